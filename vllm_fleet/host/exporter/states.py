"""The state files of this host's instances and multi-node workers, and what was deployed here.

* :class:`StateFiles`: the launcher's state file per instance (``{state_dir}/{name}.json``: loading / ready /
  draining / failed / stopped, probe latency and failures, load duration; ``vllm_fleet.contracts.StateFile``),
  for an instance whose model sleeps (its state file has a ``sleep_state``) its sleep state, sleeps, wakes
  (their durations, the failed ones) and time asleep (docs/sleep.md), and, for a multi-node instance, its group
  size (the instance config); per headless rank of a multi-node
  instance on this host, the worker's state file (``{state_dir}/workers/{name}.json``: waiting / joined /
  rank0_gone / exited); per LoRA instance (its config names an adapters file), whether each adapter it carries
  is loaded (the adapter state file the launcher and ``vllm-fleet adapters sync`` write:
  ``{state_dir}/adapters/{name}.json``). Read at every scrape; ``read_errors`` counts the files that could not
  be read.
* :class:`Deployment`: the manifest ``vllm-fleet manifest`` writes and, on the gateway host, the drained set
  ``vllm-fleet drain`` writes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric, SummaryMetricFamily
from prometheus_client.registry import Collector

from vllm_fleet.contracts import (
    ADAPTER_STATE_STALE_SECONDS,
    SLEEP_STATES,
    WORKER_STATE_SUBDIR,
    WORKER_STATES,
    AdaptersFile,
    AdapterStateFile,
    ContractError,
    StateFile,
    WorkerStateFile,
    adapter_state_path,
    adapters_file_of,
    is_adapters_file,
    read_adapter_state,
    read_state,
    read_worker_state,
)
from vllm_fleet.files import read_json_object
from vllm_fleet.host.exporter.common import PREFIX, log, pid_alive
from vllm_fleet.host.gateway_state import GatewayState, StateFileError

STATES = ("loading", "ready", "draining", "failed", "stopped")


def wall_clock() -> float:
    """The scrape's wall clock (the one reading of it here: the golden tests fix it)."""
    return time.time()


@dataclass
class Instance:
    name: str
    model: str = ""
    port: int | None = None
    state: StateFile | None = None
    nnodes: int = 1  # the instance config's: hosts the engine group spans
    adapters_file: str = ""  # the instance config's VLLM_FLEET_ADAPTERS_FILE: LoRA on


def _configs(config_dir: Path | None) -> tuple[list[tuple[str, dict[str, Any]]], int]:
    """``(name, config)`` of every ``*.json`` config in ``config_dir`` (name: its ``name`` or the file's stem),
    and how many could not be read. An instance's adapters file beside its config (``NAME.adapters.json``) is
    no config."""
    found: list[tuple[str, dict[str, Any]]] = []
    errors = 0
    if config_dir is not None and config_dir.is_dir():
        for p in sorted(config_dir.glob("*.json")):
            if is_adapters_file(p):
                continue
            cfg = read_json_object(p)
            if cfg is None:
                errors += 1
            else:
                found.append((str(cfg.get("name") or p.stem), cfg))
    return found, errors


def _states(state_dir: Path, read: Callable[[Path], Any]) -> tuple[list[tuple[str, Any]], int]:
    """``(name, state)`` of every ``*.json`` state file in ``state_dir`` read with ``read`` (name: its
    ``instance`` or the file's stem), and how many could not be read (logged)."""
    found: list[tuple[str, Any]] = []
    errors = 0
    if state_dir.is_dir():
        for p in sorted(state_dir.glob("*.json")):
            try:
                st = read(p)
            except (OSError, ContractError) as exc:
                # a torn write cannot happen (tmp + rename); anything else is worth a metric
                log.warning("%s", exc)
                errors += 1
                continue
            found.append((str(st.get("instance") or p.stem), st))
    return found, errors


