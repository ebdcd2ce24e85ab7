"""vLLM's sleep mode on the H200 (issue 33's facts, before the launcher owns it): one Qwen3-8B-shaped engine (dummy
weights) with ``--enable-sleep-mode`` and ``VLLM_SERVER_DEV_MODE=1``, alone on the GPU.

Device side, after `run-device.sh install` (docs/gpu-validation.md, "Sleep mode"):

  python3 tools/gpu-validate/sleep.py OUT     # one call, about 6 min; OUT/sleep-results.json

In order: a start (the compile cache cold), the first request's TTFT, a 10 s round of 64 streams (output
tokens/s); GPU memory awake; ``POST /sleep?level=1`` (its time, GPU memory asleep, ``/is_sleeping``), a
completion asked while asleep (what a client gets), ``POST /wake_up`` (its time), the first request's TTFT after
it and a round; then level 2: sleep, wake (weights and KV cache), ``/collective_rpc reload_weights`` (level 2
drops the weights), the first TTFT and a round; then the engine stopped and started again with the compile
cache warm (what a swap by restart costs) and its first TTFT. The development endpoints answer only because
``VLLM_SERVER_DEV_MODE=1``: listed in the results (``dev_endpoints``).
"""

from __future__ import annotations

import asyncio
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lora import BASE, MODEL, VF, bench_round  # tools/gpu-validate/lora.py: the load rounds

PORT = 8021
ROUND_S = float(os.environ.get("SLEEP_ROUND_S", "10"))


def http(method: str, path: str, body: Any = None, timeout: float = 120) -> tuple[int, str, float]:
    """(status, body text, seconds) of one request to the engine; status 0 on a timeout or a refused connection."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{PORT}{path}", data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return int(r.status), r.read().decode(errors="replace")[:500], time.monotonic() - t0
    except urllib.error.HTTPError as e:
        return int(e.code), e.read().decode(errors="replace")[:500], time.monotonic() - t0
    except Exception as e:
        return 0, repr(e)[:300], time.monotonic() - t0


def gpu_used_mib() -> int:
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=False).stdout  # fmt: skip
    return int(out.split()[0]) if out.split() else -1


def start(log: Path) -> tuple[subprocess.Popen[bytes], float]:
    cmd = [
        str(VF / "venv/bin/vllm"), "serve", str(MODEL), "--served-model-name", BASE,
        "--host", "127.0.0.1", "--port", str(PORT), "--load-format", "dummy", "--dtype", "bfloat16",
        "--max-model-len", "4096", "--gpu-memory-utilization", "0.85", "--max-num-seqs", "256",
        "--enable-sleep-mode",
    ]  # fmt: skip
    env = dict(os.environ, VLLM_USE_FLASHINFER_SAMPLER="0", VLLM_NO_USAGE_STATS="1", VLLM_SERVER_DEV_MODE="1",
               VLLM_CACHE_ROOT=str(VF / "cache" / "sleep-vllm"))  # fmt: skip
    t0 = time.monotonic()
    with log.open("ab") as f:
        p = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    while time.monotonic() - t0 < 400:
        if http("GET", "/health", timeout=2)[0] == 200:
            return p, time.monotonic() - t0
        if p.poll() is not None:
            break
        time.sleep(1)
    sys.stderr.write(log.read_text(errors="replace")[-4000:])
    raise SystemExit("the engine did not become healthy")


def ttft() -> dict[str, Any]:
    """One streamed completion: seconds to its first token, and in all."""
    body = {
        "model": BASE,
        "prompt": "the quick brown fox",
        "max_tokens": 16,
        "stream": True,
        "temperature": 0,
    }
    req = urllib.request.Request(f"http://127.0.0.1:{PORT}/v1/completions", data=json.dumps(body).encode(),
                                 method="POST", headers={"Content-Type": "application/json"})  # fmt: skip
    t0 = time.monotonic()
    first = None
    with urllib.request.urlopen(req, timeout=300) as r:
        for line in r:
            if first is None and line.startswith(b"data: {"):
                first = time.monotonic() - t0
    return {"ttft_s": round(first or -1, 4), "e2e_s": round(time.monotonic() - t0, 4)}


def one_round(name: str) -> dict[str, Any]:
    r = asyncio.run(bench_round(PORT, [BASE], ROUND_S, seed=len(name)))
    print(f"  round {name}: {json.dumps(r)[:300]}", flush=True)
    return dict(r)


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    log = out / "engine.log"
    res: dict[str, Any] = {"round_s": ROUND_S}

    def save() -> None:
        (out / "sleep-results.json").write_text(json.dumps(res, indent=2))

    res["gpu_used_mib_before_start"] = gpu_used_mib()
    p, secs = start(log)
    res["start_cold_cache_s"] = round(secs, 1)
    res["first_ttft_after_start"] = ttft()
    res["round_before"] = one_round("before")
    res["gpu_used_mib_awake"] = gpu_used_mib()
    print("awake", res["gpu_used_mib_awake"], "MiB", flush=True)
    save()
    res["dev_endpoints"] = {
        path: http("GET", path, timeout=10)[0] for path in ("/is_sleeping", "/server_info")
    }
    for level in (1, 2):
        key = f"level{level}"
        r: dict[str, Any] = {}
        st, body, s = http("POST", f"/sleep?level={level}")
        r["sleep"] = {"status": st, "seconds": round(s, 3), "body": body[:200]}
        r["is_sleeping"] = http("GET", "/is_sleeping")[1]
        r["gpu_used_mib_asleep"] = gpu_used_mib()
        st, body, s = http(
            "POST", "/v1/completions", {"model": BASE, "prompt": "x", "max_tokens": 4}, timeout=15
        )
        r["request_while_asleep"] = {"status": st, "seconds": round(s, 3), "body": body[:300]}
        st, body, s = http("POST", "/wake_up")
        r["wake_up"] = {"status": st, "seconds": round(s, 3), "body": body[:200]}
        if level == 2:  # level 2 dropped the weights: load them again (the dummy loader here, disk for real)
            st, body, s = http("POST", "/collective_rpc", {"method": "reload_weights"}, timeout=300)
            r["reload_weights"] = {"status": st, "seconds": round(s, 3), "body": body[:200]}
        r["is_sleeping_after"] = http("GET", "/is_sleeping")[1]
        r["gpu_used_mib_woken"] = gpu_used_mib()
        r["first_ttft_after_wake"] = ttft()
        r["round_after"] = one_round(key)
        res[key] = r
        print(key, json.dumps({k: v for k, v in r.items() if k != "round_after"})[:600], flush=True)
        save()
    os.killpg(p.pid, signal.SIGTERM)
    p.wait(120)
    res["gpu_used_mib_after_stop"] = gpu_used_mib()
    p, secs = start(log)
    res["start_warm_cache_s"] = round(secs, 1)
    res["first_ttft_after_restart"] = ttft()
    os.killpg(p.pid, signal.SIGTERM)
    p.wait(120)
    save()
    print(json.dumps({k: v for k, v in res.items() if not k.startswith(("round", "level"))}, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
