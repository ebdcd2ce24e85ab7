"""No single gateway or monitoring host: what each host runs when the spec names two or more (docs/design/ha.md).

``gateway.hosts``: every gateway host runs the same nginx configuration, and keepalived moves
``gateway.virtual_address`` between them by VRRP with unicast peers (multicast is often filtered). Each gateway's
keepalived asks its own nginx two questions through ``vllm-fleet gateway-check`` (``host/gateway_check.py``),
on nginx's loopback status server: does nginx answer (``GATEWAY_HEALTH_PATH``; no: the gateway gives the address
up at once, VRRP's FAULT state), and does at least one engine answer through it (``GATEWAY_UPSTREAMS_PATH``; no:
its priority drops below every gateway that reaches one, which takes the address over; when no gateway reaches
an engine the address stays where it is and clients get the gateway's JSON errors, not a dead address). After
every state change keepalived's notify (``host/vrrp_notify.py``, as root) writes the state to
``contracts.VRRP_STATE_FILE``, which the host exporter reads (``vllm_fleet_gateway_vrrp_master``): the alerts and
``vllm-fleet status`` tell from it which gateway holds the address.

``monitoring.hosts``: Prometheus on each with the same targets, rules and external labels but ``replica`` (the
Prometheus HA convention), dropped from the alerts it sends, so that every Alertmanager receives the same
alert from both; each Prometheus sends to every Alertmanager, and the Alertmanagers gossip (their cluster) so
that a notification goes out once while either lives.

Decided here, printed by nginx/keepalived.conf.j2, nginx/vllm-fleet.conf.j2, monitoring/prometheus.yml.j2 and
monitoring/prometheus-alertmanager.default.j2; the checks are in fleet/plan_checks.py (``check_gateway_ha``; the
ports through ``host_service_ports``) and the spec (the hosts' lists).
"""

from __future__ import annotations

import hashlib
import ipaddress
from typing import Any

from pydantic import BaseModel, ConfigDict

from vllm_fleet.contracts import (
    GATEWAY_PEER_PATH,
    GATEWAY_PEERS_FILE,
    GATEWAY_PEERS_SCHEMA,
    VRRP_STATE_FILE,
    GatewayPeer,
    GatewayPeers,
)
from vllm_fleet.fleet.admission_config import NGINX_GROUP
from vllm_fleet.fleet.network import internal_address, monitoring_listen_address
from vllm_fleet.fleet.spec import DEFAULT_VRRP_PRIORITY, FleetSpec

# nginx's loopback status server (gateway.stub_status_port): nginx itself answers / at least one engine answers
GATEWAY_HEALTH_PATH = "/vf/health"
GATEWAY_UPSTREAMS_PATH = "/vf/upstreams"
# what keepalived runs: the tools venv's console script of vllm_fleet.host.gateway_check (`vllm-fleet
# gateway-check` is the same code, but the CLI loads the spec model first, ≈ 0.8 s of CPU every few seconds on a
# gateway). Not `VENV/bin/python -m MODULE`: keepalived runs a script by its real path (script security), and
# the venv's python is a link to the system interpreter, which then runs outside the venv (exit 1, always)
GATEWAY_CHECK_SCRIPT = "vllm-fleet-gateway-check"
# the file the gateway role writes from gateway.vrrp.auth_secret: keepalived.conf includes it in its instance
VRRP_AUTH_FILE = "/etc/keepalived/vllm-fleet-vrrp-auth.conf"
# keepalived runs the checks as this user (enable_script_security): they only ask nginx on loopback
SCRIPT_USER = "nobody"
SCRIPT_GROUP = "nogroup"
# keepalived's notify: writes the VRRP state for the host exporter (vllm_fleet_gateway_vrrp_master), as root
# (named on the notify line): the file under /run is root's, so that no other user can claim the address
# (the venv's console script of vllm_fleet.host.vrrp_notify, for the reason GATEWAY_CHECK_SCRIPT says)
VRRP_NOTIFY_SCRIPT = "vllm-fleet-vrrp-notify"
NOTIFY_USER = "root"
# nginx's own bounds on the upstream question: connect, answer, and all engines tried together (seconds)
UPSTREAM_CONNECT_SECONDS = 1
UPSTREAM_READ_SECONDS = 2
UPSTREAM_TOTAL_SECONDS = 2


