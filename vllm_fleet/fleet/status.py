"""``vllm-fleet status SPEC``: the whole fleet in one table, from the monitoring host's Prometheus.

One instant query (``QUERY``) brings every series the table needs: the host exporters' view of each launcher
(state, phase and failure reason, ready since, probe, restarts), each engine's own load (running / waiting
requests, KV cache), the gateway's drained set and what each host has deployed (the manifest's spec hash).
Rows are the spec's instances, so an instance Prometheus knows nothing about still shows — as unknown; a host
whose exporter is not scraped is named as unreachable.
Where the gateway runs the admission service (``gateway.limits``: ``Gateway.admission``), the same query brings
its per-key series too, and a "Top keys" section follows the table: the ``TOP_KEYS`` keys with the most requests
admitted in the last ``KEY_WINDOW`` (in flight, queued, admitted, refused, the budgets at 100 %), and a line for
each other key at a budget. A multi-node instance's ranks > 0 get a worker row
each, under their instance (``vllm-worker@NAME`` on the rank's host: its state file via that host's exporter).
With two or more gateways (``gateway.hosts``) a line says which holds ``gateway.virtual_address`` (each
gateway's keepalived state, ``vllm_fleet_gateway_vrrp_state`` / ``_master`` from its exporter), and a line names
each instance that some gateways drain and others do not (``vllm_fleet_gateway_drained`` per gateway: a drain
that did not reach every gateway); with two or more monitoring hosts (``monitoring.hosts``) a line per host says
whether its Prometheus and Alertmanager are scraped and how many members its Alertmanager's cluster counts
(``alertmanager_cluster_members``). The monitoring hosts' Prometheus servers are asked in turn
(``prometheus_urls``): the first that answers is read.

Verdicts per row: ``serving`` (ready, probe passing, engine scraped, in rotation), ``degraded`` (loading,
draining, drained, probe failing, a rank of its group not joined) or ``down`` (failed, stopped, unreachable,
unknown). A canary (``rollouts[].canary``, role ``canary``) runs only during ``vllm-fleet rollout``: stopped,
never started, or left failed while no gateway holds a live lease for it, it is ``idle`` (not counted in the exit
code); running, it is judged like any instance, but its served model's verdict never depends on it. Per served
model whose canary a gateway has an entry for (``vllm_fleet_gateway_canary_share`` and
``_lease_expiry_timestamp_seconds``), a "Rollout" line gives its share on each gateway and the seconds left of
its lease (an expired lease: out of rotation). Per instance that carries LoRA adapters (``adapters[]``), an
"Adapters" line names those its engine has loaded and those it carries but has not
(``vllm_fleet_instance_adapter_loaded``): a ready instance missing one is ``degraded``. An instance whose model
sleeps (``models[].sleep``) shows its sleep state after its launcher's (``ready · asleep L1 12m0s``, ``ready ·
waking``, ``ready · awake``) and a "Sleep" line: its level, wakes, failed wakes and the last wake's duration
(``vllm_fleet_instance_sleep_state`` and the other ``SLEEP_METRICS``); asleep or waking, it is judged like an awake
one (the gateway wakes it on the first request). A worker row is
``serving`` (joined), ``degraded`` (waiting for rank 0) or ``down`` (rank 0 gone, exited, unknown, unreachable)
and counts in the exit code like an instance row. Exit codes (``EXIT_*``): 0 every instance serving; 1 some
instance is not, but every served model still has a serving instance; 2 a served model has none; 3 Prometheus
could not be asked.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import socket
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import asdict, dataclass, field
from typing import Any

from vllm_fleet.fleet.spec import FleetSpec, spec_hash

EXIT_SERVING, EXIT_DEGRADED, EXIT_DOWN, EXIT_UNREACHABLE = 0, 1, 2, 3
EXPORTER_JOB, ENGINE_JOB = "vllm-fleet-exporter", "vllm"  # monitoring/prometheus.yml.j2
NGINX_JOB, PROMETHEUS_JOB, ALERTMANAGER_JOB = "nginx", "prometheus", "alertmanager"
METRICS = (
    "up",
    "vllm_fleet_instance_state",
    "vllm_fleet_instance_phase_info",
    "vllm_fleet_instance_stack_info",
    "vllm_fleet_instance_ready_timestamp_seconds",
    "vllm_fleet_instance_restarts_total",
    "vllm_fleet_probe_success",
    "vllm_fleet_probe_latency_seconds",
    "vllm_fleet_gateway_drained",
    "vllm_fleet_deployed_info",
    "vllm_fleet_worker_state",
    "vllm_fleet_worker_state_since_timestamp_seconds",
    "vllm_fleet_worker_restarts_total",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    # high availability (vllm_fleet.fleet.observability.VRRP_METRICS, ALERTMANAGER_CLUSTER_METRICS)
    "vllm_fleet_gateway_vrrp_master",
    "vllm_fleet_gateway_vrrp_state",
    "vllm_fleet_gateway_vrrp_state_since_timestamp_seconds",
    "alertmanager_cluster_members",
    # canary rollouts (rollouts[]): each gateway's entry per canary, while `vllm-fleet rollout` holds its lease
    "vllm_fleet_gateway_canary_share",
    "vllm_fleet_gateway_canary_lease_expiry_timestamp_seconds",
    # LoRA adapters (adapters[]): per instance, each adapter it carries: 1 loaded in its engine, 0 not
    "vllm_fleet_instance_adapter_loaded",
    # sleep mode (models[].sleep; vllm_fleet.fleet.observability.SLEEP_METRICS): only instances whose model sleeps
    "vllm_fleet_instance_sleep_state",
    "vllm_fleet_instance_sleep_level",
    "vllm_fleet_instance_asleep_since_timestamp_seconds",
    "vllm_fleet_instance_wakes_total",
    "vllm_fleet_instance_failed_wakes_total",
    "vllm_fleet_instance_last_wake_seconds",
)
# the gateway admission service's per-key gauges (vllm_fleet.fleet.observability.ADMISSION_METRICS)
KEY_METRICS = (
    "vllm_fleet_gateway_key_in_flight",
    "vllm_fleet_gateway_key_queued",
    "vllm_fleet_gateway_key_budget_used_ratio",
)
ADMISSION_JOB = "vllm-fleet-admission"
KEY_WINDOW = "5m"
TOP_KEYS = 5
# the per-key counters' increase over KEY_WINDOW, in the same query under names of their own; `or` matches
# label sets without the metric name, so each also carries its name as the label vf_status (two sums by
# (client, key) would otherwise be one series to `or`, the second dropped)
KEY_INCREASES = {
    "vllm_fleet_status_key_admitted": "vllm_fleet_gateway_key_admitted_total",
    "vllm_fleet_status_key_refused": "vllm_fleet_gateway_key_refused_total",
}
QUERY = (
    '{__name__=~"'
    + "|".join(METRICS + KEY_METRICS)
    + '"}'
    + "".join(
        f" or label_replace(label_replace(sum by (client, key) (increase({src}[{KEY_WINDOW}])), "
        f'"__name__", "{name}", "", ""), "vf_status", "{name}", "", "")'
        for name, src in KEY_INCREASES.items()
    )
)

Sample = tuple[dict[str, str], float]


class StatusError(RuntimeError):
    """Prometheus could not be asked (the message says where and why)."""


@dataclass
class SleepStatus:
    """An instance whose model sleeps (``models[].sleep``), as its host exporter reads its launcher's state file."""

    state: str = ""  # awake | sleeping | asleep | waking ("": none of these)
    level: int | None = None  # 1: weights kept in host memory, 2: dropped
    asleep_since: float | None = None  # only while asleep
    wakes: int | None = None  # since the launcher started
    failed_wakes: int | None = None  # since the launcher started: their held requests were answered 503
    last_wake_seconds: float | None = None


