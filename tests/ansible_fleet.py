"""The Ansible end-to-end tests' fleet: sandbox hosts deployed with `ansible-playbook site.yml` (the playbook
runner, the offline wheelhouse, the sim stack that runs the sim engine behind the real unit and launcher).
Shared by tests/integration/test_ansible.py (the two-host example) and test_ha_fleet.py (three hosts, two
gateways, two monitoring hosts)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_fleet.devtools.testing import http_json

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
# the ansible-playbook (and ansible-*) these tests run: this venv's, or another one's first on PATH
# (`make e2e-newest-ansible`: the newest ansible-core release)
ANSIBLE_BIN = Path(os.environ.get("VLLM_FLEET_ANSIBLE_BIN") or BIN)
WHEELHOUSE_MOUNT = "/mnt/vf-wheelhouse"
TIMINGS = Path(os.environ.get("VLLM_FLEET_ANSIBLE_TIMINGS", "/tmp/vllm-fleet-ansible-timings.json"))
RECAP_RE = re.compile(
    r"^(\S+)\s+:\s+ok=(\d+)\s+changed=(\d+)\s+unreachable=(\d+)\s+failed=(\d+)\s+skipped=\d+\s+rescued=\d+\s+ignored=(\d+)",
    re.M,
)
EXTRA_WHEELS = "/var/tmp/vf-extra-wheels"


def retarget(spec: dict[str, Any], names: dict[str, str], addresses: dict[str, str]) -> dict[str, Any]:
    """The example spec with its host names and addresses replaced by the sandbox hosts'."""
    from vllm_fleet.devtools.sandbox_net import retarget_spec

    return retarget_spec(spec, names, addresses)


def wheelhouse() -> Path:
    """The offline wheelhouse for the cpu lock, reusing the sandbox's wheels (built once, then cached)."""
    from vllm_fleet.devtools.sandbox_image import cache_dir, ensure_wheelhouse, file_lock
    from vllm_fleet.fleet.lock import build_wheelhouse, check_wheelhouse

    dest = cache_dir() / "ansible-wheelhouse"
    lock = REPO / "locks" / "cpu-0.32.0.txt"
    with file_lock(cache_dir() / ".ansible-wheelhouse.lock"):
        stale = (
            not (dest / "lock.txt").is_file() or (dest / "lock.txt").stat().st_mtime < lock.stat().st_mtime
        )
        if stale or check_wheelhouse(dest / "lock.txt", dest):
            build_wheelhouse(lock, dest, reuse=[ensure_wheelhouse()])
    return dest


def what_changed(out: str) -> list[str]:
    """The tasks and handlers of a playbook's output that changed something (for a failed assertion's message:
    a client's dropped keep-alive connection is most often an nginx reload one of them caused)."""
    seen, task = [], ""
    for line in out.splitlines():
        if line.startswith(("TASK [", "RUNNING HANDLER [")):
            task = line.split("]", 1)[0] + "]"
        elif line.startswith("changed: ") and task and task not in seen:
            seen.append(task)
    return seen


@dataclass
class Fleet:
    spec_path: Path
    inventory: Path
    extra: list[str]
    hosts: dict[str, Any]
    spec: dict[str, Any]
    gateway_url: str
    templates: Path
    wheelhouse: Path
    # the text of the spec the last successful (not --check) run deployed: `vllm-fleet status` shows drift
    # when it differs from spec_path's
    deployed: str = ""
    # the playbook arguments that name the stack the fleet runs (its lock and where its extra wheels are): the
    # sim stack until the upgrade scenario rolls the fleet onto a real one; a scenario's own -e come later and win
    stack: list[str] = field(default_factory=list)

    def playbook(self, *args: str, spec: Path | None = None, timeout: float = 1500) -> tuple[int, str, float]:
        env = dict(os.environ, PATH=f"{ANSIBLE_BIN}:{BIN}:{os.environ['PATH']}", ANSIBLE_CONFIG=str(REPO / "ansible.cfg"),
                   ANSIBLE_NOCOLOR="1", ANSIBLE_FORCE_COLOR="0",
                   VLLM_FLEET_TEMPLATES=str(self.templates))  # fmt: skip
        cmd = [str(ANSIBLE_BIN / "ansible-playbook"), "-i", str(self.inventory), "site.yml",
               "-e", f"vllm_fleet_spec={spec or self.spec_path}", *self.extra, *self.stack, *args]  # fmt: skip
        t = time.monotonic()
        res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        if res.returncode == 0 and "--check" not in args:
            self.deployed = (spec or self.spec_path).read_text()
        return res.returncode, res.stdout + res.stderr, time.monotonic() - t

    def unit_pids(self) -> dict[str, str]:
        out = {}
        for m in self.spec["models"]:
            h = self.hosts[m["host"]]
            out[m["name"]] = h.run(
                f"systemctl show -p MainPID --value vllm@{m['name']}.service"
            ).stdout.strip()
        return out

    @property
    def api_key(self) -> str:
        """The gateway key the role generated on the controller (no vaulted list given)."""
        return (self.inventory.parent / "vllm-fleet-secrets" / "gateway-api-key").read_text().split()[0]

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def chat(self, headers: dict[str, str] | None = None) -> tuple[int, Any]:
        body = {"model": "tiny-qwen3", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}
        return http_json("POST", f"{self.gateway_url}/v1/chat/completions", body, timeout=60,
                         headers=self.auth if headers is None else headers)  # fmt: skip