def read_instances(state_dir: Path, config_dir: Path | None) -> tuple[list[Instance], int]:
    """Instances known from the instance configs and/or launcher state files. Returns (instances, errors)."""
    found: dict[str, Instance] = {}
    configs, cfg_errors = _configs(config_dir)
    for name, cfg in configs:
        nnodes = cfg.get("nnodes")
        env = cfg.get("environment")
        found[name] = Instance(
            name,
            str(cfg.get("served_model_name") or name),
            cfg.get("port"),
            nnodes=nnodes if isinstance(nnodes, int) and not isinstance(nnodes, bool) else 1,
            adapters_file=str(adapters_file_of(env) or "") if isinstance(env, dict) else "",
        )
    states, st_errors = _states(state_dir, read_state)
    for name, st in states:
        inst = found.setdefault(name, Instance(name))
        inst.state = st
        inst.model = inst.model or str(st.get("served_model_name") or name)
        inst.port = inst.port or st.get("port")
    return sorted(found.values(), key=lambda i: i.name), cfg_errors + st_errors


@dataclass
class Worker:
    """A headless rank > 0 of a multi-node instance on this host (``vllm-worker@NAME.service``)."""

    name: str
    model: str = ""
    rank: int | None = None
    state: WorkerStateFile | None = None


def read_workers(state_dir: Path, config_dir: Path | None) -> tuple[list[Worker], int]:
    """Workers known from their configs (``{config_dir}/workers/NAME.json``) and/or their state files
    (``{state_dir}/workers/NAME.json``). Returns (workers, errors)."""
    found: dict[str, Worker] = {}
    configs, cfg_errors = _configs(config_dir)
    for name, cfg in configs:
        rank = cfg.get("rank")
        found[name] = Worker(
            name, str(cfg.get("served_model_name") or name), rank if isinstance(rank, int) else None
        )
    states, st_errors = _states(state_dir / WORKER_STATE_SUBDIR, read_worker_state)
    for name, st in states:
        w = found.setdefault(name, Worker(name))
        pid = st.get("worker_pid")
        if st.get("state") in ("waiting", "joined") and isinstance(pid, int) and not pid_alive(pid):
            # killed (SIGKILL at a stop timeout, the OOM killer): it could not write its last state
            st = {**st, "state": "exited", "reason": "the worker process is gone"}
        w.state = st
        w.model = w.model or str(st.get("served_model_name") or name)
        w.rank = w.rank if w.rank is not None else st.get("rank")
    return sorted(found.values(), key=lambda w: w.name), cfg_errors + st_errors


def _number(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) else None


def _flag(v: Any) -> int | None:
    return (1 if v else 0) if isinstance(v, bool) else None


# how a state-file value becomes a sample: the family, and the value (None: the key is absent or ill-typed)
_KINDS: dict[str, tuple[type[GaugeMetricFamily | CounterMetricFamily], Callable[[Any], float | None]]] = {
    "gauge": (GaugeMetricFamily, _number),
    "flag": (GaugeMetricFamily, _flag),
    "counter": (CounterMetricFamily, _number),
}
# one series per instance from its state file: (kind, metric name, help, state-file key), in exposition order
STATE_METRICS = (
    ("gauge", "instance_load_duration_seconds", "Start to ready, last start", "load_duration_seconds"),
    ("gauge", "instance_started_timestamp_seconds", "Launcher start time", "started_at"),
    ("gauge", "instance_ready_timestamp_seconds", "Time the engine became ready", "ready_at"),
    ("gauge", "instance_state_updated_timestamp_seconds", "Last state write", "updated_at"),
    ("flag", "probe_success", "1 when the last generation probe succeeded", "last_probe_ok"),
    ("gauge", "probe_latency_seconds", "Latency of the last probe", "last_probe_latency_seconds"),
    ("gauge", "probe_last_timestamp_seconds", "Time of the last probe", "last_probe_at"),
    ("counter", "probes", "Probes since the launcher started", "probes_total"),
    ("counter", "probe_failures", "Failed probes since the launcher started", "probe_failures_total"),
    (
        "counter",
        "probes_starved",
        "Liveness checks that timed out while the engine waited for CPUs (counted as alive)",
        "probes_starved_total",
    ),
)