@dataclass
class Row:
    host: str
    instance: str
    model: str
    role: str
    gpus: list[int]
    verdict: str = "down"  # serving | degraded | down; idle: a canary that is not running (not judged)
    state: str = (
        "unknown"  # the launcher's: loading | ready | draining | failed | stopped; unknown; unreachable
    )
    phase: str = ""  # the launcher's phase, or its failure reason
    ready_since: float | None = None
    restarts: int | None = None
    probe_ok: bool | None = None
    probe_latency: float | None = None
    running: int | None = None
    waiting: int | None = None
    kv_cache: float | None = None
    rotation: str = "?"  # in | drained | ? (the gateway's exporter is not scraped)
    stack: str = ""  # the engine stack the running engine was started from (its venv's name)
    adapters: list[str] = field(default_factory=list)  # the adapters it carries that its engine has loaded
    adapters_missing: list[str] = field(default_factory=list)  # those it carries that are not loaded
    sleep: SleepStatus | None = None  # its sleep mode (None: its model does not sleep, or nothing reported)


@dataclass
class WorkerRow:
    """A rank > 0 of a multi-node instance: ``vllm-worker@INSTANCE`` on ``host``."""

    host: str
    instance: str
    model: str
    rank: int
    gpus: list[int]
    verdict: str = "down"  # serving (joined) | degraded (waiting) | down
    state: str = "unknown"  # the worker's: waiting | joined | rank0_gone | exited; unknown; unreachable
    since: float | None = None  # when the worker entered its state
    restarts: int | None = None  # systemd NRestarts of vllm-worker@INSTANCE


WORKER_VERDICTS = {"joined": "serving", "waiting": "degraded"}  # any other state: down
# the launcher states of a canary that is not running: stopped (a rollout ended), unknown (never started: no
# state file); failed too where no gateway holds a live lease for it (a crashed canary its rollout stopped)
CANARY_IDLE_STATES = ("stopped", "unknown")


@dataclass
class CanaryGateway:
    """One gateway's entry for a canary (while ``vllm-fleet rollout`` renews its lease)."""

    host: str
    share: float | None = None  # the share of the model's requests the gateway sends the canary
    lease_left: float | None = None  # seconds until the lease expires (<= 0: expired, out of rotation)

    @property
    def live(self) -> bool:
        return self.lease_left is None or self.lease_left > 0


@dataclass
class RolloutStatus:
    """A served model's canary as the gateways report it."""

    model: str
    canary: str
    verdict: str  # the canary row's
    gateways: list[CanaryGateway] = field(default_factory=list)


@dataclass
class KeyRow:
    """An API key at the gateway (``CLIENT/8 hex digits``), from the admission service's series."""

    key: str
    client: str
    in_flight: int | None = None
    queued: int | None = None
    admitted: float = 0.0  # requests admitted in the last KEY_WINDOW
    refused: float = 0.0  # requests refused (429) in the last KEY_WINDOW
    at_budget: list[str] = field(default_factory=list)  # budgets used at 100 % now: in_flight, rpm, tpm


@dataclass
class GatewayHostStatus:
    """One of two or more gateways: its keepalived's VRRP state as its host exporter reports it."""

    host: str
    state: str = "UNKNOWN"  # MASTER | BACKUP | FAULT | STOP | UNKNOWN; unreachable: its exporter not scraped
    holds: bool = False  # it holds the virtual address (vllm_fleet_gateway_vrrp_master)
    since: float | None = None  # when keepalived reported that state
    nginx_up: bool | None = None  # its nginx exporter scraped (None: Prometheus has no such target)
    # its drained set, as its exporter reads its drained-set file (vllm_fleet_gateway_drained); None: unreachable
    drained: list[str] | None = None


