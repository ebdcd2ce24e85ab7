"""The one table of alerts. Everything about an alert is written here once; generated from it:

- the Prometheus rules file (``rules_yaml``, the ``generator:`` of ``alerts/artifacts.yml``),
- the Grafana-managed copies of the alerts that have a ``grafana_uid`` (``grafana.py``),
- the names, summaries and dashboard links the promtool tests expect (``alerts/tests/make_tests.py``),
- the alerts table of docs/observability.md (``markdown_table``; ``tools/alerts_doc.py`` writes it).

Texts hold placeholders ``${name}``, filled per fleet spec:

- ``${KEY}`` for every field ``KEY`` of the spec's ``alerts:`` section (thresholds, ``for`` durations,
  ``rate_window`` ...),
- ``${by}``: the engine label set ``host, instance, model``,
- ``${threshold}``: the alert's threshold (the per-instance value in a per-instance variant),
- ``${sel}``: the instance selector of a per-instance alert (``{instance="a"}``, ``{instance!~"a|b"}``, or
  nothing), written right after a metric name,
- in ``expr`` only: ``${value}`` and ``${op}`` (the entry's fields).

``{{ $labels.x }}`` / ``{{ $value }}`` are Prometheus' own annotation templates and stay as they are.

Per-instance variants: an alert with ``per_instance=True`` reads its threshold from ``models[].alerts.KEY``
where an instance sets it (``KEY`` = ``threshold``): such an instance gets its own rule (``${sel}`` =
``{instance="NAME"}``, labelled ``threshold: "VALUE"``); the fleet-wide rule excludes these instances.
``zero_disables``: a threshold of 0 leaves the rule out (fleet-wide or for that instance).
``needs``: a key of the template context's ``vf`` (e.g. ``gateway_admission_on``); the rule is rendered only
where it is true (an alert on series that only a part of the fleet the spec may leave out exports).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from vllm_fleet.fleet.observability.thresholds import TTFT_BUCKETS
from vllm_fleet.fleet.spec import AlertThresholds

Severity = Literal["critical", "warning", "info", "none"]
BY = "host, instance, model"  # the labels every engine series has (prometheus.yml)
SPEC_KEYS = frozenset(AlertThresholds.model_fields)
SPECIAL = frozenset({"by", "sel", "threshold", "value", "op"})
OVERVIEW_UID = "vllm-fleet-overview"  # the dashboards' uids (the alerts link to them; dashboards.py)
INSTANCE_UID = "vllm-fleet-instance"
_PLACEHOLDER = re.compile(r"\$\{(\w+)\}")
FIXED_FOR = re.compile(r"[1-9][0-9]*[smh]")  # a ``for_`` that is a duration itself, not a spec key
# A canary (``rollouts[].canary``: role canary) is deployed but stopped except during ``vllm-fleet rollout``:
# its engine target (job vllm, always in prometheus.yml) is down then, normally. Its ``up`` series says which
# instance is a canary (the host exporter's series have no role label); its launcher's state whether it runs.
CANARY_UP = 'up{job="vllm", role="canary"}'
CANARY_RUNNING = "ready|draining"  # launcher states of a canary that should answer (loading: not yet)
# Sleep mode (docs/sleep.md): the windows of the wake alerts (the dashboards' wake panels use them too)
WAKE_FAILED_WINDOW = "15m"  # VllmFleetWakeFailed fires while a failed wake is this recent
WAKE_SLOW_WINDOW = "30m"  # VllmFleetWakeSlow: the mean wake duration over this window


@dataclass(frozen=True)
class Alert:
    name: str  # CamelCase: the alertname, the runbook docs/runbooks/NAME.md, the Grafana rule's title
    severity: Severity
    summary: str
    description: str  # Prometheus annotation template
    # the compared PromQL: Grafana queries it and compares the result itself (``$B op threshold``)
    value: str
    op: str | None = None  # comparison of value and threshold; None: ``value`` is the whole expression
    threshold: str | float | None = None  # a key of the spec's ``alerts:`` (str) or a constant
    # key of the spec's ``alerts:`` holding the ``for:`` duration, or a fixed duration ("5m"); None: no ``for``
    for_: str | None = None
    expr: str = "${value} ${op} ${threshold}"  # the Prometheus expression
    scope: Literal["instance", "fleet"] = "instance"  # which dashboard the alert links to
    per_instance: bool = False  # models[].alerts.<threshold> overrides the threshold per instance
    zero_disables: bool = False  # a threshold of 0 leaves the rule out (fleet-wide or for that instance)
    grafana_uid: str | None = None  # also a Grafana-managed rule, with this uid
    group: str = "vllm-fleet"
    section: str = ""  # a comment line above the alert in the rules file
    needs: str = ""  # a key of ``vf``: the alert is rendered only where ``vf[needs]`` is true ("": always)

    @property
    def runbook(self) -> str:
        return f"docs/runbooks/{self.name}.md"

    @property
    def expression(self) -> str:
        """The Prometheus expression template, ``${value}`` / ``${op}`` filled in."""
        if self.op is None:
            return self.value
        values = {"value": self.value, "op": self.op}
        if not isinstance(self.threshold, str):  # a constant; a spec key stays ${threshold}, filled per rule
            values["threshold"] = _num(self.threshold)
        return fill(self.expr, values, keep=True)

    def symbolic(self, text: str) -> str:
        """``text`` with ``${threshold}`` written as the spec key it stands for (docs)."""
        key = f"${{{self.threshold}}}" if isinstance(self.threshold, str) else _num(self.threshold)
        return fill(text, {"threshold": key}, keep=True)

    @property
    def spec_keys(self) -> list[str]:
        """The keys of the spec's ``alerts:`` this alert reads, in order of appearance."""
        keys = [self.threshold] if isinstance(self.threshold, str) else []
        keys += [self.for_] if self.for_ else []
        keys += _PLACEHOLDER.findall(self.symbolic(self.expression + self.description))
        return list(dict.fromkeys(k for k in keys if k in SPEC_KEYS))


