"""The launcher's sleep-mode decisions (``vllm_fleet.host.sleep_control`` inside ``launcher_state.Supervisor``)
on a fake clock, and a swap group's slots (``vllm_fleet.host.swap_group``) on real flocks."""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
from launcher_clock import Clock

from vllm_fleet.contracts import (
    SLEEP_TRANSITION_TIMEOUT_SECONDS,
    WAKE_RETRY_AFTER_SECONDS,
    InstanceConfig,
    ServiceConfig,
    SleepConfig,
    parse_state,
)
from vllm_fleet.host import launcher as launcher_mod
from vllm_fleet.host.cpu_wait import CpuReading
from vllm_fleet.host.launcher_actions import (
    Action,
    AskYield,
    Exit,
    Kill,
    Log,
    Notify,
    PollGuard,
    ReportWakeFailed,
    Save,
    SleepEngine,
    StartProbe,
    WakeEngine,
)
from vllm_fleet.host.launcher_state import EXIT_ENGINE_DIED, Check, Supervisor, state_file
from vllm_fleet.host.probe import ProbeResult, Progress
from vllm_fleet.host.sleep_control import GUARD_POLL_SECONDS, GuardReading
from vllm_fleet.host.swap_group import RoomOnTheWay, Slots, going_to_sleep, yield_candidate

WALL0 = 1_700_000_000.0
PING = Notify(("WATCHDOG=1",))


class FakeSlots:
    """A swap group slot that is free when ``free`` says so."""

    def __init__(self, free: bool = True) -> None:
        self.free, self.held, self.taken, self.released = free, False, 0, 0

    def try_take(self) -> bool:
        if self.held:
            return True
        if self.free:
            self.held, self.taken = True, self.taken + 1
        return self.held

    def release(self) -> None:
        self.held, self.released = False, self.released + 1


def config(level: int = 1, idle: float | None = 30.0, group: str = "g", wait: float = 20.0) -> InstanceConfig:
    svc = ServiceConfig(watchdog_seconds=30, probe_interval_seconds=10, probe_timeout_seconds=5)
    sleep = SleepConfig(
        level=level, idle_seconds=idle, wake_wait_seconds=wait, group=group, group_members=["b"]
    )
    return InstanceConfig(
        name="a", served_model_name="m", model_path="/m", port=9101, command=["x"], service=svc, sleep=sleep
    )


class Run(Clock):
    """A ready sleeper on a fake clock: every action kept with its time, a liveness check answered at once."""

    def __init__(
        self,
        cfg: InstanceConfig,
        slots: FakeSlots | None = None,
        room: Callable[[float], list[str]] = lambda now: [],
    ) -> None:
        self.slots = slots if slots is not None else FakeSlots()
        self.slots.try_take()  # the launcher took it before the engine started (Launcher.wait_for_slot)
        super().__init__(Supervisor(cfg, 30, 0.0, WALL0, self.slots, room), 0.0)
        self.checks: list[float] = []
        self.feed(self.sm.engine_started(0.0, 77))
        self.feed(self.sm.ready_probe_done(0.0, ProbeResult(True, 0.1, "", "decode")))
        assert self.sm.state == "ready"

    def feed(self, actions: list[Action]) -> list[Action]:
        self.seen += [(self.now, a) for a in actions]
        if (
            StartProbe(first=False) in actions
        ):  # a liveness check of an idle engine: its decode passes at once
            cpu = CpuReading(at=self.now, waited=0.0, ran=0.0, pids=(77,), stopped=(), counted=True)
            answer = ProbeResult(True, 0.1, "", "decode")
            check = Check(0.1, cpu, cpu, Progress(0, 0, 1.0, self.now), answer)
            self.checks.append(self.now)
            return actions + self.feed(self.sm.check_done(self.now, check))
        return actions

    def at(self, t: float) -> Run:
        self.now = t
        return self

    def guard(
        self, inflight: int = 0, held: int = 0, last: float = 0.0, state: str = "awake"
    ) -> list[Action]:
        """Answer the pending PollGuard: the guard's reading, ``last`` = when a request last ended (fake time)."""
        assert self.sm.sleep is not None and self.sm.sleep.polling
        reading = GuardReading(state, inflight, held, WALL0 + last, WALL0 + self.now)
        return self.feed(self.sm.guard_read(self.now, reading))

    def state(self) -> dict[str, object]:
        st = state_file(self.sm, 1, WALL0 + self.now)
        return dict(parse_state(json.loads(json.dumps(st))))