@dataclass
class MonitoringHostStatus:
    """One of two or more monitoring hosts: its Prometheus and Alertmanager scraped (None: no such target in
    the Prometheus asked), and the members its Alertmanager's cluster counts."""

    host: str
    prometheus_up: bool | None = None
    alertmanager_up: bool | None = None
    cluster_members: int | None = None


@dataclass
class HostStatus:
    name: str
    reachable: bool
    deployed_spec: str = ""  # the spec hash the host's manifest records ("" when unknown)
    drift: bool = False
    # it runs an instance or a headless rank: the engine role writes its deployment manifest (a gateway- or
    # monitoring-only host has none, and no drift to tell)
    engines: bool = True


@dataclass
class FleetStatus:
    fleet: str
    spec_hash: str
    prometheus: str
    at: float
    rows: list[Row] = field(default_factory=list)
    workers: list[WorkerRow] = field(default_factory=list)  # ranks > 0 of multi-node instances
    hosts: list[HostStatus] = field(default_factory=list)
    models_down: list[str] = field(default_factory=list)  # served models without a serving instance
    admission: bool = False  # the gateway runs the admission service (gateway.limits)
    admission_up: bool | None = None  # its metrics scraped (None: not asked, or no admission service)
    keys: list[KeyRow] = field(default_factory=list)  # the busiest keys (TOP_KEYS), most admitted first
    keys_at_budget: list[KeyRow] = field(default_factory=list)  # other keys at a budget
    # the Prometheus servers asked before the one that answered, and why each did not
    prometheus_errors: list[str] = field(default_factory=list)
    virtual_address: str = ""  # gateway.virtual_address ("": one gateway)
    gateways: list[GatewayHostStatus] = field(default_factory=list)  # two or more gateways only
    holders: list[str] = field(default_factory=list)  # the gateways that hold the virtual address
    # instance → the gateways that drain it, where some reachable gateways do and others do not (a drain or
    # undrain that did not reach every gateway: vllm-fleet drain's exit 4)
    drained_on_some: dict[str, list[str]] = field(default_factory=dict)
    monitoring: list[MonitoringHostStatus] = field(default_factory=list)  # two or more monitoring hosts only
    # served models whose canary some gateway has an entry for (rollouts[])
    rollouts: list[RolloutStatus] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        if self.models_down:
            return EXIT_DOWN
        rows: list[Row | WorkerRow] = [*self.rows, *self.workers]
        return EXIT_SERVING if all(r.verdict in ("serving", "idle") for r in rows) else EXIT_DEGRADED

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["exit_code"] = self.exit_code
        return d


# ------------------------------------------------------------------------------------------------ reading


def prometheus_urls(spec: FleetSpec) -> list[str]:
    """Each monitoring host's Prometheus (``monitoring.hosts``, in order): ``status`` asks them in turn."""
    return [f"http://{spec.host(h).address}:{spec.monitoring.prometheus_port}" for h in spec.monitoring_hosts]


def prometheus_url(spec: FleetSpec) -> str:
    """The first monitoring host's Prometheus."""
    return prometheus_urls(spec)[0]


