"""The files one side of vllm-fleet writes and another reads, each defined once (standard library only, so
both the controller's ``fleet`` package and the hosts' ``host`` package import it):

- ``InstanceConfig``: ``{config_dir}/instances/NAME.json``, rendered on the controller from
  units/instance.json.j2 (``vllm-fleet render`` and the artifacts role), read on the host by the launcher
  (``vllm_fleet.host.launcher.load_config``) and the exporter.
- ``StateFile``: ``{state_dir}/NAME.json``, written by the launcher (``Launcher.state_dict``), read by the
  host exporter (``vllm_fleet.host.exporter.read_instances``).
- ``WorkerStateFile``: ``{state_dir}/workers/NAME.json``, written by a multi-node instance's headless rank
  (``vllm_fleet.host.worker.state_dict``), read by the host exporter (``vllm_fleet.host.exporter.read_workers``);
  in a folder of its own, so that the exporter's ``{state_dir}/*.json`` never takes a worker for an instance.
- ``AdapterStateFile``: ``{state_dir}/adapters/NAME.json``, the LoRA adapters an instance's engine has loaded,
  written by the launcher and ``vllm-fleet adapters sync`` (``vllm_fleet.host.adapters``), read by the exporter.
- ``SERVICE_DEFAULTS``: the defaults of an instance's ``service`` settings: the spec's ``ServiceSettings``,
  the base unit ``vllm@.service`` and the launcher take them from here; ``probe_timing``: the watchdog timing
  rule both the spec's validation and the launcher apply.
- ``parse_nvidia_smi``: the GPU facts the doctor reads on a host and the planner reads on the controller.
- ``HostContract``: ``{config_dir}/host.json``, a host's contract: what its commands (``vllm-fleet fetch``,
  ``manifest``, ``doctor``) need of the fleet spec, built on the controller (``vllm_fleet.fleet.host_contract``,
  rendered as an engine artifact by ``vllm-fleet render`` and the roles); a host reads it, never the spec.
- ``AdmissionConfig``: the gateway host's admission service config (``vllm-fleet admission --config``), read
  by ``vllm_fleet.host.admission_service``.
- ``VrrpStateFile``: ``VRRP_STATE_FILE`` on a gateway host of two or more, written by keepalived's notify
  (``vllm_fleet.host.vrrp_notify``), read by the host exporter (``vllm_fleet.host.exporter.vrrp``).
- ``AdaptersFile``: ``{config_dir}/instances/NAME.adapters.json``, an instance's LoRA adapters (every adapter of
  its served model, with where its files are and whether the instance carries it), rendered on the controller
  (``vllm_fleet.fleet.context.adapters_json``), read on the host by the launcher, ``vllm-fleet adapters sync`` and
  the LoRA resolver; a change of it never restarts the instance (docs/lora.md).
- ``GatewayPeers``: ``GATEWAY_PEERS_FILE`` on a gateway host of two or more, rendered on the controller
  (``vllm_fleet.fleet.ha.gateway_peer_plan``), read by ``vllm-fleet drain`` (``vllm_fleet.host.drain``): the other
  gateways, told every drain and undrain.
- ``SleepwatchConfig``: ``SLEEPWATCH_CONFIG_FILE`` on a gateway host that routes to a model that sleeps, rendered
  on the controller (``vllm_fleet.fleet.sleepwatch_plan``), read by ``vllm-fleet sleepwatch``
  (``vllm_fleet.host.sleepwatch``), which writes ``AsleepFile`` (``SLEEP_ASLEEP_FILE``) for the njs router.

The loaders check every field's type and name the file and field of a mismatch (``ContractError``).
"""

from __future__ import annotations

import dataclasses
import json
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from types import UnionType
from typing import Any, TypedDict, TypeVar

# a pinned hub revision that cannot move: a full commit hash (the spec's check, the fetch's resolution)
COMMIT_RE = re.compile(r"[0-9a-f]{40}")

# the deployment manifest of a host (``vllm-fleet manifest`` writes it, the host exporter reads its spec hash)
MANIFEST_PATH = "/var/lib/vllm-fleet/manifest.json"


class ContractError(ValueError):
    """A file does not match its contract: the message names the file and the field."""


@dataclass(frozen=True)
class ServiceDefaults:
    """Defaults of ``models[].service`` (the spec's ``ServiceSettings`` documents each field)."""

    start_timeout_seconds: int = 180
    load_timeout_seconds: int = 3600
    stall_timeout_seconds: int = 900
    watchdog_seconds: int = 60
    probe_interval_seconds: float = 10.0
    probe_timeout_seconds: float = 20.0
    stop_kill_after_loading_seconds: float = 5.0
    starved_grace_seconds: int = 300
    restart_sec: int = 10
    start_limit_burst: int = 5
    start_limit_interval_seconds: int = 900


SERVICE_DEFAULTS = ServiceDefaults()
_D = SERVICE_DEFAULTS

# The watchdog timing rule, the one place it is written. Under a watchdog of W seconds the launcher starts a
# liveness check at least every W/3 s (a late ping still leaves one more round before systemd's deadline) and
# gives each check at most 0.8·W s (its verdict comes before the deadline). The spec refuses settings beyond
# these limits (fleet/spec.py, ServiceSettings); the launcher applies them to the watchdog systemd actually
# set (WATCHDOG_USEC), which equals the spec's unless someone overrides the unit.
PROBE_INTERVAL_PER_WATCHDOG = 1 / 3
PROBE_TIMEOUT_PER_WATCHDOG = 0.8


# Keep-alive between the gateway and the engines, the one place both idle timeouts are written. The side that
# reuses an idle connection must give it up first: nginx (the upstream pool's ``keepalive_timeout``) closes an
# idle engine connection after GATEWAY_UPSTREAM_KEEPALIVE_SECONDS; the engine (uvicorn's ``timeout_keep_alive``,
# set through VLLM_HTTP_TIMEOUT_KEEP_ALIVE) only after ENGINE_HTTP_KEEPALIVE_SECONDS. vLLM's default is 5 s, and
# a client whose pool keeps connections longer (aiohttp: 15 s), or whose event loop is too busy to see the
# engine's FIN in time, sends a request on a connection the engine has closed: a reset before any byte of an
# answer, which no client retries for a POST. 75 s (nginx's own default for its clients) leaves the gateway a
# margin of 71 s and stays above the common client pools (httpx 5 s, aiohttp 15 s); docs/gateway.md.
GATEWAY_UPSTREAM_KEEPALIVE_SECONDS = 4
ENGINE_HTTP_KEEPALIVE_SECONDS = 75


def probe_timing(watchdog_seconds: float, interval: float, timeout: float) -> tuple[float, float]:
    """The probe interval and timeout used under a watchdog of ``watchdog_seconds`` (0: no watchdog, no limit)."""
    if watchdog_seconds <= 0:
        return interval, timeout
    return (
        min(interval, watchdog_seconds * PROBE_INTERVAL_PER_WATCHDOG),
        min(timeout, watchdog_seconds * PROBE_TIMEOUT_PER_WATCHDOG),
    )


