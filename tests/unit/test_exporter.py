"""The host exporter: launcher state files, instance configs, the gateway access log, the CLI's exposition."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from vllm_fleet.fleet.observability import SLEEP_METRICS
from vllm_fleet.host.exporter import AccessLogTail, FleetCollector, read_instances, unit_restarts

STATE = {
    "instance": "qwen3", "served_model_name": "qwen3-8b", "port": 8001, "state": "ready", "launcher_pid": 123,
    "engine_pid": 456, "started_at": 1795940000.1, "ready_at": 1795940030.2, "load_duration_seconds": 30.1,
    "phase": "loading weights", "last_probe_at": 1795940100.0, "last_probe_ok": True,
    "last_probe_latency_seconds": 0.071, "probes_total": 12, "probe_failures_total": 2, "updated_at": 1795940100.0,
}  # fmt: skip


def scrape(collector: FleetCollector) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    reg = CollectorRegistry()
    reg.register(collector)
    out = {}
    for fam in text_string_to_metric_families(generate_latest(reg).decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def lbl(**kw: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(kw.items()))


def test_state_file_metrics(tmp_path: Path) -> None:
    (tmp_path / "qwen3.json").write_text(json.dumps(STATE))
    m = scrape(FleetCollector(tmp_path, None, use_systemd=False))
    i = {"instance": "qwen3", "model": "qwen3-8b"}
    assert m[("vllm_fleet_instance_state", lbl(**i, state="ready"))] == 1
    for s in ("loading", "draining", "failed", "stopped"):
        assert m[("vllm_fleet_instance_state", lbl(**i, state=s))] == 0
    assert m[("vllm_fleet_instance_load_duration_seconds", lbl(**i))] == 30.1
    assert m[("vllm_fleet_probe_latency_seconds", lbl(**i))] == 0.071
    assert m[("vllm_fleet_probe_success", lbl(**i))] == 1
    assert m[("vllm_fleet_probes_total", lbl(**i))] == 12
    assert m[("vllm_fleet_probe_failures_total", lbl(**i))] == 2
    assert m[("vllm_fleet_instance_state_present", lbl(**i))] == 1
    assert m[("vllm_fleet_exporter_read_errors_total", ())] == 0
    # no stack in this (older launcher's) state file: no stack series
    assert not [k for k in m if k[0] == "vllm_fleet_instance_stack_info"]


def test_the_engine_stack_of_the_running_engine_is_exported(tmp_path: Path) -> None:
    (tmp_path / "qwen3.json").write_text(json.dumps({**STATE, "stack": "cpu-0.32.0-0123456789ab"}))
    m = scrape(FleetCollector(tmp_path, None, use_systemd=False))
    i = {"instance": "qwen3", "model": "qwen3-8b"}
    assert m[("vllm_fleet_instance_stack_info", lbl(**i, stack="cpu-0.32.0-0123456789ab"))] == 1


def test_state_changes_are_seen_at_the_next_scrape(tmp_path: Path) -> None:
    c = FleetCollector(tmp_path, None, use_systemd=False)
    (tmp_path / "qwen3.json").write_text(json.dumps({**STATE, "state": "loading", "last_probe_ok": False}))
    m = scrape(c)
    i = {"instance": "qwen3", "model": "qwen3-8b"}
    assert m[("vllm_fleet_instance_state", lbl(**i, state="loading"))] == 1
    assert m[("vllm_fleet_probe_success", lbl(**i))] == 0
    (tmp_path / "qwen3.json").write_text(json.dumps({**STATE, "state": "failed"}))
    m = scrape(c)
    assert m[("vllm_fleet_instance_state", lbl(**i, state="failed"))] == 1
    assert m[("vllm_fleet_instance_state", lbl(**i, state="loading"))] == 0


def test_configured_instance_without_state_file_and_bad_files(tmp_path: Path) -> None:
    cfg, st = tmp_path / "cfg", tmp_path / "st"
    cfg.mkdir()
    st.mkdir()
    (cfg / "a.json").write_text(json.dumps({"name": "a", "served_model_name": "m-a", "port": 8001}))
    (st / "broken.json").write_text("{not json")
    instances, errors = read_instances(st, cfg)
    assert [(i.name, i.model, i.state) for i in instances] == [("a", "m-a", None)]
    assert errors == 1
    m = scrape(FleetCollector(st, cfg, use_systemd=False))
    assert m[("vllm_fleet_instance_state_present", lbl(instance="a", model="m-a"))] == 0
    assert m[("vllm_fleet_instance_state", lbl(instance="a", model="m-a", state="ready"))] == 0
    assert m[("vllm_fleet_exporter_read_errors_total", ())] == 1


def _line(status: int, model: str, upstream: str = "127.0.0.1:8001", t: float = 0.2) -> str:
    return json.dumps({"status": status, "model": model, "upstream_addr": upstream, "request_time": t}) + "\n"


def test_access_log_tail_counts_codes_retries_and_survives_rotation(tmp_path: Path) -> None:
    log = tmp_path / "access.log"
    log.write_text(_line(200, "old"))  # before the exporter started: not counted
    tail = AccessLogTail(log)
    c = FleetCollector(tmp_path / "none", None, access_log=tail, use_systemd=False)
    scrape(c)
    with log.open("a") as f:
        f.write(_line(200, "m") + _line(200, "m") + _line(502, "m", "127.0.0.1:8001, 127.0.0.1:8002", 3.0))
        f.write("garbage\n" + _line(404, ""))
        f.write('{"status": 200, "model": "m"')  # a partial line: counted once complete
    m = scrape(c)
    assert m[("vllm_fleet_gateway_requests_total", lbl(model="m", code="200"))] == 2
    assert m[("vllm_fleet_gateway_requests_total", lbl(model="m", code="502"))] == 1
    assert m[("vllm_fleet_gateway_requests_total", lbl(model="none", code="404"))] == 1
    assert ("vllm_fleet_gateway_requests_total", lbl(model="old", code="200")) not in m
    assert m[("vllm_fleet_gateway_upstream_retries_total", lbl(model="m"))] == 1
    assert m[("vllm_fleet_gateway_log_bad_lines_total", ())] == 1
    assert m[("vllm_fleet_gateway_request_duration_seconds_bucket", lbl(model="m", le="2.5"))] == 2
    assert m[("vllm_fleet_gateway_request_duration_seconds_count", lbl(model="m"))] == 3
    with log.open("a") as f:
        f.write("}\n")
    assert scrape(c)[("vllm_fleet_gateway_requests_total", lbl(model="m", code="200"))] == 3
    # logrotate: the file is moved away and a new one created
    os.rename(log, tmp_path / "access.log.1")
    log.write_text(_line(503, "m"))
    m = scrape(c)
    assert m[("vllm_fleet_gateway_requests_total", lbl(model="m", code="503"))] == 1
    assert m[("vllm_fleet_gateway_requests_total", lbl(model="m", code="200"))] == 3


def test_failed_upstream_tries_are_counted_by_kind_and_whether_they_were_retried(tmp_path: Path) -> None:
    """$upstream_addr/$upstream_status list every try (", " within an upstream, " : " across the internal
    redirects): a 502 try is a connection that failed before any response (a reused keep-alive connection the
    engine had closed), a 504 a timeout; retried unless it was the request's last try."""
    a, b = "127.0.0.1:8001", "127.0.0.1:8002"

    def rec(status: int, addrs: str, statuses: str) -> str:
        return (
            json.dumps({"status": status, "model": "m", "upstream_addr": addrs, "upstream_status": statuses})
            + "\n"
        )

    log = tmp_path / "access.log"
    log.write_text(
        rec(200, f"{a}, {a}", "502, 200")  # a closed keep-alive connection, the same server on a fresh one
        + rec(
            200, f"{a} : {b}, {a}", "503 : 502, 200"
        )  # full, spilled: a closed connection in the spill twin
        + rec(200, f"{a}, {b} : {a}", "502, 504 : 200")  # an error and a timeout, then the fallback
        + rec(502, f"{a}, {b}", "502, 502")  # the last try failed too: the client got the gateway's 502
        + rec(504, a, "504")
        + rec(502, "m_m", "502")  # nginx's "no live upstreams": no try was made
        + rec(200, a, "200")
        + rec(200, "", "")
    )
    m = scrape(
        FleetCollector(
            tmp_path / "none", None, access_log=AccessLogTail(log, from_start=True), use_systemd=False
        )
    )
    name = "vllm_fleet_gateway_upstream_failed_tries_total"
    assert m[(name, lbl(model="m", kind="error", retried="true"))] == 4
    assert m[(name, lbl(model="m", kind="error", retried="false"))] == 1
    assert m[(name, lbl(model="m", kind="timeout", retried="true"))] == 1
    assert m[(name, lbl(model="m", kind="timeout", retried="false"))] == 1
    assert m[("vllm_fleet_gateway_requests_total", lbl(model="m", code="200"))] == 5


