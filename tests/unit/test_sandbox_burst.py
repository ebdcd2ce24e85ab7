"""tools/sandbox_burst.py's pure parts: how one response is classified, which access-log entries spilled, the
admission service's per-key counters."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def burst() -> ModuleType:
    spec = importlib.util.spec_from_file_location("sandbox_burst", REPO / "tools" / "sandbox_burst.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def sse(*events: object, done: bool = True) -> str:
    out = "".join(f"data: {json.dumps(e)}\n\n" for e in events)
    return out + ("data: [DONE]\n\n" if done else "")


def chunk(content: str | None) -> dict[str, object]:
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": content}}]}


SSE = "text/event-stream; charset=utf-8"
ROLE = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}


def test_a_full_stream_with_content_is_complete(burst: ModuleType) -> None:
    r = burst.classify(200, sse(ROLE, chunk("hel"), chunk("lo"), chunk(None)), content_type=SSE)
    assert r["kind"] == "complete" and r["content_events"] == 2


def test_a_text_completion_stream_counts_its_text(burst: ModuleType) -> None:
    # /v1/completions streams choices[].text (tools/gpu-validate/churn.py's requests)
    def text(t: str) -> dict[str, object]:
        return {"object": "text_completion", "choices": [{"index": 0, "text": t, "finish_reason": None}]}

    r = burst.classify(200, sse(text("once"), text(" upon"), text("")), content_type=SSE)
    assert r["kind"] == "complete" and r["content_events"] == 2
    assert burst.classify(200, sse(text("")), content_type=SSE)["kind"] == "empty_200"


def test_a_200_stream_carrying_an_error_event_is_the_defect(burst: ModuleType) -> None:
    # what vLLM sends when its second admission check fails after the 200 (host/stream_guard.py's docstring)
    err = {"error": {"message": "The server is currently busy", "type": "ServiceUnavailable", "code": 503}}
    r = burst.classify(200, sse(err), content_type=SSE)
    assert r["kind"] == "error_200" and r["code"] == "503" and "busy" in r["detail"]
    # an error after some content is the defect too, [DONE] or not
    assert burst.classify(200, sse(chunk("a"), err, done=False), content_type=SSE)["kind"] == "error_200"


def test_a_stream_cut_before_done_is_dropped(burst: ModuleType) -> None:
    r = burst.classify(
        200, sse(ROLE, chunk("a"), done=False), content_type=SSE, error="IncompleteRead: 0 bytes"
    )
    assert r["kind"] == "dropped" and r["detail"] == "IncompleteRead: 0 bytes"
    # a clean end of the body without [DONE] is a cut stream as well
    r = burst.classify(200, sse(chunk("a"), done=False), content_type=SSE)
    assert r["kind"] == "dropped" and "[DONE]" in r["detail"]
    # no response at all
    r = burst.classify(None, "", error="ConnectionResetError: reset by peer")
    assert r == {"status": None, "kind": "dropped", "detail": "ConnectionResetError: reset by peer"}


def test_done_without_any_content_is_empty(burst: ModuleType) -> None:
    assert burst.classify(200, sse(ROLE, chunk("")), content_type=SSE)["kind"] == "empty_200"


def test_refusals_keep_status_code_reason_and_retry_after(burst: ModuleType) -> None:
    # the admission service's refusal, as router.js's refused() writes it
    body = {"error": {"message": "This API key waited too long (wait_timeout); retry after 1 s",
                      "type": "rate_limit_error", "param": None, "code": "rate_limit_exceeded"}}  # fmt: skip
    r = burst.classify(429, json.dumps(body), content_type="application/json", retry_after="1")
    assert (r["kind"], r["status"], r["code"], r["reason"], r["retry_after"]) == (
        "refused",
        429,
        "rate_limit_exceeded",
        "wait_timeout",
        "1",
    )
    # every instance full: the gateway's own JSON 503
    full = {"error": {"message": "Every instance of model tiny-qwen3 is full; retry later",
                      "type": "server_error", "param": None, "code": "model_overloaded"}}  # fmt: skip
    r = burst.classify(503, json.dumps(full), retry_after="1")
    assert (r["kind"], r["code"], r["reason"]) == ("refused", "model_overloaded", None)
    # a 502 is not a refusal; a non-JSON body still classifies
    r = burst.classify(502, "<html>bad gateway</html>")
    assert (r["kind"], r["code"]) == ("other_status", None)


def test_summary_counts_refusals_without_retry_after_and_fails_the_verdict(burst: ModuleType) -> None:
    too_large = {"error": {"message": "This request reserves more tokens than this API key may use in a minute "
                           "(too_large); this request can never fit the key's budget",
                           "type": "rate_limit_error", "param": None, "code": "rate_limit_exceeded"}}  # fmt: skip
    recs = [
        {**burst.classify(200, sse(chunk("a")), content_type=SSE), "ttft": 0.5},
        {**burst.classify(200, sse(chunk("b")), content_type=SSE), "ttft": 1.5},
        burst.classify(429, json.dumps(too_large)),
        burst.classify(503, "{}", retry_after="1"),
    ]
    s = burst.summarize(recs)
    assert s["by_kind"]["complete"] == 2 and s["by_kind"]["refused"] == 2
    assert s["refused_without_retry_after"] == 1
    assert s["refusals"]["429 rate_limit_exceeded (too_large) NO Retry-After"] == 1
    assert s["ttft_s"]["n"] == 2 and s["ttft_s"]["max"] == 1.5
    v = burst.verdict(s)
    assert v["no_error_200"] and v["no_dropped"] and not v["refusals_429_503_with_retry_after"]
    # with Retry-After on every refusal the verdict holds
    assert burst.verdict(burst.summarize(recs[:2] + recs[3:]))["refusals_429_503_with_retry_after"]


def entry(t: str, **kw: object) -> str:
    return json.dumps({"time": t, "uri": "/v1/chat/completions", "status": 200, "upstream": "m_tiny_qwen3",
                       "upstream_status": "200", "request_id": "r", **kw})  # fmt: skip


def test_spill_kinds(burst: ModuleType) -> None:
    def kind(**kw: object) -> str | None:
        return burst.spill_kind(json.loads(entry("2026-01-01T00:00:00+00:00", **kw)))

    assert kind() is None
    assert kind(upstream="m_tiny_qwen3__spill", upstream_status="503 : 200") == "spill"
    assert kind(upstream="m_tiny_qwen3__fallback", upstream_status="502, 502 : 200") == "fallback"
    assert kind(upstream_status="503, 200") == "retry_503"
    # a single try that answered 503 (nowhere else to go) did not spill; nor did a 502 then 200
    assert kind(upstream_status="503", status=503) is None
    assert kind(upstream_status="502, 200") is None


def test_run_entries_and_spill_summary(burst: ModuleType) -> None:
    t0 = 1_767_225_600.0  # 2026-01-01T00:00:00Z
    lines = [
        entry("2025-12-31T23:59:58+00:00"),  # before the window
        entry("2026-01-01T00:00:01+00:00", request_id="a"),
        entry("2026-01-01T01:00:02+01:00", upstream="m_tiny_qwen3__spill", upstream_status="503 : 200"),
        entry("2026-01-01T00:00:03+00:00", uri="/v1/models"),  # not ours
        "not json",
        entry(
            "2026-01-01T00:00:04+00:00",
            status=503,
            upstream="m_tiny_qwen3__spill",
            upstream_status="503 : 503",
        ),
        entry("2026-01-01T00:00:11+00:00"),  # after
    ]
    got = burst.run_entries(lines, t0, t0 + 10)
    assert [e["time"][-14:-6] for e in got] == ["00:00:01", "01:00:02", "00:00:04"]
    s = burst.spill_summary(got)
    assert s["entries"] == 3 and s["spilled"] == 2 and s["by_kind"] == {"spill": 2}
    assert s["spilled_final_status"] == {"200": 1, "503": 1}


def test_key_counters_follow_the_key_id(burst: ModuleType) -> None:
    key = "sk-burst-" + "b" * 32
    kid = "burst" + burst.key_id_suffix(key)
    assert len(kid) == len("burst/") + 8

    def text(admitted: int, wt: int) -> str:
        return "\n".join([
            "# HELP vllm_fleet_gateway_key_admitted_total Requests admitted, per key",
            f'vllm_fleet_gateway_key_admitted_total{{client="burst",key="{kid}"}} {admitted}.0',
            'vllm_fleet_gateway_key_admitted_total{client="other",key="other/00000000"} 99.0',
            f'vllm_fleet_gateway_key_refused_total{{client="burst",key="{kid}",reason="wait_timeout"}} {wt}.0',
            f'vllm_fleet_gateway_key_refused_total{{client="burst",key="{kid}",reason="rpm"}} 0.0',
            f'vllm_fleet_gateway_key_withdrawn_total{{client="burst",key="{kid}"}} 1.0',
        ])  # fmt: skip

    before = burst.key_counters(burst.parse_metrics(text(5, 2)), key)
    after = burst.key_counters(burst.parse_metrics(text(12, 30)), key)
    assert after == {
        "key_id": kid,
        "admitted": 12.0,
        "withdrawn": 1.0,
        "refused": {"wait_timeout": 30.0, "rpm": 0.0},
    }
    assert burst.counters_delta(before, after) == {
        "key_id": kid, "admitted": 7.0, "withdrawn": 0.0, "refused": {"wait_timeout": 28.0},
    }  # fmt: skip
    # another key's counters are not ours
    assert burst.key_counters(burst.parse_metrics(text(5, 2)), "sk-other")["key_id"] is None