def probe_timing_problems(watchdog_seconds: float, interval: float, timeout: float) -> list[str]:
    """What the rule refuses in a spec: settings the launcher would have to shorten."""
    if watchdog_seconds <= 0:
        return []
    out = []
    if interval > watchdog_seconds * PROBE_INTERVAL_PER_WATCHDOG:
        out.append(
            f"probe_interval_seconds {interval:g} must be at most a third of watchdog_seconds "
            f"({watchdog_seconds * PROBE_INTERVAL_PER_WATCHDOG:.3g} s)"
        )
    if timeout > watchdog_seconds * PROBE_TIMEOUT_PER_WATCHDOG:
        out.append(
            f"probe_timeout_seconds {timeout:g} must be at most 0.8 × watchdog_seconds "
            f"({watchdog_seconds * PROBE_TIMEOUT_PER_WATCHDOG:.3g} s)"
        )
    return out


def _where(source: str, key: str) -> str:
    return f"{source}: {key}" if source else key


def _number(v: Any, source: str, key: str) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise ContractError(f"{_where(source, key)}: expected a number, got {v!r}")
    return float(v)


def _integer(v: Any, source: str, key: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ContractError(f"{_where(source, key)}: expected an integer, got {v!r}")
    return v


def _string(v: Any, source: str, key: str) -> str:
    if not isinstance(v, str):
        raise ContractError(f"{_where(source, key)}: expected a string, got {v!r}")
    return v


def _mapping(v: Any, source: str, key: str) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise ContractError(f"{_where(source, key)}: expected an object, got {v!r}")
    return v


# ------------------------------------------------------------------------- sleep mode (issue 33, docs/sleep.md)
# An instance whose model has ``sleep`` runs vLLM with ``--enable-sleep-mode`` and ``VLLM_SERVER_DEV_MODE=1``
# (the only way vLLM serves /sleep and /wake_up), and the sleep guard in front of its API server
# (``--middleware SLEEP_GUARD``): every development path answers a JSON 404 unless the request carries the
# instance's admin token (a random one per start, made by the launcher and given to the engine alone in its
# environment), and a request arriving while the engine sleeps is held until it is awake (the guard asks the
# launcher to wake it: SIGUSR1), or answered 503 JSON with Retry-After when the wake fails or takes longer than
# the wait. The launcher owns sleep and wake: it puts an idle engine to sleep and wakes it on the guard's signal,
# taking a slot of the instance's swap group first (host-local flock slots; a peer asked to yield: SIGUSR2).
SLEEP_GUARD = "vllm_fleet.host.sleep_guard.SleepGuard"
SLEEP_LEVELS = (1, 2)  # 1: weights to host memory, KV cache dropped; 2: both dropped (wake reloads from disk)
SLEEP_STATES = ("awake", "sleeping", "asleep", "waking")
ADMIN_TOKEN_ENV = "VLLM_FLEET_ADMIN_TOKEN"  # the engine's environment: the token its guard accepts
ADMIN_TOKEN_HEADER = "X-VF-Admin-Token"
LAUNCHER_PID_ENV = "VLLM_FLEET_LAUNCHER_PID"  # whom the guard signals (SIGUSR1) for a wake
WAKE_WAIT_ENV = "VLLM_FLEET_WAKE_WAIT_SECONDS"  # how long the guard holds a request for a wake
DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"
# the User-Agent of the launcher's probes (host/probe.py): the guard counts them in flight, but they do not keep
# an idle engine awake
PROBE_USER_AGENT = "vllm-fleet-probe"
# the guard's own paths on the engine's port: GET the sleep state (public, read-only JSON: state, inflight, held,
# last_request_at); POST a failed wake (admin token; held requests get their 503 at once)
SLEEP_STATE_PATH = "/vllm-fleet/sleep"
WAKE_FAILED_PATH = "/vllm-fleet/wake-failed"
# what vLLM serves only with VLLM_SERVER_DEV_MODE=1 (0.21-0.33): the guard answers them only with the token
DEV_MODE_PATHS = (
    "/sleep",
    "/wake_up",
    "/is_sleeping",
    "/collective_rpc",
    "/reset_prefix_cache",
    "/reset_mm_cache",
    "/reset_encoder_cache",
    "/server_info",
    "/scale_elastic_ep",
    "/is_scaling_elastic_ep",
    "/pause",
    "/resume",
    "/is_paused",
    "/update_weights",
    "/init_weight_transfer",
    "/get_world_size",
)
WAKE_RETRY_AFTER_SECONDS = 5  # Retry-After of a request whose wake failed or did not finish in its wait
WAKE_WAIT_SECONDS = (
    60.0  # models[].sleep.wake_wait_seconds default: L1 sleep of a peer (9.7 s) + wake (0.6 s)
)
SLEEP_TRANSITION_TIMEOUT_SECONDS = 600.0  # a sleep or wake still running this long: the engine is hung
SWAP_SUBDIR = "swap"  # {state_dir}/swap/GROUP/slot-N.lock: one flock per engine awake (or loading) in GROUP
# GPU memory an engine asleep keeps (CUDA context, what vLLM's allocator does not manage): 2.63 GiB measured on
# the H200 for a Qwen3-8B shape, TP 1 (docs/perf/sleep.md); the plan reserves this per sleeper and GPU
ASLEEP_GPU_GIB = 3.0


@dataclass
class ServiceConfig:
    """What the launcher uses of an instance's ``service`` settings (the systemd ones go to the unit)."""

    start_timeout_seconds: float = _D.start_timeout_seconds
    load_timeout_seconds: float = _D.load_timeout_seconds
    stall_timeout_seconds: float = _D.stall_timeout_seconds
    watchdog_seconds: float = _D.watchdog_seconds
    probe_interval_seconds: float = _D.probe_interval_seconds
    probe_timeout_seconds: float = _D.probe_timeout_seconds
    stop_kill_after_loading_seconds: float = _D.stop_kill_after_loading_seconds
    starved_grace_seconds: float = _D.starved_grace_seconds

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "") -> ServiceConfig:
        """The known keys (numbers); others (``restart_sec`` ...) are systemd's, not the launcher's."""
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: _number(v, source, f"service.{k}") for k, v in d.items() if k in known})


@dataclass
class SleepConfig:
    """An instance's sleep mode (the model's ``sleep`` in the spec; docs/sleep.md): the level it sleeps at, after
    how long idle (None: only when a peer of its swap group needs the room), how long the guard holds a request
    for a wake; its swap group on this host (``""``: none), how many of the group may be awake (or loading) at
    once, and the group's other instances on this host (whom the launcher asks to yield, least recently used
    first)."""

    level: int = 1
    idle_seconds: float | None = None
    wake_wait_seconds: float = WAKE_WAIT_SECONDS
    group: str = ""
    max_awake: int = 1
    group_members: list[str] = field(default_factory=list)

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "") -> SleepConfig:
        level = _integer(d.get("level", 1), source, "sleep.level")
        if level not in SLEEP_LEVELS:
            raise ContractError(
                f"{_where(source, 'sleep.level')}: expected one of {SLEEP_LEVELS}, got {level}"
            )
        idle = d.get("idle_seconds")
        members = d.get("group_members") or []
        if not isinstance(members, list):
            raise ContractError(f"{_where(source, 'sleep.group_members')}: expected a list, got {members!r}")
        return cls(
            level=level,
            idle_seconds=None if idle is None else _number(idle, source, "sleep.idle_seconds"),
            wake_wait_seconds=_number(
                d.get("wake_wait_seconds", WAKE_WAIT_SECONDS), source, "sleep.wake_wait_seconds"
            ),
            group=_string(d.get("group") or "", source, "sleep.group"),
            max_awake=_integer(d.get("max_awake", 1), source, "sleep.max_awake"),
            group_members=[_string(m, source, f"sleep.group_members[{i}]") for i, m in enumerate(members)],
        )


