"""The launcher's sleep-mode decisions, without I/O (issue 33, docs/sleep.md): ``SleepControl`` takes events and
returns actions, like ``launcher_state.Supervisor`` (which owns one when the instance config has ``sleep``).

The engine serves behind the sleep guard (``vllm_fleet.host.sleep_guard``), which counts the requests it runs,
holds the ones that arrive while the engine is not awake and signals the launcher (SIGUSR1) to wake it. Here:

* awake: the guard's state is read every ``GUARD_POLL_SECONDS``; when it runs and holds nothing and no request
  ended for ``idle_seconds`` (or a peer of the swap group asked this one to yield, SIGUSR2, within the last
  ``YIELD_WINDOW_SECONDS``), ``SleepEngine`` (the guard answers 409 when a request slipped in: still awake);
* asleep: the swap group's slot is given back; SIGUSR1 starts a wake: take a slot (at once, or ``AskYield`` of
  the group's least recently used awake member every ``YIELD_ASK_EVERY`` s and try again each tick), then
  ``WakeEngine``; a slot not found or a wake refused within ``wake_wait_seconds`` is a failed wake:
  ``ReportWakeFailed`` (the guard answers the requests it holds with 503 and ``Retry-After`` at once);
* a sleep or a wake still running after ``SLEEP_TRANSITION_TIMEOUT_SECONDS`` is a hung engine (``hung``).

Times: ``now`` is the caller's monotonic clock, ``wall`` the wall clock (the guard's ``last_request_at`` and
the state file's times are wall-clock).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from vllm_fleet.contracts import SLEEP_TRANSITION_TIMEOUT_SECONDS, WAKE_RETRY_AFTER_SECONDS, SleepConfig
from vllm_fleet.host.launcher_actions import (
    Action,
    AskYield,
    Log,
    PollGuard,
    ReportWakeFailed,
    Save,
    SleepEngine,
    WakeEngine,
    status,
)

GUARD_POLL_SECONDS = 1.0  # the guard's state is read this often (awake: idle; asleep: it answers = alive)
YIELD_WINDOW_SECONDS = 2.0  # a peer's yield request (SIGUSR2) counts this long; the peer asks every second
YIELD_ASK_EVERY = 1.0  # a wake waiting for a slot asks the least recently used awake peer this often
# a peer going to sleep frees a slot: while it does (this long at most), nobody else is asked to yield and a member
# asked earlier stays awake (the first sleep after a start took 8.3 s on an H100 and 12.2 s on the H200)
PEER_SLEEP_GRACE_SECONDS = 30.0


def no_peer_going_to_sleep(now: float) -> list[str]:
    """The peers going to sleep where there is no swap group (``swap_group.RoomOnTheWay`` where there is one)."""
    return []


class SlotLike(Protocol):
    """A swap group's slot (``swap_group.Slots``): taken without waiting, or not."""

    @property
    def held(self) -> bool: ...

    def try_take(self) -> bool: ...

    def release(self) -> None: ...


@dataclass(frozen=True)
class GuardReading:
    """The guard's answer (``GET contracts.SLEEP_STATE_PATH``) and the wall clock when it was read."""

    state: str
    inflight: int
    held: int
    last_request_at: float
    wall: float

    @classmethod
    def parse(cls, data: Any, wall: float) -> GuardReading | None:
        """None when ``data`` is not the guard's answer."""
        if not isinstance(data, dict):
            return None
        try:
            return cls(
                str(data["state"]),
                int(data["inflight"]),
                int(data["held"]),
                float(data["last_request_at"]),
                wall,
            )
        except (KeyError, TypeError, ValueError):
            return None


