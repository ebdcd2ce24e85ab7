"""The sleep guard: an ASGI middleware the launcher loads into a sleeping model's engine (``vllm serve
--enable-sleep-mode --middleware vllm_fleet.host.sleep_guard.SleepGuard`` with ``VLLM_SERVER_DEV_MODE=1``;
docs/sleep.md), and its transport-agnostic core, which the sim engine puts in front of its own handler.

vLLM serves /sleep and /wake_up only in development mode, which also opens its other development paths to
anyone who reaches the port; and a request sent to a sleeping engine gets no answer at all (docs/perf/sleep.md).
The guard, in front of vLLM's API server:

- answers every administration path (``contracts.DEV_MODE_PATHS``, exact or ``PATH/...``, and everything under
  ``/vllm-fleet/``) with FastAPI's own JSON 404 unless the request carries ``X-VF-Admin-Token`` equal to the
  token in the engine's environment (``contracts.ADMIN_TOKEN_ENV``; none there: nothing matches);
- keeps the engine's sleep state (awake, sleeping, asleep, waking) from the /sleep and /wake_up it forwards:
  /sleep is refused (409) while a request is in flight or held, idempotent when asleep; /wake_up with
  ``tags=weights`` alone (a level-2 wake's first step) leaves it waking until a /wake_up with ``kv_cache``;
- counts the requests in flight (until the response's last body message is sent, streams included, or the
  app fails) and when one last ended; ``GET /vllm-fleet/sleep`` (public, read-only) tells the launcher;
- holds a request that arrives while the engine is not awake: asleep, it asks the launcher for a wake
  (SIGUSR1 to ``contracts.LAUNCHER_PID_ENV``'s pid, at once, then at most once a second while held; a request
  held during a sleep asks as soon as the engine is asleep), and lets it through when the engine is awake, or
  answers 503 JSON with ``Retry-After`` (OpenAI's error shape; Anthropic's on /v1/messages) when the wait
  (``contracts.WAKE_WAIT_ENV``) ends first or the launcher reports the wake failed
  (``POST /vllm-fleet/wake-failed``: the held requests are answered at once, new ones for ``retry_after`` s);
- never holds nor counts the health and discovery paths (GET/HEAD /health, /ping, /metrics, /version,
  /v1/models, /load).

``SleepCore`` makes these decisions and does the waiting (asyncio, no ASGI types); ``SleepGuard(app)`` adapts
it to ASGI. The environment is read once, when the guard is made. Imports only the standard library and
``vllm_fleet.contracts`` (itself standard library only): it runs in every sleeping engine's API server.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import os
import signal
import time
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs

from vllm_fleet.contracts import (
    ADMIN_TOKEN_ENV,
    ADMIN_TOKEN_HEADER,
    DEV_MODE_PATHS,
    LAUNCHER_PID_ENV,
    PROBE_USER_AGENT,
    SLEEP_STATE_PATH,
    SLEEP_STATES,
    WAKE_FAILED_PATH,
    WAKE_RETRY_AFTER_SECONDS,
    WAKE_WAIT_ENV,
    WAKE_WAIT_SECONDS,
)

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[MutableMapping[str, Any], Receive, Send], Awaitable[None]]

AWAKE, SLEEPING, ASLEEP, WAKING = SLEEP_STATES
SIGNAL_INTERVAL_SECONDS = 1.0  # a wake signal for held requests is repeated at most this often
# never held, never counted (GET and HEAD): what health checks, scrapes and discovery read
EXEMPT_METHODS = frozenset({"GET", "HEAD"})
EXEMPT_PATHS = frozenset({"/health", "/ping", "/metrics", "/version", "/v1/models", "/load"})
GUARD_ROOT = SLEEP_STATE_PATH.rsplit("/", 1)[0]  # "/vllm-fleet": the guard's own paths
# an administration path is one of these or under one; each is one segment, so the first segment decides
ADMIN_ROOTS = frozenset((*DEV_MODE_PATHS, GUARD_ROOT))
assert all(r.count("/") == 1 for r in ADMIN_ROOTS), ADMIN_ROOTS
ANTHROPIC_PATH = "/v1/messages"  # and under it: refusals in Anthropic's error shape
LEVEL2_WAKE_LAST_TAG = "kv_cache"  # a /wake_up with tags wakes the engine only once this tag is back

log = logging.getLogger("vllm_fleet.sleep_guard")


def is_admin_path(path: str) -> bool:
    """``path`` is an administration path: a development path or the guard's own, exact or under it."""
    end = path.find("/", 1)
    return (path if end < 0 else path[:end]) in ADMIN_ROOTS


def wake_tags(query: str) -> frozenset[str]:
    """The tags of a /wake_up query (``tags=weights&tags=kv_cache`` as vLLM reads them; commas too); empty:
    all of them."""
    values = parse_qs(query).get("tags", [])
    return frozenset(t.strip() for v in values for t in v.split(",") if t.strip())