def _contract_json(path: str | Path) -> tuple[Any, str]:
    """A contract file's JSON and its name for errors (``OSError`` when unreadable, ``ContractError`` when it
    is not JSON)."""
    p = Path(path)
    try:
        return json.loads(p.read_text()), str(p)
    except ValueError as exc:
        raise ContractError(f"{p}: not JSON ({exc})") from None


@dataclass
class InstanceConfig:
    """``{config_dir}/instances/NAME.json``. Required: ``name``, ``model_path``, ``port``, ``command``; the
    template writes every field (``units/instance.json.j2``; tests/unit/test_contracts.py checks it)."""

    name: str
    served_model_name: str
    model_path: str
    port: int
    command: list[str]
    listen_address: str = "127.0.0.1"
    environment: dict[str, str] = field(default_factory=dict)
    shutdown_timeout: float = 30
    state_dir: str = "/run/vllm-fleet"
    service: ServiceConfig = field(default_factory=ServiceConfig)
    # the hosts (ranks) the engine group spans: 1, or len(placement) of a multi-node instance (docs/multi-node.md)
    nnodes: int = 1
    # informational (the launcher does not act on them)
    profile: str = ""
    vllm_version: str = ""
    host: str = ""
    gpus: list[int] = field(default_factory=list)
    source: dict[str, Any] = field(default_factory=dict)
    cache_dir: str = ""
    # sleep mode (None: the engine never sleeps)
    sleep: SleepConfig | None = None

    @property
    def probe_host(self) -> str:
        return "127.0.0.1" if self.listen_address in ("0.0.0.0", "", "::") else self.listen_address

    @classmethod
    def from_dict(cls, d: Any, source: str = "") -> InstanceConfig:
        """Check and convert the rendered JSON; ``ContractError`` names the first field that is wrong."""
        d = _mapping(d, source, "(root)")
        for key in ("name", "model_path", "port", "command"):
            if key not in d:
                raise ContractError(f"{_where(source, key)}: missing")
        command = d["command"]
        if not isinstance(command, list) or not all(isinstance(a, str) for a in command):
            raise ContractError(f"{_where(source, 'command')}: expected a list of strings, got {command!r}")
        env = _mapping(d.get("environment") or {}, source, "environment")
        for k, v in env.items():
            _string(v, source, f"environment.{k}")
        gpus = d.get("gpus") or []
        if not isinstance(gpus, list):
            raise ContractError(f"{_where(source, 'gpus')}: expected a list of integers, got {gpus!r}")
        name = _string(d["name"], source, "name")
        return cls(
            name=name,
            served_model_name=_string(d.get("served_model_name") or name, source, "served_model_name"),
            model_path=_string(d["model_path"], source, "model_path"),
            port=_integer(d["port"], source, "port"),
            command=list(command),
            listen_address=_string(d.get("listen_address") or "127.0.0.1", source, "listen_address"),
            environment=dict(env),
            shutdown_timeout=_number(d.get("shutdown_timeout", 30), source, "shutdown_timeout"),
            state_dir=_string(d.get("state_dir") or "/run/vllm-fleet", source, "state_dir"),
            service=ServiceConfig.from_dict(_mapping(d.get("service") or {}, source, "service"), source),
            nnodes=_integer(d.get("nnodes", 1), source, "nnodes"),
            profile=_string(d.get("profile", ""), source, "profile"),
            vllm_version=_string(d.get("vllm_version", ""), source, "vllm_version"),
            host=_string(d.get("host", ""), source, "host"),
            gpus=[_integer(g, source, f"gpus[{i}]") for i, g in enumerate(gpus)],
            source=_mapping(d.get("source") or {}, source, "source"),
            cache_dir=_string(d.get("cache_dir", ""), source, "cache_dir"),
            sleep=None
            if d.get("sleep") is None
            else SleepConfig.from_dict(_mapping(d["sleep"], source, "sleep"), source),
        )

    @classmethod
    def load(cls, path: str | Path) -> InstanceConfig:
        """Read and check ``path`` (``OSError`` when unreadable, ``ContractError`` when it is not one)."""
        return cls.from_dict(*_contract_json(path))


# the keys the template writes besides the ones above ("_managed": the ansible_managed marker; "spec": the
# instance's `models` entry as deployed, which the controller reads back while a rollout holds a change:
# vllm_fleet.fleet.spec.running_version — the launcher does not read it)
INSTANCE_CONFIG_EXTRA_KEYS = frozenset({"_managed", "spec"})


class StateFile(TypedDict, total=False):
    """``{state_dir}/NAME.json``: the launcher's view of its engine, rewritten (tmp file + rename) on every
    change. Readers must accept a missing key (a launcher of another version): ``total=False``."""

    instance: str
    served_model_name: str
    port: int
    state: str  # loading | ready | draining | stopping | failed
    launcher_pid: int
    engine_pid: int | None
    started_at: float
    ready_at: float | None
    load_duration_seconds: float | None
    phase: str
    last_probe_at: float | None
    last_probe_ok: bool | None
    last_probe_latency_seconds: float | None
    last_probe_kind: str | None
    probes_total: int
    probe_failures_total: int
    probes_starved_total: int
    failure_reason: str | None
    failure_process: str | None
    failure_signal: str | None
    updated_at: float
    stack: str  # the engine stack (venv folder name) the engine runs from: ``stack_of(command)``
    # sleep mode (the instance config's ``sleep``; absent or null when the model does not sleep): the engine's
    # sleep state (SLEEP_STATES), its level and swap group, when a request last ended (the guard's reading;
    # the swap group's least recently used), since when it sleeps, and counters since the launcher started
    sleep_state: str | None
    sleep_level: int | None
    swap_group: str | None
    last_active_at: float | None
    asleep_since: float | None
    sleeps_total: int
    wakes_total: int
    failed_wakes_total: int
    wake_seconds_total: float  # the wakes' durations summed (from the wake signal to awake)
    last_wake_seconds: float | None
    asleep_seconds_total: float  # completed periods asleep (the exporter adds the current one)
    last_wake_failure: str | None