def vrrp_router_id(spec: FleetSpec) -> int:
    """``gateway.vrrp.router_id``, else one derived from the fleet's name (1-255, the same on every run)."""
    if spec.gateway.vrrp.router_id:
        return spec.gateway.vrrp.router_id
    digest = hashlib.sha256(f"vllm-fleet:{spec.name}".encode()).digest()
    return int.from_bytes(digest[:4], "big") % 255 + 1


def virtual_interface(spec: FleetSpec) -> ipaddress.IPv4Interface:
    """``gateway.virtual_address`` with its prefix (/32 when the spec gives none)."""
    return ipaddress.IPv4Interface(spec.gateway.virtual_address)


def vrrp_priorities(spec: FleetSpec) -> dict[str, int]:
    """Gateway host → its VRRP priority (``gateway.hosts[].priority``, else ``DEFAULT_VRRP_PRIORITY``)."""
    return {h.name: h.priority or DEFAULT_VRRP_PRIORITY for h in spec.gateway.hosts}


def upstream_check_weight(spec: FleetSpec) -> int:
    """How far a gateway that reaches no engine drops (keepalived's script weight, negative): below every other
    gateway's priority, so that one that reaches an engine takes the address over (priorities are >= 2 and
    keepalived keeps a dropped priority >= 1)."""
    prio = vrrp_priorities(spec).values()
    return -(max(prio) - min(prio) + 1)


class VrrpCheck(BaseModel):
    """One ``vrrp_script`` of keepalived.conf. ``weight`` 0: a failure puts the gateway in FAULT (it gives the
    address up); negative: a failure lowers its priority by that much."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    script: str
    interval: int
    timeout: int
    fall: int
    rise: int
    weight: int


class KeepalivedPlan(BaseModel):
    """What keepalived.conf of one gateway host says (``vf.keepalived``; None on other hosts and with one
    gateway)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    instance: str
    router_id: int
    # gateway.vrrp.interface; "": the gateway role finds the interface that holds interface_address
    interface: str
    interface_address: str
    virtual_address: str
    priority: int
    advert_int: int
    # this host's fleet address (the advertisements' source) and the other gateways' (their destinations)
    unicast_src: str
    unicast_peers: list[str]
    checks: list[VrrpCheck]
    # the include file with the authentication block ("" : no VRRP authentication)
    auth_file: str
    script_user: str
    script_group: str
    # keepalived's notify (run as notify_user after every state change, with TYPE NAME STATE PRIORITY
    # appended): writes state_file, which the host exporter reads (--vrrp-state)
    notify: str
    notify_user: str
    state_file: str


def gateway_check_urls(spec: FleetSpec) -> tuple[str, str]:
    """Where keepalived's checks ask nginx: (nginx answers, an engine answers through nginx)."""
    base = f"http://127.0.0.1:{spec.gateway.stub_status_port}"
    return base + GATEWAY_HEALTH_PATH, base + GATEWAY_UPSTREAMS_PATH


def vrrp_checks(spec: FleetSpec) -> list[VrrpCheck]:
    """The two checks: nginx (a failure: FAULT, at once after two misses) and the engines (a failure: the
    priority drops by ``upstream_check_weight``)."""
    python = f"{spec.paths.venv}/bin/{GATEWAY_CHECK_SCRIPT}"
    nginx, upstreams = gateway_check_urls(spec)
    upstream_timeout = UPSTREAM_CONNECT_SECONDS + UPSTREAM_TOTAL_SECONDS  # nginx's bounds, and a margin
    return [
        VrrpCheck(name="vf_nginx", script=f"{python} {nginx} --timeout 1.5", interval=2, timeout=2, fall=2,
                  rise=2, weight=0),
        VrrpCheck(name="vf_upstreams", script=f"{python} {upstreams} --timeout {upstream_timeout}",
                  interval=3, timeout=upstream_timeout + 1, fall=2, rise=2, weight=upstream_check_weight(spec)),
    ]  # fmt: skip


