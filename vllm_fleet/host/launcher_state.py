"""The launcher's decisions, without I/O: ``Supervisor`` takes events and returns actions.

Events are method calls, each with the monotonic time ``now`` (the caller's clock: the launcher passes
``time.monotonic()``, the tests plain numbers): the engine started, printed a line, a probe or a liveness check
finished (with what it read: the work counters, the decode's answer, the CPU figures), the carried LoRA
adapters were loaded or the loaded ones read back, a stop was requested, the drain wait counted in-flight
requests, systemd's watchdog fired, the engine exited, and ``tick`` (the launcher calls it every 0.25 s). Each
returns the actions the launcher performs in order: sd_notify fields (READY=1, WATCHDOG=1, STATUS=, STOPPING=1,
EXTEND_TIMEOUT_USEC=), a log line, the state file's (or the adapter state file's) write, a probe, an in-flight
count or an adapter load or read to start, SIGTERM or SIGKILL to the engine, the launcher's exit. No threads, sockets,
clocks or sleeps here: ``vllm_fleet.host.launcher`` does all of that.

Hung is judged by withholding WATCHDOG=1: a liveness check that fails sends no ping, and systemd's watchdog
kills the unit ``WatchdogSec`` after the last one (``watchdog_deadline``; then ``watchdog_fired``). The probe
interval and timeout follow the one watchdog timing rule (``vllm_fleet.contracts.probe_timing``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from vllm_fleet.contracts import (
    ADAPTER_STATE_REFRESH_SECONDS,
    InstanceConfig,
    StateFile,
    adapters_file_of,
    probe_timing,
    stack_of,
)
from vllm_fleet.host.churn import FLOOD_JUDGE_AFTER, Conns, flooded
from vllm_fleet.host.cpu_wait import CpuReading, starvation
from vllm_fleet.host.engine_death import Death
from vllm_fleet.host.launcher_actions import (
    Action,
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
    Terminate,
    status,
)
from vllm_fleet.host.probe import ProbeResult, Progress, judge
from vllm_fleet.host.sleep_control import GuardReading, SleepControl, SlotLike, no_peer_going_to_sleep

EXIT_CONFIG = 78  # EX_CONFIG: configuration error, never restarted (RestartPreventExitStatus=78)
EXIT_ENGINE_DIED = 1
EXIT_LOAD_TIMEOUT = 3
EXIT_WATCHDOG = 134  # 128 + SIGABRT
STATUS_EVERY = 2.0  # while loading: STATUS= and EXTEND_TIMEOUT_USEC= this often
FIRST_PROBE_AFTER = 1.0  # the first readiness probe, after the engine started
READY_RETRY = 0.5  # the next readiness probe after one failed
PROBE_STUCK_AFTER = 5.0  # a check still running this long past its timeout counts as failed
DRAIN_POLL = 0.5  # the drain wait counts in-flight requests this often
DRAIN_IDLE_POLLS = 2  # ... and is over after this many counts of 0 in a row
KILL_AFTER_DRAIN = 10.0  # SIGKILL when the engine outlives SIGTERM by shutdown_timeout + this
# under connection churn the kernel's figures alone keep the pings going for at most this many WatchdogSec
# after the engine last answered on its own (docs/design/liveness-under-churn.md)
FLOOD_GRACE_WATCHDOGS = 10
CHECK_MARGIN = (
    0.5  # seconds a flood-judged check may take beyond FLOOD_JUDGE_AFTER (reading /proc, the threads)
)


def next_check_at(started: float, done: float, interval: float) -> float:
    """When the next liveness check starts, after one that ran from ``started`` to ``done``: ``interval`` after
    the last start, but early enough that a next check ending in the flood judgement (``FLOOD_JUDGE_AFTER``
    plus ``CHECK_MARGIN``) still pings within ``interval`` of this one's ping — so a quick check followed by a
    flooded one does not stretch the gap between two WATCHDOG=1 beyond the interval (a third of WatchdogSec).
    Never later than ``interval`` after the last start; never sooner than half an interval after ``done``."""
    budget = FLOOD_JUDGE_AFTER + CHECK_MARGIN
    return max(done + interval / 2, started + interval - max(0.0, budget - (done - started)))


def exit_code_of(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


@dataclass(frozen=True)
class AdapterLoad:
    """What loading the carried adapters did (``adapters.load_carried``): a line per adapter, the first one the
    engine refused (name, its message, whether the engine answered at all), the loaded set read back."""

    lines: tuple[str, ...] = ()
    failed: tuple[str, str, bool] | None = None
    loaded: tuple[str, ...] = ()


@dataclass(frozen=True)
class Check:
    """What one liveness check read: its time, the work counters (None when ``/metrics`` did not answer), the
    idle engine's decode or the ``/metrics`` failure (None while busy), the engine's CPU figures before and
    after (``cpu_wait.read_group``), and its port's connections before and after (``churn.read_port``; None
    when unread)."""

    latency: float
    cpu_before: CpuReading
    cpu_after: CpuReading
    reading: Progress | None = None
    answer: ProbeResult | None = None
    conns_before: Conns | None = None
    conns_after: Conns | None = None


# ---------------------------------------------------------------------------------------------- parts
@dataclass
class ProbeStats:
    """The probe figures the state file carries."""

    total: int = 0
    failures: int = 0
    starved: int = 0  # checks that timed out while the engine was starved of CPU (alive)
    consecutive_failures: int = 0
    last_at: float | None = None
    last_ok: bool | None = None
    last_latency: float | None = None
    last_kind: str = ""  # how the last check passed or failed (ProbeResult.stage)

    def record(self, now: float, res: ProbeResult) -> None:
        self.total += 1
        self.last_at, self.last_ok, self.last_latency = now, res.ok, round(res.latency, 4)
        self.last_kind = res.stage
        self.starved += res.stage == "starved"  # (a "flooded" pass is in last_kind only)
        if res.ok:
            self.consecutive_failures = 0
        else:
            self.failures += 1
            self.consecutive_failures += 1


@dataclass
class Liveness:
    """The verdict on each liveness check. Busy is not hung: while requests run or wait, the work counters
    must advance (``probe.judge``). Starved is not hung: a check that failed for want of an answer in time
    while the engine's threads waited for a CPU passes as ``starved``, for at most ``grace`` seconds after the
    engine last passed on its own answer (a hang on a starved host is still caught after that). Flooded is
    not hung: a check that timed out while the API server worked through a flood of connections and the engine
    core worked too passes as ``flooded`` (``churn.flooded``), for at most ``flood_grace`` seconds after the
    engine's last answer of its own."""

    grace: float  # starved_grace_seconds
    alive_at: float  # the last check that passed on the engine's own answer
    flood_grace: float = float("inf")  # FLOOD_GRACE_WATCHDOGS × WatchdogSec
    progress: Progress | None = None  # the work counters the next check compares with
    cpu_at_check: CpuReading | None = None  # the CPU figures when the last check began

    def judge(self, now: float, c: Check) -> ProbeResult:
        previous, self.cpu_at_check = self.cpu_at_check, c.cpu_before
        res, self.progress = judge(self.progress, c.reading, c.answer, c.latency)
        if res.ok:
            self.alive_at = now
            return res
        if not (res.timed_out or res.stage == "stalled"):
            return res  # an error answer is no starvation
        # a stall spans the time since the previous reading of the counters; a timeout this check
        since = previous if res.stage == "stalled" and previous is not None else c.cpu_before
        verdict = starvation(since, c.cpu_after)
        late = now - self.alive_at
        if verdict.starved and late <= self.grace:
            return ProbeResult(True, res.latency, f"{verdict.why}; {res.error}", "starved")
        why = verdict.why
        if verdict.starved:
            why += f", but no answer of its own for {late:.0f}s (> starved_grace_seconds {self.grace:g})"
        elif res.timed_out:  # the API server did not answer in time: flooded with connections?
            flood = flooded(c.cpu_before, c.cpu_after, (c.conns_before, c.conns_after))
            if flood.flooded and late <= self.flood_grace:
                return ProbeResult(True, res.latency, f"{flood.why}; {res.error}", "flooded")
            why += f"; {flood.why}" if flood.why else ""
            if flood.flooded:
                why += f", but no answer of its own for {late:.0f}s (> {self.flood_grace:g}s)"
        return ProbeResult(False, res.latency, f"{res.error} ({why})", res.stage, res.timed_out)


