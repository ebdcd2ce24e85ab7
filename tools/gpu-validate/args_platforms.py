"""Device side: does `vllm serve --help=all` name the same options on CUDA as with VLLM_TARGET_DEVICE=cpu?

`vllm-fleet lock args` captures the gpu argument list on a machine without a GPU (the official wheel, run on a
CPU torch with VLLM_TARGET_DEVICE=cpu). This checks that assumption with the vLLM the H200 has (the carried
0.21.0 under $SITE, tools/gpu-validate/run-device.sh install): both option sets, parsed with the parser the
planner uses, and their difference, to OUT/args-platforms.json. Exit 0 when they are equal.

    python3 tools/gpu-validate/args_platforms.py $OUT
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from vllm_fleet.fleet.engine_flags import parse_help


def options(env_extra: dict[str, str]) -> tuple[set[str], str]:
    env = {**os.environ, "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", **env_extra}
    res = subprocess.run([sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", "--help=all"],
                         capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
    return parse_help(res.stdout), res.stderr[-2000:] if res.returncode else ""


def main() -> int:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    out.mkdir(parents=True, exist_ok=True)
    cuda, cuda_err = options({})
    cpu, cpu_err = options({"VLLM_TARGET_DEVICE": "cpu"})
    import vllm

    result = {
        "vllm": vllm.__version__,
        "cuda_options": len(cuda),
        "cpu_options": len(cpu),
        "only_cuda": sorted(cuda - cpu),
        "only_cpu": sorted(cpu - cuda),
        "errors": {"cuda": cuda_err, "cpu": cpu_err},
    }
    (out / "args-platforms.json").write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "errors"}, indent=2))
    return 0 if cuda and cuda == cpu else 1


if __name__ == "__main__":
    sys.exit(main())