Families = list[tuple[GaugeMetricFamily | CounterMetricFamily, str, Callable[[Any], float | None]]]


def _add_row(
    lv: list[str], st: Any, current: Any, states: tuple[str, ...], state: GaugeMetricFamily, fams: Families
) -> None:
    """One instance's series: its one-hot ``state`` over ``states`` (``current`` 1, the others 0), and each of
    ``fams`` (family, state file key, conversion) whose value the state file has."""
    for s in states:
        state.add_metric([*lv, s], 1 if current == s else 0)
    for fam, key, value in fams:
        v = value(st.get(key))
        if v is not None:
            fam.add_metric(lv, v)


def instance_metrics(instances: list[Instance]) -> Iterator[Metric]:
    """The launcher state files' series, one per instance (configured or with a state file)."""
    lbl = ["instance", "model"]
    state = GaugeMetricFamily(
        PREFIX + "instance_state",
        "Launcher state: 1 for the current state (state file)",
        labels=[*lbl, "state"],
    )
    present = GaugeMetricFamily(
        PREFIX + "instance_state_present", "1 when the launcher wrote a state file", labels=lbl
    )
    fams = [
        (_KINDS[kind][0](PREFIX + name, doc, labels=lbl), key, _KINDS[kind][1])
        for kind, name, doc, key in STATE_METRICS
    ]
    for i in instances:
        lv = [i.name, i.model]
        st = i.state or {}
        present.add_metric(lv, 1 if i.state is not None else 0)
        _add_row(lv, st, st.get("state"), STATES, state, fams)
    phase = GaugeMetricFamily(
        PREFIX + "instance_phase_info",
        "The launcher's phase and failure reason (its systemd STATUS, in words)",
        labels=[*lbl, "phase", "reason"],
    )
    for i in instances:
        if i.state is not None:
            phase.add_metric(
                [
                    i.name,
                    i.model,
                    str(i.state.get("phase") or ""),
                    str(i.state.get("failure_reason") or ""),
                ],
                1,
            )
    stack = GaugeMetricFamily(
        PREFIX + "instance_stack_info",
        "The engine stack (venv: profile-vLLM version-lock hash) the running engine was started from",
        labels=[*lbl, "stack"],
    )
    for i in instances:
        if i.state is not None and i.state.get("stack"):
            stack.add_metric([i.name, i.model, str(i.state.get("stack"))], 1)
    nodes = GaugeMetricFamily(
        PREFIX + "instance_nodes",
        "Hosts (ranks) the engine group of a multi-node instance spans (instance config; multi-node only)",
        labels=lbl,
    )
    for i in instances:
        if i.nnodes > 1:
            nodes.add_metric([i.name, i.model], i.nnodes)
    yield state
    yield present
    yield phase
    yield stack
    yield nodes
    yield from (fam for fam, _, _ in fams)


# sleep mode (docs/sleep.md): one series per instance whose state file has a sleep state (its model sleeps;
# none for one that never sleeps): (kind, metric name, help, state-file key), in exposition order after
# ``instance_sleep_state``; then the wakes' summary and the time asleep (``sleep_metrics``)
SLEEP_STATE_METRICS = (
    (
        "gauge",
        "instance_sleep_level",
        "The level the engine sleeps at (1: weights in host memory, 2: dropped)",
        "sleep_level",
    ),
    (
        "gauge",
        "instance_asleep_since_timestamp_seconds",
        "Time the engine fell asleep (while asleep or waking)",
        "asleep_since",
    ),
    (
        "gauge",
        "instance_last_active_timestamp_seconds",
        "Time a request to the engine last ended",
        "last_active_at",
    ),
    (
        "gauge",
        "instance_last_wake_seconds",
        "Duration of the last wake (the wake signal to awake)",
        "last_wake_seconds",
    ),
    (
        "counter",
        "instance_sleeps",
        "Times the launcher put the engine to sleep since it started",
        "sleeps_total",
    ),
    ("counter", "instance_wakes", "Wakes completed since the launcher started", "wakes_total"),
    (
        "counter",
        "instance_failed_wakes",
        "Wakes that failed since the launcher started (the requests held for them were answered 503)",
        "failed_wakes_total",
    ),
)


