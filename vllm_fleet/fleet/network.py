"""Who listens where, and who may reach it: the fleet's binding rules (docs/security.md).

Nothing but the gateway (and SSH) faces the network. Every other service binds to loopback when the hosts
that must reach it are the host itself, and otherwise to the host's fleet-internal address
(``hosts[].private_address``, else ``hosts[].address``) — never to every interface. The host firewall
(``firewall/nftables.conf.j2``) then lets only the hosts that need a port reach it.
"""

from __future__ import annotations

import ipaddress
from typing import Any

from vllm_fleet.fleet.spec import FleetSpec, Host

LOOPBACK = "127.0.0.1"


def internal_address(host: Host) -> str:
    """The address other fleet hosts use to reach ``host``."""
    return host.private_address or host.address


def exporter_address(spec: FleetSpec, host: str) -> str:
    """Where the exporters of ``host`` listen (node-exporter, the vllm-fleet exporter, the nginx exporter):
    loopback on the one monitoring host (Prometheus scrapes it there), the internal address elsewhere (and on
    every monitoring host when there are several: each one's Prometheus scrapes the others too)."""
    if spec.monitoring_hosts == [host]:
        return LOOPBACK
    return internal_address(spec.host(host))


def exporter_addresses(spec: FleetSpec) -> dict[str, str]:
    """Host name → where its exporters listen, which is where Prometheus scrapes them."""
    return {h.name: exporter_address(spec, h.name) for h in reversed(spec.hosts)}


def monitoring_listen_address(spec: FleetSpec, host: str) -> str:
    """Where Prometheus and Alertmanager listen on monitoring host ``host``: loopback when the fleet is that
    one host, else its internal address (behind basic auth and the firewall)."""
    if {h.name for h in spec.hosts} <= {host}:
        return LOOPBACK
    return internal_address(spec.host(host))


def monitoring_address(spec: FleetSpec) -> str:
    """Where Prometheus and Alertmanager are reached: those of the (first) monitoring host."""
    return monitoring_listen_address(spec, spec.monitoring_host)


def nft_family(address: str) -> str:
    """``ip`` or ``ip6``: the nftables match for a source address (a name resolves as IPv4 when loaded)."""
    try:
        return "ip6" if ipaddress.ip_address(address.split("/")[0]).version == 6 else "ip"
    except ValueError:
        try:
            return "ip6" if ipaddress.ip_network(address, strict=False).version == 6 else "ip"
        except ValueError:
            return "ip"