class SleepControl:
    """One engine's sleep state: awake → sleeping → asleep → waking → awake (``state``, as the guard's)."""

    def __init__(
        self,
        cfg: SleepConfig,
        slots: SlotLike | None,
        now: float,
        serving: Callable[[], str] = lambda: "Serving",
        room_on_the_way: Callable[[float], list[str]] = no_peer_going_to_sleep,
    ) -> None:
        self.cfg, self.slots = cfg, slots
        self.serving = serving  # the STATUS= text of a serving engine (the supervisor's)
        # the peers of the swap group going to sleep (swap_group.RoomOnTheWay): a yield is not needed then
        self.room_on_the_way = room_on_the_way
        self.state = "awake"
        self.op = ""  # "sleep" or "wake" while that request to the engine runs
        self.op_started = now
        self.polling = False
        self.next_poll = now + GUARD_POLL_SECONDS
        self.wake_started: float | None = None  # a wake in progress (from the signal), the slot wait included
        self.next_yield_ask = now
        self.yield_until = float("-inf")
        self.last_reading: GuardReading | None = None
        self.last_active_at: float | None = None  # wall: when a request last ended (the guard's reading)
        self.asleep_since: float | None = None  # monotonic
        self.sleeps = self.wakes = self.failed_wakes = 0
        self.wake_seconds_total = 0.0
        self.last_wake_seconds: float | None = None
        self.asleep_seconds_total = 0.0
        self.last_wake_failure = ""

    @property
    def group(self) -> str:
        return self.cfg.group

    # ------------------------------------------------------------------ the clock and the guard's readings
    def tick(self, now: float) -> list[Action]:
        """The engine serves (ready, not stopping: the supervisor calls this only then)."""
        if self.op:
            return []
        out: list[Action] = []
        if self.wake_started is not None:  # waiting for a slot
            out += self._try_wake(now)
            if self.op:
                return out
        if not self.polling and now >= self.next_poll:
            self.polling = True
            out.append(PollGuard())
        return out

    def guard_read(self, now: float, reading: GuardReading | None) -> list[Action]:
        """The guard's state (None: it did not answer)."""
        self.polling = False
        self.next_poll = now + GUARD_POLL_SECONDS
        if reading is None:
            return []
        self.last_reading = reading
        # a request ended since the last reading: the state file says so (the swap group's least recently used
        # is read from it by a peer that needs a slot)
        out: list[Action] = [Save()] if reading.last_request_at != self.last_active_at else []
        self.last_active_at = reading.last_request_at
        if self.state != "awake" or self.op or reading.inflight or reading.held:
            return out
        idle = reading.wall - reading.last_request_at
        idle_due = self.cfg.idle_seconds is not None and idle >= self.cfg.idle_seconds
        asked = now < self.yield_until
        if asked and not idle_due and (peers := self.room_on_the_way(now)):
            # the room a peer asked for is on the way (a sleeping peer frees its slot): one sleep per slot needed
            self.yield_until = float("-inf")
            return [*out, Log(f"not yielding: {', '.join(peers)} of swap group {self.group} going to sleep")]
        if asked or idle_due:
            why = (
                "a peer of swap group " + self.group + " needs the room" if asked else f"idle for {idle:.0f}s"
            )
            self.op, self.op_started, self.state = "sleep", now, "sleeping"
            return [
                Log(f"going to sleep (level {self.cfg.level}): {why}"),
                status(f"Going to sleep (level {self.cfg.level}): {why}"),
                Save(),
                SleepEngine(self.cfg.level),
            ]
        return out

    def hung(self, now: float) -> str:
        """Why the engine counts as hung ('' when it does not): a sleep or a wake that does not end."""
        if self.op and now - self.op_started > SLEEP_TRANSITION_TIMEOUT_SECONDS:
            return f"{self.op} did not finish in {SLEEP_TRANSITION_TIMEOUT_SECONDS:g}s"
        return ""

    # ------------------------------------------------------------------ sleep
    def slept(self, now: float, code: int, message: str) -> list[Action]:
        """The engine's (or the guard's) answer to ``SleepEngine``: 200 asleep, 409 busy (still awake)."""
        self.op = ""
        if code != 200:
            self.state = "awake"
            self.next_poll = now + GUARD_POLL_SECONDS
            if code == 409:
                return [Log(f"not going to sleep: {message}"), status(self.serving()), Save()]
            return [Log(f"sleep refused ({code}): {message}", 4), status(self.serving()), Save()]
        self.state, self.sleeps = "asleep", self.sleeps + 1
        self.asleep_since, self.yield_until = now, float("-inf")
        took = now - self.op_started
        released = ""
        if self.slots is not None and self.slots.held:
            self.slots.release()
            released = f"; its slot of swap group {self.group} is free"
        return [
            Log(f"asleep (level {self.cfg.level}) after {took:.1f}s{released}"),
            status(self.asleep_status),
            Save(),
        ]

    # ------------------------------------------------------------------ wake
    def wake_requested(self, now: float) -> list[Action]:
        """SIGUSR1 from the guard: a request waits for the engine."""
        if self.state != "asleep" or self.wake_started is not None or self.op:
            return []
        self.wake_started = now
        return [Log("wake requested: a request is waiting"), *self._try_wake(now)]

    def _try_wake(self, now: float) -> list[Action]:
        assert self.wake_started is not None
        if self.slots is None or self.slots.try_take():
            self.op, self.op_started, self.state = "wake", now, "waking"
            return [status(f"Waking (level {self.cfg.level})"), Save(), WakeEngine(self.cfg.level)]
        if now - self.wake_started >= self.cfg.wake_wait_seconds:
            why = f"no free slot in swap group {self.group} after {now - self.wake_started:.1f}s"
            return self._wake_failed(now, why)
        if now >= self.next_yield_ask:
            first = self.next_yield_ask <= self.wake_started
            self.next_yield_ask = now + YIELD_ASK_EVERY
            out: list[Action] = [AskYield()]
            if first:
                msg = f"waiting for a slot of swap group {self.group} to wake"
                out = [Log(msg), status(f"Asleep: {msg}"), *out]
            return out
        return []

    def woken(self, now: float, wall: float, ok: bool, message: str) -> list[Action]:
        """The engine's answer to ``WakeEngine``."""
        self.op = ""
        if not ok:
            return self._wake_failed(now, f"the engine did not wake: {message}")
        started = self.wake_started if self.wake_started is not None else self.op_started
        took = now - started
        self.state, self.wake_started = "awake", None
        self.wakes += 1
        self.wake_seconds_total += took
        self.last_wake_seconds = round(took, 3)
        if self.asleep_since is not None:
            self.asleep_seconds_total += now - self.asleep_since
        self.asleep_since = None
        self.last_active_at = wall  # just woken for a request: not the least recently used of its group
        self.next_poll = now + GUARD_POLL_SECONDS
        return [Log(f"awake after {took:.2f}s"), status(self.serving()), Save()]

    def _wake_failed(self, now: float, why: str) -> list[Action]:
        self.state, self.wake_started = "asleep", None
        self.failed_wakes += 1
        self.last_wake_failure = why
        if self.slots is not None and self.slots.held:
            self.slots.release()
        return [
            Log(f"wake failed: {why}", 4),
            ReportWakeFailed(why, WAKE_RETRY_AFTER_SECONDS),
            status(f"Asleep (level {self.cfg.level}): wake failed: {why}"),
            Save(),
        ]

    def yield_requested(self, now: float) -> list[Action]:
        """SIGUSR2 from a peer of the swap group that needs a slot: sleep as soon as nothing runs."""
        if self.state == "awake" and not self.op:
            self.yield_until = now + YIELD_WINDOW_SECONDS
            self.next_poll = min(self.next_poll, now)
        return []

    def stopping(self) -> list[Action]:
        """The unit stops: requests held for a wake get their 503 now (no wake will come)."""
        if self.state == "awake" and self.wake_started is None:
            return []
        self.wake_started = None
        return [ReportWakeFailed("the engine is stopping", WAKE_RETRY_AFTER_SECONDS)]

    # ------------------------------------------------------------------ what it says
    @property
    def asleep_status(self) -> str:
        return f"Asleep (level {self.cfg.level}), {self.wakes} wake(s) so far; a request wakes it"

    def fields(self, wall: Callable[[float | None], float | None]) -> dict[str, Any]:
        """The state file's sleep keys (``contracts.StateFile``); ``wall``: a monotonic time on the wall clock."""
        return {
            "sleep_state": self.state,
            "sleep_level": self.cfg.level,
            "swap_group": self.group or None,
            "last_active_at": self.last_active_at,
            "asleep_since": wall(self.asleep_since),
            "sleeps_total": self.sleeps,
            "wakes_total": self.wakes,
            "failed_wakes_total": self.failed_wakes,
            "wake_seconds_total": round(self.wake_seconds_total, 3),
            "last_wake_seconds": self.last_wake_seconds,
            "asleep_seconds_total": round(self.asleep_seconds_total, 3),
            "last_wake_failure": self.last_wake_failure or None,
        }
