"""The main process of ``vllm@NAME.service``: runs the engine as its child and speaks sd_notify for it.

``vllm-fleet launch NAME`` (or ``python -m vllm_fleet.host.launcher NAME``) reads
``{config_dir}/instances/NAME.json`` (rendered from units/instance.json.j2) and:

* refuses at once, with exit code ``EXIT_CONFIG`` (78, listed in the unit's RestartPreventExitStatus=),
  when the model path or the engine executable is missing — no restart storm for a configuration error;
* starts the engine in its own process group with the configured environment, relays its log lines to
  its own stdout (the journal) and derives a loading phase from them;
* while loading: ``STATUS=`` (phase + elapsed) and ``EXTEND_TIMEOUT_USEC=`` while the engine is alive and
  still printing progress, so a moderate TimeoutStartSec survives slow loads but a stuck load is caught;
* ``READY=1`` only after ``/health`` is 200 *and* a 1-token ``/v1/completions`` probe succeeds;
* then ``WATCHDOG=1`` after every periodic liveness check that passes — busy is not hung: while requests run
  or wait, the check passes when the engine's work counters (tokens, engine steps, finished requests in
  ``/metrics``) advanced since the last check; when idle, a 1-token decode must succeed (an admission 503 is
  "alive and full"). A hang stops the pings and systemd's watchdog restarts the unit (docs/engine-service.md);
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
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from vllm_fleet.contracts import InstanceConfig, StateFile, probe_timing, stack_of
from vllm_fleet.host.cpu_wait import CpuReading, read_group, starvation
from vllm_fleet.host.engine_death import Death, DeathWatch
from vllm_fleet.host.netif import with_rank_interface
from vllm_fleet.host.notify import Notifier
from vllm_fleet.host.probe import ProbeResult, Progress, health, inflight, liveness, probe

EXIT_CONFIG = 78  # EX_CONFIG: configuration error, never restarted (RestartPreventExitStatus=78)
EXIT_ENGINE_DIED = 1
EXIT_LOAD_TIMEOUT = 3
EXIT_WATCHDOG = 134  # 128 + SIGABRT
DEFAULT_CONFIG_DIR = "/etc/vllm-fleet"

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
        tmp = d / f".{name}.json.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(data, sort_keys=True) + "\n")
        tmp.chmod(0o644)
        os.replace(tmp, d / f"{name}.json")
    except OSError as exc:
        _log(f"cannot write state file in {state_dir}: {exc}", 4)


def _log(msg: str, level: int = 6) -> None:
    """Launcher's own messages; with a syslog priority prefix when stderr goes to the journal."""
    prefix = f"<{level}>" if os.environ.get("JOURNAL_STREAM") else ""
    sys.stderr.write(f"{prefix}vllm-fleet launcher: {msg}\n")
    sys.stderr.flush()


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it if the launcher dies (PR_SET_PDEATHSIG), so a launcher killed
    outside systemd leaves no engine behind. Runs before the launcher starts any thread."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def exit_code_of(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


@dataclass
class _Loop:
    """What ``Launcher.run``'s supervision loop carries from one round to the next."""

    next_probe: float
    next_status: float = 0.0
    stop_at: float | None = None  # monotonic time of the first stop request
    term_at: float | None = None  # when the engine got SIGTERM
    killed: bool = False  # SIGKILL sent (once)
    loading_when_stopped: bool = False