def _num(v: Any) -> str:
    return str(v)


def fill(text: str, values: dict[str, str], *, keep: bool = False) -> str:
    """Replace every ``${name}`` by ``values[name]``; an unknown name is an error (or stays, with ``keep``)."""

    def one(m: re.Match[str]) -> str:
        name = m.group(1)
        if name in values:
            return values[name]
        if keep:
            return m.group(0)
        raise KeyError(f"unknown placeholder ${{{name}}} in {text!r}")

    return _PLACEHOLDER.sub(one, text)


# fmt: off
ALERTS: tuple[Alert, ...] = (
    Alert(
        "VllmKvCacheUsageHigh", "warning", section="KV cache",
        summary="vLLM KV cache almost full",
        description="KV cache of {{ $labels.instance }} ({{ $labels.model }} on {{ $labels.host }}) is "
                    "{{ $value | humanizePercentage }} full (warning above ${kv_cache_warning}); new requests "
                    "queue and running ones may be preempted.",
        value="max by (${by}) (vllm:kv_cache_usage_perc)", op=">", threshold="kv_cache_warning",
        for_="kv_cache_for",
    ),
    Alert(
        "VllmKvCacheUsageCritical", "critical", grafana_uid="vf-kv-cache-critical",
        summary="vLLM KV cache full",
        description="KV cache of {{ $labels.instance }} ({{ $labels.model }} on {{ $labels.host }}) is "
                    "{{ $value | humanizePercentage }} full (critical above ${kv_cache_critical}); requests are "
                    "being preempted or queued.",
        value="max by (${by}) (vllm:kv_cache_usage_perc)", op=">", threshold="kv_cache_critical",
        for_="kv_cache_for",
    ),
    Alert(
        "VllmQueueWaitHigh", "warning", section="queue wait", grafana_uid="vf-queue-wait",
        summary="vLLM requests wait too long in the queue",
        description="p99 queue wait of {{ $labels.instance }} ({{ $labels.model }} on {{ $labels.host }}) is "
                    "{{ $value | humanizeDuration }} over ${rate_window} (threshold ${queue_wait_p99_seconds}s).",
        value="histogram_quantile(0.99, sum by (${by}, le) "
              "(rate(vllm:request_queue_time_seconds_bucket[${rate_window}])))",
        op=">", threshold="queue_wait_p99_seconds", for_="queue_wait_for",
    ),
    Alert(
        "VllmDecodeRateLow", "warning", section="decode rate floor",
        summary="vLLM decode rate below its floor while requests run",
        description='{{ $labels.instance }} ({{ $labels.model }} on {{ $labels.host }}) generates '
                    '{{ $value | printf "%.1f" }} tokens/s with requests running (floor ${threshold} tokens/s).',
        value="sum by (${by}) (rate(vllm:generation_tokens_total${sel}[${rate_window}]))",
        op="<", threshold="decode_rate_floor", for_="decode_rate_for",
        expr="${value} ${op} ${threshold}\n"
             "and on (${by})\n"
             "sum by (${by}) (vllm:num_requests_running${sel}) > 0",
        per_instance=True, zero_disables=True,
    ),
    Alert(
        # requests were running during the whole window and not one token was generated in it
        "VllmDecodeStalled", "critical", section="decode stalled",
        summary="vLLM decode stalled: requests running, no tokens generated",
        description="{{ $labels.instance }} ({{ $labels.model }} on {{ $labels.host }}) has had requests running "
                    "for ${decode_stall_for} without generating a token. /health can stay 200 in this state "
                    "(NCCL hang, GPU fault).",
        value="min by (${by}) (min_over_time(vllm:num_requests_running[${decode_stall_for}]))",
        op=">", threshold=0,
        expr="${value} ${op} ${threshold}\n"
             "and on (${by})\n"
             "sum by (${by}) (increase(vllm:generation_tokens_total[${decode_stall_for}])) == 0",
    ),
    Alert(
        "VllmInstanceDown", "critical", section="availability", grafana_uid="vf-instance-down",
        summary="vLLM instance unreachable",
        description="Prometheus cannot scrape {{ $labels.instance }} ({{ $labels.model }} on {{ $labels.host }}) "
                    "and its launcher does not report it loading.",
        # a canary (rollouts[].canary, role canary) is stopped outside `vllm-fleet rollout`: down only while its
        # launcher reports it running (ready, draining), not when it is stopped, never started, or left failed
        value='up{job="vllm", role!="canary"}', op="==", threshold=0, for_="instance_down_for",
        expr='${value} ${op} ${threshold}\n'
             'unless on (instance) (vllm_fleet_instance_state{state="loading"} == 1)\n'
             'or\n'
             + CANARY_UP + ' == 0\n'
             'and on (instance) (vllm_fleet_instance_state{state=~"' + CANARY_RUNNING + '"} == 1)',
    ),
    Alert(
        "VllmUnitRestartLoop", "critical",
        summary="vLLM unit is restarting in a loop",
        description='systemd restarted {{ $labels.unit }} ({{ $labels.instance }} on {{ $labels.host }}) '
                    '{{ $value | printf "%.0f" }} times in ${restart_loop_window} (threshold ${restart_loop_count}).',
        value="increase(vllm_fleet_instance_restarts_total[${restart_loop_window}])",
        op=">=", threshold="restart_loop_count",
    ),
    Alert(
        # the launcher's liveness rule (docs/engine-service.md): a late check while the engine waits for CPUs
        # passes as "starved" for at most starved_grace_seconds; this says the host is short of CPU
        "VllmEngineCpuStarved", "warning",
        summary="vLLM engine starved of CPU: its liveness checks answer late",
        description='{{ $value | printf "%.0f" }} liveness checks of {{ $labels.instance }} ({{ $labels.model }} '
                    "on {{ $labels.host }}) timed out in ${rate_window} while its threads waited for a CPU. It "
                    "serves slowly; the launcher counts such checks as alive for starved_grace_seconds only.",
        value="increase(vllm_fleet_probes_starved_total[${rate_window}])", op=">=", threshold=3,
    ),
    Alert(
        # a multi-node instance (docs/multi-node.md): rank 0's config says how many hosts the group spans
        # (vllm_fleet_instance_nodes), each worker host's exporter whether its rank joined rank 0
        # (vllm_fleet_worker_state); a rank whose host exporter is not scraped counts as not joined
        "VllmMultiNodeGroupPartial", "critical", section="multi-node groups",
        summary="vLLM multi-node group partial: a rank has not joined rank 0",
        description='{{ $value | printf "%.0f" }} rank(s) > 0 of the multi-node instance {{ $labels.instance }} '
                    "({{ $labels.model }}, rank 0 on {{ $labels.host }}) have not joined rank 0 for "
                    "${multinode_partial_for} (waiting for rank 0, rank 0 gone, exited, or their host not "
                    "scraped): the engine group cannot serve until every rank is in it.",
        value="max by (${by}) (vllm_fleet_instance_nodes) - 1\n"
              "- on (instance) group_left ()\n"
              '(sum by (instance) (vllm_fleet_worker_state{state="joined"}) or max by (instance) '
              "(vllm_fleet_instance_nodes) * 0)",
        op=">", threshold=0, for_="multinode_partial_for",
        expr="${value}\n${op} ${threshold}",
    ),
    Alert(
        # LoRA adapters (the spec's adapters[]): each instance that carries an adapter loads it before READY=1 and
        # `vllm-fleet adapters sync` keeps it loaded; each one's host exporter says whether its engine has it
        # (vllm_fleet_instance_adapter_loaded, the adapter state file). Fires when no carrier has it loaded
        "VllmFleetAdapterNotLoaded", "warning", section="LoRA adapters", scope="fleet",
        summary="A LoRA adapter is loaded on none of the instances that carry it",
        description="Adapter {{ $labels.adapter }} of model {{ $labels.model }} has been loaded on none of the "
                    "instances that carry it for 5m: its requests go to engines that load it on demand first "
                    "(slower), or fail where it does not load. `vllm-fleet adapters show` on the carriers' hosts "
                    "says what their engines have loaded; the launcher's journal and `vllm-fleet adapters sync` "
                    "the engine's reason.",
        value="max by (model, adapter) (vllm_fleet_instance_adapter_loaded)", op="==", threshold=0, for_="5m",
    ),
    Alert(
        # sleep mode (docs/sleep.md): the launcher wakes a sleeping engine when its sleep guard holds a request
        # (a swap group's slot first, its least recently used peer put to sleep for it); a wake that fails (the
        # engine's wake_up refused or timed out, no slot in time) answers the held requests 503 with Retry-After.
        # The host exporter's counters are the launcher's (vllm_fleet_instance_failed_wakes_total)
        "VllmFleetWakeFailed", "critical", section="sleep mode",
        summary="A sleeping vLLM engine failed to wake: the requests held for it got 503",
        description='{{ $value | printf "%.0f" }} wake(s) of {{ $labels.instance }} ({{ $labels.model }} on '
                    "{{ $labels.host }}) failed in the last " + WAKE_FAILED_WINDOW + ": the requests held for "
                    "them were answered 503 with Retry-After. The launcher's journal (journalctl -u "
                    "vllm@{{ $labels.instance }}) says why; `vllm-fleet status` shows its sleep state.",
        value="sum by (${by}) (increase(vllm_fleet_instance_failed_wakes_total[" + WAKE_FAILED_WINDOW + "]))",
        op=">", threshold=0,
    ),
    Alert(
        # the wake's duration runs from the guard's signal to awake: the swap group's room made included
        "VllmFleetWakeSlow", "warning",
        summary="A sleeping vLLM engine wakes slowly",
        description="Wakes of {{ $labels.instance }} ({{ $labels.model }} on {{ $labels.host }}) took "
                    "{{ $value | humanizeDuration }} on average over the last " + WAKE_SLOW_WINDOW + " (threshold "
                    "${threshold}s): the first request for a sleeping model waits that long, and a request held "
                    "longer than its wake wait (models[].sleep.wake_wait_seconds) gets 503.",
        value="sum by (${by}) (increase(vllm_fleet_instance_wake_duration_seconds_sum${sel}[" + WAKE_SLOW_WINDOW
              + "]))\n/\nsum by (${by}) (increase(vllm_fleet_instance_wake_duration_seconds_count${sel}["
              + WAKE_SLOW_WINDOW + "]))",
        op=">", threshold="wake_slow_seconds", per_instance=True,
        expr="${value}\n${op} ${threshold}",
    ),
    Alert(
        "VllmGateway5xxRatioHigh", "critical", section="gateway", scope="fleet",
        summary="Gateway answers too many 5xx",
        description="{{ $value | humanizePercentage }} of gateway requests for model {{ $labels.model }} on "
                    "{{ $labels.host }} ended in 5xx over ${rate_window} (threshold ${gateway_5xx_ratio}).",
        value='sum by (host, model) (rate(vllm_fleet_gateway_requests_total{code=~"5.."}[${rate_window}]))\n'
              "/\n"
              "sum by (host, model) (rate(vllm_fleet_gateway_requests_total[${rate_window}]))",
        op=">", threshold="gateway_5xx_ratio", for_="gateway_5xx_for",
        expr="${value}\n${op} ${threshold}",
    ),
    Alert(
        "VllmFailoverActive", "warning", scope="fleet",
        summary="Backup/fallback instances are serving",
        description="Backup or fallback instances of model {{ $labels.model }} are serving traffic: every "
                    "primary is down, drained or failing.",
        # a canary (role canary) serves its share during `vllm-fleet rollout` while every primary serves too
        value="(\n"
              '  sum by (model) (rate(vllm:request_success_total{role!~"primary|canary"}[${rate_window}]))\n'
              '  + sum by (model) (vllm:num_requests_running{role!~"primary|canary"})\n'
              ")",
        op=">", threshold=0,
    ),
    Alert(
        "VllmTtftSloBreached", "warning", section="latency SLO", grafana_uid="vf-ttft-slo",
        summary="vLLM time to first token above its SLO",
        description="p99 time to first token of {{ $labels.instance }} ({{ $labels.model }} on {{ $labels.host }}) "
                    "is {{ $value | humanizeDuration }} over ${rate_window} (SLO ${threshold}s).",
        value="histogram_quantile(0.99, sum by (${by}, le) "
              "(rate(vllm:time_to_first_token_seconds_bucket${sel}[${rate_window}])))",
        op=">", threshold="ttft_p99_slo_seconds", for_="ttft_for", per_instance=True,
    ),
    Alert(
        "VllmPreemptions", "warning", section="preemptions",
        summary="vLLM is preempting requests",
        description='{{ $labels.instance }} ({{ $labels.model }} on {{ $labels.host }}) preempts '
                    '{{ $value | printf "%.2f" }} requests/s (threshold ${preemptions_per_second}/s): the KV cache '
                    'is too small for the load.',
        value="sum by (${by}) (rate(vllm:num_preemptions_total[${rate_window}]))",
        op=">", threshold="preemptions_per_second", for_="preemptions_for",
    ),
    Alert(
        "VllmSaturated", "warning", section="saturation",
        summary="vLLM instance full: its queue bound turns requests away",
        description='{{ $labels.instance }} ({{ $labels.model }} on {{ $labels.host }}) rejects '
                    '{{ $value | printf "%.2f" }} requests/s with 503 (queue bound max_num_queued_reqs reached; '
                    'threshold ${saturation_rejections_per_second}/s): the gateway retries them on other '
                    'instances; add capacity if it lasts.',
        value="sum by (${by}) (rate(vllm:admission_rejections_total[${rate_window}]))",
        op=">", threshold="saturation_rejections_per_second", for_="saturation_for",
    ),
    Alert(
        # gateway.limits (docs/gateway.md, "Per-key limits"): the admission service's per-key series; a key at
        # 100 % of a budget while nothing is refused is a tenant using exactly what it was given
        "VllmFleetKeyAtBudget", "warning", section="per-key limits (gateway admission service)", scope="fleet",
        needs="gateway_admission_on",
        summary="An API key is held at one of its gateway budgets and refused",
        description="Key {{ $labels.key }} (client {{ $labels.client }}) has used {{ $value | humanizePercentage }} "
                    "of its {{ $labels.budget }} budget for ${key_at_budget_for}, and the gateway refused some of "
                    "its requests (429) in the last ${rate_window}.",
        value="max by (client, key, budget) (vllm_fleet_gateway_key_budget_used_ratio)",
        op=">=", threshold=1, for_="key_at_budget_for",
        expr="${value} ${op} ${threshold}\n"
             "and on (client, key)\n"
             "sum by (client, key) (increase(vllm_fleet_gateway_key_refused_total[${rate_window}])) > 0",
    ),
    Alert(
        # the service not scraped, or nginx admitting requests without it (fail open: it did not answer, e.g. its
        # listen backlog was full; counted by the host exporter from the gateway's access log)
        "VllmFleetGatewayAdmissionDown", "critical", scope="fleet", needs="gateway_admission_on",
        summary="Gateway admission service unreachable: per-key limits not applied",
        description="The admission service of the gateway on {{ $labels.host }} (vllm-fleet-admission.service) "
                    "cannot be scraped, or nginx admitted requests without it (fail open: it did not answer) in "
                    "the last ${rate_window}, for ${admission_down_for}: nginx admits such requests unlimited "
                    "(gateway.limits.on_failure: open) or answers 503 (closed).",
        value='up{job="vllm-fleet-admission"}', op="==", threshold=0, for_="admission_down_for",
        expr="${value} ${op} ${threshold}\n"
             "or\n"
             "sum by (host) (increase(vllm_fleet_gateway_admission_fail_open_total[${rate_window}])) > 0",
    ),
    Alert(
        # gateway.hosts (docs/design/ha.md): each gateway's host exporter reads keepalived's state
        # (vllm_fleet_gateway_vrrp_master, 1 on the holder). A dead holder exports nothing, so the sum over the
        # gateways that answer is 0; every gateway lost (no series at all) is the second clause. One gateway: no
        # VRRP series and one nginx target, nothing fires. Each Prometheus evaluates this alone: one cut off
        # from the holder sees no holder (its peer alert fires too)
        "VllmFleetGatewayAddressNotHeld", "critical", scope="fleet",
        section="high availability (gateway.hosts, monitoring.hosts)",
        summary="No gateway holds the fleet's virtual address",
        description="No gateway reports holding the virtual address (gateway.virtual_address: keepalived MASTER) "
                    "for ${gateway_address_for}, or every gateway's nginx exporter is down: clients of the address "
                    "get no answer. `vllm-fleet status` shows each gateway's VRRP state.",
        value="sum(vllm_fleet_gateway_vrrp_master)", op="==", threshold=0, for_="gateway_address_for",
        expr="${value} ${op} ${threshold}\n"
             "or on ()\n"
             '(sum(up{job="nginx"}) == 0 and on () count(up{job="nginx"}) > 1)',
    ),
    Alert(
        # two holders: their VRRP advertisements do not reach each other (protocol 112 blocked between them, an
        # interface down on one side, another router with the same virtual_router_id)
        "VllmFleetGatewayAddressSplit", "critical", scope="fleet",
        summary="Two or more gateways hold the fleet's virtual address (split brain)",
        description='{{ $value | printf "%.0f" }} gateways report holding the virtual address '
                    "(gateway.virtual_address: keepalived MASTER) for ${gateway_address_for}: their VRRP "
                    "advertisements do not reach each other, and clients' connections go to either.",
        value="sum(vllm_fleet_gateway_vrrp_master)", op=">", threshold=1, for_="gateway_address_for",
    ),
    Alert(
        # a gateway of two or more that could not take the address over: its nginx exporter or host exporter
        # not scraped (the host, or its network, is gone), or its keepalived in FAULT (its nginx does not answer),
        # STOP or UNKNOWN (not running); while another gateway's nginx exporter answers (none: NotHeld)
        "VllmFleetGatewayPeerDown", "warning", scope="fleet",
        summary="A gateway of the HA pair is lost: the virtual address has no standby there",
        description="Gateway host {{ $labels.host }} has been lost for ${ha_peer_down_for} "
                    '({{ $value | printf "%.0f" }} sign(s): its nginx exporter or host exporter not scraped, or '
                    "its keepalived in FAULT, STOP or UNKNOWN) while another gateway serves: it cannot take the "
                    "virtual address over, one more failure and no gateway holds it.",
        value="count by (host) (\n"
              '  up{job="nginx"} == 0\n'
              '  or (up{job="vllm-fleet-exporter"} == 0 and on (host) up{job="nginx"})\n'
              '  or vllm_fleet_gateway_vrrp_state{state=~"FAULT|STOP|UNKNOWN"} == 1\n'
              ")",
        op=">=", threshold=1, for_="ha_peer_down_for",
        expr="${value}\n${op} ${threshold}\n"
             'and on () count(up{job="nginx"} == 1) >= 1\n'
             'and on () count(up{job="nginx"}) > 1',
    ),
    Alert(
        # monitoring.hosts (docs/design/ha.md): every Prometheus scrapes every Prometheus and Alertmanager (job
        # prometheus, alertmanager), so each sees a lost peer; an Alertmanager whose cluster has fewer members
        # than the Alertmanagers that answer is cut off from the others' gossip (notifications and silences no
        # longer shared: duplicates). Only with two or more Alertmanager targets
        "VllmFleetMonitoringPeerDown", "warning", scope="fleet",
        summary="A Prometheus or Alertmanager of the monitoring pair is down or out of the cluster",
        description='{{ if eq $labels.problem "down" }}Prometheus cannot scrape the {{ $labels.job }} of '
                    "monitoring host {{ $labels.host }}{{ else }}The Alertmanager of monitoring host "
                    '{{ $labels.host }} has {{ $value | printf "%.0f" }} cluster member(s), fewer than the '
                    "Alertmanagers that answer (their gossip on monitoring.alertmanager_cluster_port does not "
                    "pass){{ end }} for ${ha_peer_down_for}: the monitoring pair has lost its redundancy.",
        value='(\n'
              '  label_replace(up{job=~"prometheus|alertmanager"} == 0, "problem", "down", "", "")\n'
              "  or\n"
              '  label_replace(alertmanager_cluster_members < on () group_left () count(up{job="alertmanager"} == 1), '
              '"problem", "cluster", "", "")\n'
              ")\n"
              'and on () count(up{job="alertmanager"}) > 1',
        for_="ha_peer_down_for",
    ),
    Alert(
        "Watchdog", "none", section="pipeline", scope="fleet",
        summary="Always firing: proves Prometheus -> Alertmanager works",
        description="This alert always fires. If it stops arriving at its receiver, the alerting pipeline is "
                    "broken.",
        value="vector(1)",
    ),
)
# fmt: on
BY_NAME = {a.name: a for a in ALERTS}


