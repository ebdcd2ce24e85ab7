"""The canary split through the real nginx gateway, with stub engines: a canary (rollouts) gets nothing without a
live lease in the state file (``vllm-fleet canary set``), ``share`` of the model's requests with one (by a hash of
the prefix key under cache_aware), and a canary that fails or is full costs the client nothing: the request goes
on along the model's normal path. The exporter counts each track's outcomes from the access log; drain, undrain
and nginx's peer handler keep the lease in the state file."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from vllm_fleet.devtools.gateway_nginx import HAVE_NGINX
from vllm_fleet.devtools.gateway_testing import (
    OPEN_RATE_LIMIT,
    Gateway,
    StubEngine,
    chat_body,
    gateway_spec,
    stub_engines,
    wait_for,
)
from vllm_fleet.devtools.testing import free_port, http_json
from vllm_fleet.host.exporter.access_log import AccessLogTail
from vllm_fleet.host.gateway_state import read_state

pytestmark = pytest.mark.skipif(not HAVE_NGINX, reason="nginx + libnginx-mod-http-js needed")


@pytest.fixture
def stubs() -> Iterator[dict[str, StubEngine]]:
    with stub_engines("a", "b", "c", "can") as s:
        yield s


CA = {"policy": "cache_aware", "max_conns": 8}


def _gw(
    tmp: Path, stubs: dict[str, StubEngine], canary_port: int, routing: dict[str, Any] | None = None
) -> Gateway:
    extra = {"routing": routing} if routing else {}
    servers = [{"name": n, "port": stubs[n].port, **extra} for n in ("a", "b", "c")]
    rollout = {"model": "tiny-qwen3", "canary": {"name": "can", "port": canary_port}, "share": 0.25}
    return Gateway(gateway_spec(servers, tmp, rate_limit=OPEN_RATE_LIMIT, rollouts=[rollout]), tmp)


def ask(g: Gateway, n: int, body: dict[str, Any] | None = None, distinct: bool = False) -> list[str]:
    """n requests one after the other, each answered 200; who served each. Returns once the log has them.
    ``distinct``: each with a prompt of its own (a prefix key of its own under cache_aware)."""
    seen = len(g.log())
    out = []
    for i in range(n):
        if distinct:
            body = chat_body(messages=[{"role": "user", "content": f"question {i} {time.time()}"}])
        st, b = http_json("POST", g.url + "/v1/chat/completions", body or chat_body())
        assert st == 200, (st, b)
        out.append(str(b["served_by"]))
    assert wait_for(lambda: len(g.log()) >= seen + n, 5)
    return out


def test_the_canary_gets_its_share_only_while_its_lease_is_live(
    stubs: dict[str, StubEngine], tmp_path: Path
) -> None:
    g = _gw(tmp_path, stubs, stubs["can"].port).start()
    try:
        # (i) no lease: nothing for the canary
        assert "can" not in ask(g, 40)
        assert stubs["can"].hits == 0
        assert {e["track"] for e in g.log()} == {"stable"}
        # (ii) a live lease of 0.25, requests without a prefix key (least_conn): about a quarter
        g.cli("canary", "set", "can", "--share", "0.25", "--lease", "120")
        got = ask(g, 400)
        n = got.count("can")
        assert 60 <= n <= 140, n  # binomial(400, 0.25): mean 100, sd 8.7
        assert stubs["can"].hits == n
        log = g.log()[-400:]
        assert sum(e["track"] == "canary" for e in log) == n
        assert {e["upstream"] for e in log if e["track"] == "canary"} == {"vf_i_can"}
        # (vi) drain and undrain of a stable instance keep the lease (and the canary its share)
        lease = read_state(g.state).canary["can"]
        g.cli("drain", "a")
        assert read_state(g.state).canary == {"can": lease}
        got = ask(g, 80)
        assert "a" not in got and "can" in got
        g.cli("undrain", "a")
        assert read_state(g.state).canary == {"can": lease} and read_state(g.state).drained == []
        # a drained canary gets nothing, whatever its lease
        g.cli("drain", "can")
        before = stubs["can"].hits
        ask(g, 40)
        assert stubs["can"].hits == before
        g.cli("undrain", "can")
        # (v) a lease that ran out: nothing
        g.cli("canary", "set", "can", "--share", "0.5", "--lease", "1")
        time.sleep(1.2)
        before = stubs["can"].hits
        assert "can" not in ask(g, 40)
        assert stubs["can"].hits == before
        assert {e["track"] for e in g.log()[-40:]} == {"stable"}
        # cleared: nothing either
        g.cli("canary", "set", "can", "--share", "0.5", "--lease", "60")
        g.cli("canary", "clear", "can")
        assert "can" not in ask(g, 20)
    finally:
        g.stop()


def test_cache_aware_decides_by_the_prefix_key(stubs: dict[str, StubEngine], tmp_path: Path) -> None:
    """(iii) each key always on the same side, about ``share`` of the distinct keys on the canary."""
    g = _gw(tmp_path, stubs, stubs["can"].port, routing=CA).start()
    try:
        g.cli("canary", "set", "can", "--share", "0.25", "--lease", "120")

        def tenant(p: int, q: int) -> dict[str, Any]:
            system = f"You are the assistant of tenant {p}. " * 30
            return chat_body(
                messages=[{"role": "system", "content": system}, {"role": "user", "content": f"q{q}"}]
            )

        side: dict[int, set[bool]] = {}
        for q in range(3):
            for p in range(120):
                (who,) = ask(g, 1, tenant(p, q))
                side.setdefault(p, set()).add(who == "can")
        assert all(len(s) == 1 for s in side.values()), side  # every turn of a key: one side
        on_canary = sum(s == {True} for s in side.values())
        assert 12 <= on_canary <= 50, on_canary  # binomial(120, 0.25): mean 30, sd 4.7
        # the stable side keeps its prefix affinity: the cache-aware twin
        assert {e["upstream"] for e in g.log() if e["track"] == "stable"} == {"m_tiny_qwen3__ca"}
    finally:
        g.stop()


def _track_counts(g: Gateway) -> dict[tuple[str, str], float]:
    tail = AccessLogTail(g.access_log, from_start=True)
    return {
        (s.labels["track"], s.labels["outcome"]): s.value
        for fam in tail.metrics()
        if fam.name == "vllm_fleet_gateway_track_requests"
        for s in fam.samples
    }


@pytest.mark.parametrize("routing", [None, CA], ids=["least_conn", "cache_aware"])
def test_a_failing_canary_costs_the_client_nothing(
    stubs: dict[str, StubEngine], tmp_path: Path, routing: dict[str, Any] | None
) -> None:
    """(iv) the canary full (503) or refusing connections: every request is answered by a stable instance, and
    the exporter counts the canary's failures (shed, error)."""
    g = _gw(tmp_path, stubs, stubs["can"].port, routing=routing).start()
    try:
        g.cli("canary", "set", "can", "--share", "0.5", "--lease", "120")
        stubs["can"].status = 503
        got = ask(g, 60, distinct=True)
        assert set(got) <= {"a", "b", "c"}
        shed = stubs["can"].hits
        assert shed >= 10  # binomial(60, 0.5)
        stubs["can"].close()  # now the canary refuses connections
        got = ask(g, 60, distinct=True)
        assert set(got) <= {"a", "b", "c"}
        counts = _track_counts(g)
        assert counts[("canary", "shed")] == shed
        assert counts[("canary", "error")] >= 10
        assert counts[("canary", "ok")] == 0
        assert counts[("canary", "error")] + counts[("canary", "shed")] + counts[("stable", "ok")] == 120
        canary = [e for e in g.log() if e["track"] == "canary"]
        assert {e["upstream_status"].split(" : ")[0] for e in canary} <= {"503", "502"}
        assert {e["status"] for e in canary} == {200}
    finally:
        g.stop()


