"""Launcher pieces that need no engine, and the rendered systemd units (systemd-analyze verify)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from vllm_fleet.fleet.render import render_fleet
from vllm_fleet.fleet.spec import SpecError, load_spec
from vllm_fleet.host.launcher import (
    EXIT_CONFIG,
    EXIT_ENGINE_DIED,
    InstanceConfig,
    config_problem,
    exit_code_of,
    load_config,
    parse_phase,
    write_state,
)
from vllm_fleet.host.notify import Notifier, NotifyListener

REPO = Path(__file__).resolve().parents[2]


def spec_file(tmp_path: Path, base: str = "tiny-cpu.yml", **patch: object) -> Path:
    d = yaml.safe_load((REPO / "examples" / base).read_text())
    d.update(patch)
    p = tmp_path / "spec.yml"
    p.write_text(yaml.safe_dump(d))
    return p


def render(tmp_path: Path, spec_path: Path) -> Path:
    out = tmp_path / "out"
    render_fleet(load_spec(spec_path), out)
    return out


# --------------------------------------------------------------------------- phases, notify, state


@pytest.mark.parametrize(
    ("line", "phase"),
    [
        ("(APIServer pid=1) INFO 11-29 08:25:21 [api_utils.py:286] non-default args: {'model': 'x'}", "parsing arguments"),
        ("(APIServer pid=1) INFO [model.py:733] Resolved architecture: Qwen3ForCausalLM", "resolving model config"),
        ("(EngineCore pid=2) INFO [core.py:133] Initializing a V1 LLM engine (v0.32.0) with", "starting engine core"),
        ("(Worker pid=3) INFO [cpu_model_runner.py:68] Starting to load model /m...", "loading weights"),
        ("(Worker pid=3) INFO [default_loader.py:501] Loading weights took 0.01 seconds", "weights loaded"),
        ("(EngineCore pid=2) INFO [kv_cache_utils.py:2327] CPU KV cache size: 131,072 tokens", "allocating KV cache"),
        ("(EngineCore pid=2) INFO [core.py:402] init engine (profile, create kv cache, warmup model) took 0.22 s",
         "engine core ready"),
        ("(APIServer pid=1) INFO [entry.py:140] Starting vLLM server on http://127.0.0.1:8101", "starting API server"),
        ("(Worker) INFO Capturing CUDA graphs (mixed prefill-decode, PIECEWISE): 100%", "capturing CUDA graphs"),
        ("(APIServer pid=1) INFO [launcher.py:195] Route: /health, Methods: GET", None),
    ],
)  # fmt: skip
def test_parse_phase(line: str, phase: str | None) -> None:
    assert parse_phase(line) == phase


def test_error_lines() -> None:
    from vllm_fleet.host.launcher import _ERROR_RE

    assert _ERROR_RE.search(
        "(APIServer pid=1) ERROR 11-29 [serving.py:500] Error in completion stream generator."
    )
    assert _ERROR_RE.search("OSError: libnuma.so.1: cannot open shared object file")
    assert not _ERROR_RE.search(
        "(Worker pid=871) WARNING 11-29 [utils.py:597] Failed to create oneDNN linear. Exception: could not"
    )


@pytest.mark.parametrize("abstract", [False, True])
def test_notify_roundtrip(tmp_path: Path, abstract: bool) -> None:
    addr = f"@vllm-fleet-test-{os.getpid()}-{time.monotonic_ns()}" if abstract else str(tmp_path / "n.sock")
    listener = NotifyListener(addr)
    try:
        n = Notifier(addr)
        assert n.enabled
        assert n.send("READY=1", "STATUS=Serving x\nsecond line")
        assert n.status("hello")
        i = listener.wait_for("READY", "1", timeout=5)
        assert listener.messages[i][1]["STATUS"] == "Serving x second line"  # one message, newline-safe
        listener.wait_for("STATUS", "hello", timeout=5)
        n.close()
    finally:
        listener.close()


def test_notifier_without_socket_is_a_noop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    n = Notifier()
    assert not n.enabled and n.send("READY=1") is False


def test_notifier_survives_a_vanished_socket(tmp_path: Path) -> None:
    assert Notifier(str(tmp_path / "gone.sock")).send("WATCHDOG=1") is False


def test_state_file_is_replaced_atomically(tmp_path: Path) -> None:
    write_state(str(tmp_path / "st"), "qwen3", {"state": "loading", "n": 1})
    write_state(str(tmp_path / "st"), "qwen3", {"state": "ready", "n": 2})
    assert json.loads((tmp_path / "st" / "qwen3.json").read_text()) == {"n": 2, "state": "ready"}
    assert [p.name for p in (tmp_path / "st").iterdir()] == ["qwen3.json"]  # no tmp leftovers
    assert oct((tmp_path / "st" / "qwen3.json").stat().st_mode & 0o777) == "0o644"


def test_exit_codes() -> None:
    assert exit_code_of(-9) == 137 and exit_code_of(-15) == 143 and exit_code_of(3) == 3


# --------------------------------------------------------------------------- config


def test_config_problem_names_the_model_path(tmp_path: Path) -> None:
    def cfg(mp: str, exe: str = sys.executable) -> InstanceConfig:
        return InstanceConfig(name="a", served_model_name="a", model_path=mp, port=9, command=[exe, "x"])

    assert "does not exist" in config_problem(cfg(str(tmp_path / "nope")))
    (tmp_path / "f").write_text("")
    assert "not a directory" in config_problem(cfg(str(tmp_path / "f")))
    (tmp_path / "m").mkdir()
    assert "no config.json" in config_problem(cfg(str(tmp_path / "m")))
    (tmp_path / "m" / "config.json").write_text("{}")
    assert config_problem(cfg(str(tmp_path / "m"))) == ""
    assert "not executable" in config_problem(cfg(str(tmp_path / "m"), "/nonexistent/python"))
    assert config_problem(cfg("Qwen/Qwen3-8B")) == ""  # a hub id is vLLM's business


def test_rendered_instance_config_loads(tmp_path: Path) -> None:
    out = render(tmp_path, spec_file(tmp_path))
    cfg = load_config("tiny", out / "h1" / "etc" / "vllm-fleet")
    assert cfg.port == 8101 and cfg.served_model_name == "tiny-qwen3"
    assert cfg.command[1:4] == ["-m", "vllm_fleet.host.vllm_cpu_entry", "serve"]
    assert "--shutdown-timeout" in cfg.command
    assert cfg.environment["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert cfg.service.watchdog_seconds == 60 and cfg.service.probe_timeout_seconds == 20
    assert cfg.state_dir == "/run/vllm-fleet"


def test_launch_with_missing_config_exits_78(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "vllm_fleet.host.launcher", "nope", "--config-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == EXIT_CONFIG
    assert "cannot read instance config" in r.stderr


def test_a_launcher_error_is_named_and_leaves_no_engine_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """A bug of the launcher's own (an exception in its loop, here right after the engine started): the engine's
    process group killed, state failed with the exception named (what `vllm-fleet why` reports), the traceback
    on stderr (the journal), exit 1 (systemd restarts it)."""
    from vllm_fleet.host import launcher
    from vllm_fleet.host.failure_cause import failure_cause

    out = render(tmp_path, spec_file(tmp_path))
    conf = out / "h1" / "etc" / "vllm-fleet"
    doc = json.loads((conf / "instances" / "tiny.json").read_text())
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    doc.update(
        model_path=str(tmp_path / "model"),
        command=[sys.executable, "-c", "import time; print('engine up', flush=True); time.sleep(300)"],
        state_dir=str(tmp_path / "state"),
    )
    (conf / "instances" / "tiny.json").write_text(json.dumps(doc))
    engine: list[int] = []

    def broken(self: launcher.Supervisor, now: float, pid: int) -> list[launcher.Action]:
        engine.append(pid)
        raise RuntimeError("boom")

    monkeypatch.setattr(launcher.Supervisor, "engine_started", broken)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        rc = launcher.launch("tiny", str(conf))
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    assert rc == EXIT_ENGINE_DIED == 1
    assert len(engine) == 1
    with pytest.raises(ProcessLookupError):
        os.killpg(engine[0], 0)  # the group is gone (killed and reaped)
    state = json.loads((tmp_path / "state" / "tiny.json").read_text())
    assert state["state"] == "failed"
    assert state["failure_reason"].startswith(
        "launcher error: RuntimeError: boom (its traceback is in the journal)"
    )
    assert failure_cause("tiny", str(tmp_path / "state")).startswith("launcher error: RuntimeError: boom")
    err = capfd.readouterr().err
    assert "Traceback (most recent call last)" in err and 'raise RuntimeError("boom")' in err


def test_service_settings_are_validated(tmp_path: Path) -> None:
    d = yaml.safe_load((REPO / "examples" / "tiny-cpu.yml").read_text())
    d["models"][0]["service"] = {"watchdog_seconds": 10, "probe_timeout_seconds": 12}
    p = tmp_path / "bad.yml"
    p.write_text(yaml.safe_dump(d))
    with pytest.raises(SpecError) as e:
        load_spec(p)
    assert "models[0].service" in e.value.render() and "probe_timeout_seconds" in e.value.render()


@pytest.mark.parametrize(
    ("service", "refused"),
    [
        ({"watchdog_seconds": 30, "probe_interval_seconds": 10, "probe_timeout_seconds": 24}, None),
        (
            {"watchdog_seconds": 30, "probe_interval_seconds": 12},
            "probe_interval_seconds 12 must be at most a third",
        ),
        (
            {"watchdog_seconds": 30, "probe_timeout_seconds": 25},
            "probe_timeout_seconds 25 must be at most 0.8",
        ),
        ({"watchdog_seconds": 0, "probe_interval_seconds": 100, "probe_timeout_seconds": 100}, None),
    ],
)
def test_one_watchdog_timing_rule_for_the_spec_and_the_launcher(
    tmp_path: Path, service: dict[str, float], refused: str | None
) -> None:
    """The spec refuses exactly what the launcher would shorten (vllm_fleet.contracts.probe_timing): a spec that
    passes runs with its own interval and timeout."""
    from vllm_fleet.contracts import SERVICE_DEFAULTS, probe_timing

    d = yaml.safe_load((REPO / "examples" / "tiny-cpu.yml").read_text())
    d["models"][0]["service"] = service
    p = tmp_path / "spec.yml"
    p.write_text(yaml.safe_dump(d))
    interval = service.get("probe_interval_seconds", SERVICE_DEFAULTS.probe_interval_seconds)
    timeout = service.get("probe_timeout_seconds", SERVICE_DEFAULTS.probe_timeout_seconds)
    used = probe_timing(service["watchdog_seconds"], interval, timeout)
    if refused is None:
        svc = load_spec(p).models[0].service
        assert used == (svc.probe_interval_seconds, svc.probe_timeout_seconds)
        return
    with pytest.raises(SpecError) as e:
        load_spec(p)
    assert "models[0].service" in e.value.render() and refused in e.value.render(), e.value.render()
    assert used != (interval, timeout)


# --------------------------------------------------------------------------- units


def _unit(out: Path, host: str, name: str) -> str:
    return (out / host / "etc" / "systemd" / "system" / name).read_text()


def test_template_unit_directives(tmp_path: Path) -> None:
    out = render(tmp_path, spec_file(tmp_path))
    u = _unit(out, "h1", "vllm@.service")
    assert u.startswith("# Ansible managed")
    for line in [
        "Type=notify",
        "NotifyAccess=main",
        "ExecStart=/opt/vllm-fleet/venv/bin/python -m vllm_fleet.host.launcher %i --config-dir /etc/vllm-fleet",
        "User=vllm",
        "KillMode=mixed",
        "Restart=on-failure",
        "RestartPreventExitStatus=78",
        "SyslogIdentifier=vllm-%i",
        "ProtectSystem=strict",
        "ProtectHome=yes",
        "PrivateTmp=yes",
        "NoNewPrivileges=yes",
        "LimitMEMLOCK=infinity",
        "LimitNOFILE=65536",
        "RuntimeDirectory=vllm-fleet",
        "RuntimeDirectoryPreserve=yes",
        "StateDirectory=vllm-fleet/cache",
        "PrivateDevices=yes",
    ]:
        assert line in u.splitlines(), line
    assert "DeviceAllow" not in u  # cpu profile: no devices at all
    drop = _unit(out, "h1", "vllm@tiny.service.d/10-fleet.conf")
    assert "DeviceAllow" not in drop
    assert "TimeoutStopSec=70" in drop  # 2 x shutdown_timeout 20 + 30
    assert "WatchdogSec=60" in drop and "After=" not in drop
    target = _unit(out, "h1", "vllm-fleet.target")
    assert "Wants=vllm@tiny.service" in target
    sysusers = (out / "h1" / "etc" / "sysusers.d" / "vllm-fleet.conf").read_text()
    assert "u vllm -:vllm" in sysusers


def test_gpu_profile_allows_only_nvidia_devices(tmp_path: Path) -> None:
    out = render(tmp_path, spec_file(tmp_path, "seed-004-4xa100.yml"))
    host = next(p.name for p in out.iterdir() if (p / "etc/systemd/system/vllm@.service").exists())
    u = _unit(out, host, "vllm@.service")
    assert "DevicePolicy=closed" in u and "PrivateDevices=no" in u
    allows = [x for x in u.splitlines() if x.startswith("DeviceAllow=")]
    # by path, whatever /proc/devices calls the driver (open modules list "nvidia", no "nvidia-frontend");
    # the template names no GPU node: those are per instance
    assert allows == [
        "DeviceAllow=/dev/nvidiactl rw",
        "DeviceAllow=/dev/nvidia-uvm rw",
        "DeviceAllow=/dev/nvidia-uvm-tools rw",
        "DeviceAllow=char-nvidia-caps rw",
        "DeviceAllow=char-nvidia-caps-imex-channels rw",
    ]
    cfgs = sorted((out / host / "etc" / "vllm-fleet" / "instances").glob("*.json"))
    devices = {json.loads(c.read_text())["environment"]["CUDA_VISIBLE_DEVICES"] for c in cfgs}
    assert len(devices) == len(cfgs)  # each instance its own GPUs
    for c in cfgs:
        cfg = json.loads(c.read_text())
        drop = _unit(out, host, f"vllm@{cfg['name']}.service.d/10-fleet.conf")
        own = [x for x in drop.splitlines() if x.startswith("DeviceAllow=")]
        assert own == [f"DeviceAllow=/dev/nvidia{g} rw" for g in cfg["gpus"]], (cfg["name"], own)


def test_shared_gpu_instances_start_one_after_another(tmp_path: Path) -> None:
    d = yaml.safe_load((REPO / "examples" / "seed-004-4xa100.yml").read_text())
    first = d["models"][0]
    second = {**first, "name": "second", "port": first["port"] + 50, "served_model_name": "second"}
    for m in (first, second):
        m["share_gpus"] = True
        m["gpu_memory_utilization"] = 0.4
    d["models"] = [first, second]
    p = tmp_path / "shared.yml"
    p.write_text(yaml.safe_dump(d))
    out = render(tmp_path, p)
    host = first["host"]
    drop = _unit(out, host, "vllm@second.service.d/10-fleet.conf")
    assert f"After=vllm@{first['name']}.service" in drop.splitlines()
    assert "After=" not in _unit(out, host, f"vllm@{first['name']}.service.d/10-fleet.conf")


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="systemd-analyze not installed")
@pytest.mark.parametrize("example", ["tiny-cpu.yml", "seed-004-4xa100.yml"])
def test_systemd_analyze_verify_is_clean(tmp_path: Path, example: str) -> None:
    # point the venv at this interpreter's prefix so ExecStart's binary exists for verify
    out = render(tmp_path, spec_file(tmp_path, example, paths={"venv": sys.prefix}))
    checked = 0
    for sysdir in out.glob("*/etc/systemd/system"):
        units = [sysdir / "vllm-fleet.target"] + [
            sysdir / d.name[:-2] for d in sysdir.glob("vllm@*.service.d")
        ]
        env = {**os.environ, "SYSTEMD_UNIT_PATH": f"{sysdir}:"}
        r = subprocess.run(
            ["systemd-analyze", "verify", *map(str, units)],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        noise = [ln for ln in (r.stdout + r.stderr).splitlines() if "vllm-fleet-exporter" not in ln]
        assert r.returncode == 0 and noise == [], r.stdout + r.stderr
        checked += len(units)
    assert checked >= 2


def test_a_liveness_check_reads_the_ports_connections_and_the_api_servers_cpu_apart() -> None:
    """``Launcher._check`` hands the supervisor the work counters and, around them, the engine port's
    connections (``churn.read_port``) and the process group's CPU figures with its leader's apart."""
    import http.server
    import socket
    import threading

    from vllm_fleet.host.launcher import Launcher
    from vllm_fleet.host.launcher_state import Check

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            raw = b'vllm:num_requests_running{engine="0"} 3\nvllm:generation_tokens_total{engine="0"} 9\n'
            self.send_response(200)
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def log_message(self, *a: object) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    port = srv.server_address[1]
    idle_client = socket.create_connection(("127.0.0.1", port), timeout=5)  # a lane that sends nothing yet
    engine = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        cfg = InstanceConfig(name="a", served_model_name="m", model_path="/m", port=port, command=["x"])
        launcher = Launcher(cfg, Notifier(""))
        launcher.proc = engine
        seen: list[Check] = []
        launcher.sm.check_done = lambda now, check: seen.append(check) or []  # type: ignore[method-assign]
        launcher._check()(time.monotonic())
        (check,) = seen
        assert check.reading is not None and check.reading.running == 3 and check.answer is None
        for conns in (check.conns_before, check.conns_after):
            assert conns is not None and conns.established >= 1, conns
        for cpu in (check.cpu_before, check.cpu_after):
            assert cpu.pids == (engine.pid,) and cpu.api_ran == cpu.ran and cpu.core_ran == 0
    finally:
        engine.kill()
        engine.wait()
        idle_client.close()
        srv.shutdown()
