"""The launcher's decisions (``vllm_fleet.host.launcher_state.Supervisor``) driven with a fake clock: plain
numbers for the time, every event fed by hand, the actions compared exactly (what the launcher would send,
write, start, signal, and when)."""

from __future__ import annotations

import ast
import itertools
import re
import signal
from pathlib import Path

import pytest
from launcher_clock import Clock

from vllm_fleet.contracts import ADAPTERS_FILE_ENV, InstanceConfig, ServiceConfig
from vllm_fleet.host.churn import FLOOD_JUDGE_AFTER, Conns
from vllm_fleet.host.cpu_wait import CpuReading
from vllm_fleet.host.engine_death import DeathWatch
from vllm_fleet.host.launcher_state import (
    CHECK_MARGIN,
    EXIT_CONFIG,
    EXIT_ENGINE_DIED,
    EXIT_LOAD_TIMEOUT,
    EXIT_WATCHDOG,
    Action,
    AdapterLoad,
    Check,
    Exit,
    Kill,
    LoadAdapters,
    Log,
    Notify,
    PollInflight,
    RefreshAdapters,
    Save,
    SaveAdapters,
    StartProbe,
    Supervisor,
    Terminate,
    next_check_at,
    state_file,
)
from vllm_fleet.host.probe import ProbeResult, Progress

PID = 4242
WALL0 = 1_700_000_000.0  # the wall clock when the launcher started (the state file's times)
PING = Notify(("WATCHDOG=1",))


def config(**service: float) -> InstanceConfig:
    svc = {
        "watchdog_seconds": 30,
        "probe_interval_seconds": 10,
        "probe_timeout_seconds": 5,
        "starved_grace_seconds": 25,
        "start_timeout_seconds": 60,
        "load_timeout_seconds": 600,
        "stall_timeout_seconds": 120,
        "stop_kill_after_loading_seconds": 5,
    } | service
    return InstanceConfig(
        name="a", served_model_name="m", model_path="/m", port=9101, command=["x"], shutdown_timeout=20,
        service=ServiceConfig(**svc),
    )  # fmt: skip


def statuses(actions: list[Action]) -> list[str]:
    return [f[7:] for a in actions if isinstance(a, Notify) for f in a.fields if f.startswith("STATUS=")]


def logs(actions: list[Action]) -> list[str]:
    return [a.message for a in actions if isinstance(a, Log)]


def cpu(at: float, waited: float = 0.0, ran: float = 0.0, stopped: tuple[int, ...] = ()) -> CpuReading:
    return CpuReading(at=at, waited=waited, ran=ran, pids=(PID, PID + 1), stopped=stopped, counted=True)


def busy(at: float, work: float) -> Progress:
    return Progress(running=32, waiting=500, work=work, at=at)


def started(now: float, **service: float) -> tuple[Supervisor, Clock]:
    sm = Supervisor(config(**service), service.get("watchdog_seconds", 30), now, WALL0)
    c = Clock(sm, now)
    c.feed(sm.engine_started(now, PID))
    return sm, c


def ready(at: float, **service: float) -> tuple[Supervisor, Clock]:
    """Started 3 s before ``at``, READY=1 at ``at``."""
    sm, c = started(at - 3.0, **service)
    c.tick_to(at - 2.0)
    assert sm.probing
    c.at(at).feed(sm.ready_probe_done(at, ProbeResult(True, 0.2, "", "decode")))
    assert sm.state == "ready"
    return sm, c


def check_at(c: Clock, start: float, latency: float, check: Check) -> list[Action]:
    """Tick to ``start``, where the next liveness check must begin, then answer it ``latency`` later."""
    assert StartProbe(first=False) not in c.tick_to(start - 0.25), "a check began early"
    assert c.tick_to(start)[-1:] == [StartProbe(first=False)], f"no check began at {start}"
    return c.at(start + latency).feed(c.sm.check_done(start + latency, check))


# --------------------------------------------------------------------------------------- the timing rule


def test_the_probe_timing_comes_from_the_contracts_rule() -> None:
    """Interval at most W/3, timeout at most 0.8·W (``contracts.probe_timing``); no watchdog, no limit."""
    sm = Supervisor(config(probe_interval_seconds=12, probe_timeout_seconds=25), 30, 0.0)
    assert (sm.probe_interval, sm.probe_timeout) == (10, 24)
    sm = Supervisor(config(probe_interval_seconds=12, probe_timeout_seconds=25), 0, 0.0)
    assert (sm.probe_interval, sm.probe_timeout, sm.watchdog) == (12, 25, 0.0)
    assert Supervisor(config(), -1, 0.0).watchdog == 0.0


# --------------------------------------------------------------------------------------- start → ready