# key → (accepted JSON types, nullable)
_STATE_TYPES: dict[str, tuple[tuple[type, ...], bool]] = {
    "instance": ((str,), False),
    "served_model_name": ((str,), False),
    "port": ((int,), False),
    "state": ((str,), False),
    "launcher_pid": ((int,), False),
    "engine_pid": ((int,), True),
    "started_at": ((int, float), False),
    "ready_at": ((int, float), True),
    "load_duration_seconds": ((int, float), True),
    "phase": ((str,), False),
    "last_probe_at": ((int, float), True),
    "last_probe_ok": ((bool,), True),
    "last_probe_latency_seconds": ((int, float), True),
    "last_probe_kind": ((str,), True),
    "probes_total": ((int,), False),
    "probe_failures_total": ((int,), False),
    "probes_starved_total": ((int,), False),
    "failure_reason": ((str,), True),
    "failure_process": ((str,), True),
    "failure_signal": ((str,), True),
    "updated_at": ((int, float), False),
    "stack": ((str,), False),
    "sleep_state": ((str,), True),
    "sleep_level": ((int,), True),
    "swap_group": ((str,), True),
    "last_active_at": ((int, float), True),
    "asleep_since": ((int, float), True),
    "sleeps_total": ((int,), False),
    "wakes_total": ((int,), False),
    "failed_wakes_total": ((int,), False),
    "wake_seconds_total": ((int, float), False),
    "last_wake_seconds": ((int, float), True),
    "asleep_seconds_total": ((int, float), False),
    "last_wake_failure": ((str,), True),
}
STATE_KEYS = tuple(_STATE_TYPES)


def stack_of(command: list[str]) -> str:
    """The engine stack an engine command runs from: the name of the venv folder holding its program
    (``/opt/vllm-fleet/stacks/cpu-0.32.0-1a2b3c4d5e6f/bin/python`` → ``cpu-0.32.0-1a2b3c4d5e6f``); ""
    when the program is not in a venv's ``bin``."""
    if not command:
        return ""
    parts = command[0].rstrip("/").split("/")
    return parts[-3] if len(parts) >= 3 and parts[-2] == "bin" and parts[-3] else ""


def _check_types(
    data: Any, types_of: dict[str, tuple[tuple[type, ...], bool]], source: str
) -> dict[str, Any]:
    """Every key of ``types_of`` that is present in ``data`` has its type (unknown keys are kept)."""
    d = _mapping(data, source, "(root)")
    for key, (types, nullable) in types_of.items():
        if key not in d:
            continue
        v = d[key]
        if v is None and nullable:
            continue
        # JSON true is not a number here (bool is an int in Python)
        ok = isinstance(v, types) and not (isinstance(v, bool) and bool not in types)
        if not ok:
            want = "/".join(t.__name__ for t in types) + (" or null" if nullable else "")
            raise ContractError(f"{_where(source, key)}: expected {want}, got {v!r}")
    return d


def parse_state(data: Any, source: str = "") -> StateFile:
    """Check a state file's content: every known key that is present has its type (unknown keys, from a
    newer launcher, are kept). ``ContractError`` names the first wrong one."""
    return _check_types(data, _STATE_TYPES, source)  # type: ignore[return-value]


def read_state(path: str | Path) -> StateFile:
    """Read and check a state file (``OSError`` when unreadable, ``ContractError`` when it is not one)."""
    return parse_state(*_contract_json(path))


# ------------------------------------------------------------------------- an instance's LoRA adapters

ADAPTERS_FILE_SCHEMA = 1
# {config_dir}/instances/NAME.adapters.json, beside the instance's config NAME.json: a reader of the instance
# configs (``*.json`` there) must skip this suffix
ADAPTERS_FILE_SUFFIX = ".adapters.json"
# the engine's environment names the file (the LoRA resolver reads it); runtime loading is on with it
ADAPTERS_FILE_ENV = "VLLM_FLEET_ADAPTERS_FILE"
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def adapters_file_path(config_dir: str, instance: str) -> str:
    """An instance's adapters file (``AdaptersFile``)."""
    return f"{config_dir}/instances/{instance}{ADAPTERS_FILE_SUFFIX}"


def is_adapters_file(path: str | Path) -> bool:
    """Whether ``path`` names an adapters file (not an instance config)."""
    return str(path).endswith(ADAPTERS_FILE_SUFFIX)


@dataclass(frozen=True)
class AdapterEntry:
    """One adapter of an ``AdaptersFile``: ``name`` (what requests send as ``model``), ``path`` (its folder on
    the host), ``rank`` and ``carry`` (the instance loads it at start; every other one it may load on demand)."""

    name: str
    path: str
    rank: int
    carry: bool


@dataclass(frozen=True)
class AdaptersFile:
    """``{config_dir}/instances/NAME.adapters.json``: every adapter of the instance's served model (``model``)."""

    schema: int
    instance: str
    model: str
    adapters: list[AdapterEntry]

    @property
    def carried(self) -> list[AdapterEntry]:
        return [a for a in self.adapters if a.carry]

    def adapter(self, name: str) -> AdapterEntry:
        for a in self.adapters:
            if a.name == name:
                return a
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def dumps(self) -> str:
        """The file's text (what the render writes, byte for byte)."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, data: Any, source: str = "") -> AdaptersFile:
        """Check every field (``ContractError`` names the file and the field: ``adapters[0].rank``)."""
        d = _schema_checked(data, source, ADAPTERS_FILE_SCHEMA, "an adapters file")
        f: AdaptersFile = _dataclass_from(cls, d, source, "")
        seen: set[str] = set()
        for i, a in enumerate(f.adapters):
            if a.name in seen:
                raise ContractError(f"{_where(source, f'adapters[{i}].name')}: {a.name!r} is listed twice")
            seen.add(a.name)
            if not a.path.startswith("/"):
                raise ContractError(f"{_where(source, f'adapters[{i}].path')}: expected an absolute path")
        return f

    @classmethod
    def load(cls, path: str | Path) -> AdaptersFile:
        """Read and check ``path`` (``OSError`` when unreadable, ``ContractError`` when it is not one)."""
        return cls.from_dict(*_contract_json(path))


# ------------------------------------------------------------------------- a multi-node instance's workers

WORKER_STATE_SUBDIR = "workers"  # {state_dir}/workers/NAME.json: not matched by the instances' *.json
# waiting: for a connection to rank 0 (the unit just started); joined: connected to rank 0's TCPStore
# (READY=1); rank0_gone: the connection went away for grace_seconds, the worker ends its engine and exits 1
# (Restart=always starts a fresh one); exited: the engine exited, or the unit was stopped
WORKER_STATES = ("waiting", "joined", "rank0_gone", "exited")


class WorkerStateFile(TypedDict, total=False):
    """``{state_dir}/workers/NAME.json``: a headless rank's view of its group, rewritten (tmp file + rename)
    on every change of state. Readers must accept a missing key: ``total=False``."""

    instance: str
    served_model_name: str
    rank: int
    nnodes: int
    state: str  # WORKER_STATES
    since: float  # when ``state`` began (epoch seconds)
    master: str  # rank 0's master_addr:master_port
    worker_pid: int
    engine_pid: int | None
    exit_code: int | None  # the worker's exit status once ``rank0_gone`` / ``exited``
    reason: str | None  # why it left ``joined`` (rank 0's connection closed, the port does not answer ...)
    updated_at: float


_WORKER_STATE_TYPES: dict[str, tuple[tuple[type, ...], bool]] = {
    "instance": ((str,), False),
    "served_model_name": ((str,), False),
    "rank": ((int,), False),
    "nnodes": ((int,), False),
    "state": ((str,), False),
    "since": ((int, float), False),
    "master": ((str,), False),
    "worker_pid": ((int,), False),
    "engine_pid": ((int,), True),
    "exit_code": ((int,), True),
    "reason": ((str,), True),
    "updated_at": ((int, float), False),
}
WORKER_STATE_KEYS = tuple(_WORKER_STATE_TYPES)


def worker_state_path(state_dir: str | Path, name: str) -> Path:
    return Path(state_dir) / WORKER_STATE_SUBDIR / f"{name}.json"


def parse_worker_state(data: Any, source: str = "") -> WorkerStateFile:
    """Check a worker state file's content like ``parse_state`` (unknown keys are kept)."""
    return _check_types(data, _WORKER_STATE_TYPES, source)  # type: ignore[return-value]


