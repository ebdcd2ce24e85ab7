"""The main process of ``vllm@NAME.service``: runs the engine as its child and speaks sd_notify for it.

``vllm-fleet launch NAME`` (or ``python -m vllm_fleet.host.launcher NAME``) reads
``{config_dir}/instances/NAME.json`` (rendered from units/instance.json.j2) and:

* refuses at once, with exit code ``EXIT_CONFIG`` (78, listed in the unit's RestartPreventExitStatus=),
  when the model path or the engine executable is missing — no restart storm for a configuration error;
* starts the engine in its own process group with the configured environment, relays its log lines to
  its own stdout (the journal) and derives a loading phase from them;
* while loading: ``STATUS=`` (phase + elapsed) and ``EXTEND_TIMEOUT_USEC=`` while the engine is alive and
  still printing progress, so a moderate TimeoutStartSec survives slow loads but a stuck load is caught;
* ``READY=1`` only after ``/health`` is 200 *and* a 1-token ``/v1/completions`` probe succeeds, and, when the
  config names an adapters file (``VLLM_FLEET_ADAPTERS_FILE``: LoRA on), after every adapter the instance carries
  is loaded (``POST /v1/load_lora_adapter``; one the engine refuses fails the start with ``EXIT_CONFIG`` and
  the engine's message); the adapters loaded are in ``STATUS=`` and in ``{state_dir}/adapters/NAME.json``
  (``vllm_fleet.contracts.AdapterStateFile``), refreshed from ``/v1/models`` every 30 s while ready
  (``vllm_fleet.host.adapters``);
* then ``WATCHDOG=1`` after every periodic liveness check that passes — busy is not hung: while requests run
  or wait, the check passes when the engine's work counters (tokens, engine steps, finished requests in
  ``/metrics``) advanced since the last check; when idle, a 1-token decode must succeed (an admission 503 is
  "alive and full"); a check the API server does not answer in time passes while the kernel shows it
  flooded with connections and the engine core working (``churn``). A hang stops the pings and systemd's
  watchdog restarts the unit (docs/engine-service.md);
* SIGTERM/SIGINT: ``STOPPING=1``, SIGTERM to the engine (it drains with ``--shutdown-timeout``), wait and
  exit with its code; during start-up vLLM ignores SIGTERM, so the process group is SIGKILLed after
  ``stop_kill_after_loading_seconds``;
* SIGABRT (systemd's WatchdogSignal): SIGKILL the engine's process group and exit;
* the engine dies on its own: exit non-zero at once (the group's leftovers are killed), naming what died and
  how (``engine_death``: vLLM's API server outlives a dead worker and exits 0, so the worker's death is read
  from the engine core's log line); a worker killed by SIGILL (an instruction the CPU lacks) is a
  configuration error (``EXIT_CONFIG``); SIGKILL (the OOM killer) exits 137 (1 when vLLM did not get the
  worker's status) and is restarted;
* keeps ``{state_dir}/NAME.json`` up to date for the host exporter (its format: ``vllm_fleet.contracts.StateFile``).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import http.client
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from vllm_fleet.contracts import (
    ADMIN_TOKEN_ENV,
    ADMIN_TOKEN_HEADER,
    DEFAULT_CONFIG_DIR,
    LAUNCHER_PID_ENV,
    SLEEP_STATE_PATH,
    SLEEP_TRANSITION_TIMEOUT_SECONDS,
    WAKE_FAILED_PATH,
    WAKE_WAIT_ENV,
    InstanceConfig,
    StateFile,
    adapters_file_of,
)
from vllm_fleet.files import write_json_atomic
from vllm_fleet.host import adapters
from vllm_fleet.host.churn import read_port, sample_or_flooded
from vllm_fleet.host.cpu_wait import read_group
from vllm_fleet.host.engine_death import DeathWatch
from vllm_fleet.host.launcher_actions import AskYield, PollGuard, ReportWakeFailed, SleepEngine, WakeEngine
from vllm_fleet.host.launcher_state import (
    EXIT_CONFIG,
    EXIT_ENGINE_DIED,
    EXIT_LOAD_TIMEOUT,
    Action,
    Check,
    Exit,
    Kill,
    LoadAdapters,
    Log,
    Notify,
    PollInflight,
    RefreshAdapters,
    Save,
    SaveAdapters,
    StartProbe,
    Supervisor,
    Terminate,
    exit_code_of,  # noqa: F401 (tests import it from here)
    state_file,
)
from vllm_fleet.host.netif import with_rank_interface
from vllm_fleet.host.notify import Notifier
from vllm_fleet.host.probe import ProbeResult, health, inflight, probe, sample
from vllm_fleet.host.sleep_control import (
    PEER_SLEEP_GRACE_SECONDS,
    YIELD_ASK_EVERY,
    GuardReading,
    no_peer_going_to_sleep,
)
from vllm_fleet.host.swap_group import RoomOnTheWay, Slots, yield_candidate
from vllm_fleet.host.waker import Waker

# (pattern, phase) in the order vLLM prints them; the last one seen is the current phase
PHASES: list[tuple[re.Pattern[str], str]] = [
    (re.compile(p), name)
    for p, name in [
        (r"non-default args", "parsing arguments"),
        (r"Resolved architecture", "resolving model config"),
        (r"Initializing a V1 LLM engine|Initializing an LLM engine", "starting engine core"),
        (r"Starting to load model|Loading safetensors checkpoint shards|Loading weights", "loading weights"),
        (r"Loading weights took|Model loading took", "weights loaded"),
        (
            r"Memory profiling|profile, create kv cache|KV cache size|Available KV cache memory",
            "allocating KV cache",
        ),
        (r"Compiling a graph|torch\.compile takes|Dynamo bytecode transform", "compiling (torch.compile)"),
        (r"Capturing CUDA graphs|Graph capturing finished", "capturing CUDA graphs"),
        (r"init engine \(profile, create kv cache, warmup model\) took", "engine core ready"),
        (r"Starting vLLM server on|Starting vLLM API server", "starting API server"),
        (r"Application startup complete", "API server up"),
    ]
]
_ERROR_RE = re.compile(r"\b(ERROR|CRITICAL)\b|^Traceback |^\w*(Error|Exception): ")


def parse_phase(line: str) -> str | None:
    """The loading phase a vLLM log line announces, or None."""
    found = None
    for rx, name in PHASES:
        if rx.search(line):
            found = name
    return found


def load_config(name: str, config_dir: str | Path = DEFAULT_CONFIG_DIR) -> InstanceConfig:
    """``CONFIG_DIR/instances/NAME.json``, checked against its contract (``vllm_fleet.contracts``)."""
    return InstanceConfig.load(Path(config_dir) / "instances" / f"{name}.json")


def config_problem(cfg: InstanceConfig) -> str:
    """A configuration error that no restart can fix, or ''."""
    mp = cfg.model_path
    if mp.startswith("/"):
        p = Path(mp)
        if not p.exists():
            return f"model path {mp} does not exist"
        if not p.is_dir():
            return f"model path {mp} is not a directory"
        if not (p / "config.json").is_file():
            return f"model path {mp} has no config.json (incomplete download?)"
        if not os.access(p / "config.json", os.R_OK):
            return f"model path {mp} is not readable by uid {os.getuid()}"
    if not cfg.command:
        return "empty engine command"
    exe = cfg.command[0]
    if "/" in exe and not os.access(exe, os.X_OK):
        return f"engine executable {exe} is missing or not executable"
    return ""


def write_state(state_dir: str, name: str, data: StateFile | dict[str, Any]) -> None:
    """Atomically replace ``{state_dir}/{name}.json`` (tmp file + rename). Best effort."""
    try:
        d = Path(state_dir)
        d.mkdir(parents=True, exist_ok=True)
        write_json_atomic(d / f"{name}.json", data)
    except OSError as exc:
        _log(f"cannot write state file in {state_dir}: {exc}", 4)


def _log(msg: str, level: int = 6) -> None:
    """Launcher's own messages; with a syslog priority prefix when stderr goes to the journal."""
    prefix = f"<{level}>" if os.environ.get("JOURNAL_STREAM") else ""
    sys.stderr.write(f"{prefix}vllm-fleet launcher: {msg}\n")
    sys.stderr.flush()


