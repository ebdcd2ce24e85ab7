"""PNG plot of a run: latency percentiles and throughput over time (matplotlib, Agg backend)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def plot(report: dict[str, Any], path: Path, title: str | None = None) -> Path:
    """Top: TTFT and E2E p50/p95/p99; bottom: output tokens/s (sliding window) and failures per second."""
    ts = report.get("timeseries") or []
    t = [r["t"] for r in ts]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    styles = {"p50": "-", "p95": "--", "p99": ":"}
    for key, color in (("e2e", "tab:blue"), ("ttft", "tab:orange")):
        for q, ls in styles.items():
            ys = [float("nan") if r.get(f"{key}_{q}_ms") is None else r[f"{key}_{q}_ms"] for r in ts]
            ax1.plot(t, ys, ls, color=color, label=f"{key.upper()} {q}", marker="." if q == "p50" else None)
    win = report.get("timeseries_window_s", 1)
    ax1.set_ylabel(f"latency (ms), last {win:g} s")
    ax1.set_yscale("symlog", linthresh=10)
    ax1.legend(ncol=2, fontsize=8)
    ax1.grid(alpha=0.3)
    ax2.plot(t, [r["output_tokens_per_s"] for r in ts], color="tab:green", label="output tokens/s")
    ax2.set_ylabel(f"output tokens/s (last {win:g} s)")
    ax2.set_xlabel("seconds since start (by completion time)")
    ax2.grid(alpha=0.3)
    fails = [r["failed"] for r in ts]
    if any(fails):
        ax3 = ax2.twinx()
        ax3.bar(t, fails, width=0.8, color="tab:red", alpha=0.5, label="failed requests")
        ax3.set_ylabel("failed / s", color="tab:red")
    w = report.get("window", {})
    for ax in (ax1, ax2):
        if w.get("measure_start_s"):
            ax.axvspan(0, w["measure_start_s"], color="grey", alpha=0.15, label="_warm-up")
        for ev in report.get("events", []):
            ax.axvline(ev["t"], color="tab:red", lw=1)
            if ax is ax1:
                ax.annotate(
                    ev["label"], (ev["t"], 1), xycoords=("data", "axes fraction"), fontsize=7, va="top"
                )
    o = report["overall"]
    fig.suptitle(
        title
        or f"{report.get('profile', {}).get('name', 'bench')} → {report.get('target', {}).get('url', '')}: "
        f"{o['requests_per_s']:.2f} req/s, {o['output_tokens_per_s']:.0f} out tok/s, {o['failed']} failed"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