def _source_address(host: str) -> str | None:
    """This machine's address towards ``host`` (the route's source; a UDP connect sends nothing), or None."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, kind, proto) as s:
            s.connect(addr)
            return str(s.getsockname()[0])
    except (OSError, IndexError):
        return None


def unanswered_hint(spec: FleetSpec, url: str) -> str:
    """What to do when Prometheus at ``url`` does not answer in time: the monitoring host's firewall drops
    every packet it does not admit (``firewall.admin_sources`` besides the monitoring host), so a controller
    that is not admitted waits for the timeout."""
    target = urllib.parse.urlsplit(url).hostname or ""
    mon = next((h for h in spec.monitoring_hosts if spec.host(h).address == target), spec.monitoring_host)
    if not spec.firewall.enabled:
        return f" (is the monitoring host {mon} up and Prometheus running there?)"
    sources = ", ".join(spec.firewall.admin_sources) or "none"
    me = _source_address(target) if target else None
    mine = f"; this machine's address towards {target} is {me}" if me else ""
    return (
        f". The monitoring host's firewall ({mon}) admits Prometheus only from {mon} itself and "
        f"firewall.admin_sources (configured: {sources}){mine}: add this machine's address (or its network) "
        f"to firewall.admin_sources and deploy again, or run `vllm-fleet status` on {mon}, or tunnel "
        f"(ssh -L 9090:{target}:{urllib.parse.urlsplit(url).port or 9090} {mon}, then --prometheus "
        "http://127.0.0.1:9090); docs/status.md"
    )


def _timed_out(exc: BaseException) -> bool:
    return isinstance(exc, TimeoutError) or (
        isinstance(exc, urllib.error.URLError) and isinstance(exc.reason, TimeoutError)
    )


def basic_auth_header(auth: tuple[str, str]) -> str:
    """The ``Authorization`` header's value for basic auth (``monitoring.web_auth``: Prometheus and
    Alertmanager take the same user and password)."""
    return "Basic " + base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode()


def query(
    url: str,
    expr: str,
    auth: tuple[str, str] | None = None,
    timeout: float = 10.0,
    timeout_hint: str = "",
) -> list[Sample]:
    """One instant query: ``(labels, value)`` per series. ``timeout_hint`` ends the error when nothing
    answered within ``timeout`` (:func:`unanswered_hint`)."""
    req = urllib.request.Request(f"{url.rstrip('/')}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
    if auth is not None:
        req.add_header("Authorization", basic_auth_header(auth))
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            doc = json.loads(r.read())
    except urllib.error.HTTPError as exc:
        hint = ""
        if exc.code == 401:
            hint = (
                " (it needs the monitoring password: --prometheus-password-file, e.g. the controller's "
                "vllm-fleet-secrets/monitoring-web-password next to the inventory; docs/security.md)"
            )
        raise StatusError(f"Prometheus at {url}: HTTP {exc.code} {exc.reason}{hint}") from None
    except (OSError, ValueError) as exc:
        if _timed_out(exc):
            raise StatusError(f"Prometheus at {url}: no answer within {timeout:g} s{timeout_hint}") from None
        raise StatusError(f"Prometheus at {url}: {type(exc).__name__}: {exc}") from None
    if doc.get("status") != "success":
        raise StatusError(f"Prometheus at {url}: {doc.get('errorType')}: {doc.get('error')}")
    out: list[Sample] = []
    for s in doc["data"]["result"]:
        try:
            out.append((dict(s["metric"]), float(s["value"][1])))
        except (KeyError, IndexError, ValueError):
            continue
    return out


def ask(
    spec: FleetSpec, urls: list[str], auth: tuple[str, str] | None = None, expr: str = QUERY
) -> tuple[str, list[Sample], list[str]]:
    """``expr`` (``QUERY``: the status table's) to each Prometheus of ``urls`` in turn: (the first that
    answered, its samples, why each one before it did not). None answering: ``StatusError`` with every
    reason."""
    errors: list[str] = []
    for url in urls:
        try:
            return url, query(url, expr, auth, timeout_hint=unanswered_hint(spec, url)), errors
        except StatusError as exc:
            errors.append(str(exc))
    raise StatusError("\n".join(errors))


# ------------------------------------------------------------------------------------------------ judging


class _Index:
    """The samples by metric name, with lookups by labels."""

    def __init__(self, samples: list[Sample]) -> None:
        self.by_name: dict[str, list[Sample]] = {}
        for labels, value in samples:
            self.by_name.setdefault(labels.get("__name__", ""), []).append((labels, value))

    def find(self, name: str, **labels: str) -> list[Sample]:
        return [
            (lv, v) for lv, v in self.by_name.get(name, []) if all(lv.get(k) == x for k, x in labels.items())
        ]

    def one(self, name: str, **labels: str) -> float | None:
        found = self.find(name, **labels)
        return found[0][1] if found else None

    def total(self, name: str, **labels: str) -> float | None:
        found = self.find(name, **labels)
        return sum(v for _, v in found) if found else None


def judge(
    spec: FleetSpec, samples: list[Sample], prometheus: str = "", now: float | None = None
) -> FleetStatus:
    """The status of every instance of ``spec`` from one query's ``samples``."""
    idx = _Index(samples)
    want = spec_hash(spec)
    st = FleetStatus(spec.name, want, prometheus, time.time() if now is None else now)
    for h in spec.hosts:
        up = idx.one("up", job=EXPORTER_JOB, host=h.name)
        deployed = next(
            (lv.get("spec_hash", "") for lv, _ in idx.find("vllm_fleet_deployed_info", host=h.name)), ""
        )
        engines = bool(spec.models_on(h.name) or spec.workers_on(h.name))
        st.hosts.append(HostStatus(h.name, up == 1, deployed, bool(deployed) and deployed != want, engines))
    reachable = {h.name: h.reachable for h in st.hosts}
    gateway_seen = any(reachable.get(g, False) for g in spec.gateway_hosts) if spec.gateway.enabled else False
    entries = {r.canary.name: _canary_gateways(idx, r.canary.name, st.at) for r in spec.rollouts}
    for m in spec.models:
        row = Row(m.host, m.name, m.served_model_name or m.name, m.role, list(m.gpus))
        _fill(row, idx, reachable.get(m.host, False), gateway_seen, spec.gateway.enabled)
        if m.role == "canary":
            _judge_canary(row, entries.get(m.name, []), spec.gateway.enabled)
        st.rows.append(row)
        for rank, node in enumerate(m.placement[1:] if m.multi_node else [], start=1):
            w = WorkerRow(node.host, m.name, row.model, rank, list(node.gpus))
            _fill_worker(w, idx, reachable.get(node.host, False))
            st.workers.append(w)
        missing = [w.rank for w in st.workers if w.instance == m.name and w.state != "joined"]
        if missing and row.verdict == "serving":
            # vLLM needs every rank: a group with one missing is about to fail (or already has)
            row.verdict = "degraded"
            row.phase = "rank " + ", ".join(str(r) for r in missing) + " not joined"
    # a model's verdict is its stable instances' (a canary's never counts, serving or not)
    stable = [r for r in st.rows if r.role != "canary"]
    models = dict.fromkeys(r.model for r in stable)
    st.models_down = [x for x in models if not any(r.model == x and r.verdict == "serving" for r in stable)]
    rows = {r.instance: r for r in st.rows}
    st.rollouts = [
        RolloutStatus(r.model, r.canary.name, rows[r.canary.name].verdict, entries[r.canary.name])
        for r in spec.rollouts
        if entries.get(r.canary.name) and r.canary.name in rows
    ]
    if spec.gateway.admission:
        st.admission = True
        st.admission_up = idx.one("up", job=ADMISSION_JOB) == 1
        st.keys, st.keys_at_budget = _keys(idx)
    if spec.gateway_ha:
        st.virtual_address = spec.gateway.virtual_address
        st.gateways = [_gateway(idx, g, reachable.get(g, False)) for g in spec.gateway_hosts]
        st.holders = [g.host for g in st.gateways if g.holds]
        st.drained_on_some = _drained_on_some(st.gateways)
    if spec.monitoring_ha:
        st.monitoring = [_monitoring(idx, m) for m in spec.monitoring_hosts]
    return st