def test_ready_only_after_the_model_answers() -> None:
    sm, c = started(100.0)
    assert [a for _, a in c.seen] == [Log(f"engine pid {PID}; watchdog 30s, probe every 10s"), Save()]
    first = c.tick_to(100.25)
    assert first == [
        Notify(("STATUS=Loading m: starting (0s elapsed)", "EXTEND_TIMEOUT_USEC=60000000")),
        Save(),
    ]
    assert c.tick_to(100.75) == []  # the first probe 1 s after the start, the status every 2 s
    assert c.tick_to(101.0) == [StartProbe(first=True)]
    assert c.tick_to(101.75) == []  # one probe at a time
    # /health refused: not ready, the next probe 0.5 s after the answer
    assert c.at(101.8).feed(sm.ready_probe_done(101.8, ProbeResult(False, 0.0, "refused", "health"))) == []
    sm.engine_output(102.0, ["loading weights", "weights loaded"])
    assert c.tick_to(102.25) == [
        Notify(("STATUS=Loading m: weights loaded (2s elapsed)", "EXTEND_TIMEOUT_USEC=60000000")),
        Save(),
    ]
    assert c.tick_to(102.5) == [StartProbe(first=True)]  # 101.8 + 0.5, on the next tick
    # health 200 but an admission 503 instead of a decode: not ready either
    assert c.at(102.6).feed(sm.ready_probe_done(102.6, ProbeResult(True, 0.1, "", "full"))) == []
    assert sm.state == "loading" and sm.phase == "waiting for the first decode"
    assert c.tick_to(103.0) == []
    assert c.tick_to(103.25) == [StartProbe(first=True)]
    assert not any(isinstance(a, Notify) and "READY=1" in a.fields for _, a in c.seen)
    # the 1-token decode answers: READY=1, after the state file is written, with the first ping
    got = c.at(103.5).feed(sm.ready_probe_done(103.5, ProbeResult(True, 0.2, "", "decode")))
    assert got == [
        Save(),
        Notify(("READY=1", "STATUS=Serving m on 127.0.0.1:9101 (ready in 3.5s)")),
        PING,
        Log("ready after 3.5s (health 200 and 1-token decode ok)"),
    ]
    st = state_file(sm, 7, WALL0 + 4)
    assert st["state"] == "ready" and st["phase"] == "serving" and st["load_duration_seconds"] == 3.5
    assert st["ready_at"] == WALL0 + 3.5 and st["last_probe_at"] == WALL0 + 3.5 and st["engine_pid"] == PID
    assert st["probes_total"] == 1 and st["last_probe_ok"] is True and st["last_probe_kind"] == "decode"
    assert sm.watchdog_deadline == 133.5
    # the first liveness check one interval after READY, not before
    assert c.tick_to(113.25) == []
    assert c.tick_to(113.5) == [StartProbe(first=False)]


def test_a_load_that_stops_printing_times_out_at_the_stall_limit() -> None:
    sm, c = started(0.0)
    sm.engine_output(10.25, [])
    c.tick_to(
        132.0
    )  # status rounds every 2 s from 0.25: the one at 130.25 finds exactly 120 s without output
    assert sm.state == "loading" and not any(isinstance(a, Exit) for _, a in c.seen)
    got = c.tick_to(134.0)  # the one at 132.25 finds 122 s: over the limit
    assert got[0] == Kill(wait=True) and got[-1] == Exit(EXIT_LOAD_TIMEOUT)
    assert statuses(got) == ["Failed: load timeout: no engine output for more than 120s"]
    assert c.times(Kill(wait=True)) == [132.25]
    assert sm.state == "failed"


# --------------------------------------------------------------------------------------- busy is not hung


def test_a_busy_engine_with_slow_checks_is_alive_while_its_counters_advance() -> None:
    sm, c = ready(at=3.0)
    # 532 requests, no decode probe: /metrics answers slowly (4 s of a 5 s timeout), the counters advance
    got = check_at(c, 13.0, 4.0, Check(4.0, cpu(13), cpu(17), busy(13, 1000)))
    assert got == [Save(), PING] and sm.probes.last_kind == "baseline"
    got = check_at(c, 23.0, 4.0, Check(4.0, cpu(23), cpu(27), busy(23, 1400)))
    assert got == [Save(), PING] and sm.probes.last_kind == "progress"
    assert sm.watchdog_deadline == 27.0 + 30
    # the counters stand still and the engine got its CPU: hung, no ping
    got = check_at(c, 33.0, 4.0, Check(4.0, cpu(33, ran=1), cpu(37, ran=5), busy(33, 1400)))
    assert PING not in got and got[0] == Save()
    (msg,) = statuses(got)
    assert msg.startswith("Probe failing (1x): stalled: 32 running, 500 waiting, no token or step for 10s")
    assert "not starved" in msg and sm.probes.last_ok is False and sm.probes.failures == 1
    assert sm.watchdog_deadline == 57.0  # systemd's watchdog, 30 s after the last ping
    # they advance again: pinged, and the status says serving again
    got = check_at(c, 43.0, 4.0, Check(4.0, cpu(43), cpu(47), busy(43, 1500)))
    assert got == [Save(), PING, Log("probes succeed again"), Notify(("STATUS=Serving m on 127.0.0.1:9101",))]
    assert sm.probes.consecutive_failures == 0 and sm.watchdog_deadline == 77.0


