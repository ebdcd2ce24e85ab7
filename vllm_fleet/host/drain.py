"""``vllm-fleet drain NAME`` / ``undrain NAME``: take an engine instance out of / into the gateway's rotation.

Runs on the gateway host. The drained set lives in ``/etc/vllm-fleet/gateway/drained.json``
(``{"drained": [...], "down": [...]}``). The gateway's njs router reads that file on every request and, while
one instance of an upstream is drained, sends the request to the rendered copy of that upstream without it
(``NAME__x__INSTANCE``, see vllm_fleet/fleet/routes.py) — so a drain or undrain changes no nginx configuration and needs
no reload: new requests stop reaching the instance at once, in-flight ones finish, and no client connection is
closed (a reload closes the clients' idle keep-alive connections; a client that was just reusing one gets an
error). Only when an upstream would lose two or more instances, or one it has no copy without (a one-server or
the fallback upstream), does drain set nginx's ``down`` flag on those servers in the rendered upstream file
(/etc/nginx/vllm-fleet/upstreams.conf, one line per server ending in ``# vf-instance=NAME``), check it with
``nginx -t`` (restoring the old file if that fails) and reload nginx gracefully; ``down`` in the state file lists
the instances so marked, and the Ansible role renders the same marks (so a re-render keeps them;
``vllm-fleet drain --apply`` re-applies them to a freshly copied file). ``--wait S`` then waits until the
instance reports no running request (``vllm:num_requests_running`` on its /metrics). Exit codes: 0 done,
1 error, 3 refused (the model would be left without any server; ``--force`` overrides).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from vllm_fleet.cli import command

UPSTREAMS_FILE = "/etc/nginx/vllm-fleet/upstreams.conf"
STATE_FILE = "/etc/vllm-fleet/gateway/drained.json"

SERVER_RE = re.compile(
    r"^(?P<head>\s*server\s+(?P<addr>\S+))(?P<params>[^;#]*);(?P<tail>.*#\s*vf-instance=(?P<inst>\S+).*)$"
)
UPSTREAM_RE = re.compile(
    r"^\s*upstream\s+(?P<name>\S+)\s*\{(?:\s*#\s*vf-variant-of=(?P<of>\S+)\s+excludes=(?P<excl>\S+))?"
)
MODEL_RE = re.compile(r"^#\s*model\s+(?P<model>.+?)\s*$")


class DrainError(Exception):
    """Drain could not be done; ``code`` is the exit status."""

    def __init__(self, msg: str, code: int = 1) -> None:
        super().__init__(msg)
        self.code = code


@dataclass
class Upstream:
    name: str
    model: str
    # (instance, address, is_down) per server line
    servers: list[tuple[str, str, bool]] = field(default_factory=list)
    # a copy of upstream ``variant_of`` without instance ``excludes`` (the router's choice while it is drained)
    variant_of: str = ""
    excludes: str = ""
    # instances drained by the fleet spec (gateway.drained): always ``down``
    spec_drained: set[str] = field(default_factory=set)


def apply_drained(text: str, drained: set[str]) -> str:
    """Return the upstream file text with ``down`` set exactly on the servers of the drained instances."""
    out = []
    for line in text.splitlines(keepends=True):
        m = SERVER_RE.match(line.rstrip("\n"))
        if m:
            params = [p for p in m["params"].split() if p != "down"]
            if m["inst"] in drained:
                params.append("down")
            nl = "\n" if line.endswith("\n") else ""
            line = f"{m['head']}{''.join(' ' + p for p in params)};{m['tail']}{nl}"
        out.append(line)
    return "".join(out)


def parse_upstreams(text: str) -> list[Upstream]:
    """The upstreams that routing state is about; each one's spill-over twin (``# vf-spill-of=``, the same
    servers with max_fails=0) is left out: it is rendered from the same lines and carries the same marks."""
    ups: list[Upstream] = []
    model = ""
    twin = False
    for line in text.splitlines():
        if mm := MODEL_RE.match(line):
            model = mm["model"]
        elif um := UPSTREAM_RE.match(line):
            twin = "vf-spill-of=" in line
            if not twin:
                ups.append(Upstream(um["name"], model, variant_of=um["of"] or "", excludes=um["excl"] or ""))
        elif twin:
            continue
        elif (sm := SERVER_RE.match(line)) and ups:
            ups[-1].servers.append((sm["inst"], sm["addr"], "down" in sm["params"].split()))
            if "spec-drained" in sm["tail"].split():
                ups[-1].spec_drained.add(sm["inst"])
    return ups


def needs_marks(text: str, drained: set[str]) -> bool:
    """True when the router cannot keep every drained instance out by picking an upstream copy: an upstream
    loses two or more instances, or one that it has no copy without (then ``down`` marks and a reload do it)."""
    ups = parse_upstreams(text)
    copies = {(u.variant_of, u.excludes) for u in ups if u.variant_of}
    for u in ups:
        if u.variant_of:
            continue
        out = {i for i, _, _ in u.servers} & (drained - u.spec_drained)
        if len(out) > 1 or (len(out) == 1 and (u.name, next(iter(out))) not in copies):
            return True
    return False


def instances(text: str) -> dict[str, str]:
    """instance name → address, from the upstream file."""
    return {inst: addr for up in parse_upstreams(text) for inst, addr, _ in up.servers}


def stranded_models(text: str, drained: set[str] | frozenset[str] = frozenset()) -> list[str]:
    """Served models with no server left that is neither ``down`` nor in ``drained`` (in any upstream)."""
    live: dict[str, bool] = {}
    for up in parse_upstreams(text):
        if not up.variant_of:
            ok = any(not down and i not in drained for i, _, down in up.servers)
            live[up.model] = live.get(up.model, False) or ok
    return sorted(m for m, ok in live.items() if not ok)


def read_state(path: Path) -> set[str]:
    return set(_state(path).get("drained", []))


def _state(path: Path) -> dict[str, list[str]]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except ValueError as exc:
        raise DrainError(f"{path}: not valid JSON ({exc})") from None
    return data if isinstance(data, dict) else {}


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = path.stat().st_mode & 0o777 if path.exists() else 0o644
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def _run(argv: list[str]) -> None:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        raise DrainError(f"{shlex.join(argv)} failed ({r.returncode}): {(r.stderr or r.stdout).strip()}")


def set_drained(
    name: str | None,
    drain: bool,
    upstreams: Path = Path(UPSTREAMS_FILE),
    state: Path = Path(STATE_FILE),
    nginx: list[str] | None = None,
    force: bool = False,
    reload: bool = True,
) -> set[str]:
    """Add (drain) or remove (undrain) ``name`` — None: re-apply the state file — write the state file and,
    only where the router cannot do it alone (``needs_marks``), the ``down`` marks + nginx -t + reload.
    Returns the drained set."""
    nginx = nginx or ["nginx"]
    old = upstreams.read_text()
    known = instances(old)
    ups = parse_upstreams(old)
    spec_drained = {i for up in ups for i in up.spec_drained}
    # marks from an older drain (before the state file listed them) count as drained too
    legacy = {i for up in ups for i, _, d in up.servers if d} if "down" not in _state(state) else set()
    drained = (read_state(state) | spec_drained | legacy) & set(known)
    if name is not None:
        if name not in known:
            raise DrainError(
                f"unknown instance {name!r} in {upstreams} (instances: {', '.join(sorted(known))})"
            )
        drained = drained | {name} if drain else drained - {name}
    stranded = stranded_models(old, drained)
    if stranded and drain and not force:
        raise DrainError(
            f"refused: draining {name} leaves model(s) {', '.join(stranded)} with no server in rotation "
            "(--force to do it anyway)",
            code=3,
        )
    marks = drained if needs_marks(old, drained) else spec_drained & drained
    new = apply_drained(old, marks)
    if new != old:
        _write_atomic(upstreams, new)
        try:
            _run([*nginx, "-t", "-q"])
        except DrainError:
            _write_atomic(upstreams, old)
            raise
    doc = {"drained": sorted(drained), "down": sorted(marks - spec_drained), "updated": time.time()}
    _write_atomic(state, json.dumps(doc, indent=2) + "\n")
    if reload and new != old:
        before = _workers(nginx)
        _run(reload_command(nginx))
        _wait_new_workers(nginx, before)
    return drained


def _proc_cmdline(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _workers(nginx: list[str]) -> set[str]:
    """PIDs of the accepting worker processes of the nginx that ``nginx`` (its -c, if given) runs."""
    conf = nginx[nginx.index("-c") + 1] if "-c" in nginx[:-1] else ""
    masters = set()
    procs: dict[str, tuple[str, str]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        cmd = _proc_cmdline(d.name)
        if not cmd.startswith("nginx: "):
            continue
        try:
            ppid = (d / "stat").read_text().rsplit(")", 1)[1].split()[1]
        except (OSError, IndexError):
            continue
        procs[d.name] = (ppid, cmd)
        if cmd.startswith("nginx: master process") and (not conf or conf in cmd):
            masters.add(d.name)
    return {
        pid
        for pid, (ppid, cmd) in procs.items()
        if ppid in masters and cmd == "nginx: worker process"  # not "… is shutting down"
    }


def _wait_new_workers(nginx: list[str], before: set[str], timeout: float = 10.0) -> None:
    """A reload is asynchronous: return once the new workers run (the old ones then stop accepting), so the
    next request is routed by the new configuration."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        now = _workers(nginx)
        if now and not now <= before:
            time.sleep(0.1)
            return
        time.sleep(0.05)


