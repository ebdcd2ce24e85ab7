#!/usr/bin/env python3
"""A burst far above max_num_seqs through a LoRA fleet's gateway: the base model and its adapters in turn, half
the lanes streamed, a new connection per request (tools/gpu-validate/lora_fleet.py's lanes, tally and verdict:
every request complete or refused with a JSON 429/503 and Retry-After, none cut, no 200 carrying an error, each
answer naming the model asked).

    python tools/lora_burst.py GATEWAY_HOST:PORT KEY_FILE --base tiny-qwen3 --models tiny-qwen3,tiny-sql,tiny-chat \\
        [--lanes 96] [--seconds 30] [--tokens 16] [--json OUT]

e.g. on `make demo DEMO_SPEC=examples/tiny-cpu-lora.yml KEEP=1` (docs/perf/lora.md). Exit 0 when every check held.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu-validate"))
import lora_fleet as lf


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gateway", help="HOST:PORT")
    ap.add_argument("key_file")
    ap.add_argument("--base", required=True, help="the base model's served name")
    ap.add_argument("--models", required=True, help="comma-separated: the base and its adapters")
    ap.add_argument("--lanes", type=int, default=96)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    key = Path(a.key_file).read_text().split()[0]
    host, port = a.gateway.rsplit(":", 1)
    models = a.models.split(",")
    lf.NAME = a.base  # the tally's "base" group

    def plan(i: int, k: int) -> tuple[str, bool]:
        return models[(i + k) % len(models)], i % 2 == 0

    records, cut = asyncio.run(lf.lanes(host, int(port), key, a.lanes, plan, a.tokens, a.seconds, 60.0))
    tally = lf.tally(records, cut)
    verdict = lf.burst_verdict(tally)
    print(json.dumps({"tally": tally, "verdict": verdict}, indent=1, default=str))
    if a.json:
        Path(a.json).write_text(json.dumps({"tally": tally, "verdict": verdict}, indent=1, default=str))
    return 0 if all(verdict.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
