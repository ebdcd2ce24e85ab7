"""tools/fairness_bench.py's readings of the admission service's metrics, on known samples: the wait
histogram's quantiles between two scrapes, refusals by reason, the summary of a phase's requests; and its lanes
(per-group max_tokens, their own key and model, the drain that cuts) against a small local server."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from vllm_fleet.devtools.testing import load_tool

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def fb() -> ModuleType:
    return load_tool(REPO / "tools" / "fairness_bench.py", "fairness_bench")


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


# ---- the lanes as tools/gpu-validate/classes.py drives them


async def _engine(
    seen: list[dict[str, Any]], reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    """A stream of max_tokens events, one every 10 ms; the request's body and headers are recorded."""
    await reader.readline()
    headers = {}
    while (h := await reader.readline()) not in (b"\r\n", b""):
        k, _, v = h.decode().partition(":")
        headers[k.strip().lower()] = v.strip()
    body = json.loads(await reader.readexactly(int(headers["content-length"])))
    seen.append(
        {**body, "authorization": headers.get("authorization"), "class": headers.get("x-request-class")}
    )
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n")
    try:
        for _ in range(body["max_tokens"]):
            writer.write(b'data: {"choices":[{"text":"a"}]}\n\n')
            await writer.drain()
            await asyncio.sleep(0.01)
        writer.write(b"data: [DONE]\n\n")
        await writer.drain()
    finally:
        writer.close()


def test_lanes_take_their_groups_tokens_key_and_model_and_the_drain_cuts(fb: ModuleType) -> None:
    seen: list[dict[str, Any]] = []

    async def run() -> dict[str, list[Any]]:
        server = await asyncio.start_server(lambda r, w: _engine(seen, r, w), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        groups = [fb.Group("short", "k", 1, "interactive", 2), fb.Group("long", "k", 1, "batch", 1000)]
        try:
            return await fb.run_phase(
                f"http://127.0.0.1:{port}", groups, 0.3, 0.0, 5, keys={"k": "sk-x"}, model="m", drain=0.5
            )
        finally:
            server.close()

    res = asyncio.run(run())
    short, long_ = res["short"], res["long"]
    # the short lane sends one request after another until the phase ends (how many: as fast as the machine
    # answers; ci36 had 2, one of 0.55 s on a loaded machine)
    assert short and all(r.ok and r.ttft is not None for r in short)
    assert all(b.start >= a.start + a.seconds - 0.01 for a, b in itertools.pairwise(short))
    assert short[-1].start < 0.3 <= short[-1].start + short[-1].seconds + 0.01
    # the 1,000-token stream (10 s) still ran 0.5 s after the phase: cut, a failure of its own status
    assert len(long_) == 1 and long_[0].status == "cut" and not long_[0].ok
    assert fb.summary(long_)["failed"] == {"cut": 1}
    assert {s["model"] for s in seen} == {"m"} and {s["authorization"] for s in seen} == {"Bearer sk-x"}
    assert {(s["class"], s["max_tokens"]) for s in seen} == {("interactive", 2), ("batch", 1000)}
