"""Starve processes of CPU on purpose (tests): a cgroup of their own with a CPU quota, on this machine.

A CFS quota is the deterministic way to take the CPUs from an engine while everything else runs (a neighbour's
burst does it too, but how much depends on the machine): the throttled threads stay runnable and wait, which
is what the kernel counts as ``run_delay`` and what the launcher's starvation rule reads
(``vllm_fleet.host.cpu_wait``). Works with the cgroup-v1 ``cpu`` controller and with cgroup v2; needs root.
Processes of a sandbox host are found by their pids inside the container (``host_pids_of_group``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

from vllm_fleet.devtools.testing import group_processes

CGROUP = Path("/sys/fs/cgroup")
# The least CPU a quota can leave: the kernel's minimum quota (1 ms) in its longest period (1 s). Starvation
# tests use it: at 0.5 % a fast CI machine's idle tiny engine still answered a 1-token decode probe (about
# 30 ms of CPU) within its 6 s timeout, so no check was late and none counted as starved.
FLOOR_PERCENT = 0.1


class ThrottleError(RuntimeError):
    pass


def _cpu_hierarchy() -> tuple[Path, int]:
    """(mount point, version) of the hierarchy with the cpu controller."""
    if (CGROUP / "cgroup.controllers").exists():
        if "cpu" not in (CGROUP / "cgroup.controllers").read_text().split():
            raise ThrottleError("cgroup v2 without the cpu controller")
        return CGROUP, 2
    for name in ("cpu", "cpu,cpuacct"):
        if (CGROUP / name / "cpu.cfs_quota_us").exists():
            return CGROUP / name, 1
    raise ThrottleError("no cgroup hierarchy with the cpu controller under /sys/fs/cgroup")


def _cgroup_of(pid: int, version: int) -> str:
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if (version == 2 and controllers == "") or (version == 1 and "cpu" in controllers.split(",")):
            return path
    raise ThrottleError(f"pid {pid}: no cpu cgroup in /proc/{pid}/cgroup")


def _move(pid: int, group: Path) -> None:
    with contextlib.suppress(ProcessLookupError, FileNotFoundError):  # gone meanwhile: nothing to move
        (group / "cgroup.procs").write_text(f"{pid}\n")


@contextlib.contextmanager
def throttled(pids: Sequence[int], percent: float, name: str = "vf-throttle") -> Iterator[Path]:
    """Move ``pids`` (whole processes, every thread) into a new cgroup allowed ``percent`` % of one CPU;
    on exit move them back where they were and remove the cgroup."""
    if not pids:
        raise ThrottleError("no process to throttle")
    root, version = _cpu_hierarchy()
    group = root / f"{name}-{os.getpid()}"
    period = 1_000_000  # the longest period the kernel takes: quotas down to 0.1 % of a CPU
    quota = max(1_000, int(period * percent / 100))  # the kernel's minimum quota is 1 ms
    home = {pid: _cgroup_of(pid, version) for pid in pids}
    group.mkdir()
    try:
        if version == 2:
            (group / "cpu.max").write_text(f"{quota} {period}\n")
        else:
            (group / "cpu.cfs_period_us").write_text(f"{period}\n")
            (group / "cpu.cfs_quota_us").write_text(f"{quota}\n")
        for pid in pids:
            _move(pid, group)
        yield group
    finally:
        for pid, path in home.items():
            _move(pid, root / path.lstrip("/"))
        for left in (group / "cgroup.procs").read_text().split():  # children started meanwhile
            _move(int(left), root / home[pids[0]].lstrip("/"))
        group.rmdir()


def host_pids_of_group(pid1: int, pgid: int) -> list[int]:
    """This machine's pids of the processes in process group ``pgid`` as numbered inside the container whose
    init is ``pid1`` (a pid of this machine)."""
    ns = os.readlink(f"/proc/{pid1}/ns/pid")
    leader = None
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.readlink(entry / "ns/pid") != ns:
                continue
            nspid = next(x for x in (entry / "status").read_text().splitlines() if x.startswith("NSpid:"))
        except (OSError, StopIteration):
            continue
        if int(nspid.split()[-1]) == pgid:
            leader = int(entry.name)
            break
    if leader is None:
        raise ThrottleError(f"no process {pgid} in the container of pid {pid1}")
    return sorted(group_processes(leader))  # the process group, as this machine numbers it
