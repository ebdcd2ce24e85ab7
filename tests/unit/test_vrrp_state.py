"""Which gateway holds the virtual address (issue 30, docs/design/ha.md): keepalived's notify writes its VRRP state
(vllm_fleet/host/vrrp_notify.py), the host exporter turns it into vllm_fleet_gateway_vrrp_master / _state, and a
real keepalived runs the rendered notify line (in a network namespace of its own, where this machine allows)."""

from __future__ import annotations

import copy
import json
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from vllm_fleet.contracts import VRRP_STATE_FILE, read_vrrp_state
from vllm_fleet.fleet import ha
from vllm_fleet.fleet.observability import VRRP_METRICS
from vllm_fleet.fleet.render import render_host
from vllm_fleet.fleet.spec import FleetSpec, parse_spec
from vllm_fleet.host import vrrp_notify
from vllm_fleet.host.exporter import FleetCollector, VrrpState, read_vrrp

REPO = Path(__file__).resolve().parents[2]
EXAMPLE: dict[str, Any] = yaml.safe_load((REPO / "examples/tiny-cpu-ha.yml").read_text())
STATES = ("MASTER", "BACKUP", "FAULT", "STOP", "UNKNOWN")


def ha_spec(**vrrp: Any) -> FleetSpec:
    d = copy.deepcopy(EXAMPLE)
    d["gateway"]["vrrp"] = vrrp
    return parse_spec(d)