@dataclass(frozen=True)
class Answer:
    """A response the guard gives itself (the request never reaches the engine)."""

    status: int
    body: bytes
    retry_after: int | None = None
    content_type: str | None = "application/json"

    @classmethod
    def json(cls, status: int, obj: Any, retry_after: int | None = None) -> Answer:
        return cls(status, json.dumps(obj, separators=(",", ":")).encode(), retry_after)


NOT_FOUND = Answer.json(404, {"detail": "Not Found"})  # FastAPI's own: no different from a missing route
NOT_ALLOWED = Answer.json(405, {"detail": "Method Not Allowed"})
ASLEEP_ALREADY = Answer(200, b"", content_type=None)  # vLLM's own /sleep answer: an empty 200


def _openai_error(status: int, message: str, type_: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": None, "code": status}}


def refusal(path: str, message: str, retry_after: int) -> Answer:
    """The 503 of a request the engine cannot take now: Anthropic's error shape on /v1/messages (and under it),
    OpenAI's (vLLM's own busy answer's type) elsewhere; with ``Retry-After``."""
    if path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/"):
        body: dict[str, Any] = {"type": "error", "error": {"type": "overloaded_error", "message": message}}
    else:
        body = _openai_error(503, message, "Service Unavailable")
    return Answer.json(503, body, retry_after)


def _conflict(message: str) -> Answer:
    return Answer.json(409, _openai_error(409, message, "Conflict"))


def _bad_request(message: str) -> Answer:
    return Answer.json(400, _openai_error(400, message, "BadRequestError"))


class Pass:
    """Forward the request to the engine; call ``done(status)`` once its response has ended: its last body
    message sent (``status``: the response's) or the app failed (None). Later calls do nothing."""

    __slots__ = ("_end",)

    def __init__(self, end: Callable[[int | None], None] | None = None) -> None:
        self._end = end

    def done(self, status: int | None) -> None:
        end, self._end = self._end, None
        if end is not None:
            end(status)


ReadBody = Callable[[], Awaitable[bytes]]
UntilGone = Callable[[], Awaitable[None]]


class SleepCore:
    """The guard's decisions and waiting, for one engine (one asyncio loop).

    ``await core.enter(method, path, query, headers, read_body, until_gone)`` for each request (``headers``:
    lower-case names) gives an ``Answer`` to send instead of forwarding, a ``Pass`` to forward (then
    ``pass.done(status)`` when the response has ended), or None when the client went away while the request
    was held (``until_gone`` returned: send nothing). ``read_body`` is awaited only for the guard's own
    POST /vllm-fleet/wake-failed; ``until_gone`` (optional) only while a request is held, and completes when
    the client disconnects. ``snapshot()`` is GET /vllm-fleet/sleep's answer."""

    def __init__(
        self,
        token: str = "",
        launcher_pid: int | None = None,
        wake_wait: float = WAKE_WAIT_SECONDS,
        retry_after: int = WAKE_RETRY_AFTER_SECONDS,
        *,
        signal_interval: float = SIGNAL_INTERVAL_SECONDS,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        kill: Callable[[int, int], None] = os.kill,
    ) -> None:
        self._token = token.encode()
        self.launcher_pid = launcher_pid
        self.wake_wait = wake_wait
        self.retry_after = retry_after
        self.signal_interval = signal_interval
        self._clock = clock
        self._wall = wall
        self._kill = kill
        self.state = AWAKE
        self.inflight = 0
        self.held = 0
        self.last_request_at = wall()
        self.asleep_since: float | None = None
        self.signals = 0  # SIGUSR1 sent to the launcher
        self._changed: asyncio.Event | None = None  # set (and replaced) on every change a held request awaits
        self._signalled_at = -math.inf
        self._failures = 0  # wake failures reported so far
        self._failed_reason = ""
        self._failed_retry = retry_after
        self._failed_until = -math.inf  # until then a request that would be held is refused at once

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> SleepCore:
        """The core an engine's guard runs: the admin token, the launcher's pid and the wait from the engine's
        environment (a pid or wait that is not a positive number counts as absent)."""
        env = os.environ if environ is None else environ
        pid: int | None
        try:
            pid = int(env.get(LAUNCHER_PID_ENV, ""))
        except ValueError:
            pid = None
        if pid is not None and pid <= 1:  # 0 and -1 would signal process groups; 1 is init
            pid = None
        try:
            wait = float(env.get(WAKE_WAIT_ENV, ""))
        except ValueError:
            wait = WAKE_WAIT_SECONDS
        if not (wait > 0 and math.isfinite(wait)):
            wait = WAKE_WAIT_SECONDS
        return cls(env.get(ADMIN_TOKEN_ENV, ""), pid, wait)

    # --- what the launcher reads

    def snapshot(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "inflight": self.inflight,
            "held": self.held,
            "last_request_at": self.last_request_at,
            "asleep_since": self.asleep_since,
        }

    # --- one request

    @staticmethod
    def exempt(method: str, path: str) -> bool:
        """Never held, never counted."""
        return path in EXEMPT_PATHS and method in EXEMPT_METHODS

    def authorized(self, headers: Mapping[str, str]) -> bool:
        given = headers.get(ADMIN_TOKEN_HEADER.lower())
        return bool(self._token) and given is not None and hmac.compare_digest(given.encode(), self._token)

    async def enter(
        self,
        method: str,
        path: str,
        query: str,
        headers: Mapping[str, str],
        read_body: ReadBody,
        until_gone: UntilGone | None = None,
    ) -> Answer | Pass | None:
        if self.exempt(method, path):
            return Pass()
        if is_admin_path(path):
            if path == SLEEP_STATE_PATH and method == "GET":
                return Answer.json(200, self.snapshot())
            if not self.authorized(headers):
                return NOT_FOUND
            return await self._admin(method, path, query, read_body)
        if self.state != AWAKE and headers.get("user-agent") == PROBE_USER_AGENT:
            # the launcher's own liveness check, begun before the engine went to sleep: it must not wake it
            return refusal(path, f"the engine is {self.state}", self.retry_after)
        if self.state != AWAKE:
            outcome = await self._hold(path, until_gone)
            if isinstance(outcome, Answer):
                return outcome
            if not outcome:
                return None  # the client left
        self.inflight += 1  # no await since the state was seen awake
        return Pass(self._ended_probe if headers.get("user-agent") == PROBE_USER_AGENT else self._ended)

    def _ended(self, status: int | None) -> None:
        self.inflight -= 1
        self.last_request_at = self._wall()

    def _ended_probe(self, status: int | None) -> None:
        self.inflight -= 1

    # --- administration (the token was given)

    async def _admin(self, method: str, path: str, query: str, read_body: ReadBody) -> Answer | Pass:
        if path == WAKE_FAILED_PATH:
            return self._wake_failed(await read_body()) if method == "POST" else NOT_ALLOWED
        if path == GUARD_ROOT or path.startswith(GUARD_ROOT + "/"):
            return NOT_ALLOWED if path == SLEEP_STATE_PATH else NOT_FOUND
        if method == "POST" and path == "/sleep":
            return self._sleep()
        if method == "POST" and path == "/wake_up":
            return self._wake(wake_tags(query))
        return Pass()  # another development path: forwarded as it is, not counted

    def _sleep(self) -> Answer | Pass:
        busy = self.inflight + self.held
        if busy:
            return _conflict(f"busy: {busy} request(s) in flight")
        if self.state == ASLEEP:
            return ASLEEP_ALREADY
        if self.state != AWAKE:
            return _conflict(f"busy: the engine is {self.state}")
        self._set(SLEEPING)
        return Pass(self._slept)

    def _slept(self, status: int | None) -> None:
        if self.state != SLEEPING:
            return
        if status == 200:
            self.asleep_since = self._wall()
            self._signalled_at = -math.inf  # a new sleep: the first held request signals at once
            self._set(ASLEEP)
        else:
            self._set(AWAKE)

    def _wake(self, tags: frozenset[str]) -> Answer | Pass:
        if self.state == SLEEPING:
            return _conflict("busy: the engine is sleeping")
        if self.state == AWAKE:
            return Pass()  # vLLM's wake of an awake engine: nothing changes here
        self._set(WAKING)
        return Pass(lambda status: self._woken(status, tags))

    def _woken(self, status: int | None, tags: frozenset[str]) -> None:
        if status == 200:
            if not tags or LEVEL2_WAKE_LAST_TAG in tags:
                self.asleep_since = None
                self._failed_until = -math.inf  # awake: a failed wake's refusal window is over
                self._set(AWAKE)
        elif self.state == WAKING:
            self._set(ASLEEP)

    def _wake_failed(self, body: bytes) -> Answer:
        try:
            obj = json.loads(body or b"{}")
        except ValueError:
            obj = None
        if not isinstance(obj, dict):
            return _bad_request("expected a JSON object {reason, retry_after}")
        retry = obj.get("retry_after", self.retry_after)
        if isinstance(retry, bool) or not isinstance(retry, int) or retry < 0:
            return _bad_request(f"retry_after: expected a whole number of seconds >= 0, got {retry!r}")
        reason = str(obj.get("reason") or "the wake failed")
        if self.state == AWAKE:  # the engine woke meanwhile: nothing is held, nothing to refuse
            return Answer.json(200, {"answered": 0})
        answered = self.held
        log.warning(
            "wake failed (%s): %d held request(s) answered 503, retry after %d s", reason, answered, retry
        )
        self._failures += 1
        self._failed_reason = reason
        self._failed_retry = retry
        self._failed_until = self._clock() + retry
        self._set(ASLEEP if self.state == WAKING else self.state)
        return Answer.json(200, {"answered": answered})

    # --- holding

    def _set(self, state: str) -> None:
        self.state = state
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    def _signal(self, now: float) -> None:
        if self.launcher_pid is None or now - self._signalled_at < self.signal_interval:
            return
        self._signalled_at = now
        try:
            self._kill(self.launcher_pid, signal.SIGUSR1)
            self.signals += 1
        except OSError as exc:
            log.warning("cannot ask the launcher (pid %d) for a wake: %s", self.launcher_pid, exc)

    async def _hold(self, path: str, until_gone: UntilGone | None) -> Answer | bool:
        """Wait for the engine to be awake (True), the client to leave (False), or give the refusal."""
        now = self._clock()
        if now < self._failed_until:
            return refusal(path, self._failed_message(), max(1, math.ceil(self._failed_until - now)))
        self.held += 1
        deadline = now + self.wake_wait
        failures = self._failures
        gone = asyncio.ensure_future(until_gone()) if until_gone is not None else None
        try:
            while True:
                if self.state == AWAKE:
                    return True
                if self._failures != failures:
                    return refusal(path, self._failed_message(), self._failed_retry)
                now = self._clock()
                if now >= deadline:
                    message = (
                        f"the model is asleep and was not woken within {self.wake_wait:g} s; retry later"
                    )
                    return refusal(path, message, self.retry_after)
                timeout = deadline - now
                if self.state == ASLEEP and self.launcher_pid is not None:
                    self._signal(now)
                    timeout = min(timeout, max(0.0, self._signalled_at + self.signal_interval - now))
                if self._changed is None:
                    self._changed = asyncio.Event()
                changed = asyncio.ensure_future(self._changed.wait())
                waiting: set[asyncio.Future[Any]] = {changed} if gone is None else {changed, gone}
                await asyncio.wait(waiting, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                changed.cancel()
                if gone is not None and gone.done():
                    return False
        finally:
            self.held -= 1
            if gone is not None:
                if gone.done() and not gone.cancelled():
                    gone.exception()  # retrieved: a failed receive is a client gone too
                gone.cancel()

    def _failed_message(self) -> str:
        return f"the model could not be woken: {self._failed_reason}; retry later"


# ------------------------------------------------------------------------------------------------ ASGI


async def send_answer(send: Send, answer: Answer) -> None:
    headers = [(b"content-length", str(len(answer.body)).encode())]
    if answer.content_type:
        headers.append((b"content-type", answer.content_type.encode()))
    if answer.retry_after is not None:
        headers.append((b"retry-after", str(answer.retry_after).encode()))
    await send({"type": "http.response.start", "status": answer.status, "headers": headers})
    await send({"type": "http.response.body", "body": answer.body, "more_body": False})


class SleepGuard:
    """``SleepGuard(app)``: vLLM adds it with ``app.add_middleware(SleepGuard)``; the core reads the engine's
    environment here, once (``core``: another one, for tests)."""

    def __init__(self, app: App, core: SleepCore | None = None) -> None:
        self.app = app
        self.core = SleepCore.from_env() if core is None else core

    async def __call__(self, scope: MutableMapping[str, Any], receive: Receive, send: Send) -> None:
        core = self.core
        if scope["type"] != "http" or core.exempt(scope.get("method", ""), scope.get("path", "")):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
        query = scope.get("query_string", b"").decode("latin-1")
        early: list[Message] = []  # request messages read while the request was held: the app gets them first

        async def read_body() -> bytes:
            chunks = []
            while True:
                message = await receive()
                if message["type"] != "http.request":
                    break
                chunks.append(message.get("body", b""))
                if not message.get("more_body", False):
                    break
            return b"".join(chunks)

        async def until_gone() -> None:
            while (message := await receive())["type"] != "http.disconnect":
                early.append(message)

        verdict = await core.enter(scope["method"], scope["path"], query, headers, read_body, until_gone)
        if verdict is None:
            return  # the client left while the request was held
        if isinstance(verdict, Answer):
            await send_answer(send, verdict)
            return
        status: int | None = None

        async def replay() -> Message:
            return early.pop(0) if early else await receive()

        def tracked(message: Message) -> Awaitable[None]:
            nonlocal status
            kind = message["type"]
            if kind == "http.response.start":
                status = message["status"]
            elif kind == "http.response.body" and not message.get("more_body", False):
                return last(message)
            return send(message)

        async def last(message: Message) -> None:
            try:
                await send(message)
            finally:
                verdict.done(status)

        try:
            await self.app(scope, replay if early else receive, tracked)
        except BaseException:
            verdict.done(None)
            raise
        verdict.done(status)
