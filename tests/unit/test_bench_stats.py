"""Bench statistics on known samples: percentiles, ITL from chunk timestamps, throughput, error types."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from vllm_fleet.bench import compare, errors
from vllm_fleet.bench.client import _sse_payloads, _StreamState
from vllm_fleet.bench.stats import (
    RequestRecord,
    distribution,
    intervals,
    percentile,
    summarize,
    summarize_by_class,
    timeseries,
)


def test_percentiles_known_samples() -> None:
    s = list(range(1, 11))  # 1..10
    assert percentile(s, 50) == pytest.approx(5.5)
    assert percentile(s, 95) == pytest.approx(9.55)
    assert percentile(s, 99) == pytest.approx(9.91)
    assert percentile(s, 0) == 1 and percentile(s, 100) == 10
    assert percentile([7.0], 99) == 7.0
    assert percentile([3, 1, 2], 50) == 2  # unsorted input


def test_percentiles_match_numpy() -> None:
    np = pytest.importorskip("numpy")
    rng = np.random.default_rng(1)
    vals = list(rng.exponential(0.3, 997))
    for q in (50, 95, 99, 12.5):
        assert percentile(vals, q) == pytest.approx(float(np.percentile(vals, q)))


def test_percentile_refuses_bad_input() -> None:
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_distribution_in_ms_and_empty() -> None:
    d = distribution([0.1, 0.2, 0.3, 0.4])
    assert d["count"] == 4 and d["mean"] == pytest.approx(250.0) and d["p50"] == pytest.approx(250.0)
    assert distribution([])["p99"] is None


def test_itl_from_chunk_timestamps() -> None:
    assert intervals([1.0, 1.25, 1.5, 2.0]) == pytest.approx([0.25, 0.25, 0.5])
    assert intervals([3.0]) == []
    st = _StreamState(start=10.0)
    for t, data in [
        (10.5, {"choices": [{"delta": {"role": "assistant", "content": ""}}]}),
        (10.6, {"choices": [{"delta": {"content": "a"}}]}),
        (10.9, {"choices": [{"delta": {"content": "b"}, "finish_reason": "length"}]}),
        (10.95, {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 2}}),
    ]:
        st.openai(data, t)
    assert st.times == [10.5, 10.6, 10.9]  # the usage-only chunk carries no token
    assert intervals(st.times) == pytest.approx([0.1, 0.3])
    assert (st.usage_prompt, st.usage_output, st.finish_reason) == (7, 2, "length")


def test_anthropic_stream_state() -> None:
    st = _StreamState(start=0.0)
    st.anthropic({"type": "message_start", "message": {"usage": {"input_tokens": 12}}}, 0.1)
    st.anthropic({"type": "content_block_start", "index": 0}, 0.2)
    st.anthropic({"type": "content_block_delta", "delta": {"text": "x"}}, 0.3)
    st.anthropic({"type": "content_block_delta", "delta": {"text": "y"}}, 0.5)
    st.anthropic(
        {"type": "message_delta", "delta": {"stop_reason": "max_tokens"}, "usage": {"output_tokens": 2}}, 0.6
    )
    assert st.times == [0.3, 0.5] and st.usage_prompt == 12 and st.usage_output == 2
    assert st.finish_reason == "max_tokens"


def test_sse_split_keeps_incomplete_event() -> None:
    payloads, rest = _sse_payloads(b'data: {"a":1}\n\ndata: [DONE]\n\ndata: {"b"')
    assert payloads == ['{"a":1}', "[DONE]"] and rest == b'data: {"b"'
    payloads, rest = _sse_payloads(b"event: x\r\ndata: {}\r\n\r\n")
    assert payloads == ["{}"] and rest == b""


def _rec(cls: str, start: float, e2e: float, ok: bool = True, **kw: object) -> RequestRecord:
    return RequestRecord(cls=cls, start=start, e2e=e2e, ok=ok, ttft=e2e / 4 if ok else None, **kw)  # type: ignore[arg-type]


def test_summarize_throughput_errors_and_warmup() -> None:
    recs = [
        _rec("a", 0.0, 1.0, output_tokens=100, prompt_tokens=10, warmup=True),  # excluded
        _rec("a", 1.0, 1.0, output_tokens=10, prompt_tokens=5),
        _rec("a", 1.5, 2.0, output_tokens=30, prompt_tokens=5),
        _rec("b", 2.0, 1.0, output_tokens=20, prompt_tokens=5),
        _rec("b", 2.0, 0.1, ok=False, error="http_500"),
        _rec("b", 2.5, 0.1, ok=False, error="connect"),
        _rec("b", 2.6, 0.1, ok=False, error="http_500"),
    ]
    s = summarize(recs, window=4.0)
    assert (s["requests"], s["ok"], s["failed"]) == (6, 3, 3)
    assert s["errors"] == {"connect": 1, "http_500": 2}
    assert s["output_tokens_per_s"] == pytest.approx(60 / 4.0)
    assert s["requests_per_s"] == pytest.approx(3 / 4.0)
    assert s["e2e_ms"]["p50"] == pytest.approx(1000.0)
    tpot = RequestRecord(cls="a", start=0, ok=True, ttft=0.5, e2e=1.5, output_tokens=11).tpot
    assert tpot == pytest.approx(0.1)
    by = summarize_by_class(recs, 4.0)
    assert by["a"]["ok"] == 2 and by["b"]["failed"] == 3


def test_timeseries_bins_by_completion() -> None:
    recs = [
        _rec("a", 0.2, 0.5, output_tokens=4),
        _rec("a", 0.5, 1.0, output_tokens=6),
        _rec("a", 1.0, 0.1, ok=False),
    ]
    ts = timeseries(recs, bin_s=1.0)
    assert [r["ok"] for r in ts] == [1, 1] and [r["failed"] for r in ts] == [0, 1]
    assert ts[0]["output_tokens_per_s"] == 4 and ts[1]["output_tokens_per_s"] == 6


def test_error_classification() -> None:
    assert errors.classify_status(503) == "http_503"
    assert errors.classify_exception(TimeoutError()) == errors.TIMEOUT
    assert errors.classify_exception(TimeoutError()) == errors.TIMEOUT
    assert errors.classify_exception(ConnectionRefusedError()) == errors.CONNECT
    assert errors.classify_exception(aiohttp.ServerDisconnectedError()) == errors.DISCONNECTED
    assert errors.classify_exception(aiohttp.ClientPayloadError("cut")) == errors.DISCONNECTED
    assert errors.classify_exception(ValueError("bad json")) == errors.BAD_RESPONSE
    assert errors.classify_exception(RuntimeError()) == errors.OTHER
    assert errors.classify_finish_reason("abort") == errors.ABORTED
    assert errors.classify_finish_reason("length") is None


async def _refused() -> str:
    from vllm_fleet.devtools.testing import free_port

    async with aiohttp.ClientSession() as s:
        try:
            await s.get(f"http://127.0.0.1:{free_port()}/")
        except aiohttp.ClientError as exc:
            return errors.classify_exception(exc)
    return "no error"


def test_refused_connection_is_connect() -> None:
    assert asyncio.run(_refused()) == errors.CONNECT


def test_compare_order_and_ratios() -> None:
    assert compare.order(2) == ["A", "B", "B", "A"]
    assert compare.order(3) == ["A", "B", "B", "A", "A", "B"]
    rounds = [
        {"label": lab, "figures": {"output_tokens_per_s": v, "requests_per_s": v}}
        for lab, v in [("A", 100.0), ("B", 99.0), ("B", 102.0), ("A", 100.0), ("A", 50.0), ("B", 60.0)]
    ]
    r = compare.ratios(rounds)["output_tokens_per_s"]
    assert r["n"] == 3 and r["median"] == pytest.approx(1.02)
    assert r["min"] == pytest.approx(0.99) and r["max"] == pytest.approx(1.2)


def test_timeseries_sliding_window() -> None:
    recs = [_rec("a", 0.0, 0.5, output_tokens=10), _rec("a", 0.0, 1.5, output_tokens=20)]
    ts = timeseries(recs, bin_s=1.0, window_s=2.0)
    assert ts[0]["output_tokens_per_s"] == 10  # first second: only 1 s of history
    assert ts[1]["output_tokens_per_s"] == 15  # (10 + 20) tokens over the 2 s window
    assert ts[1]["ok"] == 1  # counts stay per bin


async def _stream_in_one_write(api: str) -> RequestRecord:
    """A real HTTP server that writes a whole SSE stream (5 tokens) in one socket write, as a fast server
    or a proxy that coalesces chunks does; the client must still time each message on its own."""
    from aiohttp import web

    from vllm_fleet.bench.client import Target, send
    from vllm_fleet.bench.workload import RequestClass

    if api == "anthropic":
        events = [{"type": "message_start", "message": {"usage": {"input_tokens": 3}}}]
        events += [{"type": "content_block_delta", "delta": {"text": str(i)}} for i in range(5)]
        events += [
            {"type": "message_delta", "delta": {"stop_reason": "max_tokens"}, "usage": {"output_tokens": 5}}
        ]
    else:
        events = [{"choices": [{"delta": {"content": str(i)}}]} for i in range(4)]
        events += [{"choices": [{"delta": {"content": "4"}, "finish_reason": "length"}]}]
    body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(body.encode())  # one write: the client reads it in one chunk
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    app.router.add_post("/v1/messages", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        c = RequestClass(name="x", share=1, input_tokens=1, output_tokens=5, api=api)  # type: ignore[arg-type]
        async with aiohttp.ClientSession() as s:
            return await send(s, Target("t", f"http://127.0.0.1:{port}", "m"), c, "hi", 0.0, 10.0)
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("api", ["openai-chat", "anthropic"])
def test_itl_of_messages_that_arrive_in_one_read(api: str) -> None:
    rec = asyncio.run(_stream_in_one_write(api))
    assert rec.ok, rec.detail
    assert len(rec.itl) == 4
    assert all(gap > 0 for gap in rec.itl), rec.itl  # one timestamp per read would make every gap 0.0
    assert rec.ttft is not None and 0 < rec.ttft <= rec.e2e
