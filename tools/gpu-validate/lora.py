"""LoRA adapters on the H200 (issue 32): a Qwen3-8B-shaped base (dummy weights) with N random rank-16 adapters.

Device side, after `run-device.sh install` (docs/gpu-validation.md, "LoRA adapters"):

  python3 tools/gpu-validate/lora.py start OUT    # adapters + two engines (own sessions: they outlive the call)
  python3 tools/gpu-validate/lora.py bench OUT    # runtime loads, then the interleaved rounds; results.json

Two engines share the GPU (gpu_memory_utilization 0.42 each, started one after the other: two engines that
start together mis-size their KV cache): A serves the base alone (no LoRA flags), B the same base with
`--enable-lora --max-loras 32 --max-lora-rank 16` and runtime loading on. The bench loads one engine at a time,
in interleaved rounds: A base, B base, B with the requests spread over 1, 8 and 32 adapters. Each round: C
concurrent streaming completions for D seconds (random prompts of P words, 128 tokens each, ignore_eos);
figures: requests/s, output tokens/s, TTFT p50/p90, failures. Also the time of each runtime load
(POST /v1/load_lora_adapter) and of each adapter's first request, and nvidia-smi's memory per process.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

VF = Path("/root/vf")
MODEL = VF / "models" / "qwen3-8b"
ADAPTERS = VF / "adapters"
BASE = "qwen3-8b"
RANK = 16
N_MAX = 32
PORTS = {"A": 8011, "B": 8012}
CONCURRENCY = int(os.environ.get("LORA_C", "64"))
ROUND_SECONDS = float(os.environ.get("LORA_D", "20"))
PROMPT_WORDS = 200
MAX_TOKENS = 128
WORDS = "the of and to in is was for on that with as by at from his an were are which this be".split()  # noqa: SIM905


def make_adapters(n: int) -> list[str]:
    """n random rank-16 adapters (peft format) for the Qwen3-8B shape: q,k,v,o,gate,up,down of every layer,
    drawn on the GPU (vllm_fleet.devtools.tinymodel.write_lora_adapter: torch is imported only by the call)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo (PYTHONPATH names it too)
    from vllm_fleet.devtools.tinymodel import write_lora_adapter

    cfg = json.loads((MODEL / "config.json").read_text())
    names = []
    for i in range(n):
        name = f"a{i:02d}"
        out = ADAPTERS / name
        names.append(name)
        if not (out / "adapter_model.safetensors").exists():
            write_lora_adapter(cfg, out, RANK, seed=1000 + i, base_name=BASE, scale=0.01, device="cuda")
    return names


def engine_cmd(which: str) -> tuple[list[str], dict[str, str]]:
    cmd = [
        str(VF / "venv/bin/vllm"), "serve", str(MODEL), "--served-model-name", BASE,
        "--host", "127.0.0.1", "--port", str(PORTS[which]), "--load-format", "dummy", "--dtype", "bfloat16",
        "--max-model-len", "4096", "--gpu-memory-utilization", "0.42", "--max-num-seqs", "256",
    ]  # fmt: skip
    env = dict(os.environ, VLLM_USE_FLASHINFER_SAMPLER="0", VLLM_NO_USAGE_STATS="1")
    env["VLLM_CACHE_ROOT"] = str(VF / "cache" / "lora-vllm")
    if which == "B":
        cmd += ["--enable-lora", "--max-loras", str(N_MAX), "--max-lora-rank", str(RANK)]
        cmd += ["--max-cpu-loras", str(N_MAX)]
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    return cmd, env


def get(url: str, timeout: float = 5) -> int:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return int(r.status)
    except Exception:
        return 0


def wait_healthy(port: int, limit: float, log: Path) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        if get(f"http://127.0.0.1:{port}/health") == 200:
            return time.monotonic() - t0
        time.sleep(2)
    sys.stderr.write(log.read_text()[-4000:])
    raise SystemExit(f"engine on {port} not healthy after {limit:.0f}s")


def start(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    make_adapters(N_MAX)
    facts: dict[str, object] = {"adapters_made_seconds": round(time.monotonic() - t0, 1)}
    size = sum(f.stat().st_size for f in (ADAPTERS / "a00").iterdir())
    facts["adapter_bytes"] = size
    for which in ("A", "B"):
        cmd, env = engine_cmd(which)
        log = VF / "log" / f"lora-{which}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("w") as f:
            subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        facts[f"start_{which}_seconds"] = round(wait_healthy(PORTS[which], 560, log), 1)
        print(which, "healthy", facts[f"start_{which}_seconds"], flush=True)
    (out / "start.json").write_text(json.dumps(facts, indent=2))
    print(json.dumps(facts))


def prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(PROMPT_WORDS))


async def one(session, port: int, model: str, text: str, rec: dict) -> None:  # type: ignore[no-untyped-def]
    body = {"model": model, "prompt": text, "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True,
            "temperature": 0}  # fmt: skip
    t0 = time.monotonic()
    ttft = None
    tokens = 0
    try:
        async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
            if r.status != 200:
                rec["failed"] += 1
                rec.setdefault("errors", []).append((await r.text())[:200])
                return
            async for line in r.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                ev = json.loads(line[6:])
                if ev.get("choices") and ev["choices"][0].get("text") is not None:
                    tokens += 1
                    if ttft is None:
                        ttft = time.monotonic() - t0
    except Exception as exc:
        rec["failed"] += 1
        rec.setdefault("errors", []).append(repr(exc)[:200])
        return
    rec["ttft"].append(ttft if ttft is not None else time.monotonic() - t0)
    rec["tokens"] += tokens
    rec["done"] += 1