def test_real_gateway_log_format_is_parsed(tmp_path: Path) -> None:
    """A line in the gateway's vf_json format (nginx/vllm-fleet.conf.j2)."""
    line = (
        '{"time":"2026-11-29T08:34:49+00:00","request_id":"d4","remote_addr":"127.0.0.1","client":"alice",'
        '"method":"POST","uri":"/v1/completions","status":200,"model":"tiny-qwen3","route":"body","priority":"",'
        '"upstream":"m_tiny_qwen3__default","upstream_addr":"127.0.0.1:18101","upstream_status":"200",'
        '"request_time":0.005,"upstream_connect_time":"0.001","upstream_header_time":"0.005",'
        '"upstream_response_time":"0.005","request_length":207,"bytes_sent":331,"limit_req":"PASSED"}\n'
    )
    log = tmp_path / "a.log"
    log.write_text(line)
    tail = AccessLogTail(log, from_start=True)
    m = scrape(FleetCollector(tmp_path / "none", None, access_log=tail, use_systemd=False))
    assert m[("vllm_fleet_gateway_requests_total", lbl(model="tiny-qwen3", code="200"))] == 1


def test_requests_admitted_without_the_admission_service_are_counted(tmp_path: Path) -> None:
    """gateway.limits: vf_json's "admission" is "1" for a request the service admitted, "open" for one nginx
    admitted unlimited because the service did not answer (on_failure open); absent without limits."""

    def rec(admission: str | None) -> str:
        d: dict[str, Any] = {"status": 200, "model": "m", "upstream_addr": "127.0.0.1:8001"}
        if admission is not None:
            d["admission"] = admission
        return json.dumps(d) + "\n"

    log = tmp_path / "access.log"
    log.write_text(rec("1") + rec("open") + rec("") + rec(None) + rec("open"))
    c = FleetCollector(
        tmp_path / "none", None, access_log=AccessLogTail(log, from_start=True), use_systemd=False
    )
    assert scrape(c)[("vllm_fleet_gateway_admission_fail_open_total", ())] == 2
    empty = tmp_path / "empty.log"
    empty.write_text("")
    c = FleetCollector(tmp_path / "none", None, access_log=AccessLogTail(empty), use_systemd=False)
    assert scrape(c)[("vllm_fleet_gateway_admission_fail_open_total", ())] == 0  # a series from the start