def recap(output: str) -> dict[str, dict[str, int]]:
    keys = ("ok", "changed", "unreachable", "failed", "ignored")
    return {
        m.group(1): dict(zip(keys, map(int, m.groups()[1:]), strict=True)) for m in RECAP_RE.finditer(output)
    }


def record(key: str, seconds: float) -> None:
    data = json.loads(TIMINGS.read_text()) if TIMINGS.is_file() else {}
    data[key] = round(seconds, 1)
    TIMINGS.write_text(json.dumps(data, indent=2) + "\n")


# a test stack's hook (a .pth imports it in every process of the venv): `python -m
# vllm_fleet.host.vllm_cpu_entry serve ...` (the instances' engine command) runs the sim engine with the same
# arguments, so the unit, the launcher, Ansible's restarts and the gateway drive an engine that loads in no
# time (tests/integration/test_engine_contract.py keeps it honest against vLLM). Nothing else changes: vLLM and
# torch still import (the doctor's layers check them), and any other command runs as it would
SIM_HOOK = """import importlib.util
import sys

ENTRY = "vllm_fleet.host.vllm_cpu_entry"


class _SimEngine:
    def find_spec(self, name, path=None, target=None):
        if name != ENTRY or sys.argv[:1] != ["-m"]:  # only `python -m ENTRY`, while runpy locates it
            return None
        sim = importlib.util.find_spec("vllm_fleet.devtools.sim_engine")
        return importlib.util.spec_from_file_location(ENTRY, sim.origin)


sys.meta_path.insert(0, _SimEngine())
"""
SIM_STACK = {"vf_stack_sim.py": SIM_HOOK, "vf_stack_sim.pth": "import vf_stack_sim\n"}


def make_wheel(dest: Path, name: str, version: str, files: dict[str, str]) -> Path:
    """A pure-Python wheel of ``files`` (path in site-packages -> text), with a valid RECORD."""
    import base64
    import hashlib
    import zipfile

    dist = name.replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    files = dict(files)
    files[f"{info}/METADATA"] = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    files[f"{info}/WHEEL"] = (
        "Wheel-Version: 1.0\nGenerator: vllm-fleet-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    )
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    record.append(f"{info}/RECORD,,")
    files[f"{info}/RECORD"] = "\n".join(record) + "\n"
    whl = dest / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        for path, text in files.items():
            # a fixed date: the same files make the same wheel, so the same lock and the same stack id (with
            # the time of the call each call made a new stack, and a deploy meant as "nothing new" upgraded)
            entry = zipfile.ZipInfo(path, date_time=(2026, 1, 1, 0, 0, 0))
            entry.external_attr = 0o644 << 16
            z.writestr(entry, text)
    return whl


def stack_with(fleet: Fleet, tmp_path: Path, name: str, files: dict[str, str]) -> tuple[Path, list[str]]:
    """A new stack: the fleet's lock plus one pinned package (its wheel offered to the hosts next to the
    read-only wheelhouse). Returns the lock and the playbook arguments that deploy it."""
    import hashlib

    whl = make_wheel(tmp_path, name, "1.0", files)
    for h in fleet.hosts.values():
        h.copy_to(whl, f"{EXTRA_WHEELS}/{whl.name}", mode=0o644)
    sha = hashlib.sha256(whl.read_bytes()).hexdigest()
    lock = tmp_path / f"lock-{name}.txt"
    lock.write_text(
        (fleet.wheelhouse / "lock.txt").read_text() + f"{name}==1.0 \\\n    --hash=sha256:{sha}\n"
    )
    args = ["-e", f"vllm_fleet_install_lock={lock}",
            "-e", json.dumps({"vllm_fleet_pip_extra_args": ["--find-links", EXTRA_WHEELS]})]  # fmt: skip
    return lock, args


PROM_QUERIES = r"""
import base64, json, sys, urllib.parse, urllib.request as u
base, queries = sys.argv[1], json.loads(sys.argv[2])
pw = open('/etc/prometheus/vllm-fleet-web.password').read().strip()
auth = 'Basic ' + base64.b64encode(('vllm-fleet:' + pw).encode()).decode()
out = {}
for q in queries:
    req = u.Request(base + '/api/v1/query?' + urllib.parse.urlencode({'query': q}), headers={'Authorization': auth})
    doc = json.loads(u.urlopen(req, timeout=20).read())
    out[q] = doc['data']['result'] if doc['status'] == 'success' else doc
print(json.dumps(out))
"""


def prometheus(fleet: Fleet, queries: list[str], host: str | None = None) -> dict[str, Any]:
    """Instant queries against the fleet's Prometheus, run on the monitoring host (``host``: that monitoring
    host's, a sandbox name)."""
    mon = fleet.hosts[host or fleet.spec["monitoring"]["host"]]
    base = f"http://{mon.address}:9090"
    cp = mon.run(["python3", "-c", PROM_QUERIES, base, json.dumps(queries)], check=True, timeout=120)
    return dict(json.loads(cp.stdout))