def _canary_gateways(idx: _Index, canary: str, now: float) -> list[CanaryGateway]:
    """Each gateway's entry for ``canary`` (by the gateway's host label): its share and the seconds left of its
    lease. None where no gateway reports one (no rollout runs)."""
    out: dict[str, CanaryGateway] = {}
    for lv, v in idx.find("vllm_fleet_gateway_canary_share", instance=canary):
        out.setdefault(lv.get("host", ""), CanaryGateway(lv.get("host", ""))).share = v
    for lv, v in idx.find("vllm_fleet_gateway_canary_lease_expiry_timestamp_seconds", instance=canary):
        out.setdefault(lv.get("host", ""), CanaryGateway(lv.get("host", ""))).lease_left = v - now
    return [out[h] for h in sorted(out)]


def _judge_canary(row: Row, gateways: list[CanaryGateway], gateway: bool) -> None:
    """A canary row: ``idle`` while it is not running (its launcher stopped, never started, or failed with no
    live lease on any gateway: its rollout stopped it), else judged as :func:`_fill` did. In rotation only
    through a gateway's live canary entry (its share), never the model's pool."""
    live = [g for g in gateways if g.live]
    if gateway and row.rotation != "drained":
        if live:
            row.rotation = f"canary {max(g.share or 0.0 for g in live):.0%}"
        elif row.rotation == "in":
            row.rotation = "out"
    if row.state in CANARY_IDLE_STATES or (row.state == "failed" and not live):
        row.verdict = "idle"
        if not row.phase:
            row.phase = "idle: runs only in vllm-fleet rollout"


def _up(idx: _Index, job: str, host: str) -> bool | None:
    up = idx.one("up", job=job, host=host)
    return None if up is None else up == 1


def _gateway(idx: _Index, host: str, exporter_up: bool) -> GatewayHostStatus:
    """A gateway's VRRP state from its exporter; ``unreachable`` when that is not scraped (a dead holder too:
    it holds nothing any more)."""
    g = GatewayHostStatus(host, nginx_up=_up(idx, NGINX_JOB, host))
    if not exporter_up:
        g.state = "unreachable"
        return g
    current = [lv["state"] for lv, v in idx.find("vllm_fleet_gateway_vrrp_state", host=host) if v == 1]
    g.state = current[0] if current else "UNKNOWN"
    g.holds = idx.one("vllm_fleet_gateway_vrrp_master", host=host) == 1
    g.since = idx.one("vllm_fleet_gateway_vrrp_state_since_timestamp_seconds", host=host) or None
    g.drained = sorted(
        lv.get("instance", "") for lv, v in idx.find("vllm_fleet_gateway_drained", host=host) if v == 1
    )
    return g


def _drained_on_some(gateways: list[GatewayHostStatus]) -> dict[str, list[str]]:
    """Instance → the gateways that drain it, for each instance that some reachable gateways drain and others
    do not."""
    seen = [g for g in gateways if g.drained is not None]
    out: dict[str, list[str]] = {}
    for inst in sorted({i for g in seen for i in g.drained or []}):
        on = [g.host for g in seen if inst in (g.drained or [])]
        if len(on) < len(seen):
            out[inst] = on
    return out


def _monitoring(idx: _Index, host: str) -> MonitoringHostStatus:
    members = idx.one("alertmanager_cluster_members", job=ALERTMANAGER_JOB, host=host)
    return MonitoringHostStatus(
        host,
        _up(idx, PROMETHEUS_JOB, host),
        _up(idx, ALERTMANAGER_JOB, host),
        None if members is None else int(members),
    )


def _keys(idx: _Index) -> tuple[list[KeyRow], list[KeyRow]]:
    """The busiest keys (most admitted in KEY_WINDOW, then most refused, in flight, queued) and the other
    keys at a budget. A key with nothing admitted, refused, in flight or queued is left out."""
    rows: dict[str, KeyRow] = {}

    def row(labels: dict[str, str]) -> KeyRow | None:
        key = labels.get("key", "")
        if not key:
            return None
        return rows.setdefault(key, KeyRow(key, labels.get("client", "")))

    for labels, v in idx.by_name.get("vllm_fleet_gateway_key_in_flight", []):
        if (r := row(labels)) is not None:
            r.in_flight = (r.in_flight or 0) + int(v)
    for labels, v in idx.by_name.get("vllm_fleet_gateway_key_queued", []):
        if (r := row(labels)) is not None:
            r.queued = (r.queued or 0) + int(v)
    for labels, v in idx.by_name.get("vllm_fleet_status_key_admitted", []):
        if (r := row(labels)) is not None:
            r.admitted += v
    for labels, v in idx.by_name.get("vllm_fleet_status_key_refused", []):
        if (r := row(labels)) is not None:
            r.refused += v
    for labels, v in idx.by_name.get("vllm_fleet_gateway_key_budget_used_ratio", []):
        if (r := row(labels)) is not None and v >= 1 and labels.get("budget", "") not in r.at_budget:
            r.at_budget.append(labels.get("budget", ""))
    active = [
        r for r in rows.values() if r.admitted > 0 or r.refused > 0 or r.in_flight or r.queued or r.at_budget
    ]
    active.sort(key=lambda r: (-r.admitted, -r.refused, -(r.in_flight or 0), -(r.queued or 0), r.key))
    for r in active:
        r.at_budget.sort()
    top = active[:TOP_KEYS]
    return top, [r for r in active[TOP_KEYS:] if r.at_budget]


def _fill_worker(w: WorkerRow, idx: _Index, host_up: bool) -> None:
    if not host_up:
        w.state, w.verdict = "unreachable", "down"
        return
    labels = {"instance": w.instance, "rank": str(w.rank), "host": w.host}
    current = [lv["state"] for lv, v in idx.find("vllm_fleet_worker_state", **labels) if v == 1]
    w.state = current[0] if current else "unknown"
    w.verdict = WORKER_VERDICTS.get(w.state, "down")
    w.since = idx.one("vllm_fleet_worker_state_since_timestamp_seconds", **labels) or None
    restarts = idx.one("vllm_fleet_worker_restarts_total", **labels)
    w.restarts = int(restarts) if restarts is not None else None


