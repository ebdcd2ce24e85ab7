"""vllm_fleet.host.sleep_guard: the engine middleware that gates vLLM's development paths behind the admin token,
keeps the sleep state, counts requests in flight and holds requests while the engine is not awake — driven
with a fake engine (an ASGI app) in one asyncio loop, no sockets (tests/integration/test_sleep_guard_sim.py:
the same core in front of the sim engine, over HTTP)."""

from __future__ import annotations

import asyncio
import importlib
import itertools
import json
import signal
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import pytest

from vllm_fleet import contracts
from vllm_fleet.host import sleep_guard
from vllm_fleet.host.sleep_guard import SleepCore, SleepGuard

TOKEN = "s3cret"
ADMIN = {contracts.ADMIN_TOKEN_HEADER: TOKEN}
PID = 4242
SSE = [(b"content-type", b"text/event-stream; charset=utf-8")]
CHUNK = b'data: {"choices":[{"text":"x"}]}\n\n'
DONE = b"data: [DONE]\n\n"


class Engine:
    """The engine's API server as the guard sees it: records each request it gets; ``/stream`` answers one
    event, waits for ``gates['/stream']`` (when set), then [DONE]; others a JSON echo with ``status[path]``
    (200), after ``gates[path]``; ``tail`` keeps the app running after its last body message; ``fail`` paths
    raise."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, str, bytes]] = []
        self.status: dict[str, int] = {}
        self.gates: dict[str, asyncio.Event] = {}
        self.tail: asyncio.Event | None = None
        self.fail: set[str] = set()

    def paths(self) -> list[str]:
        return [p for _, p, _, _ in self.seen]

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            self.seen.append((scope["type"], "", "", b""))
            return
        body = b""
        while True:
            m = await receive()
            if m["type"] != "http.request":
                break
            body += m.get("body", b"")
            if not m.get("more_body", False):
                break
        path = scope["path"]
        self.seen.append((scope["method"], path, scope["query_string"].decode(), body))
        if path in self.fail:
            raise RuntimeError("engine failed")
        gate = self.gates.get(path)
        if path == "/stream":
            await send({"type": "http.response.start", "status": 200, "headers": SSE})
            await send({"type": "http.response.body", "body": CHUNK, "more_body": True})
            if gate is not None:
                await gate.wait()
            await send({"type": "http.response.body", "body": DONE, "more_body": False})
        else:
            if gate is not None:
                await gate.wait()
            payload = json.dumps({"path": path, "body": body.decode()}).encode()
            headers = [(b"content-type", b"application/json")]
            await send(
                {"type": "http.response.start", "status": self.status.get(path, 200), "headers": headers}
            )
            await send({"type": "http.response.body", "body": payload, "more_body": False})
        if self.tail is not None:
            await self.tail.wait()


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes
    messages: list[dict[str, Any]] = field(default_factory=list)

    def json(self) -> Any:
        return json.loads(self.body)


async def call(
    guard: SleepGuard,
    method: str,
    path: str,
    headers: dict[str, str] | None = None,
    body: bytes = b"",
    query: str = "",
    gone: asyncio.Event | None = None,
) -> Reply:
    """One request through the guard; ``gone`` set: the client disconnects."""
    sent: list[dict[str, Any]] = []
    first = True

    async def receive() -> dict[str, Any]:
        nonlocal first
        if first:
            first = False
            return {"type": "http.request", "body": body, "more_body": False}
        await (gone or asyncio.Event()).wait()
        return {"type": "http.disconnect"}

    async def send(m: dict[str, Any]) -> None:
        sent.append(m)

    scope = {
        "type": "http",
        "method": method,
        "path": path,
        "query_string": query.encode(),
        "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()],
    }
    await guard(scope, receive, send)
    if not sent:
        return Reply(0, {}, b"", sent)
    start = sent[0]
    return Reply(
        start["status"],
        {k.decode(): v.decode() for k, v in start["headers"]},
        b"".join(m.get("body", b"") for m in sent[1:]),
        sent,
    )


Kills = list[tuple[float, int, int]]


def make(
    token: str = TOKEN, pid: int | None = PID, wake_wait: float = 5.0, interval: float = 1.0
) -> tuple[SleepGuard, Engine, Kills]:
    engine = Engine()
    kills: Kills = []

    def kill(p: int, sig: int) -> None:
        kills.append((asyncio.get_running_loop().time(), p, sig))

    core = SleepCore(token, pid, wake_wait, signal_interval=interval, kill=kill)
    return SleepGuard(engine, core), engine, kills


def run(fn: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(asyncio.wait_for(fn(), 20))


async def until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    """Wait on state (the loop turns until ``cond`` holds)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        assert loop.time() < end, "condition not reached"
        await asyncio.sleep(0.001)


