"""Canary rollouts (issue 29), end to end: two sandbox hosts deployed with `ansible-playbook site.yml` from
examples/tiny-cpu-canary.yml as written, only retargeted (h1: gateway, monitoring, tiny-a; h2: tiny-b and the
canary's files). The instances run the sim stack (tests/ansible_fleet.py): what is tested is the rollout —
the play, the gateways' split, the judging on Prometheus, the promotion through the drain path, the dead-man
rule — not the engine.

Deploy → the canary is deployed, not running, in no rotation → a change is held (the running instances keep
their config and process) → a good canary under steady cache-aware traffic is promoted (0 failed requests) → a
bad one (max_num_seqs 1 at a rate that makes it queue) is rolled back before its window ends, the stable
instances untouched (0 failed) → a controller killed mid-rollout: the gateways stop sending the canary traffic
and its host stops it within the lease (0 failed) → a canary that cannot start never takes a request → the
hosts are torn down with the module. `extended` (`make test-all`).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from ansible_fleet import (
    ANSIBLE_BIN,
    BIN,
    REPO,
    SIM_HOOK,
    SIM_STACK,
    WHEELHOUSE_MOUNT,
    Fleet,
    prometheus,
    stack_with,
    wheelhouse,
)

from vllm_fleet.devtools.failover import FailoverLoad
from vllm_fleet.devtools.gateway_testing import wait_for

pytestmark = [pytest.mark.sandbox, pytest.mark.slow, pytest.mark.extended]

MODEL = "tiny-qwen3"
CANARY = "tiny-canary"
STABLE = ("tiny-a", "tiny-b")
VF = "/opt/vllm-fleet/venv/bin/vllm-fleet"


def host(fleet: Fleet, n: str) -> Any:
    return fleet.hosts[fleet.names[n]]  # type: ignore[attr-defined]


def where(fleet: Fleet, name: str) -> Any:
    m = next(m for m in fleet.spec["models"] if m["name"] == name)
    return fleet.hosts[m["host"]]


def config(fleet: Fleet, name: str) -> dict[str, Any]:
    h = host(fleet, "h2") if name == CANARY else where(fleet, name)
    return dict(json.loads(h.run(f"cat /etc/vllm-fleet/instances/{name}.json").stdout))


def arg(cfg: dict[str, Any], flag: str) -> str:
    cmd = cfg["command"]
    return str(cmd[cmd.index(flag) + 1])


def pids(fleet: Fleet) -> dict[str, str]:
    return {
        n: where(fleet, n).run(f"systemctl show -P MainPID vllm@{n}.service").stdout.strip() for n in STABLE
    }


def canary_active(fleet: Fleet) -> str:
    return str(
        host(fleet, "h2").run(f"systemctl is-active vllm@{CANARY}.service", check=False).stdout.strip()
    )


def gateway_state(fleet: Fleet) -> dict[str, Any]:
    out = host(fleet, "h1").run("cat /etc/vllm-fleet/gateway/drained.json 2>/dev/null || echo '{}'").stdout
    return dict(json.loads(out))


def access_tracks(fleet: Fleet, since: int) -> list[str]:
    """The ``track`` of every gateway access-log line after line ``since``."""
    lines = host(fleet, "h1").run(f"tail -n +{since + 1} /var/log/nginx/vllm-fleet.access.log").stdout
    return [str(json.loads(x).get("track", "-")) for x in lines.splitlines() if x.strip()]


def log_lines(fleet: Fleet) -> int:
    return int(host(fleet, "h1").run("wc -l < /var/log/nginx/vllm-fleet.access.log").stdout)


def write_spec(fleet: Fleet, change: dict[str, Any], name: str) -> Path:
    """The fleet's spec with ``change`` applied to every stable instance of the model (a new version)."""
    spec = json.loads(json.dumps(fleet.spec))
    for m in spec["models"]:
        if m["name"] in STABLE:
            m.update(change)
    path = fleet.spec_path.with_name(f"{name}.yml")
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def rollout_cmd(fleet: Fleet, spec: Path, report: Path) -> tuple[list[str], dict[str, str]]:
    env = dict(os.environ, PATH=f"{ANSIBLE_BIN}:{BIN}:{os.environ['PATH']}", ANSIBLE_CONFIG=str(REPO / "ansible.cfg"),
               ANSIBLE_NOCOLOR="1", VLLM_FLEET_TEMPLATES=str(fleet.templates),
               VLLM_FLEET_ANSIBLE_BIN=str(ANSIBLE_BIN))  # fmt: skip
    cmd = [str(BIN / "vllm-fleet"), "rollout", str(spec), MODEL, "-i", str(fleet.inventory),
           "--report", str(report)]  # fmt: skip
    for a in [*fleet.extra, *fleet.stack]:
        cmd.append(f"--ansible-arg={a}")
    return cmd, env


