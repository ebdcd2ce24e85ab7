"""The launcher's main loop on a fake clock, for tests of its decisions (tests/unit/test_launcher_state.py,
test_sleep_control.py): plain numbers for the time, every action kept with its time."""

from __future__ import annotations

import math

from vllm_fleet.host.launcher_actions import Action
from vllm_fleet.host.launcher_state import Supervisor


class Clock:
    """The launcher's main loop on a fake clock: ``tick_to`` ticks every 0.25 s; every action is kept with its
    time in ``seen``."""

    def __init__(self, sm: Supervisor, now: float) -> None:
        self.sm, self.now = sm, now
        self.seen: list[tuple[float, Action]] = []

    def feed(self, actions: list[Action]) -> list[Action]:
        self.seen += [(self.now, a) for a in actions]
        return actions

    def at(self, t: float) -> Clock:
        assert t >= self.now
        self.now = t
        return self

    def tick_to(self, t: float) -> list[Action]:
        """Tick at every multiple of 0.25 s after now, up to ``t``."""
        out: list[Action] = []
        k = math.floor(self.now * 4 + 1e-9) + 1
        while k / 4 <= t + 1e-9:
            self.now = k / 4
            out += self.feed(self.sm.tick(self.now))
            k += 1
        return out

    def times(self, action: Action) -> list[float]:
        return [t for t, a in self.seen if a == action]
