"""Grafana dashboards (grafanalib): fleet overview and instance drill-down with GPU panels.

The overview ends with a "Sleep" row where some model sleeps (``models[].sleep``) and a "Keys" row where the
gateway runs the admission service.

Render generators (dashboards/artifacts.yml) call ``overview_json(ctx)`` / ``instance_json(ctx)`` with the
template context; thresholds are drawn at the alert thresholds of ``vf.alerts``. ``panel_queries()`` lists
every query with the variables it needs, for the live test that runs each one against a real Prometheus.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import grafanalib.core as G
from grafanalib._gen import DashboardEncoder

from vllm_fleet.contracts import SLEEP_STATES
from vllm_fleet.fleet.observability.alerts import INSTANCE_UID, OVERVIEW_UID, WAKE_SLOW_WINDOW

RI = "$__rate_interval"
M = 'model=~"$model"'
I = 'instance="$instance"'  # noqa: E741 - PromQL selector fragment
H = 'host=~"$host"'
# the overview's canary rollout panels (rollouts[]): the engines' track label (canary / stable, prometheus.yml)
CANARY_PANEL = "Canary vs stable: TTFT / end-to-end p95 by track"
CANARY_SHARE_PANEL = "Canary share of requests (gateway)"


@dataclass
class PanelDef:
    title: str
    exprs: list[tuple[str, str]]  # (expr, legend)
    unit: str = ""
    thresholds: list[tuple[str, float]] | None = None  # (color, value) lines at alert thresholds
    gpu_only: bool = False
    description: str = ""
    stat: bool = False
    # a state timeline: the query's value is a state's index, shown as its name and colour: (value, name, colour)
    states: list[tuple[int, str, str]] | None = None


def _p(quantile: float, metric: str, sel: str, by: str) -> str:
    return f"histogram_quantile({quantile}, sum by ({by}, le) (rate({metric}_bucket{{{sel}}}[{RI}])))"


def overview_panels(a: dict[str, Any]) -> list[PanelDef]:
    by = "model"
    return [
        PanelDef(
            "Requests/s (finished)",
            [(f"sum by (model) (rate(vllm:request_success_total{{{M}}}[{RI}]))", "{{model}}")],
            "reqps",
        ),
        PanelDef(
            "Tokens/s",
            [
                (f"sum by (model) (rate(vllm:generation_tokens_total{{{M}}}[{RI}]))", "{{model}} generated"),
                (f"sum by (model) (rate(vllm:prompt_tokens_total{{{M}}}[{RI}]))", "{{model}} prompt"),
            ],
            "short",
        ),
        PanelDef(
            "Time to first token p50 / p99",
            [
                (_p(0.5, "vllm:time_to_first_token_seconds", M, by), "{{model}} p50"),
                (_p(0.99, "vllm:time_to_first_token_seconds", M, by), "{{model}} p99"),
            ],
            "s",
            [("red", a["ttft_p99_slo_seconds"])],
        ),
        PanelDef(
            "Inter-token latency p50 / p99",
            [
                (_p(0.5, "vllm:inter_token_latency_seconds", M, by), "{{model}} p50"),
                (_p(0.99, "vllm:inter_token_latency_seconds", M, by), "{{model}} p99"),
            ],
            "s",
        ),
        PanelDef(
            "End-to-end latency p50 / p99",
            [
                (_p(0.5, "vllm:e2e_request_latency_seconds", M, by), "{{model}} p50"),
                (_p(0.99, "vllm:e2e_request_latency_seconds", M, by), "{{model}} p99"),
            ],
            "s",
        ),
        PanelDef(
            "Queue wait p99",
            [(_p(0.99, "vllm:request_queue_time_seconds", M, by), "{{model}} p99")],
            "s",
            [("orange", a["queue_wait_p99_seconds"])],
        ),
        PanelDef(
            "KV cache usage (max over instances)",
            [(f"max by (model, instance) (vllm:kv_cache_usage_perc{{{M}}})", "{{model}} {{instance}}")],
            "percentunit",
            [("orange", a["kv_cache_warning"]), ("red", a["kv_cache_critical"])],
        ),
        PanelDef(
            "Requests running / waiting",
            [
                (f"sum by (model) (vllm:num_requests_running{{{M}}})", "{{model}} running"),
                (f"sum by (model) (vllm:num_requests_waiting{{{M}}})", "{{model}} waiting"),
            ],
            "short",
        ),
        PanelDef(
            "Preemptions/s",
            [(f"sum by (model) (rate(vllm:num_preemptions_total{{{M}}}[{RI}]))", "{{model}}")],
            "short",
            [("orange", a["preemptions_per_second"])],
        ),
        PanelDef(
            "Prefix cache hit rate",
            [
                (
                    f"sum by (model) (rate(vllm:prefix_cache_hits_total{{{M}}}[{RI}]))"
                    f" / sum by (model) (rate(vllm:prefix_cache_queries_total{{{M}}}[{RI}]))",
                    "{{model}}",
                )
            ],
            "percentunit",
        ),
        PanelDef(
            "Errors: gateway 5xx ratio, aborted requests/s",
            [
                (
                    f'sum by (model) (rate(vllm_fleet_gateway_requests_total{{code=~"5..", {M}}}[{RI}]))'
                    f" / sum by (model) (rate(vllm_fleet_gateway_requests_total{{{M}}}[{RI}]))",
                    "{{model}} gateway 5xx ratio",
                ),
                (
                    f'sum by (model) (rate(vllm:request_success_total{{finished_reason="abort", {M}}}[{RI}]))',
                    "{{model}} aborted/s",
                ),
            ],
            "short",
            [("red", a["gateway_5xx_ratio"])],
        ),
        PanelDef(
            "Failover: backup/fallback traffic, gateway retries",
            [
                (
                    # a canary (role canary) serves its share during a rollout: not a failover
                    f'sum by (model) (rate(vllm:request_success_total{{role!~"primary|canary", {M}}}[{RI}]))',
                    "{{model}} served by backup/fallback",
                ),
                (
                    f"sum by (model) (rate(vllm_fleet_gateway_upstream_retries_total{{{M}}}[{RI}]))",
                    "{{model}} retried on another upstream",
                ),
                (
                    f"sum by (model, retried) (rate(vllm_fleet_gateway_upstream_failed_tries_total{{{M}}}[{RI}]))",
                    "{{model}} upstream tries failed (sent again: {{retried}})",
                ),
            ],
            "reqps",
        ),
        PanelDef(
            CANARY_PANEL,
            [
                (
                    _p(0.95, "vllm:time_to_first_token_seconds", M, "model, track"),
                    "{{model}} {{track}} TTFT p95",
                ),
                (
                    _p(0.95, "vllm:e2e_request_latency_seconds", M, "model, track"),
                    "{{model}} {{track}} e2e p95",
                ),
            ],
            "s",
            description="p95 per model and track (canary: the rollout's canary, stable: every other instance); "
            "the rollout gate compares the same p95s (rollouts[].margin)",
        ),
        PanelDef(
            CANARY_SHARE_PANEL,
            [(f"max by (model, host) (vllm_fleet_gateway_canary_share{{{M}}})", "{{model}} on {{host}}")],
            "percentunit",
            description="share of the model's requests each gateway sends its canary while `vllm-fleet rollout` "
            "holds the canary's lease; no series outside a rollout",
        ),
        PanelDef(
            "Instances ready (launcher state)",
            [(f'sum by (model) (vllm_fleet_instance_state{{state="ready", {M}}})', "{{model}} ready")],
            "short",
        ),
        PanelDef(
            "Instances scraped (up)",
            [(f'sum by (model) (up{{job="vllm", {M}}})', "{{model}} up")],
            "short",
        ),
    ]


KEYS_ROW = "Keys"  # the overview's row of the gateway admission service's per-key series (gateway.limits)
TOP = 10  # keys per panel
KEY = "{{key}} ({{client}})"


def key_panels(a: dict[str, Any]) -> list[PanelDef]:
    """The overview's "Keys" row, where the gateway runs the admission service (``vf.gateway_admission_on``):
    the busiest keys by client and key id (``CLIENT/8 hex digits``)."""
    adm = "vllm_fleet_gateway_key_"
    return [
        PanelDef(
            f"Top {TOP} keys: requests admitted/s",
            [(f"topk({TOP}, sum by (client, key) (rate({adm}admitted_total[{RI}])))", KEY)],
            "reqps",
        ),
        PanelDef(
            f"Top {TOP} keys: requests queued for admission",
            [(f"topk({TOP}, sum by (client, key) ({adm}queued))", KEY)],
            "short",
        ),
        PanelDef(
            "Requests refused/s by reason",
            [
                (f"sum by (reason) (rate({adm}refused_total[{RI}]))", "{{reason}}"),
                (
                    f"topk({TOP}, sum by (client, key, reason) (rate({adm}refused_total[{RI}])))",
                    KEY + " {{reason}}",
                ),
            ],
            "reqps",
            description="429 from the gateway's admission service: in_flight, rpm, tpm, too_large, queue_full, "
            "wait_timeout, capacity",
        ),
        PanelDef(
            f"Top {TOP} keys: tokens/min settled",
            [
                (
                    f'topk({TOP}, sum by (client, key) (rate({adm}tokens_total{{kind="settled"}}[{RI}])) * 60)',
                    KEY,
                )
            ],
            "short",
            description="prompt + completion tokens of finished requests (what the tokens_per_minute budget counts)",
        ),
        PanelDef(
            f"Top {TOP} keys: admission wait p50 / p90",
            [
                (f"topk({TOP}, {_p(0.5, adm + 'queue_wait_seconds', '', 'client, key')})", KEY + " p50"),
                (f"topk({TOP}, {_p(0.9, adm + 'queue_wait_seconds', '', 'client, key')})", KEY + " p90"),
            ],
            "s",
        ),
        PanelDef(
            f"Top {TOP} keys: budget used",
            [(f"topk({TOP}, max by (client, key, budget) ({adm}budget_used_ratio))", KEY + " {{budget}}")],
            "percentunit",
            [("red", 1.0)],
            description="share of each budget the key has set (in_flight now, rpm and tpm over the sliding "
            "minute); at 100 % its requests wait or are refused (VllmFleetKeyAtBudget)",
        ),
    ]


SLEEP_ROW = "Sleep"  # the overview's row of sleep mode (models[].sleep), where some instance sleeps
SLEEP_STATE_PANEL = "Sleep state per instance"
SLEEP_WINDOW = "1h"  # wakes, failed wakes and time asleep: per hour
_SLEEP_COLOURS = {"awake": "green", "sleeping": "yellow", "asleep": "blue", "waking": "orange"}
SLEEP = "vllm_fleet_instance_"
SLEEP_BY = "model, instance"


def sleep_state_expr() -> str:
    """One series per instance that sleeps: the index of its sleep state in ``SLEEP_STATES`` (awake 0, sleeping 1,
    asleep 2, waking 3), from the exporter's one-hot ``sleep_state``."""
    return " + ".join(
        f'{k} * max by ({SLEEP_BY}) ({SLEEP}sleep_state{{state="{s}", {M}}})'
        for k, s in enumerate(SLEEP_STATES)
        if k
    )