async def put_to_sleep(guard: SleepGuard) -> None:
    r = await call(guard, "POST", "/sleep", ADMIN, query="level=1")
    assert r.status == 200 and guard.core.state == "asleep"


def task(coro: Awaitable[Reply]) -> asyncio.Task[Reply]:
    return asyncio.ensure_future(coro)


# ------------------------------------------------------------------------------------------ token gating


@pytest.mark.parametrize(
    "path", [*contracts.DEV_MODE_PATHS, "/sleep/x", "/collective_rpc/", "/vllm-fleet", "/vllm-fleet/other"]
)
def test_admin_paths_are_a_json_404_without_the_token(path: str) -> None:
    async def body() -> None:
        guard, engine, _ = make()
        for method in ("GET", "POST"):
            for headers in ({}, {contracts.ADMIN_TOKEN_HEADER: "wrong"}, {contracts.ADMIN_TOKEN_HEADER: ""}):
                r = await call(guard, method, path, headers)
                assert (r.status, r.body) == (404, b'{"detail":"Not Found"}'), (method, headers)
                assert r.headers["content-type"] == "application/json"
                assert int(r.headers["content-length"]) == len(r.body)
        assert engine.seen == []

    run(body)


def test_wake_failed_without_the_token_is_a_404_and_changes_nothing() -> None:
    async def body() -> None:
        guard, engine, _ = make()
        r = await call(guard, "POST", contracts.WAKE_FAILED_PATH, {}, b'{"reason": "x"}')
        assert r.status == 404 and r.json() == {"detail": "Not Found"}
        assert guard.core._failures == 0 and engine.seen == []

    run(body)


def test_no_token_in_the_environment_means_no_header_matches() -> None:
    async def body() -> None:
        guard, engine, _ = make(token="")
        for headers in ({}, {contracts.ADMIN_TOKEN_HEADER: ""}, ADMIN):
            assert (await call(guard, "GET", "/is_sleeping", headers)).status == 404
        assert engine.seen == []

    run(body)


def test_with_the_token_dev_paths_are_forwarded_uncounted() -> None:
    async def body() -> None:
        guard, engine, _ = make()
        before = guard.core.last_request_at
        engine.gates["/collective_rpc"] = gate = asyncio.Event()
        pending = task(call(guard, "POST", "/collective_rpc", ADMIN, b'{"method":"reload_weights"}'))
        await until(lambda: engine.paths() == ["/collective_rpc"])
        assert guard.core.inflight == 0  # administration is not traffic: it never blocks a sleep
        gate.set()
        r = await pending
        assert r.status == 200 and r.json() == {
            "path": "/collective_rpc",
            "body": '{"method":"reload_weights"}',
        }
        r = await call(guard, "GET", "/is_sleeping", ADMIN)
        assert r.status == 200 and engine.paths()[-1] == "/is_sleeping"
        assert guard.core.last_request_at == before and guard.core.inflight == 0  # not traffic

    run(body)


def test_the_guards_own_namespace_with_the_token() -> None:
    async def body() -> None:
        guard, engine, _ = make()
        assert (await call(guard, "GET", contracts.WAKE_FAILED_PATH, ADMIN)).json() == {
            "detail": "Method Not Allowed"
        }
        assert (await call(guard, "POST", contracts.SLEEP_STATE_PATH, ADMIN)).status == 405
        assert (await call(guard, "GET", "/vllm-fleet/nothing", ADMIN)).status == 404
        assert engine.seen == []

    run(body)


def test_the_sleep_state_is_public_and_read_only() -> None:
    async def body() -> None:
        guard, engine, _ = make()
        start = guard.core.last_request_at
        r = await call(guard, "GET", contracts.SLEEP_STATE_PATH)
        assert r.status == 200 and r.headers["content-type"] == "application/json"
        assert r.json() == {
            "state": "awake",
            "inflight": 0,
            "held": 0,
            "last_request_at": start,
            "asleep_since": None,
        }
        assert (await call(guard, "POST", contracts.SLEEP_STATE_PATH)).status == 404  # without the token
        assert (await call(guard, "HEAD", contracts.SLEEP_STATE_PATH)).status == 404
        await put_to_sleep(guard)
        state = (await call(guard, "GET", contracts.SLEEP_STATE_PATH)).json()
        assert state["state"] == "asleep" and state["asleep_since"] >= start
        assert engine.paths() == ["/sleep"]

    run(body)


