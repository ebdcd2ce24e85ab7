"""What an alert rule or a dashboard panel reads, and which of those series a fleet lacks by design.

Used by the checks that run every alert and panel expression against a live Prometheus: the local one of
``tests/integration/test_observability_live.py`` and the deployed sandbox fleet's in
``tests/integration/test_ansible.py`` ("every metric an alert or a panel reads has series").
docs/observability.md lists the families absent by design.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

# a vector selector: one of our metric families (vLLM's, ours, node-exporter's, nginx-exporter's, `up{…}`)
# with its label matchers
SELECTOR = re.compile(r"((?:vllm:|vllm_fleet_|node_|nginx_)[A-Za-z0-9_:]*|(?<![\w:])up(?=\{))(\{[^}]*\})?")

# families a fleet has only with hardware or topology it may lack (docs/observability.md, "absent by design")
ABSENT_BY_DESIGN: dict[str, re.Pattern[str]] = {
    # NVML readings: only hosts with NVIDIA GPUs (the cpu profile has none)
    "gpu": re.compile(r"vllm_fleet_gpu_"),
    # a multi-node group's node count and its workers' states: only fleets with a group (TP/PP over hosts)
    "multinode": re.compile(r"vllm_fleet_instance_nodes|vllm_fleet_worker_state"),
    # keepalived's VRRP state (the gateways' exporters, --vrrp-state): only fleets of two or more gateways
    "ha": re.compile(r"vllm_fleet_gateway_vrrp_"),
    # each gateway's canary entry (vllm_fleet.fleet.observability.ROLLOUT_METRICS): only while `vllm-fleet
    # rollout` runs (a canary is stopped otherwise); every other family must have series on a deployed fleet
    "rollout": re.compile(r"vllm_fleet_gateway_canary_(?:share|lease_expiry_timestamp_seconds)\b"),
    # whether each carried LoRA adapter is loaded (vllm_fleet.fleet.observability.LORA_METRICS): only fleets
    # whose spec has `adapters` (a LoRA instance's exporter exports it per adapter it carries)
    "lora": re.compile(r"vllm_fleet_instance_adapter_loaded\b"),
    # an instance's sleep mode (vllm_fleet.fleet.observability.SLEEP_METRICS): only fleets with a model that sleeps
    # (models[].sleep; CUDA/ROCm engines only: vLLM-CPU has no sleep mode, so the CI fleet has none)
    "sleep": re.compile(
        r"vllm_fleet_instance_(?:sleep_state|sleep_level|asleep_since_timestamp_seconds|last_active_timestamp_seconds"
        r"|last_wake_seconds|sleeps_total|wakes_total|failed_wakes_total|wake_duration_seconds(?:_sum|_count)?"
        r"|asleep_seconds_total)\b"
    ),
}

# a selector of a rollout's canary (its role / track label, monitoring/prometheus.yml.j2): series only in a fleet
# with a `rollouts` entry (a stopped canary is still a scrape target there); VllmInstanceDown reads one
CANARY_SELECTOR = re.compile(r'\b(?:role|track)="canary"')


def selectors(expr: str) -> list[str]:
    """Every vector selector (metric name + its label matchers) in a PromQL expression; `le` matchers
    are dropped (bucket bounds are not a property of the metric's existence)."""
    out = []
    for name, labels in SELECTOR.findall(expr):
        matchers = [m.strip() for m in labels.strip("{}").split(",") if m.strip()] if labels else []
        matchers = [m for m in matchers if not m.startswith("le")]
        out.append(name + ("{" + ", ".join(matchers) + "}" if matchers else ""))
    return out


def metric_name(selector: str) -> str:
    return selector.split("{", 1)[0]


def substitute(expr: str, instance: str, host: str, window: str) -> str:
    """A dashboard query with Grafana's variables filled in, as Grafana would send it."""
    return (
        expr.replace("$__rate_interval", window)
        .replace('model=~"$model"', 'model=~".*"')
        .replace("$instance", instance)
        .replace("$host", host)
    )


def absent_by_design(name: str, lacks: Iterable[str]) -> bool:
    """True when the family ``name`` belongs to one of the ``lacks`` kinds (keys of ABSENT_BY_DESIGN)."""
    return any(ABSENT_BY_DESIGN[k].search(name) for k in lacks)
