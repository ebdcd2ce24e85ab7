"""What the engine's /metrics says over the run: counters before/after, gauges sampled during the run."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from vllm_fleet.vllm_metrics import RUN_COUNTERS, RUN_GAUGES, RUN_HISTOGRAMS

# counters and histogram parts whose change over the run is reported (sample names as exposed)
DELTAS = (*RUN_COUNTERS, *(h + s for h in RUN_HISTOGRAMS for s in ("_sum", "_count")))
GAUGES = RUN_GAUGES


def parse(text: str, model: str | None = None) -> dict[str, float]:
    """Sum each sample name over its label sets (only ``model_name=model`` series when given)."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if model and "model_name" in s.labels and s.labels["model_name"] != model:
                continue
            out[s.name] = out.get(s.name, 0.0) + float(s.value)
    return out


async def scrape(session: aiohttp.ClientSession, url: str, model: str | None) -> dict[str, float]:
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=5)) as r:
        r.raise_for_status()
        return parse(await r.text(), model)


class MetricsWatcher:
    """Scrapes every URL before the run, every ``interval`` s during it, and after it."""

    def __init__(self, urls: list[str], model: str | None, interval: float = 1.0) -> None:
        self.urls = urls
        self.model = model
        self.interval = interval
        self.before: dict[str, dict[str, float]] = {}
        self.after: dict[str, dict[str, float]] = {}
        self.samples: list[dict[str, Any]] = []
        self.errors: dict[str, str] = {}
        self._task: asyncio.Task[None] | None = None
        self._t0 = 0.0

    async def _all(self, session: aiohttp.ClientSession) -> dict[str, dict[str, float]]:
        out = {}
        for url in self.urls:
            try:
                out[url] = await scrape(session, url, self.model)
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                self.errors[url] = f"{type(exc).__name__}: {exc}"
        return out

    async def start(self, session: aiohttp.ClientSession, t0: float) -> None:
        self._t0 = t0
        self.before = await self._all(session)
        self._task = asyncio.create_task(self._loop(session))

    async def _loop(self, session: aiohttp.ClientSession) -> None:
        while True:
            snap = await self._all(session)
            row: dict[str, Any] = {"t": time.perf_counter() - self._t0}
            for g in GAUGES:
                vals = [m[g] for m in snap.values() if g in m]
                row[g] = sum(vals) if g != "vllm:kv_cache_usage_perc" else max(vals, default=None)
            self.samples.append(row)
            await asyncio.sleep(self.interval)

    async def stop(self, session: aiohttp.ClientSession) -> dict[str, Any]:
        if self._task:
            self._task.cancel()
        self.after = await self._all(session)
        return self.summary()

    def summary(self) -> dict[str, Any]:
        if not self.urls:
            return {"available": False, "reason": "no metrics URL"}
        urls = [u for u in self.urls if u in self.before and u in self.after]
        if not urls:
            return {"available": False, "errors": self.errors}
        delta = {k: sum(self.after[u].get(k, 0.0) - self.before[u].get(k, 0.0) for u in urls) for k in DELTAS}
        q_count = delta["vllm:request_queue_time_seconds_count"]
        queries = delta["vllm:prefix_cache_queries_total"]
        kv = [
            s["vllm:kv_cache_usage_perc"]
            for s in self.samples
            if s.get("vllm:kv_cache_usage_perc") is not None
        ]
        return {
            "available": True,
            "urls": urls,
            "errors": self.errors,
            "kv_cache_usage_peak": max(kv) if kv else None,
            "kv_cache_usage_mean": sum(kv) / len(kv) if kv else None,
            "requests_running_peak": max(
                (s["vllm:num_requests_running"] for s in self.samples), default=None
            ),
            "requests_waiting_peak": max(
                (s["vllm:num_requests_waiting"] for s in self.samples), default=None
            ),
            "queue_time_mean_ms": delta["vllm:request_queue_time_seconds_sum"] / q_count * 1000
            if q_count
            else None,
            "requests_finished": q_count,
            "prompt_tokens": delta["vllm:prompt_tokens_total"],
            "generation_tokens": delta["vllm:generation_tokens_total"],
            "preemptions": delta["vllm:num_preemptions_total"],
            "prefix_cache_hit_rate": delta["vllm:prefix_cache_hits_total"] / queries if queries else None,
            "samples": self.samples,
        }
