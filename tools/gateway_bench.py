#!/usr/bin/env python3
"""Gateway overhead, measured against the same engine in ONE run: direct vs through the nginx gateway.

1. First SSE chunk latency: sequential streaming chat requests, alternating direct / gateway; reports the
   median and p90 of each side and the median of the paired differences.
2. Throughput: closed-loop load (``--concurrency`` workers, non-streaming chat, ``--max-tokens`` tokens) in
   short rounds in the order A B B A A B B A ... (A = direct, B = gateway); reports req/s per round and the
   median gateway/direct ratio over round pairs with its spread (min, max, IQR).

Without ``--direct``/``--gateway`` it starts what it measures: one real vLLM-CPU engine with the tiny model
and the gateway rendered by ``vllm-fleet render`` in front of it (API key auth on, limits out of the way).

    .venv/bin/python tools/gateway_bench.py --rounds 12 --round-seconds 5 --json out/gateway-bench.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vllm_fleet.devtools.gateway_testing import Gateway, gateway_spec
from vllm_fleet.devtools.testing import EngineProcess

KEY = "sk-vf-bench-0123456789abcdef0123456789"


def body(model: str, max_tokens: int, stream: bool) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": "Tell me about the gateway."}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": stream,
    }


async def first_chunk(s: aiohttp.ClientSession, url: str, model: str) -> float:
    t0 = time.perf_counter()
    async with s.post(url + "/v1/chat/completions", json=body(model, 16, True)) as r:
        r.raise_for_status()
        async for line in r.content:
            if line.startswith(b"data:"):
                t = time.perf_counter() - t0
                await r.read()
                return t
    raise RuntimeError("no SSE data chunk")


async def round_rps(
    s: aiohttp.ClientSession, url: str, model: str, seconds: float, conc: int, mt: int
) -> tuple[float, int]:
    """Completed requests per second over ``seconds`` (requests in flight at the end are not counted)."""
    done = errors = 0
    end = time.perf_counter() + seconds
    payload = body(model, mt, False)

    async def worker() -> None:
        nonlocal done, errors
        while time.perf_counter() < end:
            try:
                async with s.post(url + "/v1/chat/completions", json=payload) as r:
                    await r.read()
                    if r.status == 200 and time.perf_counter() <= end:
                        done += 1
                    elif r.status != 200:
                        errors += 1
            except aiohttp.ClientError:
                errors += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(conc)))
    return done / max(min(time.perf_counter(), end) - t0, 1e-9), errors


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p * (len(xs) - 1)))]


async def bench(a: argparse.Namespace, direct: str, gateway: str) -> dict[str, Any]:
    hdr = {"Authorization": f"Bearer {KEY}"}
    conn = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout, headers=hdr) as s:
        for url in (direct, gateway):  # warm-up
            await round_rps(s, url, a.model, 2, a.concurrency, a.max_tokens)
        ttft: dict[str, list[float]] = {"direct": [], "gateway": []}
        for i in range(a.ttft_samples):
            order = [("direct", direct), ("gateway", gateway)]
            for side, url in order if i % 2 == 0 else order[::-1]:
                ttft[side].append(await first_chunk(s, url, a.model))
        diffs = [g - d for d, g in zip(ttft["direct"], ttft["gateway"], strict=True)]
        print(
            f"first SSE chunk ms: direct median {statistics.median(ttft['direct']) * 1e3:.1f}, gateway median "
            f"{statistics.median(ttft['gateway']) * 1e3:.1f}, paired overhead median {statistics.median(diffs) * 1e3:.2f}",
            file=sys.stderr,
        )
        rounds: list[dict[str, Any]] = []
        pattern = ["direct", "gateway", "gateway", "direct"]
        for i in range(a.rounds * 2):
            side = pattern[i % 4]
            rps, errors = await round_rps(
                s,
                direct if side == "direct" else gateway,
                a.model,
                a.round_seconds,
                a.concurrency,
                a.max_tokens,
            )
            rounds.append({"side": side, "rps": rps, "errors": errors})
            print(f"round {i + 1:2d} {side:8s} {rps:7.1f} req/s  errors {errors}", file=sys.stderr)
    ratios = []
    for i in range(0, len(rounds) - 1, 2):  # each consecutive pair holds one direct and one gateway round
        pair = {r["side"]: r["rps"] for r in rounds[i : i + 2]}
        if pair["direct"] > 0:  # a round that completed nothing (machine saturated) says nothing
            ratios.append(pair["gateway"] / pair["direct"])
    if not ratios:
        raise SystemExit("no round pair completed requests on both sides: use longer --round-seconds")
    q = statistics.quantiles(ratios, n=4) if len(ratios) >= 2 else [ratios[0]] * 3
    return {
        "first_chunk_ms": {
            side: {"median": statistics.median(v) * 1e3, "p90": pct(v, 0.9) * 1e3, "n": len(v)}
            for side, v in ttft.items()
        },
        "first_chunk_overhead_ms": {"median": statistics.median(diffs) * 1e3, "p90": pct(diffs, 0.9) * 1e3},
        "throughput": {
            "rounds": rounds,
            "ratio_median": statistics.median(ratios),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
            "ratio_iqr": [q[0], q[2]],
            "direct_rps_median": statistics.median(r["rps"] for r in rounds if r["side"] == "direct"),
            "gateway_rps_median": statistics.median(r["rps"] for r in rounds if r["side"] == "gateway"),
            "errors": sum(r["errors"] for r in rounds),
        },
        "settings": {
            k: getattr(a, k) for k in ("rounds", "round_seconds", "concurrency", "max_tokens", "ttft_samples")
        },
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--direct", help="engine base URL (default: start one)")
    p.add_argument("--gateway", help="gateway base URL in front of that engine (default: start one)")
    p.add_argument("--model", default="tiny-qwen3")
    p.add_argument("--model-dir", help="tiny model folder (default: build one in a temp dir)")
    p.add_argument("--rounds", type=int, default=10, help="round pairs")
    p.add_argument("--round-seconds", type=float, default=5)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--ttft-samples", type=int, default=40)
    p.add_argument("--json", help="write the results here")
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gateway-bench-"))
    eng: EngineProcess | None = None
    gw: Gateway | None = None
    try:
        direct, gateway = a.direct, a.gateway
        if not (direct and gateway):
            from vllm_fleet.devtools.tinymodel import build_tiny_model

            model_dir = build_tiny_model(Path(a.model_dir) if a.model_dir else work / "tiny")
            (work / "engine").mkdir()
            eng = (
                EngineProcess(model_dir, served_name=a.model, workdir=work / "engine").start().wait_ready(900)
            )
            keys = work / "api_keys"
            keys.write_text(f'"{KEY}" bench;\n')
            big = {
                "per_key_rps": 100000,
                "per_key_burst": 100000,
                "per_ip_rps": 100000,
                "per_ip_burst": 100000,
            }
            spec = gateway_spec(
                [{"name": "a", "port": eng.port, "served_model_name": a.model}], work, str(model_dir),
                api_keys_file=str(keys), rate_limit=big,
            )  # fmt: skip
            gw = Gateway(spec, work).start()
            direct, gateway = eng.url, gw.url
        res = asyncio.run(bench(a, direct, gateway))
    finally:
        if gw:
            gw.stop()
        if eng:
            eng.stop()
    out = json.dumps(res, indent=2)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(out + "\n")
    fc, tp = res["first_chunk_ms"], res["throughput"]
    print(
        f"first SSE chunk: direct {fc['direct']['median']:.1f} ms, gateway {fc['gateway']['median']:.1f} ms "
        f"(median paired overhead {res['first_chunk_overhead_ms']['median']:.2f} ms)\n"
        f"throughput: gateway/direct median {tp['ratio_median']:.3f} (min {tp['ratio_min']:.3f}, "
        f"max {tp['ratio_max']:.3f}, IQR {tp['ratio_iqr'][0]:.3f}-{tp['ratio_iqr'][1]:.3f}); "
        f"direct {tp['direct_rps_median']:.1f} req/s, gateway {tp['gateway_rps_median']:.1f} req/s, "
        f"errors {tp['errors']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
