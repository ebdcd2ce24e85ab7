"""sd_notify(3) without libsystemd: one datagram per message to ``$NOTIFY_SOCKET``.

Supports filesystem sockets and abstract ones (``@name``). Without ``$NOTIFY_SOCKET`` (run by hand, outside
systemd) every call is a no-op that returns False.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time


class Notifier:
    def __init__(self, address: str | None = None) -> None:
        addr = address if address is not None else os.environ.get("NOTIFY_SOCKET", "")
        if addr.startswith("@"):
            addr = "\0" + addr[1:]
        self.address = addr
        self._sock: socket.socket | None = None
        if addr:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def send(self, *fields: str) -> bool:
        """Send ``KEY=VALUE`` fields as one message. Never raises: a lost notification must not kill the
        service (systemd then acts on the missing READY/WATCHDOG, which is the right outcome)."""
        if self._sock is None:
            return False
        msg = "\n".join(f.replace("\n", " ") for f in fields).encode()
        try:
            self._sock.sendto(msg, self.address)
            return True
        except OSError:
            return False

    def status(self, text: str) -> bool:
        return self.send(f"STATUS={text}")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class NotifyListener:
    """The receiving end (what systemd does), for tests and local runs: binds a datagram socket and
    collects ``(monotonic time, {KEY: VALUE})`` per message in a background thread."""

    def __init__(self, path: str) -> None:
        self.address = path
        bind = "\0" + path[1:] if path.startswith("@") else path
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self._sock.bind(bind)
        self._sock.settimeout(0.2)
        self.messages: list[tuple[float, dict[str, str]]] = []
        self._stop = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="notify-listener", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop:
            try:
                data = self._sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            fields = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
            with self._cond:
                self.messages.append((time.monotonic(), fields))
                self._cond.notify_all()

    def wait_for(self, key: str, value: str | None = None, timeout: float = 60, since: int = 0) -> int:
        """Index of the first message at or after ``since`` with ``key`` (and ``value``); TimeoutError."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for i in range(since, len(self.messages)):
                    f = self.messages[i][1]
                    if key in f and (value is None or f[key] == value):
                        return i
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no {key}{'=' + value if value else ''} within {timeout}s")
                self._cond.wait(left)

    def values(self, key: str) -> list[str]:
        with self._cond:
            return [f[key] for _, f in self.messages if key in f]

    def close(self) -> None:
        self._stop = True
        self._thread.join(2)
        self._sock.close()
        if not self.address.startswith("@"):
            with contextlib.suppress(OSError):
                os.unlink(self.address)
