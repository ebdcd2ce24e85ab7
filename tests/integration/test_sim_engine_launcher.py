"""The launcher (`vllm-fleet launch`) runs the sim engine from an instance config's ``command``, as it runs
vLLM: phases while loading, READY=1 after a real completion, watchdog pings; the sim's controls make it
stalled (the probe says so from the work counters), and SIGTERM drains to exit 0. Seconds, no vLLM."""

from __future__ import annotations

import signal
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from vllm_fleet.devtools.gateway_testing import wait_for
from vllm_fleet.devtools.launched import LaunchedInstance, launch
from vllm_fleet.devtools.testing import SIM_LAUNCHER_SERVICE, free_port, http_json, sim_engine_argv
from vllm_fleet.host import probe


@pytest.fixture
def launched(sim_model_dir: Path, tmp_path: Path) -> Iterator[LaunchedInstance]:
    port = free_port()
    cfg = {
        "name": "sim", "served_model_name": "sim-served", "model_path": str(sim_model_dir),
        "listen_address": "127.0.0.1", "port": port,
        "command": sim_engine_argv(sim_model_dir, port, "sim-served", shutdown_timeout=10, load_seconds=3),
        "shutdown_timeout": 10, "state_dir": str(tmp_path / "state"), "service": SIM_LAUNCHER_SERVICE,
    }  # fmt: skip
    r = launch(tmp_path, "sim", cfg, new_session=True)
    try:
        yield r
    finally:
        r.kill()


def test_launcher_runs_the_sim_engine(launched: LaunchedInstance) -> None:
    r = launched
    i_ready = r.notify.wait_for("READY", "1", timeout=60)
    statuses = [f["STATUS"] for _, f in r.notify.messages[:i_ready] if "STATUS" in f]
    phases = {s.split(": ", 1)[1].rsplit(" (", 1)[0] for s in statuses if s.startswith("Loading")}
    assert len(phases) >= 2, statuses  # parsed from the sim's vLLM-style log lines
    r.notify.wait_for("WATCHDOG", "1", since=i_ready + 1, timeout=10)
    # busy and stalled: requests running, the engine core stopped → the probe fails with "stalled"
    body = {"model": "sim-served", "prompt": "x", "max_tokens": 500, "ignore_eos": True}
    lanes = [
        threading.Thread(target=http_json, args=("POST", r.url + "/v1/completions", body), daemon=True)
        for _ in range(2)
    ]
    for t in lanes:
        t.start()
    assert wait_for(lambda: (http_json("GET", r.url + "/sim/control")[1] or {}).get("running") == 2, 10)
    n = len(r.notify.messages)
    assert http_json("POST", r.url + "/sim/control", {"stall": True})[0] == 200

    def stalled() -> bool:
        return any("stalled" in f.get("STATUS", "") for _, f in r.notify.messages[n:])

    assert wait_for(stalled, 20), r.notify.values("STATUS")[-5:]
    assert http_json("POST", r.url + "/sim/control", {"stall": False})[0] == 200
    # SIGTERM: the launcher drains the two in-flight requests (they finish), then the engine exits 0
    r.proc.send_signal(signal.SIGTERM)
    for t in lanes:
        t.join(30)
    assert r.proc.wait(40) == 0, r.output()[-2000:]
    assert "STOPPING" in {key for _, f in r.notify.messages for key in f}


def test_controls_make_it_hung_or_dead(sim_engine_factory: Any) -> None:
    """``hang``: connections are accepted, nothing is answered (the probe's /metrics times out);
    ``die``: the process exits at once with the code asked for."""
    hung = sim_engine_factory()
    assert hung.control(hang=True, timeout=2) == (0, None)
    with socket.create_connection(("127.0.0.1", hung.port), timeout=2):
        pass  # the listening socket still accepts
    reading, answer = probe.progress("127.0.0.1", hung.port, timeout=1)
    assert reading is None and answer.timed_out, answer
    dead = sim_engine_factory()
    assert dead.proc is not None
    dead.control(die=3)
    assert dead.proc.wait(10) == 3
