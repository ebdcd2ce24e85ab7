"""The gateway role's sleep watch in a real play (issue 33; docs/sleep.md "Gateway"): `ansible-playbook site.yml
--limit GW` onto one sandbox host that is the gateway of a gpu-profile fleet whose engine hosts are never booted.

Sleep mode is refused on the cpu profile, so no CPU sandbox fleet renders the watch. Here the spec has two GPU
hosts g1 and g2 with their GPUs written out (the plan needs no detection; the play never reaches them: the limit
leaves them out of every play), one model with a replica on each, both sleeping at level 1: its upstream has two
servers that sleep, so the gateway renders `vllm-fleet-sleepwatch.service` and /etc/nginx/vllm-fleet/sleepwatch.json.
The replicas' "engines" are stub guards started by this test on the sandbox bridge's address of this machine
(g1's and g2's address in the spec, one port each): they answer the guard's public `GET /vllm-fleet/sleep`
with the state the test sets, and any other request with their name.

Deploy (only the gateway host in the recap) → the watch active and enabled, its config and unit as `vllm-fleet
render` renders them, its file written; nginx -t passes and nginx answers (a JSON 404 for /sleep) → a stub turned
asleep is in the file and the router sends every request to the awake replica → a rerun and a --check run change
nothing → a third sleeping replica: the role's handler restarts the watch on its new config → no model sleeps:
the watch stopped, disabled, its unit and config gone (and, gateway.limits turned off in the same change, the
admission service's), nginx still serving; a rerun changes nothing.
`extended` (`make test-all`): one more host and four deploys beside CI's fleet; CI has the watch's rules
(tests/unit/test_sleepwatch.py, test_gateway_sleep_routes.py) and the watch with the real nginx on loopback
(test_gateway_sleep.py). The host is taken down when the module ends.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from ansible_fleet import BIN, REPO, WHEELHOUSE_MOUNT, Fleet, recap, what_changed, wheelhouse

from vllm_fleet.contracts import SLEEP_ASLEEP_FILE, SLEEPWATCH_CONFIG_FILE
from vllm_fleet.devtools.gateway_testing import StubEngine, chat_body, wait_for
from vllm_fleet.devtools.sandbox_net import parse_address
from vllm_fleet.devtools.testing import http_json
from vllm_fleet.fleet.admission_config import ADMISSION_UNIT_FILE
from vllm_fleet.fleet.spec import DEFAULT_CONFIG_DIR

pytestmark = [pytest.mark.sandbox, pytest.mark.slow, pytest.mark.extended]

GW = "sleepplay-gw"
MODEL = "qwen3-8b"
UNIT = "vllm-fleet-sleepwatch.service"
UNIT_FILE = f"/etc/systemd/system/{UNIT}"
# gateway.limits (on by default with keys) until the last test turns it off
ADMISSION_UNIT = Path(ADMISSION_UNIT_FILE).name
ADMISSION_FILES = (f"{DEFAULT_CONFIG_DIR}/gateway/admission.json", ADMISSION_UNIT_FILE)
# the engine hosts' SSH address in the inventory: TEST-NET-1 (RFC 5737), which nothing answers — the limit must
# keep the play off them
UNREACHABLE = "192.0.2.10"
# a replica per engine host (never booted): instance -> host
REPLICAS = {"q-a": "sleepplay-g1", "q-b": "sleepplay-g2"}
GPU = {"count": 1, "model": "NVIDIA H200", "memory_gib": 140, "compute_capability": "9.0"}
SHAPE = {
    "params_b": 8.19,
    "num_layers": 36,
    "num_kv_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 40960,
}


def gpu_host(name: str, address: str) -> dict[str, Any]:
    return {"name": name, "address": address, "gpus": dict(GPU), "memory_gib": 64}


def replica(name: str, host: str, port: int) -> dict[str, Any]:
    return {
        "name": name,
        "served_model_name": MODEL,
        "source": {"hf": {"repo": "Qwen/Qwen3-8B", "revision": "0" * 40}},
        "host": host,
        "gpus": [0],
        "port": port,
        "dtype": "bfloat16",
        "max_model_len": 8192,
        "gpu_memory_utilization": 0.85,
        "max_num_seqs": 64,
        "sleep": {"level": 1},
        "shape": dict(SHAPE),
    }


class SleepPlay:
    """The fleet of this module: the gateway host, the stub guards, the spec and the play's arguments."""

    def __init__(self, fleet: Fleet, gw: Any, bridge: str, stubs: dict[str, StubEngine], work: Path) -> None:
        self.fleet, self.gw, self.bridge, self.stubs, self.work = fleet, gw, bridge, stubs, work

    def write(self, spec: dict[str, Any]) -> None:
        """The spec (and an inventory of every host of it: the engine hosts unreachable) as the play reads them."""
        self.fleet.spec = spec
        self.fleet.spec_path.write_text(yaml.safe_dump(spec, sort_keys=False))
        inv = yaml.safe_load(self.fleet.inventory.read_text())
        hosts = {GW: inv["all"]["hosts"][GW]}
        for h in spec["hosts"]:
            if h["name"] != GW:
                hosts[h["name"]] = {"ansible_host": UNREACHABLE}
        inv["all"]["hosts"] = hosts
        self.fleet.inventory.write_text(yaml.safe_dump(inv, sort_keys=False))

    def play(self, *args: str) -> tuple[dict[str, int], str, float]:
        """`ansible-playbook site.yml --limit GW ARGS`: must pass, and name only the gateway host in its recap."""
        rc, out, seconds = self.fleet.playbook("--limit", GW, *args)
        assert rc == 0, out[-8000:]
        rec = recap(out)
        assert set(rec) == {GW}, (rec, out[-3000:])
        return rec[GW], out, seconds

    def sh(self, cmd: str) -> str:
        return str(self.gw.run(cmd, check=True).stdout)

    def unit(self) -> dict[str, str]:
        return self.unit_state(UNIT)

    def unit_state(self, name: str) -> dict[str, str]:
        out = self.sh(f"systemctl show -p ActiveState,UnitFileState,LoadState,InvocationID,MainPID {name}")
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def asleep_file(self) -> dict[str, Any] | None:
        cp = self.gw.run(["cat", SLEEP_ASLEEP_FILE])
        try:
            return dict(json.loads(cp.stdout)) if cp.returncode == 0 else None
        except ValueError:
            return None

    def until_asleep(self, asleep: list[str], waking: list[str] | None = None, timeout: float = 20) -> None:
        """Wait until the watch's file on the gateway host says exactly ``asleep`` not awake (``waking`` of them
        waking)."""

        def ok() -> bool:
            doc = self.asleep_file()
            return doc is not None and doc["asleep"] == asleep and doc["waking"] == (waking or [])

        assert wait_for(ok, timeout, 0.3), (
            self.asleep_file(),
            self.sh(f"journalctl -u {UNIT} -n 30 --no-pager"),
        )

    def rendered(self) -> Path:
        """`vllm-fleet render` of the spec as the play has it (the same template tree): the gateway host's folder."""
        out = self.work / f"render-{time.monotonic_ns()}"
        env = dict(os.environ, VLLM_FLEET_TEMPLATES=str(self.fleet.templates))
        subprocess.run(
            [str(BIN / "vllm-fleet"), "render", str(self.fleet.spec_path), "--out", str(out), "--fit-after-fetch"],
            env=env, cwd=REPO, check=True, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        return out / GW

    def host_suite(self) -> None:
        """The host verification suite (tests/host, testinfra) on the gateway host, against the spec deployed."""
        env = dict(os.environ, PATH=f"{BIN}:{os.environ['PATH']}", ANSIBLE_CONFIG=str(REPO / "ansible.cfg"))
        res = subprocess.run(
            [str(BIN / "pytest"), "tests/host", "-q", f"--hosts=ansible://{GW}",
             f"--ansible-inventory={self.fleet.inventory}", f"--fleet-spec={self.fleet.spec_path}"],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert res.returncode == 0 and " passed" in res.stdout, res.stdout[-5000:] + res.stderr[-2000:]

    def chat(self) -> tuple[int, Any]:
        return http_json("POST", f"{self.fleet.gateway_url}/v1/chat/completions", chat_body(MODEL),
                         timeout=30, headers=self.fleet.auth)  # fmt: skip

    def nginx_serves(self) -> None:
        """nginx -t passes, nginx is active, and it answers through the gateway port: /sleep (a development path)
        is its own JSON 404, never forwarded."""
        assert self.gw.run("nginx -t").returncode == 0, self.gw.run("nginx -t").stderr
        assert self.sh("systemctl is-active nginx").strip() == "active"
        seen = {n: s.hits for n, s in self.stubs.items()}
        for method in ("GET", "POST"):
            st, body = http_json(
                method, f"{self.fleet.gateway_url}/sleep", {"model": MODEL}, headers=self.fleet.auth
            )
            assert st == 404 and isinstance(body, dict) and set(body) == {"error"}, (method, st, body)
        assert {n: s.hits for n, s in self.stubs.items()} == seen, "a development path reached an engine"


@pytest.fixture(scope="module")
def sp(sandbox_factory: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SleepPlay]:
    from vllm_fleet.devtools.sandbox import write_inventory
    from vllm_fleet.fleet.lock import self_wheel

    wh = wheelhouse()
    work = tmp_path_factory.mktemp("sleepplay")
    gw = sandbox_factory(GW, apt_proxy=True, binds_ro=[(str(wh), WHEELHOUSE_MOUNT)])
    # the engine hosts' address: this machine's end of the sandbox bridge, which the gateway host reaches; each
    # replica's stub guard listens there on a port of its own
    bridge = parse_address(gw.address).gateway
    stubs = {name: StubEngine(name, host=bridge) for name in ("q-a", "q-b", "q-c")}
    for s in stubs.values():
        s.sleep_state = "awake"
    inventory, _ = write_inventory(work / "inventory", [gw])
    tree = work / "templates"
    for manifest in REPO.glob("*/artifacts.yml"):
        shutil.copytree(manifest.parent, tree / manifest.parent.name)
    extra = ["-e", f"vllm_fleet_wheelhouse={wh}", "-e", f"vllm_fleet_wheelhouse_remote={WHEELHOUSE_MOUNT}",
             "-e", f"vllm_fleet_self_wheel={self_wheel(work / 'whl')}"]  # fmt: skip
    spec: dict[str, Any] = {
        "name": "sleepplay",
        "stack": {"profile": "gpu", "vllm_version": "0.33.0"},
        "hosts": [gpu_host(h, bridge) for h in REPLICAS.values()] + [{"name": GW, "address": gw.address}],
        "models": [replica(n, h, stubs[n].port) for n, h in REPLICAS.items()],
        "gateway": {"host": GW, "port": 8000},
        "monitoring": {"enabled": False},
    }
    fleet = Fleet(work / "fleet.yml", inventory, extra, {GW: gw}, spec, f"http://{gw.address}:8000", tree, wh)
    play = SleepPlay(fleet, gw, bridge, stubs, work)
    play.write(spec)
    try:
        yield play
    finally:
        for s in stubs.values():
            s.close()


def test_deploy_limited_to_the_gateway_runs_the_watch(sp: SleepPlay) -> None:
    rec, _, seconds = sp.play()
    print(f"first deploy of the gateway host: {seconds:.0f} s, {rec}")
    unit = sp.unit()
    assert (unit["ActiveState"], unit["UnitFileState"]) == ("active", "enabled"), unit
    # its files as `vllm-fleet render` renders them (Ansible drops a template's last newline)
    rendered = sp.rendered()
    config = json.loads(sp.sh(f"cat {SLEEPWATCH_CONFIG_FILE}"))
    assert config == json.loads((rendered / SLEEPWATCH_CONFIG_FILE.lstrip("/")).read_text())
    assert [(i["instance"], i["address"], i["port"]) for i in config["instances"]] == [
        ("q-a", sp.bridge, sp.stubs["q-a"].port),
        ("q-b", sp.bridge, sp.stubs["q-b"].port),
    ], config
    assert config["output"] == SLEEP_ASLEEP_FILE
    unit_text = sp.sh(f"cat {UNIT_FILE}")
    assert unit_text.rstrip("\n") == (rendered / UNIT_FILE.lstrip("/")).read_text().rstrip("\n")
    # run as nginx's user, from the tools venv the play installed on this gateway-only host
    assert sp.sh(f"ps -o user= -p {unit['MainPID']}").strip() == "www-data"
    # its file: written at its start (every guard answers awake), in a folder nginx's workers can read
    sp.until_asleep([])
    assert sp.sh(f"stat -c '%U %a' {Path(SLEEP_ASLEEP_FILE).parent}").split() == ["www-data", "755"]
    routes = json.loads(sp.sh("cat /etc/nginx/vllm-fleet/routes.json"))
    assert json.dumps(routes).count('"sleeps": true') >= 1, routes
    sp.nginx_serves()
    sp.host_suite()


def test_the_asleep_set_follows_the_guards_and_the_router_prefers_the_awake_replica(sp: SleepPlay) -> None:
    a, b = sp.stubs["q-a"], sp.stubs["q-b"]
    a.sleep_state = "asleep"
    sp.until_asleep(["q-a"])
    before = (a.hits, b.hits)
    for _ in range(6):
        st, body = sp.chat()
        assert st == 200 and body["served_by"] == "q-b", (st, body)
    assert (a.hits, b.hits) == (before[0], before[1] + 6)
    a.sleep_state = "waking"
    sp.until_asleep(["q-a"], waking=["q-a"])
    a.sleep_state = "awake"
    sp.until_asleep([])


def test_rerun_changes_nothing(sp: SleepPlay) -> None:
    invocation = sp.unit()["InvocationID"]
    rec, out, seconds = sp.play()
    print(f"rerun: {seconds:.0f} s")
    assert rec["changed"] == 0, what_changed(out)
    assert sp.unit()["InvocationID"] == invocation, "the rerun restarted the watch"


def test_check_mode_changes_nothing(sp: SleepPlay) -> None:
    rec, out, seconds = sp.play("--check")
    print(f"--check: {seconds:.0f} s")
    assert rec["changed"] == 0, what_changed(out)


def test_a_new_sleeping_replica_restarts_the_watch_on_its_new_config(sp: SleepPlay) -> None:
    spec = json.loads(json.dumps(sp.fleet.spec))
    spec["hosts"].insert(2, gpu_host("sleepplay-g3", sp.bridge))
    spec["models"].append(replica("q-c", "sleepplay-g3", sp.stubs["q-c"].port))
    sp.write(spec)
    invocation = sp.unit()["InvocationID"]
    _, out, _ = sp.play()
    assert "RUNNING HANDLER [gateway : Restart vllm-fleet-sleepwatch]" in out, what_changed(out)
    unit = sp.unit()
    assert unit["ActiveState"] == "active" and unit["InvocationID"] != invocation, unit
    config = json.loads(sp.sh(f"cat {SLEEPWATCH_CONFIG_FILE}"))
    assert [i["instance"] for i in config["instances"]] == ["q-a", "q-b", "q-c"], config
    sp.stubs["q-c"].sleep_state = "asleep"
    sp.until_asleep(["q-c"])
    sp.stubs["q-c"].sleep_state = "awake"
    sp.until_asleep([])
    sp.nginx_serves()


def test_no_model_sleeps_stops_the_watch_and_removes_its_files(sp: SleepPlay) -> None:
    """And gateway.limits turned off in the same change: the admission service, which ran until now (keys are
    on by default), goes the same way."""
    assert sp.unit_state(ADMISSION_UNIT)["ActiveState"] == "active"
    spec = json.loads(json.dumps(sp.fleet.spec))
    for m in spec["models"]:
        del m["sleep"]
    spec["gateway"]["limits"] = {"enabled": False}
    sp.write(spec)
    sp.play()
    # what the role promises (docs/sleep.md "Gateway", docs/gateway.md "Per-key limits"): stopped and
    # disabled, and nothing of it left to start
    for unit_name, files in ((UNIT, (SLEEPWATCH_CONFIG_FILE, UNIT_FILE)), (ADMISSION_UNIT, ADMISSION_FILES)):
        unit = sp.unit_state(unit_name)
        assert unit["ActiveState"] == "inactive" and unit["UnitFileState"] in ("", "disabled"), unit
        for path in files:
            assert sp.gw.run(["test", "-e", path]).returncode == 1, f"{path} is still there"
        assert unit["LoadState"] == "not-found", unit
    # the watch removes its file when it stops; the router no longer reads it
    assert sp.asleep_file() is None
    assert '"sleeps": true' not in sp.sh("cat /etc/nginx/vllm-fleet/routes.json")
    sp.nginx_serves()
    served = {sp.chat()[1]["served_by"] for _ in range(6)}
    assert served <= {"q-a", "q-b", "q-c"} and served, served
    sp.host_suite()
    rec, out, _ = sp.play()
    assert rec["changed"] == 0, what_changed(out)