def vrrp_notify(spec: FleetSpec) -> str:
    """keepalived's notify command: the tools venv's console script (like the checks), naming the state file
    (keepalived appends TYPE NAME STATE PRIORITY)."""
    return f"{spec.paths.venv}/bin/{VRRP_NOTIFY_SCRIPT} --state-file {VRRP_STATE_FILE}"


def keepalived_plan(spec: FleetSpec, host: str) -> KeepalivedPlan | None:
    """``host``'s keepalived.conf, when it is one of two or more gateway hosts."""
    if not spec.gateway_ha or host not in spec.gateway_hosts:
        return None
    own = internal_address(spec.host(host))
    vrrp = spec.gateway.vrrp
    return KeepalivedPlan(
        instance=f"vf_{spec.name}".replace("-", "_"),
        router_id=vrrp_router_id(spec),
        interface=vrrp.interface,
        interface_address=own,
        virtual_address=str(virtual_interface(spec)),
        priority=vrrp_priorities(spec)[host],
        advert_int=vrrp.advert_int,
        unicast_src=own,
        unicast_peers=[internal_address(spec.host(h)) for h in spec.gateway_hosts if h != host],
        checks=vrrp_checks(spec),
        auth_file=VRRP_AUTH_FILE if vrrp.auth_secret else "",
        script_user=SCRIPT_USER,
        script_group=SCRIPT_GROUP,
        notify=vrrp_notify(spec),
        notify_user=NOTIFY_USER,
        state_file=VRRP_STATE_FILE,
    )


def certificate_addresses(spec: FleetSpec, host: str) -> list[str]:
    """The addresses a gateway host's self-signed certificate names (``gateway.tls.self_signed``): the host's
    ``address`` and ``private_address``, and with two or more gateways the virtual address, the one clients use
    (each once, in that order)."""
    h = spec.host(host)
    addrs = [h.address, h.private_address or ""]
    if spec.gateway_ha:
        addrs.append(str(virtual_interface(spec).ip))
    return list(dict.fromkeys(a for a in addrs if a))


def gateway_ha_vars(spec: FleetSpec, upstreams: list[dict[str, Any]]) -> dict[str, Any] | None:
    """What nginx's configuration adds on every gateway host of two or more (``vf.gateway_ha``; None with one):
    the paths keepalived asks on the loopback status server, nginx's bounds on the engine question, and every
    engine address the gateway reaches (each once, in the upstreams' order), which nginx tries until one
    answers its /health."""
    if not spec.gateway_ha:
        return None
    # a canary (rollouts) is no answer for the gateway: it serves only a leased share of one model's requests
    engines = list(
        dict.fromkeys(str(s["address"]) for u in upstreams for s in u["servers"] if s["role"] != "canary")
    )
    return {
        "health_path": GATEWAY_HEALTH_PATH,
        "upstreams_path": GATEWAY_UPSTREAMS_PATH,
        "engines": engines,
        "connect_seconds": UPSTREAM_CONNECT_SECONDS,
        "read_seconds": UPSTREAM_READ_SECONDS,
        "total_seconds": UPSTREAM_TOTAL_SECONDS,
        "virtual_address": str(virtual_interface(spec).ip),
    }


def drained_set_file(spec: FleetSpec) -> str:
    """Where `vllm-fleet drain` keeps the drained set on a gateway host: ``gateway.state_file``, else
    ``PATHS.CONFIG_DIR/gateway/drained.json``."""
    return spec.gateway.state_file or f"{spec.paths.config_dir}/gateway/drained.json"