def scrape(collector: Any) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    reg = CollectorRegistry()
    reg.register(collector)
    out = {}
    for fam in text_string_to_metric_families(generate_latest(reg).decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def vrrp_series(m: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> tuple[float, dict[str, float]]:
    """(vllm_fleet_gateway_vrrp_master, {state: value of vllm_fleet_gateway_vrrp_state})."""
    states = {dict(k[1])["state"]: v for k, v in m.items() if k[0] == "vllm_fleet_gateway_vrrp_state"}
    return m[("vllm_fleet_gateway_vrrp_master", ())], states


def one_hot(state: str) -> dict[str, float]:
    return {s: float(s == state) for s in STATES}


# --------------------------------------------------------------------------- the notify


def test_the_notify_writes_keepalived_s_arguments_atomically_and_readable_by_all(tmp_path: Path) -> None:
    path = tmp_path / "run" / "vllm-fleet-vrrp" / "state.json"
    old = os.umask(0o077)  # root's umask may be tight: the exporter's user must read the file all the same
    try:
        before = time.time()
        assert vrrp_notify.main(["--state-file", str(path), "INSTANCE", "vf_tinyha", "MASTER", "100"]) == 0
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644 and stat.S_IMODE(path.parent.stat().st_mode) == 0o755
    rec = read_vrrp_state(path)
    assert {k: v for k, v in rec.items() if k != "since"} == {
        "state": "MASTER", "type": "INSTANCE", "name": "vf_tinyha", "priority": 100, "keepalived_pid": os.getppid(),
    }  # fmt: skip
    assert before <= rec["since"] <= time.time()
    # the next change replaces it, and no temp file is left behind
    assert vrrp_notify.main(["--state-file", str(path), "INSTANCE", "vf_tinyha", "BACKUP", "49"]) == 0
    assert (read_vrrp_state(path)["state"], read_vrrp_state(path)["priority"]) == ("BACKUP", 49)
    assert sorted(p.name for p in path.parent.iterdir()) == ["state.json"]


def test_the_notify_says_when_it_cannot_write(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "file").write_text("")
    blocked = tmp_path / "file" / "state.json"  # a file where the folder should be
    assert vrrp_notify.main(["--state-file", str(blocked), "INSTANCE", "x", "FAULT", "100"]) == 1
    assert f"vrrp_notify: cannot write {blocked}" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        vrrp_notify.main(["INSTANCE", "x", "MASTER", "high"])  # not a priority


def test_the_default_state_file_is_the_one_the_exporter_and_keepalived_are_given() -> None:
    import argparse

    from vllm_fleet.host.exporter import add_args

    # not in paths.state_dir (/run/vllm-fleet): the engines' units own it, the exporter reads its *.json
    assert VRRP_STATE_FILE.startswith("/run/") and not VRRP_STATE_FILE.startswith("/run/vllm-fleet/")
    p = argparse.ArgumentParser()
    add_args(p)
    assert p.parse_args([]).vrrp_state == ""  # no VRRP series unless the unit asks for them
    plan = ha.keepalived_plan(ha_spec(), "h1")
    assert (
        plan
        and plan.state_file == VRRP_STATE_FILE
        and plan.notify.endswith(f"--state-file {VRRP_STATE_FILE}")
    )


# --------------------------------------------------------------------------- the exporter


def _write(path: Path, **rec: Any) -> None:
    path.write_text(
        json.dumps({"type": "INSTANCE", "name": "vf_t", "priority": 100, "since": 1795940000.5, **rec})
    )


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_the_exporter_reports_the_state_one_hot_from_the_first_scrape(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    collector = FleetCollector(tmp_path / "run", None, use_systemd=False, vrrp_state=path)
    # no file yet (keepalived has not reported since boot): UNKNOWN, not the holder, no "since"
    m = scrape(collector)
    assert vrrp_series(m) == (0, one_hot("UNKNOWN"))
    assert ("vllm_fleet_gateway_vrrp_state_since_timestamp_seconds", ()) not in m
    for state in ("MASTER", "BACKUP", "FAULT", "STOP"):
        _write(path, state=state, keepalived_pid=os.getpid())  # a keepalived that runs
        m = scrape(collector)
        assert vrrp_series(m) == (float(state == "MASTER"), one_hot(state)), state
        assert m[("vllm_fleet_gateway_vrrp_state_since_timestamp_seconds", ())] == 1795940000.5
        assert m[("vllm_fleet_exporter_read_errors_total", ())] == 0


def test_a_state_whose_keepalived_is_gone_reads_stop_and_a_bad_file_unknown(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    collector = FleetCollector(tmp_path / "run", None, use_systemd=False, vrrp_state=path)
    # keepalived killed while it held the address: it could not report STOP, its file still says MASTER
    _write(path, state="MASTER", keepalived_pid=_dead_pid())
    m = scrape(collector)
    assert vrrp_series(m) == (0, one_hot("STOP"))
    assert ("vllm_fleet_gateway_vrrp_state_since_timestamp_seconds", ()) not in m
    # a state keepalived does not send for our instance: unknown, not an error
    _write(path, state="DELETED", keepalived_pid=os.getpid())
    assert vrrp_series(scrape(collector)) == (0, one_hot("UNKNOWN"))
    # not JSON, or a field of the wrong type: unknown, and a read error
    for text in ("{torn", json.dumps({"state": "MASTER", "priority": "high"})):
        path.write_text(text)
        m = scrape(collector)
        assert vrrp_series(m) == (0, one_hot("UNKNOWN")), text
        assert m[("vllm_fleet_exporter_read_errors_total", ())] == 1
    assert read_vrrp(tmp_path / "none.json").state == "UNKNOWN"


def test_only_an_exporter_given_the_state_file_exports_vrrp_series(tmp_path: Path) -> None:
    assert not [k for k in scrape(FleetCollector(tmp_path, None, use_systemd=False)) if "vrrp" in k[0]]
    # the collector on its own exports the same series the composition does
    path = tmp_path / "state.json"
    _write(path, state="BACKUP", keepalived_pid=os.getpid())
    alone = scrape(VrrpState(path))
    whole = scrape(FleetCollector(tmp_path / "run", None, use_systemd=False, vrrp_state=path))
    assert alone == {k: v for k, v in whole.items() if "vrrp" in k[0]} and len(alone) == 7
    # the names the alerts and status read (the controller cannot import host code: one list each side)
    assert {name for name, _ in alone} == set(VRRP_METRICS)


def test_the_cli_exports_the_vrrp_state_it_is_given(tmp_path: Path) -> None:
    _write(tmp_path / "state.json", state="MASTER", keepalived_pid=os.getpid())
    cmd = [sys.executable, "-m", "vllm_fleet.cli", "exporter", "--once", "--no-nvml", "--state-dir", str(tmp_path),
           "--config-dir", "", "--worker-config-dir", "", "--access-log", "", "--drain-state", "",
           "--manifest", ""]  # fmt: skip
    r = subprocess.run(
        [*cmd, "--vrrp-state", str(tmp_path / "state.json")], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    assert "vllm_fleet_gateway_vrrp_master 1.0" in r.stdout.splitlines()
    assert 'vllm_fleet_gateway_vrrp_state{state="MASTER"} 1.0' in r.stdout.splitlines()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "vrrp" not in r.stdout


# --------------------------------------------------------------------------- what is rendered


def _files(spec: FleetSpec, host: str) -> dict[str, str]:
    return {r.dest: r.content for r in render_host(spec, host)}


def test_keepalived_runs_the_notify_as_root_and_the_gateway_s_exporter_reads_its_file() -> None:
    spec = ha_spec()
    notify = (
        f'    notify "/opt/vllm-fleet/venv/bin/vllm-fleet-vrrp-notify --state-file {VRRP_STATE_FILE}" root\n'
    )
    exporter = "/etc/systemd/system/vllm-fleet-exporter.service"
    for host in ("h1", "h2"):
        fs = _files(spec, host)
        conf = fs["/etc/keepalived/keepalived.conf"]
        # in the vrrp_instance block (its last statement), the checks still as nobody
        assert conf.rstrip().endswith(notify + "}") and "script_user nobody nogroup" in conf
        assert f"    --vrrp-state {VRRP_STATE_FILE}\n" in fs[exporter]
    # h3 runs no keepalived: its exporter has no VRRP state to read; one gateway neither
    assert "--vrrp-state" not in _files(spec, "h3")[exporter]
    one = parse_spec(yaml.safe_load((REPO / "examples/tiny-cpu-2hosts.yml").read_text()))
    assert all("--vrrp-state" not in _files(one, h.name)[exporter] for h in one.hosts)


def _can_run_keepalived() -> bool:
    return (
        os.geteuid() == 0
        and all(shutil.which(t) for t in ("keepalived", "unshare", "ip"))
        and subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode == 0
    )


def _wait_for(path: Path, state: str, seconds: float) -> dict[str, Any]:
    deadline = time.monotonic() + seconds
    rec: dict[str, Any] = {}
    while time.monotonic() < deadline:
        if path.exists():
            rec = dict(read_vrrp_state(path))
            if rec.get("state") == state:
                return rec
        time.sleep(0.1)
    raise AssertionError(f"no {state} in {path} within {seconds} s (last: {rec})")


@pytest.mark.skipif(not _can_run_keepalived(), reason="needs root, unshare, ip and keepalived")
def test_a_real_keepalived_runs_the_rendered_notify(tmp_path: Path) -> None:
    """keepalived 2.2.7 with h1's rendered keepalived.conf, in a network namespace of its own (a veth holding
    h1's address; its peer never answers): it reports BACKUP, takes the address after 3 silent advertisement
    intervals (MASTER), and reports STOP when stopped; the exporter reads each from the file the notify wrote
    as root. What the test changes in the config: the checks are /bin/true (no nginx here), and the notify's
    interpreter is a wrapper that runs this checkout's module (the rendered one runs the tools venv's); keepalived
    refuses such a wrapper under /tmp with enable_script_security, which is left out here."""
    spec = ha_spec(interface="vf0")
    conf = _files(spec, "h1")["/etc/keepalived/keepalived.conf"]
    state = tmp_path / "vrrp" / "state.json"
    wrapper = tmp_path / "notify.sh"
    wrapper.write_text(
        f'#!/bin/sh\nPYTHONPATH={REPO} exec {sys.executable} -m vllm_fleet.host.vrrp_notify "$@"\n'
    )
    wrapper.chmod(0o755)
    venv_notify = f"{spec.paths.venv}/bin/{ha.VRRP_NOTIFY_SCRIPT}"
    assert venv_notify in conf
    conf = conf.replace(venv_notify, str(wrapper)).replace(VRRP_STATE_FILE, str(state))
    conf = conf.replace("    enable_script_security\n", "")
    for c in ha.vrrp_checks(spec):
        conf = conf.replace(f'script "{c.script}"', 'script "/bin/true"')
    (tmp_path / "keepalived.conf").write_text(conf)
    setup = (
        "mount -t tmpfs tmpfs /run && ip link set lo up && ip link add vf0 type veth peer name vf1 && "
        "ip link set vf0 up && ip link set vf1 up && ip address add 10.77.0.71/24 dev vf0 && "
        f"exec keepalived --dont-fork --log-console -f {tmp_path / 'keepalived.conf'}"
    )
    log = (tmp_path / "keepalived.log").open("w")
    proc = subprocess.Popen(
        ["unshare", "-n", "-m", "--propagation", "private", "sh", "-c", setup], stdout=log, stderr=log
    )
    try:
        backup = _wait_for(state, "BACKUP", 10)
        master = _wait_for(state, "MASTER", 15)  # 3 x advert_int + skew without a peer's advertisement
        assert master["name"] == ha.keepalived_plan(spec, "h1").instance  # type: ignore[union-attr]
        assert master["type"] == "INSTANCE" and master["priority"] == 100
        assert master["since"] > backup["since"]
        assert os.stat(state).st_uid == 0 and stat.S_IMODE(state.stat().st_mode) == 0o644
        # the notify's parent: keepalived's VRRP process, alive while keepalived runs
        assert Path(f"/proc/{master['keepalived_pid']}/comm").read_text().strip() == "keepalived"
        assert read_vrrp(state).state == "MASTER"
        proc.terminate()
        proc.wait(15)
        _wait_for(state, "STOP", 10)
        assert read_vrrp(state).state == "STOP"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        log.close()
    assert "(vf_tinyha) Entering MASTER STATE" in (tmp_path / "keepalived.log").read_text()
