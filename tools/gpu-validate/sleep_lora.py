"""Sleep mode with LoRA on the H200: does a LoRA engine's adapter survive a sleep, and can it wake from level 2?

The plan refuses `sleep.level: 2` with LoRA on (vLLM issue 39934: reload_weights of a LoRA-wrapped model) and
allows level 1. This run checks both on the pinned release. Device side, after `run-device.sh install`:

  python3 tools/gpu-validate/sleep_lora.py OUT     # one call, about 4 min; OUT/sleep-lora-results.json

One bare engine (no launcher): the Qwen3-8B-shaped model with real random bf16 weights (sleep_fleet.py's
make_real_model, kept for a rerun), `--enable-lora --max-loras 2 --max-lora-rank 16 --enable-sleep-mode`, one
rank-16 adapter `a00` carried (`--lora-modules`). Probes: a greedy completion (8 tokens, temperature 0, top-5
logprobs of each token) of the base and of the adapter. Then: POST /sleep?level=1, /wake_up, the probes again;
POST /sleep?level=2, /wake_up?tags=weights, /collective_rpc reload_weights, /wake_up?tags=kv_cache, the probes
again. Each answer and its status are kept; the verdicts: the adapter changes the answer, level 1 keeps both
answers, and what level 2 does.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from lora import BASE, MODEL, VF  # noqa: E402
from sleep import gpu_used_mib, http  # noqa: E402  (its PORT: 8021)
from sleep_fleet import make_real_model  # noqa: E402

REPO = HERE.parents[1]
REAL = VF / "models" / "qwen3-8b-b"  # sleep_fleet.py's folder of real weights (reused when there)
ADAPTER = VF / "adapters-sleep" / "a00"


def probe(model: str) -> dict[str, Any]:
    body = {"model": model, "prompt": "the quick brown fox jumps over", "max_tokens": 8, "temperature": 0,
            "logprobs": 5}  # fmt: skip
    req = urllib.request.Request("http://127.0.0.1:8021/v1/completions", data=json.dumps(body).encode(),
                                 method="POST", headers={"Content-Type": "application/json"})  # fmt: skip
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            st, text = int(r.status), r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        st, text = int(e.code), e.read().decode(errors="replace")
    except OSError as e:
        st, text = 0, repr(e)
    sec = time.monotonic() - t0
    out: dict[str, Any] = {"status": st, "seconds": round(sec, 3)}
    try:
        choice = json.loads(text)["choices"][0]
        out["text"] = choice["text"]
        out["top1_logprobs"] = [round(x, 3) for x in choice["logprobs"]["token_logprobs"]]
    except (ValueError, KeyError, IndexError, TypeError):
        out["body"] = text[:400]
    return out


def probes() -> dict[str, Any]:
    return {"base": probe(BASE), "a00": probe("a00")}


def step(res: dict[str, Any], name: str, method: str, path: str, body: Any = None) -> int:
    st, text, sec = http(method, path, body, timeout=600)
    res["steps"].append({"step": name, "status": st, "seconds": round(sec, 3), "body": text[:600],
                         "gpu_used_mib": gpu_used_mib()})  # fmt: skip
    print(f"  {name}: {st} in {sec:.2f} s {text[:200]!r}", flush=True)
    return st


def main(out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {"steps": [], "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    res["weights"] = make_real_model(MODEL, REAL)
    print(f"weights: {res['weights']}", flush=True)
    code = (
        f"import json, sys; from pathlib import Path; sys.path.insert(0, {str(REPO)!r})\n"
        "from vllm_fleet.devtools.tinymodel import write_lora_adapter\n"
        f"cfg = json.loads(Path({str(REAL / 'config.json')!r}).read_text())\n"
        f"write_lora_adapter(cfg, Path({str(ADAPTER)!r}), 16, seed=7, base_name={BASE!r}, scale=0.5, "
        "device='cuda')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
    cmd = [
        str(VF / "venv/bin/vllm"), "serve", str(REAL), "--served-model-name", BASE,
        "--host", "127.0.0.1", "--port", "8021", "--dtype", "bfloat16",
        "--max-model-len", "4096", "--gpu-memory-utilization", "0.85", "--max-num-seqs", "64",
        "--enable-sleep-mode", "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16",
        "--lora-modules", f"a00={ADAPTER}",
    ]  # fmt: skip
    env = dict(os.environ, VLLM_USE_FLASHINFER_SAMPLER="0", VLLM_NO_USAGE_STATS="1", VLLM_SERVER_DEV_MODE="1",
               VLLM_CACHE_ROOT=str(VF / "cache" / "sleep-lora-vllm"))  # fmt: skip
    log = out / "engine.log"
    t0 = time.monotonic()
    with log.open("ab") as f:
        p = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        while http("GET", "/health", timeout=2)[0] != 200:
            if p.poll() is not None or time.monotonic() - t0 > 400:
                print(log.read_text(errors="replace")[-3000:])
                raise SystemExit("the engine did not become healthy")
            time.sleep(1)
        res["ready_s"] = round(time.monotonic() - t0, 1)
        print(f"healthy after {res['ready_s']} s; GPU {gpu_used_mib()} MiB", flush=True)
        res["before"] = probes()
        print(f"before: {json.dumps(res['before'])}", flush=True)
        res["before_again"] = probes()  # vLLM's own repeatability, awake
        print(f"before, again: {json.dumps(res['before_again'])}", flush=True)
        step(res, "sleep level 1", "POST", "/sleep?level=1")
        step(res, "wake_up", "POST", "/wake_up")
        res["after_level1"] = probes()
        print(f"after level 1: {json.dumps(res['after_level1'])}", flush=True)
        step(res, "sleep level 2", "POST", "/sleep?level=2")
        step(res, "wake_up weights", "POST", "/wake_up?tags=weights")
        step(res, "reload_weights", "POST", "/collective_rpc", {"method": "reload_weights"})
        step(res, "wake_up kv_cache", "POST", "/wake_up?tags=kv_cache")
        res["engine_alive_after_level2"] = p.poll() is None
        res["after_level2"] = probes() if p.poll() is None else None
        print(f"after level 2: {json.dumps(res['after_level2'])}", flush=True)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
        res["log_tail"] = log.read_text(errors="replace")[-6000:]
        (out / "sleep-lora-results.json").write_text(json.dumps(res, indent=1))

    def same(a: dict[str, Any] | None, b: dict[str, Any]) -> bool:
        return a is not None and a.get("status") == 200 and "text" in a and a.get("text") == b.get("text")

    b = res["before"]
    verdicts = {
        "awake_repeat_base_same": same(res["before_again"]["base"], b["base"]),
        "awake_repeat_adapter_same": same(res["before_again"]["a00"], b["a00"]),
        "adapter_changes_the_answer": "text" in b["a00"] and b["base"].get("text") != b["a00"].get("text"),
        "level1_base_same": same(res["after_level1"]["base"], b["base"]),
        "level1_adapter_same": same(res["after_level1"]["a00"], b["a00"]),
        "level2_reload_ok": next(s["status"] for s in res["steps"] if s["step"] == "reload_weights") == 200,
        "level2_base_same": same((res["after_level2"] or {}).get("base"), b["base"]),
        "level2_adapter_same": same((res["after_level2"] or {}).get("a00"), b["a00"]),
    }
    res["verdicts"] = verdicts
    (out / "sleep-lora-results.json").write_text(json.dumps(res, indent=1))
    print("verdicts: " + json.dumps(verdicts), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(Path(sys.argv[1])))
