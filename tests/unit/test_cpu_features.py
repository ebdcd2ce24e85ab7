"""CPU flags for doctor and the AMX permission request of every engine process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from vllm_fleet.host import cpu_features

CPUINFO = """processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8481C
flags\t\t: fpu avx2 avx512f avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8
processor\t: 1
"""


def test_flags_and_model_from_cpuinfo() -> None:
    facts = cpu_features.isa_facts(CPUINFO)
    assert facts["model"] == "Intel(R) Xeon(R) Platinum 8481C"
    assert facts["flags"] == {f: True for f in cpu_features.ISA_FLAGS}
    assert cpu_features.isa_facts("flags : avx2")["flags"]["amx_tile"] is False
    assert cpu_features.cpu_flags("") == set()


def test_request_matches_what_this_cpu_offers(tmp_path: Path) -> None:
    """In a fresh interpreter: granted where the CPU and kernel offer AMX, 'not offered' elsewhere — never
    an error — and the outcome is traced once per process."""
    trace = tmp_path / "trace.jsonl"
    code = "from vllm_fleet.host.cpu_features import request_amx as r; print(r()); print(r())"
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, cpu_features.TRACE_ENV: str(trace)},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\n")
    has_amx = "amx_tile" in cpu_features.cpu_flags()
    expect = cpu_features.GRANTED if has_amx else cpu_features.NOT_OFFERED
    assert out[0].startswith(expect) and out[1] == out[0], out
    lines = [json.loads(x) for x in trace.read_text().splitlines()]
    assert len(lines) == 1 and lines[0]["amx"] == out[0]