# ---------------------------------------------------------------------------------------------------- rules


@dataclass(frozen=True)
class Rule:
    """One Prometheus rule of an alert: the fleet-wide one, or a per-instance variant."""

    alert: Alert
    expr: str
    for_: str | None
    labels: dict[str, str]
    annotations: dict[str, str]


def for_duration(a: dict[str, Any], alert: Alert) -> str | None:
    """The ``for:`` of ``alert``'s rule: the spec's ``alerts:`` value (``a``) of its key, or its fixed duration."""
    if alert.for_ is None:
        return None
    return alert.for_ if FIXED_FOR.fullmatch(alert.for_) else a[alert.for_]


def spec_values(a: dict[str, Any]) -> dict[str, str]:
    """The placeholders' values of the spec's ``alerts:`` (``a``), and ``${by}``."""
    return {k: _num(v) for k, v in a.items() if k in SPEC_KEYS} | {"by": BY}


def dashboard_url(vf: dict[str, Any], alert: Alert) -> str:
    grafana = vf["monitoring"]["grafana"]["url"].rstrip("/")
    if alert.scope == "instance":
        return f"{grafana}/d/{INSTANCE_UID}/{INSTANCE_UID}?var-instance={{{{ $labels.instance }}}}"
    return f"{grafana}/d/{OVERVIEW_UID}/{OVERVIEW_UID}"