class Launcher:
    def __init__(self, cfg: InstanceConfig, notifier: Notifier | None = None) -> None:
        self.cfg = cfg
        self.n = notifier or Notifier()
        self.proc: subprocess.Popen[bytes] | None = None
        self._relay_thread: threading.Thread | None = None
        self.state = "loading"
        self.phase = "starting"
        self.last_error_line = ""
        self.deaths = DeathWatch()
        self.failure: Death | None = None
        self.failure_reason = ""
        self.last_output = time.monotonic()
        self.started_at = time.time()
        self.t0 = time.monotonic()
        self.ready_at: float | None = None
        self.load_duration: float | None = None
        self.last_probe_at: float | None = None
        self.last_probe_ok: bool | None = None
        self.last_probe_latency: float | None = None
        self.last_probe_kind = ""  # how the last liveness check passed or failed (probe.ProbeResult.stage)
        self.probes_total = 0
        self.probe_failures_total = 0
        self.probes_starved_total = 0  # checks that timed out while the engine was starved of CPU (alive)
        self.consecutive_failures = 0
        self._alive_at = 0.0  # monotonic time of the last check that passed on the engine's own answer
        self._was_starved = False  # the last check passed as starved (the status says so)
        self._cpu_at_check: CpuReading | None = None  # the engine's CPU figures when the last check began
        self._signals: list[int] = []
        self._wake = threading.Event()
        self._drained = threading.Event()
        self.drain_result = "second stop request"
        self._probe_thread: threading.Thread | None = None
        self._probe_result: ProbeResult | None = None
        self._progress: Progress | None = None  # the last work-counter reading (liveness compares with it)
        self._probe_started = 0.0
        self._lock = threading.Lock()
        svc = cfg.service
        wd_env = os.environ.get("WATCHDOG_USEC")
        wd = int(wd_env) / 1e6 if wd_env and wd_env.isdigit() else svc.watchdog_seconds
        self.watchdog = wd if wd > 0 else 0.0
        # the watchdog timing rule (vllm_fleet.contracts, one place; the spec refuses what it would shorten)
        self.probe_interval, self.probe_timeout = probe_timing(
            self.watchdog, svc.probe_interval_seconds, svc.probe_timeout_seconds
        )

    # ------------------------------------------------------------------ state
    def state_dict(self) -> StateFile:
        """The state file's content (its contract: ``vllm_fleet.contracts.StateFile``)."""
        return {
            "instance": self.cfg.name,
            "served_model_name": self.cfg.served_model_name,
            "stack": stack_of(self.cfg.command),
            "port": self.cfg.port,
            "state": self.state,
            "launcher_pid": os.getpid(),
            "engine_pid": self.proc.pid if self.proc else None,
            "started_at": self.started_at,
            "ready_at": self.ready_at,
            "load_duration_seconds": self.load_duration,
            "phase": self.phase,
            "last_probe_at": self.last_probe_at,
            "last_probe_ok": self.last_probe_ok,
            "last_probe_latency_seconds": self.last_probe_latency,
            "last_probe_kind": self.last_probe_kind or None,
            "probes_total": self.probes_total,
            "probe_failures_total": self.probe_failures_total,
            "probes_starved_total": self.probes_starved_total,
            "failure_reason": self.failure_reason or None,
            "failure_process": (self.failure.process or None) if self.failure else None,
            "failure_signal": sig.name if self.failure and (sig := self.failure.signal) else None,
            "updated_at": time.time(),
        }

    def save(self) -> None:
        write_state(self.cfg.state_dir, self.cfg.name, self.state_dict())

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    # ------------------------------------------------------------------ engine
    def _engine_env(self) -> dict[str, str]:
        env = dict(os.environ)
        for k in (
            "NOTIFY_SOCKET",
            "WATCHDOG_USEC",
            "WATCHDOG_PID",
            "LISTEN_FDS",
            "LISTEN_PID",
            "LISTEN_FDNAMES",
        ):
            env.pop(k, None)
        # a process killed by SIGILL/SIGSEGV/SIGBUS prints "Fatal Python error: ..." and its Python stack first
        env.setdefault("PYTHONFAULTHANDLER", "1")
        env.update(self.cfg.environment)
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
            target=self._relay, args=(self.proc.stdout,), name="relay", daemon=True
        )
        self._relay_thread.start()

    def _relay(self, stream: BinaryIO) -> None:
        """Copy the engine's output to our stdout (the journal) line by line; progress bars update with
        carriage returns, so those end a line too (they are progress, and feed the stall detector)."""
        out = sys.stdout.buffer
        fd = stream.fileno()
        buf = b""
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                chunk = b""
            if not chunk:
                if buf:
                    self._line(out, buf + b"\n")
                return
            buf += chunk
            parts = re.split(rb"(?<=[\r\n])", buf)
            buf = parts.pop()
            for part in parts:
                part = part.rstrip(b"\r\n")
                if part.strip():
                    self._line(out, part + b"\n")

    def _line(self, out: BinaryIO, raw: bytes) -> None:
        with contextlib.suppress(OSError, ValueError):
            out.write(raw)
            out.flush()
        line = raw.decode(errors="replace")
        self.last_output = time.monotonic()
        ph = parse_phase(line)
        if ph and self.state == "loading":
            self.phase = ph
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

    # ------------------------------------------------------------------ probes
    def _start_probe(self, first: bool) -> None:
        def run() -> None:
            if first:
                h = health(self.cfg.probe_host, self.cfg.port, 2.0)
                if not h.ok:
                    res = ProbeResult(False, 0.0, h.error, "health")
                else:
                    res = probe(
                        self.cfg.probe_host, self.cfg.port, self.cfg.served_model_name, self.probe_timeout
                    )
                    if res.stage == "full":  # READY needs a real decode, not an admission 503
                        res = ProbeResult(
                            False, res.latency, "admission 503 before the first decode", "decode"
                        )
            else:
                res = self._liveness()
            with self._lock:
                self._probe_result = res
            self._wake.set()

        self._probe_started = time.monotonic()
        self._probe_thread = threading.Thread(target=run, name="probe", daemon=True)
        self._probe_thread.start()

    def _liveness(self) -> ProbeResult:
        """One periodic liveness check (``probe.liveness``); a check that failed for want of an answer in
        time while the kernel shows the engine's threads waiting for a CPU is starvation, not a hang: it
        passes as ``starved`` — for at most ``starved_grace_seconds`` after the last check the engine
        passed on its own answer (a hang on a starved host is still caught after that)."""
        assert self.proc is not None
        pgid = self.proc.pid
        previous, at_start = self._cpu_at_check, read_group(pgid)
        self._cpu_at_check = at_start
        prev_progress = self._progress
        res, self._progress = liveness(
            self.cfg.probe_host, self.cfg.port, self.cfg.served_model_name, self.probe_timeout, prev_progress
        )
        if res.ok:
            self._alive_at = time.monotonic()
            return res
        if not (res.timed_out or res.stage == "stalled"):
            return res  # an error answer is no starvation
        # a stall spans the time since the previous reading of the counters; a timeout this check
        since = previous if res.stage == "stalled" and previous is not None else at_start
        verdict = starvation(since, read_group(pgid))
        grace = self.cfg.service.starved_grace_seconds
        late = time.monotonic() - self._alive_at
        if verdict.starved and late <= grace:
            self.probes_starved_total += 1
            return ProbeResult(True, res.latency, f"{verdict.why}; {res.error}", "starved")
        if verdict.starved:
            why = (
                f"{verdict.why}, but no answer of its own for {late:.0f}s (> starved_grace_seconds {grace:g})"
            )
        else:
            why = verdict.why
        return ProbeResult(False, res.latency, f"{res.error} ({why})", res.stage, res.timed_out)

    def _take_probe(self) -> ProbeResult | None:
        with self._lock:
            res, self._probe_result = self._probe_result, None
        if res is not None:
            self._probe_thread = None
        return res

    def _record(self, res: ProbeResult) -> None:
        self.probes_total += 1
        self.last_probe_at = time.time()
        self.last_probe_ok = res.ok
        self.last_probe_latency = round(res.latency, 4)
        self.last_probe_kind = res.stage
        if res.ok:
            self.consecutive_failures = 0
        else:
            self.probe_failures_total += 1
            self.consecutive_failures += 1

    # ------------------------------------------------------------------ drain
    def _start_drain_wait(self, timeout: float) -> None:
        """vLLM's own drain (SIGTERM + --shutdown-timeout) finishes the requests in the engine core but can
        cut streams whose last chunks the API server has not sent yet (seen under CPU contention). So wait
        until the engine reports nothing running or waiting (twice in a row), at most ``timeout``; then
        the engine gets SIGTERM and drains whatever arrived meanwhile."""

        def run() -> None:
            deadline = time.monotonic() + timeout
            idle = 0
            self.drain_result = f"still busy after {timeout:g}s"
            while time.monotonic() < deadline and not self._drained.is_set():
                n = inflight(self.cfg.probe_host, self.cfg.port, 2.0)
                if n is None:
                    self.drain_result = "no answer from /metrics"
                    break
                idle = idle + 1 if n == 0 else 0
                if idle >= 2:
                    self.drain_result = "idle"
                    break
                self.n.status(f"Stopping: waiting for {n} in-flight request(s)")
                time.sleep(0.5)
            self._drained.set()
            self._wake.set()

        threading.Thread(target=run, name="drain", daemon=True).start()

    # ------------------------------------------------------------------ signals
    def _on_signal(self, signum: int, _frame: object) -> None:
        self._signals.append(signum)  # list.append is atomic: no signal is lost
        self._wake.set()

    def install_signals(self) -> None:
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGABRT):
            signal.signal(s, self._on_signal)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)

    # ------------------------------------------------------------------ main loop
    def status(self, text: str) -> None:
        self.n.status(text)

    def loading_status(self) -> str:
        return f"Loading {self.cfg.served_model_name}: {self.phase} ({self.elapsed():.0f}s elapsed)"

    def fail(self, code: int, why: str) -> int:
        self.state = "failed"
        self.failure_reason = why
        self.status(f"Failed: {why}")
        _log(why, 3)
        self.save()
        return code

    def _died(self, rc: int | None) -> int:
        """The engine died on its own (``rc``: the API server's exit status, None when it was still running):
        fail with what died and how, and an exit code that tells systemd whether a restart can help."""
        was = self.state
        pid = self.proc.pid if self.proc else "?"
        death = self.deaths.cause()
        api = f"; the API server exited with {rc}" if rc is not None else ""
        if death is None or (rc is not None and rc < 0):
            # the API server itself was killed (its workers die after it, by our SIGKILL), or it exited
            # with nothing else to blame
            death, api = Death(f"engine API server (pid {pid})", rc), ""
        self.failure = death
        why = f"engine exited unexpectedly: {death.describe()} while {was}{api}"
        if death.is_config_error:
            self.phase = "configuration error"
            return self.fail(EXIT_CONFIG, f"{why}; not restarting (a restart would die the same way)")
        if death.signal is None and self.last_error_line:
            why += f"; last error: {self.last_error_line}"
        sig = death.signal
        return self.fail(128 + sig.value if sig else (exit_code_of(rc or 0) or EXIT_ENGINE_DIED), why)

    def run(self) -> int:
        """Start the engine, then supervise it until it exits: every 0.25 s (or at once on a signal), in
        this order: stop requests and the watchdog signal, the engine's exit, the stop's escalation, then
        the loading or the serving step. Returns the exit code."""
        cfg = self.cfg
        problem = config_problem(cfg)
        if problem:
            self.phase = "configuration error"
            return self.fail(
                EXIT_CONFIG, f"{problem}; not starting the engine (fix the config, then restart)"
            )
        self.install_signals()
        self.status(f"Starting engine for {cfg.served_model_name} on {cfg.probe_host}:{cfg.port}")
        _log(f"starting {' '.join(cfg.command)}")
        try:
            self.spawn()
        except OSError as exc:
            return self.fail(EXIT_CONFIG, f"cannot start the engine: {exc}")
        assert self.proc is not None
        _log(f"engine pid {self.proc.pid}; watchdog {self.watchdog:g}s, probe every {self.probe_interval:g}s")
        self.save()
        loop = _Loop(next_probe=time.monotonic() + 1.0)
        while True:
            self._wake.wait(0.25)
            self._wake.clear()
            now = time.monotonic()
            code = self._on_signals(loop, now)
            if code is None:
                code = self._on_exit(loop, now)
            if code is not None:
                return code
            if loop.stop_at is not None:
                self._escalate_stop(loop, now)
                continue
            res = self._take_probe()
            if self.state == "loading":
                code = self._loading_step(loop, now, res)
                if code is not None:
                    return code
                continue
            self._serving_step(loop, now, res)

    def _on_signals(self, loop: _Loop, now: float) -> int | None:
        """SIGABRT (systemd's watchdog): kill and exit. SIGTERM/SIGINT: start the stop (drain wait, then
        SIGTERM to the engine; while loading at once); a second one ends the drain wait."""
        assert self.proc is not None
        cfg = self.cfg
        pending: list[int] = []
        while self._signals:
            pending.append(self._signals.pop(0))
        sig = signal.SIGABRT if signal.SIGABRT in pending else (pending[0] if pending else None)
        if sig == signal.SIGABRT:
            # systemd's watchdog fired: the engine is hung; it cannot drain, so kill it now
            self.kill_group(signal.SIGKILL)
            self.proc.wait()
            return self.fail(EXIT_WATCHDOG, "watchdog timeout: no successful probe in time; engine killed")
        if sig in (signal.SIGTERM, signal.SIGINT):
            if loop.stop_at is None:
                loop.stop_at = now
                loop.loading_when_stopped = self.state == "loading"
                self.state = "draining"
                self.n.send("STOPPING=1", f"STATUS=Stopping: draining (up to {cfg.shutdown_timeout:g}s)")
                self.save()
                if loop.loading_when_stopped:
                    _log("stop requested while loading: SIGTERM to the engine")
                    self.signal_engine(signal.SIGTERM)
                    loop.term_at = now
                else:
                    _log("stop requested: waiting for in-flight requests, then SIGTERM to the engine")
                    self._start_drain_wait(cfg.shutdown_timeout)
            elif loop.term_at is None:  # a second stop request: no more waiting
                self._drained.set()
        if loop.stop_at is not None and loop.term_at is None and self._drained.is_set():
            _log(
                f"drain wait over after {now - loop.stop_at:.1f}s ({self.drain_result}): SIGTERM to the engine"
            )
            self.signal_engine(signal.SIGTERM)
            loop.term_at = now
        return None

    def _on_exit(self, loop: _Loop, now: float) -> int | None:
        """The exit code when the engine has exited (stopped, or died) or one of its workers died."""
        assert self.proc is not None
        rc = self.proc.poll()
        if rc is not None:
            if loop.stop_at is None and rc >= 0 and self._relay_thread is not None:
                # the API server ended on its own (vLLM exits 0 after a dead worker): the engine core's
                # line naming the dead worker may still be in the pipe; the relay reads it to the end
                self._relay_thread.join(2.0)
            self.kill_group(signal.SIGKILL)  # leftovers (engine core, workers) of a dead API server
            if loop.stop_at is not None:
                self.state = "stopped"
                code = 0 if loop.loading_when_stopped else exit_code_of(rc)
                self.status(f"Stopped (engine exit {exit_code_of(rc)} after {now - loop.stop_at:.1f}s)")
                _log(f"engine exited with {rc} {now - loop.stop_at:.1f}s after the stop request")
                self.save()
                return code
            return self._died(rc)
        if self.deaths.death is not None and loop.stop_at is None:
            # a worker died but the API server still runs (it shuts down on its own, then exits 0)
            self.kill_group(signal.SIGKILL)
            self.proc.wait()
            return self._died(None)
        return None

    def _escalate_stop(self, loop: _Loop, now: float) -> None:
        """Stopping: SIGKILL the group once the engine outlives SIGTERM by too long."""
        if loop.term_at is None:
            return
        limit = (
            self.cfg.service.stop_kill_after_loading_seconds
            if loop.loading_when_stopped
            else self.cfg.shutdown_timeout + 10
        )
        if now - loop.term_at > limit and not loop.killed:
            _log(f"engine still running {now - loop.term_at:.0f}s after SIGTERM: SIGKILL to its group", 4)
            self.kill_group(signal.SIGKILL)
            loop.killed = True

    def _loading_step(self, loop: _Loop, now: float, res: ProbeResult | None) -> int | None:
        """Loading: READY=1 after the first good probe; status and EXTEND_TIMEOUT_USEC every 2 s while
        the engine makes progress; the load and stall timeouts (an exit code)."""
        assert self.proc is not None
        cfg, svc = self.cfg, self.cfg.service
        if res is not None:
            if res.ok:
                self._record(res)
                self.state = "ready"
                self.phase = "serving"
                self.ready_at = time.time()
                self._alive_at = now
                self.load_duration = round(self.elapsed(), 3)
                self.save()  # the state file is current before anyone hears READY
                self.n.send(
                    "READY=1",
                    f"STATUS=Serving {cfg.served_model_name} on {cfg.probe_host}:{cfg.port} "
                    f"(ready in {self.load_duration:.1f}s)",
                )
                if self.watchdog:
                    self.n.send("WATCHDOG=1")
                _log(f"ready after {self.load_duration:.1f}s (health 200 and 1-token decode ok)")
                loop.next_probe = now + self.probe_interval
                return None
            if res.stage == "decode":
                self.phase = "waiting for the first decode"
            loop.next_probe = now + 0.5
        if now >= loop.next_status:
            loop.next_status = now + 2.0
            fields = [f"STATUS={self.loading_status()}"]
            stalled = now - self.last_output > svc.stall_timeout_seconds
            if self.elapsed() > svc.load_timeout_seconds or stalled:
                self.kill_group(signal.SIGKILL)
                self.proc.wait()
                why = "no engine output" if stalled else "loading"
                limit = svc.stall_timeout_seconds if stalled else svc.load_timeout_seconds
                return self.fail(EXIT_LOAD_TIMEOUT, f"load timeout: {why} for more than {limit:g}s")
            # alive and still making progress: push systemd's start timeout forward
            extend = max(30.0, svc.start_timeout_seconds)
            fields.append(f"EXTEND_TIMEOUT_USEC={int(extend * 1e6)}")
            self.n.send(*fields)
            self.save()
        if self._probe_thread is None and now >= loop.next_probe:
            self._start_probe(first=True)
        return None

    def _serving_step(self, loop: _Loop, now: float, res: ProbeResult | None) -> None:
        """Ready: periodic liveness probes feed the watchdog (no ping while they fail)."""
        cfg = self.cfg
        if res is not None:
            was_failing = self.consecutive_failures > 0
            self._record(res)  # state stays "ready": last_probe_ok carries the probe outcome
            self.save()  # the state file is current before the notification
            if res.ok:
                if self.watchdog:
                    self.n.send("WATCHDOG=1")
                if res.stage == "starved":
                    self.status(f"Serving {cfg.served_model_name} slowly: starved of CPU")
                    _log(f"Probe late, engine alive: {res.error}", 4)
                    self._was_starved = True
                elif was_failing or self._was_starved:
                    _log("probes succeed again")
                    self._was_starved = False
                    self.status(f"Serving {cfg.served_model_name} on {cfg.probe_host}:{cfg.port}")
            else:
                msg = f"Probe failing ({self.consecutive_failures}x): {res.error}"
                self.status(msg)
                _log(msg, 4)
            loop.next_probe = self._probe_started + self.probe_interval
        elif self._probe_thread is not None and now - self._probe_started > self.probe_timeout + 5:
            # the probe thread is stuck beyond its own timeout: count it and keep not pinging
            self._record(ProbeResult(False, now - self._probe_started, "probe stuck", "decode"))
            self.status(f"Probe failing ({self.consecutive_failures}x): probe stuck")
            self._probe_started = now
            self.save()
        if self._probe_thread is None and now >= loop.next_probe:
            self._start_probe(first=False)


def launch(name: str, config_dir: str = DEFAULT_CONFIG_DIR) -> int:
    n = Notifier()
    try:
        cfg = load_config(name, config_dir)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        msg = f"cannot read instance config {config_dir}/instances/{name}.json: {exc}"
        n.status(f"Failed: {msg}")
        _log(msg, 3)
        return EXIT_CONFIG
    return Launcher(cfg, n).run()


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