@dataclass
class Drain:
    """A stop. Serving: wait until the engine runs and queues nothing (twice in a row; vLLM's own drain can cut
    streams whose last chunks the API server has not sent yet), at most ``timeout`` (shutdown_timeout), then
    SIGTERM (vLLM drains whatever arrived meanwhile). Loading: SIGTERM at once. SIGKILL to the group when the
    engine outlives SIGTERM by ``kill_after``."""

    stop_at: float
    timeout: float
    kill_after: float
    loading: bool  # stopped while loading
    term_at: float | None = None  # SIGTERM sent to the engine
    killed: bool = False
    polling: bool = False
    next_poll: float = 0.0
    idle_polls: int = 0
    result: str = ""  # why the wait ended

    def start(self) -> list[Action]:
        if self.loading:
            return [
                Log("stop requested while loading: SIGTERM to the engine"),
                *self._terminate(self.stop_at),
            ]
        self.next_poll = self.stop_at
        log = Log("stop requested: waiting for in-flight requests, then SIGTERM to the engine")
        return [log, *self.tick(self.stop_at)]

    def again(self, now: float) -> list[Action]:
        """A second stop request: no more waiting."""
        return self._over(now, "second stop request") if self.term_at is None else []

    def counted(self, now: float, inflight: int | None) -> list[Action]:
        """The drain wait's count of requests running or waiting (None: ``/metrics`` did not answer)."""
        self.polling = False
        if self.term_at is not None:
            return []
        if inflight is None:
            return self._over(now, "no answer from /metrics")
        self.idle_polls = self.idle_polls + 1 if inflight == 0 else 0
        if self.idle_polls >= DRAIN_IDLE_POLLS:
            return self._over(now, "idle")
        self.next_poll = now + DRAIN_POLL
        return [status(f"Stopping: waiting for {inflight} in-flight request(s)")]

    def tick(self, now: float) -> list[Action]:
        if self.term_at is None:
            if now >= self.stop_at + self.timeout:
                return self._over(now, f"still busy after {self.timeout:g}s")
            if not self.polling and now >= self.next_poll:
                self.polling = True
                return [PollInflight()]
            return []
        if now - self.term_at > self.kill_after and not self.killed:
            self.killed = True
            msg = f"engine still running {now - self.term_at:.0f}s after SIGTERM: SIGKILL to its group"
            return [Log(msg, 4), Kill(wait=False)]
        return []

    def _over(self, now: float, why: str) -> list[Action]:
        self.result = why
        return [
            Log(f"drain wait over after {now - self.stop_at:.1f}s ({why}): SIGTERM to the engine"),
            *self._terminate(now),
        ]

    def _terminate(self, now: float) -> list[Action]:
        self.term_at = now
        return [Terminate()]