# ------------------------------------------------------------------------------------------ sleep and wake


def test_sleep_is_refused_while_a_stream_runs_then_taken_when_idle() -> None:
    async def body() -> None:
        guard, engine, _ = make()
        engine.gates["/stream"] = gate = asyncio.Event()
        stream = task(call(guard, "POST", "/stream", body=b"{}"))
        await until(lambda: guard.core.inflight == 1)
        r = await call(guard, "POST", "/sleep", ADMIN, query="level=1")
        assert r.status == 409 and r.json() == {
            "error": {
                "message": "busy: 1 request(s) in flight",
                "type": "Conflict",
                "param": None,
                "code": 409,
            }
        }
        assert guard.core.state == "awake" and engine.paths() == ["/stream"]
        gate.set()
        assert (await stream).body == CHUNK + DONE
        assert guard.core.inflight == 0
        engine.gates["/sleep"] = slept = asyncio.Event()
        sleeping = task(call(guard, "POST", "/sleep", ADMIN, query="level=2"))
        await until(lambda: guard.core.state == "sleeping")
        assert guard.core.asleep_since is None
        slept.set()
        assert (await sleeping).status == 200
        assert guard.core.state == "asleep" and guard.core.asleep_since is not None
        assert engine.seen[-1][1:3] == ("/sleep", "level=2")

    run(body)


def test_sleep_when_asleep_is_an_idempotent_200_not_forwarded() -> None:
    async def body() -> None:
        guard, engine, _ = make()
        await put_to_sleep(guard)
        since = guard.core.asleep_since
        r = await call(guard, "POST", "/sleep", ADMIN)
        assert (r.status, r.body) == (200, b"") and engine.paths() == ["/sleep"]
        assert guard.core.asleep_since == since

    run(body)


def test_a_failed_sleep_leaves_it_awake() -> None:
    async def body() -> None:
        guard, engine, _ = make()
        engine.status["/sleep"] = 500
        assert (await call(guard, "POST", "/sleep", ADMIN)).status == 500
        assert guard.core.state == "awake"
        engine.status.clear()
        engine.fail.add("/sleep")
        with pytest.raises(RuntimeError):
            await call(guard, "POST", "/sleep", ADMIN)
        assert guard.core.state == "awake"

    run(body)


def test_sleep_is_refused_while_a_request_is_held_and_during_a_wake() -> None:
    async def body() -> None:
        guard, engine, _ = make()
        await put_to_sleep(guard)
        held = task(call(guard, "POST", "/v1/completions", body=b"{}"))
        await until(lambda: guard.core.held == 1)
        r = await call(guard, "POST", "/sleep", ADMIN)
        assert r.status == 409 and r.json()["error"]["message"] == "busy: 1 request(s) in flight"
        engine.gates["/wake_up"] = woken = asyncio.Event()
        waking = task(call(guard, "POST", "/wake_up", ADMIN))
        await until(lambda: guard.core.state == "waking")
        held.cancel()
        await until(lambda: guard.core.held == 0)
        r = await call(guard, "POST", "/sleep", ADMIN)
        assert r.status == 409 and r.json()["error"]["message"] == "busy: the engine is waking"
        woken.set()
        assert (await waking).status == 200 and guard.core.state == "awake"

    run(body)


def test_wake_up_releases_held_requests() -> None:
    async def body() -> None:
        guard, engine, _ = make()
        await put_to_sleep(guard)
        held = task(call(guard, "POST", "/v1/completions", body=b'{"prompt":"hi"}'))
        await until(lambda: guard.core.held == 1)
        assert engine.paths() == ["/sleep"]  # not forwarded while asleep
        r = await call(guard, "POST", "/wake_up", ADMIN)
        assert r.status == 200 and guard.core.state == "awake" and guard.core.asleep_since is None
        reply = await held
        assert reply.status == 200 and reply.json() == {"path": "/v1/completions", "body": '{"prompt":"hi"}'}
        assert engine.paths() == ["/sleep", "/wake_up", "/v1/completions"]
        assert (guard.core.held, guard.core.inflight) == (0, 0)

    run(body)


