"""Plan-time checks of the alert thresholds, and the histogram bounds they are checked against.

Imported by the planner: it needs only the spec (nothing of the renderer or the dashboards).
"""

from __future__ import annotations

import json

from vllm_fleet.fleet.spec import FleetSpec

# vLLM's default TTFT histogram bounds (vllm/v1/metrics/buckets.py, 0.32). A p99 threshold between two
# bounds is an interpolation artefact: the SLO must be one of these, or the engine needs
# --custom-histogram-buckets with that bound. The one list: the planner's check below and the rules generator
# (alerts.py) read it.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
    80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
# request-latency family (e2e, queue, prefill, decode)
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
    960.0, 1920.0, 7680.0,
)  # fmt: skip


def _custom_ttft_buckets(extra_args: list[str]) -> list[float] | None:
    """TTFT bounds given with --custom-histogram-buckets JSON, if any."""
    for n, arg in enumerate(extra_args):
        value = None
        if arg == "--custom-histogram-buckets" and n + 1 < len(extra_args):
            value = extra_args[n + 1]
        elif arg.startswith("--custom-histogram-buckets="):
            value = arg.split("=", 1)[1]
        if value is not None:
            try:
                data = json.loads(value)
                return [float(b) for b in data.get("time_to_first_token", [])] or None
            except (ValueError, AttributeError, TypeError):
                return None
    return None


def check_alert_thresholds(spec: FleetSpec) -> list[tuple[str, str]]:
    """Plan-time checks of the alert thresholds: (field path, reason) pairs."""
    problems: list[tuple[str, str]] = []
    for i, m in enumerate(spec.models):
        buckets = _custom_ttft_buckets(m.extra_args) or list(TTFT_BUCKETS)
        own = m.alerts.ttft_p99_slo_seconds
        slo, path = (own, f"models[{i}].alerts.ttft_p99_slo_seconds") if own is not None else (
            spec.alerts.ttft_p99_slo_seconds, "alerts.ttft_p99_slo_seconds")  # fmt: skip
        if not any(abs(slo - b) < 1e-9 for b in buckets):
            near = sorted(buckets, key=lambda b: abs(b - slo))[:2]
            problems.append(
                (
                    path,
                    f"TTFT SLO {slo}s is not a bound of {m.name}'s time_to_first_token histogram, so p99 > SLO "
                    f"would be an interpolation guess; use a bucket bound (nearest: {sorted(near)}) or add it "
                    "with --custom-histogram-buckets",
                )
            )
    return problems