def statuses(actions: list[Action]) -> list[str]:
    return [f[7:] for a in actions if isinstance(a, Notify) for f in a.fields if f.startswith("STATUS=")]


def put_to_sleep(r: Run, at: float = 31.0) -> None:
    """Idle since 0: the guard poll at ``at`` sleeps it, the sleep answers 200 two seconds later."""
    assert PollGuard() in r.tick_to(at)
    assert r.guard()[-1] == SleepEngine(1)
    r.at(at + 2.0).feed(r.sm.slept(at + 2.0, 200, "{}"))
    assert r.sm.sleep is not None and r.sm.sleep.state == "asleep"


# --------------------------------------------------------------------------------------- sleep


def test_an_idle_engine_sleeps_after_idle_seconds_and_gives_its_slot_back() -> None:
    r = Run(config(idle=30.0))
    assert r.state()["sleep_state"] == "awake" and r.state()["swap_group"] == "g"
    # polled every second; a request ended at t=5: idle for 25 s at t=30 is not enough
    assert r.tick_to(30.0).count(PollGuard()) == 1  # one poll in flight at a time
    assert r.guard(last=5.0) == [Save()]  # a request ended since: the state file says when (the group's LRU)
    assert r.tick_to(30.75) == []
    got = r.tick_to(30.0 + GUARD_POLL_SECONDS)
    assert got[-1] == PollGuard()
    got = r.guard(last=1.0)  # idle for 30 s: sleep (the state file written with it)
    assert got == [
        Log("going to sleep (level 1): idle for 30s"),
        Notify(("STATUS=Going to sleep (level 1): idle for 30s",)),
        Save(),
        SleepEngine(1),
    ]
    assert r.state()["sleep_state"] == "sleeping" and r.slots.held
    got = r.at(43.0).feed(r.sm.slept(43.0, 200, "{}"))
    assert got[0] == Log("asleep (level 1) after 12.0s; its slot of swap group g is free")
    assert statuses(got) == ["Asleep (level 1), 0 wake(s) so far; a request wakes it"]
    assert not r.slots.held and r.slots.released == 1
    st = r.state()
    assert st["sleep_state"] == "asleep" and st["sleeps_total"] == 1 and st["asleep_since"] == WALL0 + 43.0
    assert st["last_active_at"] == WALL0 + 1.0


def test_a_busy_engine_does_not_sleep_and_a_refused_sleep_keeps_it_awake() -> None:
    r = Run(config(idle=30.0))
    r.tick_to(40.0)
    assert r.guard(inflight=1, last=0.0) == [Save()]  # a request runs
    r.tick_to(41.0)
    assert r.guard(held=1, last=0.0) == []  # (held while awake cannot happen, but it would block a sleep too)
    r.tick_to(42.0)
    assert r.guard()[-1] == SleepEngine(1)
    # a request slipped in between the reading and the sleep: the guard answers 409, still awake
    got = r.at(42.1).feed(r.sm.slept(42.1, 409, "busy: 1 request(s) in flight"))
    assert got[0] == Log("not going to sleep: busy: 1 request(s) in flight")
    assert r.sm.sleep is not None and r.sm.sleep.state == "awake" and r.slots.held


