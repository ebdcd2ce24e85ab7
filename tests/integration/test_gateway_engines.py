"""The gateway in front of engines: 2 primaries (a, b) and 1 backup (c) of the tiny model.

The subject is nginx and our routing (drain, priority pools, fallback, reload, failover), not vLLM: the engines
are sim engines (vllm_fleet.devtools.sim_engine, real processes with vLLM's HTTP API, started like real ones
on their own ports; tests/integration/test_engine_contract.py checks them against real vLLM-CPU). The OpenAI
and Anthropic SDK tests use them too: what they depend on of vLLM (the answers' shapes and SSE framing) is
what the contract compares.

Order matters (pytest runs the file top to bottom): SDKs and routing first, then drain, reload under load,
and last the destructive part: kill -9 of a primary under load, all primaries down, a primary back (a
forwarder to the backup's engine answers on its address again).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from vllm_fleet.devtools.gateway_testing import Gateway, chat_body, gateway_spec, load, wait_for
from vllm_fleet.devtools.testing import EngineProcess, http_json

KEY = "sk-vf-engines-0123456789abcdef0123"
AUTH = {"Authorization": f"Bearer {KEY}"}


class Engines:
    def __init__(self, a: EngineProcess, b: EngineProcess, c: EngineProcess) -> None:
        self.a, self.b, self.c = a, b, c

    def addr(self, e: EngineProcess) -> str:
        return f"127.0.0.1:{e.port}"


@pytest.fixture(scope="module")
def engines(sim_engine_factory: Any) -> Engines:
    """a and b: the primaries; c: the backup (never killed). Sim engines, stopped when the module ends."""
    return Engines(sim_engine_factory(), sim_engine_factory(), sim_engine_factory())


def _start(tmp: Path, servers: list[dict[str, Any]]) -> Gateway:
    keys = tmp / "api_keys"
    keys.write_text(f'"{KEY}" tester;\n')
    spec = gateway_spec(
        servers,
        tmp,
        api_keys_file=str(keys),
        rate_limit={"per_key_rps": 10000, "per_key_burst": 10000, "per_ip_rps": 10000, "per_ip_burst": 10000},
    )
    return Gateway(spec, tmp).start()


@pytest.fixture(scope="module")
def gw(engines: Engines, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    g = _start(
        tmp_path_factory.mktemp("gateway"),
        [
            {"name": "a", "port": engines.a.port},
            {"name": "b", "port": engines.b.port},
            {"name": "c", "port": engines.c.port, "role": "backup"},
        ],
    )
    try:
        yield g
    finally:
        g.stop()


def served_by(entry: dict[str, Any]) -> str:
    """The server that answered (the last address nginx tried)."""
    return str(entry["upstream_addr"]).replace(" : ", ", ").split(", ")[-1]


def drain(g: Gateway, *args: str) -> subprocess.CompletedProcess[str]:
    """``vllm-fleet drain|undrain ...`` against this gateway's files (the real CLI, in a subprocess)."""
    main = "import sys; from vllm_fleet.cli import main; sys.exit(main(sys.argv[1:]))"
    cmd = [sys.executable, "-c", main, *args, "--upstreams", str(g.nginx.upstreams_file)]
    cmd += ["--state", str(g.state), "--nginx", g.nginx_cmd]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def test_openai_sdk_plain_and_streaming(gw: Gateway) -> None:
    import openai

    c = openai.OpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=0)
    r = c.chat.completions.create(
        model="tiny-qwen3", messages=[{"role": "user", "content": "hi"}], max_tokens=8
    )
    assert r.choices[0].message.content is not None and r.usage and r.usage.completion_tokens > 0
    chunks = list(
        c.chat.completions.create(
            model="tiny-qwen3", messages=[{"role": "user", "content": "hi"}], max_tokens=8, stream=True
        )
    )
    assert len(chunks) >= 3 and any(ch.choices and ch.choices[0].finish_reason for ch in chunks)
    comp = c.completions.create(model="tiny-qwen3", prompt="def f(", max_tokens=5)
    assert comp.choices[0].text is not None
    scomp = list(c.completions.create(model="tiny-qwen3", prompt="def f(", max_tokens=5, stream=True))
    assert len(scomp) >= 2
    assert [m.id for m in c.models.list()] == ["tiny-qwen3"]


