"""extra_args checks: every flag vllm-fleet emits is managed, and short / underscore / abbreviated spellings
of a managed flag are caught as vLLM's parser would read them."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from vllm_fleet.fleet import engine_flags
from vllm_fleet.fleet.engine import engine_args
from vllm_fleet.fleet.engine_flags import APPENDED, MANAGED, check_args, option_name
from vllm_fleet.fleet.spec import SleepSettings, parse_spec

REPO = Path(__file__).resolve().parents[2]
KNOWN = engine_flags.load("cpu", "0.32.0")


def _every_typed_field(example: str, version: str) -> list[str]:
    d = yaml.safe_load((REPO / "examples" / example).read_text())
    d["stack"]["vllm_version"] = version
    spec = parse_spec(d)
    m = spec.models[0].model_copy(
        update={
            "dtype": "float16",
            "quantization": "awq",
            "kv_cache_dtype": "fp8",
            "kv_cache_memory_bytes": 1 << 30,
            "max_model_len": 4096,
            "max_num_seqs": 8,
            "max_num_queued_reqs": 16,
            "max_num_batched_tokens": 4096,
            "block_size": 16,
            "enable_prefix_caching": True,
            "enable_chunked_prefill": False,
            "enforce_eager": True,
            "reasoning_parser": "qwen3",
            "enable_auto_tool_choice": True,
            "tool_call_parser": "hermes",
            "sleep": SleepSettings(),
        }
    )
    return engine_args(spec, m)


@pytest.mark.parametrize("example", ["seed-004-4xa100.yml", "tiny-cpu.yml"])
def test_every_flag_the_engine_command_sets_is_managed(example: str) -> None:
    args = _every_typed_field(example, "0.32.0")
    emitted = {a for a in args if a.startswith("--")}
    assert "--max-num-queued-reqs" in emitted and "--enforce-eager" in emitted  # all typed fields reached
    assert "--enable-sleep-mode" in emitted
    assert emitted - MANAGED.keys() == APPENDED == {"--middleware"}
    # and check_args refuses each of them again in extra_args, but for one vLLM appends to
    assert KNOWN is not None
    assert check_args(["--middleware", "my.module.Other"], KNOWN) == []
    for flag in emitted - APPENDED:
        assert check_args([flag], KNOWN)[0][1].startswith(f"{flag} is set by vllm-fleet"), flag


def test_the_opposite_boolean_of_a_managed_flag_is_managed() -> None:
    assert KNOWN is not None
    for flag in ("--no-enable-prefix-caching", "--no-enforce-eager", "--no-enable-chunked-prefill"):
        (p,) = check_args([flag], KNOWN)
        assert "set by vllm-fleet" in p[1], flag


@pytest.mark.parametrize(
    ("args", "reason"),
    [
        (
            ["-tp", "2"],
            "-tp (--tensor-parallel-size) is set by vllm-fleet from the spec; use the typed field "
            "tensor_parallel_size instead",
        ),
        (["-q", "awq"], "-q (--quantization) is set by vllm-fleet"),
        (["-tp=2"], "-tp (--tensor-parallel-size) is set by vllm-fleet"),
        (
            ["--tensor_parallel_size", "2"],
            "--tensor_parallel_size (--tensor-parallel-size) is set by vllm-fleet",
        ),
        (["--max_model_len=8192"], "--max_model_len (--max-model-len) is set by vllm-fleet"),
        (
            ["--tensor-parallel", "2"],
            "--tensor-parallel (abbreviates --tensor-parallel-size) is set by vllm-fleet",
        ),
        (["--port=9000"], "--port is set by vllm-fleet from the spec; use the typed field port instead"),
        (["-x", "1"], "-x is not a short option vllm-fleet knows; write the long option"),
        (
            ["--max-num-seqz", "4"],
            "--max-num-seqz is not an option of this vLLM release (did you mean --max-num-seqs?)",
        ),
    ],
)
def test_spellings_vllm_accepts_are_read_as_vllm_reads_them(args: list[str], reason: str) -> None:
    assert KNOWN is not None
    (p,) = check_args(args, KNOWN)
    assert p[0] == 0 and p[1].startswith(reason), p


def test_values_and_options_that_are_fine() -> None:
    assert KNOWN is not None
    ok = ["--seed", "-1", "-pp", "2", "-O3", "--compilation-config.mode", "3", "--enable-log-requests", "-"]
    assert check_args(ok, KNOWN) == []


def test_option_name() -> None:
    assert option_name("-1") is None and option_name("-0.5") is None and option_name("value") is None
    assert option_name("-O3") == option_name("-O") == "--optimization-level"
    assert option_name("--kv_cache_dtype.x=1") == "--kv-cache-dtype"
    assert option_name("-dp") == "--data-parallel-size"
