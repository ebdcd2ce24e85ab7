"""Drive load: closed loop (N concurrent users) or open loop (rate), warm-up, and bounds that always stop."""

from __future__ import annotations

import asyncio
import contextlib
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from .client import Target, send
from .prompts import PromptBuilder, SharedPrefixes
from .stats import RequestRecord
from .workload import Profile


@dataclass
class LoadResult:
    records: list[RequestRecord]
    t0: float  # perf_counter at the start of the load
    measure_start: float  # seconds after t0 when the first measured request was sent
    issue_end: float  # seconds after t0 when the last request was sent
    end: float  # seconds after t0 when the last request finished
    cancelled: int = 0  # requests still running at the hard stop (not in records)
    started_at: float = field(default_factory=time.time)


class Progress:
    """A one-line progress display on stderr (rewritten in place on a terminal, a line per 5 s otherwise)."""

    def __init__(self, label: str, duration: float, enabled: bool = True) -> None:
        self.label = label
        self.duration = duration
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self._last = 0.0

    def update(
        self, elapsed: float, records: list[RequestRecord], inflight: int, final: bool = False
    ) -> None:
        if not self.enabled:
            return
        if not final and not self.tty and elapsed - self._last < 5:
            return
        self._last = elapsed
        ok = sum(r.ok for r in records)
        tokens = sum(r.output_tokens for r in records if r.ok)
        frac = min(1.0, elapsed / self.duration) if self.duration else 0.0
        bar = "#" * int(frac * 20)
        line = (
            f"[{bar:<20}] {self.label} {elapsed:6.1f}s  done {len(records)} ok {ok} "
            f"err {len(records) - ok}  in flight {inflight}  {tokens / max(elapsed, 1e-9):8.1f} out tok/s"
        )
        end = "\n" if final or not self.tty else ""
        print(("\r" if self.tty else "") + line, end=end, file=sys.stderr, flush=True)


class Load:
    """One load run against one target. ``stop()`` ends issuing early (scenarios use it)."""

    def __init__(
        self,
        profile: Profile,
        target: Target,
        builder: PromptBuilder,
        stream: bool | None = None,
        progress: Progress | None = None,
        seed: int | None = None,
    ) -> None:
        self.p = profile
        self.target = target
        self.builder = builder
        self.stream = stream
        self.progress = progress
        self.chooser = profile.chooser(seed)
        self.records: list[RequestRecord] = []
        self.issued = 0
        self.inflight = 0
        self.t0 = 0.0
        self.measure_start: float | None = None
        self.issue_end = 0.0
        self._stop = asyncio.Event()
        self._measured_issued = 0
        self._rng = random.Random(profile.seed if seed is None else seed)
        self.shared = SharedPrefixes(profile.seed)

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def stop(self) -> None:
        self._stop.set()

    def _may_issue(self) -> bool | None:
        """None: stop issuing; True: a warm-up request; False: a measured request."""
        if self._stop.is_set():
            return None
        t = self.now()
        warm = t < self.p.warmup or self.issued < self.p.warmup_requests
        if warm:
            return True
        if self.measure_start is None:
            self.measure_start = t
        if t - self.measure_start >= self.p.duration:
            return None
        if self.p.max_requests is not None and self._measured_issued >= self.p.max_requests:
            return None
        return False

    def _count(self, warm: bool) -> None:
        self.issued += 1
        if not warm:
            self._measured_issued += 1

    async def _one(self, session: aiohttp.ClientSession, warm: bool, counted: bool = False) -> None:
        c = self.chooser.next()
        prompt: str | list[dict[str, str]]
        prompt = (
            self.shared.messages(self.builder, c)
            if c.shared_prefix is not None
            else self.builder.build(c.input_tokens)
        )
        if not counted:
            self._count(warm)
        self.inflight += 1
        try:
            rec = await send(session, self.target, c, prompt, self.t0, self.p.timeout, self.stream)
        finally:
            self.inflight -= 1
        rec.warmup = warm
        self.records.append(rec)

    async def _user(self, session: aiohttp.ClientSession) -> None:
        while (warm := self._may_issue()) is not None:
            await self._one(session, warm)
        self.issue_end = max(self.issue_end, self.now())

    async def _open_loop(self, session: aiohttp.ClientSession) -> None:
        rate = float(self.p.arrival.rate or 1.0)
        cap = asyncio.Semaphore(self.p.arrival.max_concurrency or 1_000_000)
        tasks: set[asyncio.Task[None]] = set()

        async def limited(warm: bool) -> None:
            async with cap:
                await self._one(session, warm, counted=True)

        next_t = self.now()
        while (warm := self._may_issue()) is not None:
            # counted when created: a loop running behind schedule creates several tasks before any starts,
            # and counting at their start overshot --requests
            self._count(warm)
            t = asyncio.create_task(limited(warm))
            tasks.add(t)
            t.add_done_callback(tasks.discard)
            gap = self._rng.expovariate(rate) if self.p.arrival.poisson else 1.0 / rate
            next_t += gap
            delay = next_t - self.now()
            if delay > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), delay)
        self.issue_end = self.now()
        if tasks:
            await asyncio.gather(*tasks)

    async def _show(self) -> None:
        assert self.progress is not None
        while True:
            self.progress.update(self.now(), self.records, self.inflight)
            await asyncio.sleep(0.5)

    async def run(self, session: aiohttp.ClientSession, t0: float | None = None) -> LoadResult:
        self.t0 = t0 if t0 is not None else time.perf_counter()
        started = time.time()
        work: asyncio.Future[Any]
        if self.p.arrival.concurrency is not None:
            work = asyncio.gather(*(self._user(session) for _ in range(self.p.arrival.concurrency)))
        else:
            work = asyncio.ensure_future(self._open_loop(session))
        shower = asyncio.create_task(self._show()) if self.progress else None
        hard_stop = self.p.warmup + self.p.duration + self.p.timeout + 10
        if self.p.warmup_requests or self.p.max_requests:
            hard_stop += self.p.timeout  # count-bounded runs: leave room, the duration still bounds them
        cancelled = 0
        try:
            await asyncio.wait_for(work, hard_stop)
        except TimeoutError:
            cancelled = self.issued - len(self.records)
        finally:
            if shower:
                shower.cancel()
        end = max((r.end for r in self.records), default=self.now())
        if self.progress:
            self.progress.update(self.now(), self.records, 0, final=True)
        ms = self.measure_start if self.measure_start is not None else end
        return LoadResult(self.records, self.t0, ms, self.issue_end, end, cancelled, started)
