"""tools/gpu-validate/classes.py's pure parts and its specs: the two renders (the engine's priority flags only with
classes, nothing held back by the gateway), the engine's samples over a phase's window, the comparison and its
ratios, the access log's classes."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from vllm_fleet.devtools.testing import load_tool

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cl() -> ModuleType:
    return load_tool(REPO / "tools" / "gpu-validate" / "classes.py", "gpu_classes")


def test_the_two_renders_differ_only_in_the_engines_priority_and_the_gateways_header(
    cl: ModuleType, tmp_path: Path
) -> None:
    specs = cl.write_specs(tmp_path / "specs", 32)
    facts = cl.render_specs(specs, lambda n: tmp_path / f"render-{n}", install=None)
    c, p = facts["classes"], facts["plain"]
    assert facts["ok"]
    assert c["engine_priority"] and c["gateway_sends_priority"]
    assert not p["engine_priority"] and not p["gateway_sends_priority"]
    cmd = c["engine_command"]
    assert cmd[cmd.index("--max-num-seqs") + 1] == "32"
    assert "--max-num-queued-reqs" not in cmd  # vLLM 0.21.0 has no such flag: the engine's queue is unbounded
    # nothing binds at the gateway: no model capacity (vLLM 0.21.0 cannot bound its queue: the admission
    # service holds nothing back), the key unlimited
    for f in (c, p):
        assert f["admission_capacity"] == {}
        assert f["admission_default_key"]["max_in_flight"] == 0
        assert f["admission_default_key"]["requests_per_minute"] == 0
        assert f["admission_default_key"]["tokens_per_minute"] == 0


def test_priority_needs_both_the_policy_and_the_middleware(cl: ModuleType) -> None:
    mw = ["--middleware", "vllm_fleet.host.request_priority.RequestPriority"]
    pol = ["--scheduling-policy", "priority"]
    assert cl.has_priority(["vllm", "serve", "m", *pol, *mw])
    assert not cl.has_priority(["vllm", "serve", "m", *pol])
    assert not cl.has_priority(["vllm", "serve", "m", *mw])
    assert not cl.has_priority(["vllm", "serve", "m", "--scheduling-policy", "fcfs", *mw])
    # the stream guard is another middleware, not the priority one
    assert not cl.has_priority(["vllm", *pol, "--middleware", "vllm_fleet.host.stream_guard.StreamGuard"])


def test_the_engines_samples_count_only_inside_the_window(cl: ModuleType) -> None:
    rows = [
        {"t": 0.0, "num_requests_running": 64, "num_requests_waiting": 900, "generation_tokens_total": 0.0},
        {
            "t": 10.0,
            "num_requests_running": 32,
            "num_requests_waiting": 150,
            "generation_tokens_total": 1000.0,
        },
        {"t": 12.0, "kind": None},  # a failed scrape: no metrics
        {
            "t": 15.0,
            "num_requests_running": 32,
            "num_requests_waiting": 170,
            "generation_tokens_total": 6000.0,
        },
        {
            "t": 20.0,
            "num_requests_running": 30,
            "num_requests_waiting": 160,
            "generation_tokens_total": 9000.0,
        },
        {
            "t": 25.0,
            "num_requests_running": 64,
            "num_requests_waiting": 999,
            "generation_tokens_total": 99999.0,
        },
    ]
    w = cl.engine_window(rows, 10.0, 20.0)
    assert w == {"samples": 3, "peak_running": 32, "peak_waiting": 170, "generation_tokens_per_s": 800.0}
    assert cl.engine_window(rows, 30.0, 40.0) == {
        "samples": 0,
        "peak_running": None,
        "peak_waiting": None,
        "generation_tokens_per_s": None,
    }


def _phase(ttft50: float, ttft90: float, ok: float, tok: float, run: int, wait: int) -> dict[str, Any]:
    return {
        "interactive": {"ttft_p50": ttft50, "ttft_p90": ttft90, "success": ok, "requests": 10},
        "batch": {"tokens_per_s": tok, "success": 1.0, "requests": 100},
        "engine": {"generation_tokens_per_s": tok + 10, "peak_running": run, "peak_waiting": wait},
    }


def test_the_comparison_takes_medians_over_rounds_and_the_ratios(cl: ModuleType) -> None:
    runs = {
        "classes": [_phase(0.1, 0.2, 1.0, 5000, 32, 170), _phase(0.3, 0.4, 1.0, 4000, 32, 172)],
        "plain": [_phase(8.0, 9.0, 1.0, 5200, 32, 168), _phase(math.nan, None, 0.5, 4400, 31, 171)],
    }
    c = cl.compare(runs)
    assert c["classes"]["interactive_ttft_p50_s"] == pytest.approx(0.2)
    assert c["classes"]["batch_tokens_per_s"] == 4500
    assert c["classes"]["interactive_requests"] == 20
    # a round without a TTFT (NaN or None) leaves it out of the median
    assert c["plain"]["interactive_ttft_p50_s"] == 8.0 and c["plain"]["interactive_ttft_p90_s"] == 9.0
    assert c["plain"]["interactive_success"] == 0.75
    assert (c["plain"]["engine_peak_running"], c["plain"]["engine_peak_waiting"]) == (32, 171)
    r = c["ratios"]
    assert r["interactive_ttft_p50_plain_over_classes"] == 40.0
    assert r["interactive_ttft_p90_plain_over_classes"] == 30.0
    assert r["batch_tokens_per_s_classes_over_plain"] == round(4500 / 4800, 2)
    # one config only (the first phase): no ratios, no error
    one = cl.compare({"classes": runs["classes"]})
    assert one["ratios"]["interactive_ttft_p50_plain_over_classes"] is None


def test_access_log_classes_and_strict_json(cl: ModuleType) -> None:
    log = "\n".join(
        [
            json.dumps({"status": 200, "class": "batch"}),
            json.dumps({"status": 200, "class": "interactive"}),
            json.dumps({"status": 200, "class": "batch"}),
            json.dumps({"status": 200, "class": ""}),
            "not json",
            "[1, 2]",
            json.dumps({"status": 200}),  # a gateway without classes logs no class field
        ]
    )
    assert cl.class_counts(log) == {"batch": 2, "interactive": 1, "": 2}
    assert cl.finite({"a": [math.nan, 1.0, {"b": math.nan}], "c": (2, math.nan)}) == {
        "a": [None, 1.0, {"b": None}],
        "c": [2, None],
    }
