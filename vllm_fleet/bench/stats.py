"""Statistics over request records: percentiles, inter-token latency, throughput, errors by type."""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

PERCENTILES = (50.0, 95.0, 99.0)


@dataclass
class RequestRecord:
    """One request as the client saw it. Times are seconds; ``start`` is relative to the run's start."""

    cls: str
    start: float
    ok: bool = False
    error: str | None = None  # error type (see ``errors.py``); None when ok
    detail: str = ""
    status: int | None = None
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    stream: bool = True
    target: str = ""
    warmup: bool = False

    @property
    def end(self) -> float:
        return self.start + (self.e2e or 0.0)

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first (vLLM's TPOT definition)."""
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["tpot"] = self.tpot
        return d


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) with linear interpolation between closest ranks (NumPy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} outside 0..100")
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def distribution(values: Sequence[float], scale: float = 1000.0) -> dict[str, float | int | None]:
    """count, mean and p50/p95/p99 (scaled, ms by default); None fields when there are no values."""
    out: dict[str, float | int | None] = {"count": len(values)}
    if not values:
        out.update({"mean": None, **{f"p{int(q)}": None for q in PERCENTILES}})
        return out
    out["mean"] = sum(values) / len(values) * scale
    for q in PERCENTILES:
        out[f"p{int(q)}"] = percentile(values, q) * scale
    return out


def intervals(timestamps: Sequence[float]) -> list[float]:
    """Gaps between consecutive chunk arrival times: the inter-token latencies of one stream."""
    return [b - a for a, b in itertools.pairwise(timestamps)]


def summarize(records: Iterable[RequestRecord], window: float) -> dict[str, Any]:
    """Throughput and latency figures of measured records over ``window`` seconds."""
    recs = [r for r in records if not r.warmup]
    ok = [r for r in recs if r.ok]
    errors = Counter(r.error or "unknown" for r in recs if not r.ok)
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    w = window if window > 0 else float("nan")
    return {
        "requests": len(recs),
        "ok": len(ok),
        "failed": len(recs) - len(ok),
        "error_rate": (len(recs) - len(ok)) / len(recs) if recs else 0.0,
        "errors": dict(sorted(errors.items())),
        "window_s": window,
        "requests_per_s": len(ok) / w,
        "output_tokens": out_tokens,
        "prompt_tokens": in_tokens,
        "output_tokens_per_s": out_tokens / w,
        "prompt_tokens_per_s": in_tokens / w,
        "mean_prompt_tokens": in_tokens / len(ok) if ok else None,
        "mean_output_tokens": out_tokens / len(ok) if ok else None,
        "ttft_ms": distribution([r.ttft for r in ok if r.ttft is not None]),
        "itl_ms": distribution([x for r in ok for x in r.itl]),
        "tpot_ms": distribution([t for r in ok if (t := r.tpot) is not None]),
        "e2e_ms": distribution([r.e2e for r in ok if r.e2e is not None]),
    }


def summarize_by_class(records: Sequence[RequestRecord], window: float) -> dict[str, dict[str, Any]]:
    names = sorted({r.cls for r in records})
    return {n: summarize([r for r in records if r.cls == n], window) for n in names}


def measured_window(records: Sequence[RequestRecord], measure_start: float) -> float:
    """Seconds from the end of warm-up to the last measured completion."""
    ends = [r.end for r in records if not r.warmup]
    return max(ends) - measure_start if ends else 0.0


def timeseries(
    records: Sequence[RequestRecord], bin_s: float = 1.0, window_s: float | None = None
) -> list[dict[str, Any]]:
    """Every ``bin_s`` seconds: figures of the requests completed in the last ``window_s`` seconds (a sliding
    window, ``bin_s`` by default): completed, failed, output tokens/s, TTFT/E2E p50/p95/p99 (ms)."""
    if not records:
        return []
    win = max(window_s or bin_s, bin_s)
    last = max(r.end for r in records)
    rows = []
    for i in range(int(last // bin_s) + 1):
        t = (i + 1) * bin_s
        rs = [r for r in records if t - win <= r.end < t]
        in_bin = [r for r in rs if r.end >= t - bin_s]
        ok = [r for r in rs if r.ok]
        row: dict[str, Any] = {
            "t": t,
            "ok": sum(r.ok for r in in_bin),
            "failed": sum(not r.ok for r in in_bin),
            "output_tokens_per_s": sum(r.output_tokens for r in ok) / min(win, t),
            "warmup": bool(rs) and all(r.warmup for r in rs),
        }
        for key in ("ttft", "e2e"):
            vals = [v for r in ok if (v := getattr(r, key)) is not None]
            for q in PERCENTILES:
                row[f"{key}_p{int(q)}_ms"] = percentile(vals, q) * 1000 if vals else None
        rows.append(row)
    return rows