def test_a_level_2_wake_is_awake_only_after_kv_cache() -> None:
    async def body() -> None:
        guard, engine, _ = make()
        await put_to_sleep(guard)
        held = task(call(guard, "POST", "/v1/chat/completions", body=b"{}"))
        await until(lambda: guard.core.held == 1)
        assert (await call(guard, "POST", "/wake_up", ADMIN, query="tags=weights")).status == 200
        assert guard.core.state == "waking" and not held.done()
        rpc = await call(guard, "POST", "/collective_rpc", ADMIN, b'{"method":"reload_weights"}')
        assert rpc.status == 200 and guard.core.state == "waking" and not held.done()
        assert (await call(guard, "POST", "/wake_up", ADMIN, query="tags=kv_cache")).status == 200
        assert guard.core.state == "awake"
        assert (await held).status == 200
        assert [q for _, p, q, _ in engine.seen if p == "/wake_up"] == ["tags=weights", "tags=kv_cache"]

    run(body)


@pytest.mark.parametrize(
    ("query", "awake"),
    [
        ("", True),
        ("tags=weights", False),
        ("tags=weights&tags=kv_cache", True),
        ("tags=weights,kv_cache", True),
    ],
)
def test_wake_tags(query: str, awake: bool) -> None:
    async def body() -> None:
        guard, _, _ = make()
        await put_to_sleep(guard)
        await call(guard, "POST", "/wake_up", ADMIN, query=query)
        assert guard.core.state == ("awake" if awake else "waking")

    run(body)


def test_a_failed_wake_leaves_it_asleep_and_the_held_request_asks_again() -> None:
    async def body() -> None:
        guard, engine, kills = make(interval=0.05)
        await put_to_sleep(guard)
        held = task(call(guard, "POST", "/v1/completions", body=b"{}"))
        await until(lambda: len(kills) == 1)
        engine.status["/wake_up"] = 500
        assert (await call(guard, "POST", "/wake_up", ADMIN)).status == 500
        assert guard.core.state == "asleep" and not held.done()
        await until(lambda: len(kills) == 2)  # asleep again: the held request asks for another wake
        engine.status.clear()
        assert (await call(guard, "POST", "/wake_up", ADMIN)).status == 200
        assert (await held).status == 200

    run(body)


def test_wake_up_while_sleeping_is_refused_and_while_awake_is_forwarded() -> None:
    async def body() -> None:
        guard, engine, _ = make()
        assert (await call(guard, "POST", "/wake_up", ADMIN)).status == 200
        assert guard.core.state == "awake" and engine.paths() == ["/wake_up"]
        engine.gates["/sleep"] = slept = asyncio.Event()
        sleeping = task(call(guard, "POST", "/sleep", ADMIN))
        await until(lambda: guard.core.state == "sleeping")
        r = await call(guard, "POST", "/wake_up", ADMIN)
        assert r.status == 409 and r.json()["error"]["message"] == "busy: the engine is sleeping"
        slept.set()
        await sleeping
        assert engine.paths() == ["/wake_up", "/sleep"]

    run(body)


# ------------------------------------------------------------------------------------------ in flight


def test_inflight_ends_with_the_last_body_message_not_the_app() -> None:
    async def body() -> None:
        guard, engine, _ = make()
        engine.tail = tail = asyncio.Event()
        engine.gates["/stream"] = gate = asyncio.Event()
        before = guard.core.last_request_at
        stream = task(call(guard, "POST", "/stream", body=b"{}"))
        await until(lambda: guard.core.inflight == 1)
        assert guard.core.snapshot()["inflight"] == 1
        gate.set()
        await until(lambda: guard.core.inflight == 0)
        assert not stream.done()  # the app still runs (a background task): the response has ended
        assert guard.core.last_request_at > before
        tail.set()
        assert (await stream).status == 200

    run(body)


def test_inflight_ends_when_the_app_raises() -> None:
    async def body() -> None:
        guard, engine, _ = make()
        engine.fail.add("/v1/completions")
        with pytest.raises(RuntimeError):
            await call(guard, "POST", "/v1/completions", body=b"{}")
        assert guard.core.inflight == 0

    run(body)