# --------------------------------------------------------------------------------------- hung is hung


def test_a_starved_engine_passes_until_the_grace_ends_then_is_judged_hung() -> None:
    """Decode probes time out while the engine's threads wait for a CPU: ``starved`` passes (pings) while the
    last answer of its own is at most starved_grace_seconds (25) old; the first check after that fails."""
    sm, c = ready(at=0.0)
    timeout = ProbeResult(False, 5.0, "/v1/completions: TimeoutError: timed out", "decode", True)

    def starved_check(t: float) -> Check:
        return Check(5.0, cpu(t, waited=0.0), cpu(t + 5, waited=4.0), Progress(0, 0, 10, t), timeout)

    got = check_at(c, 10.0, 5.0, starved_check(10.0))  # 15 s since the engine last answered
    assert got[:2] == [Save(), PING] and statuses(got) == ["Serving m slowly: starved of CPU"]
    assert logs(got)[0].startswith("Probe late, engine alive: starved of CPU: its threads waited 4.0s")
    got = check_at(c, 20.0, 5.0, starved_check(20.0))  # 25 s: the grace's last second
    assert got[:2] == [Save(), PING] and sm.probes.starved == 2
    got = check_at(c, 30.0, 5.0, starved_check(30.0))  # 35 s: over
    assert PING not in got
    assert statuses(got) == [
        "Probe failing (1x): /v1/completions: TimeoutError: timed out (starved of CPU: its threads waited 4.0s "
        "for a CPU and ran 0.0s in 5.0s, but no answer of its own for 35s (> starved_grace_seconds 25))"
    ]
    assert c.times(PING) == [0.0, 15.0, 25.0] and sm.watchdog_deadline == 55.0
    assert state_file(sm, 7, 0.0)["probes_starved_total"] == 2


# --------------------------------------------------------------------------------------- connection churn

METRICS_TIMEOUT = ProbeResult(False, 5.0, "/metrics: TimeoutError: timed out", "metrics", True)
FLOOD = Conns(pending=120, established=2000)


def churn_check(
    t: float, api: float, core: float, conns: Conns = FLOOD, stopped: tuple[int, ...] = (), took: float = 5.0
) -> Check:
    """``/metrics`` unanswered for ``took`` s (its 5 s timeout, or the flood judgement's 1 s) while the API
    server ran ``api`` and the engine core ``core`` seconds."""
    before = CpuReading(t, 0.0, 1000.0, (PID, PID + 1), (), True, api_ran=400.0)
    after = CpuReading(t + took, 0.0, 1000.0 + api + core, (PID, PID + 1), stopped, True, api_ran=400.0 + api)
    answer = METRICS_TIMEOUT if took == 5.0 else ProbeResult(False, took, f"/metrics: no answer in {took:.1f}s",
                                                             "metrics", True)  # fmt: skip
    return Check(took, before, after, None, answer, conns, conns)


def test_a_flooded_api_server_with_a_working_engine_core_keeps_the_pings_going() -> None:
    """2,000 new-connection lanes: every ``/metrics`` times out, the API server is on a CPU the whole time, the
    engine core works: pinged after every check, one probe interval (= WatchdogSec / 3) apart."""
    sm, c = ready(at=3.0)
    assert check_at(c, 13.0, 4.0, Check(4.0, cpu(13), cpu(17), busy(13, 1000))) == [Save(), PING]
    got = check_at(c, 23.0, 5.0, churn_check(23.0, api=4.9, core=5.0))
    assert got[:2] == [Save(), PING] and statuses(got) == ["Serving m under connection churn"]
    assert logs(got) == [
        "Probe late, engine alive: flooded with connections, engine core working: API server ran 4.9s, engine "
        "core 5.0s in 5.0s; 120 connection(s) waiting to be accepted, 2000 established; /metrics: TimeoutError: "
        "timed out"
    ]
    for t in range(33, 133, 10):
        got = check_at(c, float(t), 5.0, churn_check(float(t), api=4.0, core=3.0))
        assert got[:2] == [Save(), PING] and sm.probes.last_kind == "flooded", t
    pings = c.times(PING)
    assert pings == [3.0, 17.0, *range(28, 138, 10)]  # under the flood: 10 s apart, a third of WatchdogSec
    assert sm.probes.consecutive_failures == 0 and sm.probes.starved == 0
    # /metrics answers again with the counters advanced: an answer of its own, the status says serving
    got = check_at(c, 133.0, 1.0, Check(1.0, cpu(133), cpu(134), busy(133, 90000)))
    assert got == [Save(), PING, Log("probes succeed again"), Notify(("STATUS=Serving m on 127.0.0.1:9101",))]