def sleep_panels(a: dict[str, Any]) -> list[PanelDef]:
    """The overview's "Sleep" row, where a model sleeps (``models[].sleep``): each instance's sleep state over
    time, its wakes per hour, its mean wake duration (line at the VllmFleetWakeSlow threshold), its failed wakes
    and the share of the last hour it slept."""
    per = f"[{SLEEP_WINDOW}]"
    wake = f"{SLEEP}wake_duration_seconds"
    return [
        PanelDef(
            SLEEP_STATE_PANEL,
            [(sleep_state_expr(), "{{instance}}")],
            states=[(k, s, _SLEEP_COLOURS[s]) for k, s in enumerate(SLEEP_STATES)],
            description="awake, sleeping (going to sleep), asleep (GPU memory freed), waking; the launcher's state "
            "file via the host exporter",
        ),
        PanelDef(
            "Wakes per hour",
            [(f"sum by ({SLEEP_BY}) (increase({SLEEP}wakes_total{{{M}}}{per}))", "{{instance}}")],
            "short",
            description="wakes completed in the last hour (each one the first request to a sleeping instance)",
        ),
        PanelDef(
            f"Mean wake duration ({WAKE_SLOW_WINDOW})",
            [
                (
                    f"sum by ({SLEEP_BY}) (increase({wake}_sum{{{M}}}[{WAKE_SLOW_WINDOW}]))"
                    f" / sum by ({SLEEP_BY}) (increase({wake}_count{{{M}}}[{WAKE_SLOW_WINDOW}]))",
                    "{{instance}}",
                )
            ],
            "s",
            [("orange", a["wake_slow_seconds"])],
            description="the wake signal to awake, a swap group's room made included (VllmFleetWakeSlow above "
            "the line; an instance's own models[].alerts.wake_slow_seconds is not drawn)",
        ),
        PanelDef(
            "Failed wakes per hour",
            [(f"sum by ({SLEEP_BY}) (increase({SLEEP}failed_wakes_total{{{M}}}{per}))", "{{instance}}")],
            "short",
            description="each failed wake answered the requests held for it 503 with Retry-After "
            "(VllmFleetWakeFailed)",
        ),
        PanelDef(
            f"Time asleep (share of the last {SLEEP_WINDOW})",
            [(f"sum by ({SLEEP_BY}) (rate({SLEEP}asleep_seconds_total{{{M}}}{per}))", "{{instance}}")],
            "percentunit",
            description="the GPU time the instance gave back by sleeping",
        ),
    ]