def rollout(fleet: Fleet, spec: Path, report: Path, timeout: float = 900) -> tuple[int, str, float]:
    cmd, env = rollout_cmd(fleet, spec, report)
    t = time.monotonic()
    cp = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    return cp.returncode, cp.stdout + cp.stderr, time.monotonic() - t


def hit_rate(fleet: Fleet, window: str) -> float | None:
    q = (f"sum(increase(vllm:prefix_cache_hits_total[{window}])) / "
         f"sum(increase(vllm:prefix_cache_queries_total[{window}]))")  # fmt: skip
    res = prometheus(fleet, [q], host=fleet.names["h1"])[q]  # type: ignore[attr-defined]
    return float(res[0]["value"][1]) if res else None


def traffic(fleet: Fleet) -> FailoverLoad:
    # 6 lanes, 32 distinct system prompts (prefix keys): the canary's share is a quarter of the keys
    return FailoverLoad(fleet.gateway_url, MODEL, api_key=fleet.api_key, lanes=6, prefixes=32, pause=0.1,
                        read_timeout=30, timeout=60, connect_timeout=5)  # fmt: skip


def failed(load: FailoverLoad) -> list[Any]:
    return [r for r in load.records if r.outcome != "ok"]


@pytest.fixture(scope="module")
def fleet(
    sandbox_factory: Any, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Fleet]:
    from vllm_fleet.devtools.sandbox import down, write_inventory
    from vllm_fleet.devtools.sandbox_net import retarget_spec
    from vllm_fleet.fleet.lock import self_wheel

    wh = wheelhouse()
    work = tmp_path_factory.mktemp("rollout")
    names = {n: f"ro-{n}" for n in ("h1", "h2")}
    hosts = {
        names[n]: sandbox_factory(
            names[n], engine=True, apt_proxy=True, binds_ro=[(str(wh), WHEELHOUSE_MOUNT)]
        )
        for n in names
    }
    example = yaml.safe_load((REPO / "examples" / "tiny-cpu-canary.yml").read_text())
    spec = retarget_spec(example, names, {n: hosts[names[n]].address for n in names})
    spec_path = work / "fleet.yml"
    spec_path.write_text(yaml.safe_dump(spec, sort_keys=False))
    models = work / "models"
    models.mkdir()
    shutil.copytree(tiny_model, models / "tiny")
    inventory, _ = write_inventory(work / "inventory", list(hosts.values()))
    extra = ["-e", f"vllm_fleet_models_src={models}", "-e", f"vllm_fleet_wheelhouse={wh}",
             "-e", f"vllm_fleet_wheelhouse_remote={WHEELHOUSE_MOUNT}",
             "-e", f"vllm_fleet_self_wheel={self_wheel(work / 'whl')}"]  # fmt: skip
    tree = work / "templates"
    for manifest in REPO.glob("*/artifacts.yml"):
        shutil.copytree(manifest.parent, tree / manifest.parent.name)
    gw = hosts[names["h1"]].address
    fleet = Fleet(
        spec_path, inventory, extra, hosts, spec, f"http://{gw}:{spec['gateway']['port']}", tree, wh
    )
    fleet.names = names  # type: ignore[attr-defined]
    fleet.work = work  # type: ignore[attr-defined]
    _, fleet.stack = stack_with(fleet, work, "vf-stack-sim", SIM_STACK)
    fleet.stack += ["-e", "vllm_fleet_doctor_load=false"]
    try:
        yield fleet
    finally:
        for name in hosts:
            down(name)


