"""The launcher's signals never hang its main loop (sleep_scale.py at fleet scale: two launchers of a busy swap group
stopped pinging and ignored SIGTERM; their signal handler's ``threading.Event.set`` waited for the Event's lock,
which the main thread itself held inside ``Event.wait``). A signal handler runs in the main thread between two
bytecodes, wherever that thread is: here one is delivered at every line the main loop runs inside its waker's
``wait`` and ``clear``, in a child process (a hang is a timeout, not a hung test run)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

from vllm_fleet.host.waker import Stop, Waker

REPO = Path(__file__).resolve().parents[2]

CHILD = r"""
import os, signal, sys, threading
from vllm_fleet.contracts import InstanceConfig, ServiceConfig
from vllm_fleet.host.launcher import Launcher
from vllm_fleet.host.notify import Notifier

cfg = InstanceConfig(name="a", served_model_name="m", model_path="/m", port=9101, command=["x"],
                     service=ServiceConfig())
la = Launcher(cfg, Notifier(""))
la.install_signals()
waker = la._wake
files = {threading.__file__, sys.modules[type(waker).__module__].__file__}
sent = []

def tracer(frame, event, arg):
    if frame.f_code.co_filename not in files:
        return None

    def line(frame, event, arg):
        if event == "line" and len(sent) < 500:
            sent.append(frame.f_lineno)
            os.kill(os.getpid(), signal.SIGUSR2)  # a peer asks it to yield, right here
        return line

    return line

sys.settrace(tracer)
for _ in range(5):  # the main loop's wait and clear (Launcher.run, Launcher.wait_for_slot)
    waker.wait(0.01)
    waker.clear()
sys.settrace(None)
assert sent and len(la._signals) == len(sent), (len(sent), len(la._signals))
print("signals", len(sent))
"""


def test_a_signal_at_any_line_of_the_main_loop_s_wait_and_clear_is_taken_and_never_hangs() -> None:
    try:
        r = subprocess.run(
            [sys.executable, "-c", CHILD], cwd=REPO, capture_output=True, text=True, timeout=30
        )
    except subprocess.TimeoutExpired as exc:  # killed (SIGKILL): its handler would take SIGTERM and hang
        raise AssertionError("the launcher's main loop hung in its signal handler") from exc
    assert r.returncode == 0, r.stderr[-2000:]
    assert int(r.stdout.split()[-1]) > 5


def test_the_waker_wakes_a_wait_from_a_thread_and_clears() -> None:
    w = Waker()
    assert not w.wait(0.01)
    t0 = time.monotonic()
    threading.Timer(0.05, w.set).start()
    assert w.wait(5) and time.monotonic() - t0 < 2
    assert w.wait(0)  # set until cleared
    w.clear()
    assert not w.wait(0)
    for _ in range(100_000):  # far more than a pipe holds: set never blocks
        w.set()
    assert w.wait(0)
    w.clear()
    assert not w.wait(0)
    w.close()


STOP_CHILD = r"""
import os, signal, sys, threading
from vllm_fleet.host import waker

make = {"Stop": waker.Stop, "Event": threading.Event}[sys.argv[1]]
files = {threading.__file__, waker.__file__}
current = [make()]
signal.signal(signal.SIGTERM, lambda *_: current[0].set())  # the exporter's and the sleep watch's handler
sent = []

def tracer(frame, event, arg):
    if frame.f_code.co_filename not in files:
        return None

    def line(frame, event, arg):
        if event == "line" and len(sent) < 300:
            sent.append(frame.f_lineno)
            os.kill(os.getpid(), signal.SIGTERM)  # systemd stops the service, right here
        return line

    return line

for _ in range(30):  # a fresh flag each time: the handler's set lands inside wait, at each of its lines
    current[0] = make()
    sys.settrace(tracer)
    current[0].wait(0.01)
    sys.settrace(None)
    assert current[0].is_set()
print("signals", len(sent))
"""


def _stop_child(kind: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", STOP_CHILD, kind], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


def test_a_sigterm_inside_the_stop_flag_s_wait_is_taken_and_never_hangs() -> None:
    try:
        r = _stop_child("Stop", 30)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError("the stop flag's wait hung in the SIGTERM handler") from exc
    assert r.returncode == 0, r.stderr[-2000:]
    assert int(r.stdout.split()[-1]) >= 30


def test_the_same_sigterm_hangs_a_threading_event_which_the_stop_flag_replaced() -> None:
    """What the exporter and the sleep watch did before: a SIGTERM inside ``Event.wait`` hangs in ``set``."""
    try:
        r = _stop_child("Event", 5)  # the Stop child ends in well under a second
    except subprocess.TimeoutExpired:
        return
    raise AssertionError(
        f"a threading.Event took every signal (rc {r.returncode}): {r.stdout} {r.stderr[-500:]}"
    )


def test_the_stop_flag_is_set_for_good_and_wakes_a_wait_from_a_thread() -> None:
    s = Stop()
    assert not s.is_set() and not s.wait(0.01)
    t0 = time.monotonic()
    threading.Timer(0.05, s.set).start()
    assert s.wait() and time.monotonic() - t0 < 5
    assert s.is_set() and s.wait(0) and s.wait(0)