def test_no_idle_sleep_without_idle_seconds_but_a_peers_yield_request_sleeps_it() -> None:
    r = Run(config(idle=None))
    r.tick_to(1000.0)
    assert r.guard(last=0.0) == [Save()]  # never idle-sleeps
    r.at(1000.2).feed(r.sm.yield_requested(1000.2))
    assert r.tick_to(1000.25) == [PollGuard()]  # polled at once
    assert r.guard(inflight=2) == []  # busy: it does not yield now...
    r.tick_to(1001.25)
    got = r.guard()  # ...but within the yield window, once idle
    assert got[-1] == SleepEngine(1) and got[0] == Log(
        "going to sleep (level 1): a peer of swap group g needs the room"
    )
    r.at(1001.5).feed(r.sm.slept(1001.5, 200, ""))
    # a yield request long past does not sleep it again after a wake
    r.feed(r.sm.wake_requested(1002.0))
    r.at(1002.5).feed(r.sm.woken(1002.5, WALL0 + 1002.5, True, ""))
    r.tick_to(1010.0)
    assert r.guard(last=1002.5) == []  # nothing new since the wake wrote it: nothing written


def test_a_member_asked_to_yield_stays_awake_while_a_peer_is_already_going_to_sleep() -> None:
    """Seen on an H100 (sleep_scale.py, 3 models, max_awake 2): a start needed one slot, the first peer asked took
    8.3 s to sleep (the first sleep after a start), the waiter asked the other one a second later, and both slept.
    A member asked while a peer's sleep is on the way stays awake; asked again once none is, it yields."""
    going: list[str] = []
    r = Run(config(idle=None), room=lambda now: list(going))
    r.tick_to(100.0)
    r.guard(last=0.0)
    r.at(100.2).feed(r.sm.yield_requested(100.2))
    going.append("b")  # b was asked first and is going to sleep
    assert r.tick_to(100.25) == [PollGuard()]
    assert r.guard() == [Log("not yielding: b of swap group g going to sleep")]
    assert r.sm.sleep is not None and r.sm.sleep.state == "awake" and r.slots.held
    r.tick_to(101.25)
    assert SleepEngine(1) not in r.guard()  # the request is spent: not taken up once b is asleep either
    going.clear()
    r.tick_to(102.25)
    assert SleepEngine(1) not in r.guard()
    r.at(102.3).feed(r.sm.yield_requested(102.3))  # asked again: the room is still needed, none on the way
    r.tick_to(102.5)
    assert r.guard()[-1] == SleepEngine(1)


def test_an_idle_sleep_goes_ahead_whoever_else_is_going_to_sleep() -> None:
    r = Run(config(idle=30.0), room=lambda now: ["b"])
    r.tick_to(31.0)
    assert r.guard(last=0.0)[-1] == SleepEngine(1)


def test_a_liveness_check_running_when_the_sleep_begins_judges_nothing() -> None:
    """A check takes a while (the CPU figures, the decode): the guard's reading may find the engine idle meanwhile.
    The sleep goes ahead (the guard refuses it with a 409 while the check's decode runs, and refuses a decode that
    arrives after at once); the check's verdict, a failed decode, is dropped: no failure counted, no ping missed."""
    r = Run(config(idle=30.0))
    r.tick_to(29.75)  # the checks at 10 and 20 s passed
    r.sm.probing, r.sm.probe_started = True, 29.75  # one begun now still runs
    r.tick_to(30.0)  # (the guard's reading pending since 1 s)
    got = r.guard(last=0.0)
    assert got[-1] == SleepEngine(1)
    r.at(30.5).feed(r.sm.slept(30.5, 200, ""))
    cpu = CpuReading(at=31.0, waited=0.0, ran=0.0, pids=(77,), stopped=(), counted=True)
    failed = Check(2.0, cpu, cpu, Progress(0, 0, 1.0, 31.0), ProbeResult(False, 2.0, "503", "decode"))
    assert r.at(31.0).feed(r.sm.check_done(31.0, failed)) == []
    assert r.sm.probes.failures == 0 and not r.sm.probing and len(r.checks) == 3