def test_deploy_leaves_the_canary_deployed_stopped_and_out_of_rotation(fleet: Fleet) -> None:
    rc, out, seconds = fleet.playbook()
    assert rc == 0, out[-6000:]
    print(f"deploy: {seconds:.0f} s")
    code, body = fleet.chat()
    assert code == 200 and body["choices"], body
    h2 = host(fleet, "h2")
    assert canary_active(fleet) == "inactive"
    assert h2.run(f"systemctl is-enabled vllm@{CANARY}.service", check=False).stdout.strip() != "enabled"
    assert f"vllm@{CANARY}" not in h2.run("systemctl show -P Wants vllm-fleet.target").stdout
    assert config(fleet, CANARY)["port"] == 8111
    assert not gateway_state(fleet).get("canary")


def venv(cfg: dict[str, Any]) -> str:
    return str(Path(cfg["command"][0]).parent.parent)


def test_a_change_is_held_for_the_rollout(fleet: Fleet) -> None:
    """A new version — a new engine stack (its own lock: a venv of its own) and a new flag: site.yml installs the
    stack and deploys both to the canary's files only; tiny-a and tiny-b keep their config, their venv and their
    process."""
    before = pids(fleet)
    old = {n: venv(config(fleet, n)) for n in STABLE}
    # the sim hook under file names of its own: the new venv starts as a copy of the old one, and pip's removal of
    # vf-stack-sim (not in the new lock) would take files of the same names with it (a real engine would start)
    sim2 = {"vf_stack_sim2.py": SIM_HOOK, "vf_stack_sim2.pth": "import vf_stack_sim2\n"}
    _, fleet.stack = stack_with(fleet, fleet.work, "vf-stack-sim2", sim2)  # type: ignore[attr-defined]
    fleet.stack += ["-e", "vllm_fleet_doctor_load=false"]
    spec = write_spec(fleet, {"shutdown_timeout": 12}, "good")
    rc, out, _ = fleet.playbook(spec=spec)
    assert rc == 0, out[-6000:]
    canary = config(fleet, CANARY)
    assert arg(canary, "--shutdown-timeout") == "12"
    assert venv(canary) not in old.values(), (venv(canary), old)
    for n in STABLE:
        assert arg(config(fleet, n), "--shutdown-timeout") == "10", n
        assert venv(config(fleet, n)) == old[n], n
    assert pids(fleet) == before
    assert canary_active(fleet) == "inactive"


def test_a_good_canary_is_promoted_without_a_failed_request(fleet: Fleet) -> None:
    spec = fleet.spec_path.with_name("good.yml")
    seen = log_lines(fleet)
    before = hit_rate(fleet, "5m")
    with traffic(fleet) as load:
        # some traffic before the canary (the hit rate's "before")
        assert wait_for(lambda: len(load.records) >= 60, timeout=120)
        rc, out, took = rollout(fleet, spec, fleet.work / "good.json")  # type: ignore[attr-defined]
    assert rc == 0, out[-6000:]
    print(out[-3000:])
    report = json.loads((fleet.work / "good.json").read_text())  # type: ignore[attr-defined]
    assert report["outcome"] == "promoted", report
    tracks = access_tracks(fleet, seen)
    assert tracks.count("canary") >= 20, (tracks.count("canary"), len(tracks))
    assert failed(load) == [], failed(load)[:5]
    canary_venv = venv(config(fleet, CANARY))
    for n in STABLE:  # promoted: the stable instances run the new version (its stack and its flag)
        assert arg(config(fleet, n), "--shutdown-timeout") == "12", n
        assert venv(config(fleet, n)) == canary_venv, n
    assert canary_active(fleet) == "inactive"
    assert not gateway_state(fleet).get("canary")
    print(
        f"good canary promoted in {took:.0f} s; {len(load.records)} requests, 0 failed, "
        f"{tracks.count('canary')} through the canary; hit rate before {before}, during {hit_rate(fleet, '3m')}"
    )


