"""Restart counts from systemd: ``NRestarts`` of ``vllm@NAME.service`` per instance and of
``vllm-worker@NAME.service`` per multi-node worker on this host (one ``systemctl show`` per template and scrape),
and a counter of the reads that failed (the restart series are missing meanwhile; the journal says why)."""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from vllm_fleet.host.exporter.common import PREFIX, log
from vllm_fleet.host.exporter.states import Instance, StateFiles, Worker, rank_label

# how often a systemd read failure that goes on is logged again (seconds)
SYSTEMD_LOG_EVERY = 600.0


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


class SystemdRestarts(Collector):
    """The restart series of the instances and workers :class:`StateFiles` knows, and the failed-read counter
    (kept for the exporter's lifetime). Standalone, ``collect`` reads the state files itself; the exporter's
    :class:`~vllm_fleet.host.exporter.registry.FleetCollector` hands it the scrape's reading instead."""

    def __init__(self, states: StateFiles) -> None:
        self.states = states
        # failed systemd reads since the exporter started (a counter), and what was last logged about them
        self.errors = 0
        self._lock = threading.Lock()
        self._logged: tuple[str, float] | None = None

    def _restarts(self, names: list[str], template: str) -> dict[str, int]:
        """:func:`unit_restarts`, counting and logging a failure instead of dropping the series silently
        (logged when the reason changes, again every ``SYSTEMD_LOG_EVERY`` seconds while it lasts, and when
        the reads work again)."""
        try:
            restarts = unit_restarts(names, template)
        except SystemdReadError as exc:
            with self._lock:
                self.errors += 1
                now, msg = time.monotonic(), str(exc)
                last = self._logged
                if last is None or last[0] != msg or now - last[1] >= SYSTEMD_LOG_EVERY:
                    self._logged = (msg, now)
                    log.warning(
                        "cannot read restart counts (NRestarts) from systemd, %d failed reads so far; no "
                        "vllm_fleet_instance_restarts_total / vllm_fleet_worker_restarts_total series meanwhile: %s",
                        self.errors,
                        msg,
                    )
            return {}
        with self._lock:
            if self._logged is not None and names:
                self._logged = None
                log.info("restart counts are read from systemd again")
        return restarts

    def metrics(self, instances: list[Instance], workers: list[Worker]) -> Iterator[Metric]:
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
                    wfam.add_metric([w.name, w.model, rank_label(w), unit], restarts[w.name])
            yield wfam
        yield CounterMetricFamily(
            PREFIX + "exporter_systemd_errors",
            "Reads of unit properties from systemd (systemctl show NRestarts) that failed since the exporter "
            "started; the restart series are missing while they fail (the reason is in its journal)",
            value=self.errors,
        )

    def collect(self) -> Iterator[Metric]:
        states = self.states.read()
        yield from self.metrics(states.instances, states.workers)