class StateFolder(BaseModel):
    """The drained-set file's folder on a gateway host, as the gateway role makes it (``vf.gateway_state_folder``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str
    owner: str
    group: str
    mode: str


def drained_set_folder(spec: FleetSpec, host: str) -> StateFolder | None:
    """``host``'s drained-set folder: root's (0755), where only `vllm-fleet drain` (root) replaces the file; on a
    gateway of two or more group ``www-data`` and 0775, because its nginx's workers apply the other gateways'
    drains there too (a temp file in the folder, then a rename: the folder must be theirs to write). The file
    stays 0644 either way (the router and the host exporter read it). None: not a gateway host."""
    if not spec.gateway.enabled or host not in spec.gateway_hosts:
        return None
    path = drained_set_file(spec).rsplit("/", 1)[0] or "/"
    if spec.gateway_ha:
        return StateFolder(path=path, owner="root", group=NGINX_GROUP, mode="0775")
    return StateFolder(path=path, owner="root", group="root", mode="0755")


class GatewayPeerPlan(BaseModel):
    """A gateway of two or more: its nginx's peer server (nginx/peer.conf.j2), where the other gateways'
    `vllm-fleet drain` / `undrain` reach it, and its peers file (``contracts.GATEWAY_PEERS_FILE``), which its own
    drain reads to tell them (``vf.gateway_peer``; None on other hosts and with one gateway)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # where the peer server listens: this host's fleet address and gateway.peer_port
    listen_address: str
    port: int
    path: str
    # the only addresses it answers (403 for every other): the other gateways' fleet addresses
    allow: list[str]
    # the peers file: where it is, and what it says (contracts.GatewayPeers)
    peers_file: str
    peers: dict[str, Any]


def gateway_peer_plan(spec: FleetSpec, host: str) -> GatewayPeerPlan | None:
    """``host``'s peer server and peers file, when it is one of two or more gateway hosts."""
    if not spec.gateway_ha or host not in spec.gateway_hosts:
        return None
    port = spec.gateway.peer_port
    own = internal_address(spec.host(host))
    others = [(h, internal_address(spec.host(h))) for h in spec.gateway_hosts if h != host]
    peers = GatewayPeers(
        schema=GATEWAY_PEERS_SCHEMA,
        fleet=spec.name,
        host=host,
        source=own,
        peers=[GatewayPeer(name=h, url=f"http://{a}:{port}{GATEWAY_PEER_PATH}") for h, a in others],
    )
    return GatewayPeerPlan(
        listen_address=own,
        port=port,
        path=GATEWAY_PEER_PATH,
        allow=list(dict.fromkeys(a for _, a in others)),
        peers_file=GATEWAY_PEERS_FILE,
        peers=peers.to_dict(),
    )


class MonitoringPeer(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str
    address: str


class MonitoringServer(BaseModel):
    """What Prometheus and Alertmanager of one monitoring host are told (``vf.monitoring_server``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # where this host's Prometheus and Alertmanager listen
    listen_address: str
    # the external label `replica` of this host's Prometheus ("" : one monitoring host, no such label)
    replica: str
    # every monitoring host (this one included, in spec order) and where its Prometheus and Alertmanager are
    # reached: every Prometheus sends its alerts to every Alertmanager and scrapes every Prometheus and
    # Alertmanager (a lost peer is seen)
    servers: list[MonitoringPeer]
    # the Alertmanager cluster: this host's gossip address ("" : no gossip) and the others'
    cluster_listen: str
    cluster_peers: list[str]


def monitoring_server(spec: FleetSpec, host: str) -> MonitoringServer | None:
    """``host``'s Prometheus and Alertmanager settings, when it is a monitoring host."""
    if not spec.monitoring.enabled or host not in spec.monitoring_hosts:
        return None
    own = monitoring_listen_address(spec, host)
    servers = [
        MonitoringPeer(host=h, address=own if h == host else monitoring_listen_address(spec, h))
        for h in spec.monitoring_hosts
    ]
    if not spec.monitoring_ha:
        return MonitoringServer(
            listen_address=own, replica="", servers=servers, cluster_listen="", cluster_peers=[]
        )
    port = spec.monitoring.alertmanager_cluster_port
    return MonitoringServer(
        listen_address=own,
        replica=host,
        servers=servers,
        cluster_listen=f"{own}:{port}",
        cluster_peers=[f"{s.address}:{port}" for s in servers if s.host != host],
    )