def test_a_flood_that_begins_after_an_idle_check_is_busy_from_its_first_check() -> None:
    """The last reading showed no requests (the decode answered); then 2,000 lanes connect at once and neither
    ``/metrics`` nor the decode is answered: the port and the two processes are the evidence."""
    sm, c = ready(at=3.0)
    idle = Check(0.5, cpu(13), cpu(13.5), Progress(0, 0, 10, 13), ProbeResult(True, 0.5, "", "decode"))
    assert check_at(c, 13.0, 0.5, idle) == [Save(), PING]
    # the quick check is followed early enough (10 - 1.5 + 0.5 s) that a flooded one, judged after 1 s and
    # some reading of /proc, still pings within the interval (a third of WatchdogSec) of the last ping
    got = check_at(c, 22.0, 1.5, churn_check(22.0, api=1.0, core=0.9, took=1.5))
    assert got[:2] == [Save(), PING] and sm.probes.last_kind == "flooded"
    assert c.times(PING)[-2:] == [13.5, 23.5]
    # flooded from now on: each check takes the flood judgement's time, one interval after the last start
    for t in (32.0, 42.0, 52.0):
        got = check_at(c, t, 1.5, churn_check(t, api=1.0, core=0.9, took=1.5))
        assert got[:2] == [Save(), PING]
    pings = c.times(PING)
    assert max(b - a for a, b in itertools.pairwise(pings[1:])) <= sm.probe_interval == 10.0


def test_the_next_check_starts_early_enough_for_a_flooded_one_to_ping_within_an_interval() -> None:
    """``next_check_at``: an interval after the last start, less what a flood-judged check may take beyond
    this one; never sooner than half an interval after this one ended."""
    budget = FLOOD_JUDGE_AFTER + CHECK_MARGIN
    assert next_check_at(100.0, 100.1, 10.0) == pytest.approx(110.0 - budget + 0.1)
    assert next_check_at(100.0, 101.6, 10.0) == 110.0  # a check that took the budget or longer: the interval
    assert next_check_at(100.0, 105.0, 10.0) == 110.0
    assert next_check_at(100.0, 109.0, 10.0) == 114.0  # a slow check: half an interval after it ended
    assert next_check_at(100.0, 100.0, 2.0) == 101.0  # a short interval: half of it
    for d in (0.0, 0.3, 0.9, 1.5):  # quick, then flood-judged: the two pings an interval apart at most
        assert next_check_at(0.0, d, 10.0) + budget - d <= 10.0 + 1e-9


def test_both_processes_idle_with_requests_pending_is_hung_at_the_first_check() -> None:
    """Requests in flight, the port flooded, but neither process runs (a deadlock): no ping from the first
    failed check, and systemd's watchdog fires WatchdogSec after the last one, as for any hang."""
    sm, c = ready(at=3.0)
    check_at(c, 13.0, 4.0, Check(4.0, cpu(13), cpu(17), busy(13, 1000)))
    got = check_at(c, 23.0, 5.0, churn_check(23.0, api=0.1, core=0.0))
    assert PING not in got
    (msg,) = statuses(got)
    assert msg.startswith("Probe failing (1x): /metrics: TimeoutError: timed out (not starved: ")
    assert msg.endswith("; API server not busy: API server ran 0.1s, engine core 0.0s in 5.0s; 120 connection(s) "
                        "waiting to be accepted, 2000 established)")  # fmt: skip
    got = check_at(c, 33.0, 5.0, churn_check(33.0, api=5.0, core=0.2))  # the loop spins, the core does not
    assert PING not in got and "engine core idle: " in statuses(got)[0]
    assert c.times(PING) == [3.0, 17.0] and sm.watchdog_deadline == 47.0
    got = c.at(47.0).feed(sm.watchdog_fired(47.0))
    assert got[0] == Kill(wait=True) and got[-1] == Exit(EXIT_WATCHDOG)