def firewall_rules(spec: FleetSpec, host: str) -> list[dict[str, object]]:
    """The accept rules of ``host``'s firewall (everything else is dropped): ``{comment, proto, ports,
    sources}``, ``sources`` empty = from anywhere, else ``[(family, [addresses])]``."""
    fw, mon, gw = spec.firewall, spec.monitoring, spec.gateway
    mon_hosts = [internal_address(spec.host(h)) for h in spec.monitoring_hosts]
    gateway_here = gw.enabled and host in spec.gateway_hosts
    monitoring_here = host in spec.monitoring_hosts
    rules: list[dict[str, object]] = [{"comment": "ssh", "ports": [fw.ssh_port], "sources": []}]

    def by_family(addresses: list[str]) -> list[tuple[str, list[str]]]:
        out: dict[str, list[str]] = {}
        for a in addresses:
            fam = out.setdefault(nft_family(a), [])
            if a not in fam:
                fam.append(a)
        return sorted(out.items())

    if gateway_here:
        plain = not gw.tls or gw.tls.plain_http != "off"
        ports = ([gw.port] if plain else []) + ([gw.tls.port] if gw.tls else [])
        rules.append({"comment": "the gateway (clients)", "ports": ports, "sources": []})
    if fw.open_tcp_ports.get(host):
        rules.append({"comment": "firewall.open_tcp_ports", "ports": fw.open_tcp_ports[host], "sources": []})
    engines = [m.port for m in spec.models_on(host)]
    if engines:
        reach = []
        if gw.enabled:
            reach += [internal_address(spec.host(h)) for h in spec.gateway_hosts]
        if mon.enabled:
            reach += mon_hosts
        if reach:
            rules.append({"comment": "engines: the gateway and monitoring hosts", "ports": sorted(set(engines)),
                          "sources": by_family(reach)})  # fmt: skip
    if mon.enabled:
        # vllm-fleet's exporter runs on every host (Prometheus scrapes it on every host)
        exporters = [mon.node_exporter_port, mon.exporter_port]
        if gateway_here:
            exporters.append(mon.nginx_exporter_port)
            if gw.admission:
                exporters.append(gw.limits.metrics_port)
        host_gpus = spec.host(host).gpus
        if mon.gpu_exporter_port and (host_gpus.count or host_gpus.detect):
            exporters.append(mon.gpu_exporter_port)
        who = "the monitoring hosts" if spec.monitoring_ha else "the monitoring host"
        rules.append({"comment": f"exporters: {who}", "ports": sorted(set(exporters)),
                      "sources": by_family(mon_hosts)})  # fmt: skip
        if monitoring_here and fw.admin_sources:
            rules.append({"comment": "Prometheus and Alertmanager: firewall.admin_sources",
                          "ports": [mon.prometheus_port, mon.alertmanager_port],
                          "sources": by_family(fw.admin_sources)})  # fmt: skip
        if monitoring_here and spec.monitoring_ha:
            rules += _monitoring_peer_rules(spec, host, by_family)
    if gateway_here and spec.gateway_ha:
        peers = [internal_address(spec.host(h)) for h in spec.gateway_hosts if h != host]
        # VRRP is an IP protocol of its own (112), without ports: keepalived's unicast advertisements
        rules.append({"comment": "VRRP: the other gateway hosts", "proto": VRRP_PROTOCOL, "ports": [],
                      "sources": by_family(peers)})  # fmt: skip
        # their `vllm-fleet drain` / `undrain`, which this gateway's nginx applies to its own drained set
        rules.append({"comment": "drains: the other gateway hosts", "ports": [gw.peer_port],
                      "sources": by_family(peers)})  # fmt: skip
    rules += _multi_node_rules(spec, host, by_family)
    for r in rules:
        r.setdefault("proto", "tcp")
    return rules


# VRRP's IP protocol number (keepalived's advertisements; nftables: `meta l4proto 112`)
VRRP_PROTOCOL = 112


def _monitoring_peer_rules(spec: FleetSpec, host: str, by_family: Any) -> list[dict[str, object]]:
    """Between the monitoring hosts of ``monitoring.hosts``: each Prometheus sends its alerts to every
    Alertmanager and scrapes the other Prometheus and Alertmanager (a lost peer is seen), and the Alertmanagers
    gossip on the cluster port (TCP and UDP)."""
    mon = spec.monitoring
    peers = by_family([internal_address(spec.host(h)) for h in spec.monitoring_hosts if h != host])
    return [
        {"comment": "Prometheus and Alertmanager: the other monitoring hosts",
         "ports": [mon.prometheus_port, mon.alertmanager_port], "sources": peers},
        {"comment": "Alertmanager cluster: the other monitoring hosts", "proto": "tcp",
         "ports": [mon.alertmanager_cluster_port], "sources": peers},
        {"comment": "Alertmanager cluster: the other monitoring hosts", "proto": "udp",
         "ports": [mon.alertmanager_cluster_port], "sources": peers},
    ]  # fmt: skip


# Linux's default net.ipv4.ip_local_port_range: vLLM 0.32's gloo pairs and message queues listen on ports
# from it, which cannot be pinned (docs/multi-node.md); the master port is rank 0's TCPStore
EPHEMERAL_RANGE = "32768-60999"


def _multi_node_rules(spec: FleetSpec, host: str, by_family: Any) -> list[dict[str, object]]:
    """Each multi-node instance with a rank on ``host``: its master port (rank 0) and the ephemeral range,
    TCP, from the group's other hosts only (no UDP: none was open in the spike)."""
    from vllm_fleet.fleet.engine import master_port

    rules: list[dict[str, object]] = []
    for m in spec.groups_on(host):
        hosts = [n.host for n in m.placement]
        peers = [internal_address(spec.host(h)) for h in hosts if h != host]
        ports: list[object] = [master_port(m)] if host == m.host else []
        rules.append({"comment": f"multi-node group {m.name}: its other hosts", "ports": [*ports, EPHEMERAL_RANGE],
                      "sources": by_family(peers)})  # fmt: skip
    return rules
