"""Drain through the real nginx gateway, with stub engines (tiny HTTP servers that say who they are, or
answer 503 like a full engine): the router overlays the drained set on routes.json and walks the remaining
servers of the upstream; the rendered files are never edited and nginx is never reloaded."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from vllm_fleet.devtools.gateway_nginx import JS_MODULE
from vllm_fleet.devtools.gateway_testing import Gateway, chat_body, gateway_spec, wait_for
from vllm_fleet.devtools.testing import free_port, http_json

pytestmark = pytest.mark.skipif(
    shutil.which("nginx") is None or not Path(JS_MODULE).exists(),
    reason="nginx + libnginx-mod-http-js needed",
)


class Stub:
    """An engine stand-in on a free port: 200 {"served_by": NAME} (or ``status`` when set)."""

    def __init__(self, name: str) -> None:
        self.name, self.status, self.hits = name, 200, 0
        stub = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                stub.hits += 1
                body = json.dumps({"served_by": stub.name, "status": stub.status}).encode()
                self.send_response(stub.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

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
    rl = {"per_key_rps": 10000, "per_key_burst": 10000, "per_ip_rps": 10000, "per_ip_burst": 10000}
    return Gateway(gateway_spec(servers, tmp, rate_limit=rl, **gw), tmp).start()


def drain(g: Gateway, *args: str) -> subprocess.CompletedProcess[str]:
    main = "import sys; from vllm_fleet.cli import main; sys.exit(main(sys.argv[1:]))"
    routes = g.nginx.etc_nginx / "vllm-fleet" / "routes.json"
    cmd = [sys.executable, "-c", main, *args, "--routes", str(routes), "--state", str(g.state)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


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