def sleeps(vf: dict[str, Any]) -> bool:
    """Whether some instance of the fleet sleeps (its context's ``sleep``: the model's ``sleep``)."""
    return any(i.get("sleep") for i in vf["all_instances"])


def instance_panels(a: dict[str, Any]) -> list[PanelDef]:
    by = "instance"
    g = "gpu, host"
    return [
        PanelDef(
            "Launcher state", [(f"vllm_fleet_instance_state{{{I}}} == 1", "{{state}}")], "short", stat=True
        ),
        PanelDef(
            "Load duration (last start)", [(f"vllm_fleet_instance_load_duration_seconds{{{I}}}", "load")], "s"
        ),
        PanelDef(
            "Generation probe latency / failures",
            [
                (f"vllm_fleet_probe_latency_seconds{{{I}}}", "latency"),
                (f"increase(vllm_fleet_probe_failures_total{{{I}}}[{RI}])", "failures"),
            ],
            "s",
        ),
        PanelDef(
            "Unit restarts (systemd NRestarts)",
            [(f"vllm_fleet_instance_restarts_total{{{I}}}", "restarts")],
            "short",
            [("red", float(a["restart_loop_count"]))],
            description="needs systemd on the host",
        ),
        PanelDef(
            "KV cache usage",
            [(f"vllm:kv_cache_usage_perc{{{I}}}", "kv cache")],
            "percentunit",
            [("orange", a["kv_cache_warning"]), ("red", a["kv_cache_critical"])],
        ),
        PanelDef(
            "Requests running / waiting",
            [
                (f"vllm:num_requests_running{{{I}}}", "running"),
                (f"vllm:num_requests_waiting{{{I}}}", "waiting"),
            ],
            "short",
        ),
        PanelDef(
            "Decode rate (generated tokens/s)",
            [(f"sum by (instance) (rate(vllm:generation_tokens_total{{{I}}}[{RI}]))", "tokens/s")],
            "short",
            [("orange", a["decode_rate_floor"])] if a["decode_rate_floor"] > 0 else None,
        ),
        PanelDef(
            "TTFT / ITL / queue wait p99",
            [
                (_p(0.99, "vllm:time_to_first_token_seconds", I, by), "TTFT p99"),
                (_p(0.99, "vllm:inter_token_latency_seconds", I, by), "ITL p99"),
                (_p(0.99, "vllm:request_queue_time_seconds", I, by), "queue wait p99"),
                (_p(0.99, "vllm:request_prefill_time_seconds", I, by), "prefill p99"),
            ],
            "s",
            [("red", a["ttft_p99_slo_seconds"])],
        ),
        PanelDef(
            "Preemptions/s",
            [(f"rate(vllm:num_preemptions_total{{{I}}}[{RI}])", "preemptions/s")],
            "short",
            [("orange", a["preemptions_per_second"])],
        ),
        PanelDef(
            "GPU utilisation",
            [(f"vllm_fleet_gpu_utilization_ratio{{{H}}}", "GPU {{gpu}}")],
            "percentunit",
            gpu_only=True,
        ),
        PanelDef(
            "GPU memory used",
            [
                (
                    f"vllm_fleet_gpu_memory_used_bytes{{{H}}} / vllm_fleet_gpu_memory_total_bytes{{{H}}}",
                    "GPU {{gpu}}",
                )
            ],
            "percentunit",
            gpu_only=True,
        ),
        PanelDef(
            "GPU temperature / power",
            [
                (f"vllm_fleet_gpu_temperature_celsius{{{H}}}", "GPU {{gpu}} °C"),
                (f"vllm_fleet_gpu_power_watts{{{H}}}", "GPU {{gpu}} W"),
            ],
            "short",
            gpu_only=True,
        ),
        PanelDef(
            "GPU ECC / XID errors",
            [
                (f"sum by ({g}, type) (vllm_fleet_gpu_ecc_errors_total{{{H}}})", "GPU {{gpu}} ECC {{type}}"),
                (f"sum by ({g}, xid) (vllm_fleet_gpu_xid_errors_total{{{H}}})", "GPU {{gpu}} XID {{xid}}"),
            ],
            "short",
            gpu_only=True,
        ),
    ]