def adapters_text(names: list[str], most: int = 4) -> str:
    """The adapters in a STATUS= line: ``adapters a, b`` (at most ``most`` names, then how many more)."""
    if not names:
        return "no adapters loaded"
    shown = ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")
    return f"adapter{'s' if len(names) > 1 else ''} {shown}"


# ---------------------------------------------------------------------------------------------- machine
class Supervisor:
    """One engine's life: loading → ready → draining → stopped, or failed (``state``, as the state file
    says)."""

    def __init__(
        self,
        cfg: InstanceConfig,
        watchdog: float,
        now: float,
        started_at: float = 0.0,
        slots: SlotLike | None = None,
        room_on_the_way: Callable[[float], list[str]] = no_peer_going_to_sleep,
    ) -> None:
        self.cfg, self.svc = cfg, cfg.service
        self.watchdog = watchdog if watchdog > 0 else 0.0
        self.probe_interval, self.probe_timeout = probe_timing(
            self.watchdog, self.svc.probe_interval_seconds, self.svc.probe_timeout_seconds
        )
        self.t0, self.started_at = now, started_at  # the same moment, monotonic and wall clock
        self.state, self.phase = "loading", "starting"
        self.engine_pid: int | None = None
        self.failure: Death | None = None
        self.failure_reason = ""
        self.last_output = now
        self.ready_at: float | None = None
        self.load_duration: float | None = None
        self.next_probe = now + FIRST_PROBE_AFTER
        self.next_status = now
        self.probing = False
        self.probe_started = now
        self.probes = ProbeStats()
        flood_grace = FLOOD_GRACE_WATCHDOGS * self.watchdog if self.watchdog else float("inf")
        self.liveness = Liveness(self.svc.starved_grace_seconds, now, flood_grace)
        self.was_starved = False  # the last check passed as starved or flooded (the status says so)
        self.last_ping: float | None = None
        self.stop: Drain | None = None
        # LoRA (the config names an adapters file): the carried adapters load between the first decode and
        # READY=1; the adapter state file is refreshed from the engine every 30 s while ready (contracts)
        self.lora = bool(adapters_file_of(cfg.environment))
        self.adapters: list[str] = []  # what the engine has loaded, as last read
        self.adapters_refreshing = False
        self.next_adapters_refresh = now
        # the decode that passed while the carried adapters load (READY=1 follows their load); None: not loading
        self.ready_probe: ProbeResult | None = None
        # sleep mode (the config's ``sleep``): the engine sleeps when idle and wakes on request (sleep_control);
        # ``slots``: its swap group's slot, taken before the engine was started
        # ``room_on_the_way``: the peers going to sleep (swap_group.RoomOnTheWay)
        self.sleep = (
            SleepControl(cfg.sleep, slots, now, self._serving, room_on_the_way) if cfg.sleep else None
        )

    @property
    def stopping(self) -> bool:
        return self.stop is not None

    @property
    def watchdog_deadline(self) -> float | None:
        """When systemd's watchdog kills the unit unless another WATCHDOG=1 comes first."""
        return self.last_ping + self.watchdog if self.watchdog and self.last_ping is not None else None

    # ------------------------------------------------------------------ start, output, failure
    def engine_started(self, now: float, pid: int) -> list[Action]:
        self.engine_pid = pid
        self.next_probe = now + FIRST_PROBE_AFTER
        msg = f"engine pid {pid}; watchdog {self.watchdog:g}s, probe every {self.probe_interval:g}s"
        return [Log(msg), Save()]

    def engine_output(self, at: float, phases: list[str]) -> None:
        """The engine printed a line at ``at``; ``phases``: the loading phases its lines announced since."""
        self.last_output = max(self.last_output, at)
        if phases and self.state == "loading":
            self.phase = phases[-1]

    def config_error(self, why: str) -> list[Action]:
        self.phase = "configuration error"
        return self.fail(EXIT_CONFIG, f"{why}; not starting the engine (fix the config, then restart)")

    def fail(self, code: int, why: str) -> list[Action]:
        self.state, self.failure_reason = "failed", why
        return [status(f"Failed: {why}"), Log(why, 3), Save(), Exit(code)]

    def watchdog_fired(self, now: float) -> list[Action]:
        """SIGABRT, systemd's WatchdogSignal: the engine is hung and cannot drain."""
        msg = "watchdog timeout: no successful probe in time; engine killed"
        return [Kill(wait=True), *self.fail(EXIT_WATCHDOG, msg)]

    def engine_exited(
        self, now: float, rc: int | None, death: Death | None, last_error: str = ""
    ) -> list[Action]:
        """The API server exited with ``rc``, or (``rc`` None) a worker died (``death``) while it still runs.
        ``death``: what the engine's log says died; ``last_error``: its last error line."""
        if rc is not None and self.stop is not None:
            self.state = "stopped"
            took = now - self.stop.stop_at
            code = 0 if self.stop.loading else exit_code_of(rc)
            return [
                Kill(wait=False),  # leftovers of the group
                status(f"Stopped (engine exit {exit_code_of(rc)} after {took:.1f}s)"),
                Log(f"engine exited with {rc} {took:.1f}s after the stop request"),
                Save(),
                Exit(code),
            ]
        if rc is None and (death is None or self.stop is not None):
            return []  # still running; a worker's death during a stop is the stop's business
        was, api = self.state, f"; the API server exited with {rc}" if rc is not None else ""
        if death is None or (rc is not None and rc < 0):
            # the API server itself was killed (its workers die after it, by our SIGKILL), or it exited with
            # nothing else to blame
            pid = self.engine_pid if self.engine_pid is not None else "?"
            death, api = Death(f"engine API server (pid {pid})", rc), ""
        self.failure = death
        why = f"engine exited unexpectedly: {death.describe()} while {was}{api}"
        kill: list[Action] = [Kill(wait=rc is None)]
        if death.is_config_error:
            self.phase = "configuration error"
            return kill + self.fail(EXIT_CONFIG, f"{why}; not restarting (a restart would die the same way)")
        if death.signal is None and last_error:
            why += f"; last error: {last_error}"
        sig = death.signal
        return kill + self.fail(128 + sig.value if sig else (exit_code_of(rc or 0) or EXIT_ENGINE_DIED), why)

    # ------------------------------------------------------------------ the clock
    def tick(self, now: float) -> list[Action]:
        if self.state in ("failed", "stopped"):
            return []
        if self.stop is not None:
            return self.stop.tick(now)
        if self.state == "loading":
            return self._loading_tick(now)
        out: list[Action] = []
        sleep = self.sleep
        if sleep is not None:
            if hung := sleep.hung(now):
                return [Kill(wait=True), *self.fail(EXIT_ENGINE_DIED, f"engine hung: {hung}")]
            out += sleep.tick(now)
        if sleep is not None and sleep.state != "awake":
            # asleep, or going to sleep or waking: a decode check would wake it (the guard holds it)
            out += self._sleep_ping(now)
        else:
            if self.probing and now - self.probe_started > self.probe_timeout + PROBE_STUCK_AFTER:
                # the check is stuck beyond its own timeout: count it and keep not pinging
                self.probes.record(now, ProbeResult(False, now - self.probe_started, "probe stuck", "decode"))
                self.probe_started = now
                out += [status(f"Probe failing ({self.probes.consecutive_failures}x): probe stuck"), Save()]
            if not self.probing and now >= self.next_probe:
                out.append(self._start_probe(now, first=False))
        if self.lora and not self.adapters_refreshing and now >= self.next_adapters_refresh:
            self.adapters_refreshing = True
            out.append(RefreshAdapters())
        return out

    def _loading_tick(self, now: float) -> list[Action]:
        """STATUS= and EXTEND_TIMEOUT_USEC= every 2 s while the engine prints; the load and stall timeouts."""
        out: list[Action] = []
        if now >= self.next_status:
            self.next_status = now + STATUS_EVERY
            svc = self.svc
            stalled = now - self.last_output > svc.stall_timeout_seconds
            if now - self.t0 > svc.load_timeout_seconds or stalled:
                why = "no engine output" if stalled else "loading"
                limit = svc.stall_timeout_seconds if stalled else svc.load_timeout_seconds
                why = f"load timeout: {why} for more than {limit:g}s"
                return [Kill(wait=True), *self.fail(EXIT_LOAD_TIMEOUT, why)]
            # alive and still making progress: push systemd's start timeout forward
            extend = f"EXTEND_TIMEOUT_USEC={int(max(30.0, svc.start_timeout_seconds) * 1e6)}"
            out += [Notify((f"STATUS={self.loading_status(now)}", extend)), Save()]
        if not self.probing and self.ready_probe is None and now >= self.next_probe:
            out.append(self._start_probe(now, first=True))
        return out

    def loading_status(self, now: float) -> str:
        return f"Loading {self.cfg.served_model_name}: {self.phase} ({now - self.t0:.0f}s elapsed)"

    def _start_probe(self, now: float, first: bool) -> StartProbe:
        self.probing, self.probe_started = True, now
        return StartProbe(first)

    # ------------------------------------------------------------------ probes
    def ready_probe_done(self, now: float, res: ProbeResult) -> list[Action]:
        """READY=1 after the first probe that got a real decode (health 200, then 1 token)."""
        self.probing = False
        if self.state != "loading" or self.stop is not None:
            return []
        if res.ok and res.stage == "full":  # READY needs a real decode, not an admission 503
            res = ProbeResult(False, res.latency, "admission 503 before the first decode", "decode")
        if not res.ok:
            if res.stage == "decode":
                self.phase = "waiting for the first decode"
            self.next_probe = now + READY_RETRY
            return []
        if self.lora:  # the carried adapters before READY=1
            self.ready_probe = res
            self.phase = "loading adapters"
            return [status(self.loading_status(now)), Save(), LoadAdapters()]
        return self._ready(now, res)

    def adapters_loaded(self, now: float, load: AdapterLoad) -> list[Action]:
        """The carried adapters are loaded: READY=1. One the engine refused fails the start, as a configuration
        error when the engine answered (a restart would load the same files: exit 78, not restarted; the
        play starts it again once the spec or the files change), else as an engine failure (restarted)."""
        passed, self.ready_probe = self.ready_probe, None
        if self.state != "loading" or self.stop is not None:
            return []
        out: list[Action] = [Log(line) for line in load.lines]
        if load.failed is not None:
            name, msg, answered = load.failed
            why = f"LoRA adapter {name} could not be loaded: {msg}"
            if answered:
                self.phase = "configuration error"
                why += "; not restarting (fix the adapter or the spec, then rerun the play)"
            return [*out, Kill(wait=True), *self.fail(EXIT_CONFIG if answered else EXIT_ENGINE_DIED, why)]
        self.adapters = list(load.loaded)
        self.next_adapters_refresh = now + ADAPTER_STATE_REFRESH_SECONDS
        assert passed is not None
        return [*out, SaveAdapters(), *self._ready(now, passed)]

    def adapters_refreshed(self, now: float, names: list[str] | None) -> list[Action]:
        """What the engine has loaded now (None: it did not say): the adapter state file follows."""
        self.adapters_refreshing = False
        self.next_adapters_refresh = now + ADAPTER_STATE_REFRESH_SECONDS
        if names is None or self.state != "ready" or self.stop is not None:
            return []
        self.adapters = sorted(names)
        return [SaveAdapters()]

    def _ready(self, now: float, res: ProbeResult) -> list[Action]:
        self.probes.record(now, res)
        self.state, self.phase = "ready", "serving"
        self.ready_at = self.liveness.alive_at = now
        self.load_duration = round(now - self.t0, 3)
        if self.sleep is not None:
            self.sleep.next_poll = now
        self.next_probe = now + self.probe_interval
        checked = "health 200 and 1-token decode ok"
        checked += f"; {len(self.adapters)} adapter(s) loaded" if self.lora else ""
        return [
            Save(),  # the state file is current before anyone hears READY
            Notify(("READY=1", f"STATUS={self._serving()} (ready in {self.load_duration:.1f}s)")),
            *self._ping(now),
            Log(f"ready after {self.load_duration:.1f}s ({checked})"),
        ]

    def check_done(self, now: float, check: Check) -> list[Action]:
        """A periodic liveness check finished: WATCHDOG=1 when it passed, none while checks fail. One that ran
        while the engine went to sleep (or woke) judges nothing: asleep, the guard's answers are the check."""
        self.probing = False
        if self.state != "ready" or self.stop is not None:
            return []
        if self.sleep is not None and (
            self.sleep.state != "awake" or self.sleep.op_started > self.probe_started
        ):
            self.next_probe = max(self.next_probe, now + self.probe_interval)
            return []
        res = self.liveness.judge(now, check)
        was_failing = self.probes.consecutive_failures > 0
        self.probes.record(now, res)  # state stays "ready": last_probe_ok carries the outcome
        self.next_probe = next_check_at(self.probe_started, now, self.probe_interval)
        out: list[Action] = [Save()]  # the state file is current before the notification
        if not res.ok:
            msg = f"Probe failing ({self.probes.consecutive_failures}x): {res.error}"
            return [*out, status(msg), Log(msg, 4)]
        out += self._ping(now)
        if res.stage == "starved":
            self.was_starved = True
            name = self.cfg.served_model_name
            out += [
                status(f"Serving {name} slowly: starved of CPU"),
                Log(f"Probe late, engine alive: {res.error}", 4),
            ]
        elif res.stage == "flooded":
            self.was_starved = True
            name = self.cfg.served_model_name
            out += [
                status(f"Serving {name} under connection churn"),
                Log(f"Probe late, engine alive: {res.error}", 4),
            ]
        elif was_failing or self.was_starved:
            self.was_starved = False
            out += [Log("probes succeed again"), status(self._serving())]
        return out

    def _serving(self) -> str:
        out = f"Serving {self.cfg.served_model_name} on {self.cfg.probe_host}:{self.cfg.port}"
        return out + (f", {adapters_text(self.adapters)}" if self.lora else "")

    def _ping(self, now: float) -> list[Action]:
        if not self.watchdog:
            return []
        self.last_ping = now
        return [Notify(("WATCHDOG=1",))]

    # ------------------------------------------------------------------ sleep mode
    def _sleep_ping(self, now: float) -> list[Action]:
        """Not awake: the liveness check is the guard's answer (asleep) or the sleep or wake request running
        (bounded by ``SleepControl.hung``): WATCHDOG=1 once per probe interval."""
        sleep = self.sleep
        assert sleep is not None
        if not sleep.op:  # asleep: the guard's answers ping (guard_read)
            return []
        due = self.last_ping is None or now - self.last_ping >= self.probe_interval
        return self._ping(now) if due else []

    def _sleeping(self) -> SleepControl | None:
        """The sleep controller while the engine serves (ready, not stopping)."""
        return self.sleep if self.state == "ready" and self.stop is None else None

    def guard_read(self, now: float, reading: GuardReading | None) -> list[Action]:
        """The guard's state (``PollGuard``; None: it did not answer). Asleep, an answer is a liveness pass."""
        if (sleep := self._sleeping()) is None:
            if self.sleep is not None:
                self.sleep.polling = False
            return []
        # a liveness check may run meanwhile: its decode is counted by the guard (a 409 if it is in flight when
        # the sleep comes), refused at once if it arrives after (never held, never a wake), and its verdict
        # dropped (check_done)
        out = sleep.guard_read(now, reading)
        if reading is not None and sleep.state == "asleep":
            self.liveness.alive_at = now
            due = self.last_ping is None or now - self.last_ping >= self.probe_interval
            out += self._ping(now) if due else []
        return out

    def slept(self, now: float, code: int, message: str) -> list[Action]:
        """The answer to ``SleepEngine``: the HTTP status (0: no answer) and its message."""
        if self.sleep is None or self.state != "ready":
            return []
        return self.sleep.slept(now, code, message)

    def woken(self, now: float, wall: float, ok: bool, message: str) -> list[Action]:
        """The answer to ``WakeEngine``."""
        if self.sleep is None or self.state != "ready":
            return []
        out = self.sleep.woken(now, wall, ok, message)
        if ok:  # the engine answered on its own: the starved/flooded graces count from now
            self.liveness.alive_at = now
            self.liveness.progress = None
            self.next_probe = max(self.next_probe, now + self.probe_interval)
            # ... and a liveness pass: WATCHDOG=1 now, as the next check comes an interval from now (without it a
            # member woken just before a ping was due went two intervals without one)
            out += self._ping(now)
        return out

    def wake_requested(self, now: float) -> list[Action]:
        """SIGUSR1: the guard holds a request for the sleeping engine."""
        return sleep.wake_requested(now) if (sleep := self._sleeping()) is not None else []

    def yield_requested(self, now: float) -> list[Action]:
        """SIGUSR2: a peer of the swap group needs this engine's slot."""
        return sleep.yield_requested(now) if (sleep := self._sleeping()) is not None else []

    # ------------------------------------------------------------------ stop
    def stop_requested(self, now: float) -> list[Action]:
        """SIGTERM/SIGINT (``Drain``); a second one ends the drain wait."""
        if self.state in ("failed", "stopped"):
            return []
        if self.stop is not None:
            return self.stop.again(now)
        loading, timeout = self.state == "loading", self.cfg.shutdown_timeout
        kill_after = self.svc.stop_kill_after_loading_seconds if loading else timeout + KILL_AFTER_DRAIN
        self.stop = Drain(now, timeout, kill_after, loading)
        self.state = "draining"
        notify = Notify(("STOPPING=1", f"STATUS=Stopping: draining (up to {timeout:g}s)"))
        held = self.sleep.stopping() if self.sleep is not None else []
        return [notify, Save(), *held, *self.stop.start()]

    def drain_progress(self, now: float, inflight: int | None) -> list[Action]:
        return [] if self.stop is None else self.stop.counted(now, inflight)


