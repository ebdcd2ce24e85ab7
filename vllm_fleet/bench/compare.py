"""Compare two endpoints (e.g. direct engine vs through the gateway) in one run: interleaved rounds A B B A …

Machines are noisy: figures from different runs must not be compared. Each round is a short closed/open-loop
run against one endpoint; adjacent A/B rounds form a pair; the report gives the median B/A ratio over pairs
and its spread (min, max, interquartile range).
"""

from __future__ import annotations

import statistics
from typing import Any

from .session import Options, _limit, _session, prepare, run_once
from .stats import percentile
from .workload import Profile, override

METRICS = {
    "output_tokens_per_s": ("overall", "output_tokens_per_s"),
    "requests_per_s": ("overall", "requests_per_s"),
    "ttft_p50_ms": ("ttft_ms", "p50"),
    "ttft_p95_ms": ("ttft_ms", "p95"),
    "ttft_p99_ms": ("ttft_ms", "p99"),
    "e2e_p50_ms": ("e2e_ms", "p50"),
    "e2e_p95_ms": ("e2e_ms", "p95"),
    "itl_p50_ms": ("itl_ms", "p50"),
}


def order(rounds: int) -> list[str]:
    """ABBA ABBA …: each endpoint goes first equally often; ``rounds`` rounds per endpoint."""
    seq: list[str] = []
    while len(seq) < 2 * rounds:
        seq += ["A", "B"] if (len(seq) // 2) % 2 == 0 else ["B", "A"]
    return seq[: 2 * rounds]


def round_figures(rep: dict[str, Any]) -> dict[str, float | None]:
    o = rep["overall"]
    out: dict[str, float | None] = {}
    for name, (a, b) in METRICS.items():
        out[name] = o[b] if a == "overall" else o[a][b]
    # the engines' prefix-cache hit rate over the round (every --metrics-url of the endpoint, summed)
    out["prefix_cache_hit_rate"] = (rep.get("engine_metrics") or {}).get("prefix_cache_hit_rate")
    out["failed"] = o["failed"]
    return out


def spread(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"median": None, "min": None, "max": None, "p25": None, "p75": None, "n": 0}
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "p25": percentile(values, 25),
        "p75": percentile(values, 75),
        "n": len(values),
    }


def ratios(rounds: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """B/A per adjacent pair (rounds 1-2, 3-4, …), then median and spread per figure."""
    out: dict[str, dict[str, float | None]] = {}
    for name in (*METRICS, "prefix_cache_hit_rate"):
        vals = []
        for i in range(0, len(rounds) - 1, 2):
            pair = {
                rounds[i]["label"]: rounds[i]["figures"],
                rounds[i + 1]["label"]: rounds[i + 1]["figures"],
            }
            a, b = pair.get("A", {}).get(name), pair.get("B", {}).get(name)
            if a and b:
                vals.append(b / a)
        out[name] = spread(vals)
    return out


async def compare(
    profile: Profile,
    url_a: str,
    url_b: str,
    rounds: int,
    round_duration: float,
    base: Options,
    warmup: float = 3.0,
    metrics_b: list[str] | None = None,
) -> dict[str, Any]:
    """Run ``rounds`` rounds per endpoint, interleaved; warm both up first (not measured). ``metrics_b``: B's
    engines' /metrics when they are not A's (default: the same)."""
    per_round = override(profile, duration=round_duration, warmup=0.0, warmup_requests=0)
    warm = override(profile, duration=warmup, warmup=0.0, warmup_requests=0)
    opts = {
        "A": Options(**{**base.__dict__, "url": url_a, "label": "A"}),
        "B": Options(**{**base.__dict__, "url": url_b, "label": "B"}),
    }
    if metrics_b is not None:
        opts["B"].metrics_urls = metrics_b
    async with _session(_limit(profile)) as sess:
        prepared = {k: await prepare(sess, profile, o) for k, o in opts.items()}
        for k, o in opts.items():
            await run_once(warm, _quiet(o), session=sess, prepared=prepared[k])
        done: list[dict[str, Any]] = []
        for i, label in enumerate(order(rounds)):
            rep = await run_once(per_round, opts[label], session=sess, prepared=prepared[label])
            done.append({"round": i + 1, "label": label, "figures": round_figures(rep), "report": rep})
    return {
        "schema": "vllm-fleet-bench-compare/1",
        "a": url_a,
        "b": url_b,
        "profile": profile.model_dump(),
        "rounds_per_endpoint": rounds,
        "round_duration_s": round_duration,
        "order": [r["label"] for r in done],
        "ratio_b_over_a": ratios(done),
        "totals": {
            lab: {
                "requests": sum(r["report"]["overall"]["requests"] for r in done if r["label"] == lab),
                "failed": sum(r["report"]["overall"]["failed"] for r in done if r["label"] == lab),
            }
            for lab in ("A", "B")
        },
        "rounds": [{k: v for k, v in r.items() if k != "report"} for r in done],
        "per_endpoint": {
            lab: per_endpoint([r["figures"] for r in done if r["label"] == lab]) for lab in ("A", "B")
        },
    }


def per_endpoint(figs: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Each figure over one endpoint's rounds: median and spread."""
    names = (*METRICS, "prefix_cache_hit_rate")
    return {n: spread([f[n] for f in figs if f.get(n) is not None]) for n in names}


def _quiet(o: Options) -> Options:
    return Options(**{**o.__dict__, "progress": False, "metrics_urls": []})


def table(res: dict[str, Any]) -> str:
    lines = [f"A = {res['a']}", f"B = {res['b']}", f"order: {' '.join(res['order'])}", ""]
    lines.append(f"{'B/A ratio':<22}{'median':>8}{'min':>8}{'p25':>8}{'p75':>8}{'max':>8}{'pairs':>7}")
    for name, s in res["ratio_b_over_a"].items():
        cells = "".join(
            "       -" if s[k] is None else f"{s[k]:>8.3f}" for k in ("median", "min", "p25", "p75", "max")
        )
        lines.append(f"{name:<22}{cells}{s['n']:>7}")
    lines.append("")
    lines.append(f"{'per endpoint (median [min..max])':<34}{'A':>24}{'B':>24}")
    for name in (*METRICS, "prefix_cache_hit_rate"):
        cells = ""
        for lab in ("A", "B"):
            s = res["per_endpoint"][lab][name]
            cells += f"{'-':>24}" if s["median"] is None else f"{_fmt(s):>24}"
        lines.append(f"{name:<34}{cells}")
    t = res["totals"]
    lines.append(
        f"failed requests: A {t['A']['failed']}/{t['A']['requests']},"
        f" B {t['B']['failed']}/{t['B']['requests']}"
    )
    return "\n".join(lines)


def _fmt(s: dict[str, float | None]) -> str:
    return f"{s['median']:.3g} [{s['min']:.3g}..{s['max']:.3g}]"