def _sleep(idx: _Index, instance: str) -> SleepStatus | None:
    """The sleep mode of ``instance`` from its exporter's sleep series; None where it has none (its model does not
    sleep)."""
    states = idx.find("vllm_fleet_instance_sleep_state", instance=instance)
    if not states:
        return None

    def whole(name: str) -> int | None:
        v = idx.one(name, instance=instance)
        return None if v is None else int(v)

    return SleepStatus(
        state=next((lv.get("state", "") for lv, v in states if v == 1), ""),
        level=whole("vllm_fleet_instance_sleep_level"),
        asleep_since=idx.one("vllm_fleet_instance_asleep_since_timestamp_seconds", instance=instance),
        wakes=whole("vllm_fleet_instance_wakes_total"),
        failed_wakes=whole("vllm_fleet_instance_failed_wakes_total"),
        last_wake_seconds=idx.one("vllm_fleet_instance_last_wake_seconds", instance=instance),
    )


def _fill(row: Row, idx: _Index, host_up: bool, gateway_seen: bool, gateway: bool) -> None:
    i = row.instance
    if gateway:
        drained = idx.one("vllm_fleet_gateway_drained", instance=i) == 1
        row.rotation = "drained" if drained else "in" if gateway_seen else "?"
    else:
        row.rotation = "-"
    if not host_up:
        row.state, row.phase, row.verdict = "unreachable", "the host's exporter is not scraped", "down"
        return
    current = [lv["state"] for lv, v in idx.find("vllm_fleet_instance_state", instance=i) if v == 1]
    row.state = current[0] if current else "unknown"
    stack = idx.find("vllm_fleet_instance_stack_info", instance=i)
    row.stack = stack[0][0].get("stack", "") if stack else ""
    info = idx.find("vllm_fleet_instance_phase_info", instance=i)
    if info:
        row.phase = info[0][0].get("reason") or info[0][0].get("phase", "")
    ready = idx.one("vllm_fleet_instance_ready_timestamp_seconds", instance=i)
    row.ready_since = ready if ready else None
    restarts = idx.one("vllm_fleet_instance_restarts_total", instance=i)
    row.restarts = int(restarts) if restarts is not None else None
    ok = idx.one("vllm_fleet_probe_success", instance=i)
    row.probe_ok = None if ok is None else ok == 1
    row.probe_latency = idx.one("vllm_fleet_probe_latency_seconds", instance=i)
    engine_up = idx.one("up", job=ENGINE_JOB, instance=i) == 1
    running = idx.total("vllm:num_requests_running", job=ENGINE_JOB, instance=i)
    waiting = idx.total("vllm:num_requests_waiting", job=ENGINE_JOB, instance=i)
    row.running = int(running) if running is not None else None
    row.waiting = int(waiting) if waiting is not None else None
    kv = [v for _, v in idx.find("vllm:kv_cache_usage_perc", job=ENGINE_JOB, instance=i)]
    row.kv_cache = max(kv) if kv else None
    row.sleep = _sleep(idx, i)
    for lv, v in sorted(
        idx.find("vllm_fleet_instance_adapter_loaded", instance=i), key=lambda s: s[0]["adapter"]
    ):
        (row.adapters if v == 1 else row.adapters_missing).append(lv["adapter"])
    if row.state == "ready" and row.adapters_missing and row.probe_ok is not False:
        # it serves its base model, but requests for an adapter it carries go elsewhere (or fail)
        row.verdict = "degraded"
        row.phase = "adapter " + ", ".join(row.adapters_missing) + " not loaded"
    elif row.state == "ready" and engine_up and row.probe_ok is not False and row.rotation != "drained":
        row.verdict = "serving"
    elif row.state in ("loading", "draining") or (row.state == "ready" and (engine_up or row.probe_ok)):
        row.verdict = "degraded"
        if row.state == "ready" and row.rotation == "drained":
            row.phase = "drained at the gateway"
        elif row.state == "ready" and row.probe_ok is False:
            row.phase = "probe failing"
        elif row.state == "ready":
            row.phase = "engine not scraped"
    else:
        row.verdict = "down"


# ------------------------------------------------------------------------------------------------ showing

_COLOURS = {"serving": "\x1b[32m", "degraded": "\x1b[33m", "down": "\x1b[31m", "idle": "\x1b[2m"}
_COLUMNS = (
    "HOST",
    "INSTANCE",
    "MODEL",
    "GPUS",
    "STATE",
    "SINCE",
    "RESTARTS",
    "PROBE",
    "RUN/WAIT",
    "KV",
    "GATEWAY",
    "STACK",
)


def _age(ts: float | None, now: float) -> str:
    if not ts:
        return "-"
    s = max(0, int(now - ts))
    if s >= 86400:
        return f"{s // 86400}d{s % 86400 // 3600}h"
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60}m"
    return f"{s // 60}m{s % 60}s"


