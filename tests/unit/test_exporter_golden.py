"""The host exporter's exposition, byte for byte, against golden files (tests/unit/golden/exporter_*.prom).

The alerts, the dashboards and ``vllm-fleet status`` read these series by name, labels and value: a change of a
metric name, a label, a HELP text, a value or the order of the families shows here as a diff. One fixture host
feeds every collector: instance configs and launcher state files (a broken one too), a multi-node worker's
config and state files (one whose process is gone), the gateway's access log, the deployment manifest, the
drained set, keepalived's VRRP state (a gateway of two or more), LoRA instances' adapters files and adapter state
files, an instance whose model sleeps (asleep, then awake after a wake), systemd's ``NRestarts`` (``systemctl show``,
faked) and NVML (a fake ``pynvml`` with two GPUs and XID events). The exporter's wall clock is fixed (``CLOCK``); the
scrape duration, the one value that cannot repeat, is masked.

After an intended change of the exposition: ``VF_UPDATE_GOLDEN=1 pytest tests/unit/test_exporter_golden.py``
rewrites the golden files; review their diff.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from vllm_fleet.host.exporter import (
    AccessLogTail,
    Deployment,
    FleetCollector,
    Nvml,
    StateFiles,
    SystemdRestarts,
    VrrpState,
    add_args,
    build_registry,
    states,
)

GOLDEN = Path(__file__).parent / "golden"
CLOCK = 1795940400.0  # the exporter's wall clock at every scrape (time asleep, stale adapter state files)
DURATION = re.compile(r"^(vllm_fleet_exporter_scrape_duration_seconds) \S+$", re.MULTILINE)

STATE = {
    "instance": "qwen3", "served_model_name": "qwen3-8b", "port": 8001, "state": "ready", "launcher_pid": 123,
    "engine_pid": 456, "started_at": 1795940000.1, "ready_at": 1795940030.2, "load_duration_seconds": 30.1,
    "phase": "serving", "last_probe_at": 1795940100.0, "last_probe_ok": True, "stack": "cpu-0.32.0-0123456789ab",
    "last_probe_latency_seconds": 0.071, "probes_total": 12, "probe_failures_total": 2, "probes_starved_total": 1,
    "updated_at": 1795940100.0,
    # the sleep keys of a model that does not sleep, as the launcher writes them: no sleep series
    "sleep_state": None, "sleep_level": None, "swap_group": None, "last_active_at": None, "asleep_since": None,
    "sleeps_total": 0, "wakes_total": 0, "failed_wakes_total": 0, "wake_seconds_total": 0.0,
    "last_wake_seconds": None, "asleep_seconds_total": 0.0, "last_wake_failure": None,
}  # fmt: skip
# a model that sleeps (level 1, swap group "pair"): asleep since 100 s before CLOCK, after 3 sleeps, 2 wakes and a
# failed one; 4000 s asleep in periods that ended
ASLEEP = {
    **STATE, "instance": "nap", "served_model_name": "nap-8b", "port": 8004, "sleep_state": "asleep",
    "sleep_level": 1, "swap_group": "pair", "last_active_at": 1795939990.0, "asleep_since": CLOCK - 100,
    "sleeps_total": 3, "wakes_total": 2, "failed_wakes_total": 1, "wake_seconds_total": 1.25,
    "last_wake_seconds": 0.5, "asleep_seconds_total": 4000.0, "last_wake_failure": "wake_up: HTTP 500",
}  # fmt: skip
# the same after a third wake of 0.75 s: awake, the period asleep folded into asleep_seconds_total
AWAKE = {
    **ASLEEP, "sleep_state": "awake", "asleep_since": None, "last_active_at": CLOCK, "wakes_total": 3,
    "wake_seconds_total": 2.0, "last_wake_seconds": 0.75, "asleep_seconds_total": 4100.0,
}  # fmt: skip
FAILED = {
    "instance": "a", "port": 8002, "state": "failed", "phase": "engine exited", "failure_reason": "OOM killed",
    "started_at": 1795940000.0, "last_probe_ok": False, "probes_total": 3, "probe_failures_total": 3,
    "updated_at": 1795940200.5,
}  # fmt: skip
WORKER = {
    "instance": "big", "served_model_name": "big-70b", "rank": 1, "nnodes": 3, "state": "joined",
    "since": 1795940050.5, "master": "10.0.0.1:28001", "worker_pid": os.getpid(), "engine_pid": 78, "exit_code": None,
    "reason": None, "updated_at": 1795940050.5,
}  # fmt: skip


def _access(status: Any, model: str | None, upstream: str = "127.0.0.1:8001", t: Any = 0.2) -> str:
    return json.dumps({"status": status, "model": model, "upstream_addr": upstream, "request_time": t}) + "\n"


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


@pytest.fixture
def host(tmp_path: Path) -> dict[str, Path]:
    """One host's files, as the launcher, the worker, the gateway and ``vllm-fleet manifest`` leave them."""
    st, cfg, wcfg = tmp_path / "run", tmp_path / "instances", tmp_path / "workers"
    for d in (st / "workers", cfg, wcfg):
        d.mkdir(parents=True)
    # LoRA instances: their configs name their adapters files (beside them: no instance configs themselves)
    lora = {"VLLM_FLEET_ADAPTERS_FILE": str(cfg / "qwen3.adapters.json")}
    (cfg / "qwen3.json").write_text(
        json.dumps({"name": "qwen3", "served_model_name": "qwen3-8b", "port": 8001, "environment": lora})
    )
    (cfg / "big.json").write_text(
        json.dumps({"name": "big", "served_model_name": "big-70b", "port": 8003, "nnodes": 3,
                    "environment": {"VLLM_FLEET_ADAPTERS_FILE": str(cfg / "big.adapters.json")}})
    )  # fmt: skip
    adapter = {"path": "/var/lib/vllm-fleet/models/adapters/x", "rank": 8}
    (cfg / "qwen3.adapters.json").write_text(
        json.dumps({"schema": 1, "instance": "qwen3", "model": "qwen3-8b", "adapters": [
            {**adapter, "name": "sql", "carry": True}, {**adapter, "name": "chat", "carry": True},
            {**adapter, "name": "spill", "carry": False}]})
    )  # fmt: skip
    (cfg / "big.adapters.json").write_text(
        json.dumps({"schema": 1, "instance": "big", "model": "big-70b",
                    "adapters": [{**adapter, "name": "legal", "carry": True}]})
    )  # fmt: skip
    # qwen3 is ready: its engine has sql and spill loaded (chat: 0); big is not ready and its file is stale
    (st / "adapters").mkdir()
    (st / "adapters" / "qwen3.json").write_text(
        json.dumps(
            {"instance": "qwen3", "model": "qwen3-8b", "loaded": ["sql", "spill"], "updated_at": 1795940100.0}
        )
    )
    (st / "adapters" / "big.json").write_text(
        json.dumps({"instance": "big", "model": "big-70b", "loaded": ["legal"], "updated_at": 1795940100.0})
    )
    (cfg / "zz-broken.json").write_text("{not json")
    (st / "qwen3.json").write_text(json.dumps(STATE))
    (cfg / "nap.json").write_text(json.dumps({"name": "nap", "served_model_name": "nap-8b", "port": 8004}))
    (st / "nap.json").write_text(json.dumps(ASLEEP))
    (st / "a.json").write_text(json.dumps(FAILED))  # no config: known from its state file only
    (st / "torn.json").write_text("[1, 2]")  # not an object: a read error
    (wcfg / "big.json").write_text(json.dumps({"name": "big", "served_model_name": "big-70b", "rank": 1}))
    (wcfg / "other.json").write_text(json.dumps({"name": "other", "served_model_name": "o", "rank": 2}))
    (st / "workers" / "big.json").write_text(json.dumps(WORKER))
    gone = {**WORKER, "instance": "gone", "served_model_name": "g", "rank": 2, "worker_pid": _dead_pid()}
    (st / "workers" / "gone.json").write_text(json.dumps(gone))
    (st / "workers" / "bad.json").write_text(json.dumps({**WORKER, "rank": "one"}))
    log = tmp_path / "access.log"
    log.write_text(
        _access(200, "qwen3-8b", t=0.04)
        + _access(200, "qwen3-8b", t=0.3)
        + _access(502, "qwen3-8b", "127.0.0.1:8001, 127.0.0.1:8002", 3.0)
        + _access(200, "big-70b", t=700.0)
        + _access(404, "", t="-")
        + _access("499", None, t=0.1)
        + "garbage\n"
        + _access("x", "qwen3-8b")
    )
    manifest = tmp_path / "manifest.json"
    manifest.write_text(
        json.dumps(
            {"spec_hash": "abc123", "profile": "cpu", "pinned_vllm": "0.32.0", "stack": {"vllm": "0.32.0"}}
        )
    )
    drained = tmp_path / "drained.json"
    drained.write_text(json.dumps({"drained": ["a", "qwen3"], "updated": 1795940000}))
    vrrp = tmp_path / "vrrp.json"  # keepalived's notify: this gateway holds the address (its keepalived runs)
    vrrp.write_text(
        json.dumps({"state": "MASTER", "type": "INSTANCE", "name": "vf_t", "priority": 100,
                    "since": 1795940010.25, "keepalived_pid": os.getpid()})
    )  # fmt: skip
    return {"state": st, "config": cfg, "workers": wcfg, "log": log, "manifest": manifest, "drained": drained,
            "vrrp": vrrp}  # fmt: skip


