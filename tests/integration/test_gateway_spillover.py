"""Overload through the gateway: a full engine (its queue bound answers 503) is never ejected; its requests
spill over to another instance of the model, then to the fallback pool; when every one is full the client gets
a JSON 503 with Retry-After, in the shape of its API.

Engines: ``p`` runs 2 requests at most and admits no more (``--max-num-seqs 2 --max-num-queued-reqs 2``); ``c``
has no queue bound. The subject is nginx's spill-over on an engine's admission 503, so both are sim engines
(vllm_fleet.devtools.sim_engine): tests/integration/test_engine_contract.py checks that their 503 (status,
body, headers, the queue bound's arithmetic) is real vLLM's.
"""

from __future__ import annotations

import http.client
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from vllm_fleet.devtools.gateway_testing import OPEN_RATE_LIMIT, Gateway, gateway_spec, wait_for
from vllm_fleet.devtools.testing import EngineProcess


@pytest.fixture(scope="module")
def p(sim_engine_factory: Any) -> EngineProcess:
    """The full primary: 2 unfinished requests at most (vLLM 0.32's --max-num-queued-reqs counts running +
    waiting), the rest get vLLM's 503."""
    return sim_engine_factory(extra=["--max-num-seqs", "2", "--max-num-queued-reqs", "2"], token_delay=0.003)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def engine(sim_engine_factory: Any) -> EngineProcess:
    """``c``: an instance with room (no queue bound)."""
    return sim_engine_factory()  # type: ignore[no-any-return]


def start(tmp: Path, servers: list[dict[str, Any]]) -> Gateway:
    return Gateway(gateway_spec(servers, tmp, rate_limit=OPEN_RATE_LIMIT), tmp).start()


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[Any]:
    started: list[Gateway] = []

    def make(servers: list[dict[str, Any]]) -> Gateway:
        started.append(start(tmp_path / f"gw{len(started)}", servers))
        return started[-1]

    yield make
    for g in started:
        g.stop()


def burst(url: str, n: int, anthropic: bool = False, tokens: int = 120) -> list[dict[str, Any]]:
    """``n`` concurrent requests (one connection each, no client retries): status, Retry-After, body."""
    host, port = url.removeprefix("http://").split(":")
    if anthropic:
        path = "/v1/messages"
        body = {"model": "tiny-qwen3", "max_tokens": tokens, "messages": [{"role": "user", "content": "hi"}]}
    else:
        path = "/v1/completions"
        body = {"model": "tiny-qwen3", "prompt": "once upon a time", "max_tokens": tokens, "ignore_eos": True}
    out: list[dict[str, Any]] = []
    lock = threading.Lock()
    go = threading.Event()

    def one() -> None:
        go.wait()
        c = http.client.HTTPConnection(host, int(port), timeout=300)
        try:
            c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
            r = c.getresponse()
            raw = r.read()
            res = {"status": r.status, "retry_after": r.getheader("Retry-After"), "body": json.loads(raw)}
        except Exception as exc:  # a dropped connection is a failure and must be counted
            res = {"status": f"{type(exc).__name__}: {exc}"}
        finally:
            c.close()
        with lock:
            out.append(res)

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    go.set()
    for t in threads:
        t.join(600)
    return out


def addr(e: EngineProcess) -> str:
    return f"127.0.0.1:{e.port}"


def test_a_full_instance_spills_to_another_and_is_never_ejected(
    p: EngineProcess, engine: EngineProcess, gateway: Any
) -> None:
    g = gateway([{"name": "p", "port": p.port}, {"name": "c", "port": engine.port}])
    res = burst(g.url, 16)
    assert [r["status"] for r in res] == [200] * 16, res  # none lost, none shed: c has room
    wait_for(lambda: len(g.log()) >= 16, 5)
    log = g.log()
    spilled = [e for e in log if "503" in e["upstream_status"]]
    assert spilled, log  # p turned some away (queue bound); they were sent again, before the first byte
    assert all(e["upstream"].endswith("__spill") and e["upstream_status"].endswith("200") for e in spilled)
    print(f"16 at once: {len(spilled)} spilled from a full instance, e.g. {spilled[0]['upstream_status']}")
    # a full replica is not a failed one: it still gets traffic at once (max_fails=1 would eject it for 5 s)
    seen = len(log)
    served = burst(g.url, 1, tokens=2) + burst(g.url, 1, tokens=2) + burst(g.url, 1, tokens=2)
    assert all(r["status"] == 200 for r in served)
    wait_for(lambda: len(g.log()) >= seen + 3, 5)
    after = g.log()[seen:]
    assert len(after) == 3 and any(e["upstream_addr"] == addr(p) for e in after), after  # p was not ejected


def test_spill_over_to_the_fallback_pool(p: EngineProcess, engine: EngineProcess, gateway: Any) -> None:
    g = gateway([{"name": "p", "port": p.port}, {"name": "c", "port": engine.port, "role": "fallback"}])
    res = burst(g.url, 12)
    assert [r["status"] for r in res] == [200] * 12, res
    wait_for(lambda: len(g.log()) >= 12, 5)
    log = g.log()
    to_fallback = [e for e in log if e["upstream_addr"].endswith(addr(engine))]
    assert to_fallback and all("503" in e["upstream_status"] for e in to_fallback), log
    assert {e["upstream"] for e in to_fallback} == {to_fallback[0]["upstream"]}  # the fallback pool's name
    print(f"12 at once: {len(to_fallback)} served by the fallback ({to_fallback[0]['upstream']})")


@pytest.mark.parametrize("anthropic", [False, True], ids=["openai", "anthropic"])
def test_every_instance_full_is_a_json_503_with_retry_after(
    p: EngineProcess, gateway: Any, anthropic: bool
) -> None:
    g = gateway([{"name": "p", "port": p.port}])
    # long answers: the 4 admitted still run when the last of the 10 arrive (with 120 tokens an idle machine
    # finished some first and admitted 6)
    res = burst(g.url, 10, anthropic=anthropic, tokens=600)
    statuses = sorted(str(r["status"]) for r in res)
    assert set(statuses) == {"200", "503"}, statuses  # nothing dropped, no 502
    full = [r for r in res if r["status"] == 503]
    assert len(full) >= 6, statuses  # p admits 2 at a time
    for r in full:
        assert r["retry_after"] == "1", r
        if anthropic:
            assert r["body"]["type"] == "error" and r["body"]["error"]["type"] == "overloaded_error", r
        else:
            assert r["body"]["error"]["code"] == "model_overloaded", r
        assert "tiny-qwen3 is full" in json.dumps(r["body"]), r