def test_unit_restarts_of_no_units_asks_nothing() -> None:
    assert unit_restarts([]) == {}


def test_a_failing_systemd_read_is_counted_and_logged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """What `systemctl show` answers as a DynamicUser= on Debian 12 (no nss-systemd): the restart series are
    missing, and the exporter says so (a counter, a journal line) instead of dropping them silently."""
    import vllm_fleet.host.exporter as exporter

    answer = {"rc": 1, "err": "Failed to get properties: Transport endpoint is not connected\n"}

    def fake_run(cmd: list[str], **_kw: object) -> subprocess.CompletedProcess[str]:
        units = [a for a in cmd if a.endswith(".service")]
        out = "" if answer["rc"] else "\n\n".join(f"Id={u}\nNRestarts=3" for u in units)
        return subprocess.CompletedProcess(cmd, answer["rc"], out, answer["err"])

    monkeypatch.setattr(exporter.systemd.subprocess, "run", fake_run)
    with pytest.raises(exporter.SystemdReadError, match="Transport endpoint is not connected"):
        unit_restarts(["qwen3"])
    (tmp_path / "qwen3.json").write_text(json.dumps(STATE))
    c = FleetCollector(tmp_path, None, use_systemd=True)
    caplog.set_level("INFO", logger="vllm_fleet.host.exporter")
    for _ in range(3):
        m = scrape(c)
    assert not [k for k in m if k[0] == "vllm_fleet_instance_restarts_total"]
    assert m[("vllm_fleet_exporter_systemd_errors_total", ())] == 3
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1, warnings  # once per reason, not once per scrape
    assert "Transport endpoint is not connected" in warnings[0]
    assert "vllm_fleet_instance_restarts_total" in warnings[0]
    # systemctl missing: another reason, logged again
    monkeypatch.setattr(
        exporter.systemd.subprocess,
        "run",
        lambda *a, **k: (_ for _ in ()).throw(FileNotFoundError("systemctl")),
    )
    m = scrape(c)
    assert m[("vllm_fleet_exporter_systemd_errors_total", ())] == 4
    assert len([r for r in caplog.records if r.levelname == "WARNING"]) == 2
    # the reads work again: the series is back, the counter keeps its count, the recovery is logged
    monkeypatch.setattr(exporter.systemd.subprocess, "run", fake_run)
    answer.update(rc=0, err="")
    m = scrape(c)
    key = lbl(instance="qwen3", model="qwen3-8b", unit="vllm@qwen3.service")
    assert m[("vllm_fleet_instance_restarts_total", key)] == 3
    assert m[("vllm_fleet_exporter_systemd_errors_total", ())] == 4
    assert any("read from systemd again" in r.getMessage() for r in caplog.records)
    # no systemd at all (a container, a test machine): no systemd series, no error counter
    assert not [k for k in scrape(FleetCollector(tmp_path, None, use_systemd=False)) if "systemd" in k[0]]


