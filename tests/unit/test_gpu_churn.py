"""tools/gpu-validate/churn.py's pure parts and its client: the watchdog gaps of a phase, the launcher's verdict
words, and how one request on a new connection is read and classified (against a small local HTTP server)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import ModuleType

import pytest

from vllm_fleet.devtools.testing import load_tool

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def churn() -> ModuleType:
    return load_tool(REPO / "tools" / "gpu-validate" / "churn.py", "gpu_churn")


def test_gaps_run_from_the_last_ping_before_the_phase_to_its_end(churn: ModuleType) -> None:
    # pings at 0, 3 (before the phase at 10), 12, 30, 31; the phase ends at 50 without another ping
    gaps = churn.ping_gaps([0.0, 3.0, 12.0, 30.0, 31.0], 10.0, 50.0)
    assert gaps == [(3.0, 9.0), (12.0, 18.0), (30.0, 1.0), (31.0, 19.0)]
    rep = churn.watchdog_report([0.0, 3.0, 12.0, 30.0, 31.0], 10.0, 50.0, 20.0)
    assert rep["pings"] == 3 and rep["max_ping_gap_s"] == 19.0
    assert [g["gap_s"] for g in rep["gaps_over_5s"]] == [9.0, 18.0, 19.0]
    assert rep["gaps_over_5s"][0]["at_s"] == -7.0  # the gap began before the phase
    assert not rep["within_goal"] and not rep["systemd_would_kill"]
    # one gap of a whole WatchdogSec: systemd would have killed the unit
    assert churn.watchdog_report([0.0, 25.0], 1.0, 26.0, 20.0)["systemd_would_kill"]
    # regular pings: within a third of WatchdogSec
    ok = churn.watchdog_report([float(t) for t in range(0, 61, 5)], 0.0, 60.0, 20.0)
    assert ok["within_goal"] and ok["gaps_over_5s"] == [] and ok["max_ping_gap_s"] == 5.0


def test_verdict_words_of_status_lines(churn: ModuleType) -> None:
    # the launcher's own STATUS= texts (launcher_state.py)
    assert churn.verdict_of("Serving qwen3-8b under connection churn") == "flooded"
    assert churn.verdict_of("Serving qwen3-8b slowly: starved of CPU") == "starved"
    assert churn.verdict_of("Probe failing (2x): /metrics: timed out (not starved)") == "failing"
    assert churn.verdict_of("Serving qwen3-8b on 127.0.0.1:8002") == "serving"


SSE_OK = [
    b'data: {"choices":[{"text":"once"}]}\n\n',
    b'data: {"choices":[{"text":" upon"}]}\n\n',
    b"data: [DONE]\n\n",
]
SSE_ERR = [b'data: {"choices":[{"text":"a"}]}\n\n', b'data: {"error":{"message":"busy","code":503}}\n\n']


async def _serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    line = (await reader.readline()).decode()
    headers = {}
    while (h := await reader.readline()) not in (b"\r\n", b""):
        k, _, v = h.decode().partition(":")
        headers[k.strip().lower()] = v.strip()
    await reader.readexactly(int(headers["content-length"]))
    path = line.split()[1]
    if path.startswith("/refuse"):
        body = json.dumps({"error": {"message": "wait (wait_timeout)", "code": "rate_limited"}}).encode()
        writer.write(
            b"HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
        )
        writer.write(b"Content-Length: %d\r\n\r\n" % len(body) + body)
    else:
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        events = SSE_ERR if path.startswith("/err") else SSE_OK
        if path.startswith("/cut"):
            events = SSE_OK[:1]
        for ev in events:
            writer.write(b"%x\r\n" % len(ev) + ev + b"\r\n")
            await writer.drain()
        if not path.startswith("/cut"):
            writer.write(b"0\r\n\r\n")
    await writer.drain()
    writer.close()


def test_one_request_on_a_new_connection_is_read_and_classified(churn: ModuleType) -> None:
    async def run() -> dict[str, dict[str, object]]:
        server = await asyncio.start_server(_serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        out = {}
        for path in ("/ok", "/err", "/cut", "/refuse"):
            out[path] = await churn.one_request("127.0.0.1", port, path, b"{}", "sk-x")
        server.close()
        return out

    r = asyncio.run(run())
    assert r["/ok"]["kind"] == "complete" and r["/ok"]["content_events"] == 2 and r["/ok"]["ttft"] >= 0
    assert r["/err"]["kind"] == "error_200" and r["/err"]["code"] == "503"
    assert r["/cut"]["kind"] == "dropped"
    ref = r["/refuse"]
    assert ref["kind"] == "refused" and ref["retry_after"] == "1" and ref["reason"] == "wait_timeout"
    # nothing listening: a dropped connect
    assert asyncio.run(churn.one_request("127.0.0.1", 1, "/ok", b"{}", None))["kind"] == "dropped"