def test_anthropic_sdk_plain_and_streaming(gw: Gateway) -> None:
    import anthropic

    c = anthropic.Anthropic(base_url=gw.url, api_key=KEY, max_retries=0)
    msgs: Any = [{"role": "user", "content": "hi"}]
    m = c.messages.create(model="tiny-qwen3", max_tokens=8, system="be brief", messages=msgs)
    assert m.type == "message" and m.content and m.usage.output_tokens > 0
    with c.messages.stream(model="tiny-qwen3", max_tokens=8, messages=msgs) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert final.usage.output_tokens > 0 and isinstance(text, str)
    assert c.messages.count_tokens(model="tiny-qwen3", messages=msgs).input_tokens > 0
    entries = gw.find(lambda e: e["uri"].startswith("/v1/messages") and e["status"] == 200)
    assert entries and all(e["model"] == "tiny-qwen3" and e["route"] == "body" for e in entries)


def test_routing_by_header_and_by_path(gw: Gateway) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    st, p = http_json(
        "POST", gw.url + "/v1/chat/completions", body, headers={**AUTH, "X-Model-Name": "tiny-qwen3"}
    )
    assert st == 200, p
    st, p = http_json(
        "POST", gw.url + "/models/tiny-qwen3/v1/completions", {"prompt": "x", "max_tokens": 3}, headers=AUTH
    )
    assert st == 200 and p["object"] == "text_completion", p
    st, p = http_json("POST", gw.url + "/models/tiny-qwen3/v1/messages", {"model": "tiny-qwen3", "max_tokens": 3,
                      "messages": [{"role": "user", "content": "x"}]}, headers=AUTH)  # fmt: skip
    assert st == 200 and p["type"] == "message", p
    routes = {e["route"] for e in gw.find(lambda e: e["status"] == 200 and e["route"] in ("header", "path"))}
    assert routes == {"header", "path"}


def test_drain_and_undrain(gw: Gateway, engines: Engines) -> None:
    r = drain(gw, "drain", "a", "--wait", "30")  # --wait: until a's /metrics shows no running request
    assert r.returncode == 0, r.stderr
    assert "a: no running request" in r.stdout
    assert json.loads(gw.state.read_text())["drained"] == ["a"]
    n = len(gw.log())
    assert all(s == 200 for s in load(gw.url + "/v1/chat/completions", 12, 4, headers=AUTH))
    assert wait_for(lambda: len(gw.log()) >= n + 12, 5)
    assert {served_by(e) for e in gw.log()[n:]} == {engines.addr(engines.b)}
    r = drain(gw, "undrain", "a")
    assert r.returncode == 0, r.stderr
    n = len(gw.log())
    assert all(s == 200 for s in load(gw.url + "/v1/chat/completions", 12, 4, headers=AUTH))
    assert wait_for(lambda: len(gw.log()) >= n + 12, 5)
    assert engines.addr(engines.a) in {served_by(e) for e in gw.log()[n:]}
    r = drain(gw, "drain", "no-such-instance")
    assert r.returncode == 1 and "unknown instance" in r.stderr


def test_drain_keeps_client_connections(gw: Gateway, engines: Engines) -> None:
    """Drain and undrain change no nginx config and reload nothing: a client's keep-alive connection to the
    gateway carries requests before, during and after (a reload would close it while idle), and the drained
    instance gets none of them (the router picks the upstream's copy without it)."""
    host, port = gw.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    body = json.dumps(chat_body())

    def ask() -> int:
        conn.request("POST", "/v1/chat/completions", body, {**AUTH, "Content-Type": "application/json"})
        r = conn.getresponse()
        r.read()
        return r.status

    try:
        assert ask() == 200
        sock = conn.sock
        conf_before = gw.nginx.upstreams_file.read_text()
        assert drain(gw, "drain", "b").returncode == 0
        assert gw.nginx.upstreams_file.read_text() == conf_before  # nothing to reload
        n = len(gw.log())
        assert [ask() for _ in range(4)] == [200] * 4
        assert conn.sock is sock  # the same TCP connection
        assert wait_for(lambda: len(gw.log()) >= n + 4, 5)
        assert {served_by(e) for e in gw.log()[n:]} == {engines.addr(engines.a)}
        assert {e["upstream"] for e in gw.log()[n:]} == {"m_tiny_qwen3__x__b"}
        assert drain(gw, "undrain", "b").returncode == 0
        assert [ask() for _ in range(2)] == [200] * 2
        assert conn.sock is sock
    finally:
        conn.close()


