"""``vllm-fleet why`` (vllm_fleet/host/failure_cause.py): the launcher's reason from its state file while it says
failed, else its last error line in the journal, else what systemd says of the unit's last run with its last
lines; one line, capped. The commands it runs are played by a recorder (the real ones: test_unit_engine_service)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from vllm_fleet.host.failure_cause import MAX_CHARS, failure_cause, last_errors


class Host:
    """``journalctl`` and ``systemctl show`` as a host with ``unit`` would answer them."""

    def __init__(self, err: str = "", tail: str = "", show: str = "") -> None:
        self.err, self.tail, self.show = err, tail, show
        self.calls: list[list[str]] = []

    def __call__(self, argv: Sequence[str]) -> str:
        self.calls.append(list(argv))
        if argv[0] == "journalctl":
            return self.err if "-p" in argv else self.tail
        return self.show


SHOW_CRASHED = "LoadState=loaded\nActiveState=failed\nResult=exit-code\nExecMainCode=1\nExecMainStatus=1\n"


def write_state(d: Path, state: str, reason: str | None, pid: int = 41) -> None:
    doc = {"instance": "tiny-b", "state": state, "failure_reason": reason, "launcher_pid": pid}
    (d / "tiny-b.json").write_text(json.dumps(doc))


PROPS = "LoadState,ActiveState,Result,ExecMainPID,ExecMainCode,ExecMainStatus"
SHOW = ["systemctl", "show", "vllm@tiny-b.service", "-p", PROPS]


def test_the_state_files_reason_while_it_says_failed(tmp_path: Path) -> None:
    write_state(tmp_path, "failed", "engine exited unexpectedly: engine API server (pid 7) exited with 1")
    host = Host(err="vllm-fleet launcher: an older failure", show=SHOW_CRASHED + "ExecMainPID=41\n")
    assert failure_cause("tiny-b", str(tmp_path), run=host) == (
        "engine exited unexpectedly: engine API server (pid 7) exited with 1"
    )
    assert host.calls == [SHOW]


def test_a_state_file_another_launcher_wrote_is_not_the_cause(tmp_path: Path) -> None:
    """The unit's last main process (ExecMainPID 42) is not the launcher that wrote the file (41): the journal."""
    write_state(tmp_path, "failed", "an earlier run's failure", pid=41)
    host = Host(err="vllm-fleet launcher: load timeout: loading for more than 60s\n",
                show=SHOW_CRASHED.replace("Status=1", "Status=3") + "ExecMainPID=42\n")  # fmt: skip
    assert failure_cause("tiny-b", str(tmp_path), run=host) == "load timeout: loading for more than 60s"


def test_a_restarted_launchers_state_file_gives_way_to_its_last_error_in_the_journal(tmp_path: Path) -> None:
    write_state(tmp_path, "loading", None)
    host = Host(
        err="vllm-fleet launcher: watchdog timeout: no successful probe in time; engine killed\n"
        "some other error line of the unit\n"
        "vllm-fleet launcher: engine exited unexpectedly: engine worker VllmWorker-0 killed by SIGKILL\n"
    )
    why = failure_cause("tiny-b", str(tmp_path), "30min", run=host)
    assert why == "engine exited unexpectedly: engine worker VllmWorker-0 killed by SIGKILL"
    assert host.calls == [
        SHOW,
        [
            "journalctl",
            "-u",
            "vllm@tiny-b.service",
            "--since",
            "-30min",
            "-p",
            "err",
            "-o",
            "cat",
            "--no-pager",
        ],
    ]


def test_a_launcher_that_logged_nothing_gets_what_systemd_says_and_the_last_lines(tmp_path: Path) -> None:
    """No state file, no launcher error (it crashed with a traceback, or was killed): systemd's result, how its
    main process ended, the unit's last lines joined on one line."""
    host = Host(
        tail="Traceback (most recent call last):\n  File \"x.py\", line 1\nKeyError: 'tiny-b'\n",
        show=SHOW_CRASHED,
    )
    why = failure_cause("tiny-b", str(tmp_path), run=host)
    assert why == (
        "systemd: vllm@tiny-b.service is failed (result exit-code); its main process exited with status 1; "
        "its last lines: Traceback (most recent call last): | File \"x.py\", line 1 | KeyError: 'tiny-b'"
    )
    killed = Host(
        show=SHOW_CRASHED.replace("ExecMainCode=1", "ExecMainCode=2").replace("Status=1", "Status=9")
    )
    assert failure_cause("tiny-b", str(tmp_path), run=killed) == (
        "systemd: vllm@tiny-b.service is failed (result exit-code); its main process killed by signal 9"
    )


