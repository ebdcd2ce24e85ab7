"""Busy under connection churn, or hung? The kernel tells without asking the API server.

Under thousands of new connections vLLM's API server (one uvicorn event loop) spends its time accepting and
parsing them: a fresh ``/metrics`` request from the launcher waits in the accept queue and times out, while the
engine core keeps working. What the kernel counts answers regardless (docs/design/liveness-under-churn.md):
the CPU time of the API server (the process group's leader) and of the engine core (the rest of the group:
``cpu_wait.CpuReading.api_ran`` / ``core_ran``), and, for the engine's port, the listen socket's accept queue
and the established connections (``/proc/net/tcp`` and ``tcp6``: ``read_port``). ``flooded`` judges two
readings (no I/O).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from vllm_fleet.host.cpu_wait import CpuReading

API_RAN_PER_SECOND = 0.5  # the API server's loop works: on a CPU at least half of the window
CORE_RAN_PER_SECOND = 0.1  # the engine core works: its processes on a CPU at least a tenth of the window
FLOOD_CONNECTIONS = 256  # this many established connections to the port count as a flood (no accept queue)
# a liveness check waits this long for the API server's ``/metrics`` before it asks the kernel; flooded, it ends
# there (the answer would come after the check's timeout, if at all: the request waits in the accept queue)
FLOOD_JUDGE_AFTER = 1.0

_LISTEN, _ESTABLISHED = "0A", "01"
T = TypeVar("T")


@dataclass(frozen=True)
class Conns:
    """The engine's port as the kernel sees it."""

    pending: int  # connections completed by the kernel, not yet accepted by the API server (accept queue)
    established: int  # established connections whose local end is the port


@dataclass(frozen=True)
class Flood:
    flooded: bool  # a flooded API server and a working engine core: busy, not hung
    why: str  # one line for the journal; '' when what rules it out is ``cpu_wait.starvation``'s to say


def parse_tcp(text: str, port: int) -> Conns:
    """The rows of one ``/proc/net/tcp`` (or ``tcp6``) for local ``port``: a LISTEN row's ``rx_queue`` is its
    accept queue's length; ESTABLISHED rows are counted."""
    pending = established = 0
    for line in text.splitlines()[1:]:
        f = line.split()
        if len(f) < 5 or ":" not in f[1] or ":" not in f[4]:
            continue
        try:
            local_port = int(f[1].rsplit(":", 1)[1], 16)
            rx_queue = int(f[4].split(":", 1)[1], 16)
        except ValueError:
            continue
        if local_port != port:
            continue
        if f[3] == _LISTEN:
            pending += rx_queue
        elif f[3] == _ESTABLISHED:
            established += 1
    return Conns(pending, established)


def read_port(port: int, proc: Path = Path("/proc")) -> Conns | None:
    """``parse_tcp`` over IPv4 and IPv6, or None when neither can be read."""
    found: list[Conns] = []
    for name in ("tcp", "tcp6"):
        try:
            found.append(parse_tcp((proc / "net" / name).read_text(), port))
        except OSError:
            continue
    if not found:
        return None
    return Conns(sum(c.pending for c in found), sum(c.established for c in found))


def flooded(before: CpuReading, after: CpuReading, conns: tuple[Conns | None, Conns | None]) -> Flood:
    """Was the API server flooded with connections while the engine core worked, between the two readings?
    Never when a process of the group is stopped or the group changed, when the kernel keeps no statistics,
    when the API server was off the CPU (a deadlocked loop), when the engine core was (hung, or idle: an idle
    engine core sleeps on its input queue), or when the port shows no flood (nothing in the accept queue and
    fewer than ``FLOOD_CONNECTIONS`` established: the clients of requests in flight, or on their way)."""
    window = after.at - before.at
    if after.stopped or not after.pids or set(before.pids) != set(after.pids) or window <= 0:
        return Flood(False, "")  # stopped, or the group changed: ``starvation`` says which
    if not (before.counted and after.counted):
        return Flood(False, "")  # nothing to tell it by
    api = max(0.0, after.api_ran - before.api_ran)
    core = max(0.0, after.core_ran - before.core_ran)
    seen = [c for c in conns if c is not None]
    pending = max((c.pending for c in seen), default=0)
    established = max((c.established for c in seen), default=0)
    figures = (
        f"API server ran {api:.1f}s, engine core {core:.1f}s in {window:.1f}s; "
        f"{pending} connection(s) waiting to be accepted, {established} established"
    )
    if api < API_RAN_PER_SECOND * window:
        return Flood(False, f"API server not busy: {figures}")
    if core < CORE_RAN_PER_SECOND * window:
        return Flood(False, f"engine core idle: {figures}")
    if pending == 0 and established < FLOOD_CONNECTIONS:
        return Flood(False, f"no connection flood: {figures}")
    return Flood(True, f"flooded with connections, engine core working: {figures}")


def sample_or_flooded(
    sample: Callable[[], T],
    kernel: Callable[[], tuple[CpuReading, Conns | None]],
    before: tuple[CpuReading, Conns | None],
    judge_after: float = FLOOD_JUDGE_AFTER,
) -> tuple[T | None, CpuReading, Conns | None]:
    """Run ``sample`` (a liveness check's HTTP part) and wait for it; when it has not answered after
    ``judge_after`` seconds, read the kernel (``kernel``: the engine's CPU figures and port) and, when the
    readings since ``before`` show a flood (``flooded``), stop waiting: returns (None, the readings) at once and
    the late answer is dropped. Otherwise waits for ``sample`` (bounded by its own timeouts) and returns its
    answer with readings taken after it. A flooded API server so costs a check ``judge_after``, not its timeout:
    the watchdog's pings stay about one check interval apart (``launcher_state.next_check_at``)."""
    box: list[T] = []
    worker = threading.Thread(target=lambda: box.append(sample()), name="liveness-sample", daemon=True)
    worker.start()
    worker.join(judge_after)
    if worker.is_alive():
        cpu, conns = kernel()
        if flooded(before[0], cpu, (before[1], conns)).flooded:
            return None, cpu, conns
        worker.join()
    cpu, conns = kernel()
    return (box[0] if box else None), cpu, conns