def admin_request(
    host: str, port: int, method: str, path: str, token: str, body: Any = None, timeout: float = 10.0
) -> tuple[int, str]:
    """One request to the engine's port with the instance's admin token (the sleep guard's development paths):
    (HTTP status, body text); (0, why) when there was no answer."""
    data = None if body is None else json.dumps(body).encode()
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        headers = {ADMIN_TOKEN_HEADER: token, "User-Agent": "vllm-fleet-launcher"}
        if data is not None:
            headers["Content-Type"] = "application/json"
        conn.request(method, path, body=data, headers=headers)
        r = conn.getresponse()
        return r.status, r.read().decode(errors="replace")[:500]
    except (OSError, http.client.HTTPException) as exc:
        return 0, f"no answer: {exc}"
    finally:
        conn.close()


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it if the launcher dies (PR_SET_PDEATHSIG), so a launcher killed
    outside systemd leaves no engine behind. Runs before the launcher starts any thread."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


# systemd's variables for the launcher, not for the engine
_SYSTEMD_ENV = (
    "NOTIFY_SOCKET",
    "WATCHDOG_USEC",
    "WATCHDOG_PID",
    "LISTEN_FDS",
    "LISTEN_PID",
    "LISTEN_FDNAMES",
)


def relay(stream: BinaryIO, line: Callable[[bytes], None]) -> None:
    """Hand the engine's output to ``line`` line by line (each ending in a newline) until it ends; progress
    bars update with carriage returns, so those end a line too (they are progress, and feed the stall
    detector)."""
    fd = stream.fileno()
    buf = b""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            chunk = b""
        if not chunk:
            if buf:
                line(buf + b"\n")
            return
        buf += chunk
        parts = re.split(rb"(?<=[\r\n])", buf)
        buf = parts.pop()
        for part in parts:
            part = part.rstrip(b"\r\n")
            if part.strip():
                line(part + b"\n")


