"""Sleep mode through the real nginx gateway (issue 33, docs/sleep.md "Gateway"): requests for an awake replica of
a model go there first, a sleeping replica is the last resort.

The replicas are stub engines that also play the sleep guard's public reading (GET /vllm-fleet/sleep answers
their ``sleep_state``) and record every request that reaches them; the real ``vllm-fleet sleepwatch`` runs on the
rendered config and writes the file the rendered router reads (in a test folder: the plan's path is pointed
there before the render). Every wait is on state (the watch's file, the access log), never a fixed sleep.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from vllm_fleet.contracts import SLEEPWATCH_CONFIG_FILE
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
from vllm_fleet.fleet import sleepwatch_plan

pytestmark = pytest.mark.skipif(not HAVE_NGINX, reason="nginx + libnginx-mod-http-js needed")

SLEEP = {"level": 1, "idle_seconds": 60}


class SleepyGateway:
    """A rendered spec served by nginx, with the sleep watch running on its rendered config."""

    def __init__(self, tmp: Path, servers: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> None:
        folder = tmp / "run-sleepwatch"  # the unit's RuntimeDirectory
        folder.mkdir()
        self.asleep_file = folder / "asleep.json"
        monkeypatch.setattr(sleepwatch_plan, "ASLEEP_FILE", str(self.asleep_file))
        self.gw = Gateway(gateway_spec(servers, tmp, rate_limit=OPEN_RATE_LIMIT), tmp)
        config = self.gw.workdir / "out" / "h1" / SLEEPWATCH_CONFIG_FILE.lstrip("/")
        self.watch = subprocess.Popen(
            [sys.executable, "-m", "vllm_fleet.cli", "sleepwatch", "--config", str(config)],
            stdout=subprocess.DEVNULL,
            stderr=(tmp / "sleepwatch.log").open("ab"),
            start_new_session=True,
        )
        self.gw.start()

    def asleep(self) -> list[str] | None:
        try:
            return list(json.loads(self.asleep_file.read_text())["asleep"])
        except (OSError, ValueError):
            return None

    def waking(self) -> list[str] | None:
        try:
            return list(json.loads(self.asleep_file.read_text())["waking"])
        except (OSError, ValueError):
            return None

    def until_asleep(self, *names: str, waking: tuple[str, ...] = ()) -> None:
        """Wait until the watch has written exactly ``names`` not awake (``waking`` of them waking)."""
        assert wait_for(
            lambda: self.asleep() == sorted(names) and self.waking() == sorted(waking), 10, 0.05
        ), (self.asleep(), self.waking())

    def ask(self, n: int, model: str = "tiny-qwen3") -> list[tuple[int, str]]:
        """n chat requests, one after the other; returns once the access log has them too."""
        seen = len(self.gw.log())
        out = []
        for _ in range(n):
            st, body = http_json("POST", self.gw.url + "/v1/chat/completions", chat_body(model), timeout=30)
            out.append((st, body.get("served_by", "") if isinstance(body, dict) else ""))
        assert wait_for(lambda: len(self.gw.log()) >= seen + n, 5)
        return out

    def stop(self) -> None:
        self.gw.stop()
        self.watch.terminate()
        self.watch.wait(10)


@pytest.fixture
def stubs() -> Iterator[dict[str, StubEngine]]:
    with stub_engines("a", "b", "c", "other") as s:
        for x in s.values():
            x.sleep_state = "awake"
        yield s


def _gateway(
    tmp: Path, monkeypatch: pytest.MonkeyPatch, servers: list[dict[str, Any]]
) -> Iterator[SleepyGateway]:
    g = SleepyGateway(tmp, servers, monkeypatch)
    try:
        yield g
    finally:
        g.stop()


def test_awake_first_the_sleeping_replica_last_and_every_one_asleep(
    stubs: dict[str, StubEngine], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = stubs["a"], stubs["b"]
    servers = [
        {"name": "a", "port": a.port, "sleep": SLEEP},
        {"name": "b", "port": b.port, "sleep": SLEEP},
        # another model that does not sleep: its requests never look at the watch's file
        {"name": "other", "port": stubs["other"].port, "served_model_name": "plain"},
    ]
    for g in _gateway(tmp_path, monkeypatch, servers):
        routes = json.loads((g.gw.nginx.etc_nginx / "vllm-fleet" / "routes.json").read_text())
        assert routes["asleep_file"] == str(g.asleep_file)
        assert {m["model"]: m["sleeps"] for m in routes["models"]} == {"plain": False, "tiny-qwen3": True}
        g.until_asleep()
        assert {s for st, s in g.ask(8) if st == 200} == {"a", "b"}  # both awake: nginx balances
        # b asleep: every request goes to a, none reaches b
        b.sleep_state = "asleep"
        g.until_asleep("b")
        hits = b.hits
        assert g.ask(12) == [(200, "a")] * 12
        assert b.hits == hits
        assert {e["upstream"] for e in g.gw.log()[-12:]} == {"m_tiny_qwen3__z__b"}
        # a full (503 before any work): the sleeping b is the last resort, its guard holds and serves
        a.status = 503
        b.delay = 0.3  # held while it wakes
        assert g.ask(2) == [(200, "b")] * 2
        assert {e["upstream_status"] for e in g.gw.log()[-2:]} == {"503 : 200"}
        a.status, b.delay = 200, 0.0
        # both asleep: as if nothing slept (nginx picks one, whose guard wakes it)
        a.sleep_state = "asleep"
        g.until_asleep("a", "b")
        got = g.ask(6)
        assert all(st == 200 for st, _ in got) and {s for _, s in got} <= {"a", "b"}
        assert {e["upstream"] for e in g.gw.log()[-6:]} == {"m_tiny_qwen3"}
        # none awake but b waking: b, whose wake is under way, before waking a too
        b.sleep_state = "waking"
        g.until_asleep("a", "b", waking=("b",))
        hits = a.hits
        assert g.ask(4) == [(200, "b")] * 4
        assert a.hits == hits
        assert {e["upstream"] for e in g.gw.log()[-4:]} == {"m_tiny_qwen3__z__b__z__a"}
        b.sleep_state = "asleep"
        # the model that does not sleep: its instance listed as asleep by hand changes nothing for it
        a.sleep_state = "awake"
        g.until_asleep("b")
        g.asleep_file.write_text(json.dumps({"asleep": ["b", "other"], "waking": [], "updated": 0}))
        assert g.ask(3, "plain") == [(200, "other")] * 3
        assert {e["upstream"] for e in g.gw.log()[-3:]} == {"m_plain"}
        # a killed: the watch cannot reach its guard and counts it awake (never hides it); the request finds
        # it refused and goes to the sleeping b
        a.sleep_state = "asleep"
        g.until_asleep("a", "b")
        a.sleep_state = "awake"
        g.until_asleep("b")
        a.close()
        assert g.ask(3) == [(200, "b")] * 3
        assert {e["upstream_status"] for e in g.gw.log()[-3:]} == {"502 : 200"}
        assert g.asleep() == ["b"]


def test_a_waking_replica_before_an_asleep_one_and_the_last_try_kept_for_a_sleeper(
    stubs: dict[str, StubEngine], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three replicas awake for the watch but down (connection refused: no guard answers) and two that sleep:
    of a request's 3 tries the first two go to awake ones, the third to a sleeper — the waking b before the
    asleep a."""
    a, b = stubs["a"], stubs["b"]
    dead = [free_port() for _ in range(3)]
    servers = [{"name": "a", "port": a.port, "sleep": SLEEP}, {"name": "b", "port": b.port, "sleep": SLEEP}]
    servers += [{"name": f"d{i}", "port": p, "sleep": SLEEP} for i, p in enumerate(dead)]
    for g in _gateway(tmp_path, monkeypatch, servers):
        a.sleep_state, b.sleep_state = "asleep", "waking"
        g.until_asleep("a", "b", waking=("b",))
        assert g.ask(6) == [(200, "b")] * 6
        assert a.hits == 0
        log = g.gw.log()[-6:]
        assert {e["upstream"] for e in log} == {"m_tiny_qwen3__z__b__z__a"}
        assert {e["upstream_status"] for e in log} == {"502 : 502 : 200"}
        assert all(e["upstream_addr"].split(" : ")[-1] == f"127.0.0.1:{b.port}" for e in log)
        # both asleep: still two awake tries, then one of the sleepers
        b.sleep_state = "asleep"
        g.until_asleep("a", "b")
        got = g.ask(6)
        assert all(st == 200 for st, _ in got) and {s for _, s in got} <= {"a", "b"}
        assert {e["upstream_status"] for e in g.gw.log()[-6:]} == {"502 : 502 : 200"}