def read_worker_state(path: str | Path) -> WorkerStateFile:
    """Read and check a worker state file (``OSError`` / ``ContractError`` as ``read_state``)."""
    return parse_worker_state(*_contract_json(path))


# ------------------------------------------------------------------------- what an instance's engine has loaded

ADAPTER_STATE_SUBDIR = "adapters"  # {state_dir}/adapters/NAME.json: not matched by the instances' *.json
# the launcher rewrites the adapter state file from the engine at most this often while the instance is ready;
# the exporter distrusts one older than ADAPTER_STATE_STALE_SECONDS while its instance is not ready
ADAPTER_STATE_REFRESH_SECONDS = 30.0
ADAPTER_STATE_STALE_SECONDS = 120.0


def adapters_file_of(environment: dict[str, str]) -> str:
    """The adapters file an instance config's ``environment`` names; "" when LoRA is off."""
    return environment.get(ADAPTERS_FILE_ENV, "")


class AdapterStateFile(TypedDict, total=False):
    """``{state_dir}/adapters/NAME.json``: the adapters the instance's engine has loaded (its ``/v1/models``
    entries whose parent is the base model), written (tmp file + rename) by the launcher when the engine is
    ready and at most every 30 s while it serves, and by `vllm-fleet adapters sync`; read by the host
    exporter. ``total=False``: readers accept a missing key."""

    instance: str
    model: str
    loaded: list[str]
    updated_at: float


_ADAPTER_STATE_TYPES: dict[str, tuple[tuple[type, ...], bool]] = {
    "instance": ((str,), False),
    "model": ((str,), False),
    "loaded": ((list,), False),
    "updated_at": ((int, float), False),
}


def adapter_state_path(state_dir: str | Path, name: str) -> Path:
    return Path(state_dir) / ADAPTER_STATE_SUBDIR / f"{name}.json"


def parse_adapter_state(data: Any, source: str = "") -> AdapterStateFile:
    """Check an adapter state file's content like ``parse_state`` (``loaded``: a list of strings)."""
    d = _check_types(data, _ADAPTER_STATE_TYPES, source)
    if not all(isinstance(n, str) for n in d.get("loaded", [])):
        raise ContractError(f"{_where(source, 'loaded')}: expected a list of strings, got {d['loaded']!r}")
    return d  # type: ignore[return-value]


def read_adapter_state(path: str | Path) -> AdapterStateFile:
    """Read and check an adapter state file (``OSError`` / ``ContractError`` as ``read_state``)."""
    return parse_adapter_state(*_contract_json(path))


# ------------------------------------------------------------------------- keepalived's VRRP state (gateway HA)

# Where keepalived's ``notify`` (vllm_fleet.host.vrrp_notify, run as root on every gateway host of two or more)
# writes the state of the gateway's VRRP instance, and the host exporter reads it (``--vrrp-state``). A folder of
# its own under /run, not ``paths.state_dir``: that one belongs to the engines' units (RuntimeDirectory, their
# user) and the exporter takes every ``*.json`` there for an instance. The notify creates the folder (0755) and
# replaces the file (0644) atomically; /run is emptied at boot, so "no file" means keepalived has not reported
# since the host started.
VRRP_STATE_FILE = "/run/vllm-fleet-vrrp/state.json"
# the states keepalived's notify passes for an instance (keepalived.conf(5); DELETED only with notify_deleted,
# which the fleet does not set)
VRRP_STATES = ("MASTER", "BACKUP", "FAULT", "STOP")


class VrrpStateFile(TypedDict, total=False):
    """``VRRP_STATE_FILE``: the last state change keepalived reported, rewritten (tmp file + rename) on each.
    Readers must accept a missing key: ``total=False``."""

    state: str  # VRRP_STATES as keepalived sent it (upper case)
    type: str  # INSTANCE | GROUP
    name: str  # the vrrp_instance's name (fleet/ha.py KeepalivedPlan.instance)
    priority: int  # the priority keepalived reported with the change
    since: float  # when the notify ran (epoch seconds): the state holds since then
    keepalived_pid: int  # the keepalived process that ran the notify (its VRRP process: the notify's parent)


_VRRP_STATE_TYPES: dict[str, tuple[tuple[type, ...], bool]] = {
    "state": ((str,), False),
    "type": ((str,), False),
    "name": ((str,), False),
    "priority": ((int,), False),
    "since": ((int, float), False),
    "keepalived_pid": ((int,), False),
}
VRRP_STATE_KEYS = tuple(_VRRP_STATE_TYPES)


def parse_vrrp_state(data: Any, source: str = "") -> VrrpStateFile:
    """Check a VRRP state file's content like ``parse_state`` (unknown keys are kept)."""
    return _check_types(data, _VRRP_STATE_TYPES, source)  # type: ignore[return-value]


def read_vrrp_state(path: str | Path) -> VrrpStateFile:
    """Read and check a VRRP state file (``OSError`` / ``ContractError`` as ``read_state``)."""
    return parse_vrrp_state(*_contract_json(path))


# ------------------------------------------------------------------------- the gateways' peers (gateway HA)

# On each gateway host of two or more: the other gateways, which `vllm-fleet drain` / `undrain` (run on this
# host) tell the same operation through their nginx's peer location (``GATEWAY_PEER_PATH`` on
# ``gateway.peer_port`` of their fleet address). Rendered from the plan (fleet/ha.py ``gateway_peer_plan``,
# nginx/peers.json.j2), read by ``vllm_fleet.host.drain``. Next to routes.json, in a folder only root writes,
# and not in the drained-set folder: on a gateway of two or more nginx's workers (www-data) write there, and
# whoever can replace this file chooses where the drains go.
GATEWAY_PEERS_FILE = "/etc/nginx/vllm-fleet/peers.json"
# the peer location: POST {"drain": NAME} or {"undrain": NAME}, answered {"drained": [...]} (nginx/router.js.j2)
GATEWAY_PEER_PATH = "/vf/drained"
GATEWAY_PEERS_SCHEMA = 1  # raised when a field changes meaning