def state_file(sm: Supervisor, launcher_pid: int, updated_at: float) -> StateFile:
    """The state file's content (its contract: ``vllm_fleet.contracts.StateFile``); times on the wall clock."""

    def wall(t: float | None) -> float | None:
        return None if t is None else sm.started_at + (t - sm.t0)

    cfg, failure, p = sm.cfg, sm.failure, sm.probes
    return {
        "instance": cfg.name,
        "served_model_name": cfg.served_model_name,
        "stack": stack_of(cfg.command),
        "port": cfg.port,
        "state": sm.state,
        "launcher_pid": launcher_pid,
        "engine_pid": sm.engine_pid,
        "started_at": sm.started_at,
        "ready_at": wall(sm.ready_at),
        "load_duration_seconds": sm.load_duration,
        "phase": sm.phase,
        "last_probe_at": wall(p.last_at),
        "last_probe_ok": p.last_ok,
        "last_probe_latency_seconds": p.last_latency,
        "last_probe_kind": p.last_kind or None,
        "probes_total": p.total,
        "probe_failures_total": p.failures,
        "probes_starved_total": p.starved,
        "failure_reason": sm.failure_reason or None,
        "failure_process": (failure.process or None) if failure else None,
        "failure_signal": sig.name if failure and (sig := failure.signal) else None,
        "updated_at": updated_at,
        # sleep mode: none configured (the sleep controller's fields replace these)
        "sleep_state": None,
        "sleep_level": None,
        "swap_group": None,
        "last_active_at": None,
        "asleep_since": None,
        "sleeps_total": 0,
        "wakes_total": 0,
        "failed_wakes_total": 0,
        "wake_seconds_total": 0.0,
        "last_wake_seconds": None,
        "asleep_seconds_total": 0.0,
        "last_wake_failure": None,
        **(sm.sleep.fields(wall) if sm.sleep is not None else {}),  # type: ignore[typeddict-item]
    }
