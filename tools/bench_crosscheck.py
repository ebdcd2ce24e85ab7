#!/usr/bin/env python3
"""Cross-check `vllm-fleet bench` against vLLM's own `vllm bench serve` on the same engine and workload.

Both send fixed-size random prompts (IN tokens of content, OUT generated tokens with ignore_eos) through the
OpenAI chat API, N requests at concurrency C, streamed; rounds alternate (ours, vllm, vllm, ours, …) because
these machines are noisy. Prints per-round figures and the median ours/vllm ratio of output tokens/s,
requests/s and TTFT (mean, p50).

    .venv/bin/python tools/bench_crosscheck.py --url http://127.0.0.1:8000 --tokenizer MODEL_DIR
    .venv/bin/python tools/bench_crosscheck.py --start-engine MODEL_DIR     # starts a tiny engine itself

vLLM's side runs exactly:
    python -m vllm_fleet.host.vllm_cpu_entry bench serve --backend openai-chat --endpoint /v1/chat/completions
      --base-url URL --model NAME --tokenizer DIR --dataset-name random --random-input-len IN
      --random-output-len OUT --random-range-ratio 0 --num-prompts N --max-concurrency C --request-rate inf
      --ignore-eos --num-warmups 0 --disable-tqdm --save-result --result-dir D --result-filename F --seed S
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from vllm_fleet.bench.session import Options, run_once  # noqa: E402
from vllm_fleet.bench.workload import parse_profile  # noqa: E402
from vllm_fleet.devtools.testing import EngineProcess, engine_env, http_json  # noqa: E402


def vllm_argv(a: argparse.Namespace, model: str, out: Path, fname: str, seed: int) -> list[str]:
    """The arguments of `vllm bench serve` (after `bench serve`) for one round."""
    return [
        "--backend", "openai-chat", "--endpoint", "/v1/chat/completions",
        "--base-url", a.url, "--model", model, "--tokenizer", a.tokenizer,
        "--dataset-name", "random", "--random-input-len", str(a.input_len),
        "--random-output-len", str(a.output_len), "--random-range-ratio", "0",
        "--num-prompts", str(a.num_prompts), "--max-concurrency", str(a.concurrency), "--request-rate", "inf",
        "--ignore-eos", "--num-warmups", "0", "--disable-tqdm", "--seed", str(seed),
        "--save-result", "--result-dir", str(out), "--result-filename", fname,
    ]  # fmt: skip


def vllm_round(a: argparse.Namespace, model: str, out: Path, i: int) -> dict[str, float]:
    """One `vllm bench serve` run, the CLI itself in a fresh process (≈ 1 min of imports before it starts
    sending: not part of its figures). Running its code in this process instead was tried: with torch and
    vLLM imported the client side slowed down (2-3× lower throughput), so that would not be a fair check."""
    fname = f"vllm-{i}.json"
    args = vllm_argv(a, model, out, fname, i)
    argv = [*shlex.split(a.vllm_cmd), "bench", "serve", *args]
    r = subprocess.run(argv, env=engine_env(out / "vllm-cache"), capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        raise SystemExit(f"vllm bench serve failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    d = json.loads((out / fname).read_text())
    return {
        "output_tokens_per_s": d["output_throughput"],
        "requests_per_s": d["request_throughput"],
        "ttft_mean_ms": d["mean_ttft_ms"],
        "ttft_p50_ms": d["median_ttft_ms"],
        "completed": d["completed"],
        "failed": d.get("failed", 0),
    }


def ours_round(a: argparse.Namespace, model: str, i: int) -> dict[str, float]:
    prof = parse_profile(
        {
            "name": "crosscheck",
            "arrival": {"concurrency": a.concurrency},
            "duration": 3600,
            "max_requests": a.num_prompts,
            "seed": i,
            "classes": {"fixed": {"share": 1, "input_tokens": a.input_len, "output_tokens": a.output_len}},
        }
    )
    opts = Options(url=a.url, model=model, metrics_urls=[], progress=False)
    rep = asyncio.run(run_once(prof, opts))
    o = rep["overall"]
    return {
        "output_tokens_per_s": o["output_tokens_per_s"],
        "requests_per_s": o["requests_per_s"],
        "ttft_mean_ms": o["ttft_ms"]["mean"],
        "ttft_p50_ms": o["ttft_ms"]["p50"],
        "completed": o["ok"],
        "failed": o["failed"],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="engine base URL (default: start one with --start-engine)")
    p.add_argument("--tokenizer", help="model folder for vLLM's random dataset (the engine's model)")
    p.add_argument("--start-engine", metavar="MODEL_DIR", help="start a vLLM-CPU engine on this model")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3, help="rounds per tool (alternating ABBA)")
    p.add_argument(
        "--tools",
        default="ours,vllm",
        help="A,B (each ours or vllm): ours,vllm compares; vllm,vllm or ours,ours measures a tool's own noise",
    )
    p.add_argument("--pause", type=float, default=30.0, help="idle seconds before every run (default 30)")
    p.add_argument("--json", help="write the figures here")
    p.add_argument(
        "--vllm-cmd",
        default=f"{sys.executable} -m vllm_fleet.host.vllm_cpu_entry",
        help="how to run the vllm CLI (default: vllm-cpu from this venv; e.g. /opt/vllm-fleet/venv/bin/vllm)",
    )
    p.add_argument(
        "--warmup-requests", type=int, default=16, help="unrecorded requests before the first round"
    )
    a = p.parse_args()
    eng = None
    if a.start_engine:
        eng = EngineProcess(Path(a.start_engine)).start().wait_ready(600)
        a.url, a.tokenizer = eng.url, a.tokenizer or a.start_engine
    if not a.url or not a.tokenizer:
        p.error("give --url and --tokenizer, or --start-engine MODEL_DIR")
    try:
        _, models = http_json("GET", a.url.rstrip("/") + "/v1/models")
        model = models["data"][0]["id"]
        out = Path(tempfile.mkdtemp(prefix="bench-crosscheck-"))
        if a.warmup_requests > 0:  # a fresh engine's first requests are slow: none of that in round 0
            ours_round(argparse.Namespace(**{**vars(a), "num_prompts": a.warmup_requests}), model, 1000)
        tool_a, tool_b = a.tools.split(",")
        order = [(("A", tool_a), ("B", tool_b)) if k % 2 == 0 else (("B", tool_b), ("A", tool_a))
                 for k in range(a.rounds)]  # fmt: skip
        rows: list[dict[str, Any]] = []
        for i, pair in enumerate(order):
            for side, tool in pair:
                time.sleep(
                    a.pause
                )  # the same idle time before every run (the vllm CLI idles ~1 min importing)
                seed = 2 * i + (side == "B")  # never the same prompts twice (prefix caching would flatter)
                fig = ours_round(a, model, seed) if tool == "ours" else vllm_round(a, model, out, seed)
                rows.append({"round": i, "side": side, "tool": tool, **fig})
                print(json.dumps(rows[-1]), flush=True)
    finally:
        if eng is not None:
            eng.stop()
    keys = ("output_tokens_per_s", "requests_per_s", "ttft_mean_ms", "ttft_p50_ms")
    ratios: dict[str, dict[str, float]] = {}
    for k in keys:
        per = [
            next(r[k] for r in rows if r["round"] == i and r["side"] == "A")
            / next(r[k] for r in rows if r["round"] == i and r["side"] == "B")
            for i in range(a.rounds)
        ]
        ratios[k] = {"median": statistics.median(per), "min": min(per), "max": max(per)}
    print(f"\n{tool_a} / {tool_b} (A/B), {a.rounds} round pairs, {a.num_prompts} prompts of {a.input_len} in /"
          f" {a.output_len} out at concurrency {a.concurrency} ({os.uname().nodename}):")  # fmt: skip
    for k, r in ratios.items():
        flag = "ok" if abs(r["median"] - 1) <= 0.05 else "DIFFERS >5 %"
        print(f"  {k:<22} median {r['median']:.3f}  (min {r['min']:.3f}, max {r['max']:.3f})  {flag}")
    if a.json:
        Path(a.json).write_text(
            json.dumps({"args": vars(a), "rounds": rows, "ratios": ratios}, indent=2) + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
