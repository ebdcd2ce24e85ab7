"""``vllm-fleet restart`` (vllm_fleet/host/restart.py): a start systemd failed to spawn (exit 200-243: the
launcher never ran) is tried again, up to SPAWN_ATTEMPTS; a failure of the launcher's own is not, and comes back
with its cause. systemctl is played by a recorder (the real one: test_unit_engine_service)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from vllm_fleet.host.restart import SPAWN_ATTEMPTS, restart

SHOW = "LoadState=loaded\nActiveState=failed\nResult=exit-code\nExecMainCode=1\nExecMainStatus={}\n"


class Host:
    """``systemctl restart`` failing ``fails`` times with main status ``status``, then succeeding."""

    def __init__(self, fails: int, status: int) -> None:
        self.fails, self.status = fails, status
        self.systemctl_calls: list[list[str]] = []

    def systemctl(self, argv: Sequence[str]) -> int:
        self.systemctl_calls.append(list(argv))
        if argv[0] != "restart":
            return 0
        if self.fails:
            self.fails -= 1
            return 1
        return 0

    def run(self, argv: Sequence[str]) -> str:
        if argv[0] == "systemctl":
            return SHOW.format(self.status)
        if "-p" in argv:
            return f"vllm@x.service: Main process exited, code=exited, status={self.status}\n"
        return ""


def go(host: Host, tmp_path: Path) -> tuple[int, str, list[str]]:
    logged: list[str] = []
    code, text = restart("x", str(tmp_path), host.systemctl, host.run, logged.append)
    return code, text, logged


def test_a_spawn_failure_is_tried_again_and_the_restart_succeeds(tmp_path: Path) -> None:
    host = Host(fails=1, status=219)
    code, text, logged = go(host, tmp_path)
    assert (code, text) == (
        0,
        "vllm@x.service restarted, READY (attempt 2: systemd failed to spawn it before)",
    )
    assert host.systemctl_calls == [
        ["restart", "vllm@x.service"],
        ["reset-failed", "vllm@x.service"],
        ["restart", "vllm@x.service"],
    ]
    assert len(logged) == 1 and "exit status 219, the launcher never ran" in logged[0], logged
    assert f"trying again (2 of {SPAWN_ATTEMPTS})" in logged[0]


def test_a_spawn_failure_every_time_stops_after_the_attempts_with_systemds_cause(tmp_path: Path) -> None:
    host = Host(fails=99, status=217)
    code, text, logged = go(host, tmp_path)
    assert code == 1 and len(logged) == SPAWN_ATTEMPTS - 1
    assert [c[0] for c in host.systemctl_calls].count("restart") == SPAWN_ATTEMPTS
    assert text.startswith("systemd: vllm@x.service is failed (result exit-code); its main process exited with "
                           "status 217 (systemd failed to spawn it: the launcher never ran)"), text  # fmt: skip


def test_a_launcher_failure_is_not_retried_and_returns_its_cause(tmp_path: Path) -> None:
    (tmp_path / "x.json").write_text(
        json.dumps({"state": "failed", "failure_reason": "load timeout: loading"})
    )
    host = Host(fails=99, status=3)
    code, text, logged = go(host, tmp_path)
    assert (code, text, logged) == (1, "load timeout: loading", [])
    assert host.systemctl_calls == [["restart", "vllm@x.service"]]


def test_a_first_success_is_one_restart(tmp_path: Path) -> None:
    host = Host(fails=0, status=0)
    assert go(host, tmp_path) == (0, "vllm@x.service restarted, READY", [])
    assert host.systemctl_calls == [["restart", "vllm@x.service"]]
