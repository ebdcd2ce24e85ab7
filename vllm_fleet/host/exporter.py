"""``vllm-fleet exporter``: the host exporter (prometheus-client) that Prometheus scrapes on every host.

Per instance it exports the launcher's state file (``{state_dir}/{name}.json``: loading / ready / draining /
failed / stopped, probe latency and failures, load duration), the unit's restart count (systemd
``NRestarts`` of ``vllm@NAME.service`` when systemd runs) and, for a multi-node instance, its group size;
per headless rank of a multi-node instance on this host, the worker's state file
(``{state_dir}/workers/{name}.json``: waiting / joined / rank0_gone / exited) and the restart count of
``vllm-worker@NAME.service``; NVML GPU metrics (nvidia-ml-py: utilisation,
memory, temperature, power, ECC, XID) when the host has NVIDIA GPUs, and — on the gateway host — request
counts by model and status code from the gateway's JSON access log (the nginx exporter has no status codes).

Everything is read at scrape time (no background state) except the access log, which is tailed
incrementally on each scrape, and NVML XID events, which a thread collects.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from vllm_fleet.contracts import MANIFEST_PATH as MANIFEST_FILE
from vllm_fleet.contracts import (
    WORKER_STATE_SUBDIR,
    WORKER_STATES,
    ContractError,
    StateFile,
    WorkerStateFile,
    read_state,
    read_worker_state,
)
from vllm_fleet.files import read_json_object
from vllm_fleet.host.drain import STATE_FILE as DRAIN_STATE_FILE

log = logging.getLogger("vllm_fleet.host.exporter")

STATES = ("loading", "ready", "draining", "failed", "stopped")
# gateway request duration buckets (seconds): interactive up to long generations
DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
PREFIX = "vllm_fleet_"
# how often a systemd read failure that goes on is logged again (seconds)
SYSTEMD_LOG_EVERY = 600.0


# --------------------------------------------------------------------------- instances


@dataclass
class Instance:
    name: str
    model: str = ""
    port: int | None = None
    state: StateFile | None = None
    nnodes: int = 1  # the instance config's: hosts the engine group spans


def _configs(config_dir: Path | None) -> tuple[list[tuple[str, dict[str, Any]]], int]:
    """``(name, config)`` of every ``*.json`` config in ``config_dir`` (name: its ``name`` or the file's stem),
    and how many could not be read."""
    found: list[tuple[str, dict[str, Any]]] = []
    errors = 0
    if config_dir is not None and config_dir.is_dir():
        for p in sorted(config_dir.glob("*.json")):
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
        found[name] = Instance(
            name,
            str(cfg.get("served_model_name") or name),
            cfg.get("port"),
            nnodes=nnodes if isinstance(nnodes, int) and not isinstance(nnodes, bool) else 1,
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
        if st.get("state") in ("waiting", "joined") and isinstance(pid, int) and not _alive(pid):
            # killed (SIGKILL at a stop timeout, the OOM killer): it could not write its last state
            st = {**st, "state": "exited", "reason": "the worker process is gone"}
        w.state = st
        w.model = w.model or str(st.get("served_model_name") or name)
        w.rank = w.rank if w.rank is not None else st.get("rank")
    return sorted(found.values(), key=lambda w: w.name), cfg_errors + st_errors


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists (any user's: EPERM means it does)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def systemd_available() -> bool:
    return Path("/run/systemd/system").is_dir() and shutil.which("systemctl") is not None


class SystemdReadError(RuntimeError):
    """``systemctl show`` could not answer (the message says how): the restart series are missing meanwhile."""


def unit_restarts(names: list[str], template: str = "vllm") -> dict[str, int]:
    """``NRestarts`` of ``TEMPLATE@NAME.service`` (``vllm@``, ``vllm-worker@``) per instance name (one
    systemctl call for all). Raises :class:`SystemdReadError` when systemctl fails: as an unprivileged user it
    asks PID 1 over the system bus, and dbus-daemon refuses a caller whose uid it cannot resolve (a
    ``DynamicUser=`` without nss-systemd: ``Transport endpoint is not connected``)."""
    if not names:
        return {}
    units = [f"{template}@{n}.service" for n in names]
    cmd = ["systemctl", "show", "--property=Id,NRestarts", *units]
    try:
        cp = subprocess.run(cmd, capture_output=True, text=True, timeout=5, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SystemdReadError(f"{' '.join(cmd[:3])}: {exc}") from None
    if cp.returncode != 0:
        why = " ".join(cp.stderr.split()) or f"exit status {cp.returncode}"
        raise SystemdReadError(f"{' '.join(cmd[:3])}: {why}")
    result: dict[str, int] = {}
    for block in cp.stdout.strip().split("\n\n"):
        props = dict(line.split("=", 1) for line in block.splitlines() if "=" in line)
        unit, value = props.get("Id", ""), props.get("NRestarts", "")
        if unit.startswith(f"{template}@") and value.isdigit():
            result[unit.removeprefix(f"{template}@").removesuffix(".service")] = int(value)
    return result


# --------------------------------------------------------------------------- gateway access log


@dataclass
class _ModelStats:
    codes: dict[str, int] = field(default_factory=dict)
    retried: int = 0
    buckets: list[int] = field(default_factory=lambda: [0] * len(DURATION_BUCKETS))
    count: int = 0
    total_seconds: float = 0.0


class AccessLogTail:
    """Follows the gateway's JSON access log (one object per line: status, model, upstream_addr,
    request_time — nginx/vllm-fleet.conf.j2's ``vf_json``). Counts what is written after it was created, survives
    rotation (new inode or truncation), keeps counters for the exporter's lifetime."""

    def __init__(self, path: Path, from_start: bool = False) -> None:
        self.path = path
        self._buf = b""
        self.stats: dict[str, _ModelStats] = {}
        self.bad_lines = 0
        self._lock = threading.Lock()
        # lines written from now on count; a file that appears later is read from its start
        try:
            st = path.stat()
            self._inode, self._pos = st.st_ino, 0 if from_start else st.st_size
        except OSError:
            self._inode, self._pos = -1, 0

    def poll(self) -> None:
        with self._lock:
            try:
                st = self.path.stat()
            except OSError:
                return
            if st.st_ino != self._inode or st.st_size < self._pos:
                self._inode, self._pos, self._buf = st.st_ino, 0, b""
            if st.st_size == self._pos:
                return
            with self.path.open("rb") as f:
                f.seek(self._pos)
                data = f.read(st.st_size - self._pos)
            self._pos += len(data)
            lines = (self._buf + data).split(b"\n")
            self._buf = lines.pop()
            for line in lines:
                if line.strip():
                    self._count(line)

    def _count(self, line: bytes) -> None:
        try:
            rec = json.loads(line)
            code = str(int(rec["status"]))
        except (ValueError, KeyError, TypeError):
            self.bad_lines += 1
            return
        model = str(rec.get("model") or "") or "none"
        s = self.stats.setdefault(model, _ModelStats())
        s.codes[code] = s.codes.get(code, 0) + 1
        if "," in str(rec.get("upstream_addr") or ""):
            s.retried += 1
        try:
            seconds = float(rec.get("request_time", 0.0))
        except (TypeError, ValueError):
            seconds = 0.0
        s.count += 1
        s.total_seconds += seconds
        for n, bound in enumerate(DURATION_BUCKETS):
            if seconds <= bound:
                s.buckets[n] += 1

    def metrics(self) -> Iterator[Metric]:
        self.poll()
        req = CounterMetricFamily(
            PREFIX + "gateway_requests",
            "Gateway requests by model and HTTP status (access log)",
            labels=["model", "code"],
        )
        retried = CounterMetricFamily(
            PREFIX + "gateway_upstream_retries",
            "Gateway requests that tried more than one upstream server (failover before the first byte)",
            labels=["model"],
        )
        dur = HistogramMetricFamily(
            PREFIX + "gateway_request_duration_seconds", "Gateway request time (access log)", labels=["model"]
        )
        with self._lock:
            for model, s in sorted(self.stats.items()):
                for code, n in sorted(s.codes.items()):
                    req.add_metric([model, code], n)
                retried.add_metric([model], s.retried)
                cum = [(str(b), float(c)) for b, c in zip(DURATION_BUCKETS, s.buckets, strict=True)] + [
                    ("+Inf", float(s.count))
                ]
                dur.add_metric([model], cum, s.total_seconds)
            bad = self.bad_lines
        yield req
        yield retried
        yield dur
        yield CounterMetricFamily(
            PREFIX + "gateway_log_bad_lines", "Access log lines that were not JSON", value=bad
        )


# --------------------------------------------------------------------------- NVML


class Nvml:
    """GPU metrics through nvidia-ml-py. ``available`` is False on hosts without a driver or GPU."""

    def __init__(self) -> None:
        self.available = False
        self.xids: dict[tuple[int, int], int] = {}
        self._lock = threading.Lock()
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nv = pynvml
            self.count = int(pynvml.nvmlDeviceGetCount())
            self.driver = _s(pynvml.nvmlSystemGetDriverVersion())
            self.available = self.count > 0
        except Exception as exc:  # no library, no driver, no GPU: all mean "no GPU metrics"
            log.info("NVML not available: %s", exc)
            return
        threading.Thread(target=self._xid_events, name="nvml-xid", daemon=True).start()

    def _xid_events(self) -> None:
        nv = self.nv
        try:
            es = nv.nvmlEventSetCreate()
            handles = {}
            for i in range(self.count):
                h = nv.nvmlDeviceGetHandleByIndex(i)
                try:
                    nv.nvmlDeviceRegisterEvents(h, nv.nvmlEventTypeXidCriticalError, es)
                    handles[i] = nv.nvmlDeviceGetUUID(h)
                except nv.NVMLError as exc:
                    log.info("XID events not supported on GPU %d: %s", i, exc)
            if not handles:
                return
            uuid_to_index = {_s(u): i for i, u in handles.items()}
            while True:
                try:
                    data = nv.nvmlEventSetWait_v2(es, 5000)
                except nv.NVMLError_Timeout:
                    continue
                idx = uuid_to_index.get(_s(nv.nvmlDeviceGetUUID(data.device)), -1)
                with self._lock:
                    key = (idx, int(data.eventData))
                    self.xids[key] = self.xids.get(key, 0) + 1
        except Exception as exc:  # the thread must not die silently
            log.warning("XID event thread stopped: %s", exc)

    def metrics(self) -> Iterator[Metric]:
        nv = self.nv
        labels = ["gpu", "uuid"]
        info = GaugeMetricFamily(
            PREFIX + "gpu_info", "GPU model and driver", labels=[*labels, "name", "driver"]
        )
        util = GaugeMetricFamily(
            PREFIX + "gpu_utilization_ratio", "GPU busy time ratio (NVML)", labels=labels
        )
        mem_util = GaugeMetricFamily(
            PREFIX + "gpu_memory_bandwidth_utilization_ratio", "GPU memory busy ratio (NVML)", labels=labels
        )
        used = GaugeMetricFamily(PREFIX + "gpu_memory_used_bytes", "GPU memory used", labels=labels)
        total = GaugeMetricFamily(PREFIX + "gpu_memory_total_bytes", "GPU memory total", labels=labels)
        temp = GaugeMetricFamily(PREFIX + "gpu_temperature_celsius", "GPU temperature", labels=labels)
        power = GaugeMetricFamily(PREFIX + "gpu_power_watts", "GPU power draw", labels=labels)
        limit = GaugeMetricFamily(PREFIX + "gpu_power_limit_watts", "GPU enforced power limit", labels=labels)
        ecc = CounterMetricFamily(
            PREFIX + "gpu_ecc_errors",
            "ECC errors since the driver loaded (volatile)",
            labels=[*labels, "type"],
        )
        xid = CounterMetricFamily(
            PREFIX + "gpu_xid_errors", "XID critical errors seen", labels=[*labels, "xid"]
        )
        uuids: dict[int, str] = {}
        for i in range(self.count):
            try:
                h = nv.nvmlDeviceGetHandleByIndex(i)
                uuid = _s(nv.nvmlDeviceGetUUID(h))
            except nv.NVMLError:
                continue
            uuids[i] = uuid
            lv = [str(i), uuid]
            info.add_metric([*lv, _s(nv.nvmlDeviceGetName(h)), self.driver], 1)
            rates = _q(nv.nvmlDeviceGetUtilizationRates, h)
            if rates is not None:
                util.add_metric(lv, rates.gpu / 100.0)
                mem_util.add_metric(lv, rates.memory / 100.0)
            # v2 excludes driver-reserved memory, like nvidia-smi (v1 "used" counts it: ~0.6 GiB more on an H200)
            mem = (
                _q(nv.nvmlDeviceGetMemoryInfo, h, nv.nvmlMemory_v2) if hasattr(nv, "nvmlMemory_v2") else None
            )
            mem = mem or _q(nv.nvmlDeviceGetMemoryInfo, h)
            if mem is not None:
                used.add_metric(lv, float(mem.used))
                total.add_metric(lv, float(mem.total))
            for fam, value, scale in (
                (temp, _q(nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU), 1.0),
                (power, _q(nv.nvmlDeviceGetPowerUsage, h), 1000.0),
                (limit, _q(nv.nvmlDeviceGetEnforcedPowerLimit, h), 1000.0),
            ):
                if value is not None:
                    fam.add_metric(lv, float(value) / scale)
            for kind, etype in (
                ("corrected", nv.NVML_MEMORY_ERROR_TYPE_CORRECTED),
                ("uncorrected", nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED),
            ):
                n = _q(nv.nvmlDeviceGetTotalEccErrors, h, etype, nv.NVML_VOLATILE_ECC)
                if n is not None:
                    ecc.add_metric([*lv, kind], float(n))
        with self._lock:
            for (idx, code), n in sorted(self.xids.items()):
                xid.add_metric([str(idx), uuids.get(idx, ""), str(code)], n)
        yield from (info, util, mem_util, used, total, temp, power, limit, ecc, xid)


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


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _q(fn: Any, *args: Any) -> Any:
    """One NVML query; None when the GPU does not support it (NotSupported, NoPermission ...)."""
    try:
        return fn(*args)
    except Exception as exc:  # any NVMLError subclass
        log.debug("NVML query %s skipped: %s", getattr(fn, "__name__", fn), exc)
        return None


# --------------------------------------------------------------------------- collector


class FleetCollector(Collector):
    def __init__(
        self,
        state_dir: Path,
        config_dir: Path | None = None,
        access_log: AccessLogTail | None = None,
        nvml: Nvml | None = None,
        use_systemd: bool | None = None,
        drain_state: Path | None = None,
        manifest: Path | None = None,
        worker_config_dir: Path | None = None,
    ) -> None:
        self.state_dir = state_dir
        self.config_dir = config_dir
        self.worker_config_dir = worker_config_dir
        self.access_log = access_log
        self.nvml = nvml
        self.drain_state = drain_state
        self.manifest = manifest
        self.use_systemd = systemd_available() if use_systemd is None else use_systemd
        # failed systemd reads since the exporter started (a counter), and what was last logged about them
        self.systemd_errors = 0
        self._systemd_lock = threading.Lock()
        self._systemd_logged: tuple[str, float] | None = None

    def _restarts(self, names: list[str], template: str) -> dict[str, int]:
        """:func:`unit_restarts`, counting and logging a failure instead of dropping the series silently
        (logged when the reason changes, again every ``SYSTEMD_LOG_EVERY`` seconds while it lasts, and when
        the reads work again)."""
        try:
            restarts = unit_restarts(names, template)
        except SystemdReadError as exc:
            with self._systemd_lock:
                self.systemd_errors += 1
                now, msg = time.monotonic(), str(exc)
                last = self._systemd_logged
                if last is None or last[0] != msg or now - last[1] >= SYSTEMD_LOG_EVERY:
                    self._systemd_logged = (msg, now)
                    log.warning(
                        "cannot read restart counts (NRestarts) from systemd, %d failed reads so far; no "
                        "vllm_fleet_instance_restarts_total / vllm_fleet_worker_restarts_total series meanwhile: %s",
                        self.systemd_errors,
                        msg,
                    )
            return {}
        with self._systemd_lock:
            if self._systemd_logged is not None and names:
                self._systemd_logged = None
                log.info("restart counts are read from systemd again")
        return restarts

    def collect(self) -> Iterable[Metric]:
        started = time.monotonic()
        instances, errors = read_instances(self.state_dir, self.config_dir)
        workers, worker_errors = read_workers(self.state_dir, self.worker_config_dir)
        errors += worker_errors
        yield from self._instance_metrics(instances)
        yield from self._worker_metrics(workers)
        if self.use_systemd:
            restarts = self._restarts([i.name for i in instances], "vllm")
            fam = CounterMetricFamily(
                PREFIX + "instance_restarts",
                "Automatic restarts of vllm@NAME.service (systemd NRestarts)",
                labels=["instance", "model", "unit"],
            )
            for i in instances:
                if i.name in restarts:
                    fam.add_metric([i.name, i.model, f"vllm@{i.name}.service"], restarts[i.name])
            yield fam
            if workers:
                restarts = self._restarts([w.name for w in workers], "vllm-worker")
                wfam = CounterMetricFamily(
                    PREFIX + "worker_restarts",
                    "Automatic restarts of vllm-worker@NAME.service, a multi-node rank > 0 (systemd NRestarts)",
                    labels=["instance", "model", "rank", "unit"],
                )
                for w in workers:
                    if w.name in restarts:
                        unit = f"vllm-worker@{w.name}.service"
                        wfam.add_metric([w.name, w.model, _rank(w), unit], restarts[w.name])
                yield wfam
            yield CounterMetricFamily(
                PREFIX + "exporter_systemd_errors",
                "Reads of unit properties from systemd (systemctl show NRestarts) that failed since the exporter "
                "started; the restart series are missing while they fail (the reason is in its journal)",
                value=self.systemd_errors,
            )
        if self.access_log is not None:
            yield from self.access_log.metrics()
        yield from self._deployment_metrics()
        if self.nvml is not None and self.nvml.available:
            yield from self.nvml.metrics()
        yield CounterMetricFamily(
            PREFIX + "exporter_read_errors", "State/config files that could not be read", value=errors
        )
        yield GaugeMetricFamily(
            PREFIX + "exporter_scrape_duration_seconds",
            "Time this scrape took",
            value=time.monotonic() - started,
        )

    def _deployment_metrics(self) -> Iterator[Metric]:
        """What was deployed here (the manifest ``vllm-fleet manifest`` writes) and, on the gateway host, which
        instances are out of rotation (the drain state file ``vllm-fleet drain`` writes)."""
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

    def _instance_metrics(self, instances: list[Instance]) -> Iterator[Metric]:
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
            current = st.get("state")
            for s in STATES:
                state.add_metric([*lv, s], 1 if current == s else 0)
            for fam, key, value in fams:
                v = value(st.get(key))
                if v is not None:
                    fam.add_metric(lv, v)
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

    def _worker_metrics(self, workers: list[Worker]) -> Iterator[Metric]:
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
            lv = [w.name, w.model, _rank(w)]
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


def _rank(w: Worker) -> str:
    return "" if w.rank is None else str(w.rank)


def build_registry(args: argparse.Namespace) -> CollectorRegistry:
    registry = CollectorRegistry()
    tail = (
        AccessLogTail(Path(args.access_log), from_start=args.access_log_from_start)
        if args.access_log
        else None
    )
    nvml = None if args.no_nvml else Nvml()
    registry.register(
        FleetCollector(
            Path(args.state_dir),
            Path(args.config_dir) if args.config_dir else None,
            tail,
            nvml,
            drain_state=Path(args.drain_state) if args.drain_state else None,
            manifest=Path(args.manifest) if args.manifest else None,
            worker_config_dir=Path(args.worker_config_dir) if args.worker_config_dir else None,
        )
    )
    return registry


def _run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    registry = build_registry(args)
    if args.once:
        print(generate_latest(registry).decode(), end="")
        return 0
    addr, _, port = args.listen.rpartition(":")
    server, thread = start_http_server(int(port), addr=addr or "0.0.0.0", registry=registry)
    log.info("serving metrics on http://%s:%s/metrics", addr or "0.0.0.0", port)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.shutdown()
    thread.join(5)
    return 0


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--listen", default="127.0.0.1:9400", help="ADDRESS:PORT to serve /metrics on")
    p.add_argument(
        "--state-dir",
        default="/run/vllm-fleet",
        help="launcher state files (*.json), workers' (workers/*.json)",
    )
    p.add_argument("--config-dir", default="/etc/vllm-fleet/instances", help="instance configs (*.json)")
    p.add_argument(
        "--worker-config-dir",
        default="/etc/vllm-fleet/workers",
        help="configs of this host's multi-node workers, ranks > 0 (*.json)",
    )
    p.add_argument(
        "--access-log", default=os.environ.get("VLLM_FLEET_ACCESS_LOG", ""), help="gateway JSON access log"
    )
    p.add_argument("--access-log-from-start", action="store_true", help="count the existing log too (tests)")
    p.add_argument("--no-nvml", action="store_true", help="do not export GPU metrics")
    p.add_argument(
        "--drain-state", default=DRAIN_STATE_FILE, help="the gateway's drained-set file (on the gateway host)"
    )
    p.add_argument("--manifest", default=MANIFEST_FILE, help="the deployment manifest of this host")
    p.add_argument("--once", action="store_true", help="print the metrics once and exit")
    p.set_defaults(handler=_run)