def test_under_churn_a_stopped_engine_core_or_no_flood_is_no_pass() -> None:
    _, c = ready(at=3.0)
    check_at(c, 13.0, 4.0, Check(4.0, cpu(13), cpu(17), busy(13, 1000)))
    got = check_at(c, 23.0, 5.0, churn_check(23.0, api=5.0, core=0.0, stopped=(PID + 1,)))
    assert statuses(got) == [
        f"Probe failing (1x): /metrics: TimeoutError: timed out (engine process {PID + 1} stopped (SIGSTOP?))"
    ]
    got = check_at(c, 33.0, 5.0, churn_check(33.0, api=5.0, core=5.0, conns=Conns(0, 12)))
    assert PING not in got and "; no connection flood: " in statuses(got)[0]
    assert c.times(PING) == [3.0, 17.0]


def test_kernel_evidence_alone_keeps_the_pings_going_for_at_most_ten_watchdog_periods() -> None:
    """An engine core spinning in a wait that never ends burns CPU like one that works: without an answer of its
    own for more than 10 × WatchdogSec (300 s), a flooded check fails."""
    sm, c = ready(at=3.0)
    check_at(c, 13.0, 4.0, Check(4.0, cpu(13), cpu(17), busy(13, 1000)))  # its last answer, at 17
    for t in range(23, 313, 10):  # passes at 28 ... 308: at most 291 s after it
        assert PING in check_at(c, float(t), 5.0, churn_check(float(t), api=5.0, core=5.0)), t
    got = check_at(c, 313.0, 5.0, churn_check(313.0, api=5.0, core=5.0))  # 301 s
    assert PING not in got
    assert statuses(got)[0].endswith(", but no answer of its own for 301s (> 300s))")
    assert sm.watchdog_deadline == 308.0 + 30


def test_a_hung_engine_stops_the_pings_at_the_first_failed_check_and_the_watchdog_kills_it() -> None:
    sm, c = ready(at=0.0)
    ok = Check(1.5, cpu(10), cpu(11.5), Progress(0, 0, 10, 10), ProbeResult(True, 1.5, "", "decode"))
    assert check_at(c, 10.0, 1.5, ok) == [Save(), PING]
    # stopped with SIGSTOP: the decode times out, the kernel says stopped (not starved): a failure, no ping
    timeout = ProbeResult(False, 5.0, "/v1/completions: TimeoutError: timed out", "decode", True)
    stopped = Check(5.0, cpu(20), cpu(25, stopped=(PID,)), Progress(0, 0, 10, 20), timeout)
    got = check_at(c, 20.0, 5.0, stopped)
    assert statuses(got) == [f"Probe failing (1x): {timeout.error} (engine process {PID} stopped (SIGSTOP?))"]
    assert c.times(PING) == [0.0, 11.5] and sm.watchdog_deadline == 41.5
    # the next check hangs in the launcher's thread: counted as failed once it outlives timeout + 5 s
    assert c.tick_to(30.0)[-1:] == [StartProbe(first=False)]
    assert c.tick_to(40.0) == []
    got = c.tick_to(40.25)
    assert got == [Notify(("STATUS=Probe failing (2x): probe stuck",)), Save()]
    assert sm.probes.consecutive_failures == 2 and PING not in [a for t, a in c.seen if t > 11.5]
    # systemd's watchdog fires at the deadline (SIGABRT): kill the group, exit 134
    got = c.at(41.5 + 0.25).feed(sm.watchdog_fired(c.now))
    assert got[0] == Kill(wait=True) and got[-1] == Exit(EXIT_WATCHDOG) == Exit(134)
    assert sm.state == "failed" and "watchdog timeout" in sm.failure_reason


def test_an_error_answer_is_a_failure_even_on_a_starved_host() -> None:
    _, c = ready(at=0.0)
    err = ProbeResult(False, 0.2, "/v1/completions: HTTP 500: boom", "decode")
    got = check_at(c, 10.0, 0.2, Check(0.2, cpu(10), cpu(10.2, waited=0.2), Progress(0, 0, 1, 10), err))
    assert statuses(got) == ["Probe failing (1x): /v1/completions: HTTP 500: boom"] and PING not in got


# --------------------------------------------------------------------------------------- stop and drain


def drain(sm: Supervisor, c: Clock, inflight: dict[float, int], until: float) -> None:
    """Tick to ``until``, answering each in-flight count at once with the figure ``inflight`` gives from the
    last time at or before now."""
    assert sm.stop is not None
    while True:
        if sm.stop.polling:
            c.feed(sm.drain_progress(c.now, inflight[max(t for t in inflight if t <= c.now)]))
        if c.now + 0.25 > until + 1e-9:
            return
        c.tick_to(c.now + 0.25)