def test_no_liveness_decode_while_asleep_the_guard_answering_pings() -> None:
    r = Run(config())
    put_to_sleep(r)
    r.seen.clear()
    r.tick_to(80.0)
    assert StartProbe(first=False) not in [a for _, a in r.seen]  # a decode would wake it
    assert r.sm.sleep is not None and r.sm.sleep.polling
    pings = []
    for t in range(81, 120):
        r.tick_to(float(t))
        if r.sm.sleep.polling and PING in r.guard(state="asleep"):
            pings.append(t)
    assert pings and all(b - a >= 10 for a, b in itertools.pairwise(pings)), pings
    # the guard stops answering: no more pings, systemd's watchdog ends it
    last = r.sm.last_ping
    for t in range(120, 160):
        r.tick_to(float(t))
        if r.sm.sleep.polling:
            r.feed(r.sm.guard_read(r.now, None))
    assert r.sm.last_ping == last and r.sm.watchdog_deadline is not None and r.sm.watchdog_deadline < 160


def test_a_wake_takes_the_slot_then_wakes_and_counts() -> None:
    r = Run(config())
    put_to_sleep(r)
    got = r.at(50.0).feed(r.sm.wake_requested(50.0))
    assert got == [
        Log("wake requested: a request is waiting"),
        Notify(("STATUS=Waking (level 1)",)),
        Save(),
        WakeEngine(1),
    ]
    assert r.slots.held and r.state()["sleep_state"] == "waking"
    assert r.sm.wake_requested(50.1) == []  # one wake at a time
    got = r.at(50.6).feed(r.sm.woken(50.6, WALL0 + 50.6, True, ""))
    assert got[0] == Log("awake after 0.60s") and statuses(got) == ["Serving m on 127.0.0.1:9101"]
    st = r.state()
    assert st["sleep_state"] == "awake" and st["wakes_total"] == 1 and st["last_wake_seconds"] == 0.6
    assert st["asleep_seconds_total"] == 50.6 - 33.0 and st["asleep_since"] is None
    assert st["last_active_at"] == WALL0 + 50.6  # not the group's least recently used right after its wake
    # the liveness decode resumes one interval later
    r.checks.clear()
    r.tick_to(60.75)
    assert r.checks == [60.75]


def test_the_engine_answering_its_wake_pings_so_a_flapping_member_keeps_its_pings_an_interval_apart() -> None:
    """A member of a busy swap group flaps: asked to yield just after a ping, woken just before the next one was
    due. Asleep and during the transitions a ping is sent only once due, and awake the next check comes an
    interval after the wake: the gap grew to two intervals (sleep_scale.py at fleet scale: 10.2 s between two
    WATCHDOG=1 with probe_interval 5 s, a third of WatchdogSec). The engine answering the wake is a liveness pass
    as good as a decode: it pings, and the pings stay an interval apart (plus a guard poll)."""
    r = Run(config(idle=None))  # probe_interval 10 s, no idle sleep

    def run_to(t: float, state: str) -> None:
        while r.now < t:
            r.tick_to(r.now + 0.25)
            assert r.sm.sleep is not None
            if r.sm.sleep.polling:
                r.guard(state=state)

    run_to(20.0, "awake")
    last = r.sm.last_ping  # a check passed at most an interval ago
    assert last is not None and 10.0 < last <= 20.0
    r.at(20.2).feed(r.sm.yield_requested(20.2))
    run_to(20.25, "awake")
    assert r.times(SleepEngine(1)) == [20.25]
    r.at(20.6).feed(r.sm.slept(20.6, 200, ""))
    wake = last + 10.0 - 0.5  # the next ping not due yet
    run_to(wake, "asleep")
    assert r.at(wake).feed(r.sm.wake_requested(wake))[-1] == WakeEngine(1)
    r.at(wake + 0.4).feed(r.sm.woken(wake + 0.4, WALL0 + wake + 0.4, True, ""))
    run_to(60.0, "awake")
    pings = [t for t in r.times(PING) if t >= last]
    gaps = [round(b - a, 2) for a, b in itertools.pairwise(pings)]
    assert len(pings) >= 4 and max(gaps) <= 10.0 + GUARD_POLL_SECONDS, (pings, gaps)