def _panel(p: PanelDef, ds: dict[str, str], n: int, y0: int = 0) -> G.Panel:
    targets = [
        G.Target(expr=e, legendFormat=legend, refId=chr(ord("A") + k), datasource=ds)
        for k, (e, legend) in enumerate(p.exprs)
    ]
    pos = G.GridPos(h=8, w=12, x=(n % 2) * 12, y=y0 + (n // 2) * 8)
    steps: list[dict[str, Any]] = [{"color": "green", "value": None}]
    steps += [{"color": c, "value": v} for c, v in (p.thresholds or [])]
    desc = p.description or None
    if p.states is not None:
        options = {str(v): {"text": name, "color": colour, "index": v} for v, name, colour in p.states}
        return G.StateTimeline(title=p.title, dataSource=ds, targets=targets, gridPos=pos, description=desc,
                               mappings=[{"type": "value", "options": options}], showValue="never")  # fmt: skip
    if p.stat:
        return G.Stat(title=p.title, dataSource=ds, targets=targets, gridPos=pos, reduceCalc="lastNotNull",
                      textMode="name", graphMode="none", description=desc)  # fmt: skip
    return G.TimeSeries(
        title=p.title + (" (GPU hosts)" if p.gpu_only else ""),
        dataSource=ds,
        targets=targets,
        gridPos=pos,
        unit=p.unit,
        thresholds=steps,
        thresholdsStyleMode="line" if p.thresholds else "off",
        description=desc,
    )


def _ds(vf: dict[str, Any]) -> dict[str, str]:
    return {"type": "prometheus", "uid": vf["monitoring"]["grafana"]["datasource_uid"]}


# The overview's annotation of canary rollouts (docs/rollouts.md): a region on every panel while a gateway sends
# a canary its share (the gateways' canary lease, exported per gateway: live only during `vllm-fleet rollout`)
CANARY_ANNOTATION_EXPR = 'max by (model, instance) (vllm_fleet_gateway_canary_share{model=~"$model"}) > 0'


def canary_annotation(ds: dict[str, str]) -> dict[str, Any]:
    """A Prometheus-query annotation (Grafana draws a region per series while it has values)."""
    return {
        "name": "Canary rollouts",
        "datasource": ds,
        "enable": True,
        "iconColor": "orange",
        "expr": CANARY_ANNOTATION_EXPR,
        "step": "30s",
        "titleFormat": "canary {{instance}}",
        "textFormat": "{{model}}: canary {{instance}} in rotation",
        "tagKeys": "model,instance",
        "useValueForTime": False,
    }


def _dashboard(
    vf: dict[str, Any],
    title: str,
    uid: str,
    panels: list[PanelDef],
    templates: list[G.Template],
    rows: list[tuple[str, list[PanelDef]]] = [],  # noqa: B006 - read only
    annotations: list[dict[str, Any]] = [],  # noqa: B006 - read only
) -> str:
    """The panels two a line, then each row (a row header, its panels two a line)."""
    ds = _ds(vf)
    out: list[G.Panel] = [_panel(p, ds, n) for n, p in enumerate(panels)]
    y = (len(panels) + 1) // 2 * 8
    for row_title, row_panels in rows:
        out.append(G.RowPanel(title=row_title, gridPos=G.GridPos(h=1, w=24, x=0, y=y)))
        out += [_panel(p, ds, n, y + 1) for n, p in enumerate(row_panels)]
        y += 1 + (len(row_panels) + 1) // 2 * 8
    d = G.Dashboard(
        title=title,
        uid=uid,
        tags=["vllm", "vllm-fleet", vf["name"]],
        timezone="utc",
        refresh="30s",
        schemaVersion=39,
        panels=out,
        templating=G.Templating(list=templates),
        annotations=G.Annotations(list=annotations),
        time=G.Time("now-3h", "now"),
    ).auto_panel_ids()
    return json.dumps(d.to_json_data(), cls=DashboardEncoder, indent=2, sort_keys=True) + "\n"


def _var(name: str, query: str, ds: dict[str, str], include_all: bool = False) -> G.Template:
    return G.Template(
        name=name,
        label=name,
        query=query,
        dataSource=ds,
        includeAll=include_all,
        multi=include_all,
        allValue=".*" if include_all else None,
        refresh=2,
        default="$__all" if include_all else None,
    )


def overview_json(ctx: dict[str, Any]) -> str:
    vf = ctx["vf"]
    ds = _ds(vf)
    templates = [_var("model", "label_values(vllm:num_requests_running, model)", ds, include_all=True)]
    rows = [(SLEEP_ROW, sleep_panels(vf["alerts"]))] if sleeps(vf) else []
    rows += [(KEYS_ROW, key_panels(vf["alerts"]))] if vf["gateway_admission_on"] else []
    return _dashboard(
        vf,
        f"vLLM fleet / overview ({vf['name']})",
        OVERVIEW_UID,
        overview_panels(vf["alerts"]),
        templates,
        rows,
        [canary_annotation(ds)],
    )


def instance_json(ctx: dict[str, Any]) -> str:
    vf = ctx["vf"]
    ds = _ds(vf)
    templates = [
        _var("instance", 'label_values(up{job="vllm"}, instance)', ds),
        _var("host", 'label_values(up{job="vllm", instance="$instance"}, host)', ds),
    ]
    return _dashboard(
        vf, f"vLLM fleet / instance ({vf['name']})", INSTANCE_UID, instance_panels(vf["alerts"]), templates
    )


def panel_queries(
    alerts: dict[str, Any], admission: bool = True, sleep: bool = True
) -> list[tuple[str, str, bool]]:
    """(dashboard uid / panel title, expr, gpu_only) for every query of both dashboards; with ``sleep`` (a fleet
    with a model that sleeps) the overview's "Sleep" row, with ``admission`` (a fleet whose gateway runs the
    admission service) its "Keys" row too."""
    out: list[tuple[str, str, bool]] = []
    overview = overview_panels(alerts) + (sleep_panels(alerts) if sleep else [])
    overview += key_panels(alerts) if admission else []
    for uid, panels in ((OVERVIEW_UID, overview), (INSTANCE_UID, instance_panels(alerts))):
        for p in panels:
            out += [(f"{uid} / {p.title}", e, p.gpu_only) for e, _ in p.exprs]
    out.append((f"{OVERVIEW_UID} / annotation Canary rollouts", CANARY_ANNOTATION_EXPR, False))
    return out