def test_a_stop_waits_for_the_inflight_requests_then_terminates_and_exits() -> None:
    sm, c = ready(at=3.0)
    got = c.at(50.0).feed(sm.stop_requested(50.0))
    assert got == [
        Notify(("STOPPING=1", "STATUS=Stopping: draining (up to 20s)")),
        Save(),
        Log("stop requested: waiting for in-flight requests, then SIGTERM to the engine"),
        PollInflight(),
    ]
    assert sm.state == "draining" and sm.stopping
    drain(sm, c, {50.0: 3, 53.0: 0}, until=60.0)
    # counted every 0.5 s; the second 0 in a row (53.0, 53.5) ends the wait
    assert c.times(Terminate()) == [53.5]
    assert "drain wait over after 3.5s (idle): SIGTERM to the engine" in logs([a for _, a in c.seen])
    waits = statuses([a for t, a in c.seen if 50 <= t < 53])
    assert waits == ["Stopping: draining (up to 20s)"] + ["Stopping: waiting for 3 in-flight request(s)"] * 6
    # a check that was running when the stop came is not acted on
    assert c.feed(sm.check_done(60.0, Check(0.1, cpu(60), cpu(60), None, ProbeResult(True, 0.1)))) == []
    got = c.at(61.0).feed(sm.engine_exited(61.0, 0, None))
    assert got == [
        Kill(wait=False),
        Notify(("STATUS=Stopped (engine exit 0 after 11.0s)",)),
        Log("engine exited with 0 11.0s after the stop request"),
        Save(),
        Exit(0),
    ]
    assert sm.state == "stopped"


def test_the_drain_wait_is_bounded_by_the_shutdown_timeout_then_sigkill() -> None:
    sm, c = ready(at=3.0)
    c.at(50.0).feed(sm.stop_requested(50.0))
    drain(sm, c, {50.0: 2}, until=69.75)
    assert c.times(Terminate()) == []  # still within shutdown_timeout (20 s)
    drain(sm, c, {50.0: 2}, until=70.0)
    assert c.times(Terminate()) == [70.0] and sm.stop is not None and sm.stop.result == "still busy after 20s"
    # the engine outlives SIGTERM: SIGKILL to the group after shutdown_timeout + 10 s, once
    c.tick_to(100.0)
    assert c.times(Kill(wait=False)) == []
    c.tick_to(101.0)
    assert c.times(Kill(wait=False)) == [100.25]
    got = c.feed(sm.engine_exited(c.now, -9, None))
    assert got[-1] == Exit(137) and sm.state == "stopped"


def test_a_second_stop_request_ends_the_drain_wait() -> None:
    sm, c = ready(at=3.0)
    c.at(50.0).feed(sm.stop_requested(50.0))
    drain(sm, c, {50.0: 5}, until=52.0)
    got = c.feed(sm.stop_requested(52.0))
    assert got == [
        Log("drain wait over after 2.0s (second stop request): SIGTERM to the engine"),
        Terminate(),
    ]
    assert c.feed(sm.stop_requested(52.5)) == []  # SIGTERM once


def test_no_answer_from_metrics_ends_the_drain_wait() -> None:
    sm, c = ready(at=3.0)
    c.at(50.0).feed(sm.stop_requested(50.0))
    assert c.feed(sm.drain_progress(50.2, None))[-1] == Terminate() and sm.stop is not None
    assert sm.stop.result == "no answer from /metrics"


# --------------------------------------------------------------------------------------- exit during start


def test_a_stop_while_loading_terminates_at_once_and_kills_after_the_loading_limit() -> None:
    sm, c = started(0.0)
    c.tick_to(4.0)
    got = c.at(4.1).feed(sm.stop_requested(4.1))
    assert got[-2:] == [Log("stop requested while loading: SIGTERM to the engine"), Terminate()]
    c.tick_to(9.0)  # stop_kill_after_loading_seconds 5: 4.9 s after SIGTERM
    assert c.times(Kill(wait=False)) == []
    c.tick_to(9.25)
    assert c.times(Kill(wait=False)) == [9.25]
    assert sm.ready_probe_done(9.3, ProbeResult(True, 0.1, "", "decode")) == []  # no READY while stopping
    assert c.at(9.5).feed(sm.engine_exited(9.5, -9, None))[-1] == Exit(0)  # a requested stop is clean


def test_the_api_server_killed_while_loading_fails_with_its_signal() -> None:
    sm, c = started(0.0)
    c.tick_to(5.0)
    got = c.feed(sm.engine_exited(5.0, -9, None))
    assert got[0] == Kill(wait=False) and got[-1] == Exit(137)
    (msg,) = statuses(got)
    assert msg.startswith(
        f"Failed: engine exited unexpectedly: engine API server (pid {PID}) killed by SIGKILL"
    )
    assert msg.endswith("while loading")
    st = state_file(sm, 7, 5.0)
    assert st["state"] == "failed" and st["failure_signal"] == "SIGKILL"
    assert st["failure_process"] == f"engine API server (pid {PID})"