def test_a_bad_canary_is_rolled_back_before_its_window_ends(fleet: Fleet) -> None:
    """max_num_seqs 1 (and so a queue bound of 2) on the canary while 6 lanes send it a quarter of the
    traffic: it queues and turns requests away; the gateways fail those over to the stable instances."""
    spec = write_spec(fleet, {"shutdown_timeout": 12, "max_num_seqs": 1}, "bad")
    gateway_files = "/etc/nginx/vllm-fleet/routes.json /etc/vllm-fleet/gateway/admission.json"
    h1 = host(fleet, "h1")
    gw_before = h1.run(f"cat {gateway_files}").stdout
    rc, out, _ = fleet.playbook(spec=spec)
    assert rc == 0, out[-6000:]
    # the held instances are planned as they run: the gateway's cache-aware bounds and admission capacity
    # still follow max_num_seqs 16 (before, they took the spec's 1 at once: 4 requests of the model admitted)
    assert h1.run(f"cat {gateway_files}").stdout == gw_before
    before = pids(fleet)
    window = fleet.spec["rollouts"][0]["window_seconds"]
    with traffic(fleet) as load:
        assert wait_for(lambda: len(load.records) >= 20, timeout=120)
        rc, out, took = rollout(fleet, spec, fleet.work / "bad.json")  # type: ignore[attr-defined]
    assert rc == 1, out[-6000:]
    report = json.loads((fleet.work / "bad.json").read_text())  # type: ignore[attr-defined]
    assert report["outcome"] == "rolled_back", report
    observed = [s for s in report["steps"] if s["step"] == "observe"]
    assert observed and observed[-1]["at"] - observed[0]["at"] < window, observed
    print(report["verdict"]["report"])
    assert report["verdict"]["action"] == "rollback"
    assert failed(load) == [], failed(load)[:5]
    assert pids(fleet) == before
    for n in STABLE:
        assert arg(config(fleet, n), "--max-num-seqs") != "1", n
    assert canary_active(fleet) == "inactive"
    print(f"bad canary rolled back {took:.0f} s after the start; {len(load.records)} requests, 0 failed")


def test_a_killed_controller_leaves_no_canary_behind(fleet: Fleet) -> None:
    """SIGKILL to `vllm-fleet rollout` while the canary takes traffic: within the lease the gateway sends it
    nothing and its host stops it."""
    spec = fleet.spec_path.with_name("bad.yml")
    lease = fleet.spec["rollouts"][0]["lease_seconds"]
    cmd, env = rollout_cmd(fleet, spec, fleet.work / "killed.json")  # type: ignore[attr-defined]
    with traffic(fleet) as load:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            assert wait_for(lambda: bool(gateway_state(fleet).get("canary")), timeout=300, interval=1)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        killed = time.monotonic()
        assert wait_for(lambda: canary_active(fleet) == "inactive", timeout=lease + 60, interval=1)
        stopped = time.monotonic() - killed
        seen, n = log_lines(fleet), len(load.records)
        # 30 more requests after the canary stopped: none of them reaches it
        assert wait_for(lambda: len(load.records) >= n + 30, timeout=120)
    tracks = access_tracks(fleet, seen)
    assert "canary" not in tracks and len(tracks) > 5, tracks
    assert failed(load) == [], failed(load)[:5]
    print(f"controller killed: canary stopped by its host {stopped:.0f} s later (lease {lease} s), 0 failed")


def test_a_canary_that_cannot_start_never_takes_a_request(fleet: Fleet) -> None:
    h2 = host(fleet, "h2")
    before = pids(fleet)
    seen = log_lines(fleet)
    addr = config(fleet, CANARY)["listen_address"]
    # its port taken by another process on its host
    h2.run(f"systemd-run --unit vf-squatter python3 -m http.server 8111 --bind {addr}")
    try:
        assert wait_for(lambda: h2.run("ss -ltn 'sport = :8111'").stdout.count("LISTEN") == 1, timeout=30)
        rc, out, _ = rollout(fleet, fleet.spec_path.with_name("bad.yml"), fleet.work / "nostart.json")  # type: ignore[attr-defined]
    finally:
        h2.run("systemctl stop vf-squatter", check=False)
    assert rc == 3, out[-4000:]
    assert "never entered rotation" in out
    assert "canary" not in access_tracks(fleet, seen)
    assert pids(fleet) == before
    assert canary_active(fleet) in ("inactive", "failed")