RUNNING = ("ready", "draining")  # launcher states while its engine runs (an engine asleep is one of these)


def asleep_seconds(st: StateFile, at: float) -> float:
    """Seconds asleep since the launcher started: its completed periods (``asleep_seconds_total``) and the current
    one while ``asleep_since`` is set (asleep, and waking: the launcher adds the period to the total and clears
    ``asleep_since`` in one write when the engine is awake again), up to ``at`` — or, for a launcher that no longer
    runs its engine (stopped, failed), up to its last write (the total stays where it was)."""
    total = _number(st.get("asleep_seconds_total")) or 0.0
    since = _number(st.get("asleep_since"))
    if since is not None:
        end = at if st.get("state") in RUNNING else (_number(st.get("updated_at")) or at)
        total += max(0.0, end - since)
    return total


def sleep_metrics(instances: list[Instance], at: float | None = None) -> Iterator[Metric]:
    """The sleep-mode series of every instance whose state file has a sleep state (``sleep_state`` not null):
    ``instance_sleep_state{state}`` 0/1 over ``SLEEP_STATES``, ``SLEEP_STATE_METRICS``, the wakes as a summary
    (``_count`` the wakes, ``_sum`` their durations) and the time asleep (the current period to ``at``)."""
    at = wall_clock() if at is None else at
    lbl = ["instance", "model"]
    state = GaugeMetricFamily(
        PREFIX + "instance_sleep_state",
        "Sleep state of an engine that sleeps: 1 for the current state (state file)",
        labels=[*lbl, "state"],
    )
    fams = [
        (_KINDS[kind][0](PREFIX + name, doc, labels=lbl), key, _KINDS[kind][1])
        for kind, name, doc, key in SLEEP_STATE_METRICS
    ]
    wake = SummaryMetricFamily(
        PREFIX + "instance_wake_duration_seconds",
        "Wakes completed since the launcher started (count) and their durations summed, the wake signal to awake",
        labels=lbl,
    )
    asleep = CounterMetricFamily(
        PREFIX + "instance_asleep_seconds",
        "Time the engine spent asleep since the launcher started (the current period included)",
        labels=lbl,
    )
    for i in instances:
        st = i.state or {}
        current = st.get("sleep_state")
        if current is None:
            continue
        lv = [i.name, i.model]
        _add_row(lv, st, current, SLEEP_STATES, state, fams)
        wake.add_metric(
            lv,
            count_value=int(_number(st.get("wakes_total")) or 0),
            sum_value=_number(st.get("wake_seconds_total")) or 0.0,
        )
        asleep.add_metric(lv, asleep_seconds(st, at))
    yield state
    yield from (fam for fam, _, _ in fams)
    yield wake
    yield asleep


def worker_metrics(workers: list[Worker]) -> Iterator[Metric]:
    """A multi-node instance's headless ranks on this host, labelled like the instance series plus
    ``rank``: their state 0/1 per state (``WORKER_STATES``), whether a state file exists, since when."""
    lbl = ["instance", "model", "rank"]
    state = GaugeMetricFamily(
        PREFIX + "worker_state",
        "Multi-node worker (rank > 0) state: 1 for the current state (worker state file)",
        labels=[*lbl, "state"],
    )
    present = GaugeMetricFamily(
        PREFIX + "worker_state_present", "1 when the worker wrote a state file", labels=lbl
    )
    since = GaugeMetricFamily(
        PREFIX + "worker_state_since_timestamp_seconds", "Time the worker entered its state", labels=lbl
    )
    for w in workers:
        lv = [w.name, w.model, rank_label(w)]
        st = w.state or {}
        present.add_metric(lv, 1 if w.state is not None else 0)
        current = st.get("state")
        for s in WORKER_STATES:
            state.add_metric([*lv, s], 1 if current == s else 0)
        if (v := _number(st.get("since"))) is not None:
            since.add_metric(lv, v)
    yield state
    yield present
    yield since


