"""``vllm-fleet why NAME``, on an engine host: why ``vllm@NAME`` did not come up or stopped, in one line.

Read by the rolling restart's rollback (ansible/roles/engine/tasks/restart_one.yml) and by ``vllm-fleet
rollout`` when a canary fails to start, so that the message that stops a rollout names the cause. In turn:

0. when systemd failed to spawn the unit's last run (exit status 200-243: the launcher never ran), what
   systemd says (3.): the state file and the launcher's lines are an earlier run's;
1. the launcher's ``failure_reason`` in its state file (``{state_dir}/NAME.json``), while it still says
   ``failed`` and was written by the unit's last main process (systemd may already have started the unit
   again, which rewrites it);
2. the launcher's last error line in the unit's journal since ``--since`` (every failure it exits on is
   logged at priority err, ``launcher.fail``);
3. otherwise (the launcher itself crashed, was killed, or never ran): what systemd says of the unit's last run
   (its result, how its main process ended, whether systemd failed to spawn it) and the unit's last error lines
   (systemd's own), else its last lines.

Exit 0 with the cause on stdout; 1 (stdout empty) when nothing at all is known of it (no state, no journal, no
unit).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

LAUNCHER_PREFIX = "vllm-fleet launcher: "
TAIL_LINES = 5
ERROR_LINES = 4
# systemd's lines about a unit that say nothing of why: left out when others do
GENERIC = ("Failed to start ", "Scheduled restart job", "Starting ", "Stopped ")
MAX_CHARS = 600

Run = Callable[[Sequence[str]], str]


def _run(argv: Sequence[str]) -> str:
    try:
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def state_reason(state_file: Path, main_pid: str = "") -> str:
    """The launcher's failure reason while its state file says ``failed``; '' otherwise, or when ``main_pid``
    (systemd's ExecMainPID of the unit's last run, when known) is not the launcher that wrote it (a file left
    by an earlier run)."""
    try:
        doc = json.loads(state_file.read_text())
    except (OSError, ValueError):
        return ""
    if not isinstance(doc, dict) or doc.get("state") != "failed":
        return ""
    if main_pid.isdigit() and int(main_pid) and doc.get("launcher_pid") != int(main_pid):
        return ""
    return str(doc.get("failure_reason") or "")


def journal_reason(unit: str, since: str, run: Run = _run) -> str:
    """The launcher's last line at priority err (or worse) in ``unit``'s journal since ``since``."""
    out = run(["journalctl", "-u", unit, "--since", f"-{since}", "-p", "err", "-o", "cat", "--no-pager"])
    lines = [ln.strip() for ln in out.splitlines() if ln.strip().startswith(LAUNCHER_PREFIX)]
    return lines[-1][len(LAUNCHER_PREFIX) :] if lines else ""


# systemd's own exit statuses for a step of spawning the command that failed (EXIT_CHDIR 200 ... EXIT_CREDENTIALS
# 243, `systemd-analyze exit-status`): the command itself never ran
SPAWN_STATUSES = range(200, 244)


def unit_props(unit: str, run: Run = _run) -> dict[str, str]:
    props: dict[str, str] = {}
    for line in run(
        [
            "systemctl",
            "show",
            unit,
            "-p",
            "LoadState,ActiveState,Result,ExecMainPID,ExecMainCode,ExecMainStatus",
        ]
    ).splitlines():
        key, _, value = line.partition("=")
        props[key] = value
    return props


def spawn_failed(props: dict[str, str]) -> int | None:
    """systemd's exit status when the unit's last main process failed a spawn step (its command never ran)."""
    status = props.get("ExecMainStatus", "")
    if props.get("ExecMainCode") == "1" and status.isdigit() and int(status) in SPAWN_STATUSES:
        return int(status)
    return None


def last_errors(text: str) -> list[str]:
    """The last ``ERROR_LINES`` distinct lines of systemd's own (the launcher's are an earlier run's here), its
    generic ones (``GENERIC``) left out when there are others: the ones that say which step failed and why, not
    pushed out by the same lines of each retry."""
    lines = [
        ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith(LAUNCHER_PREFIX)
    ]
    distinct = list(reversed(dict.fromkeys(reversed(lines))))  # each line once, at its last place
    specific = [ln for ln in distinct if not ln.startswith(GENERIC)] or distinct
    return specific[-ERROR_LINES:]


def systemd_reason(unit: str, since: str, props: dict[str, str], run: Run = _run) -> str:
    """What systemd says of the unit's last run (``props``: ``unit_props``): its result, how its main process
    ended, its last error lines (systemd's own, e.g. "Failed to attach to cgroup ...: Device or resource busy"),
    else its last lines."""
    if props.get("LoadState") in (None, "", "not-found"):
        return ""
    # ExecMainCode: 1 exited (ExecMainStatus: its exit status), 2 killed, 3 dumped (ExecMainStatus: the signal)
    how = {"1": "exited with status", "2": "killed by signal", "3": "dumped core on signal"}.get(
        props.get("ExecMainCode", ""), ""
    )
    main = f"; its main process {how} {props.get('ExecMainStatus', '?')}" if how else ""
    if spawn_failed(props) is not None:
        main += " (systemd failed to spawn it: the launcher never ran)"
    head = f"systemd: {unit} is {props.get('ActiveState', '?')} (result {props.get('Result', '?')}){main}"
    journal = ["journalctl", "-u", unit, "--since", f"-{since}", "-o", "cat", "--no-pager"]
    # systemd's own lines about the unit (UNIT=: PID 1's, and those of the child that failed a spawn step, which
    # `-u` does not match), down to notice: "Failed at step USER spawning ...", "Main process exited, ...
    # status=217/USER"
    errors = last_errors(
        run(["journalctl", f"UNIT={unit}", "--since", f"-{since}", "-p", "notice", "-o", "cat", "--no-pager"])
    )
    if errors:
        return f"{head}; its last errors: {' | '.join(errors[-ERROR_LINES:])}"
    tail = " | ".join(ln.strip() for ln in run([*journal, "-n", str(TAIL_LINES)]).splitlines() if ln.strip())
    if not how and not tail:
        return ""  # never ran (an instance of the template unit loads whether or not it exists)
    return f"{head}; its last lines: {tail}" if tail else head


def failure_cause(name: str, state_dir: str, since: str = "15min", run: Run = _run) -> str:
    unit = f"vllm@{name}.service"
    props = unit_props(unit, run)
    if (
        spawn_failed(props) is not None
    ):  # the launcher never ran: its state file and lines are an earlier run's
        why = systemd_reason(unit, since, props, run)
    else:
        why = (
            state_reason(Path(state_dir) / f"{name}.json", props.get("ExecMainPID", ""))
            or journal_reason(unit, since, run)
            or systemd_reason(unit, since, props, run)
        )
    why = " ".join(why.split())
    return why if len(why) <= MAX_CHARS else why[: MAX_CHARS - 3] + "..."


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", help="the engine instance (vllm@NAME.service)")
    p.add_argument(
        "--state-dir", default="/run/vllm-fleet", help="the launchers' state files (paths.state_dir)"
    )
    p.add_argument(
        "--since",
        default="15min",
        metavar="SPAN",
        help="how far back the journal is read (journalctl's -SPAN)",
    )

    def run(a: argparse.Namespace) -> int:
        why = failure_cause(a.name, a.state_dir, a.since)
        if not why:
            print(f"vllm-fleet why: nothing known of vllm@{a.name}.service", file=sys.stderr)
            return 1
        print(why)
        return 0

    p.set_defaults(handler=run)
