"""pytest plugin: sandbox hosts (real systemd hosts as systemd-nspawn containers) for integration tests.

Loaded from tests/conftest.py (``pytest_plugins``). Use::

    @pytest.mark.sandbox
    def test_x(sandbox_factory):
        h1 = sandbox_factory("myarea-h1")                       # base image, free address on vfbr0
        h2 = sandbox_factory("myarea-h2", engine=True, model_dir=tiny_model)
        assert h1.run("systemctl is-system-running").stdout.strip() == "running"

Every host a module boots is powered off and removed when that module ends (also when tests fail): a module's
hosts, engines and services never run under the next module's tests.
Skips with a clear reason when not root or systemd-nspawn is missing.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from vllm_fleet.devtools.sandbox import SandboxHost, down, list_hosts, up
from vllm_fleet.devtools.sandbox_image import SandboxError

SandboxFactory = Callable[..., SandboxHost]


def sandbox_skip_reason() -> str | None:
    """Why sandbox hosts cannot run here, or None."""
    if os.geteuid() != 0:
        return "sandbox hosts need root (systemd-nspawn, bridges, mounts)"
    for tool in ("systemd-nspawn", "debootstrap", "nsenter", "ssh", "ip"):
        if shutil.which(tool) is None:
            return f"sandbox hosts need {tool} (apt-get install systemd-container debootstrap openssh-client)"
    return None


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@pytest.fixture(scope="module")
def sandbox_factory() -> Iterator[SandboxFactory]:
    """``sandbox_factory(name, address=None, **up_kwargs)`` → a booted :class:`SandboxHost`.

    ``address`` defaults to a free one on 10.77.0.0/24 (the default bridge's subnet); other keywords go to
    :func:`vllm_fleet.devtools.sandbox.up` (``engine``, ``wheelhouse``, ``model_dir``, ``apt_proxy``, ``binds_ro``).
    A name still running from an earlier, killed session is taken down first."""
    reason = sandbox_skip_reason()
    if reason:
        pytest.skip(reason)
    started: list[str] = []
    # a CI timeout or `kill` sends SIGTERM: turn it into KeyboardInterrupt so pytest still runs the teardown
    # below (hosts run in their own sessions and would otherwise outlive the test run)
    if (
        threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    ):
        signal.signal(signal.SIGTERM, _interrupt)

    def make(name: str, address: str | None = None, **kw: Any) -> SandboxHost:
        if any(h.name == name for h in list_hosts()):
            down(name)  # a leftover of a killed session: never let it make this session fail
        started.append(name)
        try:
            return up(name, address, **kw)
        except SandboxError as exc:
            if "died while booting" not in str(exc):
                raise
            # seen once in a CI run on the 2-core VM: the first boot of the session gone at the first check, no
            # console output; `up` took it down again, so one more try starts from a clean slate
            print(f"sandbox_factory: {exc}\nsandbox_factory: retrying {name} once", file=sys.stderr)
            return up(name, address, **kw)

    try:
        yield make
    finally:
        for name in reversed(started):
            try:
                down(name)
            except Exception as exc:  # keep tearing down the others
                print(f"sandbox_factory: down {name} failed: {exc}")