def test_priority_pool_and_fallback(engines: Engines, tmp_path: Path) -> None:
    """X-Priority: high → the `high` pool (b); none → the default pool (a); every GPU instance down (drained)
    → the `role: fallback` instance (c) serves."""
    g = _start(
        tmp_path,
        [
            {"name": "a", "port": engines.a.port},
            {"name": "b", "port": engines.b.port, "pool": "high"},
            {"name": "c", "port": engines.c.port, "role": "fallback"},
        ],
    )
    try:
        url = g.url + "/v1/chat/completions"
        assert all(s == 200 for s in load(url, 6, 2, headers={**AUTH, "X-Priority": "high"}))
        assert all(s == 200 for s in load(url, 6, 2, headers=AUTH))
        hi = g.find(lambda e: e["priority"] == "high", 5)
        lo = g.find(lambda e: e["priority"] == "" and e["status"] == 200, 5)
        assert {served_by(e) for e in hi} == {engines.addr(engines.b)}
        assert {served_by(e) for e in lo} == {engines.addr(engines.a)}
        for name in ("a", "b"):
            r = drain(g, "drain", name)
            assert r.returncode == 0, r.stderr
        n = len(g.log())
        assert all(s == 200 for s in load(url, 4, 2, headers=AUTH))
        assert wait_for(lambda: len(g.log()) >= n + 4, 5)
        new = g.log()[n:]
        assert {served_by(e) for e in new} == {engines.addr(engines.c)}
        assert {e["upstream"] for e in new} == {"m_tiny_qwen3__fallback"}
    finally:
        g.stop()


def test_reload_during_load_loses_nothing(gw: Gateway) -> None:
    stop = threading.Event()
    reloads = 0

    def reloader() -> None:
        nonlocal reloads
        while not stop.wait(0.25):
            gw.nginx.reload()
            reloads += 1

    t = threading.Thread(target=reloader)
    t.start()
    try:
        res = load(gw.url + "/v1/chat/completions", 200, 8, headers=AUTH)
    finally:
        stop.set()
        t.join()
    failed = [r for r in res if r != 200]
    assert reloads >= 3
    assert failed == [], failed[:5]


def test_kill_9_primary_during_load_loses_nothing(gw: Gateway, engines: Engines) -> None:
    killed = threading.Event()

    def progress(k: int) -> None:
        if k == 40 and not killed.is_set():
            killed.set()
            engines.a.kill()  # SIGKILL to the engine's process group

    n = len(gw.log())
    res = load(gw.url + "/v1/chat/completions", 200, 8, headers=AUTH, on_progress=progress)
    assert killed.is_set()
    failed = [r for r in res if r != 200]
    assert failed == [], failed[:5]
    # the failover path was taken: requests that failed on a (in flight or refused) were re-sent to another
    # instance by nginx (upstream_status "502, 200") — a POST, so only because of non_idempotent
    a = engines.addr(engines.a)
    assert wait_for(lambda: len(gw.log()) >= n + 200, 5)
    retried = [e for e in gw.log()[n:] if e["upstream_addr"].startswith(a + ", ")]
    assert retried and all(e["status"] == 200 for e in retried)


def test_all_primaries_down_backup_serves(gw: Gateway, engines: Engines) -> None:
    engines.b.kill()
    n = len(gw.log())
    res = load(gw.url + "/v1/chat/completions", 20, 4, headers=AUTH)
    assert res == [200] * 20
    assert wait_for(lambda: len(gw.log()) >= n + 20, 5)
    assert {served_by(e) for e in gw.log()[n:]} == {engines.addr(engines.c)}


class Forwarder:
    """Listens on 127.0.0.1:``port`` and pipes every connection to 127.0.0.1:``target``: an engine
    answering on a dead primary's address again, as nginx sees a restarted engine (without a second start)."""

    def __init__(self, port: int, target: int) -> None:
        self.target = target
        self.sock = socket.create_server(("127.0.0.1", port))  # SO_REUSEADDR: the dead engine's port
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self.sock.close()


def test_primary_back_traffic_returns(gw: Gateway, engines: Engines) -> None:
    back_at = Forwarder(engines.a.port, engines.c.port)  # primary a answers again (served by c's engine)

    # nginx retries a failed server after fail_timeout (5 s): traffic must come back without any reload
    def back() -> bool:
        n = len(gw.log())
        load(gw.url + "/v1/chat/completions", 4, 2, headers=AUTH)
        time.sleep(0.2)
        return engines.addr(engines.a) in {served_by(e) for e in gw.log()[n:]}

    try:
        assert wait_for(back, 30, 1)
    finally:
        back_at.close()
