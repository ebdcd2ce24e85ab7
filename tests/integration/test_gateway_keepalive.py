"""Keep-alive connections the engine closes, through the real nginx gateway: stub engines that drop a reused
connection when the next request arrives on it after ``idle`` seconds — without reading it (a reset) or after
reading it (a FIN), and never answering — as an engine does whose keep-alive timer fires while a request is on its
way (docs/gateway.md). Under concurrent POST load (plain and streamed) no client sees a failure: nginx sends each
such request again on a fresh connection (the same server: a failed reused connection costs no try) or to the
next server, before any byte reached the client; the access log lists the failed tries and the exporter counts
them (vllm_fleet_gateway_upstream_failed_tries_total)."""

from __future__ import annotations

import http.client
import json
import random
import select
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from vllm_fleet.devtools.gateway_nginx import HAVE_NGINX
from vllm_fleet.devtools.gateway_testing import OPEN_RATE_LIMIT, Gateway, chat_body, gateway_spec, wait_for
from vllm_fleet.host.exporter import AccessLogTail, FleetCollector

pytestmark = pytest.mark.skipif(not HAVE_NGINX, reason="nginx + libnginx-mod-http-js needed")


class ClosingStub:
    """An engine stand-in that answers chat completions (JSON, or SSE for ``stream: true``) on keep-alive
    connections, but drops a connection that was idle ``idle`` seconds or more when the next request arrives on
    it, and never answers that request: every other drop reads the request first (the client sees a FIN), the
    rest close with the request unread (a reset). ``status``: what it answers instead of 200 (503: full)."""

    def __init__(self, name: str, idle: float = 0.15, status: int = 200, mode: str = "silent") -> None:
        self.name, self.idle, self.status, self.mode = name, idle, status, mode
        self.answered = self.dropped = self.closed = 0
        self.lock = threading.Lock()
        stub = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            last = 0.0  # when this connection's last answer was sent (0: none yet)

            def handle_one_request(self) -> None:
                if self.last and stub.idle >= 0 and stub.mode == "silent":
                    readable, _, _ = select.select([self.connection], [], [], 30)
                    try:
                        pending = readable and self.connection.recv(1, socket.MSG_PEEK)
                    except OSError:
                        pending = b""
                    if not pending:  # nginx closed it (its keepalive_timeout) or nothing came
                        self.close_connection = True
                        return
                    if time.monotonic() - self.last >= stub.idle:
                        with stub.lock:
                            stub.dropped += 1
                            n = stub.dropped
                        if n % 2:
                            self.connection.recv(65536)  # read, then close: a FIN, no answer
                        self.close_connection = True
                        return
                super().handle_one_request()
                self.last = time.monotonic()
                if stub.mode == "after_response" and not self.close_connection:
                    with stub.lock:
                        stub.closed += 1
                    self.close_connection = True  # no "Connection: close" was said
                elif stub.mode == "timer" and not self.close_connection:
                    readable, _, _ = select.select([self.connection], [], [], stub.idle)
                    if not readable:  # the keep-alive timer fired first: a FIN on an idle connection
                        with stub.lock:
                            stub.closed += 1
                        self.close_connection = True

            def do_POST(self) -> None:
                req = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                with stub.lock:
                    stub.answered += 1
                if stub.status != 200:
                    self._json(stub.status, {"error": {"message": "busy", "code": stub.status}})
                elif req.get("stream"):
                    self._stream()
                else:
                    msg = {"role": "assistant", "content": f"served by {stub.name}"}
                    self._json(200, {"object": "chat.completion", "choices": [{"index": 0, "message": msg}]})

            def _json(self, status: int, doc: dict[str, Any]) -> None:
                body = json.dumps(doc).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _stream(self) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream; charset=utf-8")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for data in ('{"choices":[{"index":0,"delta":{"content":"hi"}}]}', "[DONE]"):
                    line = f"data: {data}\n\n".encode()
                    self.wfile.write(f"{len(line):x}\r\n".encode() + line + b"\r\n")
                self.wfile.write(b"0\r\n\r\n")

            def log_message(self, *a: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stubs() -> Iterator[list[ClosingStub]]:
    made: list[ClosingStub] = []
    yield made
    for s in made:
        s.stop()


def start(tmp: Path, servers: list[dict[str, Any]], **gw: Any) -> Gateway:
    return Gateway(gateway_spec(servers, tmp, rate_limit=OPEN_RATE_LIMIT, **gw), tmp).start()


def post_load(g: Gateway, workers: int = 12, per_worker: int = 25) -> list[str]:
    """Concurrent chat completions, half of them streamed, each worker with short random pauses (so nginx reuses
    connections that were idle for a while); the failures (no client retries), empty when all succeeded."""
    failures: list[str] = []
    lock = threading.Lock()

    def worker(i: int) -> None:
        rnd = random.Random(i)
        for n in range(per_worker):
            stream = (i + n) % 2 == 1
            c = http.client.HTTPConnection("127.0.0.1", g.spec.gateway.port, timeout=60)
            try:
                c.request("POST", "/v1/chat/completions", json.dumps(chat_body(stream=stream)),
                          {"Content-Type": "application/json"})  # fmt: skip
                r = c.getresponse()
                data = r.read()
                ok = r.status == 200 and (b"data: [DONE]" in data if stream else b'"choices"' in data)
                why = None if ok else f"HTTP {r.status}: {data[:160]!r}"
            except Exception as exc:  # a dropped connection is a failed request
                why = f"{type(exc).__name__}: {exc}"
            finally:
                c.close()
            if why:
                with lock:
                    failures.append(why)
            time.sleep(rnd.uniform(0.0, 0.4))

    with ThreadPoolExecutor(workers) as ex:
        list(ex.map(worker, range(workers)))
    return failures


def failed_tries(g: Gateway, total: int) -> tuple[list[dict[str, Any]], dict[tuple[str, str], float]]:
    """The access log's entries with a failed (502) try, and the exporter's count of failed tries by (kind,
    retried)."""
    assert wait_for(lambda: len(g.log()) >= total, 10), len(g.log())
    entries = [e for e in g.log() if "502" in e["upstream_status"]]
    tail = AccessLogTail(g.access_log, from_start=True)
    counted: dict[tuple[str, str], float] = {}
    for fam in FleetCollector(g.workdir / "none", None, access_log=tail, use_systemd=False).collect():
        for s in fam.samples:
            # every (kind, retried) is exported from the start at 0: keep the ones that counted something
            if s.name == "vllm_fleet_gateway_upstream_failed_tries_total" and s.value:
                counted[(s.labels["kind"], s.labels["retried"])] = s.value
    return entries, counted


# (instance name, status) each — 200: answers, and drops reused connections; 503: full, never drops — and the
# gateway's max_fails
LAYOUTS: dict[str, tuple[list[tuple[str, int]], int]] = {
    "one instance": ([("a", 200)], 1),
    # max_fails 0: with the default 1 every drop also ejects its engine for fail_timeout (nginx counts an error
    # on a reused connection against the server); with both ejected the requests meet "no live upstreams" and
    # fail (measured: 267 of 300). Hence the engines' long keep-alive (vllm_fleet/contracts.py): the gateway
    # retries a drop, the deployment keeps drops from happening.
    "two instances": ([("a", 200), ("b", 200)], 0),
    "a full one and one that drops": ([("full", 503), ("b", 200)], 1),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_requests_on_connections_the_engine_closed_are_sent_again_before_any_byte(
    layout: str, stubs: list[ClosingStub], tmp_path: Path
) -> None:
    """One instance (a one-server upstream): nginx itself sends the request again on a fresh connection — a
    failed reused connection costs no try. Two: to the other server, and when that one's pooled connection
    fails too (nginx tries each server of an upstream once), the router's second pass over both on new
    connections (the __fresh twin). A full engine beside one that drops: the spill-over meets the drops in its
    own pool, then the same second pass. POST throughout; no client sees a failure; every drop is a failed try
    in the access log, counted as retried."""
    servers, max_fails = LAYOUTS[layout]
    for name, status in servers:
        stubs.append(ClosingStub(name, idle=-1 if status != 200 else 0.15, status=status))
    g = start(tmp_path, [{"name": s.name, "port": s.port} for s in stubs], max_fails=max_fails)
    try:
        failures = post_load(g)
        entries, counted = failed_tries(g, 12 * 25)
    finally:
        g.stop()
    dropped = sum(s.dropped for s in stubs)
    assert failures == []
    assert dropped >= 5, "the load never made nginx reuse an idle connection"
    assert entries and all(e["status"] == 200 and e["method"] == "POST" for e in entries)
    assert counted == {("error", "true"): dropped}
    if layout != "one instance":
        assert any(e["upstream"].endswith("__fresh") for e in entries)  # the second pass served some
    if layout.startswith("a full"):
        assert any(
            e["upstream_status"].startswith("503 : ") and "502" in e["upstream_status"] for e in entries
        )
