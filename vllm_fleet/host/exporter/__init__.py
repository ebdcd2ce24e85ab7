"""``vllm-fleet exporter``: the host exporter (prometheus-client) that Prometheus scrapes on every host.

Per instance it exports the launcher's state file (``{state_dir}/{name}.json``: loading / ready / draining /
failed / stopped, probe latency and failures, load duration; for a model that sleeps its sleep state, sleeps,
wakes and their durations, failed wakes, time asleep), the unit's restart count (systemd
``NRestarts`` of ``vllm@NAME.service`` when systemd runs) and, for a multi-node instance, its group size;
per headless rank of a multi-node instance on this host, the worker's state file
(``{state_dir}/workers/{name}.json``: waiting / joined / rank0_gone / exited) and the restart count of
``vllm-worker@NAME.service``; NVML GPU metrics (nvidia-ml-py: utilisation,
memory, temperature, power, ECC, XID) when the host has NVIDIA GPUs, and — on the gateway host — request
counts by model and status code from the gateway's JSON access log (the nginx exporter has no status codes)
and, on a gateway of two or more, keepalived's VRRP state (``--vrrp-state``: whether it holds the address).

Everything is read at scrape time (no background state) except the access log, which is tailed
incrementally on each scrape, and NVML XID events, which a thread collects.

One module per collector, each a prometheus_client ``Collector`` owning its series: ``states`` (the state files
and configs: ``StateFiles``; the manifest and the drained set: ``Deployment``), ``systemd``
(``SystemdRestarts``), ``access_log`` (``AccessLogTail``), ``vrrp`` (``VrrpState``), ``nvml`` (``Nvml``);
``registry`` composes the ones the arguments enable (``FleetCollector``, ``build_registry``). This module is the
command (``add_args``, its handler) and re-exports the names other code uses.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal

from prometheus_client import generate_latest, start_http_server

from vllm_fleet.contracts import MANIFEST_PATH as MANIFEST_FILE
from vllm_fleet.contracts import VRRP_STATE_FILE
from vllm_fleet.host.drain import STATE_FILE as DRAIN_STATE_FILE
from vllm_fleet.host.exporter.access_log import DURATION_BUCKETS, AccessLogTail
from vllm_fleet.host.exporter.common import PREFIX, log
from vllm_fleet.host.exporter.nvml import Nvml
from vllm_fleet.host.exporter.registry import FleetCollector, build_registry
from vllm_fleet.host.exporter.states import (
    SLEEP_STATE_METRICS,
    STATE_METRICS,
    STATES,
    Deployment,
    HostStates,
    Instance,
    StateFiles,
    Worker,
    read_instances,
    read_workers,
)
from vllm_fleet.host.exporter.systemd import (
    SYSTEMD_LOG_EVERY,
    SystemdReadError,
    SystemdRestarts,
    systemd_available,
    unit_restarts,
)
from vllm_fleet.host.exporter.vrrp import VrrpReading, VrrpState, read_vrrp
from vllm_fleet.host.waker import Stop

__all__ = [
    "DURATION_BUCKETS",
    "PREFIX",
    "SLEEP_STATE_METRICS",
    "STATES",
    "STATE_METRICS",
    "SYSTEMD_LOG_EVERY",
    "AccessLogTail",
    "Deployment",
    "FleetCollector",
    "HostStates",
    "Instance",
    "Nvml",
    "StateFiles",
    "SystemdReadError",
    "SystemdRestarts",
    "VrrpReading",
    "VrrpState",
    "Worker",
    "add_args",
    "build_registry",
    "read_instances",
    "read_vrrp",
    "read_workers",
    "systemd_available",
    "unit_restarts",
]


def _run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    registry = build_registry(args)
    if args.once:
        print(generate_latest(registry).decode(), end="")
        return 0
    addr, _, port = args.listen.rpartition(":")
    server, thread = start_http_server(int(port), addr=addr or "0.0.0.0", registry=registry)
    log.info("serving metrics on http://%s:%s/metrics", addr or "0.0.0.0", port)
    stop = Stop()  # not a threading.Event: its set in a signal handler can wait on the main thread (waker.py)
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
    p.add_argument(
        "--vrrp-state",
        default="",
        metavar="PATH",
        help=f"keepalived's VRRP state file (a gateway of two or more: {VRRP_STATE_FILE}); none: no VRRP series",
    )
    p.add_argument("--once", action="store_true", help="print the metrics once and exit")
    p.set_defaults(handler=_run)
