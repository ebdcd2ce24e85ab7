"""The gateway's admission service configuration (``gateway.limits``), decided here from the spec and the plan.

The gateway host runs ``vllm-fleet admission --config CONFIG_DIR/gateway/admission.json``
(``vllm-fleet-admission.service``); nginx asks it before a request goes to an engine (``auth_request``,
docs/gateway.md "Per-key limits"). The file is the typed ``contracts.AdmissionConfig``: the host side never
reads the spec. Per served model, ``capacity`` is what its engines hold in flight (each instance's queue bound:
running + waiting, past which vLLM answers 503); a model with an unbounded instance has no entry (the gateway
does not hold its requests back; the engines queue them).
"""

from __future__ import annotations

from typing import Any

from vllm_fleet.contracts import ADMISSION_CONFIG_SCHEMA, ADMISSION_LISTEN_BACKLOG
from vllm_fleet.fleet.network import exporter_address
from vllm_fleet.fleet.plan import Plan
from vllm_fleet.fleet.plan_checks import serving_capacity
from vllm_fleet.fleet.spec import FleetSpec, KeyBudget

ADMISSION_SOCKET = "admit.sock"  # in gateway.limits.runtime_dir
ADMISSION_LOG_SOCKET = "log.sock"
# the service's unit (nginx/vllm-fleet-admission.service.j2)
ADMISSION_UNIT_FILE = "/etc/systemd/system/vllm-fleet-admission.service"
# nginx's workers (Debian) connect to the sockets
NGINX_GROUP = "www-data"


def admission_config_path(spec: FleetSpec) -> str:
    return f"{spec.paths.config_dir}/gateway/admission.json"


def admission_files(spec: FleetSpec) -> list[str]:
    """``vf.gateway_admission_files``: the files rendered for the service (its config, its unit), on every
    gateway host whether ``gateway.limits`` is on or not: the gateway role removes them when it is off."""
    return [admission_config_path(spec), ADMISSION_UNIT_FILE]


def runtime_directory(path: str) -> str:
    """systemd's RuntimeDirectory= for ``path`` (relative to /run); "" for a folder elsewhere (the service
    makes it)."""
    return path.removeprefix("/run/") if path.startswith("/run/") else ""


def _budget(b: KeyBudget) -> dict[str, Any]:
    return {
        "max_in_flight": b.max_in_flight,
        "requests_per_minute": b.requests_per_minute,
        "tokens_per_minute": b.tokens_per_minute,
        "weight": float(b.weight),
    }


def model_capacity(spec: FleetSpec, plan: Plan) -> dict[str, int]:
    """Served model → requests in flight its serving instances hold (``plan_checks.serving_capacity``: the sum
    of their queue bounds; a model with an unbounded instance is left out, unlimited)."""
    return serving_capacity(spec, plan.instances)


def listen_backlog(spec: FleetSpec, capacity: dict[str, int]) -> int:
    """The admission socket's listen backlog: every request the gateway can hold may connect at once
    (``max_queued`` waiting + what the engines hold), at least ``ADMISSION_LISTEN_BACKLOG``. The gateway role
    raises ``net.core.somaxconn`` and ``net.unix.max_dgram_qlen`` to it (``gateway_sysctl``)."""
    return max(ADMISSION_LISTEN_BACKLOG, spec.gateway.limits.max_queued + sum(capacity.values()))


def gateway_sysctl(spec: FleetSpec, plan: Plan) -> dict[str, int]:
    """The kernel settings the gateway role writes (/etc/sysctl.d) on the gateway host with gateway.limits on:
    the admission socket's backlog is capped at ``net.core.somaxconn``, and nginx's release datagrams are lost
    once ``net.unix.max_dgram_qlen`` of them wait unread (10 by default); {} without the service."""
    if not spec.gateway.admission:
        return {}
    n = listen_backlog(spec, model_capacity(spec, plan))
    return {"net.core.somaxconn": n, "net.unix.max_dgram_qlen": n}


def admission_metrics_address(spec: FleetSpec, host: str) -> str:
    """Where the admission service of gateway host ``host`` serves its metrics: where its exporters listen."""
    return f"{exporter_address(spec, host)}:{spec.gateway.limits.metrics_port}"


def host_admission_config(config: dict[str, Any] | None, spec: FleetSpec, host: str) -> dict[str, Any] | None:
    """The admission file of gateway host ``host`` (``config`` with its own metrics address); None elsewhere."""
    if config is None or not spec.gateway.enabled or host not in spec.gateway_hosts:
        return None
    return {**config, "metrics_address": admission_metrics_address(spec, host)}


def admission_config(spec: FleetSpec, plan: Plan) -> dict[str, Any]:
    """``contracts.AdmissionConfig`` as a dict (the rendered file's content; the metrics address is the first
    gateway host's: ``host_admission_config`` gives each gateway host its own)."""
    lim = spec.gateway.limits
    run = lim.runtime_dir.rstrip("/")
    capacity = model_capacity(spec, plan)
    return {
        "schema": ADMISSION_CONFIG_SCHEMA,
        "fleet": spec.name,
        "socket": f"{run}/{ADMISSION_SOCKET}",
        "log_socket": f"{run}/{ADMISSION_LOG_SOCKET}",
        # scraped by Prometheus like the host's exporters (behind the firewall)
        "metrics_address": admission_metrics_address(spec, spec.gateway_host),
        "queue_wait_seconds": float(lim.queue_wait_seconds),
        "max_queued_per_key": lim.max_queued_per_key,
        "max_queued": lim.max_queued,
        # an admitted request whose end nginx never reported frees its slot after the longest a proxied
        # request can live
        "lease_seconds": float(spec.gateway.read_timeout_seconds + lim.queue_wait_seconds + 30),
        "default_key": _budget(lim.default_key),
        "keys": {k: _budget(b) for k, b in sorted(lim.keys.items())},
        "default_client": _budget(lim.default_client),
        "clients": {n: _budget(c.limits) for n, c in sorted(spec.gateway.clients.items()) if c.limits},
        "per_key": {n: _budget(c.per_key) for n, c in sorted(spec.gateway.clients.items()) if c.per_key},
        "capacity": capacity,
        "socket_group": NGINX_GROUP,
        "listen_backlog": listen_backlog(spec, capacity),
    }