# The engines' administration paths: what changes an engine's state for every client (LoRA adapters loaded and
# unloaded, with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 also in SageMaker's /adapters form; sleep mode, RPCs, its
# prefix cache and vLLM's other development paths; the sleep guard's own). Only the host's own tools call them,
# on the engine's port (``vllm-fleet adapters sync``, the launcher); the gateway never forwards them in any form
# (PATH, PATH/..., /models/NAME/PATH, with X-Model-Name or a body's model): a JSON 404 (nginx/vllm-fleet.conf.j2,
# nginx/router.js.j2).
ENGINE_ADMIN_PATHS = (
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
    "/adapters",
    *DEV_MODE_PATHS,
    "/vllm-fleet",
)
# a path that is one of them or under one (case-insensitive: nothing that looks like one passes), the same
# text for nginx's PCRE and the router's JavaScript
ENGINE_ADMIN_PATH_RE = "^(?:" + "|".join(re.escape(p) for p in ENGINE_ADMIN_PATHS) + ")(?:/|$)"


@dataclass(frozen=True)
class GatewayPeer:
    """Another gateway: its host's name and the URL of its peer location (``http://ADDR:PORT/vf/drained``)."""

    name: str
    url: str


@dataclass(frozen=True)
class GatewayPeers:
    """``GATEWAY_PEERS_FILE``: this gateway (``host``), the address drain connects from (``source``: the host's
    fleet address, the one the other gateways' nginx allows) and the other gateways, in the spec's order."""

    schema: int
    fleet: str
    host: str
    source: str
    peers: list[GatewayPeer]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any, source: str = "") -> GatewayPeers:
        """Check every field (``ContractError`` names the file and the field: ``peers[1].url``)."""
        d = _schema_checked(data, source, GATEWAY_PEERS_SCHEMA, "a gateway peers file")
        peers: GatewayPeers = _dataclass_from(cls, d, source, "")
        for i, p in enumerate(peers.peers):
            if not p.url.startswith("http://"):
                raise ContractError(
                    f"{_where(source, f'peers[{i}].url')}: expected http://..., got {p.url!r}"
                )
        return peers

    @classmethod
    def load(cls, path: str | Path) -> GatewayPeers:
        """Read and check ``path`` (``OSError`` when unreadable, ``ContractError`` when it is not one)."""
        return cls.from_dict(*_contract_json(path))


# ------------------------------------------------------------------------- the gateway's sleep watch (issue 33)

# On a gateway host that routes to a model that sleeps (models[].sleep): `vllm-fleet sleepwatch --config
# SLEEPWATCH_CONFIG_FILE` (vllm_fleet.host.sleepwatch, vllm-fleet-sleepwatch.service) asks each such instance's
# sleep guard for its state (GET SLEEP_STATE_PATH on the address nginx reaches it at) every interval and writes
# the instances that are not awake to SLEEP_ASLEEP_FILE (``AsleepFile``), replaced atomically, only when the set
# changes (and once at its start); it removes the file when it stops. The njs router reads it on a request for a
# model marked ``sleeps`` in routes.json (whose ``asleep_file`` names it) and tries an awake replica first, a
# sleeping one last (docs/sleep.md "Gateway"). A folder of its own under /run (the unit's RuntimeDirectory,
# kept when it stops: the router lists the folder, and a missing folder would cost it a throw per request): /run
# is emptied at boot, so no stale set outlives the host's start. The config file is rendered next to routes.json,
# in a folder only root writes: it says which addresses the watch asks and where it writes.
SLEEP_ASLEEP_FILE = "/run/vllm-fleet-sleepwatch/asleep.json"
SLEEPWATCH_CONFIG_FILE = "/etc/nginx/vllm-fleet/sleepwatch.json"
SLEEPWATCH_SCHEMA = 1  # raised when a field changes meaning
SLEEPWATCH_INTERVAL_SECONDS = 1.0  # how often each guard is asked
# how long one answer may take: the guard answers from its own state (no engine work), so a slower answer is an
# engine whose event loop is busy, i.e. awake; no answer in time reads "unknown", taken as awake
SLEEPWATCH_TIMEOUT_SECONDS = 0.5


class AsleepFile(TypedDict):
    """``SLEEP_ASLEEP_FILE``: the instances whose guard answered a state other than ``awake`` (sorted names),
    those of them ``waking`` (a request is held there and the wake is under way: the router tries them before
    the ones still asleep), and when the set last changed (epoch seconds). An instance whose guard did not
    answer is in neither list: never hidden on a read failure."""

    asleep: list[str]
    waking: list[str]
    updated: float


@dataclass(frozen=True)
class SleepwatchInstance:
    """An instance the watch asks: its name and where nginx reaches it (its guard answers on the engine's
    port)."""

    instance: str
    address: str
    port: int


@dataclass(frozen=True)
class SleepwatchConfig:
    """``SLEEPWATCH_CONFIG_FILE``: the sleep-capable instances this gateway routes to, the file the watch writes
    (``output``: ``SLEEP_ASLEEP_FILE``), how often it asks and how long an answer may take."""

    schema: int
    fleet: str
    output: str
    interval_seconds: float
    timeout_seconds: float
    instances: list[SleepwatchInstance]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any, source: str = "") -> SleepwatchConfig:
        """Check every field (``ContractError`` names the file and the field: ``instances[1].port``)."""
        d = _schema_checked(data, source, SLEEPWATCH_SCHEMA, "a sleep watch config")
        cfg: SleepwatchConfig = _dataclass_from(cls, d, source, "")
        if not cfg.output.startswith("/"):
            raise ContractError(f"{_where(source, 'output')}: expected an absolute path, got {cfg.output!r}")
        for key in ("interval_seconds", "timeout_seconds"):
            if getattr(cfg, key) <= 0:
                raise ContractError(f"{_where(source, key)}: must be > 0, got {getattr(cfg, key)!r}")
        for i, inst in enumerate(cfg.instances):
            if not 0 < inst.port < 65536:
                raise ContractError(f"{_where(source, f'instances[{i}].port')}: not a port: {inst.port!r}")
        return cfg

    @classmethod
    def load(cls, path: str | Path) -> SleepwatchConfig:
        """Read and check ``path`` (``OSError`` when unreadable, ``ContractError`` when it is not one)."""
        return cls.from_dict(*_contract_json(path))


# GPU facts from the host to the planner: the CSV of ``nvidia-smi --query-gpu=NVSMI_FIELDS
# --format=csv,noheader,nounits`` as the doctor reads it on the host and the play hands it to the re-plan on the
# controller (``vllm-fleet plan --detected``); one parser for both sides.
NVSMI_FIELDS = "index,name,uuid,driver_version,compute_cap,memory.total"


def parse_nvidia_smi(csv_text: str) -> list[dict[str, str]]:
    """One dict per GPU line, keyed by NVSMI_FIELDS; lines of another width are skipped."""
    keys = NVSMI_FIELDS.split(",")
    gpus = []
    for line in csv_text.strip().splitlines():
        vals = [v.strip() for v in line.split(",")]
        if len(vals) == len(keys):
            gpus.append(dict(zip(keys, vals, strict=True)))
    return gpus