def table(st: FleetStatus, colour: bool = False) -> str:
    lines: list[list[str]] = []
    verdicts: list[str] = []
    for r in st.rows:
        # an engine that sleeps: its sleep state tells what its launcher's phase would (asleep, waking)
        sleeping = r.sleep is not None and r.state in SLEEP_SHOWN_STATES
        phase = (
            bool(r.phase)
            and r.phase not in ("serving", r.state)
            and not (sleeping and r.verdict == "serving")
        )
        state = r.state + (f" ({r.phase})" if phase else "")
        if sleeping and r.sleep is not None:
            state += " · " + sleep_text(r.sleep, st.at)
        probe = "-" if r.probe_ok is None else ("ok" if r.probe_ok else "FAIL")
        if r.probe_ok is not None and r.probe_latency is not None:
            probe += f" {r.probe_latency * 1000:.0f}ms"
        load = "-" if r.running is None else f"{r.running}/{r.waiting if r.waiting is not None else '-'}"
        kv = "-" if r.kv_cache is None else f"{r.kv_cache:.0%}"
        gpus = ",".join(str(g) for g in r.gpus) or "-"
        role = "" if r.role == "primary" else f" [{r.role}]"
        lines.append(
            [
                r.host,
                r.instance + role,
                r.model,
                gpus,
                state,
                _age(r.ready_since, st.at) if r.state == "ready" else "-",
                "-" if r.restarts is None else str(r.restarts),
                probe,
                load,
                kv,
                r.rotation,
                r.stack or "-",
            ]
        )
        verdicts.append(r.verdict)
        for w in (w for w in st.workers if w.instance == r.instance):
            lines.append(
                [
                    w.host,
                    f"{w.instance} [rank {w.rank}]",
                    w.model,
                    ",".join(str(g) for g in w.gpus) or "-",
                    w.state,
                    _age(w.since, st.at),
                    "-" if w.restarts is None else str(w.restarts),
                    *["-"] * 5,
                ]
            )
            verdicts.append(w.verdict)
    widths = [
        max(len(c), *(len(row[k]) for row in lines)) if lines else len(c) for k, c in enumerate(_COLUMNS)
    ]
    out = ["  ".join(c.ljust(widths[k]) for k, c in enumerate(_COLUMNS)).rstrip()]
    for row, verdict in zip(lines, verdicts, strict=True):
        text = "  ".join(c.ljust(widths[k]) for k, c in enumerate(row)).rstrip()
        out.append(f"{_COLOURS[verdict]}{text}\x1b[0m" if colour else text)
    for h in st.hosts:
        if not h.reachable:
            out.append(
                f"host {h.name}: unreachable (its exporter is not scraped by {st.prometheus or 'Prometheus'})"
            )
        elif h.drift:
            out.append(f"host {h.name}: deployed spec {h.deployed_spec}, this spec is {st.spec_hash} (drift)")
        elif not h.deployed_spec and h.engines:
            out.append(f"host {h.name}: no deployment manifest exported (spec drift unknown)")
    out += _adapter_lines(st)
    out += _sleep_lines(st)
    out += _rollout_lines(st)
    out += _ha_lines(st)
    if st.admission:
        out += _keys_table(st)
    serving = sum(r.verdict == "serving" for r in st.rows)
    idle = sum(r.verdict == "idle" for r in st.rows)
    summary = f"{serving}/{len(st.rows) - idle} instances serving"
    if idle:
        summary += f", {idle} canar{'y' if idle == 1 else 'ies'} idle"
    if st.workers:
        joined = sum(w.state == "joined" for w in st.workers)
        summary += f", {joined}/{len(st.workers)} multi-node workers joined"
    if st.models_down:
        summary += "; no serving instance for " + ", ".join(st.models_down)
    out.append(summary + f" (fleet {st.fleet}, spec {st.spec_hash})")
    return "\n".join(out)


SLEEP_SHOWN_STATES = ("ready", "draining")  # launcher states whose row shows the engine's sleep state


def sleep_text(s: SleepStatus, now: float) -> str:
    """The sleep state for the STATE column: ``asleep L1 12m0s`` (level, for how long), ``waking``, ``awake``."""
    if s.state != "asleep":
        return s.state or "?"
    return (
        "asleep"
        + (f" L{s.level}" if s.level else "")
        + (f" {_age(s.asleep_since, now)}" if s.asleep_since else "")
    )


def _sleep_lines(st: FleetStatus) -> list[str]:
    """A "Sleep" line per instance whose model sleeps: its state and level, wakes, failed wakes, the last wake's
    duration."""
    out = []
    for r in st.rows:
        s = r.sleep
        if s is None:
            continue
        state = s.state or "?"
        if s.state == "asleep" and s.asleep_since:
            state += f" for {_age(s.asleep_since, st.at)}"
        line = f"Sleep {r.instance}: {state}" + (f" (level {s.level})" if s.level else "")
        line += "; wakes " + ("?" if s.wakes is None else str(s.wakes))
        line += ", failed " + ("?" if s.failed_wakes is None else str(s.failed_wakes))
        if s.last_wake_seconds is not None:
            line += f", last wake {s.last_wake_seconds:.2f}s"
        out.append(line)
    return out


def _adapter_lines(st: FleetStatus) -> list[str]:
    """An "Adapters" line per instance that carries LoRA adapters: those its engine has loaded, and those it
    should carry but has not (``vllm_fleet_instance_adapter_loaded``)."""
    out = []
    for r in st.rows:
        if r.adapters or r.adapters_missing:
            line = f"Adapters {r.instance}: " + (", ".join(r.adapters) or "none") + " loaded"
            if r.adapters_missing:
                line += "; NOT LOADED: " + ", ".join(r.adapters_missing)
            out.append(line)
    return out


def _rollout_lines(st: FleetStatus) -> list[str]:
    """A "Rollout" line per served model whose canary a gateway has an entry for: its share on each gateway and
    the seconds left of its lease there."""

    def entry(g: CanaryGateway) -> str:
        if not g.live:
            return f"{g.host or '?'}: lease expired: out of rotation"
        text = f"{g.host or '?'}: share " + ("?" if g.share is None else f"{g.share:.0%}")
        return text + ("" if g.lease_left is None else f", lease {g.lease_left:.0f}s left")

    return [
        f"Rollout {r.model}: canary {r.canary} ({r.verdict}); " + "; ".join(entry(g) for g in r.gateways)
        for r in st.rollouts
    ]


