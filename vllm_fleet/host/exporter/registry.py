"""The exporter's registry: the collectors its arguments enable, composed into one scrape.

One :class:`FleetCollector` (not one registration per collector) so that a scrape reads the state files once
(the systemd restart series are the instances' and workers' of that reading), the families keep their order in
the exposition, and the scrape-duration gauge covers the whole scrape.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from pathlib import Path

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from vllm_fleet.host.exporter.access_log import AccessLogTail
from vllm_fleet.host.exporter.common import PREFIX
from vllm_fleet.host.exporter.nvml import Nvml
from vllm_fleet.host.exporter.states import Deployment, StateFiles
from vllm_fleet.host.exporter.systemd import SystemdRestarts, systemd_available
from vllm_fleet.host.exporter.vrrp import VrrpState, vrrp_metrics


class FleetCollector(Collector):
    """Every series of the host exporter, in this order: the instances' and workers' state files, their restart
    counts (when systemd runs, ``use_systemd=None``: when it is there), the gateway's access log, the deployment
    (manifest, drained set), keepalived's VRRP state (a gateway of two or more), the GPUs (NVML), then the
    read-error counter and the scrape duration."""

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
        vrrp_state: Path | None = None,
    ) -> None:
        self.states = StateFiles(state_dir, config_dir, worker_config_dir)
        self.use_systemd = systemd_available() if use_systemd is None else use_systemd
        self.systemd = SystemdRestarts(self.states) if self.use_systemd else None
        self.access_log = access_log
        self.deployment = Deployment(manifest, drain_state)
        self.nvml = nvml
        self.vrrp = VrrpState(vrrp_state) if vrrp_state is not None else None

    def collect(self) -> Iterator[Metric]:
        started = time.monotonic()
        states = self.states.read()
        yield from self.states.metrics(states)
        if self.systemd is not None:
            yield from self.systemd.metrics(states.instances, states.workers)
        if self.access_log is not None:
            yield from self.access_log.collect()
        yield from self.deployment.collect()
        errors = states.errors
        if self.vrrp is not None:
            vrrp = self.vrrp.read()
            errors += vrrp.error
            yield from vrrp_metrics(vrrp)
        if self.nvml is not None:
            yield from self.nvml.collect()
        yield self.states.read_errors(errors)
        yield GaugeMetricFamily(
            PREFIX + "exporter_scrape_duration_seconds",
            "Time this scrape took",
            value=time.monotonic() - started,
        )


def build_registry(args: argparse.Namespace) -> CollectorRegistry:
    """The registry of ``vllm-fleet exporter ARGS``: the access log only with ``--access-log``, NVML unless
    ``--no-nvml``, the manifest, the drained set and keepalived's VRRP state where their paths are given."""
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
            vrrp_state=Path(args.vrrp_state) if args.vrrp_state else None,
        )
    )
    return registry