def reload_command(nginx: list[str]) -> list[str]:
    """How to reload gracefully: through systemd when it manages the default nginx (its ExecReload keeps
    the unit's view of the master consistent), else ``NGINX -s reload``."""
    if nginx == ["nginx"] and shutil.which("systemctl"):
        r = subprocess.run(
            ["systemctl", "is-active", "--quiet", "nginx.service"],
            check=False,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        if r.returncode == 0:
            return ["systemctl", "reload", "nginx.service"]
    return [*nginx, "-s", "reload"]


def running_requests(address: str, timeout: float = 3) -> float:
    """Sum of ``vllm:num_requests_running`` on the engine at ``address`` (host:port)."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=timeout) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith("vllm:num_requests_running"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def wait_idle(address: str, timeout: float, interval: float = 0.5) -> bool:
    """Wait until the engine has no running request (or is unreachable). False on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if running_requests(address) == 0:
                return True
        except OSError:
            return True  # not answering: nothing running that we could wait for
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


def _args(p: argparse.ArgumentParser, drain: bool) -> None:
    p.add_argument("name", nargs="?" if drain else None, help="instance name (models[].name in the spec)")
    p.add_argument(
        "--upstreams", default=UPSTREAMS_FILE, help=f"rendered upstream file (default {UPSTREAMS_FILE})"
    )
    p.add_argument("--state", default=STATE_FILE, help=f"drained-set file (default {STATE_FILE})")
    p.add_argument(
        "--nginx",
        default="nginx",
        help='nginx command, e.g. "nginx -p PREFIX -c CONF" (used with -t and -s reload)',
    )
    p.add_argument("--no-reload", action="store_true", help="edit and check only")
    if drain:
        p.add_argument(
            "--force", action="store_true", help="drain even if the model keeps no server in rotation"
        )
        p.add_argument(
            "--wait", type=float, default=0, metavar="S", help="then wait up to S s for in-flight requests"
        )
        p.add_argument(
            "--apply", action="store_true", help="no NAME: re-apply the state file to the upstream file"
        )


def _handler(drain: bool) -> object:
    def run(a: argparse.Namespace) -> int:
        if drain and a.name is None and not a.apply:
            print("drain: give an instance NAME (or --apply)", file=sys.stderr)
            return 1
        ups = Path(a.upstreams)
        try:
            drained = set_drained(
                a.name,
                drain,
                ups,
                Path(a.state),
                shlex.split(a.nginx),
                getattr(a, "force", False),
                not a.no_reload,
            )
        except (DrainError, OSError) as exc:
            print(f"{'drain' if drain else 'undrain'}: {exc}", file=sys.stderr)
            return getattr(exc, "code", 1)
        print(f"drained: {', '.join(sorted(drained)) or '(none)'}")
        if drain and a.name and a.wait > 0:
            addr = instances(ups.read_text())[a.name]
            if not wait_idle(addr, a.wait):
                print(f"drain: {a.name} still has running requests after {a.wait:g}s", file=sys.stderr)
                return 1
            print(f"{a.name}: no running request")
        return 0

    return run


@command("drain", "take an engine instance out of the gateway's rotation (no nginx reload needed)")
def _drain_cmd(p: argparse.ArgumentParser) -> None:
    _args(p, True)
    p.set_defaults(handler=_handler(True))


@command("undrain", "put a drained engine instance back into the gateway's rotation")
def _undrain_cmd(p: argparse.ArgumentParser) -> None:
    _args(p, False)
    p.set_defaults(handler=_handler(False))
