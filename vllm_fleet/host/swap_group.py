"""A swap group's slots on one host (issue 33, docs/sleep.md): the models of a group share GPUs and at most
``max_awake`` of their engines may be awake (or loading) at once.

A slot is an exclusive ``flock`` on ``{state_dir}/swap/GROUP/slot-K.lock`` (K < max_awake), held by the launcher
of an engine from before it loads (or wakes) until it is asleep (or gone): the kernel drops it when the launcher
exits however it exits, so a crash frees its slot. A launcher that finds every slot taken asks the least
recently used awake member of its group to yield (``yield_candidate``; SIGUSR2 to that member's launcher, which
puts its engine to sleep when it runs nothing) and tries again. While a member is going to sleep its slot is on
the way (``RoomOnTheWay``): nobody else is asked, and a member asked earlier does not yield too (one start or
wake needs one slot, not every awake member's: seen on an H100, where a start made both awake members sleep).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from vllm_fleet.contracts import SWAP_SUBDIR, ContractError, StateFile, read_state


def group_dir(state_dir: str | Path, group: str) -> Path:
    return Path(state_dir) / SWAP_SUBDIR / group


class Slots:
    """The slots of swap group ``group`` on this host; this launcher holds at most one."""

    def __init__(self, state_dir: str | Path, group: str, count: int, owner: str = "") -> None:
        self.dir = group_dir(state_dir, group)
        self.count = max(1, count)
        self.owner = owner  # written into the slot file it holds (for a person looking)
        self._fd: int | None = None
        self.index: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def try_take(self) -> bool:
        """Take a free slot at once (True), or find them all taken (False). Holding one already: True."""
        if self._fd is not None:
            return True
        self.dir.mkdir(parents=True, exist_ok=True)
        for k in range(self.count):
            fd = os.open(self.dir / f"slot-{k}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o660)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{self.owner} {os.getpid()}\n".encode(), 0)
            self._fd, self.index = fd, k
            return True
        return False

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd, self.index = self._fd, None, None
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
        os.close(fd)  # closing the descriptor drops the flock

    def holders(self) -> list[str]:
        """What the taken slots' files say (owner and pid), for messages."""
        out = []
        for k in range(self.count):
            p = self.dir / f"slot-{k}.lock"
            try:
                fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                fcntl.flock(fd, fcntl.LOCK_UN)  # free: nobody holds it
            except BlockingIOError:
                text = p.read_text(errors="replace").strip()
                out.append(text.split(" ")[0] if text else f"slot-{k}")
            finally:
                os.close(fd)
        return out


def member_states(state_dir: str | Path, members: list[str]) -> Iterator[tuple[str, StateFile]]:
    """Each member's state file, as (name, state); one missing or unreadable is left out."""
    for name in members:
        try:
            st = read_state(Path(state_dir) / f"{name}.json")
        except (OSError, ContractError):
            continue
        yield name, st


def going_to_sleep(state_dir: str | Path, members: list[str]) -> list[str]:
    """The members whose engine is going to sleep (state file: ``sleep_state`` sleeping): each frees its slot
    when it is asleep."""
    return [n for n, st in member_states(state_dir, members) if st.get("sleep_state") == "sleeping"]


class RoomOnTheWay:
    """Which members' sleeps count as room on the way (``going_to_sleep``), as one launcher sees them: each for
    ``grace`` seconds from when this launcher first saw it going to sleep (a sleep that takes longer, one that
    hangs, stops counting: then the group is asked as before). ``now``: the caller's monotonic clock."""

    def __init__(self, state_dir: str | Path, members: list[str], grace: float) -> None:
        self.state_dir, self.members, self.grace = state_dir, members, grace
        self.first_seen: dict[str, float] = {}

    def __call__(self, now: float) -> list[str]:
        seen = going_to_sleep(self.state_dir, self.members)
        self.first_seen = {n: self.first_seen.get(n, now) for n in seen}
        return sorted(n for n, t in self.first_seen.items() if now - t < self.grace)


def yield_candidate(state_dir: str | Path, members: list[str]) -> tuple[str, int] | None:
    """The member of the group to ask to yield: the least recently used one whose engine is ready and awake
    (its state file: ``state`` ready, ``sleep_state`` awake; the oldest ``last_active_at``, one that never ran
    a request first), as (instance name, launcher pid); None when no member is awake (they are loading,
    waking, going to sleep, or stopped)."""
    best: tuple[float, str, int] | None = None
    for name, st in member_states(state_dir, members):
        pid = st.get("launcher_pid")
        if st.get("state") != "ready" or st.get("sleep_state") != "awake" or not isinstance(pid, int):
            continue
        at = st.get("last_active_at")
        key = (float(at) if isinstance(at, int | float) else float("-inf"), name, pid)
        if best is None or key < best:
            best = key
    return None if best is None else (best[1], best[2])