def test_a_worker_killed_by_sigill_while_loading_is_a_configuration_error() -> None:
    sm, c = started(0.0)
    w = DeathWatch()
    w.feed("Fatal Python error: Illegal instruction")
    w.feed("Worker proc VllmWorker-0 died unexpectedly (exit code: -4), shutting down executor.")
    got = c.at(3.0).feed(sm.engine_exited(3.0, None, w.cause()))  # the API server still runs
    assert got[0] == Kill(wait=True) and got[-1] == Exit(EXIT_CONFIG)
    assert sm.phase == "configuration error" and "not restarting" in sm.failure_reason
    assert state_file(sm, 7, 3.0)["failure_signal"] == signal.SIGILL.name


@pytest.mark.parametrize(("rc", "code"), [(0, EXIT_ENGINE_DIED), (2, 2)])
def test_an_engine_that_exits_on_its_own_is_restartable(rc: int, code: int) -> None:
    sm, c = started(0.0)
    got = c.at(2.0).feed(sm.engine_exited(2.0, rc, None, last_error="ERROR boom"))
    assert got[-1] == Exit(code)
    assert sm.failure_reason.endswith("while loading; last error: ERROR boom"), sm.failure_reason
    assert sm.engine_exited(3.0, None, None) == []  # nothing died: nothing to do


# --------------------------------------------------------------------------------------- purity