def test_probes_count_in_flight_but_do_not_keep_it_awake() -> None:
    async def body() -> None:
        guard, engine, _ = make()
        before = guard.core.last_request_at
        engine.gates["/v1/completions"] = gate = asyncio.Event()
        probe = task(call(guard, "POST", "/v1/completions", {"User-Agent": sleep_guard.PROBE_USER_AGENT}))
        await until(lambda: guard.core.inflight == 1)
        assert (await call(guard, "POST", "/sleep", ADMIN)).status == 409
        gate.set()
        await probe
        assert guard.core.inflight == 0 and guard.core.last_request_at == before
        await call(guard, "POST", "/v1/completions", {"User-Agent": "curl/8"})
        assert guard.core.last_request_at > before

    run(body)


def test_a_probe_that_finds_the_engine_asleep_is_refused_at_once_and_wakes_nothing() -> None:
    """The launcher's liveness check may start just before the engine goes to sleep: its decode must not be held,
    nor wake the engine it just put to sleep."""

    async def body() -> None:
        guard, _engine, kills = make()
        await put_to_sleep(guard)
        got = await call(
            guard, "POST", "/v1/completions", {"User-Agent": sleep_guard.PROBE_USER_AGENT}, b"{}"
        )
        assert got.status == 503 and json.loads(got.body)["error"]["message"] == "the engine is asleep"
        assert kills == [] and guard.core.held == 0 and guard.core.state == "asleep"

    run(body)


@pytest.mark.parametrize("path", sorted(sleep_guard.EXEMPT_PATHS))
def test_exempt_paths_are_never_held_nor_counted(path: str) -> None:
    async def body() -> None:
        guard, engine, kills = make()
        await put_to_sleep(guard)
        before = guard.core.last_request_at
        engine.gates[path] = gate = asyncio.Event()
        for method in ("GET", "HEAD"):
            pending = task(call(guard, method, path))
            await until(lambda: len(engine.seen) == 2)
            assert (guard.core.inflight, guard.core.held) == (0, 0)
            gate.set()
            assert (await pending).status == 200
            gate.clear()
            engine.seen.pop()
        assert kills == [] and guard.core.last_request_at == before and guard.core.state == "asleep"

    run(body)


def test_other_methods_on_exempt_paths_are_requests() -> None:
    async def body() -> None:
        guard, _, _ = make()
        await put_to_sleep(guard)
        pending = task(call(guard, "POST", "/ping"))
        await until(lambda: guard.core.held == 1)
        pending.cancel()

    run(body)


# ------------------------------------------------------------------------------------------ holding


def test_a_held_request_signals_the_launcher_at_once_then_once_per_interval() -> None:
    async def body() -> None:
        guard, _, kills = make(interval=0.1)
        await put_to_sleep(guard)
        held = [task(call(guard, "POST", "/v1/completions", body=b"{}")) for _ in range(3)]
        await until(lambda: guard.core.held == 3)
        assert [(p, s) for _, p, s in kills] == [(PID, signal.SIGUSR1)]  # three requests, one signal
        await until(lambda: len(kills) == 3)
        gaps = [b[0] - a[0] for a, b in itertools.pairwise(kills)]
        assert all(g >= 0.1 - 1e-3 for g in gaps), gaps
        assert guard.core.signals == 3
        await call(guard, "POST", "/wake_up", ADMIN)
        assert [r.status for r in await asyncio.gather(*held)] == [200, 200, 200]
        n = len(kills)
        await asyncio.sleep(0.25)
        assert len(kills) == n  # nothing held: no more signals

    run(body)


def test_a_request_held_during_sleeping_signals_when_asleep_is_reached() -> None:
    async def body() -> None:
        guard, engine, kills = make()
        engine.gates["/sleep"] = slept = asyncio.Event()
        sleeping = task(call(guard, "POST", "/sleep", ADMIN))
        await until(lambda: guard.core.state == "sleeping")
        held = task(call(guard, "POST", "/v1/completions", body=b"{}"))
        await until(lambda: guard.core.held == 1)
        await asyncio.sleep(0.05)
        assert kills == []  # sleeping: no wake is asked for yet
        slept.set()
        await sleeping
        await until(lambda: len(kills) == 1)
        assert kills[0][1:] == (PID, signal.SIGUSR1)
        await call(guard, "POST", "/wake_up", ADMIN)
        assert (await held).status == 200

    run(body)