def test_the_peer_handler_keeps_the_lease(stubs: dict[str, StubEngine], tmp_path: Path) -> None:
    """(vi) another gateway's drain (nginx's peer location, router.js peer()) rewrites the drained set and keeps
    the canary's lease: the peer server of peer.conf, added here to the one-gateway config."""
    g = _gw(tmp_path, stubs, stubs["can"].port)
    port = free_port()
    conf = g.nginx.etc_nginx / "conf.d" / "vllm-fleet.conf"
    conf.write_text(
        conf.read_text() + f"\nserver {{\n    listen 127.0.0.1:{port};\n    location = /vf/drained {{\n"
        "        client_body_buffer_size 4k;\n        js_content vf.peer;\n    }\n}\n"
    )
    g.start()
    try:
        g.cli("canary", "set", "can", "--share", "0.25", "--lease", "120")
        lease = read_state(g.state).canary
        st, body = http_json("POST", f"http://127.0.0.1:{port}/vf/drained", {"drain": "b"})
        assert (st, body) == (200, {"drained": ["b"]})
        doc = json.loads(g.state.read_text())
        assert doc["drained"] == ["b"] and read_state(g.state).canary == lease
        st, body = http_json("POST", f"http://127.0.0.1:{port}/vf/drained", {"undrain": "b"})
        assert (st, body) == (200, {"drained": []})
        assert read_state(g.state).canary == lease
        got = ask(g, 80)
        assert "b" in got and "can" in got  # the router still reads the rewritten file
    finally:
        g.stop()