@dataclass
class AdapterReading:
    """A LoRA instance's adapters file and adapter state file, as one scrape read them (None: missing)."""

    instance: Instance
    file: AdaptersFile
    state: AdapterStateFile | None


def read_adapters(instances: list[Instance], state_dir: Path) -> tuple[list[AdapterReading], int]:
    """The adapters of every LoRA instance: its adapters file (one that cannot be read is a read error; a
    missing one: nothing carried) and its adapter state file (missing: nothing loaded). Returns (readings,
    errors)."""
    out: list[AdapterReading] = []
    errors = 0
    for i in instances:
        if not i.adapters_file:
            continue
        try:
            doc = AdaptersFile.load(i.adapters_file)
        except FileNotFoundError:
            continue
        except (OSError, ContractError) as exc:
            log.warning("%s", exc)
            errors += 1
            continue
        try:
            st: AdapterStateFile | None = read_adapter_state(adapter_state_path(state_dir, i.name))
        except FileNotFoundError:
            st = None
        except (OSError, ContractError) as exc:
            log.warning("%s", exc)
            errors += 1
            st = None
        out.append(AdapterReading(i, doc, st))
    return out, errors


def adapter_loaded(r: AdapterReading, now: float) -> dict[str, int]:
    """1/0 per adapter the instance carries: 1 when the adapter state file lists it as loaded, unless the file
    is older than ``ADAPTER_STATE_STALE_SECONDS`` while the instance is not ready (a stopped or failed engine
    loads nothing, whatever its last file said)."""
    st = r.state or {}
    names = set(st.get("loaded") or [])
    age = now - float(st.get("updated_at") or 0.0)
    ready = (r.instance.state or {}).get("state") == "ready"
    if age > ADAPTER_STATE_STALE_SECONDS and not ready:
        names = set()
    return {a.name: 1 if a.name in names else 0 for a in r.file.carried}


def adapter_metrics(readings: list[AdapterReading], at: float | None = None) -> Iterator[Metric]:
    """``adapter_loaded{instance, model, adapter}`` per adapter each LoRA instance carries."""
    at = wall_clock() if at is None else at
    fam = GaugeMetricFamily(
        PREFIX + "instance_adapter_loaded",
        "1 when the engine has the LoRA adapter the instance carries loaded (adapter state file; 0 also when the"
        " file is stale while the instance is not ready)",
        labels=["instance", "model", "adapter"],
    )
    for r in readings:
        for name, v in adapter_loaded(r, at).items():
            fam.add_metric([r.instance.name, r.instance.model, name], v)
    yield fam


def rank_label(w: Worker) -> str:
    """A worker's ``rank`` label: its rank, empty when neither its config nor its state file says."""
    return "" if w.rank is None else str(w.rank)


@dataclass
class HostStates:
    """One scrape's reading of the state and config files: the instances, the workers, and how many files
    could not be read."""

    instances: list[Instance]
    workers: list[Worker]
    errors: int
    adapters: list[AdapterReading] = field(default_factory=list)