class Launcher:
    """The I/O around a ``launcher_state.Supervisor``: the engine's process and its output, signals, the probe
    and drain threads, sd_notify and the state file. Every 0.25 s (or at once on a signal, a result or a death)
    the main loop feeds the supervisor, in this order, the engine's output, the signals, the engine's exit, the
    threads' results and the clock, and performs the actions it returns."""

    def __init__(self, cfg: InstanceConfig, notifier: Notifier | None = None) -> None:
        self.cfg = cfg
        self.n = notifier or Notifier()
        self.proc: subprocess.Popen[bytes] | None = None
        self._relay_thread: threading.Thread | None = None
        self.last_error_line = ""
        self.deaths = DeathWatch()
        self._signals: list[int] = []
        self._phases: list[str] = []  # loading phases the relay saw, for the main loop
        self._results: list[Callable[[float], list[Action]]] = []  # the threads' answers, as events
        self._wake = Waker()  # set by the signal handler and the threads (not a threading.Event: waker.py)
        wd_env = os.environ.get("WATCHDOG_USEC")
        wd = int(wd_env) / 1e6 if wd_env and wd_env.isdigit() else cfg.service.watchdog_seconds
        # sleep mode: the engine's guard accepts this token (new at every start) on its development paths
        self.admin_token = secrets.token_urlsafe(32) if cfg.sleep else ""
        self.slots: Slots | None = None
        self.room_on_the_way: Callable[[float], list[str]] = no_peer_going_to_sleep
        if cfg.sleep and cfg.sleep.group:
            self.slots = Slots(cfg.state_dir, cfg.sleep.group, cfg.sleep.max_awake, cfg.name)
            self.room_on_the_way = RoomOnTheWay(
                cfg.state_dir, cfg.sleep.group_members, PEER_SLEEP_GRACE_SECONDS
            )
        self.sm = Supervisor(cfg, wd, time.monotonic(), time.time(), self.slots, self.room_on_the_way)
        self._output_at = self.sm.t0

    def state_dict(self) -> StateFile:
        """The state file's content (its contract: ``vllm_fleet.contracts.StateFile``)."""
        return state_file(self.sm, os.getpid(), time.time())

    def save(self) -> None:
        write_state(self.cfg.state_dir, self.cfg.name, self.state_dict())

    def save_adapters(self) -> None:
        """The adapter state file (LoRA on): what the engine has loaded, as last read. Best effort."""
        try:
            adapters.write_state(
                self.cfg.state_dir, self.cfg.name, self.cfg.served_model_name, self.sm.adapters
            )
        except OSError as exc:
            _log(f"cannot write the adapter state file in {self.cfg.state_dir}: {exc}", 4)

    # ------------------------------------------------------------------ engine
    def _engine_env(self) -> dict[str, str]:
        env = dict(os.environ)
        for k in _SYSTEMD_ENV:
            env.pop(k, None)
        # a process killed by SIGILL/SIGSEGV/SIGBUS prints "Fatal Python error: ..." and its Python stack first
        env.setdefault("PYTHONFAULTHANDLER", "1")
        env.update(self.cfg.environment)
        if self.cfg.sleep is not None:  # the sleep guard's settings (vllm_fleet.host.sleep_guard)
            env[ADMIN_TOKEN_ENV] = self.admin_token
            env[LAUNCHER_PID_ENV] = str(os.getpid())
            env[WAKE_WAIT_ENV] = f"{self.cfg.sleep.wake_wait_seconds:g}"
        return with_rank_interface(env)  # a multi-node rank 0: gloo's interface from its fleet address

    def spawn(self) -> None:
        self.proc = subprocess.Popen(
            self.cfg.command,
            env=self._engine_env(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # own session + process group: signal the whole engine at once
            preexec_fn=_die_with_parent,
        )
        assert self.proc.stdout is not None
        self._relay_thread = threading.Thread(
            target=relay, args=(self.proc.stdout, self._line), name="relay", daemon=True
        )
        self._relay_thread.start()

    def _line(self, raw: bytes) -> None:
        """One line of the engine's output: to our stdout (the journal), and what it says."""
        with contextlib.suppress(OSError, ValueError):
            sys.stdout.buffer.write(raw)
            sys.stdout.buffer.flush()
        line = raw.decode(errors="replace")
        self._output_at = time.monotonic()
        if ph := parse_phase(line):
            self._phases.append(ph)  # list.append is atomic: the main loop takes them
        if _ERROR_RE.search(line):
            self.last_error_line = line.strip()[:300]
        if self.deaths.feed(line) is not None:
            self._wake.set()  # the main loop acts on it at once

    def kill_group(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    def signal_engine(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)

    # ------------------------------------------------------------------ probes and the drain wait (threads)
    def _background(self, name: str, work: Callable[[], Callable[[float], list[Action]]]) -> None:
        def run() -> None:
            self._results.append(work())
            self._wake.set()

        threading.Thread(target=run, name=name, daemon=True).start()

    def _ready_probe(self) -> Callable[[float], list[Action]]:
        cfg = self.cfg
        h = health(cfg.probe_host, cfg.port, 2.0)
        if h.ok:
            res = probe(cfg.probe_host, cfg.port, cfg.served_model_name, self.sm.probe_timeout)
        else:
            res = ProbeResult(False, 0.0, h.error, "health")
        return lambda now: self.sm.ready_probe_done(now, res)

    def _check(self) -> Callable[[float], list[Action]]:
        """One liveness check: the engine's work counters (and, when idle, a 1-token decode) between two
        readings of its threads' CPU figures (starved or hung: ``cpu_wait``) and of its port's connections
        (flooded: ``churn``)."""
        assert self.proc is not None
        cfg, pgid = self.cfg, self.proc.pid
        conns, before, t0 = read_port(cfg.port), read_group(pgid), time.monotonic()
        got, after, conns_after = sample_or_flooded(
            lambda: sample(cfg.probe_host, cfg.port, cfg.served_model_name, self.sm.probe_timeout),
            lambda: (read_group(pgid), read_port(cfg.port)),
            (before, conns),
        )
        took = time.monotonic() - t0
        if got is None:  # flooded: the API server's answer would come late; the kernel's readings judge
            got = None, ProbeResult(False, took, f"/metrics: no answer in {took:.1f}s", "metrics", True)
        reading, answer = got
        check = Check(took, before, after, reading, answer, conns, conns_after)
        return lambda now: self.sm.check_done(now, check)

    def _count_inflight(self) -> Callable[[float], list[Action]]:
        n = inflight(self.cfg.probe_host, self.cfg.port, 2.0)
        return lambda now: self.sm.drain_progress(now, n)

    def _load_adapters(self) -> Callable[[float], list[Action]]:
        cfg = self.cfg
        load = adapters.load_carried(
            cfg.probe_host, cfg.port, cfg.served_model_name, adapters_file_of(cfg.environment)
        )
        return lambda now: self.sm.adapters_loaded(now, load)

    def _refresh_adapters(self) -> Callable[[float], list[Action]]:
        cfg = self.cfg
        try:
            names: list[str] | None = sorted(
                adapters.loaded(cfg.probe_host, cfg.port, cfg.served_model_name, self.sm.probe_timeout)
            )
        except adapters.EngineError:
            names = None
        return lambda now: self.sm.adapters_refreshed(now, names)

    # ------------------------------------------------------------------ sleep mode (threads, but AskYield)
    def _admin(self, method: str, path: str, body: Any = None, timeout: float = 10.0) -> tuple[int, str]:
        cfg = self.cfg
        return admin_request(cfg.probe_host, cfg.port, method, path, self.admin_token, body, timeout)

    def _poll_guard(self) -> Callable[[float], list[Action]]:
        code, text = self._admin("GET", SLEEP_STATE_PATH, timeout=self.sm.probe_timeout)
        reading = None
        if code == 200:
            with contextlib.suppress(ValueError):
                reading = GuardReading.parse(json.loads(text), time.time())
        return lambda now: self.sm.guard_read(now, reading)

    def _sleep_engine(self, level: int) -> Callable[[float], list[Action]]:
        code, text = self._admin("POST", f"/sleep?level={level}", timeout=SLEEP_TRANSITION_TIMEOUT_SECONDS)
        return lambda now: self.sm.slept(now, code, text.strip()[:200])

    def _wake_engine(self, level: int) -> Callable[[float], list[Action]]:
        """Level 1: ``/wake_up``. Level 2 (the weights were dropped): the weights' memory, then the weights read
        again from the model's files, then the KV cache."""
        t = SLEEP_TRANSITION_TIMEOUT_SECONDS
        if level == 1:
            calls: list[tuple[str, Any]] = [("/wake_up", None)]
        else:
            reload = {"method": "reload_weights"}
            calls = [
                ("/wake_up?tags=weights", None),
                ("/collective_rpc", reload),
                ("/wake_up?tags=kv_cache", None),
            ]
        for path, body in calls:
            code, text = self._admin("POST", path, body, timeout=t)
            if code != 200:
                msg = f"POST {path}: {code or ''} {text.strip()[:200]}".replace("  ", " ")
                return lambda now: self.sm.woken(now, time.time(), False, msg)
        return lambda now: self.sm.woken(now, time.time(), True, "")

    def _report_wake_failed(self, why: str, retry_after: int) -> Callable[[float], list[Action]]:
        code, text = self._admin("POST", WAKE_FAILED_PATH, {"reason": why, "retry_after": retry_after})
        if code != 200:
            _log(f"could not tell the guard the wake failed ({code}): {text.strip()[:200]}", 4)
        return lambda now: []

    def ask_yield(self) -> None:
        """SIGUSR2 to the least recently used awake member of the swap group (its launcher yields its slot); no one
        while a member is going to sleep (its slot is on the way: a second would sleep for the same room)."""
        sleep = self.cfg.sleep
        assert sleep is not None
        if self.room_on_the_way(time.monotonic()):
            return
        found = yield_candidate(self.cfg.state_dir, sleep.group_members)
        if found is None:
            return
        name, pid = found
        try:
            os.kill(pid, signal.SIGUSR2)
        except OSError as exc:
            _log(f"cannot ask {name} (launcher pid {pid}) to yield its slot: {exc}", 4)

    def wait_for_slot(self) -> int | None:
        """Before the engine loads (it needs the GPU memory of an awake member): take a slot of the swap group,
        asking the least recently used awake member to yield meanwhile; None once taken, or the exit code (a
        stop request, or no slot within load_timeout_seconds)."""
        slots, cfg = self.slots, self.cfg
        if slots is None or slots.try_take():
            return None
        t0 = next_ask = time.monotonic()
        limit = cfg.service.load_timeout_seconds
        while not slots.try_take():
            if any(s in (signal.SIGTERM, signal.SIGINT) for s in self._signals):
                self.n.status("Stopped while waiting for a slot of its swap group")
                return 0
            now = time.monotonic()
            if now - t0 > limit:
                why = f"no free slot in swap group {slots.dir.name} for {limit:g}s (held by {', '.join(slots.holders())})"
                return self._exit(self.sm.fail(EXIT_LOAD_TIMEOUT, why))
            if now >= next_ask:
                next_ask = now + YIELD_ASK_EVERY
                self.ask_yield()
                held = ", ".join(slots.holders()) or "?"
                extend = f"EXTEND_TIMEOUT_USEC={int(max(30.0, cfg.service.start_timeout_seconds) * 1e6)}"
                self.n.send(
                    f"STATUS=Waiting for a slot of swap group {slots.dir.name} (awake: {held})", extend
                )
            self._wake.wait(0.25)
            self._wake.clear()
        _log(f"took slot {slots.index} of swap group {slots.dir.name} after {time.monotonic() - t0:.1f}s")
        return None

    # ------------------------------------------------------------------ signals
    def _on_signal(self, signum: int, _frame: object) -> None:
        self._signals.append(signum)  # list.append is atomic: no signal is lost
        self._wake.set()

    def install_signals(self) -> None:
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGABRT, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(s, self._on_signal)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)

    # ------------------------------------------------------------------ main loop
    def run(self) -> int:
        """Start the engine, then supervise it until it exits. Returns the exit code."""
        cfg = self.cfg
        problem = config_problem(cfg)
        if problem:
            return self._exit(self.sm.config_error(problem))
        self.install_signals()
        if self.sm.lora:
            self.save_adapters()  # none loaded yet (a file of the previous engine would say otherwise)
        if (code := self.wait_for_slot()) is not None:
            return code
        self.n.status(f"Starting engine for {cfg.served_model_name} on {cfg.probe_host}:{cfg.port}")
        _log(f"starting {' '.join(cfg.command)}")
        try:
            self.spawn()
        except OSError as exc:
            return self._exit(self.sm.fail(EXIT_CONFIG, f"cannot start the engine: {exc}"))
        assert self.proc is not None
        self._do(self.sm.engine_started(time.monotonic(), self.proc.pid))
        while True:
            self._wake.wait(0.25)
            self._wake.clear()
            now = time.monotonic()
            phases: list[str] = []
            while self._phases:
                phases.append(self._phases.pop(0))
            self.sm.engine_output(self._output_at, phases)
            for events in (self._on_signals, self._on_exit, self._on_results, self.sm.tick):
                code = self._do(events(now))
                if code is not None:
                    return code

    def _on_signals(self, now: float) -> list[Action]:
        """SIGABRT (systemd's watchdog) before a stop request (SIGTERM/SIGINT); then the sleep guard's wake
        request (SIGUSR1) and a swap group peer's yield request (SIGUSR2)."""
        pending: list[int] = []
        while self._signals:
            pending.append(self._signals.pop(0))
        if signal.SIGABRT in pending:
            return self.sm.watchdog_fired(now)
        out: list[Action] = []
        if signal.SIGTERM in pending or signal.SIGINT in pending:
            out += self.sm.stop_requested(now)
        if signal.SIGUSR1 in pending:
            out += self.sm.wake_requested(now)
        if signal.SIGUSR2 in pending:
            out += self.sm.yield_requested(now)
        return out

    def _on_exit(self, now: float) -> list[Action]:
        """The engine exited (stopped, or died), or one of its workers died."""
        assert self.proc is not None
        rc = self.proc.poll()
        if rc is None and (self.deaths.death is None or self.sm.stopping):
            return []
        if rc is not None and rc >= 0 and not self.sm.stopping and self._relay_thread is not None:
            # the API server ended on its own (vLLM exits 0 after a dead worker): the engine core's line
            # naming the dead worker may still be in the pipe; the relay reads it to the end
            self._relay_thread.join(2.0)
        return self.sm.engine_exited(now, rc, self.deaths.cause(), self.last_error_line)

    def _on_results(self, now: float) -> list[Action]:
        out: list[Action] = []
        while self._results:
            out += self._results.pop(0)(now)
        return out

    def _do(self, actions: list[Action]) -> int | None:
        """Perform ``actions`` in order; the exit code when one is ``Exit``."""
        for a in actions:
            if isinstance(a, Notify):
                self.n.send(*a.fields)
            elif isinstance(a, Log):
                _log(a.message, a.level)
            elif isinstance(a, Save):
                self.save()
            elif isinstance(a, StartProbe):
                self._background("probe", self._ready_probe if a.first else self._check)
            elif isinstance(a, PollInflight):
                self._background("drain", self._count_inflight)
            elif isinstance(a, LoadAdapters):
                self._background("adapters", self._load_adapters)
            elif isinstance(a, RefreshAdapters):
                self._background("adapters", self._refresh_adapters)
            elif isinstance(a, SaveAdapters):
                self.save_adapters()
            elif isinstance(a, PollGuard):
                self._background("guard", self._poll_guard)
            elif isinstance(a, SleepEngine):
                self._background("sleep", functools.partial(self._sleep_engine, a.level))
            elif isinstance(a, WakeEngine):
                self._background("wake", functools.partial(self._wake_engine, a.level))
            elif isinstance(a, ReportWakeFailed):
                report = functools.partial(self._report_wake_failed, a.reason, a.retry_after)
                self._background("wake-failed", report)
            elif isinstance(a, AskYield):
                self.ask_yield()
            elif isinstance(a, Terminate):
                self.signal_engine(signal.SIGTERM)
            elif isinstance(a, Kill):
                self.kill_group(signal.SIGKILL)
                if a.wait and self.proc is not None:
                    self.proc.wait()
            else:
                assert isinstance(a, Exit)
                if self.sm.lora:  # the engine is gone: no adapter loaded
                    self.sm.adapters = []
                    self.save_adapters()
                return a.code
        return None

    def _exit(self, actions: list[Action]) -> int:
        code = self._do(actions)
        assert code is not None
        return code


def launch(name: str, config_dir: str = DEFAULT_CONFIG_DIR) -> int:
    n = Notifier()
    try:
        cfg = load_config(name, config_dir)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        msg = f"cannot read instance config {config_dir}/instances/{name}.json: {exc}"
        n.status(f"Failed: {msg}")
        _log(msg, 3)
        return EXIT_CONFIG
    launcher = Launcher(cfg, n)
    try:
        return launcher.run()
    except Exception as exc:  # a bug of ours: named like any other failure, the engine not left behind
        for line in traceback.format_exc().rstrip().splitlines():
            _log(line, 4)
        why = f"launcher error: {type(exc).__name__}: {exc} (its traceback is in the journal); engine killed"
        return launcher._exit([Kill(wait=True), *launcher.sm.fail(EXIT_ENGINE_DIED, why)])


def _handler(a: argparse.Namespace) -> int:
    return launch(a.name, a.config_dir)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", help="instance name (reads CONFIG_DIR/instances/NAME.json)")
    p.add_argument("--config-dir", default=DEFAULT_CONFIG_DIR, help=f"default {DEFAULT_CONFIG_DIR}")
    p.set_defaults(handler=_handler)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="vllm-fleet-launch", description=__doc__.split("\n\n")[0] if __doc__ else ""
    )
    add_args(p)
    a = p.parse_args(argv)
    return int(a.handler(a))


if __name__ == "__main__":
    sys.exit(main())
