"""``vllm-fleet restart NAME``, on an engine host: restart ``vllm@NAME`` and return when it is READY (the rolling
restart's step, ansible/roles/engine/tasks/restart_one.yml).

``systemctl restart`` returns when the launcher told READY=1, or fails. A failure of a step systemd takes to spawn
the launcher (an exit status 200-243: attaching to the unit's cgroup, setting up its namespaces, ...; the
launcher never ran) is tried again, up to ``SPAWN_ATTEMPTS`` in all: such a failure says nothing of the new
config, and systemd would restart the unit itself after RestartSec anyway (``Restart=on-failure``). Seen on a
loaded machine: `status=219/CGROUP` once in a rolling restart, which then rolled a good upgrade back. Any other
failure (the launcher ran and exited: a bad model path, an engine that cannot start, a load timeout) is not
retried: it exits 1 at once with the cause (``vllm-fleet why``) on stdout, for the play's rollback.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Callable, Sequence

from vllm_fleet.host.failure_cause import Run, _run, failure_cause, spawn_failed, unit_props

SPAWN_ATTEMPTS = 3

Systemctl = Callable[[Sequence[str]], int]


def _systemctl(argv: Sequence[str]) -> int:
    return subprocess.run(["systemctl", *argv], check=False).returncode


def restart(
    name: str,
    state_dir: str,
    systemctl: Systemctl = _systemctl,
    run: Run = _run,
    log: Callable[[str], None] = lambda m: print(m, file=sys.stderr, flush=True),
) -> tuple[int, str]:
    """(0, what happened) once the unit is READY; (1, the cause) when it is not."""
    unit = f"vllm@{name}.service"
    for attempt in range(1, SPAWN_ATTEMPTS + 1):
        if systemctl(["restart", unit]) == 0:
            again = f" (attempt {attempt}: systemd failed to spawn it before)" if attempt > 1 else ""
            return 0, f"{unit} restarted, READY{again}"
        status = spawn_failed(unit_props(unit, run))
        if status is None or attempt == SPAWN_ATTEMPTS:
            break
        log(
            f"vllm-fleet restart: systemd failed to spawn {unit} (exit status {status}, the launcher never ran: "
            f"{failure_cause(name, state_dir, run=run)}); trying again ({attempt + 1} of {SPAWN_ATTEMPTS})"
        )
        systemctl(["reset-failed", unit])
    return 1, failure_cause(name, state_dir, run=run) or f"{unit} did not start (systemctl restart failed)"


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", help="the engine instance (vllm@NAME.service)")
    p.add_argument(
        "--state-dir", default="/run/vllm-fleet", help="the launchers' state files (paths.state_dir)"
    )

    def handler(a: argparse.Namespace) -> int:
        code, text = restart(a.name, a.state_dir)
        print(text)
        return code

    p.set_defaults(handler=handler)