def test_each_new_sleep_signals_its_first_held_request_at_once() -> None:
    """The interval limits the signals of one sleep; a wake and a new sleep within it do not delay the next."""

    async def body() -> None:
        guard, _, kills = make(interval=60)
        for round_ in (1, 2):
            await put_to_sleep(guard)
            held = task(call(guard, "POST", "/v1/completions", body=b"{}"))
            await until(lambda: len(kills) == round_)  # noqa: B023
            await call(guard, "POST", "/wake_up", ADMIN)
            assert (await held).status == 200

    run(body)


def test_a_request_held_during_a_failed_sleep_goes_through() -> None:
    async def body() -> None:
        guard, engine, kills = make()
        engine.gates["/sleep"] = slept = asyncio.Event()
        engine.status["/sleep"] = 500
        sleeping = task(call(guard, "POST", "/sleep", ADMIN))
        await until(lambda: guard.core.state == "sleeping")
        held = task(call(guard, "POST", "/v1/completions", body=b"{}"))
        await until(lambda: guard.core.held == 1)
        slept.set()
        assert (await sleeping).status == 500
        assert (await held).status == 200 and kills == []

    run(body)


def test_a_held_request_times_out_with_a_503_openai_shape() -> None:
    async def body() -> None:
        guard, engine, kills = make(pid=None, wake_wait=0.2)
        await put_to_sleep(guard)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        r = await call(guard, "POST", "/v1/chat/completions", body=b"{}")
        assert loop.time() - t0 >= 0.2
        assert r.status == 503 and r.headers["retry-after"] == str(contracts.WAKE_RETRY_AFTER_SECONDS) == "5"
        assert r.headers["content-type"] == "application/json"
        assert r.json() == {
            "error": {
                "message": "the model is asleep and was not woken within 0.2 s; retry later",
                "type": "Service Unavailable",
                "param": None,
                "code": 503,
            }
        }
        assert kills == [] and guard.core.held == 0 and engine.paths() == ["/sleep"]

    run(body)


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_a_held_anthropic_request_times_out_in_anthropics_shape(path: str) -> None:
    async def body() -> None:
        guard, _, _ = make(pid=None, wake_wait=0.05)
        await put_to_sleep(guard)
        r = await call(guard, "POST", path, body=b"{}")
        assert r.status == 503 and r.headers["retry-after"] == "5"
        assert r.json() == {
            "type": "error",
            "error": {
                "type": "overloaded_error",
                "message": "the model is asleep and was not woken within 0.05 s; retry later",
            },
        }

    run(body)


def test_wake_failed_answers_held_requests_at_once_then_new_ones_for_retry_after() -> None:
    async def body() -> None:
        guard, engine, kills = make(wake_wait=30)
        await put_to_sleep(guard)
        held = [task(call(guard, "POST", p, body=b"{}")) for p in ("/v1/completions", "/v1/messages")]
        await until(lambda: guard.core.held == 2)
        engine.gates["/wake_up"] = asyncio.Event()  # the wake hangs: the launcher gives up on it
        waking = task(call(guard, "POST", "/wake_up", ADMIN))
        await until(lambda: guard.core.state == "waking")
        failed = b'{"reason": "no swap slot within 30 s", "retry_after": 2}'
        r = await call(guard, "POST", contracts.WAKE_FAILED_PATH, ADMIN, failed)
        assert r.status == 200 and r.json() == {"answered": 2}
        assert guard.core.state == "asleep"
        openai, anthropic = await asyncio.gather(*held)
        message = "the model could not be woken: no swap slot within 30 s; retry later"
        assert openai.status == 503 and openai.headers["retry-after"] == "2"
        assert openai.json()["error"] == {
            "message": message,
            "type": "Service Unavailable",
            "param": None,
            "code": 503,
        }
        assert anthropic.status == 503 and anthropic.json()["error"] == {
            "type": "overloaded_error",
            "message": message,
        }
        signals = len(kills)
        r = await call(guard, "POST", "/v1/completions", body=b"{}")  # within retry_after: at once, no signal
        assert (
            r.status == 503
            and r.headers["retry-after"] in ("1", "2")
            and r.json()["error"]["message"] == message
        )
        assert len(kills) == signals and guard.core.held == 0
        assert "/v1/completions" not in engine.paths()
        waking.cancel()

    run(body)


