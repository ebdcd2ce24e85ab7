"""What wakes the launcher's main loop at once: a signal handler or a thread calls ``set``, the loop ``wait``s with a
timeout, then ``clear``s.

A pipe, not a ``threading.Event``: ``Event.set`` takes the Event's lock, and a signal handler runs in the main
thread between two bytecodes, wherever that thread is. When it is inside ``Event.wait`` or ``Event.clear``,
holding that same lock, ``set`` never returns: the launcher stopped pinging the watchdog and took no SIGTERM
(tools/gpu-validate/sleep_scale.py: two launchers of a busy swap group, whose peers' SIGUSR2 and whose guards'
SIGUSR1 come every second; tests/unit/test_launcher_signals.py). Writing a byte to a non-blocking pipe takes no
lock.
"""

from __future__ import annotations

import contextlib
import os
import select


class Waker:
    def __init__(self) -> None:
        self._r, self._w = os.pipe()  # not inherited by the engine (O_CLOEXEC)
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)

    def set(self) -> None:
        """Wake the loop; safe in a signal handler and from any thread. A full pipe is set already."""
        with contextlib.suppress(BlockingIOError):
            os.write(self._w, b"\0")

    def wait(self, timeout: float | None) -> bool:
        """Until set or ``timeout`` seconds (None: until set): whether it is set."""
        ready, _, _ = select.select([self._r], [], [], timeout)
        return bool(ready)

    def clear(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self._r, 4096):
                pass

    def close(self) -> None:
        for fd in (self._r, self._w):
            with contextlib.suppress(OSError):
                os.close(fd)


class Stop:
    """A stop flag that a SIGTERM handler sets (the exporter's, the sleep watch's main loop): ``threading.Event``'s
    ``set``, ``is_set`` and ``wait``, through a ``Waker``, so a handler that runs while the main thread is inside
    ``wait`` never waits for a lock that thread holds. Once set, set for good."""

    def __init__(self) -> None:
        self._set = False
        self._waker = Waker()

    def set(self) -> None:
        self._set = True
        self._waker.set()

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float | None = None) -> bool:
        """Until set or ``timeout`` seconds (None: until set): whether it is set."""
        if not self._set:
            self._waker.wait(timeout)
        return self._set
