"""A sandbox host seen by a test of rendered units under its systemd (tests/integration: test_unit_engine_service,
test_unit_sleep, test_exporter_systemd, test_unit_devices): shell commands that must pass, ``systemctl show``
properties, a launcher's state file, waits on state, and the rendered files a host takes."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# the rendered files a unit test's host takes (units and drop-ins, instance configs, the service user)
UNIT_FILES = ("/etc/systemd/", "/etc/vllm-fleet/", "/etc/sysusers.d/")


class SystemdHost:
    """``h``: the sandbox host (``vllm_fleet.devtools.sandbox.SandboxHost``)."""

    sh_timeout: float = 120  # a command's default time limit
    wait_every: float = 0.5  # how often ``wait`` asks

    def __init__(self, h: Any) -> None:
        self.h = h

    def sh(self, cmd: str, check: bool = True, timeout: float | None = None) -> str:
        cp = self.h.run(cmd, timeout=self.sh_timeout if timeout is None else timeout)
        if check and cp.returncode != 0:
            raise AssertionError(f"{cmd!r} exited {cp.returncode}:\n{cp.stdout[-2000:]}\n{cp.stderr[-2000:]}")
        return str(cp.stdout)

    def show(self, unit: str, *props: str) -> dict[str, str]:
        out = self.sh(f"systemctl show {unit} " + " ".join(f"-p {p}" for p in props))
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def state(self, name: str) -> dict[str, Any]:
        """The launcher's state file of instance ``name``."""
        return dict(json.loads(self.sh(f"cat /run/vllm-fleet/{name}.json")))

    def wait(self, pred: Callable[[], Any], timeout: float, what: str, every: float | None = None) -> Any:
        """``pred()``'s first true value within ``timeout`` s (an AssertionError, ValueError or KeyError it
        raises counts as not yet)."""
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            try:
                last = pred()
                if last:
                    return last
            except (AssertionError, ValueError, KeyError) as exc:
                last = exc
            time.sleep(self.wait_every if every is None else every)
        raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}")

    def install(self, root: Path, edit: Callable[[Path, str], None] | None = None) -> None:
        """Copy the rendered files of one host (``root``: ``render_fleet``'s ``OUT/HOST``) that a unit test's host
        takes (``UNIT_FILES``), with their modes; ``edit(file, destination)`` first, when given."""
        for f in sorted(p for p in root.rglob("*") if p.is_file()):
            dest = "/" + str(f.relative_to(root))
            if dest.startswith(UNIT_FILES):
                if edit is not None:
                    edit(f, dest)
                self.h.copy_to(f, dest, mode=f.stat().st_mode & 0o777)
