"""Observability helpers shared by the alert rules, the dashboards and their tests.

``VLLM_METRICS`` is the list of metric names vLLM 0.32 exports (read from a live engine's /metrics, see
docs/observability.md; the catalogue is ``vllm_fleet.vllm_metrics``). Queries must use only these (and the
exporters' names); the live test proves it. The alert-threshold checks of the planner are in ``thresholds``
(re-exported here); rendering only the monitoring folders is ``vllm_fleet.fleet.render.render_monitoring``. Nothing here
imports the renderer: the planner imports ``thresholds``, and so this package.
"""

from __future__ import annotations

from vllm_fleet.fleet.observability.thresholds import REQUEST_LATENCY_BUCKETS as REQUEST_LATENCY_BUCKETS
from vllm_fleet.fleet.observability.thresholds import TTFT_BUCKETS as TTFT_BUCKETS
from vllm_fleet.fleet.observability.thresholds import check_alert_thresholds as check_alert_thresholds
from vllm_fleet.vllm_metrics import VLLM_COUNTERS as VLLM_COUNTERS
from vllm_fleet.vllm_metrics import VLLM_GAUGES as VLLM_GAUGES
from vllm_fleet.vllm_metrics import VLLM_HISTOGRAMS as VLLM_HISTOGRAMS
from vllm_fleet.vllm_metrics import VLLM_METRICS as VLLM_METRICS

# The gateway admission service's families (``vllm-fleet admission``, gateway.limits; scraped by the job
# ``vllm-fleet-admission`` with labels host, instance). Per key: labels client, key (``CLIENT/8 hex digits``);
# refused by reason (in_flight, rpm, tpm, too_large, queue_full, wait_timeout, capacity); tokens by kind
# (reserved, settled); budget used by budget (in_flight, rpm, tpm: the budgets that are set). Per route: model.
ADMISSION_METRICS = (
    "vllm_fleet_gateway_key_admitted_total",
    "vllm_fleet_gateway_key_refused_total",
    "vllm_fleet_gateway_key_in_flight",
    "vllm_fleet_gateway_key_queued",
    "vllm_fleet_gateway_key_tokens_total",
    "vllm_fleet_gateway_key_queue_wait_seconds",  # a histogram: _bucket, _sum, _count
    "vllm_fleet_gateway_key_budget_used_ratio",
    "vllm_fleet_gateway_admission_leases_expired_total",
    "vllm_fleet_gateway_route_capacity",
    "vllm_fleet_gateway_route_in_flight",
    "vllm_fleet_gateway_admission_up",
)
ADMISSION_JOB = "vllm-fleet-admission"  # monitoring/prometheus.yml.j2

# High availability (gateway.hosts, monitoring.hosts; docs/design/ha.md): the host exporter's VRRP families on a
# gateway of two or more (``--vrrp-state``: vllm_fleet/host/exporter/vrrp.py; labels host, instance and, on
# ``_state``, state = MASTER | BACKUP | FAULT | STOP | UNKNOWN), and Alertmanager's own cluster gauge (every
# Prometheus scrapes every Alertmanager: job ``alertmanager``)
VRRP_METRICS = (
    "vllm_fleet_gateway_vrrp_master",
    "vllm_fleet_gateway_vrrp_state",
    "vllm_fleet_gateway_vrrp_state_since_timestamp_seconds",
)
ALERTMANAGER_CLUSTER_METRICS = ("alertmanager_cluster_members",)

# Canary rollouts (rollouts[], ``vllm-fleet rollout``): each gateway's entry per canary, exported by its host
# exporter (labels host, instance = the canary, model) only while a rollout holds the canary's lease: no series
# outside a rollout (vllm_fleet.devtools.promql.ABSENT_BY_DESIGN["rollout"])
ROLLOUT_METRICS = (
    "vllm_fleet_gateway_canary_share",
    "vllm_fleet_gateway_canary_lease_expiry_timestamp_seconds",
)

# LoRA adapters (the spec's adapters[], docs: vllm_fleet/host/adapters.py): each LoRA instance's host exporter says
# per adapter it carries whether its engine has it loaded (labels host, instance, model, adapter): no series on a
# fleet without adapters (vllm_fleet.devtools.promql.ABSENT_BY_DESIGN["lora"])
LORA_METRICS = ("vllm_fleet_instance_adapter_loaded",)

# Sleep mode (models[].sleep, docs/sleep.md): each host exporter's series of an instance whose model sleeps, from
# its launcher's state file (labels host, instance, model; ``_sleep_state`` also state ∈ contracts.SLEEP_STATES):
# no series on a fleet without a sleeping model, as the CI fleet's (vLLM-CPU cannot sleep:
# vllm_fleet.devtools.promql.ABSENT_BY_DESIGN["sleep"])
SLEEP_METRICS = (
    "vllm_fleet_instance_sleep_state",
    "vllm_fleet_instance_sleep_level",
    "vllm_fleet_instance_asleep_since_timestamp_seconds",
    "vllm_fleet_instance_last_active_timestamp_seconds",
    "vllm_fleet_instance_last_wake_seconds",
    "vllm_fleet_instance_sleeps_total",
    "vllm_fleet_instance_wakes_total",
    "vllm_fleet_instance_failed_wakes_total",
    "vllm_fleet_instance_wake_duration_seconds",  # a summary: _sum, _count
    "vllm_fleet_instance_asleep_seconds_total",
)
