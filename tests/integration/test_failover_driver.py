"""The failover driver (vllm_fleet/devtools/failover.py) against real sim engines: an address that moves.

``MovingAddress`` listens on one loopback port and pipes each connection to an engine; ``cut()`` closes the
listener and resets every open connection (new connections are refused at once, where the sandbox's dead
address makes them time out), ``cut(silent=True)`` stops answering on them instead (a holder powered off:
no RST, the clients wait), ``move(port)`` listens again, piping to another engine — the address taken over
by the other gateway. Light: sim engines, a few seconds of load.
"""

from __future__ import annotations

import json
import select
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from vllm_fleet.devtools.failover import FailoverLoad, main, run_failover
from vllm_fleet.devtools.testing import SimEngineProcess, free_port


class MovingAddress:
    def __init__(self, target: int) -> None:
        self.port = free_port()
        self.accepted = 0
        self.silent = False
        self.held: list[socket.socket] = []  # connections of a silent cut, open and unanswered
        self._listen(target)

    def _listen(self, target: int) -> None:
        self.sock = socket.create_server(("127.0.0.1", self.port))
        self.sock.settimeout(0.05)
        self.cutting = threading.Event()
        self.pipes: list[threading.Thread] = []
        threading.Thread(target=self._accept, args=(self.sock, target, self.cutting), daemon=True).start()

    def _accept(self, sock: socket.socket, target: int, cutting: threading.Event) -> None:
        while not cutting.is_set():
            try:
                client, _ = sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.accepted += 1
            t = threading.Thread(target=self._pipe, args=(client, target, cutting), daemon=True)
            self.pipes.append(t)
            t.start()

    def _pipe(self, client: socket.socket, target: int, cutting: threading.Event) -> None:
        upstream = socket.create_connection(("127.0.0.1", target))
        peer = {client: upstream, upstream: client}
        reading = [client, upstream]
        try:
            while reading and not cutting.is_set():
                ready, _, _ = select.select(reading, [], [], 0.05)
                for s in ready:
                    data = s.recv(65536)
                    if data:
                        peer[s].sendall(data)
                    else:
                        reading.remove(s)
                        peer[s].shutdown(socket.SHUT_WR)
        except OSError:
            pass
        finally:
            if cutting.is_set() and self.silent:
                self.held.append(client)
            elif cutting.is_set():  # an RST, not a FIN: the connection is gone, not finished
                client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                client.close()
            else:
                client.close()
            upstream.close()

    def cut(self, silent: bool = False) -> None:
        self.silent = silent
        self.cutting.set()
        self.sock.close()  # connections still in its backlog are reset by the kernel
        for t in self.pipes:
            t.join(5)

    def move(self, target: int) -> None:
        self._listen(target)

    def close(self) -> None:
        self.cut()
        for s in self.held:
            s.close()


@pytest.fixture(scope="module")
def engines(sim_engine_factory: Any) -> tuple[SimEngineProcess, SimEngineProcess]:
    # 16 tokens at 0.03 s: a request takes about 0.5 s, so some are always in flight
    return sim_engine_factory(token_delay=0.03), sim_engine_factory(token_delay=0.03)


