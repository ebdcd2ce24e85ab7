"""Liveness that tells busy from hung, against a real HTTP server that answers like vLLM's API server."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from vllm_fleet.host.probe import liveness, progress

BUSY_503 = (
    '{"error":{"message":"The engine is currently busy and cannot accept new requests. Please try again later '
    'or on a different instance.","type":"Service Unavailable","code":503}}'
)


class Engine:
    """What the probe reads: /metrics counters, and how /v1/completions answers."""

    def __init__(self) -> None:
        self.running = 0.0
        self.waiting = 0.0
        self.gen = 100.0
        self.completion = (200, json.dumps({"choices": [{"text": "x"}]}))
        self.completions_asked = 0

    def metrics(self) -> str:
        return (
            f'vllm:num_requests_running{{engine="0",model_name="m"}} {self.running}\n'
            f'vllm:num_requests_waiting{{engine="0",model_name="m"}} {self.waiting}\n'
            f'vllm:generation_tokens_total{{engine="0",model_name="m"}} {self.gen}\n'
            f'vllm:prompt_tokens_total{{engine="0",model_name="m"}} 50.0\n'
            f'vllm:iteration_tokens_total_count{{engine="0",model_name="m"}} 7.0\n'
            "# HELP vllm:num_requests_running_x comment lines and other series are ignored\n"
        )


@pytest.fixture
def engine() -> Iterator[tuple[Engine, int]]:
    eng = Engine()

    class H(http.server.BaseHTTPRequestHandler):
        def _send(self, code: int, body: str) -> None:
            raw = body.encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def do_GET(self) -> None:
            self._send(200, eng.metrics() if self.path == "/metrics" else "")

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            eng.completions_asked += 1
            self._send(*eng.completion)

        def log_message(self, *a: Any) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield eng, srv.server_address[1]
    finally:
        srv.shutdown()


def test_busy_engine_that_advances_is_alive_without_a_decode_probe(engine: tuple[Engine, int]) -> None:
    eng, port = engine
    eng.running, eng.waiting = 32, 568  # the burst of the issue: a decode probe would queue behind 568
    first, prev = liveness("127.0.0.1", port, "m", 5, None)
    assert first.ok and first.stage == "baseline" and prev is not None
    eng.gen += 32  # one decode step of 32 sequences
    res, now = liveness("127.0.0.1", port, "m", 5, prev)
    assert res.ok and res.stage == "progress" and now is not None and now.work > prev.work
    assert eng.completions_asked == 0


def test_busy_engine_whose_counters_stand_still_is_stalled(engine: tuple[Engine, int]) -> None:
    eng, port = engine
    eng.running = 4
    _, prev = liveness("127.0.0.1", port, "m", 5, None)
    res, kept = liveness("127.0.0.1", port, "m", 5, prev)
    assert not res.ok and res.stage == "stalled" and "4 running" in res.error
    assert kept is prev  # the stall is measured from the last reading that showed progress
    assert eng.completions_asked == 0


def test_idle_engine_needs_a_real_decode(engine: tuple[Engine, int]) -> None:
    eng, port = engine
    res, _ = liveness("127.0.0.1", port, "m", 5, None)
    assert res.ok and res.stage == "decode" and eng.completions_asked == 1
    eng.completion = (500, '{"error": "boom"}')
    res, _ = liveness("127.0.0.1", port, "m", 5, None)
    assert not res.ok and res.stage == "decode" and "HTTP 500" in res.error


def test_admission_503_is_alive_and_full_but_another_503_is_not(engine: tuple[Engine, int]) -> None:
    eng, port = engine
    eng.completion = (503, BUSY_503)
    res, _ = liveness("127.0.0.1", port, "m", 5, None)
    assert res.ok and res.stage == "full"
    eng.completion = (503, '{"error": "engine dead"}')
    res, _ = liveness("127.0.0.1", port, "m", 5, None)
    assert not res.ok and res.stage == "decode"


def test_no_metrics_answer_is_a_failure() -> None:
    res, prev = liveness("127.0.0.1", 1, "m", 1, None)  # nothing listens on port 1
    assert not res.ok and res.stage == "metrics" and prev is None
    assert progress("127.0.0.1", 1, 1)[0] is None