def test_the_state_machine_does_no_io_and_keeps_no_copy_of_the_timing_rule() -> None:
    """launcher_state imports no clock, thread, socket or process module, and of our modules only values and
    pure functions; neither it nor the launcher writes the watchdog rule's numbers (contracts.probe_timing)."""
    import vllm_fleet.host.launcher as launcher
    import vllm_fleet.host.launcher_state as launcher_state

    tree = ast.parse(Path(launcher_state.__file__).read_text())
    modules = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names = {(n.module, a.name) for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert modules == set()
    assert {m for m, _ in names} == {
        "__future__", "collections.abc", "dataclasses", "vllm_fleet.contracts", "vllm_fleet.host.churn",
        "vllm_fleet.host.cpu_wait", "vllm_fleet.host.engine_death", "vllm_fleet.host.probe",
        "vllm_fleet.host.launcher_actions", "vllm_fleet.host.sleep_control",
    }  # fmt: skip
    assert {a for m, a in names if m == "collections.abc"} == {"Callable"}  # a type, for the injected reader
    # the sleep controller and the actions are as pure: values, dataclasses, typing
    import vllm_fleet.host.launcher_actions as launcher_actions
    import vllm_fleet.host.sleep_control as sleep_control

    for mod in (sleep_control, launcher_actions):
        t = ast.parse(Path(mod.__file__).read_text())
        assert not [a.name for n in ast.walk(t) if isinstance(n, ast.Import) for a in n.names], mod.__name__
        froms = {n.module for n in ast.walk(t) if isinstance(n, ast.ImportFrom)}
        assert froms <= {
            "__future__", "collections.abc", "dataclasses", "typing", "vllm_fleet.contracts",
            "vllm_fleet.host.launcher_actions",
        }, (mod.__name__, froms)  # fmt: skip
    assert {a for m, a in names if m == "vllm_fleet.host.churn"} == {"Conns", "FLOOD_JUDGE_AFTER", "flooded"}
    assert {a for m, a in names if m == "vllm_fleet.host.probe"} == {"ProbeResult", "Progress", "judge"}
    assert {a for m, a in names if m == "vllm_fleet.host.cpu_wait"} == {"CpuReading", "starvation"}
    for mod in (launcher, launcher_state):
        src = Path(mod.__file__).read_text()
        assert not re.search(r"0\.8\b|/ ?3\b|PER_WATCHDOG", src), mod.__name__


# ------------------------------------------------------------------------------------------ LoRA adapters


def lora_started(now: float) -> tuple[Supervisor, Clock]:
    """An instance whose config names an adapters file (LoRA on), started at ``now``."""
    cfg = config()
    cfg.environment = {ADAPTERS_FILE_ENV: "/etc/vllm-fleet/instances/a.adapters.json"}
    sm = Supervisor(cfg, 30, now, WALL0)
    c = Clock(sm, now)
    c.feed(sm.engine_started(now, PID))
    return sm, c


def test_lora_ready_only_after_the_carried_adapters_are_loaded() -> None:
    """The first decode answers; the carried adapters load (no readiness probe meanwhile); then READY=1 with the
    adapters in STATUS=, the adapter state file written first; refreshed every 30 s while ready."""
    sm, c = lora_started(100.0)
    assert c.tick_to(101.0)[-1] == StartProbe(first=True)
    got = c.at(101.5).feed(sm.ready_probe_done(101.5, ProbeResult(True, 0.2, "", "decode")))
    assert got == [Notify(("STATUS=Loading m: loading adapters (2s elapsed)",)), Save(), LoadAdapters()]
    assert sm.state == "loading" and sm.phase == "loading adapters"
    assert StartProbe(first=True) not in c.tick_to(110.0)  # no second probe while they load
    assert not any(isinstance(a, Notify) and "READY=1" in a.fields for _, a in c.seen)
    load = AdapterLoad(("adapter sql loaded (12 ms)", "adapter chat loaded (9 ms)"), None, ("chat", "sql"))
    got = c.at(110.2).feed(sm.adapters_loaded(110.2, load))
    assert got == [
        Log("adapter sql loaded (12 ms)"),
        Log("adapter chat loaded (9 ms)"),
        SaveAdapters(),
        Save(),
        Notify(("READY=1", "STATUS=Serving m on 127.0.0.1:9101, adapters chat, sql (ready in 10.2s)")),
        PING,
        Log("ready after 10.2s (health 200 and 1-token decode ok; 2 adapter(s) loaded)"),
    ]
    assert sm.state == "ready" and sm.adapters == ["chat", "sql"]
    # the loaded set is read back from the engine 30 s after, then every 30 s (one read at a time)
    assert RefreshAdapters() not in c.tick_to(140.0)
    assert c.tick_to(140.25).count(RefreshAdapters()) == 1
    assert RefreshAdapters() not in c.tick_to(200.0)  # still reading
    assert c.at(200.1).feed(sm.adapters_refreshed(200.1, ["sql"])) == [SaveAdapters()]
    assert sm.adapters == ["sql"]
    assert RefreshAdapters() not in c.tick_to(230.0)
    assert RefreshAdapters() in c.tick_to(230.25)
    assert sm.adapters_refreshed(231.0, None) == []  # the engine did not say: the file is left to age
    assert sm._serving() == "Serving m on 127.0.0.1:9101, adapter sql"


def test_lora_a_refused_adapter_fails_the_start_as_a_configuration_error() -> None:
    """The engine's message is in the journal and the state file; exit 78 (not restarted) when the engine
    answered, 1 (restarted) when it did not answer."""
    sm, c = lora_started(0.0)
    c.tick_to(1.0)
    c.at(1.5).feed(sm.ready_probe_done(1.5, ProbeResult(True, 0.2, "", "decode")))
    msg = "/srv/adapters/big: HTTP 500: LoRA rank 64 is greater than max_lora_rank 8."
    got = c.at(2.0).feed(sm.adapters_loaded(2.0, AdapterLoad((), ("big", msg, True), ())))
    why = f"LoRA adapter big could not be loaded: {msg}; not restarting (fix the adapter or the spec, then rerun the play)"
    assert got == [
        Kill(wait=True),
        Notify((f"STATUS=Failed: {why}",)),
        Log(why, 3),
        Save(),
        Exit(EXIT_CONFIG),
    ]
    st = state_file(sm, 7, WALL0 + 2)
    assert st["state"] == "failed" and st["phase"] == "configuration error" and st["failure_reason"] == why
    sm, c = lora_started(0.0)
    c.tick_to(1.0)
    c.at(1.5).feed(sm.ready_probe_done(1.5, ProbeResult(True, 0.2, "", "decode")))
    gone = AdapterLoad(
        (), ("sql", "/srv/sql: POST /v1/load_lora_adapter: no answer (ConnectionRefusedError)", False)
    )
    assert c.at(2.0).feed(sm.adapters_loaded(2.0, gone))[-1] == Exit(EXIT_ENGINE_DIED)
    assert sm.phase == "loading adapters"


def test_lora_a_stop_while_adapters_load_wins() -> None:
    sm, c = lora_started(0.0)
    c.tick_to(1.0)
    c.at(1.5).feed(sm.ready_probe_done(1.5, ProbeResult(True, 0.2, "", "decode")))
    c.at(2.0).feed(sm.stop_requested(2.0))
    assert sm.adapters_loaded(2.5, AdapterLoad((), None, ("sql",))) == []
    assert sm.state == "draining"


def test_lora_off_nothing_changes() -> None:
    """No adapters file in the config: READY=1 on the first decode, no adapter action ever."""
    sm, c = ready(10.0)
    c.tick_to(200.0)
    kinds = {type(a) for _, a in c.seen}
    assert not kinds & {LoadAdapters, RefreshAdapters, SaveAdapters} and not sm.lora
    assert sm._serving() == "Serving m on 127.0.0.1:9101"
