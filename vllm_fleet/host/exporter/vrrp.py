"""Whether this gateway holds the fleet's virtual address: keepalived's VRRP state, on a gateway host of two or
more (``--vrrp-state``, given by the unit only where keepalived runs; docs/design/ha.md).

keepalived's notify (``vllm_fleet.host.vrrp_notify``) writes the state file (``vllm_fleet.contracts.VrrpStateFile``)
on every state change; it is read at every scrape. The series exist from the first scrape: no file yet (keepalived
has not reported since boot), an unreadable one or a state keepalived does not send for an instance reads
``UNKNOWN`` (and master 0). A state file whose keepalived process is gone (killed, or it crashed: a stop it
could not report) reads ``STOP``: the file's last word is no longer true.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from vllm_fleet.contracts import VRRP_STATES, ContractError, read_vrrp_state
from vllm_fleet.host.exporter.common import PREFIX, log, pid_alive

UNKNOWN = "UNKNOWN"
STATES = (*VRRP_STATES, UNKNOWN)  # the values of the state label, in exposition order
MASTER = "MASTER"


@dataclass(frozen=True)
class VrrpReading:
    """One scrape's reading of the state file: the state (``STATES``), since when (None: unknown), and
    whether the file could not be read (a read error)."""

    state: str
    since: float | None = None
    error: bool = False


def read_vrrp(path: Path) -> VrrpReading:
    """The state ``path`` reports (see the module's docstring for UNKNOWN and STOP)."""
    try:
        rec = read_vrrp_state(path)
    except FileNotFoundError:
        return VrrpReading(UNKNOWN)
    except (OSError, ContractError) as exc:
        log.warning("%s", exc)
        return VrrpReading(UNKNOWN, error=True)
    state = rec.get("state", "")
    if state not in VRRP_STATES:
        return VrrpReading(UNKNOWN)
    pid = rec.get("keepalived_pid")
    if state != "STOP" and isinstance(pid, int) and not pid_alive(pid):
        return VrrpReading("STOP")
    since = rec.get("since")
    return VrrpReading(state, float(since) if isinstance(since, int | float) else None)


def vrrp_metrics(reading: VrrpReading) -> Iterator[Metric]:
    """``vllm_fleet_gateway_vrrp_master``, ``_state{state}`` (one-hot over ``STATES``) and, when known,
    ``_state_since_timestamp_seconds``."""
    yield GaugeMetricFamily(
        PREFIX + "gateway_vrrp_master",
        "1 when this gateway holds the fleet's virtual address (keepalived's VRRP state is MASTER)",
        value=1 if reading.state == MASTER else 0,
    )
    state = GaugeMetricFamily(
        PREFIX + "gateway_vrrp_state",
        "keepalived's VRRP state on this gateway: 1 for the current one (UNKNOWN: none reported since boot)",
        labels=["state"],
    )
    for s in STATES:
        state.add_metric([s], 1 if reading.state == s else 0)
    yield state
    since = GaugeMetricFamily(
        PREFIX + "gateway_vrrp_state_since_timestamp_seconds",
        "Time keepalived reported the current VRRP state",
    )
    if reading.since is not None:
        since.add_metric([], reading.since)
    yield since


class VrrpState(Collector):
    """The VRRP series of the state file at ``path`` (read at every scrape; the exporter's composition counts
    an unreadable file among its read errors)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def read(self) -> VrrpReading:
        return read_vrrp(self.path)

    def collect(self) -> Iterator[Metric]:
        yield from vrrp_metrics(self.read())