async def bench_round(port: int, models: list[str], seconds: float, seed: int) -> dict:
    import aiohttp

    rng = random.Random(seed)
    rec: dict = {"ttft": [], "tokens": 0, "done": 0, "failed": 0}
    end = time.monotonic() + seconds
    conn = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as s:
        n = 0

        async def lane(k: int) -> None:
            nonlocal n
            while time.monotonic() < end:
                model = models[n % len(models)]
                n += 1
                await one(s, port, model, prompt(rng), rec)

        t0 = time.monotonic()
        await asyncio.gather(*(lane(k) for k in range(CONCURRENCY)))
        wall = time.monotonic() - t0
    t = sorted(rec["ttft"])
    q = statistics.quantiles(t, n=10) if len(t) >= 10 else [float("nan")] * 9
    return {
        "requests": rec["done"],
        "failed": rec["failed"],
        "errors": rec.get("errors", [])[:3],
        "wall_s": round(wall, 2),
        "req_per_s": round(rec["done"] / wall, 2),
        "out_tok_per_s": round(rec["tokens"] / wall, 1),
        "ttft_p50_ms": round(statistics.median(t) * 1000, 1) if t else None,
        "ttft_p90_ms": round(q[8] * 1000, 1),
    }


def post(port: int, path: str, obj: dict) -> tuple[int, str, float]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=json.dumps(obj).encode(),
        headers={"Content-Type": "application/json"},
    )
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return int(r.status), r.read().decode()[:200], time.monotonic() - t0
    except urllib.error.HTTPError as e:
        return int(e.code), e.read().decode()[:200], time.monotonic() - t0


def smi() -> str:
    q = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"]
    return subprocess.run(q, capture_output=True, text=True).stdout.strip()


def bench(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    names = make_adapters(N_MAX)
    res: dict = {"concurrency": CONCURRENCY, "round_seconds": ROUND_SECONDS, "prompt_words": PROMPT_WORDS,
                 "max_tokens": MAX_TOKENS, "rank": RANK, "smi_before_loads": smi()}  # fmt: skip
    loads = []
    for name in names:
        st, text, dt = post(
            PORTS["B"], "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(ADAPTERS / name)}
        )
        loads.append({"adapter": name, "status": st, "seconds": round(dt, 4), "text": text[:80]})
    res["loads"] = loads
    # the first request of each adapter: the adapter's weights go to a GPU slot then
    first = []
    for name in names[:8]:
        st, _, dt = post(PORTS["B"], "/v1/completions", {"model": name, "prompt": "hello", "max_tokens": 1})
        first.append({"adapter": name, "status": st, "seconds": round(dt, 4)})
    res["first_requests"] = first
    res["smi_after_loads"] = smi()
    conds = {
        "A_base": (PORTS["A"], [BASE]),
        "B_base": (PORTS["B"], [BASE]),
        "B_1": (PORTS["B"], names[:1]),
        "B_8": (PORTS["B"], names[:8]),
        "B_32": (PORTS["B"], names[:32]),
    }
    for port, models in conds.values():  # warm-up: a short round each (CUDA graphs, adapters in slots)
        asyncio.run(bench_round(port, models, 5, seed=1))
    order = list(conds)
    rounds: dict[str, list] = {k: [] for k in conds}
    for r, seq in enumerate((order, order[::-1])):
        for k in seq:
            port, models = conds[k]
            got = asyncio.run(bench_round(port, models, ROUND_SECONDS, seed=100 + r))
            rounds[k].append(got)
            print(r, k, json.dumps(got), flush=True)
    res["rounds"] = rounds
    res["summary"] = {
        k: {
            "req_per_s": round(statistics.mean(x["req_per_s"] for x in v), 2),
            "out_tok_per_s": round(statistics.mean(x["out_tok_per_s"] for x in v), 1),
            "out_tok_per_s_spread": [min(x["out_tok_per_s"] for x in v), max(x["out_tok_per_s"] for x in v)],
            "ttft_p50_ms": round(statistics.mean(x["ttft_p50_ms"] for x in v), 1),
            "ttft_p90_ms": round(statistics.mean(x["ttft_p90_ms"] for x in v), 1),
            "failed": sum(x["failed"] for x in v),
        }
        for k, v in rounds.items()
    }
    base = res["summary"]["A_base"]
    res["ratios_vs_A_base"] = {
        k: {
            "out_tok_per_s": round(v["out_tok_per_s"] / base["out_tok_per_s"], 3),
            "ttft_p50": round(v["ttft_p50_ms"] / base["ttft_p50_ms"], 3),
        }
        for k, v in res["summary"].items()
    }
    for which in ("A", "B"):
        log = (VF / "log" / f"lora-{which}.log").read_text()
        res[f"kv_lines_{which}"] = [
            ln[-160:] for ln in log.splitlines() if "KV cache" in ln or "GPU KV" in ln
        ][:4]
        (out / f"engine-{which}.log").write_text(log[-200_000:])
    (out / "results.json").write_text(json.dumps(res, indent=2))
    print(json.dumps({"summary": res["summary"], "ratios": res["ratios_vs_A_base"]}, indent=1))
    print("loads s:", [x["seconds"] for x in loads][:8], "first:", [x["seconds"] for x in first])


if __name__ == "__main__":
    {"start": start, "bench": bench}[sys.argv[1]](Path(sys.argv[2]))
