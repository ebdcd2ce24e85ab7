"""Results as JSON and as a human table."""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from .runner import LoadResult
from .stats import measured_window, summarize, summarize_by_class, timeseries

SCHEMA = "vllm-fleet-bench/1"
MAX_FAILURES = 2000  # failed requests listed one by one in the report (scenarios count them by time)


def build(result: LoadResult, meta: dict[str, Any], bin_s: float = 1.0) -> dict[str, Any]:
    """The report of one load run: overall and per-class figures, time series, run facts."""
    recs = result.records
    window = measured_window(recs, result.measure_start)
    return {
        "schema": SCHEMA,
        **meta,
        "started_at": datetime.fromtimestamp(result.started_at, UTC).isoformat(timespec="seconds"),
        "window": {
            "measure_start_s": result.measure_start,
            "issue_end_s": result.issue_end,
            "end_s": result.end,
            "measured_s": window,
        },
        "warmup_requests": sum(r.warmup for r in recs),
        "cancelled_at_stop": result.cancelled,
        "overall": summarize(recs, window),
        "classes": summarize_by_class([r for r in recs if not r.warmup], window),
        "timeseries_window_s": (win := max(bin_s, round(result.end / 15))),
        "timeseries": timeseries(recs, bin_s, win),
        "failures": [
            {
                "start": r.start,
                "cls": r.cls,
                "error": r.error,
                "stream": r.stream,
                "warmup": r.warmup,
                "detail": r.detail,
            }
            for r in recs
            if not r.ok
        ][:MAX_FAILURES],
    }


def _clean(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_clean(v) for v in obj]
    return obj


def write_json(report: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_clean(report), indent=2) + "\n")


def _ms(d: dict[str, Any]) -> str:
    vals = [d.get(k) for k in ("p50", "p95", "p99")]
    return "/".join("-" if v is None else f"{v:.0f}" if v >= 10 else f"{v:.1f}" for v in vals)


def table(report: dict[str, Any]) -> str:
    """Per class and overall: requests, errors, req/s, output tok/s, TTFT/ITL/E2E p50/p95/p99 (ms)."""
    head = f"{'class':<10}{'req':>6}{'err':>5}{'req/s':>8}{'out tok/s':>11}"
    head += f"  {'TTFT ms':<17}{'ITL ms':<15}{'E2E ms':<17}"
    sub = f"{'':<40}  {'p50/p95/p99':<17}{'p50/p95/p99':<15}{'p50/p95/p99':<17}"
    lines = [head, sub]
    rows = [*report["classes"].items(), ("overall", report["overall"])]
    for name, s in rows:
        lines.append(
            f"{name:<10}{s['requests']:>6}{s['failed']:>5}{s['requests_per_s']:>8.2f}{s['output_tokens_per_s']:>11.1f}"
            f"  {_ms(s['ttft_ms']):<17}{_ms(s['itl_ms']):<15}{_ms(s['e2e_ms']):<17}"
        )
    o = report["overall"]
    lines.append(
        f"window {report['window']['measured_s']:.1f} s, warm-up requests {report['warmup_requests']}"
    )
    if o["errors"]:
        lines.append("errors: " + ", ".join(f"{k} {v}" for k, v in o["errors"].items()))
    m = report.get("engine_metrics") or {}
    if m.get("available"):
        kv = m.get("kv_cache_usage_peak")
        q = m.get("queue_time_mean_ms")
        lines.append(
            "engine /metrics: KV usage peak "
            + ("-" if kv is None else f"{kv * 100:.1f} %")
            + ", queue time mean "
            + ("-" if q is None else f"{q:.1f} ms")
            + f", generation tokens {m.get('generation_tokens', 0):.0f}"
            + f", preemptions {m.get('preemptions', 0):.0f}"
        )
    return "\n".join(lines)
