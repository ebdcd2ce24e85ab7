"""vllm_fleet.devtools.launched, the integration tests' launcher harness: what its cleanups signal, with stand-in
processes (a ``sleep`` as the launcher, another in a session of its own as the engine named by the state file)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from vllm_fleet.devtools.launched import LaunchedInstance, start, write_config
from vllm_fleet.devtools.testing import group_processes
from vllm_fleet.host.notify import NotifyListener


def _instance(tmp_path: Path, new_session: bool) -> tuple[LaunchedInstance, subprocess.Popen[bytes]]:
    (tmp_path / "state").mkdir(parents=True)
    engine = subprocess.Popen(["sleep", "60"], start_new_session=True)
    (tmp_path / "state" / "x.json").write_text(json.dumps({"engine_pid": engine.pid}))
    launcher = subprocess.Popen(["sleep", "60"], start_new_session=new_session)
    notify = NotifyListener(str(tmp_path / "notify.sock"))
    inst = LaunchedInstance(
        "x", tmp_path, tmp_path / "state", "127.0.0.1", 1, launcher, notify, tmp_path / "l.log", new_session
    )
    return inst, engine


def test_cleanup_stops_the_launcher_and_kills_the_engines_group(tmp_path: Path) -> None:
    inst, engine = _instance(tmp_path, new_session=False)
    try:
        assert inst.engine_pid(timeout=1) == engine.pid
        inst.cleanup(wait=5)
        assert inst.proc.returncode == -15  # SIGTERM was enough
        assert engine.wait(5) == -9 and group_processes(engine.pid) == {}
        assert not (tmp_path / "notify.sock").exists()  # the listener is closed
    finally:
        engine.kill()
        inst.proc.kill()


def test_kill_needs_a_launcher_in_its_own_session(tmp_path: Path) -> None:
    inst, engine = _instance(tmp_path, new_session=False)
    try:
        with pytest.raises(RuntimeError, match="new_session=True"):
            inst.kill()
        assert inst.proc.poll() is None
    finally:
        inst.cleanup(wait=5)
        engine.wait(5)
    inst, engine = _instance(tmp_path / "own", new_session=True)
    try:
        inst.kill()
        assert inst.proc.returncode == -9
    finally:
        engine.kill()
        engine.wait(5)
        inst.notify.close()


def test_start_refuses_a_config_without_a_state_dir(tmp_path: Path) -> None:
    write_config(tmp_path, "x", {"name": "x", "port": 1})
    with pytest.raises(ValueError, match="state_dir"):
        start(tmp_path, "x")
    assert not (tmp_path / "notify.sock").exists() and not (tmp_path / "launcher.log").exists()