def test_after_the_retry_window_a_request_is_held_and_signals_again() -> None:
    async def body() -> None:
        guard, _, kills = make(interval=0.01)
        await put_to_sleep(guard)
        r = await call(guard, "POST", contracts.WAKE_FAILED_PATH, ADMIN, b'{"retry_after": 0}')
        assert r.json() == {"answered": 0}
        held = task(call(guard, "POST", "/v1/completions", body=b"{}"))
        await until(lambda: guard.core.held == 1 and len(kills) == 1)
        await call(guard, "POST", "/wake_up", ADMIN)
        assert (await held).status == 200

    run(body)


def test_a_wake_ends_a_failed_wakes_refusal_window() -> None:
    """A failed wake, then a wake that succeeds (the next signal's) and a sleep again within retry_after (a swap
    group peer asked it to yield): the next request is held and signals, not refused for the old failure."""

    async def body() -> None:
        guard, _, kills = make(interval=0.01)
        await put_to_sleep(guard)
        r = await call(guard, "POST", contracts.WAKE_FAILED_PATH, ADMIN, b'{"retry_after": 60}')
        assert r.status == 200
        assert (await call(guard, "POST", "/wake_up", ADMIN)).status == 200
        await put_to_sleep(guard)
        signals = len(kills)
        held = task(call(guard, "POST", "/v1/completions", body=b"{}"))
        await until(lambda: guard.core.held == 1 and len(kills) > signals)
        await call(guard, "POST", "/wake_up", ADMIN)
        assert (await held).status == 200

    run(body)


@pytest.mark.parametrize(
    "payload",
    [b"not json", b"[1]", b'{"retry_after": -1}', b'{"retry_after": "5"}', b'{"retry_after": true}'],
)
def test_wake_failed_rejects_a_bad_report(payload: bytes) -> None:
    async def body() -> None:
        guard, _, _ = make()
        await put_to_sleep(guard)
        r = await call(guard, "POST", contracts.WAKE_FAILED_PATH, ADMIN, payload)
        assert r.status == 400 and r.json()["error"]["code"] == 400
        assert guard.core._failures == 0

    run(body)


def test_wake_failed_default_retry_after_and_when_awake() -> None:
    async def body() -> None:
        guard, _, _ = make()
        r = await call(guard, "POST", contracts.WAKE_FAILED_PATH, ADMIN, b"{}")
        assert r.json() == {"answered": 0} and guard.core.state == "awake"
        assert (await call(guard, "POST", "/v1/completions", body=b"{}")).status == 200  # awake: served
        await put_to_sleep(guard)
        await call(guard, "POST", contracts.WAKE_FAILED_PATH, ADMIN, b"")
        r = await call(guard, "POST", "/v1/completions", body=b"{}")
        assert r.status == 503 and r.headers["retry-after"] == str(contracts.WAKE_RETRY_AFTER_SECONDS)
        assert "the wake failed" in r.json()["error"]["message"]

    run(body)


def test_a_held_client_that_disconnects_is_dropped_from_the_count() -> None:
    async def body() -> None:
        guard, engine, _ = make()
        await put_to_sleep(guard)
        gone = asyncio.Event()
        held = task(call(guard, "POST", "/v1/completions", body=b"{}", gone=gone))
        await until(lambda: guard.core.held == 1)
        gone.set()
        r = await held
        assert r.messages == [] and guard.core.held == 0  # nothing sent to a gone client
        await call(guard, "POST", "/wake_up", ADMIN)
        assert engine.paths() == ["/sleep", "/wake_up"] and guard.core.inflight == 0

    run(body)


def test_a_cancelled_held_request_is_dropped_from_the_count() -> None:
    async def body() -> None:
        guard, _, _ = make()
        await put_to_sleep(guard)
        held = task(call(guard, "POST", "/v1/completions", body=b"{}"))
        await until(lambda: guard.core.held == 1)
        held.cancel()
        await until(lambda: guard.core.held == 0)
        assert (await call(guard, "POST", "/sleep", ADMIN)).status == 200  # not busy

    run(body)


def test_the_body_read_while_held_reaches_the_engine() -> None:
    """While held the guard listens for a disconnect, which reads the request's body: the app gets it."""

    async def body() -> None:
        guard, engine, _ = make()
        await put_to_sleep(guard)
        held = task(call(guard, "POST", "/v1/completions", body=b'{"prompt":"kept"}'))
        await until(lambda: guard.core.held == 1)
        await asyncio.sleep(0.01)
        await call(guard, "POST", "/wake_up", ADMIN)
        assert (await held).json()["body"] == '{"prompt":"kept"}'
        assert engine.seen[-1][3] == b'{"prompt":"kept"}'

    run(body)


