"""host.cpu_wait: starved or hung, from the kernel's per-thread scheduler figures."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from vllm_fleet.host.cpu_wait import CpuReading, read_group, starvation


def fake_proc(root: Path, procs: dict[int, tuple[str, int, list[tuple[int, int]]]]) -> Path:
    """A /proc with ``pid: (state, pgid, [(ran_ns, waited_ns) per thread])``."""
    for pid, (state, pgid, threads) in procs.items():
        d = root / str(pid)
        (d / "task").mkdir(parents=True)
        # the command name holds a space and a parenthesis, as vLLM's "VLLM::EngineCore" might
        (d / "stat").write_text(f"{pid} (python3 (x) y) {state} 1 {pgid} {pgid} 0 -1 4194560 0 0\n")
        for i, (ran, waited) in enumerate(threads):
            t = d / "task" / str(pid * 10 + i)
            t.mkdir()
            (t / "schedstat").write_text(f"{ran} {waited} 7\n")
    (root / "self").mkdir(exist_ok=True)
    return root


def reading(
    at: float, waited: float, ran: float = 1.0, pids: tuple[int, ...] = (5, 6), **kw: object
) -> CpuReading:
    return CpuReading(at=at, waited=waited, ran=ran, pids=pids, stopped=kw.get("stopped", ()), counted=True)  # type: ignore[arg-type]


def test_read_group_sums_the_threads_of_the_group_only(tmp_path: Path) -> None:
    proc = fake_proc(
        tmp_path,
        {
            5: ("S", 5, [(2_000_000_000, 500_000_000), (1_000_000_000, 250_000_000)]),
            6: ("R", 5, [(1_000_000_000, 250_000_000)]),
            7: ("T", 7, [(9_000_000_000, 9_000_000_000)]),  # another group: not counted
        },
    )
    r = read_group(5, proc, now=10.0)
    assert r.pids == (5, 6) and r.stopped == () and r.counted
    assert r.ran == 4.0 and r.waited == 1.0 and r.at == 10.0


def test_a_stopped_process_of_the_group_is_never_starvation(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path, {5: ("S", 5, [(1, 0)]), 6: ("T", 5, [(1, 0)])})
    after = read_group(5, proc, now=10.0)
    assert after.stopped == (6,)
    v = starvation(reading(0.0, 0.0, pids=(5, 6)), CpuReading(10.0, 100.0, 2.0, (5, 6), (6,), True))
    assert not v.starved and "6 stopped" in v.why


def test_waiting_for_cpus_is_starvation_and_sleeping_is_not() -> None:
    v = starvation(reading(0.0, 10.0), reading(10.0, 14.0))  # waited 4 s in 10 s: 0.4 per second
    assert v.starved, v.why
    assert "waited 4.0s" in v.why
    v = starvation(reading(0.0, 10.0), reading(10.0, 10.5))  # 0.05 per second: asleep (a lock, a deadlock)
    assert not v.starved and v.why.startswith("not starved")


def test_no_statistics_or_changed_processes_say_nothing() -> None:
    none = CpuReading(10.0, 0.0, 0.0, (5, 6), (), False)
    assert not starvation(reading(0.0, 0.0), none).starved
    assert not starvation(reading(0.0, 0.0), reading(10.0, 9.0, pids=(5, 7))).starved
    assert not starvation(reading(0.0, 0.0), reading(10.0, 9.0, pids=())).starved


def test_read_group_on_this_kernel_sees_a_real_stopped_child() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", "import time\nt=time.time()\nwhile time.time()-t<30: pass"],
        start_new_session=True,
    )
    try:
        time.sleep(0.5)
        busy = read_group(child.pid)
        assert busy.pids == (child.pid,) and busy.stopped == ()
        if busy.counted:  # kernels without scheduler statistics read 0: nothing to tell then
            assert busy.ran > 0.1
        os.kill(child.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while read_group(child.pid).stopped != (child.pid,) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert read_group(child.pid).stopped == (child.pid,)
    finally:
        child.kill()
        child.wait()


def test_read_group_counts_the_group_leaders_run_time_apart(tmp_path: Path) -> None:
    """The leader is vLLM's API server (the launcher starts it in its own session); the rest is its engine
    core and workers."""
    proc = fake_proc(
        tmp_path,
        {
            5: ("S", 5, [(2_000_000_000, 0), (1_000_000_000, 0)]),
            6: ("R", 5, [(4_000_000_000, 0)]),
            7: ("R", 5, [(500_000_000, 0)]),
        },
    )
    r = read_group(5, proc, now=1.0)
    assert (r.ran, r.api_ran, r.core_ran) == (7.5, 3.0, 4.5)