class StateFiles(Collector):
    """The instances' and workers' series from their state files and configs (read at every scrape)."""

    def __init__(
        self, state_dir: Path, config_dir: Path | None = None, worker_config_dir: Path | None = None
    ) -> None:
        self.state_dir = state_dir
        self.config_dir = config_dir
        self.worker_config_dir = worker_config_dir

    def read(self) -> HostStates:
        instances, errors = read_instances(self.state_dir, self.config_dir)
        workers, worker_errors = read_workers(self.state_dir, self.worker_config_dir)
        adapters, adapter_errors = read_adapters(instances, self.state_dir)
        return HostStates(instances, workers, errors + worker_errors + adapter_errors, adapters)

    def metrics(self, states: HostStates) -> Iterator[Metric]:
        """The instance, sleep-mode, adapter and worker series of ``states`` (without the read-error counter)."""
        at = wall_clock()
        yield from instance_metrics(states.instances)
        yield from sleep_metrics(states.instances, at)
        yield from adapter_metrics(states.adapters, at)
        yield from worker_metrics(states.workers)

    @staticmethod
    def read_errors(errors: int) -> Metric:
        return CounterMetricFamily(
            PREFIX + "exporter_read_errors", "State/config files that could not be read", value=errors
        )

    def collect(self) -> Iterator[Metric]:
        states = self.read()
        yield from self.metrics(states)
        yield self.read_errors(states.errors)


class Deployment(Collector):
    """What was deployed here (the manifest ``vllm-fleet manifest`` writes) and, on the gateway host, which
    instances are out of rotation (the drain state file ``vllm-fleet drain`` writes); either file is optional."""

    def __init__(self, manifest: Path | None = None, drain_state: Path | None = None) -> None:
        self.manifest = manifest
        self.drain_state = drain_state

    def collect(self) -> Iterator[Metric]:
        if self.manifest is not None and (m := read_json_object(self.manifest)) is not None:
            stack: dict[str, Any] = m["stack"] if isinstance(m.get("stack"), dict) else {}
            info = GaugeMetricFamily(
                PREFIX + "deployed_info",
                "The deployment on this host (manifest): spec hash, profile, pinned and installed vLLM",
                labels=["spec_hash", "profile", "pinned_vllm", "vllm"],
            )
            info.add_metric(
                [
                    str(m.get("spec_hash") or ""),
                    str(m.get("profile") or ""),
                    str(m.get("pinned_vllm") or ""),
                    str(stack.get("vllm") or ""),
                ],
                1,
            )
            yield info
        if self.drain_state is not None and self.drain_state.exists():
            doc = read_json_object(self.drain_state)
            drained = doc.get("drained") if doc is not None else None
            fam = GaugeMetricFamily(
                PREFIX + "gateway_drained",
                "1 for each instance the gateway keeps out of rotation (vllm-fleet drain)",
                labels=["instance"],
            )
            for name in drained if isinstance(drained, list) else []:
                fam.add_metric([str(name)], 1)
            yield fam
            yield from canary_metrics(doc)


def canary_metrics(doc: dict[str, Any] | None, now: float | None = None) -> Iterator[Metric]:
    """The canary leases of the gateway's state file (``vllm-fleet canary``): the share each canary gets while
    its lease is live (0 once it ran out, or while the canary is drained) and when the lease runs out. Nothing
    while the file holds no lease."""
    try:
        st = GatewayState.from_json(doc)
    except StateFileError:
        return
    if not st.canary:
        return
    now = time.time() if now is None else now
    share = GaugeMetricFamily(
        PREFIX + "gateway_canary_share",
        "The share of its model's requests the gateway sends the canary (vllm-fleet canary set): 0 once the lease"
        " ran out or while the canary is drained",
        labels=["instance", "model"],
    )
    expiry = GaugeMetricFamily(
        PREFIX + "gateway_canary_lease_expiry_timestamp_seconds",
        "When the canary's lease runs out (epoch seconds): no canary traffic from then on unless renewed",
        labels=["instance", "model"],
    )
    for name, lease in sorted(st.canary.items()):
        live = lease.live(now) and name not in st.drained
        share.add_metric([name, lease.model], lease.share if live else 0.0)
        expiry.add_metric([name, lease.model], lease.until)
    yield share
    yield expiry