def test_level_two_and_a_failed_wake() -> None:
    r = Run(config(level=2))
    assert PollGuard() in r.tick_to(31.0)
    assert r.guard()[-1] == SleepEngine(2)
    r.at(31.1).feed(r.sm.slept(31.1, 200, ""))
    assert r.at(40.0).feed(r.sm.wake_requested(40.0))[-1] == WakeEngine(2)
    got = r.at(41.0).feed(r.sm.woken(41.0, WALL0 + 41.0, False, "POST /collective_rpc: 500 boom"))
    why = "the engine did not wake: POST /collective_rpc: 500 boom"
    assert got[:2] == [Log(f"wake failed: {why}", 4), ReportWakeFailed(why, WAKE_RETRY_AFTER_SECONDS)]
    st = r.state()
    assert st["sleep_state"] == "asleep" and st["failed_wakes_total"] == 1 and st["last_wake_failure"] == why
    assert not r.slots.held  # given back: a peer may use it
    assert r.sm.wake_requested(42.0)[-1] == WakeEngine(2)  # the next request tries again


def test_a_wake_waits_for_a_slot_asking_the_least_recently_used_peer_then_gives_up() -> None:
    slots = FakeSlots()
    r = Run(config(wait=5.0), slots)
    put_to_sleep(r)
    slots.free = False  # a peer took the slot meanwhile
    got = r.at(40.0).feed(r.sm.wake_requested(40.0))
    assert got[-1] == AskYield() and "Asleep: waiting for a slot of swap group g to wake" in statuses(got)
    r.tick_to(44.75)
    asks = [t for t, a in r.seen if a == AskYield()]
    assert asks == [40.0, 41.0, 42.0, 43.0, 44.0]
    got = r.tick_to(45.0)
    why = "no free slot in swap group g after 5.0s"
    assert ReportWakeFailed(why, WAKE_RETRY_AFTER_SECONDS) in got
    assert r.state()["failed_wakes_total"] == 1
    # the next wake finds the slot free after a second: it wakes
    r.feed(r.sm.wake_requested(50.0))
    slots.free = True
    assert WakeEngine(1) in r.tick_to(50.25)


def test_pings_go_on_during_a_sleep_but_a_sleep_that_never_ends_is_a_hang() -> None:
    r = Run(config())
    assert PollGuard() in r.tick_to(31.0)
    assert r.guard()[-1] == SleepEngine(1)
    r.seen.clear()
    r.tick_to(31.0 + SLEEP_TRANSITION_TIMEOUT_SECONDS)
    pings = [t for t, a in r.seen if a == PING]
    assert len(pings) >= SLEEP_TRANSITION_TIMEOUT_SECONDS / 10 - 1
    got = r.tick_to(31.25 + SLEEP_TRANSITION_TIMEOUT_SECONDS)
    assert got[0] == Kill(wait=True) and got[-1] == Exit(EXIT_ENGINE_DIED)
    assert (
        r.sm.failure_reason == f"engine hung: sleep did not finish in {SLEEP_TRANSITION_TIMEOUT_SECONDS:g}s"
    )


def test_a_stop_while_asleep_answers_the_held_requests() -> None:
    r = Run(config())
    put_to_sleep(r)
    got = r.at(60.0).feed(r.sm.stop_requested(60.0))
    assert ReportWakeFailed("the engine is stopping", WAKE_RETRY_AFTER_SECONDS) in got
    assert r.sm.wake_requested(61.0) == []  # stopping: no wake


def test_without_sleep_the_state_file_says_so() -> None:
    cfg = config()
    cfg.sleep = None
    sm = Supervisor(cfg, 30, 0.0, WALL0)
    st = state_file(sm, 1, WALL0)
    assert st["sleep_state"] is None and st["wakes_total"] == 0 and sm.sleep is None


# --------------------------------------------------------------------------------------- swap group slots


def test_slots_are_flocks_one_per_engine_and_a_closed_one_is_free(tmp_path: Path) -> None:
    a, b, c = (Slots(tmp_path, "g", 2, n) for n in ("a", "b", "c"))
    assert a.try_take() and a.index == 0 and a.try_take()  # holding one: still True, still one
    assert b.try_take() and b.index == 1
    assert not c.try_take() and not c.held
    assert sorted(c.holders()) == ["a", "b"]
    a.release()
    assert c.try_take() and c.index == 0
    assert sorted(b.holders()) == ["b", "c"]
    # a launcher that dies drops its slot: a child process holding one, killed
    d = Slots(tmp_path, "h", 1, "d")
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        d.try_take()
        os.kill(os.getpid(), 9)
    os.waitpid(pid, 0)
    assert Slots(tmp_path, "h", 1, "e").try_take()


