"""Who listens where, and who may reach it: the fleet's binding rules (docs/security.md).

Nothing but the gateway (and SSH) faces the network. Every other service binds to loopback when the hosts
that must reach it are the host itself, and otherwise to the host's fleet-internal address
(``hosts[].private_address``, else ``hosts[].address``) — never to every interface. The host firewall
(``firewall/nftables.conf.j2``) then lets only the hosts that need a port reach it.
"""

from __future__ import annotations

import ipaddress

from vllm_fleet.fleet.spec import FleetSpec, Host

LOOPBACK = "127.0.0.1"


def internal_address(host: Host) -> str:
    """The address other fleet hosts use to reach ``host``."""
    return host.private_address or host.address


def exporter_address(spec: FleetSpec, host: str) -> str:
    """Where the exporters of ``host`` listen (node-exporter, the vllm-fleet exporter, the nginx exporter):
    loopback on the monitoring host (Prometheus scrapes it there), the internal address elsewhere."""
    if host == spec.monitoring_host:
        return LOOPBACK
    return internal_address(spec.host(host))


def monitoring_address(spec: FleetSpec) -> str:
    """Where Prometheus and Alertmanager listen: loopback when the fleet is one host, else the monitoring
    host's internal address (behind basic auth and the firewall)."""
    if {h.name for h in spec.hosts} <= {spec.monitoring_host}:
        return LOOPBACK
    return internal_address(spec.host(spec.monitoring_host))


def nft_family(address: str) -> str:
    """``ip`` or ``ip6``: the nftables match for a source address (a name resolves as IPv4 when loaded)."""
    try:
        return "ip6" if ipaddress.ip_address(address.split("/")[0]).version == 6 else "ip"
    except ValueError:
        try:
            return "ip6" if ipaddress.ip_network(address, strict=False).version == 6 else "ip"
        except ValueError:
            return "ip"
