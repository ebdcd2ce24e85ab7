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

from vllm_fleet.contracts import ADMISSION_CONFIG_SCHEMA
from vllm_fleet.fleet.network import exporter_address
from vllm_fleet.fleet.plan import Plan
from vllm_fleet.fleet.spec import FleetSpec, KeyBudget

ADMISSION_SOCKET = "admit.sock"  # in gateway.limits.runtime_dir
ADMISSION_LOG_SOCKET = "log.sock"
# nginx's workers (Debian) connect to the sockets
NGINX_GROUP = "www-data"


def admission_config_path(spec: FleetSpec) -> str:
    return f"{spec.paths.config_dir}/gateway/admission.json"


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
    """Served model → requests in flight its serving instances hold (the sum of their queue bounds); a model
    with an instance whose queue is unbounded is left out (unlimited). Backups (they serve only when every
    primary is down) and instances the spec keeps drained do not count; fallbacks do (the spill-over reaches
    them)."""
    bounds: dict[str, list[int | None]] = {}
    seen: set[str] = set()
    for ip in plan.instances:
        if ip.name in seen or ip.name in spec.gateway.drained or ip.role == "backup":
            continue
        seen.add(ip.name)
        bounds.setdefault(ip.served_model_name, []).append(ip.queue_bound)
    return {
        model: sum(b for b in bs if b is not None)
        for model, bs in sorted(bounds.items())
        if bs and all(b is not None for b in bs)
    }


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
        "capacity": model_capacity(spec, plan),
        "socket_group": NGINX_GROUP,
    }
