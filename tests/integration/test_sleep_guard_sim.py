"""The sleep guard in front of the sim engine over HTTP, as a sleeping model's engine runs it (``--enable-sleep-mode``,
``VLLM_SERVER_DEV_MODE=1``, ``--middleware SLEEP_GUARD``, the admin token in its environment): this test process
plays the launcher (its pid is the engine's ``LAUNCHER_PID_ENV``; its SIGUSR1 handler wakes the engine from a
thread, or reports the wake failed). Development paths are hidden without the token; /sleep is refused while a
stream runs; a request sent while asleep is held, the signal comes, the wake happens, and the answer is a
normal 200 (a stream complete to [DONE]); a failed wake, no wake, or a reported failure gives a 503 JSON with
Retry-After; a held request whose client closed the connection is let go at once, never run. Seconds, no vLLM
(tests/unit/test_sleep_guard.py has the guard's rules one by one)."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from vllm_fleet import contracts
from vllm_fleet.devtools.gateway_testing import wait_for
from vllm_fleet.devtools.testing import SimEngineProcess, http_json, requests_served

TOKEN = "test-admin-token"
ADMIN = {contracts.ADMIN_TOKEN_HEADER: TOKEN}
WAIT = 3.0  # the guard's wake wait (WAKE_WAIT_ENV): the held requests' bound in these tests


class Launcher:
    """What the launcher does on the guard's SIGUSR1, from a thread (the handler only starts it): after ``go``
    is set, ``mode`` "wake" POSTs /wake_up, "wake2" a level-2 wake (tags=weights, reload_weights,
    tags=kv_cache), "report" a failed /wake_up then /vllm-fleet/wake-failed; "ignore" does nothing. One
    action at a time; ``sent`` is set just before its first request, ``done`` when it has finished;
    ``answers`` has what the engine answered."""

    def __init__(self) -> None:
        self.url = ""
        self.mode = "wake"
        self.signals = 0
        self.signalled = threading.Event()
        self.go = threading.Event()
        self.sent = threading.Event()  # the first request of an action is on its way
        self.done = threading.Event()
        self.answers: list[tuple[str, int, Any]] = []
        self._acting = threading.Lock()

    def reset(self, mode: str = "wake", go: bool = True) -> None:
        self.mode, self.signals, self.answers = mode, 0, []
        self.signalled.clear()
        self.sent.clear()
        self.done.clear()
        (self.go.set if go else self.go.clear)()

    def on_signal(self, signum: int, frame: Any) -> None:
        self.signals += 1
        self.signalled.set()
        if self.mode != "ignore" and self._acting.acquire(blocking=False):
            threading.Thread(target=self._act, daemon=True).start()

    def _post(self, path: str, body: dict[str, Any] | None = None) -> int:
        self.sent.set()
        status, answer = http_json("POST", self.url + path, body, timeout=10, headers=ADMIN)
        self.answers.append((path, status, answer))
        return status

    def _act(self) -> None:
        try:
            self.go.wait(10)
            if self.mode == "wake":
                self._post("/wake_up")
            elif self.mode == "wake2":
                self._post("/wake_up?tags=weights")
                self._post("/collective_rpc", {"method": "reload_weights"})
                self._post("/wake_up?tags=kv_cache")
            elif self.mode == "report" and self._post("/wake_up") != 200:
                self._post(contracts.WAKE_FAILED_PATH, {"reason": "no swap slot", "retry_after": 7})
        finally:
            self.done.set()
            self._acting.release()


@pytest.fixture(scope="module")
def launcher() -> Iterator[Launcher]:
    """The SIGUSR1 handler, installed before the engine starts and removed only after it has stopped (SIGUSR1's
    default action would end the test run)."""
    launcher = Launcher()
    before = signal.signal(signal.SIGUSR1, launcher.on_signal)
    try:
        yield launcher
    finally:
        signal.signal(signal.SIGUSR1, before)


@pytest.fixture(scope="module")
def engine(launcher: Launcher, sim_engine_factory: Any) -> Iterator[SimEngineProcess]:
    env = {
        contracts.DEV_MODE_ENV: "1",
        contracts.ADMIN_TOKEN_ENV: TOKEN,
        contracts.LAUNCHER_PID_ENV: str(os.getpid()),
        contracts.WAKE_WAIT_ENV: str(WAIT),
    }
    extra = ["--enable-sleep-mode", "--middleware", contracts.SLEEP_GUARD]
    eng: SimEngineProcess = sim_engine_factory(extra=extra, env=env)
    launcher.url = eng.url
    try:
        yield eng
    finally:
        eng.stop()  # before the handler goes


@pytest.fixture(autouse=True)
def awake(engine: SimEngineProcess, launcher: Launcher) -> Iterator[None]:
    """Each test starts and leaves the engine awake and idle, the launcher waking at once."""
    launcher.reset()
    yield
    launcher.reset("ignore")
    assert engine.control(wake_fail=False)[0] == 200
    if state(engine)["state"] != "awake":
        assert post(engine, "/wake_up")[0] == 200
    assert wait_for(lambda: idle(state(engine)), 10)
    launcher.reset()


def state(e: SimEngineProcess) -> dict[str, Any]:
    status, doc = http_json("GET", e.url + contracts.SLEEP_STATE_PATH)
    assert status == 200, doc
    return dict(doc)


def idle(s: dict[str, Any]) -> bool:
    return s["state"] == "awake" and s["inflight"] == 0 and s["held"] == 0


def post(e: SimEngineProcess, path: str, body: Any = None, token: bool = True) -> tuple[int, Any]:
    return http_json("POST", e.url + path, body, timeout=30, headers=ADMIN if token else {})


def completion(stream: bool = False, max_tokens: int = 8) -> dict[str, Any]:
    return {"model": "tiny-qwen3", "prompt": "hello there", "max_tokens": max_tokens, "stream": stream}


class Call(threading.Thread):
    """One request on its own connection, in a thread: status, headers (lower-case), body text; ``woken``:
    whether the launcher had sent its wake when this answer's head arrived (the guard may forward a held
    request only after the engine answered that wake)."""

    def __init__(self, e: SimEngineProcess, path: str, body: dict[str, Any], launcher: Launcher) -> None:
        super().__init__(daemon=True)
        self.e, self.path, self.body, self.launcher = e, path, body, launcher
        self.status = 0
        self.headers: dict[str, str] = {}
        self.text = ""
        self.woken: bool | None = None
        self.start()

    def run(self) -> None:
        c = http.client.HTTPConnection("127.0.0.1", self.e.port, timeout=30)
        try:
            c.request("POST", self.path, json.dumps(self.body), {"Content-Type": "application/json"})
            r = c.getresponse()
            self.woken = self.launcher.sent.is_set()
            self.status, self.headers = r.status, {k.lower(): v for k, v in r.getheaders()}
            self.text = r.read().decode()
        finally:
            c.close()

    def answer(self) -> Call:
        self.join(30)
        assert not self.is_alive(), f"{self.path}: no answer"
        return self

    def json(self) -> Any:
        return json.loads(self.text)


def put_to_sleep(e: SimEngineProcess, level: int = 1) -> None:
    status, body = post(e, f"/sleep?level={level}")
    assert (status, body) == (200, None)
    s = state(e)
    assert s["state"] == "asleep" and s["asleep_since"] is not None
    assert post(e, "/is_sleeping")[0] == 405  # GET only (vLLM's)
    status, body = http_json("GET", e.url + "/is_sleeping", headers=ADMIN)
    assert status == 200 and body["is_sleeping"] is True


# ----------------------------------------------------------------------------------------------- tests


def test_dev_paths_are_hidden_without_the_token(engine: SimEngineProcess) -> None:
    for path in ("/sleep", "/wake_up", "/collective_rpc", "/server_info", contracts.WAKE_FAILED_PATH):
        assert post(engine, path, {}, token=False) == (404, {"detail": "Not Found"}), path
    assert http_json("GET", engine.url + "/is_sleeping") == (404, {"detail": "Not Found"})
    wrong = {contracts.ADMIN_TOKEN_HEADER: "guess"}
    assert http_json("GET", engine.url + "/is_sleeping", headers=wrong) == (404, {"detail": "Not Found"})
    # with the token they reach the engine (its own answers)
    assert http_json("GET", engine.url + "/is_sleeping", headers=ADMIN) == (
        200,
        {"is_sleeping": False, "sim_weights_loaded": True},
    )
    assert post(engine, "/collective_rpc", {"method": "reload_weights"}) == (200, {"results": [None]})
    assert post(engine, "/server_info")[0] == 404  # not modelled by the sim: forwarded, the sim's 404
    assert idle(state(engine))


def test_sleep_is_refused_while_a_stream_runs(engine: SimEngineProcess) -> None:
    c = http.client.HTTPConnection("127.0.0.1", engine.port, timeout=30)
    try:
        c.request(
            "POST", "/v1/completions", json.dumps(completion(True, 400)), {"Content-Type": "application/json"}
        )
        r = c.getresponse()
        assert r.status == 200
        first = r.readline()
        assert first.startswith(b"data: {")  # the stream is running
        assert state(engine)["inflight"] == 1
        status, body = post(engine, "/sleep?level=1")
        assert status == 409 and body["error"]["message"] == "busy: 1 request(s) in flight"
        assert state(engine)["state"] == "awake"
        assert r.read().decode().endswith("data: [DONE]\n\n")
    finally:
        c.close()
    assert wait_for(lambda: idle(state(engine)), 5)
    put_to_sleep(engine)


def test_idle_sleep_then_a_held_completion_wakes_it(engine: SimEngineProcess, launcher: Launcher) -> None:
    before = state(engine)["last_request_at"]
    put_to_sleep(engine)
    # health and metrics answer asleep, and do not wake it
    assert http_json("GET", engine.url + "/health")[0] == 200
    status, text = http_json("GET", engine.url + "/metrics")
    assert status == 200 and 'sleep_state="weights_offloaded"} 1.0' in text
    assert launcher.signals == 0 and state(engine)["state"] == "asleep"

    launcher.reset("wake", go=False)
    call = Call(engine, "/v1/completions", completion(), launcher)
    assert launcher.signalled.wait(10), "no SIGUSR1 for the held request"
    s = state(engine)
    assert (s["state"], s["held"], s["inflight"]) == ("asleep", 1, 0) and call.is_alive()
    launcher.go.set()
    call.answer()
    assert call.status == 200 and call.woken is True  # answered after the wake, not before
    assert call.json()["object"] == "text_completion" and call.json()["usage"]["completion_tokens"] == 8
    assert launcher.answers == [("/wake_up", 200, None)]
    s = state(engine)
    assert idle(s) and s["asleep_since"] is None and s["last_request_at"] > before


def test_a_held_stream_is_complete_after_the_wake(engine: SimEngineProcess, launcher: Launcher) -> None:
    put_to_sleep(engine)
    launcher.reset("wake", go=False)
    chat = {
        "model": "tiny-qwen3",
        "max_tokens": 5,
        "stream": True,
        "messages": [{"role": "user", "content": "hi"}],
    }
    call = Call(engine, "/v1/chat/completions", chat, launcher)
    assert launcher.signalled.wait(10)
    assert state(engine)["held"] == 1
    launcher.go.set()
    call.answer()
    assert call.status == 200 and call.woken is True
    assert call.headers["content-type"].startswith("text/event-stream")
    events = [b for b in call.text.split("\n\n") if b]
    assert events[-1] == "data: [DONE]" and len(events) >= 3
    assert json.loads(events[-2][len("data: ") :])["choices"][0]["finish_reason"] == "length"


def test_a_held_request_whose_client_left_is_let_go_at_once(
    engine: SimEngineProcess, launcher: Launcher
) -> None:
    """The client closes its connection while its request is held (as nginx does when its own client goes away):
    the guard stops holding it at once, well before the wake wait would end it, so its count does not leak (the
    engine may sleep again), and the wake that follows never runs it. (Before the reported failed wake below: for
    its retry_after the guard refuses a request that would be held at once, with no signal.)"""
    put_to_sleep(engine)
    served = requests_served(engine.url)
    launcher.reset("wake", go=False)
    body = json.dumps(completion()).encode()
    head = ["POST /v1/completions HTTP/1.1", "Host: sim", "Content-Type: application/json"]
    head.append(f"Content-Length: {len(body)}")
    with socket.create_connection(("127.0.0.1", engine.port), timeout=10) as sock:
        sock.sendall("\r\n".join(head).encode() + b"\r\n\r\n" + body)
        assert launcher.signalled.wait(10), "no SIGUSR1 for the held request"
        assert state(engine)["held"] == 1
        left = time.monotonic()
    assert wait_for(lambda: state(engine)["held"] == 0, WAIT / 2, 0.02), state(engine)
    assert time.monotonic() - left < WAIT / 2  # let go, not refused when the wait ended
    s = state(engine)
    assert (s["state"], s["inflight"]) == ("asleep", 0)
    launcher.go.set()  # the wake it asked for goes ahead: the engine wakes with nothing to run
    assert launcher.done.wait(10) and launcher.answers == [("/wake_up", 200, None)]
    assert wait_for(lambda: idle(state(engine)), 5), state(engine)
    assert requests_served(engine.url) == served
    assert engine.control()[1]["running"] == engine.control()[1]["waiting"] == 0
    put_to_sleep(engine)  # nothing held nor in flight: the sleep is not refused


def test_a_level_2_wake_reloads_the_weights(engine: SimEngineProcess, launcher: Launcher) -> None:
    put_to_sleep(engine, level=2)
    assert http_json("GET", engine.url + "/is_sleeping", headers=ADMIN)[1]["sim_weights_loaded"] is False
    launcher.reset("wake2")
    call = Call(engine, "/v1/completions", completion(), launcher).answer()
    assert call.status == 200 and call.woken is True
    assert [(p, s) for p, s, _ in launcher.answers] == [
        ("/wake_up?tags=weights", 200),
        ("/collective_rpc", 200),
        ("/wake_up?tags=kv_cache", 200),
    ]
    assert http_json("GET", engine.url + "/is_sleeping", headers=ADMIN)[1] == {
        "is_sleeping": False,
        "sim_weights_loaded": True,
    }


def test_a_wake_that_keeps_failing_ends_in_a_503_after_the_wait(
    engine: SimEngineProcess, launcher: Launcher
) -> None:
    put_to_sleep(engine)
    assert engine.control(wake_fail=True)[1]["wake_fail"] is True
    launcher.reset("wake")
    t0 = time.monotonic()
    call = Call(engine, "/v1/completions", completion(), launcher).answer()
    assert time.monotonic() - t0 >= WAIT
    assert call.status == 503 and call.headers["retry-after"] == str(contracts.WAKE_RETRY_AFTER_SECONDS)
    assert call.headers["content-type"] == "application/json"
    assert call.json() == {
        "error": {
            "message": f"the model is asleep and was not woken within {WAIT:g} s; retry later",
            "type": "Service Unavailable",
            "param": None,
            "code": 503,
        }
    }
    # each failed wake left it asleep, and the held request asked again (at most once a second)
    assert 2 <= launcher.signals <= WAIT + 1
    assert all(a[:2] == ("/wake_up", 500) for a in launcher.answers) and launcher.answers
    assert state(engine)["state"] == "asleep"


def test_no_wake_within_the_wait_answers_anthropic_in_its_shape(
    engine: SimEngineProcess, launcher: Launcher
) -> None:
    put_to_sleep(engine)
    launcher.reset("ignore")
    body = {"model": "tiny-qwen3", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    call = Call(engine, "/v1/messages", body, launcher).answer()
    assert call.status == 503 and call.headers["retry-after"] == "5"
    assert call.json() == {
        "type": "error",
        "error": {
            "type": "overloaded_error",
            "message": f"the model is asleep and was not woken within {WAIT:g} s; retry later",
        },
    }
    assert launcher.signals >= 1 and state(engine)["held"] == 0


def test_a_reported_failed_wake_answers_held_requests_at_once(
    engine: SimEngineProcess, launcher: Launcher
) -> None:
    put_to_sleep(engine)
    assert engine.control(wake_fail=True)[0] == 200
    launcher.reset("report", go=False)
    call = Call(engine, "/v1/completions", completion(), launcher)
    assert launcher.signalled.wait(10)
    assert state(engine)["held"] == 1
    launcher.go.set()
    assert launcher.done.wait(10)
    reported = launcher.answers[-1]
    assert reported == (contracts.WAKE_FAILED_PATH, 200, {"answered": 1})
    call.join(WAIT / 2)  # at once: well before the wait would have ended
    assert not call.is_alive()
    assert call.status == 503 and call.headers["retry-after"] == "7"
    assert call.json()["error"]["message"] == "the model could not be woken: no swap slot; retry later"
    # new requests meanwhile: refused at once, no new signal
    signals = launcher.signals
    t0 = time.monotonic()
    again = Call(engine, "/v1/completions", completion(), launcher).answer()
    assert again.status == 503 and time.monotonic() - t0 < WAIT / 2 and launcher.signals == signals
    # the launcher's own wake still works, and the engine serves
    assert engine.control(wake_fail=False)[0] == 200
    assert post(engine, "/wake_up") == (200, None)
    assert Call(engine, "/v1/completions", completion(), launcher).answer().status == 200


# ------------------------------------------------------------------------------- the sim's own sleep mode


def test_the_sim_without_the_guard_holds_a_request_as_vllm_does(sim_engine_factory: Any) -> None:
    """No guard: asleep, a completion is accepted and gets no answer until the wake (vLLM on the H200); health
    and metrics answer meanwhile; a level-2 wake's tags and reload as vLLM takes them."""
    bare: SimEngineProcess = sim_engine_factory(
        extra=["--enable-sleep-mode", "--sim-sleep-seconds", "0.05"], env={contracts.DEV_MODE_ENV: "1"}
    )
    assert http_json("POST", bare.url + "/sleep?level=3")[0] == 400
    assert http_json("POST", bare.url + "/sleep?level=2") == (200, None)
    assert http_json("GET", bare.url + "/is_sleeping") == (
        200,
        {"is_sleeping": True, "sim_weights_loaded": False},
    )
    nobody = Launcher()
    call = Call(bare, "/v1/completions", completion(), nobody)
    assert wait_for(lambda: bare.control()[1]["waiting"] == 1, 10)  # accepted, queued
    assert http_json("GET", bare.url + "/health")[0] == 200
    status, text = http_json("GET", bare.url + "/metrics")
    assert status == 200 and 'sleep_state="discard_all"} 1.0' in text
    assert call.is_alive()
    assert (
        http_json("POST", bare.url + "/collective_rpc", {"method": "reload_weights"})[0] == 500
    )  # weights asleep
    assert http_json("POST", bare.url + "/wake_up?tags=weights") == (200, None)
    assert http_json("GET", bare.url + "/is_sleeping")[1]["is_sleeping"] is True and call.is_alive()
    assert http_json("POST", bare.url + "/collective_rpc", {"method": "reload_weights"}) == (
        200,
        {"results": [None]},
    )
    assert http_json("POST", bare.url + "/wake_up?tags=kv_cache") == (200, None)
    assert call.answer().status == 200 and call.json()["usage"]["completion_tokens"] == 8
    assert bare.control(wake_fail=True)[1]["wake_fail"] is True
    assert http_json("POST", bare.url + "/sleep") == (200, None)
    status, body = http_json("POST", bare.url + "/wake_up")
    assert status == 500 and body["error"]["type"] == "InternalServerError"
    assert bare.control()[1]["asleep"] == ["kv_cache", "weights"]


def test_without_dev_mode_the_sleep_routes_are_a_404(sim_engine_factory: Any) -> None:
    plain: SimEngineProcess = sim_engine_factory(
        extra=["--enable-sleep-mode"], env={contracts.DEV_MODE_ENV: "0"}
    )
    for path in ("/sleep", "/wake_up", "/collective_rpc"):
        assert http_json("POST", plain.url + path, {}) == (404, {"detail": "Not Found"}), path
    assert http_json("GET", plain.url + "/is_sleeping") == (404, {"detail": "Not Found"})