class _NVMLError(Exception):
    pass


class _NVMLErrorTimeout(_NVMLError):
    pass


def fake_pynvml() -> SimpleNamespace:
    """Two GPUs; GPU 1 has no memory v2 query and no ECC (NotSupported); three XID events, then the event
    thread ends (an error it logs)."""
    events: list[Any] = [
        _NVMLErrorTimeout(),
        SimpleNamespace(device=1, eventData=79),
        SimpleNamespace(device=0, eventData=48),
        SimpleNamespace(device=1, eventData=79),
    ]

    def wait(_es: object, _ms: int) -> object:
        if not events:
            raise RuntimeError("no more events (test)")
        e = events.pop(0)
        if isinstance(e, Exception):
            raise e
        return e

    def memory(h: int, version: object = None) -> object:
        if version is not None and h == 1:
            raise _NVMLError("Not Supported")
        reserved = 0 if version is not None else 600 << 20
        return SimpleNamespace(used=(h + 1) * (10 << 30) + reserved, total=141 << 30)

    def ecc(h: int, etype: int, _counter: int) -> int:
        if h == 1:
            raise _NVMLError("Not Supported")
        return 5 if etype == 0 else 0

    return SimpleNamespace(
        NVMLError=_NVMLError,
        NVMLError_Timeout=_NVMLErrorTimeout,
        nvmlEventTypeXidCriticalError=8,
        nvmlMemory_v2=0x2000028,
        NVML_TEMPERATURE_GPU=0,
        NVML_MEMORY_ERROR_TYPE_CORRECTED=0,
        NVML_MEMORY_ERROR_TYPE_UNCORRECTED=1,
        NVML_VOLATILE_ECC=0,
        nvmlInit=lambda: None,
        nvmlDeviceGetCount=lambda: 2,
        nvmlSystemGetDriverVersion=lambda: b"550.54.15",
        nvmlEventSetCreate=lambda: object(),
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceRegisterEvents=lambda h, t, es: None,
        nvmlDeviceGetUUID=lambda h: f"GPU-000{h}".encode(),
        nvmlEventSetWait_v2=wait,
        nvmlDeviceGetName=lambda h: b"NVIDIA H200",
        nvmlDeviceGetUtilizationRates=lambda h: SimpleNamespace(gpu=37 + h, memory=12),
        nvmlDeviceGetMemoryInfo=memory,
        nvmlDeviceGetTemperature=lambda h, sensor: 41 + h,
        nvmlDeviceGetPowerUsage=lambda h: 312_500 + h,
        nvmlDeviceGetEnforcedPowerLimit=lambda h: 700_000,
        nvmlDeviceGetTotalEccErrors=ecc,
    )