def test_cli_once_prints_the_exposition(tmp_path: Path) -> None:
    (tmp_path / "qwen3.json").write_text(json.dumps(STATE))
    r = subprocess.run(
        [str(Path(sys.executable).parent / "vllm-fleet"), "exporter", "--once", "--no-nvml", "--state-dir", str(tmp_path),
         "--config-dir", str(tmp_path / "none")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert 'vllm_fleet_instance_state{instance="qwen3",model="qwen3-8b",state="ready"} 1.0' in r.stdout


def test_exporter_unit_per_host(tmp_path: Path) -> None:
    import yaml

    from vllm_fleet.fleet.render import render_monitoring
    from vllm_fleet.fleet.spec import parse_spec

    repo = Path(__file__).resolve().parents[2]
    data = yaml.safe_load((repo / "alerts" / "tests" / "spec.yml").read_text())
    data["hosts"][1]["private_address"] = "192.168.0.2"
    spec = parse_spec(data)
    render_monitoring(spec, tmp_path, folders=("monitoring",))
    unit = "etc/systemd/system/vllm-fleet-exporter.service"
    h1 = (tmp_path / "h1" / unit).read_text()  # monitoring + gateway host
    h2 = (tmp_path / "h2" / unit).read_text()
    assert "--listen 127.0.0.1:9400" in h1 and "--access-log /var/log/nginx/vllm-fleet.access.log" in h1
    assert (
        "--listen 192.168.0.2:9400" in h2 and "--access-log" not in h2
    )  # reachable by Prometheus on h1 only
    # a static system user, declared next to the unit (a dynamic one cannot ask systemd for NRestarts on a host
    # without nss-systemd), with the hardening a dynamic user implied
    assert "DynamicUser" not in h1.replace("Not DynamicUser=", "")
    assert (
        "User=vllm-fleet-exporter\nGroup=vllm-fleet-exporter\n" in h1 and "SupplementaryGroups=vllm adm" in h1
    )
    for line in ("NoNewPrivileges=yes", "ProtectSystem=strict", "ProtectHome=yes", "PrivateTmp=yes",
                 "RemoveIPC=yes", "RestrictSUIDSGID=yes"):  # fmt: skip
        assert f"\n{line}\n" in h1, line
    sysusers = (tmp_path / "h2" / "etc/sysusers.d/vllm-fleet-exporter.conf").read_text()
    assert 'u vllm-fleet-exporter - "vllm-fleet host exporter" / /usr/sbin/nologin' in sysusers.splitlines()
    assert "\n# Ansible managed\n" in "\n" + h1


WORKER = {
    "instance": "big", "served_model_name": "big-70b", "rank": 1, "nnodes": 2, "state": "joined",
    "since": 1795940050.5, "master": "10.0.0.1:28001", "worker_pid": os.getpid(), "engine_pid": 78, "exit_code": None,
    "reason": None, "updated_at": 1795940050.5,
}  # fmt: skip


def test_worker_state_file_metrics(tmp_path: Path) -> None:
    """A multi-node rank's state file ({state_dir}/workers/NAME.json) is a worker, never an instance."""
    st, wcfg = tmp_path / "st", tmp_path / "workers-cfg"
    (st / "workers").mkdir(parents=True)
    wcfg.mkdir()
    (st / "workers" / "big.json").write_text(json.dumps(WORKER))
    # configured on this host, not started yet: a worker without a state file
    (wcfg / "other.json").write_text(json.dumps({"name": "other", "served_model_name": "o", "rank": 2}))
    c = FleetCollector(st, None, use_systemd=False, worker_config_dir=wcfg)
    m = scrape(c)
    w = {"instance": "big", "model": "big-70b", "rank": "1"}
    assert m[("vllm_fleet_worker_state", lbl(**w, state="joined"))] == 1
    for s in ("waiting", "rank0_gone", "exited"):
        assert m[("vllm_fleet_worker_state", lbl(**w, state=s))] == 0
    assert m[("vllm_fleet_worker_state_present", lbl(**w))] == 1
    assert m[("vllm_fleet_worker_state_since_timestamp_seconds", lbl(**w))] == 1795940050.5
    o = {"instance": "other", "model": "o", "rank": "2"}
    assert m[("vllm_fleet_worker_state_present", lbl(**o))] == 0
    assert m[("vllm_fleet_worker_state", lbl(**o, state="joined"))] == 0
    assert not [k for k in m if k[0].startswith("vllm_fleet_instance_") and ("instance", "big") in k[1]]
    assert m[("vllm_fleet_exporter_read_errors_total", ())] == 0
    # the worker loses rank 0: seen at the next scrape; a broken worker file is a read error
    (st / "workers" / "big.json").write_text(json.dumps({**WORKER, "state": "rank0_gone", "exit_code": 1}))
    (st / "workers" / "bad.json").write_text(json.dumps({**WORKER, "rank": "one"}))
    m = scrape(c)
    assert m[("vllm_fleet_worker_state", lbl(**w, state="rank0_gone"))] == 1
    assert m[("vllm_fleet_worker_state", lbl(**w, state="joined"))] == 0
    assert m[("vllm_fleet_exporter_read_errors_total", ())] == 1


def test_a_killed_worker_is_not_reported_joined(tmp_path: Path) -> None:
    """A worker killed outright (SIGKILL at a stop timeout, the OOM killer) leaves "joined" in its file: its
    process being gone makes it "exited", so the partial-group alert counts the rank as missing."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (tmp_path / "workers").mkdir()
    (tmp_path / "workers" / "big.json").write_text(json.dumps({**WORKER, "worker_pid": gone.pid}))
    m = scrape(FleetCollector(tmp_path, None, use_systemd=False))
    w = {"instance": "big", "model": "big-70b", "rank": "1"}
    assert m[("vllm_fleet_worker_state", lbl(**w, state="exited"))] == 1
    assert m[("vllm_fleet_worker_state", lbl(**w, state="joined"))] == 0
    # a finished state is left as it is
    (tmp_path / "workers" / "big.json").write_text(
        json.dumps({**WORKER, "worker_pid": gone.pid, "state": "rank0_gone"})
    )
    m = scrape(FleetCollector(tmp_path, None, use_systemd=False))
    assert m[("vllm_fleet_worker_state", lbl(**w, state="rank0_gone"))] == 1


def test_multi_node_group_size_from_the_instance_config(tmp_path: Path) -> None:
    cfg, st = tmp_path / "cfg", tmp_path / "st"
    cfg.mkdir()
    st.mkdir()
    (cfg / "big.json").write_text(
        json.dumps({"name": "big", "served_model_name": "b", "port": 8001, "nnodes": 3})
    )
    (cfg / "one.json").write_text(json.dumps({"name": "one", "port": 8002, "nnodes": 1}))
    (cfg / "old.json").write_text(json.dumps({"name": "old", "port": 8003}))  # an older release's config
    m = scrape(FleetCollector(st, cfg, use_systemd=False))
    assert m[("vllm_fleet_instance_nodes", lbl(instance="big", model="b"))] == 3
    assert [k for k in m if k[0] == "vllm_fleet_instance_nodes"] == [
        ("vllm_fleet_instance_nodes", lbl(instance="big", model="b"))
    ]  # single-host instances: no series


def test_worker_unit_restarts_come_from_systemctl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """NRestarts of vllm-worker@NAME.service, asked in the same one systemctl call form as vllm@NAME's."""
    import vllm_fleet.host.exporter as exporter

    calls: list[list[str]] = []

    def fake_run(cmd: list[str], **_kw: object) -> subprocess.CompletedProcess[str]:
        calls.append(cmd)
        units = [a for a in cmd if a.endswith(".service")]
        out = "\n\n".join(f"Id={u}\nNRestarts={n + 4}" for n, u in enumerate(units))
        return subprocess.CompletedProcess(cmd, 0, out, "")

    monkeypatch.setattr(exporter.systemd.subprocess, "run", fake_run)
    (tmp_path / "workers").mkdir()
    (tmp_path / "workers" / "big.json").write_text(json.dumps(WORKER))
    m = scrape(FleetCollector(tmp_path, None, use_systemd=True))
    key = lbl(instance="big", model="big-70b", rank="1", unit="vllm-worker@big.service")
    assert m[("vllm_fleet_worker_restarts_total", key)] == 4
    assert ["systemctl", "show", "--property=Id,NRestarts", "vllm-worker@big.service"] in calls
    assert unit_restarts(["x"], "vllm-worker") == {"x": 4}


def test_exporter_unit_reads_the_worker_configs(tmp_path: Path) -> None:
    import yaml

    from vllm_fleet.fleet.render import render_monitoring
    from vllm_fleet.fleet.spec import parse_spec

    repo = Path(__file__).resolve().parents[2]
    spec = parse_spec(yaml.safe_load((repo / "examples" / "tiny-cpu-multinode.yml").read_text()))
    render_monitoring(spec, tmp_path, folders=("monitoring",))
    unit = (tmp_path / "h2" / "etc/systemd/system/vllm-fleet-exporter.service").read_text()
    assert "--worker-config-dir /etc/vllm-fleet/workers" in unit and "--state-dir /run/vllm-fleet" in unit


def _lora_host(tmp_path: Path, state: str, loaded: list[str], age: float) -> tuple[Path, Path]:
    """One LoRA instance ``qwen3`` (its launcher ``state``) carrying sql and chat (and able to load spill), its
    adapter state file listing ``loaded``, written ``age`` seconds ago."""
    import time

    cfg, st = tmp_path / "instances", tmp_path / "run"
    (st / "adapters").mkdir(parents=True)
    cfg.mkdir()
    file = cfg / "qwen3.adapters.json"
    env = {"VLLM_FLEET_ADAPTERS_FILE": str(file)}
    (cfg / "qwen3.json").write_text(
        json.dumps({"name": "qwen3", "served_model_name": "qwen3-8b", "environment": env})
    )
    a = {"path": "/srv/a", "rank": 8}
    file.write_text(json.dumps({"schema": 1, "instance": "qwen3", "model": "qwen3-8b", "adapters": [
        {**a, "name": "sql", "carry": True}, {**a, "name": "chat", "carry": True},
        {**a, "name": "spill", "carry": False}]}))  # fmt: skip
    (st / "qwen3.json").write_text(json.dumps({**STATE, "state": state}))
    (st / "adapters" / "qwen3.json").write_text(
        json.dumps(
            {"instance": "qwen3", "model": "qwen3-8b", "loaded": loaded, "updated_at": time.time() - age}
        )
    )
    return cfg, st


@pytest.mark.parametrize(
    ("state", "age", "want"),
    [
        ("ready", 5, {"sql": 1, "chat": 0}),  # fresh: as the engine said
        ("ready", 600, {"sql": 1, "chat": 0}),  # a ready instance's file is trusted however old
        ("loading", 5, {"sql": 1, "chat": 0}),  # fresh while loading: as it said
        ("failed", 600, {"sql": 0, "chat": 0}),  # stale while not ready: nothing loaded
        ("stopped", 121, {"sql": 0, "chat": 0}),
    ],
)
def test_each_carried_adapter_is_loaded_or_not(
    tmp_path: Path, state: str, age: float, want: dict[str, int]
) -> None:
    cfg, st = _lora_host(tmp_path, state, ["sql", "spill"], age)
    m = scrape(FleetCollector(st, cfg, use_systemd=False))
    got = {dict(k[1])["adapter"]: v for k, v in m.items() if k[0] == "vllm_fleet_instance_adapter_loaded"}
    assert got == want  # carried ones only: spill (loaded on demand) has no series
    assert m[("vllm_fleet_exporter_read_errors_total", ())] == 0
    # the adapters file is no instance config
    assert {dict(k[1])["instance"] for k in m if k[0] == "vllm_fleet_instance_state"} == {"qwen3"}


def test_adapter_files_missing_or_broken(tmp_path: Path) -> None:
    """No adapter state file: every carried adapter 0; a broken one, or a broken adapters file, is a read
    error (no series from a broken adapters file, whose state file is not read then); no adapters file:
    nothing carried, no error."""
    cfg, st = _lora_host(tmp_path, "ready", [], 0)
    (st / "adapters" / "qwen3.json").unlink()
    m = scrape(FleetCollector(st, cfg, use_systemd=False))
    assert (
        m[("vllm_fleet_instance_adapter_loaded", lbl(instance="qwen3", model="qwen3-8b", adapter="sql"))] == 0
    )
    assert m[("vllm_fleet_exporter_read_errors_total", ())] == 0
    (st / "adapters" / "qwen3.json").write_text('{"loaded": "sql"}')
    m = scrape(FleetCollector(st, cfg, use_systemd=False))
    assert (
        m[("vllm_fleet_instance_adapter_loaded", lbl(instance="qwen3", model="qwen3-8b", adapter="sql"))] == 0
    )
    assert m[("vllm_fleet_exporter_read_errors_total", ())] == 1
    (cfg / "qwen3.adapters.json").write_text('{"schema": 1, "adapters": "x"}')
    m = scrape(FleetCollector(st, cfg, use_systemd=False))
    assert not [k for k in m if k[0] == "vllm_fleet_instance_adapter_loaded"]
    assert m[("vllm_fleet_exporter_read_errors_total", ())] == 1  # (the state file is not read without it)
    (cfg / "qwen3.adapters.json").unlink()
    m = scrape(FleetCollector(st, cfg, use_systemd=False))
    assert not [k for k in m if k[0] == "vllm_fleet_instance_adapter_loaded"]
    assert m[("vllm_fleet_exporter_read_errors_total", ())] == 0


# ------------------------------------------------------------------------------- sleep mode (docs/sleep.md)

SLEEPS = {
    "sleep_state": "asleep", "sleep_level": 2, "swap_group": "pair", "last_active_at": 1795939000.0,
    "asleep_since": 1795940000.0, "sleeps_total": 5, "wakes_total": 4, "failed_wakes_total": 1,
    "wake_seconds_total": 62.5, "last_wake_seconds": 20.5, "asleep_seconds_total": 3000.0,
    "last_wake_failure": "wake_up: timed out",
}  # fmt: skip
# the sample names of the sleep families the alerts, dashboards and status read (the summary's _count and _sum)
SLEEP_FAMILIES = {
    n + suffix
    for n in SLEEP_METRICS
    for suffix in (("_count", "_sum") if n == "vllm_fleet_instance_wake_duration_seconds" else ("",))
}


def _sleep_scrape(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, state: dict[str, Any], at: float
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from vllm_fleet.host.exporter import states

    monkeypatch.setattr(states, "wall_clock", lambda: at)
    (tmp_path / "qwen3.json").write_text(json.dumps(state))
    return scrape(FleetCollector(tmp_path, None, use_systemd=False))


def test_an_instance_that_sleeps_exports_its_sleep_state_wakes_and_time_asleep(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    i = {"instance": "qwen3", "model": "qwen3-8b"}
    m = _sleep_scrape(tmp_path, monkeypatch, {**STATE, **SLEEPS}, 1795940060.0)
    assert {k[0] for k in m if k[0] in SLEEP_FAMILIES} == SLEEP_FAMILIES
    assert {s: m[("vllm_fleet_instance_sleep_state", lbl(**i, state=s))] for s in
            ("awake", "sleeping", "asleep", "waking")} == {"awake": 0, "sleeping": 0, "asleep": 1, "waking": 0}  # fmt: skip
    assert m[("vllm_fleet_instance_sleep_level", lbl(**i))] == 2
    assert m[("vllm_fleet_instance_sleeps_total", lbl(**i))] == 5
    assert m[("vllm_fleet_instance_wakes_total", lbl(**i))] == 4
    assert m[("vllm_fleet_instance_failed_wakes_total", lbl(**i))] == 1
    assert m[("vllm_fleet_instance_wake_duration_seconds_count", lbl(**i))] == 4
    assert m[("vllm_fleet_instance_wake_duration_seconds_sum", lbl(**i))] == 62.5
    assert m[("vllm_fleet_instance_last_wake_seconds", lbl(**i))] == 20.5
    assert m[("vllm_fleet_instance_asleep_since_timestamp_seconds", lbl(**i))] == 1795940000.0
    # the periods that ended and the current one, to the scrape's clock
    assert m[("vllm_fleet_instance_asleep_seconds_total", lbl(**i))] == 3060.0
    m = _sleep_scrape(tmp_path, monkeypatch, {**STATE, **SLEEPS}, 1795940600.0)
    assert m[("vllm_fleet_instance_asleep_seconds_total", lbl(**i))] == 3600.0
    # a clock behind the launcher's (never less than the periods that ended)
    m = _sleep_scrape(tmp_path, monkeypatch, {**STATE, **SLEEPS}, 1795939000.0)
    assert m[("vllm_fleet_instance_asleep_seconds_total", lbl(**i))] == 3000.0


def test_the_current_period_runs_while_asleep_since_is_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The launcher (vllm_fleet.host.sleep_control) keeps asleep_since while the engine is asleep or waking and
    folds the period into asleep_seconds_total when it is awake, in one write: the exported total never goes back
    (a drop would read as a counter reset). A launcher that stopped ends the period at its last write."""
    i = {"instance": "qwen3", "model": "qwen3-8b"}
    at = 1795940060.0
    totals = []
    for state, extra in (
        ("asleep", {}),
        ("waking", {}),  # a wake in progress: still the same period
        ("awake", {"asleep_since": None, "asleep_seconds_total": 3060.0}),  # folded in by the launcher
        ("sleeping", {"asleep_since": None, "asleep_seconds_total": 3060.0}),  # going to sleep: no period yet
    ):
        m = _sleep_scrape(tmp_path, monkeypatch, {**STATE, **SLEEPS, "sleep_state": state, **extra}, at)
        totals.append(m[("vllm_fleet_instance_asleep_seconds_total", lbl(**i))])
        assert m[("vllm_fleet_instance_sleep_state", lbl(**i, state=state))] == 1
        assert sum(v for k, v in m.items() if k[0] == "vllm_fleet_instance_sleep_state") == 1
    assert totals == [3060.0, 3060.0, 3060.0, 3060.0]
    # stopped while asleep (its last write at 1795940030): the total stays at that write's, however late the scrape
    stopped = {**STATE, **SLEEPS, "state": "stopped", "updated_at": 1795940030.0}
    for later in (1795940060.0, 1795950000.0):
        m = _sleep_scrape(tmp_path, monkeypatch, stopped, later)
        assert m[("vllm_fleet_instance_asleep_seconds_total", lbl(**i))] == 3030.0
    # a state this exporter does not know (a newer launcher): every known one 0, the counters still there
    m = _sleep_scrape(tmp_path, monkeypatch, {**STATE, **SLEEPS, "sleep_state": "dozing"}, at)
    assert [v for k, v in m.items() if k[0] == "vllm_fleet_instance_sleep_state"] == [0, 0, 0, 0]
    assert m[("vllm_fleet_instance_wakes_total", lbl(**i))] == 4


# the sleep keys of a model that does not sleep, as the launcher writes them
NEVER_SLEEPS = {
    "sleep_state": None, "sleep_level": None, "swap_group": None, "last_active_at": None, "asleep_since": None,
    "sleeps_total": 0, "wakes_total": 0, "failed_wakes_total": 0, "wake_seconds_total": 0.0,
    "last_wake_seconds": None, "asleep_seconds_total": 0.0, "last_wake_failure": None,
}  # fmt: skip


# STATE: an older launcher's state file, without the sleep keys
@pytest.mark.parametrize("state", [{**STATE, **NEVER_SLEEPS}, STATE])
def test_an_instance_that_never_sleeps_has_no_sleep_series(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, state: dict[str, Any]
) -> None:
    assert state.get("sleep_state") is None
    m = _sleep_scrape(tmp_path, monkeypatch, state, 1795940060.0)
    assert not {k[0] for k in m} & SLEEP_FAMILIES
    assert m[("vllm_fleet_instance_state", lbl(instance="qwen3", model="qwen3-8b", state="ready"))] == 1
    assert m[("vllm_fleet_exporter_read_errors_total", ())] == 0


def test_the_exported_sleep_series_follow_the_launchers_sleep_controller(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The launcher's sleep controller (vllm_fleet.host.sleep_control) through a sleep, a wake, a sleep and a failed
    wake, its state-file keys scraped after each step: the time asleep never goes back and counts the waking
    too, the wakes' summary and the failed wakes are the controller's."""
    from vllm_fleet.contracts import SleepConfig
    from vllm_fleet.host.sleep_control import GuardReading, SleepControl

    wall0 = 1795940000.0
    sc = SleepControl(SleepConfig(level=1, idle_seconds=30.0, wake_wait_seconds=20.0), None, 0.0)
    i = {"instance": "qwen3", "model": "qwen3-8b"}
    seen: list[tuple[str, float, float, float, float]] = []

    def scrape_at(t: float) -> None:
        state = {**STATE, **sc.fields(lambda m: None if m is None else wall0 + m)}
        m = _sleep_scrape(tmp_path, monkeypatch, state, wall0 + t)
        current = [
            dict(k[1])["state"] for k, v in m.items() if k[0] == "vllm_fleet_instance_sleep_state" and v == 1
        ]
        seen.append((current[0], m[("vllm_fleet_instance_asleep_seconds_total", lbl(**i))],
                     m[("vllm_fleet_instance_wake_duration_seconds_count", lbl(**i))],
                     m[("vllm_fleet_instance_wake_duration_seconds_sum", lbl(**i))],
                     m[("vllm_fleet_instance_failed_wakes_total", lbl(**i))]))  # fmt: skip

    def idle(t: float) -> None:
        sc.guard_read(t, GuardReading("awake", 0, 0, wall0, wall0 + t))

    scrape_at(10)  # awake
    idle(40)  # idle 40 s >= 30 s: going to sleep
    scrape_at(41)
    sc.slept(45, 200, "")  # asleep from 45
    scrape_at(60)
    sc.wake_requested(100)  # a request is held: waking (no swap group: at once)
    scrape_at(101)
    sc.woken(102.5, wall0 + 102.5, True, "")  # awake after 2.5 s; asleep 45 → 102.5
    scrape_at(110)
    idle(150)
    sc.slept(151, 200, "")
    scrape_at(160)
    sc.wake_requested(170)
    sc.woken(171, wall0 + 171, False, "HTTP 500")  # the wake fails: asleep again, the same period
    scrape_at(180)
    assert seen == [
        ("awake", 0.0, 0, 0.0, 0),
        ("sleeping", 0.0, 0, 0.0, 0),
        ("asleep", 15.0, 0, 0.0, 0),
        ("waking", 56.0, 0, 0.0, 0),
        ("awake", 57.5, 1, 2.5, 0),
        ("asleep", 66.5, 1, 2.5, 0),
        ("asleep", 86.5, 1, 2.5, 1),
    ]
    totals = [s[1] for s in seen]
    assert totals == sorted(totals)