def nvidia_smi_text(gpus: list[dict[str, str]]) -> str:
    """``gpus`` back as the query's CSV (what ``parse_nvidia_smi`` reads)."""
    return "".join(", ".join(g[k] for k in NVSMI_FIELDS.split(",")) + "\n" for g in gpus)


# ------------------------------------------------------------------------- a host's contract: host.json

# the spec's paths.config_dir by default, and where the host commands (launch, worker, adapters) look without
# --config-dir: the instance configs under instances/, the host's contract
DEFAULT_CONFIG_DIR = "/etc/vllm-fleet"
HOST_CONTRACT_FILE = "host.json"  # in the spec's paths.config_dir
HOST_CONTRACT_SCHEMA = 1  # raised when a field changes meaning; a host refuses a schema it does not know


@dataclass(frozen=True)
class HostModelSource:
    """Where a model comes from: ``kind`` hf | modelscope | path, ``repo`` (the hub repository, or the path),
    ``revision`` (the pinned tag or commit; ``local`` for a path), ``checksums`` (relative path → expected
    sha256, verified after the fetch)."""

    kind: str
    repo: str
    revision: str
    checksums: dict[str, str]


@dataclass(frozen=True)
class HostModel:
    """A model folder the host needs (for an instance it runs, or a headless rank's share of one): what
    ``vllm-fleet fetch`` downloads or verifies; ``name`` is the instance's."""

    name: str
    model_path: str
    source: HostModelSource

    @property
    def spec_field(self) -> str:
        """Its entry in the spec, as errors name it."""
        return f"models[{self.name}]"


@dataclass(frozen=True)
class HostAdapter(HostModel):
    """A LoRA adapter folder the host needs (every adapter of the served model of each LoRA instance it runs or
    has a rank of): fetched and verified like a model; ``name`` is the adapter's, ``model_path`` its folder,
    ``base`` its served model, ``rank`` its LoRA rank (the fetch checks adapter_config.json's ``r``)."""

    base: str
    rank: int

    @property
    def spec_field(self) -> str:
        return f"adapters[{self.name}]"


@dataclass(frozen=True)
class HostInstance:
    """An instance whose API server runs on the host (``vllm@NAME``; its model is the ``models`` entry of the
    same name): what the manifest records, and the stack, dtype and env the doctor's load runs with."""

    name: str
    unit: str
    served_model_name: str
    port: int
    gpus: list[int]
    tensor_parallel_size: int
    quantization: str | None
    max_model_len: int | None
    gpu_memory_utilization: float
    role: str
    args: list[str]  # the engine's arguments after `serve`
    stack: str  # the name of the stack it runs ("default": the fleet's)
    dtype: str
    env: dict[str, str]


@dataclass(frozen=True)
class HostStack:
    """An engine stack the host runs (its instances' and its headless ranks'; the fleet's ``default`` when
    it runs none)."""

    name: str
    profile: str
    vllm_version: str
    min_driver: int


@dataclass(frozen=True)
class HostGpus:
    """The spec's ``hosts[].gpus`` of the host, and ``field``: its place in the spec (what the doctor's
    verdicts name)."""

    count: int
    model: str
    memory_gib: float
    compute_capability: str
    detect: bool
    field: str


@dataclass(frozen=True)
class HostPaths:
    config_dir: str
    models_dir: str
    cache_dir: str
    state_dir: str


@dataclass(frozen=True)
class HostContract:
    """``{config_dir}/host.json``: what the commands run on one host need of the fleet spec, computed on the
    controller. ``spec_hash`` is the spec's (the manifest records it; the exporter and ``status`` compare it);
    ``stacks`` in the spec's order (the first is the one the play runs vllm-fleet from); ``models`` the folders
    to fetch (instances' and headless ranks'), ``instances`` the API servers that run here, ``adapters`` the LoRA
    adapter folders to fetch (absent from the file when there are none: a contract without adapters reads as
    it did before them)."""

    schema: int
    fleet: str
    host: str
    spec_hash: str
    paths: HostPaths
    gpus: HostGpus
    stacks: list[HostStack]
    models: list[HostModel]
    instances: list[HostInstance]
    adapters: list[HostAdapter] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if not d["adapters"]:
            del d["adapters"]
        return d

    def dumps(self) -> str:
        """The file's text (what ``vllm-fleet render`` and the roles write, byte for byte)."""
        return dumps_host_contract(self.to_dict())

    def model(self, name: str) -> HostModel:
        for m in self.models:
            if m.name == name:
                return m
        raise KeyError(name)

    def stack(self, name: str) -> HostStack:
        for s in self.stacks:
            if s.name == name:
                return s
        raise KeyError(name)

    @classmethod
    def from_dict(cls, data: Any, source: str = "") -> HostContract:
        """Check every field (``ContractError`` names the file and the field: ``models[0].source.revision``)."""
        d = _schema_checked(data, source, HOST_CONTRACT_SCHEMA, "a host contract")
        contract: HostContract = _dataclass_from(cls, d, source, "")
        if not contract.stacks:
            raise ContractError(f"{_where(source, 'stacks')}: at least one stack is required")
        models = {m.name for m in contract.models}
        for i, inst in enumerate(contract.instances):
            if inst.name not in models:
                raise ContractError(
                    f"{_where(source, f'instances[{i}].name')}: {inst.name!r} has no entry in models"
                )
            if inst.stack not in {s.name for s in contract.stacks}:
                raise ContractError(
                    f"{_where(source, f'instances[{i}].stack')}: {inst.stack!r} is not one of stacks"
                )
        names: set[str] = set()
        for i, a in enumerate(contract.adapters):
            if a.name in names:
                raise ContractError(f"{_where(source, f'adapters[{i}].name')}: {a.name!r} is listed twice")
            names.add(a.name)
        return contract

    @classmethod
    def load(cls, path: str | Path) -> HostContract:
        """Read and check ``path`` (``OSError`` when unreadable, ``ContractError`` when it is not one)."""
        return cls.from_dict(*_contract_json(path))


def _schema_checked(data: Any, source: str, expected: int, what: str) -> dict[str, Any]:
    """``data`` as a mapping whose ``schema`` is ``expected`` (``ContractError`` otherwise)."""
    d = _mapping(data, source, "(root)")
    schema = d.get("schema")
    if schema != expected:
        raise ContractError(
            f"{_where(source, 'schema')}: {schema!r} is not {what} schema this vllm-fleet reads ({expected}); "
            "render it with the same vllm-fleet as the host runs"
        )
    return d


def dumps_host_contract(data: dict[str, Any]) -> str:
    """A host contract's text from its ``to_dict()``: sorted keys, two spaces, a final newline."""
    return json.dumps(data, indent=2, sort_keys=True) + "\n"


# ------------------------------------------------------------------------- the gateway's admission service