def test_a_start_systemd_failed_to_spawn_names_the_step_from_systemds_own_errors(tmp_path: Path) -> None:
    """ci42: `status=219/CGROUP` (the launcher never ran, so no state file and no launcher line): systemd's own
    error lines say which step failed and why."""
    write_state(tmp_path, "failed", "an earlier run's failure")  # the previous launcher's file
    host = Host(
        err="vllm@tiny-b.service: Failed to attach to cgroup /system.slice/x: Device or resource busy\n"
        "vllm@tiny-b.service: Failed at step CGROUP spawning /opt/vllm-fleet/venv/bin/python: Device or resource busy\n"
        "vllm@tiny-b.service: Main process exited, code=exited, status=219/CGROUP\n"
        "vllm@tiny-b.service: Failed with result 'exit-code'.\n",
        tail="Starting vllm@tiny-b.service\n",
        show=SHOW_CRASHED.replace("Status=1", "Status=219"),
    )
    assert failure_cause("tiny-b", str(tmp_path), run=host) == (
        "systemd: vllm@tiny-b.service is failed (result exit-code); its main process exited with status 219 "
        "(systemd failed to spawn it: the launcher never ran); its last errors: vllm@tiny-b.service: Failed to attach "
        "to cgroup /system.slice/x: Device or resource busy | vllm@tiny-b.service: Failed at "
        "step CGROUP spawning /opt/vllm-fleet/venv/bin/python: Device or resource busy | vllm@tiny-b.service: "
        "Main process exited, code=exited, status=219/CGROUP | vllm@tiny-b.service: Failed with result 'exit-code'."
    )


def test_systemds_errors_once_each_the_generic_job_line_and_an_earlier_launchers_left_out() -> None:
    """ci43: three attempts of a start that fails to spawn log the same lines three times, and the job's
    "Failed to start" each time; an earlier run's launcher line is in the window too."""
    attempt = (
        "vllm@x.service: Failed to determine user credentials: No such process\n"
        "vllm@x.service: Failed at step USER spawning /opt/vllm-fleet/venv/bin/python: No such process\n"
        "Failed to start vllm@x.service - vLLM engine x.\n"
    )
    text = "vllm-fleet launcher: model path /m does not exist\n" + attempt * 3
    assert last_errors(text) == [
        "vllm@x.service: Failed to determine user credentials: No such process",
        "vllm@x.service: Failed at step USER spawning /opt/vllm-fleet/venv/bin/python: No such process",
    ]
    assert last_errors("Failed to start vllm@x.service - vLLM engine x.\n" * 2) == [
        "Failed to start vllm@x.service - vLLM engine x."
    ]


def test_nothing_known_of_a_unit_that_does_not_exist(tmp_path: Path) -> None:
    assert (
        failure_cause("nope", str(tmp_path), run=Host(show="LoadState=not-found\nActiveState=inactive\n"))
        == ""
    )
    assert failure_cause("nope", str(tmp_path), run=Host()) == ""
    # an instance of the template unit (vllm@.service) that never ran: loaded, inactive, no main process, no journal
    never = "LoadState=loaded\nActiveState=inactive\nResult=success\nExecMainCode=0\nExecMainStatus=0\n"
    assert failure_cause("tiny-never", str(tmp_path), run=Host(show=never)) == ""


def test_one_line_capped(tmp_path: Path) -> None:
    write_state(tmp_path, "failed", "a\nb " + "x" * 2000)
    why = failure_cause("tiny-b", str(tmp_path), run=Host())
    assert len(why) == MAX_CHARS and why.startswith("a b xxx") and why.endswith("...")


def test_the_command_prints_the_cause_or_exits_1_with_stdout_empty(tmp_path: Path) -> None:
    write_state(tmp_path, "failed", "model path /m does not exist; not starting the engine")
    cmd = [sys.executable, "-m", "vllm_fleet.cli", "why"]
    r = subprocess.run(
        [*cmd, "tiny-b", "--state-dir", str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert (r.returncode, r.stdout) == (0, "model path /m does not exist; not starting the engine\n"), (
        r.stderr
    )
    # an instance of which nothing is known: its name on stderr (journalctl/systemctl absent or silent here)
    r = subprocess.run(
        [*cmd, "vf-no-such-instance", "--state-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (r.returncode, r.stdout) == (1, ""), r
    assert "nothing known of vllm@vf-no-such-instance.service" in r.stderr