def test_the_least_recently_used_awake_member_is_asked_to_yield(tmp_path: Path) -> None:
    def write(name: str, **st: object) -> None:
        base = {
            "state": "ready",
            "sleep_state": "awake",
            "launcher_pid": 100 + len(name),
            "last_active_at": 5.0,
        }
        (tmp_path / f"{name}.json").write_text(json.dumps(base | st))

    write("a", last_active_at=50.0)
    write("bb", last_active_at=20.0)
    write("ccc", last_active_at=10.0, sleep_state="asleep")  # asleep: nothing to yield
    write("dddd", last_active_at=1.0, state="loading")  # loading: cannot yield
    (tmp_path / "eeeee.json").write_text("{broken")
    assert yield_candidate(tmp_path, ["a", "bb", "ccc", "dddd", "eeeee", "missing"]) == ("bb", 102)
    write("f", last_active_at=None)  # never ran a request: first
    assert yield_candidate(tmp_path, ["a", "bb", "f"]) == ("f", 101)
    assert yield_candidate(tmp_path, ["ccc", "dddd"]) is None


def test_a_member_going_to_sleep_is_room_on_the_way_for_its_grace_only(tmp_path: Path) -> None:
    def write(name: str, sleep_state: str) -> None:
        st = {"state": "ready", "sleep_state": sleep_state, "launcher_pid": 100 + len(name)}
        (tmp_path / f"{name}.json").write_text(json.dumps(st))

    write("a", "sleeping")
    write("bb", "awake")
    write("ccc", "asleep")
    (tmp_path / "dddd.json").write_text("{broken")
    members = ["a", "bb", "ccc", "dddd", "missing"]
    assert going_to_sleep(tmp_path, members) == ["a"]
    room = RoomOnTheWay(tmp_path, members, grace=30.0)
    assert room(100.0) == ["a"] and room(129.9) == ["a"]
    assert room(130.0) == []  # a sleep longer than the grace (one that hangs): the group is asked as before
    write("a", "asleep")
    assert room(131.0) == []
    write("a", "sleeping")  # a new sleep: counted from when it is seen
    write("bb", "sleeping")
    assert room(200.0) == ["a", "bb"]


def test_the_launcher_asks_no_one_while_a_member_is_going_to_sleep(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``Launcher.ask_yield`` (a start or a wake waiting for a slot): SIGUSR2 to the least recently used awake
    member, but none while another member's sleep frees a slot."""
    svc = ServiceConfig(watchdog_seconds=30, probe_interval_seconds=10, probe_timeout_seconds=5)
    sleep = SleepConfig(level=1, idle_seconds=30.0, group="g", max_awake=1, group_members=["b", "c"])
    cfg = InstanceConfig(name="a", served_model_name="m", model_path="/m", port=9101, command=["x"], service=svc,
                         sleep=sleep, state_dir=str(tmp_path))  # fmt: skip
    la = launcher_mod.Launcher(cfg, launcher_mod.Notifier(""))
    sent: list[tuple[int, int]] = []
    monkeypatch.setattr(launcher_mod.os, "kill", lambda pid, sig: sent.append((pid, sig)))

    def write(name: str, sleep_state: str, pid: int) -> None:
        st = {"state": "ready", "sleep_state": sleep_state, "launcher_pid": pid, "last_active_at": 1.0}
        (tmp_path / f"{name}.json").write_text(json.dumps(st))

    write("b", "sleeping", 201)
    write("c", "awake", 202)
    la.ask_yield()
    assert sent == []  # b's slot is on the way: c is not asked
    write("b", "asleep", 201)
    la.ask_yield()
    assert sent == [(202, launcher_mod.signal.SIGUSR2)]
