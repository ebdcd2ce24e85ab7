"""Sleep mode through the real nginx gateway (issue 33, docs/sleep.md "Gateway"): requests for an awake replica of
a model go there first, a sleeping replica is the last resort.

The replicas are stub engines that also play the sleep guard's public reading (GET /vllm-fleet/sleep answers
their ``sleep_state``) and record every request that reaches them; the real ``vllm-fleet sleepwatch`` runs on the
rendered config and writes the file the rendered router reads (in a test folder: the plan's path is pointed
there before the render). Every wait is on state (the watch's file, the access log), never a fixed sleep.

End to end, with the real pieces: the launcher runs the sim engine as a sleeping model's engine runs (the sleep
guard as middleware, development mode on), puts it to sleep after 2 s idle, and wakes it on the guard's signal
when a request through nginx arrives; the request is held and served. A failing wake is a JSON 503 with
Retry-After through nginx, and the development paths answer 404 through the gateway and without the token. Then
one model with two such replicas behind nginx and the real sleep watch: both asleep; a burst goes to one (ranked
by the model's name) and wakes it alone, as does a burst once it is listed waking; one awake and one asleep,
every request goes to the awake one; the awake one killed, the next request fails over to the sleeper, which is
woken and serves it.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from vllm_fleet.contracts import DEV_MODE_ENV, SLEEP_GUARD, SLEEP_STATE_PATH, SLEEPWATCH_CONFIG_FILE
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
from vllm_fleet.devtools.launched import LaunchedInstance, launch
from vllm_fleet.devtools.testing import (
    SIM_LAUNCHER_SERVICE,
    free_port,
    http_json,
    requests_served,
    sim_engine_argv,
)
from vllm_fleet.fleet import sleepwatch_plan
from vllm_fleet.host.sleepwatch import guard_state

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
        # both asleep, none waking: every request to the same one first (ranked by the model's name), whose
        # guard wakes it; the other is not reached
        a.sleep_state = "asleep"
        g.until_asleep("a", "b")
        first, second = wake_order("tiny-qwen3", ("a", "b"))
        hits = stubs[second].hits
        assert g.ask(6) == [(200, first)] * 6
        assert stubs[second].hits == hits
        assert {e["upstream"] for e in g.gw.log()[-6:]} == {f"m_tiny_qwen3__z__{first}__z__{second}"}
        # its wake failed (the guard's 503 before any byte): the next one in that order wakes and serves
        stubs[first].status = 503
        assert g.ask(2) == [(200, second)] * 2
        assert {e["upstream_status"] for e in g.gw.log()[-2:]} == {"503 : 200"}
        stubs[first].status = 200
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


# ----------------------------------------------------------------- end to end: the real launcher, guard and sim


IDLE_SECONDS = (
    2  # the instance configs' sleep.idle_seconds (the spec's minimum is 10; a test's launcher may go lower)
)


def launch_sleeper(
    name: str, model_dir: Path, workdir: Path, state_dir: Path, extra: tuple[str, ...] = ()
) -> LaunchedInstance:
    """The real launcher (in a session of its own) on an instance config whose model sleeps (level 1 after
    ``IDLE_SECONDS`` idle), running the sim engine as a sleeping model's engine runs (--enable-sleep-mode, the
    guard as --middleware, VLLM_SERVER_DEV_MODE=1); READY once it served its first completion (not waited for)."""
    port = free_port()
    argv = sim_engine_argv(
        model_dir,
        port,
        "tiny-qwen3",
        ["--enable-sleep-mode", "--middleware", SLEEP_GUARD, *extra],
        shutdown_timeout=10,
    )
    cfg = {
        "name": name, "served_model_name": "tiny-qwen3", "model_path": str(model_dir),
        "listen_address": "127.0.0.1", "port": port, "command": argv, "environment": {DEV_MODE_ENV: "1"},
        "shutdown_timeout": 10, "state_dir": str(state_dir), "service": SIM_LAUNCHER_SERVICE,
        "sleep": {"level": 1, "idle_seconds": IDLE_SECONDS, "wake_wait_seconds": 20},
    }  # fmt: skip
    return launch(workdir, name, cfg, new_session=True)


def kill_with_engine(r: LaunchedInstance) -> None:
    """SIGKILL the launcher's process group and the engine's (its own session), as a crash of both would."""
    pid = None
    with contextlib.suppress(OSError, ValueError):
        pid = r.state().get("engine_pid")
    r.kill()
    if pid:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(int(pid), signal.SIGKILL)


@pytest.fixture
def sleeper(sim_model_dir: Path, tmp_path: Path) -> Iterator[LaunchedInstance]:
    r = launch_sleeper("zz", sim_model_dir, tmp_path / "launcher", tmp_path / "state")
    try:
        r.notify.wait_for("READY", "1", timeout=60)
        yield r
    finally:
        r.kill()


def sleep_state(r: LaunchedInstance) -> str | None:
    try:
        return r.state().get("sleep_state")
    except (OSError, ValueError):
        return None


def until_asleep(r: LaunchedInstance) -> None:
    assert wait_for(lambda: sleep_state(r) == "asleep", 30, 0.1), (sleep_state(r), r.output()[-2000:])


def test_a_sleeping_engine_behind_the_gateway_is_woken_held_and_served(
    sleeper: LaunchedInstance, tmp_path: Path
) -> None:
    """After 2 s idle the launcher puts the engine to sleep; a completion and a streamed chat through nginx are
    held by the guard while the launcher wakes it, then served (200, the stream complete); a wake that fails
    (the sim's wake_fail) is a JSON 503 with Retry-After through nginx; the development paths answer a JSON 404
    through the gateway and vLLM's own 404 on the engine's port without the token."""
    r = sleeper
    g = Gateway(
        gateway_spec([{"name": "zz", "port": r.port, "sleep": SLEEP}], tmp_path, rate_limit=OPEN_RATE_LIMIT),
        tmp_path,
    ).start()
    try:
        until_asleep(r)
        assert guard_state("127.0.0.1", r.port, 1) == "asleep"  # the reading the sleep watch takes
        wakes = int(r.state()["wakes_total"])
        st, body = http_json("POST", g.url + "/v1/completions", completion(), timeout=60)
        assert st == 200 and body["choices"][0]["text"], body
        assert r.state()["sleep_state"] == "awake" and int(r.state()["wakes_total"]) == wakes + 1
        # asleep again: a streamed chat is held, then streamed to its end
        until_asleep(r)
        status, ctype, text = stream_chat(g.url)
        assert status == 200 and ctype.startswith("text/event-stream"), (status, text[:300])
        assert text.rstrip().endswith("data: [DONE]") and text.count("data: {") >= 2, text[-300:]
        assert int(r.state()["wakes_total"]) == wakes + 2
        # every wake fails from now on: the guard answers 503 before any byte, the gateway a JSON 503
        assert http_json("POST", r.url + "/sim/control", {"wake_fail": True})[0] == 200
        until_asleep(r)
        failed = int(r.state()["failed_wakes_total"])
        st, body, headers = post_with_headers(g.url + "/v1/completions", completion())
        assert st == 503 and headers.get("retry-after"), (st, body, headers)
        assert body["error"]["type"] == "server_error", body
        assert wait_for(lambda: int(r.state()["failed_wakes_total"]) > failed, 10)
        # the development paths: never through the gateway (its own JSON 404, in the plain form, with a model
        # header, under /models/NAME/), never on the engine's port without the token (vLLM's own 404)
        forms = [("", {}), ("", {"X-Model-Name": "tiny-qwen3"}), ("/models/tiny-qwen3", {})]
        for path in ("/sleep", "/wake_up", "/is_sleeping", "/collective_rpc", SLEEP_STATE_PATH):
            for prefix, headers in forms:
                for method in ("GET", "POST"):
                    st, body = http_json(
                        method, g.url + prefix + path, {"model": "tiny-qwen3"}, headers=headers
                    )
                    assert st == 404 and set(body) == {"error"}, (method, prefix + path, headers, st, body)
            st, body = http_json("POST", r.url + path, {})
            assert (st, body) == (404, {"detail": "Not Found"}), (path, st, body)
        assert http_json("GET", r.url + "/is_sleeping") == (404, {"detail": "Not Found"})
    finally:
        g.stop()


def completion() -> dict[str, Any]:
    return {"model": "tiny-qwen3", "prompt": "hello there", "max_tokens": 8}


def stream_chat(base: str) -> tuple[int, str, str]:
    host, _, port = base.removeprefix("http://").partition(":")
    c = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        c.request(
            "POST",
            "/v1/chat/completions",
            json.dumps(chat_body(stream=True)),
            {"Content-Type": "application/json"},
        )
        resp = c.getresponse()
        return resp.status, resp.getheader("Content-Type") or "", resp.read().decode()
    finally:
        c.close()


def post_with_headers(url: str, body: dict[str, Any]) -> tuple[int, Any, dict[str, str]]:
    host, _, rest = url.removeprefix("http://").partition(":")
    port, _, path = rest.partition("/")
    c = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        c.request("POST", "/" + path, json.dumps(body), {"Content-Type": "application/json"})
        resp = c.getresponse()
        return resp.status, json.loads(resp.read()), {k.lower(): v for k, v in resp.getheaders()}
    finally:
        c.close()


def test_a_burst_far_above_max_num_seqs_at_a_sleeping_engine(sim_model_dir: Path, tmp_path: Path) -> None:
    """12 × max_num_seqs requests at once through nginx (half streamed) while the engine sleeps: one wake, and every
    answer a 200 (a stream complete, no error event) or a JSON 429/503 with Retry-After (vLLM's admission, the stream
    guard, the gateway's spill-over); none hangs, the engine and the launcher are the same after."""
    r = launch_sleeper(
        "zb", sim_model_dir, tmp_path / "launcher", tmp_path / "state",
        ("--middleware", "vllm_fleet.host.stream_guard.StreamGuard", "--max-num-seqs", "4",
         "--max-num-queued-reqs", "8"),
    )  # fmt: skip
    g = Gateway(
        gateway_spec([{"name": "zb", "port": r.port, "sleep": SLEEP}], tmp_path, rate_limit=OPEN_RATE_LIMIT),
        tmp_path,
    ).start()
    try:
        r.notify.wait_for("READY", "1", timeout=60)
        until_asleep(r)
        engine, wakes = r.state()["engine_pid"], int(r.state()["wakes_total"])
        outcomes: list[str] = []

        def one(i: int) -> None:
            stream = bool(i % 2)
            path, body = (
                ("/v1/chat/completions", chat_body(stream=True))
                if stream
                else ("/v1/completions", completion())
            )
            c = http.client.HTTPConnection("127.0.0.1", g.spec.gateway.port, timeout=60)
            try:
                c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
                resp = c.getresponse()
                text, retry = resp.read().decode(), resp.getheader("Retry-After")
            finally:
                c.close()
            if resp.status == 200 and stream:
                done = text.rstrip().endswith("data: [DONE]") and '"error"' not in text
                outcomes.append("200 stream" if done else f"BAD stream {text[-200:]}")
            elif resp.status == 200:
                outcomes.append("200" if json.loads(text)["choices"][0]["text"] else "BAD 200")
            else:
                ok = resp.status in (429, 503) and "error" in json.loads(text) and bool(retry)
                outcomes.append(str(resp.status) if ok else f"BAD {resp.status} {retry} {text[:200]}")

        threads = [threading.Thread(target=one, args=(i,)) for i in range(48)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads), "a request hung"
        assert len(outcomes) == 48 and not [o for o in outcomes if o.startswith("BAD")], outcomes
        assert "200" in outcomes and "200 stream" in outcomes, outcomes
        st = r.state()
        assert int(st["wakes_total"]) == wakes + 1 and st["failed_wakes_total"] == 0, st
        assert st["engine_pid"] == engine and r.proc.poll() is None
    finally:
        g.stop()
        r.kill()


# ------------------------------------------------------- end to end: two real sleeping replicas of one model

REPLICAS = ("a", "b")
BURST = 8  # requests sent at once, every other one streamed
UPSTREAM = "m_tiny_qwen3"  # the model's upstream (its one-server ones: m_tiny_qwen3__a, __b)


@pytest.fixture
def two_sleepers(sim_model_dir: Path, tmp_path: Path) -> Iterator[dict[str, LaunchedInstance]]:
    """Two replicas of tiny-qwen3 on one host (one state folder), each its own real launcher, sleep guard and
    sim engine; both READY."""
    started: dict[str, LaunchedInstance] = {}
    try:
        for n in REPLICAS:
            started[n] = launch_sleeper(n, sim_model_dir, tmp_path / f"launcher-{n}", tmp_path / "state")
        for r in started.values():
            r.notify.wait_for("READY", "1", timeout=60)
        yield started
    finally:
        for r in started.values():
            kill_with_engine(r)


def wake_order(model: str, instances: tuple[str, ...]) -> list[str]:
    """The order in which the router tries a model's sleeping replicas when none is awake nor waking
    (router.js ranked(): sha1 of "vf-wake", the model and the instance, lowest first)."""
    return sorted(instances, key=lambda n: hashlib.sha1(f"vf-wake\x1f{model}\x1f{n}".encode()).hexdigest())


def wakes(r: LaunchedInstance) -> int:
    return int(r.state()["wakes_total"])


def one_request(base: str, stream: bool, ready: threading.Barrier | None = None) -> tuple[int, str]:
    """A chat completion through ``base`` on a connection of its own (after ``ready``, when given): (status, "")
    when the answer is whole (a body with choices; a stream to [DONE]), else (status, why)."""
    host, _, port = base.removeprefix("http://").partition(":")
    if ready is not None:
        ready.wait(10)
    c = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        body = json.dumps(chat_body(stream=stream))
        c.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        r = c.getresponse()
        status, text = r.status, r.read().decode()
    except (OSError, http.client.HTTPException) as exc:
        return 0, f"{type(exc).__name__}: {exc}"
    finally:
        c.close()
    if status != 200:
        return status, text[:300]
    if stream:
        whole = text.rstrip().endswith("data: [DONE]") and text.count("data: {") >= 2
    else:
        whole = bool(json.loads(text).get("choices"))
    return status, "" if whole else text[-300:]


def burst(base: str, n: int = BURST) -> list[tuple[int, str]]:
    """``n`` requests released together (a barrier), every other one streamed; ``one_request``'s answers."""
    ready = threading.Barrier(n)
    with ThreadPoolExecutor(n) as ex:
        return list(ex.map(lambda i: one_request(base, i % 2 == 1, ready), range(n)))


class Trickle(threading.Thread):
    """A slow trickle of completions straight to one engine's port (not through nginx), one every
    ``every`` seconds until ``stop()``: it keeps that replica awake (it never idles ``IDLE_SECONDS``)."""

    def __init__(self, r: LaunchedInstance, every: float = 0.4) -> None:
        super().__init__(daemon=True)
        self.url, self.every = r.url, every
        self.answers: list[int | str] = []  # statuses, or why a request failed
        self._halt = threading.Event()
        self.start()

    def run(self) -> None:
        while not self._halt.is_set():
            try:
                self.answers.append(
                    http_json("POST", self.url + "/v1/completions", completion(), timeout=30)[0]
                )
            except OSError as exc:
                self.answers.append(f"{type(exc).__name__}: {exc}")
            self._halt.wait(self.every)

    def stop(self) -> list[int | str]:
        self._halt.set()
        self.join(30)
        return self.answers


def test_two_sleeping_replicas_end_to_end(
    two_sleepers: dict[str, LaunchedInstance], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One model, two replicas, each a real launcher + sleep guard + sim engine, behind the rendered gateway with the
    real sleep watch: (1) idle, both sleep and the watch lists both; (2) a burst while both are asleep and none
    is waking goes to one replica (the same for every request: ranked by the model's name), woken once, every
    request served, the other neither reached nor woken; a burst once the watch lists that replica as waking goes
    to it alone, the other stays asleep; (3) one awake, one asleep: every request goes to the awake one, the
    sleeper is neither reached nor woken; (4) the awake one killed (launcher and engine): the next request fails
    over before its first byte to the sleeping one, which is woken and serves it."""
    reps = two_sleepers
    servers = [{"name": n, "port": r.port, "sleep": SLEEP} for n, r in reps.items()]
    for g in _gateway(tmp_path, monkeypatch, servers):
        trickles: list[Trickle] = []
        try:
            two_replicas(g, reps, trickles)
        finally:
            for t in trickles:
                t.stop()


def two_replicas(g: SleepyGateway, reps: dict[str, LaunchedInstance], trickles: list[Trickle]) -> None:
    """The steps of test_two_sleeping_replicas_end_to_end; a trickle it starts is added to ``trickles``."""
    addr = {f"127.0.0.1:{r.port}": n for n, r in reps.items()}
    seen = 0  # chat completions the access log has so far

    def chats() -> list[dict[str, Any]]:
        return [e for e in g.gw.log() if e["uri"] == "/v1/chat/completions"]

    def answered(n: int) -> list[dict[str, Any]]:
        """The next ``n`` chat completions of the access log, once nginx has logged them all."""
        nonlocal seen
        assert wait_for(lambda: len(chats()) >= seen + n, 10), (len(chats()), seen, n)
        got, seen = chats()[seen : seen + n], seen + n
        assert len(chats()) == seen, "more requests through nginx than sent"
        return got

    def served_by(entries: list[dict[str, Any]]) -> Counter[str]:
        """Per replica, the requests it answered (each entry's last try)."""
        return Counter(addr[e["upstream_addr"].split(" : ")[-1]] for e in entries)

    def all_asleep() -> None:
        for r in reps.values():
            until_asleep(r)
        g.until_asleep(*REPLICAS)

    # 1. both idle: both asleep (the launchers' state files), then the watch's file lists both
    all_asleep()
    before = {n: wakes(r) for n, r in reps.items()}

    # 2a. a burst while both are asleep and none is waking: every request goes first to the same replica x
    # (ranked by the model's name: the same on every gateway), whose guard holds them while it wakes, once;
    # y is neither reached nor woken (the watch cannot say "waking" before its next poll, up to 1 s later: the
    # order is the same either way; docs/sleep.md "Nothing awake"). Every request is answered whole.
    x, y = wake_order("tiny-qwen3", REPLICAS)
    for r in reps.values():  # a wake long enough for the whole burst to arrive while it lasts
        assert http_json("POST", r.url + "/sim/control", {"wake_seconds": 1.0})[0] == 200
    assert burst(g.gw.url) == [(200, "")] * BURST
    log = answered(BURST)
    assert {e["upstream"] for e in log} == {f"{UPSTREAM}__z__{x}__z__{y}"}
    assert served_by(log) == {x: BURST}
    assert wait_for(lambda: wakes(reps[x]) == before[x] + 1, 10)
    assert wakes(reps[y]) == before[y] and sleep_state(reps[y]) == "asleep"

    # 2b. both asleep again; one request wakes x (slowly: 3 s), and once the watch lists it as waking, a burst
    # goes to it alone: the waking one before the asleep one; the other is never woken
    all_asleep()
    before = {n: wakes(r) for n, r in reps.items()}
    for r in reps.values():
        assert http_json("POST", r.url + "/sim/control", {"wake_seconds": 3.0})[0] == 200
    with ThreadPoolExecutor(1) as ex:
        first = ex.submit(one_request, g.gw.url, False)
        assert wait_for(lambda: len(g.waking() or []) == 1, 10, 0.05), (g.asleep(), g.waking())
        assert g.waking() == [x]
        assert g.asleep() == sorted(REPLICAS) and sleep_state(reps[x]) == "waking"
        assert burst(g.gw.url, BURST - 1) == [(200, "")] * (BURST - 1)
        assert first.result(30) == (200, "")
    trickle = Trickle(reps[x])  # from now on x never idles long enough to sleep
    trickles.append(trickle)
    log = answered(BURST)
    assert served_by(log) == {x: BURST}
    assert {e["upstream"] for e in log} == {f"{UPSTREAM}__z__{x}__z__{y}"}
    assert wait_for(lambda: wakes(reps[x]) == before[x] + 1, 10)
    assert wakes(reps[y]) == before[y] and sleep_state(reps[y]) == "asleep"

    # 3. x awake (kept busy by the trickle), y asleep: every request through nginx goes to x; y is neither
    # reached (its engine's finished-request count stands still) nor woken
    a, b = reps[x], reps[y]
    for r in reps.values():
        assert http_json("POST", r.url + "/sim/control", {"wake_seconds": 0.5})[0] == 200
    g.until_asleep(y)
    b_wakes, b_served, a_served = wakes(b), requests_served(b.url), requests_served(a.url)
    assert burst(g.gw.url, 10) == [(200, "")] * 10
    log = answered(10)
    assert served_by(log) == {x: 10}
    assert {e["upstream"] for e in log} == {f"{UPSTREAM}__z__{y}"}  # y taken out of the order, put last
    assert {e["upstream_status"] for e in log} == {"200"}  # one try each
    assert requests_served(b.url) == b_served and wakes(b) == b_wakes and sleep_state(b) == "asleep"
    assert requests_served(a.url) >= a_served + 10

    # 4. x killed, launcher and engine: the watch cannot reach its guard and counts it awake (never hides
    # it), so the next request tries x first, is refused before any byte, and goes on to y, whose guard
    # holds it while its launcher wakes it
    assert set(trickle.stop()) == {200}
    kill_with_engine(a)
    assert wait_for(lambda: guard_state("127.0.0.1", a.port, 0.5) is None, 10)
    assert g.asleep() == [y]
    assert one_request(g.gw.url, False) == (200, "")
    (entry,) = answered(1)
    assert entry["upstream_status"] == "502 : 200", entry
    assert entry["upstream_addr"] == f"127.0.0.1:{a.port} : 127.0.0.1:{b.port}", entry
    # the launcher writes its state once the engine answered the wake, maybe after the answer above
    assert wait_for(lambda: wakes(b) == b_wakes + 1 and sleep_state(b) == "awake", 10), b.state()
    assert requests_served(b.url) == b_served + 1