def runbook_url(vf: dict[str, Any], alert: Alert) -> str:
    return vf["alerts"]["runbook_base_url"].rstrip("/") + f"/{alert.name}.md"


def _rule(vf: dict[str, Any], alert: Alert, sel: str, threshold: Any) -> Rule:
    values = spec_values(vf["alerts"]) | {"sel": sel, "threshold": _num(threshold)}
    labels: dict[str, str] = {"severity": alert.severity}
    if alert.per_instance:
        labels["threshold"] = _num(threshold)
    return Rule(
        alert=alert,
        expr=fill(alert.expression, values),
        for_=for_duration(vf["alerts"], alert),
        labels=labels,
        annotations={
            "summary": fill(alert.summary, values),
            "description": fill(alert.description, values),
            "runbook_url": runbook_url(vf, alert),
            "dashboard_url": dashboard_url(vf, alert),
        },
    )


def rules(vf: dict[str, Any], alerts: tuple[Alert, ...] = ALERTS) -> list[Rule]:
    """Every Prometheus rule for the fleet ``vf`` (the template context's ``vf``), in table order."""
    a = vf["alerts"]
    out: list[Rule] = []
    for alert in alerts:
        if alert.needs and not vf[alert.needs]:
            continue
        fleet = a[alert.threshold] if isinstance(alert.threshold, str) else alert.threshold
        if not alert.per_instance:
            out.append(_rule(vf, alert, "", fleet))
            continue
        assert isinstance(alert.threshold, str)
        key = alert.threshold
        own = [i for i in vf["all_instances"] if i["alerts"].get(key) is not None]
        others = '{instance!~"' + "|".join(i["name"] for i in own) + '"}' if own else ""
        if not (alert.zero_disables and fleet == 0):
            out.append(_rule(vf, alert, others, fleet))
        for i in own:
            if not (alert.zero_disables and i["alerts"][key] == 0):
                out.append(_rule(vf, alert, f'{{instance="{i["name"]}"}}', i["alerts"][key]))
    return out