# ------------------------------------------------------------------------------------------ construction


def test_from_env_reads_token_pid_and_wait() -> None:
    env = {
        contracts.ADMIN_TOKEN_ENV: "tok",
        contracts.LAUNCHER_PID_ENV: "1234",
        contracts.WAKE_WAIT_ENV: "2.5",
    }
    core = SleepCore.from_env(env)
    assert (core.launcher_pid, core.wake_wait, core.retry_after) == (
        1234,
        2.5,
        contracts.WAKE_RETRY_AFTER_SECONDS,
    )
    assert core.authorized({"x-vf-admin-token": "tok"}) and not core.authorized({"x-vf-admin-token": "to"})
    bare = SleepCore.from_env({})
    assert (bare.launcher_pid, bare.wake_wait) == (None, contracts.WAKE_WAIT_SECONDS)
    assert not bare.authorized({"x-vf-admin-token": ""})
    for pid in ("0", "-1", "1", "x", ""):
        assert SleepCore.from_env({contracts.LAUNCHER_PID_ENV: pid}).launcher_pid is None, pid
    for wait in ("0", "-3", "nan", "inf", "soon"):
        assert SleepCore.from_env({contracts.WAKE_WAIT_ENV: wait}).wake_wait == contracts.WAKE_WAIT_SECONDS


def test_the_guard_reads_the_environment_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(contracts.ADMIN_TOKEN_ENV, TOKEN)
    monkeypatch.setenv(contracts.LAUNCHER_PID_ENV, "777")
    monkeypatch.setenv(contracts.WAKE_WAIT_ENV, "9")
    guard = SleepGuard(Engine())
    monkeypatch.setenv(contracts.ADMIN_TOKEN_ENV, "other")
    monkeypatch.delenv(contracts.LAUNCHER_PID_ENV)
    assert (guard.core.launcher_pid, guard.core.wake_wait) == (777, 9.0)
    assert guard.core.authorized({"x-vf-admin-token": TOKEN})


def test_non_http_scopes_pass() -> None:
    async def body() -> None:
        guard, engine, _ = make()
        await put_to_sleep(guard)

        async def receive() -> dict[str, Any]:
            return {"type": "lifespan.startup"}

        async def send(m: Any) -> None:
            pass

        await guard({"type": "lifespan"}, receive, send)
        assert engine.seen[-1][0] == "lifespan"

    run(body)


def test_the_contract_names_it_and_starlette_loads_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--middleware`` names ``contracts.SLEEP_GUARD``; vLLM adds it with ``app.add_middleware(cls)``."""
    module, _, name = contracts.SLEEP_GUARD.rpartition(".")
    assert getattr(importlib.import_module(module), name) is SleepGuard
    applications = pytest.importorskip("starlette.applications")
    responses = pytest.importorskip("starlette.responses")
    routing = pytest.importorskip("starlette.routing")

    async def completions(request: Any) -> Any:
        async def gen() -> Any:
            yield CHUNK
            yield DONE

        return responses.StreamingResponse(gen(), media_type="text/event-stream")

    async def sleep(request: Any) -> Any:
        return responses.Response(status_code=200)

    monkeypatch.setenv(contracts.ADMIN_TOKEN_ENV, TOKEN)
    monkeypatch.delenv(contracts.LAUNCHER_PID_ENV, raising=False)
    monkeypatch.setenv(contracts.WAKE_WAIT_ENV, "0.1")
    app = applications.Starlette(
        routes=[
            routing.Route("/v1/completions", completions, methods=["POST"]),
            routing.Route("/sleep", sleep, methods=["POST"]),
        ]
    )
    app.add_middleware(SleepGuard)

    async def body() -> None:
        guard: Any = app  # Starlette's app is an ASGI callable like the guard
        assert (await call(guard, "POST", "/sleep")).status == 404
        r = await call(guard, "POST", "/v1/completions", body=b"{}")
        assert r.status == 200 and r.body == CHUNK + DONE
        assert (await call(guard, "POST", "/sleep", ADMIN)).status == 200
        r = await call(guard, "POST", "/v1/completions", body=b"{}")
        assert r.status == 503 and r.headers["retry-after"] == "5"

    run(body)
