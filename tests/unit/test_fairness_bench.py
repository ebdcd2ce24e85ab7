"""tools/fairness_bench.py's readings of the admission service's metrics, on known samples: the wait
histogram's quantiles between two scrapes, refusals by reason, the summary of a phase's requests."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def fb() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fairness_bench", REPO / "tools" / "fairness_bench.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def buckets(key: str, counts: dict[str, float]) -> dict[str, float]:
    name = "vllm_fleet_gateway_key_queue_wait_seconds_bucket"
    return {f'{name}{{client="c",key="{key}",le="{le}"}}': n for le, n in counts.items()}


def test_the_wait_quantiles_are_those_of_the_requests_between_the_two_scrapes(fb: ModuleType) -> None:
    before = buckets("c/1", {"0.5": 10, "1.0": 10, "2.5": 10, "+Inf": 10})  # 10 earlier waits under 0.5 s
    # then 100 more: 20 in (0.5, 1], 80 in (1, 2.5]; another key's samples do not count
    after = buckets("c/1", {"0.5": 10, "1.0": 30, "2.5": 110, "+Inf": 110}) | buckets(
        "c/2", {"0.5": 99, "+Inf": 99}
    )
    assert fb.hist_quantile(before, after, "c/1", 0.1) == pytest.approx(0.75)  # rank 10 of 20 in (0.5, 1]
    assert fb.hist_quantile(before, after, "c/1", 0.5) == pytest.approx(1.0 + 1.5 * 30 / 80)
    assert fb.hist_quantile(before, after, "c/1", 0.9) == pytest.approx(1.0 + 1.5 * 70 / 80)
    assert math.isnan(fb.hist_quantile(after, after, "c/1", 0.5))  # nothing waited in between
    beyond = buckets("c/1", {"0.5": 10, "1.0": 10, "2.5": 10, "+Inf": 12})
    assert fb.hist_quantile(before, beyond, "c/1", 0.9) == 2.5  # in +Inf: the last finite bound


def test_refusals_are_counted_per_reason_between_the_scrapes(fb: ModuleType) -> None:
    name = "vllm_fleet_gateway_key_refused_total"
    before = {f'{name}{{client="g",key="g/1",reason="wait_timeout"}}': 3.0}
    after = {
        f'{name}{{client="g",key="g/1",reason="wait_timeout"}}': 5.0,
        f'{name}{{client="g",key="g/1",reason="queue_full"}}': 4.0,
        f'{name}{{client="g",key="g/1",reason="rpm"}}': 0.0,
        f'{name}{{client="p",key="p/1",reason="queue_full"}}': 7.0,
    }
    assert fb.refusals(before, after, "g/1") == {"wait_timeout": 2, "queue_full": 4}


def test_a_phase_summary_counts_only_complete_answers_and_groups_the_failures(fb: ModuleType) -> None:
    R = fb.Result
    rs = [
        R(0.0, 200, 0.02, 0.2, True),
        R(0.1, 200, 0.04, 0.2, True),
        R(0.2, 200, 0.01, 0.2, False),  # a stream cut before [DONE]: not a success, its TTFT not counted
        R(0.3, 429, None, 20.0, False, "Waited 20 s for a slot of model tiny-qwen3"),
        R(0.4, 429, None, 20.1, False, "Waited 20 s for a slot of model tiny-qwen3"),
    ]
    s = fb.summary(rs)
    assert (s["requests"], s["ok"], s["success"]) == (5, 2, 0.4)
    assert s["ttft_p50"] == 0.02 and s["ttft_p90"] == 0.04 and s["ttft_max"] == 0.04
    assert s["failed"] == {"200": 1, "429 Waited N s for a slot of model tiny-qwenN": 2}
