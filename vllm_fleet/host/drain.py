"""``vllm-fleet drain NAME`` / ``undrain NAME``: take an engine instance out of / into the gateway's rotation.

Runs on the gateway host, by instance name. The drained set lives in a small runtime state file,
``/etc/vllm-fleet/gateway/drained.json`` (``{"drained": [...], "updated": T}``, gateway.state_file of the
spec), replaced atomically (temp file + rename). Nothing else changes: the rendered gateway files —
``/etc/nginx/vllm-fleet/routes.json`` (the routing table as data), upstreams.conf, router.js — stay exactly
what ``vllm-fleet render`` wrote, and nginx is not reloaded. The njs router reads the state file on every
request and overlays it on routes.json: while instances of an upstream are drained it sends the request to
that upstream's other servers, one at a time through their one-server upstreams (docs/gateway.md). New
requests stop reaching the instance at once, in-flight ones finish, and no client connection is closed (a
reload would close the clients' idle keep-alive connections). Instance names, addresses and models come from
routes.json; nothing parses nginx config. ``--wait S`` then waits until the instance reports no running
request (``vllm:num_requests_running`` on its /metrics). Exit codes: 0 done, 1 error, 3 refused (the model
would be left without any server; ``--force`` overrides).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROUTES_FILE = "/etc/nginx/vllm-fleet/routes.json"
STATE_FILE = "/etc/vllm-fleet/gateway/drained.json"


class DrainError(Exception):
    """Drain could not be done; ``code`` is the exit status."""

    def __init__(self, msg: str, code: int = 1) -> None:
        super().__init__(msg)
        self.code = code


def load_routes(path: Path) -> list[dict[str, object]]:
    """The ``routes`` of the rendered routes.json."""
    try:
        doc = json.loads(path.read_text())
    except ValueError as exc:
        raise DrainError(f"{path}: not valid JSON ({exc})") from None
    routes = doc.get("routes") if isinstance(doc, dict) else None
    if not isinstance(routes, list):
        raise DrainError(f"{path}: no routing table (not a routes.json rendered by vllm-fleet?)")
    return routes


def _servers(rt: dict[str, object]) -> list[dict[str, object]]:
    ups = rt["upstreams"]
    assert isinstance(ups, list)
    return [s for u in ups for s in u["servers"]]


def instances(routes: list[dict[str, object]]) -> dict[str, str]:
    """instance name → address."""
    return {str(s["instance"]): str(s["address"]) for rt in routes for s in _servers(rt)}


def spec_drained(routes: list[dict[str, object]]) -> set[str]:
    """Instances the spec takes out (gateway.drained: rendered ``down``)."""
    return {str(s["instance"]) for rt in routes for s in _servers(rt) if s.get("drained")}


def stranded_models(
    routes: list[dict[str, object]], drained: set[str] | frozenset[str] = frozenset()
) -> list[str]:
    """Served models with no server left that is neither drained by the spec nor in ``drained``."""
    return sorted(
        str(rt["model"])
        for rt in routes
        if not any(not s.get("drained") and s["instance"] not in drained for s in _servers(rt))
    )


def read_state(path: Path) -> set[str]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return set()
    except ValueError as exc:
        raise DrainError(f"{path}: not valid JSON ({exc})") from None
    return set(data.get("drained", [])) if isinstance(data, dict) else set()


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = path.stat().st_mode & 0o777 if path.exists() else 0o644
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def set_drained(
    name: str,
    drain: bool,
    routes_file: Path = Path(ROUTES_FILE),
    state: Path = Path(STATE_FILE),
    force: bool = False,
) -> set[str]:
    """Add (drain) or remove (undrain) instance ``name`` in the state file; returns the drained set (the
    state file's; instances of ``gateway.drained`` in the spec stay out whatever it says)."""
    routes = load_routes(routes_file)
    known = instances(routes)
    if name not in known:
        raise DrainError(
            f"unknown instance {name!r} in {routes_file} (instances: {', '.join(sorted(known))})"
        )
    drained = read_state(state) & set(known)  # names of instances no longer in the fleet are dropped
    drained = drained | {name} if drain else drained - {name}
    stranded = stranded_models(routes, drained)
    if stranded and drain and not force:
        raise DrainError(
            f"refused: draining {name} leaves model(s) {', '.join(stranded)} with no server in rotation "
            "(--force to do it anyway)",
            code=3,
        )
    doc = {"drained": sorted(drained), "updated": time.time()}
    _write_atomic(state, json.dumps(doc, indent=2) + "\n")
    return drained


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


def _common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", help="instance name (models[].name in the spec)")
    p.add_argument("--routes", help=f"rendered routing table (default {ROUTES_FILE})")
    p.add_argument(
        "--upstreams",
        help="rendered upstreams.conf: the routes.json next to it (older scripts; --routes wins)",
    )
    p.add_argument("--state", default=STATE_FILE, help=f"drained-set file (default {STATE_FILE})")
    p.add_argument("--nginx", help=argparse.SUPPRESS)  # accepted and ignored: drain runs no nginx command
    p.add_argument("--no-reload", action="store_true", help=argparse.SUPPRESS)  # ditto: it never reloads


def _routes_path(a: argparse.Namespace) -> Path:
    if a.routes:
        return Path(a.routes)
    if a.upstreams:
        return Path(a.upstreams).with_name("routes.json")
    return Path(ROUTES_FILE)


def _handler(drain: bool) -> object:
    def run(a: argparse.Namespace) -> int:
        routes = _routes_path(a)
        try:
            drained = set_drained(a.name, drain, routes, Path(a.state), getattr(a, "force", False))
            addr = instances(load_routes(routes))[a.name]
        except (DrainError, OSError) as exc:
            print(f"{'drain' if drain else 'undrain'}: {exc}", file=sys.stderr)
            return getattr(exc, "code", 1)
        print(f"drained: {', '.join(sorted(drained)) or '(none)'}")
        if drain and a.wait > 0:
            if not wait_idle(addr, a.wait):
                print(f"drain: {a.name} still has running requests after {a.wait:g}s", file=sys.stderr)
                return 1
            print(f"{a.name}: no running request")
        return 0

    return run


def add_drain_args(p: argparse.ArgumentParser) -> None:
    _common_args(p)
    p.add_argument("--force", action="store_true", help="drain even if the model keeps no server in rotation")
    p.add_argument(
        "--wait", type=float, default=0, metavar="S", help="then wait up to S s for in-flight requests"
    )
    p.set_defaults(handler=_handler(True))


def add_undrain_args(p: argparse.ArgumentParser) -> None:
    _common_args(p)
    p.set_defaults(handler=_handler(False))
