"""Was the engine starved of CPU, or hung? The kernel's per-thread scheduler statistics tell.

A probe that times out is not proof of a hang: on a host whose CPUs are taken (a neighbour's burst, a
``CPUQuota``, an oversubscribed VM) a healthy idle engine answers a 1-token decode late. Linux counts, per
thread, the time spent *runnable but waiting for a CPU* (``/proc/PID/task/TID/schedstat``, second field:
``run_delay`` in ns, kept whenever the kernel has scheduler statistics — ``CONFIG_SCHED_INFO``, on in the usual
distribution kernels). A starved engine's threads wait on the run queue; a hung one's do not: stopped
(``kill -STOP``: state ``T``), blocked in the kernel (``D``) or asleep on a lock that never comes.

``read_group`` sums those figures over every thread of the engine's process group (the launcher starts the
engine in its own session, and vLLM's processes inherit the group), and apart for the group's leader (vLLM's
API server; the others are its engine core and workers); ``starvation`` compares two readings.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

# a probe window counts as starved when the engine's threads waited this long for a CPU per second of window
# (summed over threads: 0.25 = on average a quarter of a thread runnable and not running, all the time)
STARVED_WAIT_PER_SECOND = 0.25


@dataclass(frozen=True)
class CpuReading:
    """One reading of an engine's process group."""

    at: float  # time.monotonic() of the reading
    waited: float  # seconds runnable but waiting for a CPU, summed over every thread
    ran: float  # seconds on a CPU, summed over every thread
    pids: tuple[int, ...]  # the group's processes
    stopped: tuple[int, ...]  # those stopped (state T or t: SIGSTOP, a debugger)
    counted: bool  # the kernel keeps scheduler statistics (else waited/ran are 0 and say nothing)
    api_ran: float = 0.0  # of ``ran``, the group leader's threads (the API server; the rest: the engine core)

    @property
    def core_ran(self) -> float:
        """Seconds on a CPU of every process of the group but its leader (vLLM's engine core and workers)."""
        return self.ran - self.api_ran


@dataclass(frozen=True)
class Starvation:
    starved: bool
    why: str  # one line for the journal, either way


class ProcStat(NamedTuple):
    state: str  # R, S, D, T, t, Z ...
    pgrp: int  # the process group, as the reader's pid namespace numbers it
    comm: str  # the command name (vLLM names its children VLLM::EngineCore, VLLM::Worker)


def proc_stat(pid_dir: Path) -> ProcStat | None:
    """``/proc/PID/stat`` of ``pid_dir``, or None when the process is gone."""
    try:
        raw = (pid_dir / "stat").read_text()
    except OSError:
        return None
    rest = raw.rsplit(")", 1)[-1].split()  # the command name may hold spaces and parentheses
    try:
        return ProcStat(rest[0], int(rest[2]), raw[raw.index("(") + 1 : raw.rindex(")")])
    except (IndexError, ValueError):
        return None


def read_group(pgid: int, proc: Path = Path("/proc"), now: float | None = None) -> CpuReading:
    """Scheduler figures of every thread of every process in process group ``pgid``."""
    at = time.monotonic() if now is None else now
    pids: list[int] = []
    stopped: list[int] = []
    waited = ran = api_ran = 0
    try:
        entries = os.listdir(proc)
    except OSError:
        entries = []
    for name in entries:
        if not name.isdigit():
            continue
        st = proc_stat(proc / name)
        if st is None or st.pgrp != pgid:
            continue
        pid = int(name)
        pids.append(pid)
        if st.state in ("T", "t"):
            stopped.append(pid)
        try:
            tids = os.listdir(proc / name / "task")
        except OSError:
            continue
        for tid in tids:
            try:
                fields = (proc / name / "task" / tid / "schedstat").read_text().split()
                ran += int(fields[0])
                waited += int(fields[1])
                if pid == pgid:
                    api_ran += int(fields[0])
            except (OSError, IndexError, ValueError):
                continue
    return CpuReading(
        at=at,
        waited=waited / 1e9,
        ran=ran / 1e9,
        pids=tuple(sorted(pids)),
        stopped=tuple(sorted(stopped)),
        counted=ran > 0,
        api_ran=api_ran / 1e9,
    )


def starvation(
    before: CpuReading, after: CpuReading, per_second: float = STARVED_WAIT_PER_SECOND
) -> Starvation:
    """Did the engine wait for CPUs between the two readings (so a late answer is starvation, not a hang)?
    Never when a process of the engine is stopped, when the kernel keeps no statistics, or when the
    group's processes changed in between (a process that died takes its figures with it)."""
    window = after.at - before.at
    if after.stopped:
        pids = ", ".join(str(p) for p in after.stopped)
        return Starvation(False, f"engine process {pids} stopped (SIGSTOP?)")
    if not after.pids:
        return Starvation(False, "no engine process")
    if not (before.counted and after.counted):
        return Starvation(False, "no scheduler statistics (/proc/PID/schedstat) to tell starved from hung")
    if set(before.pids) != set(after.pids) or window <= 0:
        return Starvation(False, "the engine's processes changed")
    waited = max(0.0, after.waited - before.waited)
    ran = max(0.0, after.ran - before.ran)
    figures = f"its threads waited {waited:.1f}s for a CPU and ran {ran:.1f}s in {window:.1f}s"
    if waited >= per_second * window:
        return Starvation(True, f"starved of CPU: {figures}")
    return Starvation(False, f"not starved: {figures}")