def test_a_moving_address(engines: tuple[SimEngineProcess, SimEngineProcess]) -> None:
    a, b = engines
    addr = MovingAddress(a.port)
    load = FailoverLoad(f"http://127.0.0.1:{addr.port}", "tiny-qwen3", lanes=4, prefixes=2, timeout=10)

    def cut() -> dict[str, Any]:
        addr.cut()
        time.sleep(1.0)
        addr.move(b.port)
        return {"moved": load.mark("moved")}

    metrics = [a.url + "/metrics", b.url + "/metrics"]
    try:
        res = run_failover(load, duration=6.0, cut_after=2.5, cut=cut, engine_metrics=metrics, window=2.5)
    finally:
        addr.close()
    rep, moved = res["report"], res["cut"]["moved"]
    cut_at = rep["cut"]
    assert res["cut"]["start"] == cut_at < moved <= res["cut"]["end"]
    # the requests in flight at the cut: plain ones reset before their answer, streams cut after the headers
    assert {"reset", "stream_cut"} <= set(rep["failed_in_flight"]), rep
    assert set(rep["failed_in_flight"]) <= {"reset", "stream_cut", "connect_error"}, rep
    # nothing answered during the 1 s outage: refused connects (and any that reached the old listener first)
    assert set(rep["failed_started_after_cut"]) <= {"connect_error", "reset", "stream_cut"}, rep
    assert rep["failed_started_after_cut"].get("connect_error", 0) >= 1
    assert moved - cut_at <= rep["gap_s"]  # nothing started during the outage succeeded
    assert rep["failed_after_recovery"] == 0 and rep["failed_before_cut"] == 0
    after = [r for r in res["records"] if r["start"] >= moved]
    assert after and all(r["outcome"] == "ok" for r in after)
    assert {r["stream"] for r in after} == {True, False}
    # no request that started after the cut was answered before the address moved (one in flight at the cut may
    # still end ok just after it: its answer was already on its way; ci34 had one 23 ms after the cut)
    assert rep["last_ok_before_cut_s"] is not None and rep["first_ok_after_cut_s"] is not None
    early = [r for r in res["records"] if r["outcome"] == "ok" and cut_at <= r["start"] and r["end"] < moved]
    assert not early, early
    assert rep["ok_rps_before"] > 0 and rep["ok_rps_after"] > 0
    # the prefix-cache hit rate: engine a before the cut, engine b after (2 shared 300-word prefixes: every
    # prompt's first 2 blocks of 128 tokens are cached after its prefix's first request)
    pc = res["prefix_cache"]
    before, after_ = pc["before"], pc["after"]
    assert before["engines"][b.url + "/metrics"] == {"hits": 0, "queries": 0}
    assert before["engines"][a.url + "/metrics"]["queries"] == before["queries"] > 0
    assert 0.3 < before["hit_rate"] < 1 and 0.3 < after_["hit_rate"] < 1, pc
    assert after_["engines"][b.url + "/metrics"]["hits"] > 0
    assert before["missing"] == after_["missing"] == [] and pc["errors"] == {}
    json.dumps(res)


def test_a_silent_holder(engines: tuple[SimEngineProcess, SimEngineProcess]) -> None:
    """No RST from a dead holder: the requests in flight end by the read timeout (1 s), not the 30 s bound."""
    a, b = engines
    addr = MovingAddress(a.port)
    load = FailoverLoad(f"http://127.0.0.1:{addr.port}", "tiny-qwen3", lanes=4, read_timeout=1.0, timeout=30)

    def cut() -> dict[str, Any]:
        addr.cut(silent=True)
        time.sleep(0.5)
        addr.move(b.port)
        return {}

    try:
        res = run_failover(load, duration=4.0, cut_after=1.5, cut=cut)
    finally:
        addr.close()
    rep = res["report"]
    assert rep["failed_in_flight"] == {"timeout": rep["in_flight_at_cut"]} and rep["in_flight_at_cut"] >= 1, (
        rep
    )
    hung = [r for r in res["records"] if r["start"] < rep["cut"] < r["end"]]
    assert all(r["end"] < rep["cut"] + 5 and "timed out" in r["detail"] for r in hung), hung
    assert {r["stream"] for r in hung} == {True, False}
    assert rep["gap_s"] >= 0.5 and rep["failed_after_recovery"] == 0 and res["prefix_cache"] is None