def check_ttft_buckets(vf: dict[str, Any]) -> None:
    """The TTFT SLO must be a bound of vLLM's time_to_first_token histogram, else "p99 > SLO" is an
    interpolation guess; instances that set their own bounds (--custom-histogram-buckets) are not checked
    (the planner's ``check_alert_thresholds`` checks those against their own bounds)."""
    for i in vf["all_instances"]:
        if "--custom-histogram-buckets" in " ".join(i["extra_args"]):
            continue
        own = i["alerts"].get("ttft_p99_slo_seconds")
        slo = own if own is not None else vf["alerts"]["ttft_p99_slo_seconds"]
        if slo not in TTFT_BUCKETS:
            raise ValueError(
                f"TTFT SLO {slo}s of instance {i['name']} (ttft_p99_slo_seconds) is not a bucket bound of "
                f"vLLM's TTFT histogram {list(TTFT_BUCKETS)}: use a bound, or add it with "
                "--custom-histogram-buckets (see docs/observability.md)"
            )


def _q(s: str) -> str:
    return json.dumps(s)


def rules_yaml(ctx: dict[str, Any]) -> str:
    """The Prometheus rules file (generator of alerts/artifacts.yml)."""
    vf = ctx["vf"]
    check_ttft_buckets(vf)
    out = [
        f"# {ctx['ansible_managed']}",
        f"# vllm-fleet alert rules for fleet {vf['name']} (spec {vf['spec_hash']}), generated from the alerts",
        "# table vllm_fleet/fleet/observability/alerts.py. Every threshold comes from the fleet spec (`alerts:`",
        "# and per-instance `models[].alerts:`). Metric names are the ones vLLM 0.32 exports",
        "# (docs/observability.md), with `_total` on counters. Labels on every engine series (set by",
        "# prometheus.yml): host, instance (= the fleet instance name), model (= served model name), role, pool.",
        "groups:",
    ]
    all_rules = rules(vf, ALERTS)
    for group in dict.fromkeys(a.group for a in ALERTS):
        out += [f"  - name: {group}", "    rules:"]
        seen: set[str] = set()
        for r in all_rules:
            a = r.alert
            if a.group != group:
                continue
            out.append("")
            if a.section and a.name not in seen:
                out.append(f"      # {'-' * 64} {a.section}")
            seen.add(a.name)
            out.append(f"      - alert: {a.name}")
            if a.op is None and "\n" not in r.expr:  # a constant expression (Watchdog): one plain line
                out.append(f"        expr: {r.expr}")
            else:
                out.append("        expr: |")
                out += [f"          {line}" for line in r.expr.splitlines()]
            if r.for_:
                out.append(f"        for: {r.for_}")
            out.append("        labels:")
            out += [f"          {k}: {v if k == 'severity' else _q(v)}" for k, v in r.labels.items()]
            out.append("        annotations:")
            out += [f"          {k}: {_q(v)}" for k, v in r.annotations.items()]
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------------- docs


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def markdown_table() -> str:
    """The alerts table of docs/observability.md."""
    rows = [
        "| Alert | Severity | Expression (`${key}`: the spec's `alerts.key`) | for | Summary |",
        "|---|---|---|---|---|",
    ]
    for a in ALERTS:
        expr = fill(a.symbolic(a.expression), {"by": BY, "sel": ""}, keep=True)
        notes = []
        if a.per_instance:
            notes.append(f"per instance: `models[].alerts.{a.threshold}`")
        if a.zero_disables:
            notes.append("0 disables")
        if a.grafana_uid:
            notes.append("also a Grafana rule")
        if a.needs:
            notes.append(f"only where `vf.{a.needs}`")
        cell = f"`{_cell(expr)}`" + (f" ({'; '.join(notes)})" if notes else "")
        for_ = f"`{a.for_}`" if a.for_ else "-"
        rows.append(
            f"| [{a.name}](runbooks/{a.name}.md) | {a.severity} | {cell} | {for_} | {_cell(a.summary)} |"
        )
    return "\n".join(rows) + "\n"
