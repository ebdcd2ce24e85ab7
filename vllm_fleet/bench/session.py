"""One bench run: resolve the model, build prompts, watch /metrics, drive the load, build the report."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from . import report as report_mod
from .client import Target
from .metrics import MetricsWatcher
from .prompts import PromptBuilder, make_builder
from .runner import Load, Progress
from .workload import Profile

# A scenario hook runs beside the load; it returns facts for report["scenario"] and may call load.stop().
Hook = Callable[[Load, aiohttp.ClientSession], Awaitable[dict[str, Any]]]


@dataclass
class Options:
    url: str
    model: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    stream: bool | None = None  # override every class's stream setting
    metrics_urls: list[str] | None = None  # None: URL/metrics; []: no scraping
    tokenize_url: str | None = "auto"  # "auto": URL/tokenize; None: approximate prompt sizes
    progress: bool = True
    label: str = "A"
    bin_s: float = 1.0


def _session(limit: int) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=limit, force_close=False))


async def resolve_model(session: aiohttp.ClientSession, url: str, headers: dict[str, str]) -> str:
    async with session.get(
        url.rstrip("/") + "/v1/models", headers=headers, timeout=aiohttp.ClientTimeout(10)
    ) as r:
        r.raise_for_status()
        data = await r.json()
    return str(data["data"][0]["id"])


async def prepare(
    session: aiohttp.ClientSession, profile: Profile, opts: Options
) -> tuple[Target, PromptBuilder]:
    model = opts.model or profile.model or await resolve_model(session, opts.url, opts.headers)
    tok = opts.url.rstrip("/") + "/tokenize" if opts.tokenize_url == "auto" else opts.tokenize_url
    builder = await make_builder(session, tok, model, profile.seed)
    return Target(opts.label, opts.url, model, dict(opts.headers)), builder


def meta(profile: Profile, opts: Options, target: Target, builder: PromptBuilder) -> dict[str, Any]:
    return {
        "target": {"url": opts.url, "model": target.model, "label": opts.label},
        "profile": profile.model_dump(),
        "stream_override": opts.stream,
        "prompt_sizing": "exact (/tokenize, single-token words)" if builder.exact else "approximate",
    }


async def run_once(
    profile: Profile,
    opts: Options,
    hooks: tuple[Hook, ...] = (),
    session: aiohttp.ClientSession | None = None,
    prepared: tuple[Target, PromptBuilder] | None = None,
) -> dict[str, Any]:
    own = session is None
    sess = session or _session(_limit(profile))
    try:
        target, builder = prepared or await prepare(sess, profile, opts)
        metric_urls = [opts.url.rstrip("/") + "/metrics"] if opts.metrics_urls is None else opts.metrics_urls
        watcher = MetricsWatcher(metric_urls, target.model)
        progress = Progress(f"{profile.name}@{opts.label}", profile.warmup + profile.duration, opts.progress)
        load = Load(profile, target, builder, opts.stream, progress)
        interrupted = _stop_on_signals(load)
        t0 = time.perf_counter()
        await watcher.start(sess, t0)
        load_task = asyncio.ensure_future(load.run(sess, t0))
        hook_tasks = [asyncio.ensure_future(h(load, sess)) for h in hooks]
        result = await load_task
        for h in hook_tasks:
            if not h.done():
                h.cancel()
        hook_out = []
        for h in hook_tasks:
            try:
                hook_out.append(await h)
            except asyncio.CancelledError:
                hook_out.append({"cancelled": True})
        _restore_signals()
        rep = report_mod.build(result, meta(profile, opts, target, builder), opts.bin_s)
        if interrupted:
            rep["interrupted"] = True  # Ctrl-C / SIGTERM: the load stopped early, figures cover what ran
        rep["engine_metrics"] = await watcher.stop(sess)
        if hook_out:
            rep["scenario"] = hook_out[0] if len(hook_out) == 1 else hook_out
            rep["events"] = [ev for h in hook_out for ev in h.get("events", [])]
        return rep
    finally:
        if own:
            await sess.close()


class _Interrupted:
    def __init__(self) -> None:
        self.hit = False

    def __bool__(self) -> bool:
        return self.hit


_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _stop_on_signals(load: Load) -> _Interrupted:
    """The first Ctrl-C / SIGTERM stops the load gracefully (no new requests, in-flight ones finish, scenario
    steps are cancelled) so the report of what ran is still written; a second one interrupts at once."""
    flag = _Interrupted()
    loop = asyncio.get_running_loop()

    def stop() -> None:
        flag.hit = True
        load.stop()
        _restore_signals()
        print("\nstopping: waiting for in-flight requests (Ctrl-C again to abort)", file=sys.stderr)

    for sig in _SIGNALS:
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, stop)
    return flag


def _restore_signals() -> None:
    loop = asyncio.get_running_loop()
    for sig in _SIGNALS:
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.remove_signal_handler(sig)


def _limit(profile: Profile) -> int:
    a = profile.arrival
    return (a.concurrency or a.max_concurrency or 1000) + 8