ADMISSION_CONFIG_SCHEMA = 1  # raised when a field changes meaning
# the syslog tag of nginx's end-of-request lines to the admission service (the rendered access_log, the parser)
ADMISSION_SYSLOG_TAG = "vfadmit"
# the least listen backlog of the admission socket (``AdmissionConfig.listen_backlog``; the plan raises it to
# gateway.limits.max_queued + the models' capacity): nginx opens a connection per auth_request subrequest in
# flight, and a connect() that finds the backlog full fails at once (EAGAIN: nginx admits the request unlimited,
# on_failure open). The kernel caps it at net.core.somaxconn (4096 on Debian 12), which the gateway role raises
# to it, with net.unix.max_dgram_qlen (10 by default: the release datagrams queued unread before nginx's
# non-blocking send fails and the release is lost)
ADMISSION_LISTEN_BACKLOG = 4096


@dataclass(frozen=True)
class AdmissionBudget:
    """A budget of the admission service (``vllm_fleet.host.admission.Budget``): 0 = unlimited; ``weight``
    (> 0) is the share of a saturated route relative to other keys."""

    max_in_flight: int
    requests_per_minute: int
    tokens_per_minute: int
    weight: float


@dataclass(frozen=True)
class AdmissionConfig:
    """The gateway host's admission service config (``vllm-fleet admission --config PATH``;
    docs/design/per-key-limits.md). ``keys``: key id (``CLIENT/HEX8``) → its own budget; ``per_key``: client
    → the budget of each key of that client (a key without an entry in ``keys``), else ``default_key``;
    ``clients``: client → the budget of its keys together, else ``default_client``; ``capacity``: served
    model name (the route) → requests in flight its engines hold (absent = unlimited). ``socket``: the unix
    stream socket of the HTTP protocol nginx's ``auth_request`` asks; ``log_socket``: the unix datagram
    socket nginx's ``access_log syslog:`` writes the releases to; ``metrics_address``: ``HOST:PORT`` of
    ``/metrics``; ``socket_group``: the group both sockets are given to (mode 0660; "" = left as is);
    ``listen_backlog``: the stream socket's listen backlog (absent in a file rendered before it existed:
    ``ADMISSION_LISTEN_BACKLOG``)."""

    schema: int
    fleet: str
    socket: str
    log_socket: str
    metrics_address: str
    queue_wait_seconds: float
    max_queued_per_key: int
    max_queued: int
    lease_seconds: float
    default_key: AdmissionBudget
    keys: dict[str, AdmissionBudget]
    default_client: AdmissionBudget
    clients: dict[str, AdmissionBudget]
    per_key: dict[str, AdmissionBudget]
    capacity: dict[str, int]
    socket_group: str
    listen_backlog: int = ADMISSION_LISTEN_BACKLOG

    @classmethod
    def from_dict(cls, data: Any, source: str = "") -> AdmissionConfig:
        """Check every field (``ContractError`` names the file and the field: ``keys.chat/1a2b3c4d.weight``)."""
        d = _schema_checked(data, source, ADMISSION_CONFIG_SCHEMA, "an admission config")
        cfg: AdmissionConfig = _dataclass_from(cls, d, source, "")

        def fail(key: str, why: str) -> ContractError:
            return ContractError(f"{_where(source, key)}: {why}")

        for key in ("socket", "log_socket"):
            if not getattr(cfg, key).startswith("/"):
                raise fail(key, f"expected an absolute path, got {getattr(cfg, key)!r}")
        host, _, port = cfg.metrics_address.rpartition(":")
        if not host or not port.isdigit() or not 0 <= int(port) < 65536:  # 0: the system picks one (tests)
            raise fail("metrics_address", f"expected HOST:PORT, got {cfg.metrics_address!r}")
        for key in ("queue_wait_seconds", "max_queued_per_key", "max_queued"):
            if getattr(cfg, key) < 0:
                raise fail(key, f"must be >= 0, got {getattr(cfg, key)!r}")
        if cfg.lease_seconds <= 0:
            raise fail("lease_seconds", f"must be > 0, got {cfg.lease_seconds!r}")
        if cfg.listen_backlog <= 0:
            raise fail("listen_backlog", f"must be > 0, got {cfg.listen_backlog!r}")
        budgets = {"default_key": cfg.default_key, "default_client": cfg.default_client}
        for group in ("keys", "clients", "per_key"):
            budgets.update({f"{group}.{k}": b for k, b in getattr(cfg, group).items()})
        for where, b in budgets.items():
            for name in ("max_in_flight", "requests_per_minute", "tokens_per_minute"):
                if getattr(b, name) < 0:
                    raise fail(f"{where}.{name}", f"must be >= 0 (0 = unlimited), got {getattr(b, name)!r}")
            if b.weight <= 0:
                raise fail(f"{where}.weight", f"must be > 0, got {b.weight!r}")
        for model, n in cfg.capacity.items():
            if n < 0:
                raise fail(f"capacity.{model}", f"must be >= 0, got {n!r}")
        return cfg

    @classmethod
    def load(cls, path: str | Path) -> AdmissionConfig:
        """Read and check ``path`` (``OSError`` when unreadable, ``ContractError`` when it is not one)."""
        return cls.from_dict(*_contract_json(path))


_T = TypeVar("_T")


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    """A dataclass's field types, resolved once (the annotations are strings here)."""
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _dataclass_from(cls: type[_T], data: Any, source: str, key: str) -> _T:
    """``cls`` (a dataclass of str / int / float / bool / list / dict / optional / dataclass fields) from
    ``data``, every field checked: a missing, unknown or mistyped one is named by its path. A field with a
    default may be absent (a file written before the field existed)."""
    d = _mapping(data, source, key or "(root)")
    hints = _hints(cls)
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    names = [f.name for f in fields]
    optional = {
        f.name
        for f in fields
        if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
    }
    values: dict[str, Any] = {}
    for name in names:
        sub = f"{key}.{name}" if key else name
        if name not in d:
            if name in optional:
                continue
            raise ContractError(f"{_where(source, sub)}: missing")
        values[name] = _typed(hints[name], d[name], source, sub)
    if unknown := sorted(set(d) - set(names)):
        sub = f"{key}.{unknown[0]}" if key else unknown[0]
        raise ContractError(f"{_where(source, sub)}: unknown field")
    return cls(**values)


def _typed(tp: Any, v: Any, source: str, key: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return _dataclass_from(tp, v, source, key)  # type: ignore[arg-type]
    if origin in (UnionType, typing.Union):
        if v is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _typed(inner, v, source, key)
    if origin is list:
        if not isinstance(v, list):
            raise ContractError(f"{_where(source, key)}: expected a list, got {v!r}")
        return [_typed(args[0], x, source, f"{key}[{i}]") for i, x in enumerate(v)]
    if origin is dict:
        return {
            _string(k, source, key): _typed(args[1], x, source, f"{key}.{k}")
            for k, x in _mapping(v, source, key).items()
        }
    if tp is str:
        return _string(v, source, key)
    if tp is int:
        return _integer(v, source, key)
    if tp is float:
        return _number(v, source, key)
    if tp is bool:
        if not isinstance(v, bool):
            raise ContractError(f"{_where(source, key)}: expected true or false, got {v!r}")
        return v
    raise TypeError(f"{key}: no check for {tp!r}")  # a field type this reader does not handle: a bug here
