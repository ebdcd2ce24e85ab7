"""Drain through the real nginx gateway, with stub engines (tiny HTTP servers that say who they are, or
answer 503 like a full engine): the router overlays the drained set on routes.json and walks the remaining
servers of the upstream; the rendered files are never edited and nginx is never reloaded. The same stubs
check the cache-aware routing policy: prefix affinity, its load bound, failover, spill-over and drains."""

from __future__ import annotations

import http.client
import itertools
import json
import subprocess
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
from vllm_fleet.devtools.testing import free_port, http_json

pytestmark = pytest.mark.skipif(not HAVE_NGINX, reason="nginx + libnginx-mod-http-js needed")


class Stub:
    """An engine stand-in on a free port: 200 {"served_by": NAME} (or ``status`` when set), after ``delay``
    seconds; ``busy``/``peak``: requests in flight now / at most. With ``sse`` = (events, gap) it answers as
    vLLM streams: ``text/event-stream``, chunked, one ``data:`` event every ``gap`` seconds, then ``[DONE]``."""

    def __init__(self, name: str) -> None:
        self.name, self.status, self.hits, self.delay = name, 200, 0, 0.0
        self.sse: tuple[int, float] | None = None
        self.busy = self.peak = 0
        self.lock = threading.Lock()
        stub = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with stub.lock:
                    stub.hits += 1
                    stub.busy += 1
                    stub.peak = max(stub.peak, stub.busy)
                if stub.delay:
                    time.sleep(stub.delay)
                with stub.lock:
                    stub.busy -= 1
                if stub.sse:
                    self._stream(*stub.sse)
                    return
                body = json.dumps({"served_by": stub.name, "status": stub.status}).encode()
                self.send_response(stub.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _stream(self, events: int, gap: float) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream; charset=utf-8")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for i in range(events + 1):
                    data = json.dumps({"served_by": stub.name, "i": i}) if i < events else "[DONE]"
                    line = f"data: {data}\n\n".encode()
                    self.wfile.write(f"{len(line):x}\r\n".encode() + line + b"\r\n")
                    self.wfile.flush()
                    if i < events:
                        time.sleep(gap)
                self.wfile.write(b"0\r\n\r\n")

            def log_message(self, *a: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture(scope="module")
def stubs() -> Iterator[dict[str, Stub]]:
    s = {n: Stub(n) for n in ("a", "b", "c", "d")}
    yield s
    for x in s.values():
        x.server.shutdown()


def _gw(tmp: Path, servers: list[dict[str, Any]], **gw: Any) -> Gateway:
    return Gateway(gateway_spec(servers, tmp, rate_limit=OPEN_RATE_LIMIT, **gw), tmp).start()


def drain(g: Gateway, *args: str) -> subprocess.CompletedProcess[str]:
    return g.cli(*args, check=False)


def ask(g: Gateway, n: int = 6) -> list[tuple[int, str]]:
    """n chat requests, one after the other; returns once the access log has them too."""
    seen = len(g.log())
    out = []
    for _ in range(n):
        st, body = http_json("POST", g.url + "/v1/chat/completions", chat_body())
        out.append((st, body.get("served_by", "") if isinstance(body, dict) else ""))
    assert wait_for(lambda: len(g.log()) >= seen + n, 5)
    return out


def files(g: Gateway) -> dict[str, str]:
    return {p.name: p.read_text() for p in (g.nginx.etc_nginx / "vllm-fleet").iterdir()}


def test_drain_walks_the_rest_then_backups_then_fallback(stubs: dict[str, Stub], tmp_path: Path) -> None:
    dead = free_port()
    g = _gw(
        tmp_path,
        [
            {"name": "a", "port": stubs["a"].port},
            {"name": "b", "port": stubs["b"].port},
            {"name": "x", "port": dead},  # a primary that is down
            {"name": "c", "port": stubs["c"].port, "role": "backup"},
            {"name": "d", "port": stubs["d"].port, "role": "fallback"},
        ],
    )
    try:
        before, pid = files(g), g.nginx.proc.pid if g.nginx.proc else 0
        assert {s for st, s in ask(g, 12) if st == 200} <= {"a", "b"}
        assert drain(g, "drain", "a").returncode == 0
        got = ask(g, 12)
        assert all(st == 200 for st, _ in got) and {s for _, s in got} == {"b"}  # x is down: failover
        log = g.log()[-12:]
        assert {e["upstream"] for e in log} == {"m_tiny_qwen3__x__a"}
        # b full (503): spill to the backup c, never to the drained a
        stubs["b"].status = 503
        assert {s for _, s in ask(g, 4)} == {"c"}
        stubs["b"].status = 200
        # every GPU instance out: the fallback d serves
        for n in ("b", "x", "c"):
            r = drain(g, "drain", n)
            assert r.returncode == 0, r.stderr
        assert {s for _, s in ask(g, 4)} == {"d"}
        assert {e["upstream"] for e in g.log()[-4:]} == {"m_tiny_qwen3__fallback"}
        # the model's last one: refused (exit 3) unless --force
        assert drain(g, "drain", "d").returncode == 3
        for n in ("a", "b", "x", "c"):
            assert drain(g, "undrain", n).returncode == 0
        assert json.loads(g.state.read_text())["drained"] == []
        assert {s for st, s in ask(g, 12) if st == 200} <= {"a", "b"}
        assert files(g) == before  # nothing rendered was edited
        assert g.nginx.proc and g.nginx.proc.pid == pid and "reload" not in g.nginx.log_tail()
    finally:
        g.stop()


def test_drain_of_the_only_primary_without_fallback_is_a_json_502(
    stubs: dict[str, Stub], tmp_path: Path
) -> None:
    g = _gw(
        tmp_path,
        [{"name": "a", "port": stubs["a"].port}, {"name": "c", "port": free_port(), "role": "backup"}],
    )
    try:
        assert drain(g, "drain", "a").returncode == 0  # c is left (down, but drain cannot know)
        st, body = http_json("POST", g.url + "/v1/chat/completions", chat_body())
        assert st == 502 and body["error"]["code"] == "upstream_unavailable"
        assert drain(g, "drain", "c", "--force").returncode == 0
        st, body = http_json("POST", g.url + "/v1/chat/completions", chat_body())
        assert st == 502 and body["error"]["code"] == "upstream_unavailable"
        assert drain(g, "drain", "nope").returncode == 1
    finally:
        g.stop()


def test_a_refused_connection_is_retried_even_without_retry_non_idempotent(
    stubs: dict[str, Stub], tmp_path: Path
) -> None:
    """Like proxy_next_upstream: a POST that never reached a server (connection refused) goes to the next one
    also with retry_non_idempotent: false."""
    g = _gw(
        tmp_path,
        [
            {"name": "a", "port": stubs["a"].port},
            {"name": "x", "port": free_port()},
            {"name": "c", "port": stubs["c"].port, "role": "backup"},
        ],
        retry_non_idempotent=False,
    )
    try:
        assert drain(g, "drain", "a").returncode == 0
        assert ask(g, 4) == [(200, "c")] * 4
        assert {e["upstream_status"] for e in g.log()[-4:]} == {"502 : 200"}  # x refused, then c
    finally:
        g.stop()


# ----------------------------------------------------------------------------- routing.policy cache_aware

CA = {"policy": "cache_aware", "max_conns": 2}


def test_sse_is_passed_on_as_it_is_written(stubs: dict[str, Stub], tmp_path: Path) -> None:
    """A stream reaches the client event by event, as the engine writes it: not buffered (vLLM sends no
    ``X-Accel-Buffering``) and not compressed (the server block says ``gzip off``: Debian's nginx.conf turns
    gzip on for the http block, and gzip holds a stream in its buffers). The stub paces 8 events 0.25 s apart,
    so the check does not depend on how fast an engine decodes or how busy the machine is (a real engine's
    stream came in one read when the machine was loaded)."""
    stubs["a"].sse = (8, 0.25)
    try:
        g = _gw(tmp_path, [{"name": "a", "port": stubs["a"].port}])
        try:
            host, port = g.url.removeprefix("http://").split(":")
            conn = http.client.HTTPConnection(host, int(port), timeout=30)
            t0 = time.perf_counter()
            # as the OpenAI SDK asks: a gateway that compressed the stream would hold it in gzip's buffers
            headers = {"Content-Type": "application/json", "Accept-Encoding": "gzip, deflate"}
            conn.request("POST", "/v1/chat/completions", json.dumps(chat_body(stream=True)), headers)
            resp = conn.getresponse()
            assert resp.status == 200 and resp.getheader("Content-Type", "").startswith("text/event-stream")
            assert resp.getheader("Content-Encoding") is None, resp.getheaders()
            arrivals = []
            while line := resp.readline():
                if line.startswith(b"data: {"):
                    arrivals.append(time.perf_counter() - t0)
            conn.close()
        finally:
            g.stop()
    finally:
        stubs["a"].sse = None
    gaps = [round(y - x, 3) for x, y in itertools.pairwise(arrivals)]
    print(f"SSE through the gateway: events at {[round(t, 2) for t in arrivals]} s")
    assert len(arrivals) == 8, arrivals
    # the first event came before most were written: 1.75 s between the first and the last as written, none as
    # one buffer (a measure of the stream itself, not of how soon a loaded machine answers)
    assert arrivals[-1] - arrivals[0] >= 0.25 * 4, arrivals
    assert sum(1 for d in gaps if d >= 0.125) >= 6, gaps  # one by one, not a buffer at a time


def _reset(stubs: dict[str, Stub]) -> None:
    for s in stubs.values():
        s.status, s.delay, s.peak, s.sse = 200, 0.0, 0, None


def _ca_gw(stubs: dict[str, Stub], tmp: Path, **gw: Any) -> Gateway:
    _reset(stubs)
    return _gw(
        tmp,
        [{"name": n, "port": stubs[n].port, "routing": CA} for n in ("a", "b", "c")]
        + [{"name": "d", "port": stubs["d"].port, "role": "backup", "routing": CA}],
        **gw,
    )


def tenant(p: int, q: int = 0, **kw: Any) -> dict[str, Any]:
    """A chat request of tenant p: a long system prompt (the shared prefix), question q."""
    system = f"You are the assistant of tenant {p}. " * 30
    return chat_body(
        messages=[{"role": "system", "content": system}, {"role": "user", "content": f"q{q}"}], **kw
    )


def served(g: Gateway, body: dict[str, Any], path: str = "/v1/chat/completions", **headers: str) -> str:
    st, b = http_json("POST", g.url + path, body, headers=headers or None)
    assert st == 200, (st, b)
    return str(b["served_by"])


def test_cache_aware_keeps_each_prefix_on_one_instance(stubs: dict[str, Stub], tmp_path: Path) -> None:
    g = _ca_gw(stubs, tmp_path)
    try:
        home = {p: served(g, tenant(p)) for p in range(12)}
        assert set(home.values()) <= {"a", "b", "c"} and len(set(home.values())) >= 2  # spread, no backup
        for q in range(1, 4):  # every question of a tenant, every turn of a conversation: its instance
            for p in range(12):
                assert served(g, tenant(p, q)) == home[p]
        turn2 = tenant(5)
        turn2["messages"] += [
            {"role": "assistant", "content": "an answer"},
            {"role": "user", "content": "more"},
        ]
        assert served(g, turn2) == home[5]
        # the key does not depend on how the model is named (path, header, body)
        assert served(g, tenant(7), "/models/tiny-qwen3/v1/chat/completions") == home[7]
        assert served(g, dict(tenant(7), model="ignored"), **{"X-Model-Name": "tiny-qwen3"}) == home[7]
        assert wait_for(lambda: len(g.log()) >= 12 * 4 + 3, 5)
        log = g.log()
        assert {e["upstream"] for e in log} == {"m_tiny_qwen3__ca"}
        keys = {e["prefix_key"] for e in log}
        assert len(keys) == 12 and all(len(k) == 16 for k in keys)  # a hash, never the prompt
        assert not any("tenant" in json.dumps(e) for e in log)
    finally:
        g.stop()


def test_cache_aware_gives_way_at_the_bound_and_spills_a_full_engine(
    stubs: dict[str, Stub], tmp_path: Path
) -> None:
    g = _ca_gw(stubs, tmp_path)
    try:
        home = served(g, tenant(1))
        stubs[home].delay = 0.5
        # 6 at once, one prefix: the home instance takes max_conns (2), the rest go elsewhere
        with ThreadPoolExecutor(6) as ex:
            got = list(ex.map(lambda q: served(g, tenant(1, q)), range(6)))
        assert stubs[home].peak == 2
        assert got.count(home) == 2 and len(set(got)) >= 2
        stubs[home].delay = 0.0
        assert served(g, tenant(1, 9)) == home  # below the bound again: back home
        # the home instance answers 503 (full): the request spills to another instance, never ejects it
        stubs[home].status = 503
        other = served(g, tenant(1, 10))
        assert other != home
        spilled = g.find(lambda e: e["upstream"] == "m_tiny_qwen3__spill")
        # the spill twin may try the full one again first (least_conn): "503 : 503, 200" or "503 : 200"
        assert len(spilled) == 1 and spilled[0]["upstream_status"].startswith("503 : ")
        assert spilled[0]["upstream_status"].endswith(", 200") or spilled[0]["upstream_status"] == "503 : 200"
        stubs[home].status = 200
        assert served(g, tenant(1, 11)) == home
    finally:
        g.stop()


def test_cache_aware_fails_over_and_keeps_affinity_during_a_drain(
    stubs: dict[str, Stub], tmp_path: Path
) -> None:
    dead = free_port()
    _reset(stubs)
    g = _gw(
        tmp_path,
        [
            {"name": "a", "port": stubs["a"].port, "routing": CA},
            {"name": "x", "port": dead, "routing": CA},  # a primary that is down
            {"name": "b", "port": stubs["b"].port, "routing": CA},
            {"name": "d", "port": stubs["d"].port, "role": "backup", "routing": CA},
        ],
    )
    try:
        got = [served(g, tenant(p)) for p in range(16)]  # the keys of x fail over before the first byte
        assert set(got) <= {"a", "b"}
        assert g.find(lambda e: e["upstream_status"].startswith("502"))  # x was tried
        assert [served(g, tenant(p, 1)) for p in range(16)] == got  # and then stay where they went
        assert drain(g, "drain", "a").returncode == 0
        walk = [served(g, tenant(p, 2)) for p in range(8)]
        assert set(walk) == {"b"}  # x is down: failover in the drained walk
        assert drain(g, "drain", "b").returncode == 0  # only the dead x left: the backup serves
        assert {served(g, tenant(p, 3)) for p in range(4)} == {"d"}
        for n in ("a", "b"):
            assert drain(g, "undrain", n).returncode == 0
        assert [served(g, tenant(p, 4)) for p in range(16)] == got
    finally:
        g.stop()


def test_cache_aware_without_a_prompt_and_with_every_primary_down(
    stubs: dict[str, Stub], tmp_path: Path
) -> None:
    _reset(stubs)
    g = _gw(
        tmp_path,
        [
            {"name": "x", "port": free_port(), "routing": CA},
            {"name": "y", "port": free_port(), "routing": CA},
            {"name": "d", "port": stubs["d"].port, "role": "backup", "routing": CA},
        ],
    )
    try:
        # no prompt (no key): the model's upstream, least_conn
        st, b = http_json("POST", g.url + "/v1/embeddings", {"model": "tiny-qwen3"})
        assert st == 200 and b["served_by"] == "d"
        assert g.find(lambda e: e["uri"] == "/v1/embeddings")[-1]["upstream"] == "m_tiny_qwen3"
        # every primary down: from the ring back to the upstream, whose backup serves
        assert served(g, tenant(1)) == "d"
        e = g.find(lambda e: e["prefix_key"] != "")[-1]
        assert e["upstream"] == "m_tiny_qwen3__ca:m_tiny_qwen3"
        # the Anthropic API is keyed too (system + first user message)
        body = {
            "model": "tiny-qwen3",
            "max_tokens": 4,
            "system": "s " * 300,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        }
        assert served(g, body, "/v1/messages") == "d"
    finally:
        g.stop()


def test_cache_aware_drained_walk_keeps_each_key_on_one_instance(
    stubs: dict[str, Stub], tmp_path: Path
) -> None:
    """While an instance is drained the router walks the others in an order ranked by the key (not at
    random), so a prefix keeps its instance during a rolling restart."""
    _reset(stubs)
    g = _gw(tmp_path, [{"name": n, "port": stubs[n].port, "routing": CA} for n in ("a", "b", "c", "d")])
    try:
        assert drain(g, "drain", "d").returncode == 0
        first = [served(g, tenant(p)) for p in range(12)]
        assert "d" not in first and len(set(first)) >= 2
        for q in (1, 2):
            assert [served(g, tenant(p, q)) for p in range(12)] == first
        assert {e["upstream"] for e in g.find(lambda e: e["prefix_key"] != "")} == {"m_tiny_qwen3__x__d"}
    finally:
        g.stop()
