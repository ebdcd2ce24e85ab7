#!/usr/bin/env python3
"""What the sleep guard costs per request inside the engine's API server (issue 33; docs/perf/sleep.md).

The guard (``vllm_fleet.host.sleep_guard.SleepGuard``) sits in front of every request of a sleeping model's
engine, awake or not. This drives an ASGI app in-process, with no sockets, three ways:

- bare: the app alone;
- stream guard: ``StreamGuard(app)``, what every engine runs;
- both: ``SleepGuard(StreamGuard(app))``, what a sleeping model's engine runs (the sleep guard outermost).

Each way answers two kinds of request: a plain completion (one body message) and a stream of ``--chunks`` SSE
events. The ways run in rounds whose order rotates (A B C, B C A, …), so load swings hit each alike. Per round,
the microseconds per request of each way; over the rounds, the median and the spread (min–max); then the
guard's own cost (both − stream guard) and its ratio to the bare app. CPU time of the event loop only: the
network, vLLM's own handlers and the GPU are not in it.

    .venv/bin/python tools/sleep_guard_overhead.py --rounds 7 --requests 4000 --chunks 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Callable, MutableMapping
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vllm_fleet.host.sleep_guard import SleepCore, SleepGuard
from vllm_fleet.host.stream_guard import StreamGuard

COMPLETION = json.dumps({"id": "x", "object": "text_completion", "choices": [{"text": "ok"}]}).encode()
BODY = json.dumps({"model": "m", "prompt": "hello " * 50, "max_tokens": 16}).encode()


def engine(chunks: int) -> Callable[..., Any]:
    """An ASGI app that reads the request and answers a completion, or ``chunks`` SSE events when the path is
    /v1/chat/completions."""

    async def app(scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        while (await receive()).get("more_body"):
            pass
        if scope["path"] == "/v1/chat/completions":
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream")]})  # fmt: skip
            for i in range(chunks):
                await send(
                    {"type": "http.response.body", "body": b'data: {"i": %d}\n\n' % i, "more_body": True}
                )
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
        else:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json")]})  # fmt: skip
            await send({"type": "http.response.body", "body": COMPLETION, "more_body": False})

    return app


def scope_of(path: str) -> dict[str, Any]:
    return {
        "type": "http",
        "method": "POST",
        "path": path,
        "query_string": b"",
        "headers": [(b"content-type", b"application/json"), (b"user-agent", b"bench"),
                    (b"content-length", str(len(BODY)).encode())],
    }  # fmt: skip


async def drive(app: Any, path: str, n: int) -> float:
    """Microseconds per request over ``n`` requests to ``path``."""
    scope = scope_of(path)

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": BODY, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        return None

    t0 = time.perf_counter()
    for _ in range(n):
        await app(dict(scope), receive, send)
    return (time.perf_counter() - t0) / n * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--requests", type=int, default=4000, help="per way, kind and round")
    p.add_argument("--chunks", type=int, default=64, help="SSE events of a streamed answer")
    p.add_argument("--json", help="write the figures here")
    a = p.parse_args(argv)
    app = engine(a.chunks)
    core = SleepCore(token="t" * 43, launcher_pid=None)
    ways = {"bare": app, "stream guard": StreamGuard(app), "both": SleepGuard(StreamGuard(app), core)}
    kinds = {"completion": "/v1/completions", "stream": "/v1/chat/completions"}
    names = list(ways)
    got: dict[str, dict[str, list[float]]] = {k: {w: [] for w in ways} for k in kinds}

    async def run() -> None:
        for path in kinds.values():  # warm-up
            for w in names:
                await drive(ways[w], path, 200)
        for r in range(a.rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            for kind, path in kinds.items():
                for w in order:
                    got[kind][w].append(await drive(ways[w], path, a.requests))

    asyncio.run(run())
    assert core.inflight == 0 and core.state == "awake", core.snapshot()
    out: dict[str, Any] = {"rounds": a.rounds, "requests": a.requests, "chunks": a.chunks, "kinds": {}}
    print(
        f"{a.rounds} rounds × {a.requests} requests per way and kind; a stream = {a.chunks} events + [DONE]"
    )
    for kind in kinds:
        med = {w: statistics.median(v) for w, v in got[kind].items()}
        spread = {w: (min(v), max(v)) for w, v in got[kind].items()}
        own = [b - s for b, s in zip(got[kind]["both"], got[kind]["stream guard"], strict=True)]
        row = {"median_us": med, "spread_us": spread, "sleep_guard_us": statistics.median(own),
               "sleep_guard_spread_us": (min(own), max(own))}  # fmt: skip
        out["kinds"][kind] = row
        print(f"\n{kind}: µs per request, median (min–max over rounds)")
        for w in names:
            print(f"  {w:13s} {med[w]:7.1f}  ({spread[w][0]:.1f}–{spread[w][1]:.1f})")
        print(
            f"  the sleep guard's own: {row['sleep_guard_us']:.1f} µs ({min(own):.1f}–{max(own):.1f}), "
            f"x{med['both'] / med['bare']:.2f} of the bare app, x{med['both'] / med['stream guard']:.2f} "
            "of the stream guard's"
        )
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