def _ha_lines(st: FleetStatus) -> list[str]:
    """Who holds the virtual address (two or more gateways), each monitoring host's Prometheus and Alertmanager
    (two or more monitoring hosts), and the Prometheus servers that did not answer before the one read."""
    out: list[str] = []
    if st.gateways:

        def gateway(g: GatewayHostStatus) -> str:
            if g.state == "unreachable":
                return f"{g.host} unreachable (its exporter is not scraped)"
            text = f"{g.host} {g.state}" + (f" for {_age(g.since, st.at)}" if g.since else "")
            return text + (" (nginx exporter not scraped)" if g.nginx_up is False else "")

        if len(st.holders) == 1:
            held = f"held by {st.holders[0]}"
        elif not st.holders:
            held = "HELD BY NO GATEWAY"
        else:
            held = f"HELD BY {len(st.holders)} GATEWAYS: {', '.join(st.holders)} (split brain)"
        out.append(
            f"gateway address {st.virtual_address}: {held}; " + ", ".join(gateway(g) for g in st.gateways)
        )
        seen = [g.host for g in st.gateways if g.drained is not None]
        for inst, on in st.drained_on_some.items():
            off = [h for h in seen if h not in on]
            out.append(
                f"instance {inst}: drained on {', '.join(on)}, NOT on {', '.join(off)} (a drain or undrain did not "
                f"reach every gateway: rerun `vllm-fleet drain {inst}` or `undrain {inst}` on a gateway host)"
            )

    def up(v: bool | None) -> str:
        return "up" if v else "not scraped" if v is None else "DOWN"

    for m in st.monitoring:
        line = f"monitoring {m.host}: Prometheus {up(m.prometheus_up)}, Alertmanager {up(m.alertmanager_up)}"
        if m.cluster_members is not None:
            line += f" (cluster of {m.cluster_members}/{len(st.monitoring)})"
        out.append(line)
    if st.prometheus_errors:
        out.append(f"read from Prometheus at {st.prometheus}; before it: " + "; ".join(st.prometheus_errors))
    return out


_KEY_COLUMNS = (
    "KEY",
    "CLIENT",
    "IN-FLIGHT",
    "QUEUED",
    f"ADMITTED({KEY_WINDOW})",
    f"REFUSED({KEY_WINDOW})",
    "AT BUDGET",
)


def _keys_table(st: FleetStatus) -> list[str]:
    """The "Top keys" section: the busiest keys, then a line for each other key at a budget."""
    if not st.admission_up:
        return [
            "gateway admission service: not scraped (per-key figures unknown; VllmFleetGatewayAdmissionDown)"
        ]
    if not st.keys:
        return [f"Top keys: no key admitted, refused, in flight or queued in the last {KEY_WINDOW}"]

    def num(v: float | None) -> str:
        return "-" if v is None else f"{v:.0f}"

    lines = [
        [r.key, r.client or "-", num(r.in_flight), num(r.queued), num(r.admitted), num(r.refused),
         ",".join(r.at_budget) or "-"]
        for r in st.keys
    ]  # fmt: skip
    widths = [max(len(c), *(len(row[k]) for row in lines)) for k, c in enumerate(_KEY_COLUMNS)]
    out = [f"Top keys (gateway admission, last {KEY_WINDOW}):"]
    out += [
        "  ".join(c.ljust(widths[k]) for k, c in enumerate(row)).rstrip() for row in [_KEY_COLUMNS, *lines]
    ]
    out += [
        f"key {r.key} (client {r.client or '-'}): at its {', '.join(r.at_budget)} budget"
        for r in st.keys_at_budget
    ]
    return out


# ------------------------------------------------------------------------------------------------ command


def _auth(a: argparse.Namespace, spec: FleetSpec) -> tuple[str, str] | None:
    """Basic auth for Prometheus: ``--prometheus-user`` or the spec's ``monitoring.web_user`` (when
    ``web_auth``); the password from ``$VLLM_FLEET_PROMETHEUS_PASSWORD``, ``--prometheus-password-file``, or
    the spec's ``monitoring.web_password_file`` where it is readable (on the monitoring host)."""
    mon = spec.monitoring
    user = a.prometheus_user or (mon.web_user if mon.web_auth else "")
    if not user:
        return None
    password = os.environ.get("VLLM_FLEET_PROMETHEUS_PASSWORD", "")
    for path in (a.prometheus_password_file, "" if password else mon.web_password_file):
        if path and os.access(path, os.R_OK):
            with open(path) as f:
                password = f.read().strip()
            break
        if path and path == a.prometheus_password_file:
            raise StatusError(f"cannot read the password file {path}")
    return (user, password) if password else None


def run(a: argparse.Namespace, spec: FleetSpec) -> int:
    urls = [a.prometheus] if a.prometheus else prometheus_urls(spec)
    colour = sys.stdout.isatty() and not os.environ.get("NO_COLOR") and not a.json
    while True:
        try:
            url, samples, errors = ask(spec, urls, _auth(a, spec))
            st = judge(spec, samples, url)
            st.prometheus_errors = errors
        except StatusError as exc:
            if a.json:
                print(json.dumps({"fleet": spec.name, "error": str(exc), "exit_code": EXIT_UNREACHABLE}))
            else:
                print(f"vllm-fleet status: {exc}", file=sys.stderr)
            code = EXIT_UNREACHABLE
            if not a.watch:
                return code
        else:
            code = st.exit_code
            if a.json:
                print(json.dumps(st.to_dict(), indent=None if a.watch else 2))
            else:
                if a.watch and sys.stdout.isatty():
                    print("\x1b[H\x1b[2J", end="")
                print(table(st, colour))
            if not a.watch:
                return code
        sys.stdout.flush()
        time.sleep(a.watch)