def canned(answer: bytes) -> tuple[int, Callable[[], None]]:
    """A loopback server that reads each request and writes ``answer``, then closes: (port, stop)."""
    srv = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            with c:
                head = b""
                while b"\r\n\r\n" not in head:
                    head += c.recv(65536)
                length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
                body = head.split(b"\r\n\r\n", 1)[1]
                while len(body) < length:
                    body += c.recv(65536)
                c.sendall(answer)

    threading.Thread(target=serve, daemon=True).start()
    return srv.getsockname()[1], srv.close


def outcomes(url: str, model: str = "tiny-qwen3") -> dict[bool, set[str]]:
    """stream → the outcomes of 0.5 s of two lanes (one plain, one streaming)."""
    with FailoverLoad(url, model, lanes=2, fail_pause=0.05) as ld:
        time.sleep(0.5)
    return {st: {r.outcome for r in ld.records if r.stream == st} for st in (False, True)}


def test_outcomes_of_answers_that_are_not_ok(engines: tuple[SimEngineProcess, SimEngineProcess]) -> None:
    assert outcomes(engines[0].url, model="no-such-model") == {False: {"http_404"}, True: {"http_404"}}
    truncated = (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n" + b'{"choices'
    )
    port, stop = canned(truncated)
    try:
        assert outcomes(f"http://127.0.0.1:{port}") == {False: {"reset"}, True: {"stream_cut"}}
    finally:
        stop()
    sse = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
    port, stop = canned(sse + b'data: {"error": {"message": "busy", "code": 503}}\n\ndata: [DONE]\n\n')
    try:
        assert outcomes(f"http://127.0.0.1:{port}") == {False: {"error"}, True: {"error_event"}}
    finally:
        stop()
    port, stop = canned(sse + b'data: {"choices": []}\n\n')
    try:
        assert outcomes(f"http://127.0.0.1:{port}")[True] == {"stream_cut"}
    finally:
        stop()


def test_keep_alive_or_a_connection_per_request(engines: tuple[SimEngineProcess, SimEngineProcess]) -> None:
    a, _ = engines
    for keep_alive in (False, True):
        addr = MovingAddress(a.port)
        try:
            with FailoverLoad(
                f"http://127.0.0.1:{addr.port}", "tiny-qwen3", lanes=2, keep_alive=keep_alive
            ) as ld:
                time.sleep(1.5)
        finally:
            addr.close()
        recs = ld.records
        assert len(recs) >= 4 and all(r.outcome == "ok" for r in recs), recs
        assert addr.accepted == (2 if keep_alive else len(recs))


def test_command_line(engines: tuple[SimEngineProcess, SimEngineProcess], tmp_path: Path) -> None:
    a, _ = engines
    key, out = tmp_path / "key", tmp_path / "failover.json"
    key.write_text("sk-not-checked\n")  # the sim engine takes any key: the header is only sent
    # 3 s after the cut: on a loaded 2-core machine a request may take a second, and one must start after it
    argv = [
        "run", a.url, "--key-file", str(key), "--model", "tiny-qwen3", "--lanes", "2", "--duration", "4",
        "--cut-after", "1", "--cut-cmd", f"{sys.executable} -c 'print(\"cut\")'",
        "--engine-metrics", a.url + "/metrics", "--window", "1", "--out", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    res = json.loads(out.read_text())
    assert res["cut"]["rc"] == 0 and res["cut"]["output"] == "cut\n"
    assert res["report"]["failed"] == 0 and res["report"]["ok"] == len(res["records"]) > 0
    # the cut is a no-op: the first request that started after it succeeded, so the gap ends at its start
    # (no bound in seconds: a loaded 2-core machine made it 1.003 s once, by lanes still busy at the cut)
    assert res["report"]["gap_s"] is not None
    assert res["report"]["gap_s"] == res["report"]["first_start_after_cut_s"]
    assert res["load"]["lanes"] == 2 and res["load"]["keep_alive"] is False
    assert res["prefix_cache"]["before"]["queries"] > 0 and res["prefix_cache"]["after"]["queries"] > 0
    assert "still_running" not in res["cut"]