@pytest.fixture
def nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml())


@pytest.fixture(autouse=True)
def clock(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(states, "wall_clock", lambda: CLOCK)


def _xid_thread_done() -> None:
    for t in threading.enumerate():
        if t.name == "nvml-xid":
            t.join(10)
            assert not t.is_alive()


class FakeSystemctl:
    """``systemctl show --property=Id,NRestarts UNIT...``: NRestarts 2 for vllm@, 5 for vllm-worker@ units
    (the units of names without a state file or config answer too, as systemd does); ``fail`` makes it refuse."""

    def __init__(self) -> None:
        self.fail = ""

    def __call__(self, cmd: list[str], **_kw: object) -> subprocess.CompletedProcess[str]:
        assert cmd[:3] == ["systemctl", "show", "--property=Id,NRestarts"], cmd
        if self.fail:
            return subprocess.CompletedProcess(cmd, 1, "", self.fail)
        units = cmd[3:]
        out = "\n\n".join(f"Id={u}\nNRestarts={5 if u.startswith('vllm-worker@') else 2}" for u in units)
        return subprocess.CompletedProcess(cmd, 0, out + "\n", "")


def render(registry: CollectorRegistry) -> str:
    return DURATION.sub(r"\1 <masked>", generate_latest(registry).decode())


def check(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("VF_UPDATE_GOLDEN"):
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    assert text == path.read_text(), f"the exposition differs from {path}"


def test_the_full_exposition_is_unchanged(
    host: dict[str, Path], nvml: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every collector on one host, systemd answering and then failing, the access log growing between two
    scrapes."""
    systemctl = FakeSystemctl()
    monkeypatch.setattr(subprocess, "run", systemctl)
    gpu = Nvml()
    assert gpu.available
    _xid_thread_done()
    registry = CollectorRegistry()
    registry.register(
        FleetCollector(
            host["state"],
            host["config"],
            AccessLogTail(host["log"], from_start=True),
            gpu,
            use_systemd=True,
            drain_state=host["drained"],
            manifest=host["manifest"],
            worker_config_dir=host["workers"],
            vrrp_state=host["vrrp"],
        )
    )
    first = render(registry)
    systemctl.fail = "Failed to get properties: Transport endpoint is not connected\n"
    with host["log"].open("a") as f:
        f.write(
            _access(200, "qwen3-8b", t=1.5)
            + _access(503, "big-70b", "10.0.0.2:8003, 10.0.0.3:8003", 0.5)
            # admitted unlimited: the admission service did not answer (gateway.limits.on_failure open)
            + _access(200, "qwen3-8b", t=0.5)[:-2]
            + ', "admission": "open"}\n'
        )
    (host["state"] / "qwen3.json").write_text(json.dumps({**STATE, "state": "draining", "probes_total": 13}))
    (host["state"] / "nap.json").write_text(json.dumps(AWAKE))
    second = render(registry)
    check("exporter_full.prom", f"{first}# ---- second scrape: systemd fails, the log grew\n{second}")


def test_the_exposition_of_the_clis_arguments_is_unchanged(
    host: dict[str, Path], nvml: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``build_registry`` from ``vllm-fleet exporter``'s own parser (no systemd on this host: no systemctl)."""
    monkeypatch.setattr(shutil, "which", lambda *_a, **_k: None)
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("systemctl called without systemd"))
    parser = argparse.ArgumentParser()
    add_args(parser)
    args = parser.parse_args(
        ["--state-dir", str(host["state"]), "--config-dir", str(host["config"]),
         "--worker-config-dir", str(host["workers"]), "--access-log", str(host["log"]), "--access-log-from-start",
         "--drain-state", str(host["drained"]), "--manifest", str(host["manifest"]), "--vrrp-state", str(host["vrrp"])]
    )  # fmt: skip
    registry = build_registry(args)
    _xid_thread_done()
    check("exporter_cli.prom", render(registry))
    # without the optional inputs: no access-log, deployment, VRRP or GPU series at all
    bare = parser.parse_args(
        ["--state-dir", str(host["state"]), "--config-dir", str(host["config"]), "--worker-config-dir", "",
         "--no-nvml", "--access-log", "", "--drain-state", "", "--manifest", ""]
    )  # fmt: skip
    check("exporter_bare.prom", render(build_registry(bare)))


def _families(*collectors: Collector) -> dict[str, list[Any]]:
    registry = CollectorRegistry()
    for c in collectors:
        registry.register(c)
    text = DURATION.sub(r"\1 0", generate_latest(registry).decode())
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def test_each_collector_owns_its_series(
    host: dict[str, Path], nvml: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each collector registered on its own exports its own series and nobody else's; together they export
    what the exporter's composition does (less the scrape duration, the composition's own)."""
    monkeypatch.setattr(subprocess, "run", FakeSystemctl())
    gpu = Nvml()
    _xid_thread_done()
    states = StateFiles(host["state"], host["config"], host["workers"])
    parts = {
        "states": _families(states),
        "systemd": _families(SystemdRestarts(states)),
        "access_log": _families(AccessLogTail(host["log"], from_start=True)),
        "deployment": _families(Deployment(host["manifest"], host["drained"])),
        "vrrp": _families(VrrpState(host["vrrp"])),
        "nvml": _families(gpu),
    }
    whole = _families(
        FleetCollector(
            host["state"],
            host["config"],
            AccessLogTail(host["log"], from_start=True),
            gpu,
            use_systemd=True,
            drain_state=host["drained"],
            manifest=host["manifest"],
            worker_config_dir=host["workers"],
            vrrp_state=host["vrrp"],
        )
    )
    assert whole.pop("vllm_fleet_exporter_scrape_duration_seconds")
    names = [n for fams in parts.values() for n in fams]
    assert len(names) == len(set(names))  # no series in two collectors
    assert {n: s for fams in parts.values() for n, s in fams.items()} == whole
    assert "vllm_fleet_exporter_read_errors" in parts["states"]
    assert "vllm_fleet_exporter_systemd_errors" in parts["systemd"]
    assert set(parts["deployment"]) == {"vllm_fleet_deployed_info", "vllm_fleet_gateway_drained"}
    assert all(n.startswith("vllm_fleet_gateway_") for n in parts["access_log"])
    assert all(n.startswith("vllm_fleet_gpu_") for n in parts["nvml"])
    assert all(n.startswith("vllm_fleet_gateway_vrrp_") for n in parts["vrrp"]) and len(parts["vrrp"]) == 3
    # a host without GPUs: the NVML collector exports nothing
    monkeypatch.setitem(sys.modules, "pynvml", None)
    assert _families(Nvml()) == {}
