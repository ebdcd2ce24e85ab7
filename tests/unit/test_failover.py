"""The failover driver's arithmetic (vllm_fleet/devtools/failover.py): the report from synthetic records, the
prefix-cache hit rate from synthetic snapshots and from the sim engine's own /metrics text."""

from __future__ import annotations

import json
import random

from vllm_fleet.devtools.failover import (
    PREFIX_HITS,
    PREFIX_QUERIES,
    CacheSnapshot,
    FailoverLoad,
    FailoverReport,
    Record,
    _is_error_event,
    prefix_counters,
    prefix_hit_rate,
    shared_prefixes,
)
from vllm_fleet.devtools.sim_engine import Metrics
from vllm_fleet.vllm_metrics import RUN_COUNTERS


def rec(start: float, end: float, outcome: str = "ok", lane: int = 0) -> Record:
    return Record(lane, lane % 2 == 1, start, end, outcome)


RECORDS = [
    rec(0.0, 1.0),
    rec(1.0, 2.0),
    rec(2.0, 4.0, "http_502"),  # failed, ended before the cut
    rec(3.0, 9.0),  # ok and ended before the cut: the last ok before it
    rec(8.0, 11.0, "reset"),  # in flight at the cut (10)
    rec(9.5, 12.0, "stream_cut", lane=1),  # in flight
    rec(9.8, 10.5),  # in flight, and ok: the first ok completion after the cut
    rec(10.0, 11.0, "connect_error"),  # started at the cut: after it
    rec(11.2, 12.2, "timeout"),
    rec(13.5, 14.0),  # the first ok that started after the cut: gap 3.5
    rec(14.0, 15.0, "http_503"),  # a failure after the recovery
    rec(14.5, 15.5),
    rec(15.0, 16.5),  # ends after the load's end (16): not counted in the rate
]


def test_report_arithmetic() -> None:
    rep = FailoverReport.compute(reversed(RECORDS), cut=10.0, end=16.0, marks={"cut": 10.0})
    assert (rep.total, rep.ok, rep.failed) == (13, 7, 6)
    assert rep.failed_by_outcome == {
        "http_502": 1, "reset": 1, "stream_cut": 1, "connect_error": 1, "timeout": 1, "http_503": 1,
    }  # fmt: skip
    assert rep.failed_before_cut == 1
    assert rep.in_flight_at_cut == 3
    assert rep.failed_in_flight == {"reset": 1, "stream_cut": 1}
    assert rep.failed_started_after_cut == {"connect_error": 1, "timeout": 1, "http_503": 1}
    assert rep.failed_after_recovery == 1
    assert rep.gap_s == 3.5 and rep.first_start_after_cut_s == 0.0
    assert rep.last_ok_before_cut_s == 1.0
    assert rep.first_ok_after_cut_s == 0.5
    assert rep.ok_rps_before == 0.3  # 3 ok answers in [0, 10]
    assert rep.ok_rps_after == 0.8  # 2 ok answers (14.0 and 15.5) in [13.5, 16]: 2.5 s
    d = json.loads(json.dumps(rep.as_dict()))
    assert d["gap_s"] == 3.5 and d["marks"] == {"cut": 10.0}
    line = rep.summary()
    assert "gap 3.50 s" in line and "reset 1, stream_cut 1" in line and "13 requests" in line


def test_report_without_recovery_or_failures() -> None:
    down = FailoverReport.compute([rec(0, 1), rec(2, 3, "connect_error"), rec(4, 5, "timeout")], cut=1.5)
    assert down.gap_s is None and down.ok_rps_after is None and down.first_ok_after_cut_s is None
    assert down.first_start_after_cut_s == 0.5
    assert down.failed_started_after_cut == {"connect_error": 1, "timeout": 1}
    assert down.end == 5 and "never recovered" in down.summary()
    calm = FailoverReport.compute([rec(0, 1), rec(1, 2), rec(2, 3)], cut=1.5)
    assert calm.failed == 0 and calm.failed_in_flight == {} and calm.gap_s == 0.5
    assert calm.in_flight_at_cut == 1 and calm.first_ok_after_cut_s == 0.5


def test_hit_rate_sums_engines_and_handles_resets_and_missing() -> None:
    a = CacheSnapshot(0.0, {"e1": (100, 200), "e2": (50, 100), "e3": (5, 5)})
    b = CacheSnapshot(60.0, {"e1": (250, 400), "e2": (10, 40)}, errors={"e3": "URLError: refused"})
    r = prefix_hit_rate(a, b)
    # e1: +150/+200; e2 restarted (its counters went down): 10/40 since then; e3 did not answer
    assert r["engines"] == {"e1": {"hits": 150, "queries": 200}, "e2": {"hits": 10, "queries": 40}}
    assert (r["hits"], r["queries"], r["hit_rate"]) == (160, 240, round(160 / 240, 4))
    assert r["missing"] == ["e3"] and (r["from"], r["to"]) == (0.0, 60.0)
    assert prefix_hit_rate(b, b)["hit_rate"] is None  # no queries: no rate


def test_prefix_counters_read_the_sim_engines_names() -> None:
    assert {PREFIX_HITS, PREFIX_QUERIES} <= set(RUN_COUNTERS)  # what the bench reads of vLLM too
    m = Metrics("tiny-qwen3", 1024, True, 1 << 26)
    m.counters["prefix_cache_hits"] = 256
    m.counters["prefix_cache_queries"] = 700
    m.counters["external_prefix_cache_hits"] = 99  # another family: not counted
    assert prefix_counters(m.render(0, 0, 0.0)) == (256.0, 700.0)


def test_error_events_and_prompts() -> None:
    assert _is_error_event(b'data: {"error": {"message": "busy", "code": 503}}')
    assert _is_error_event(b"event: error")
    assert not _is_error_event(b'data: {"choices": [{"delta": {"content": "x"}, "error": null}]}')
    assert not _is_error_event(b"data: [DONE]")
    p = shared_prefixes(8, 300, seed=1)
    assert p == shared_prefixes(8, 300, seed=1) != shared_prefixes(8, 300, seed=2)
    assert len(set(p)) == 8 and len({x[:20] for x in p}) == 8  # they differ at the start (the routing key)
    load = FailoverLoad("http://127.0.0.1:9/v1", "m", api_key="k", seed=1)
    assert load.path == "/v1/chat/completions" and load.headers["Authorization"] == "Bearer k"
    body = load.body(random.Random(0), 3, 0, True)
    assert body["stream"] is True and body["messages"][0]["content"] in p and body["max_tokens"] == 16
