"""An ASGI middleware the launcher loads into the engine's API server (``vllm serve --middleware
vllm_fleet.host.stream_guard.StreamGuard``): an overload refusal is an HTTP 503/429 with ``Retry-After``
before any byte of a stream is sent, never a 200 stream whose only event is an error.

vLLM checks admission (``--max-num-queued-reqs``) before it starts the response and again when the stream's
generator first runs; a request that passes the first check and fails the second got ``200`` + headers and then
one ``data: {"error": {..., "code": 503}}`` event and ``[DONE]`` — which a gateway cannot spill to another
replica and an SDK raises in the middle of the user's loop. For a ``200 text/event-stream`` response this holds
``http.response.start`` until the first body chunk (vLLM sends one event per chunk): an error event with code
503 or 429 becomes that status with ``Retry-After`` and the error as the JSON body (the rest of the stream is
dropped); anything else is forwarded unchanged, start then chunk, and the stream passes untouched after it.
Other responses pass untouched, except that the engine's own 503/429 gets a ``Retry-After`` when it has none.

Imports only the standard library: it runs in every engine's API server process.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[MutableMapping[str, Any], Receive, Send], Awaitable[None]]

# seconds a refused client should wait before it retries (the gateway's own is gateway.full_retry_after_seconds)
RETRY_AFTER_SECONDS = 1
OVERLOAD = frozenset({429, 503})

_BEFORE, _HOLD, _PASS, _DROP = range(4)
_RETRY_AFTER = b"retry-after"


def _is_event_stream(headers: list[tuple[bytes, bytes]]) -> bool:
    for name, value in headers:
        if name.lower() == b"content-type":
            return value.startswith(b"text/event-stream")
    return False


def overload_refusal(chunk: bytes) -> tuple[int, bytes] | None:
    """(status, JSON body) when ``chunk`` (a stream's first body chunk) is an error event with code 503 or 429;
    None for anything else. Cheap for a normal first event: a byte search in its first 64 bytes."""
    if b'"error"' not in chunk[:64]:
        return None
    event = chunk.split(b"\n\n", 1)[0]
    data = b"".join(line[5:] for line in event.split(b"\n") if line.startswith(b"data:"))
    try:
        obj = json.loads(data)
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    # vLLM: {"error": {"message", "type", "param", "code"}}; older releases: {"object": "error", ..., "code"}
    err = obj.get("error")
    if not isinstance(err, dict):
        err = obj if obj.get("object") == "error" else {}
    code = err.get("code")
    status = code if isinstance(code, int) else int(code) if isinstance(code, str) and code.isdigit() else 0
    if status not in OVERLOAD:
        return None
    return status, json.dumps(obj, separators=(",", ":")).encode()


def _with_retry_after(message: Message, seconds: int) -> Message:
    headers = list(message.get("headers", ()))
    if any(name.lower() == _RETRY_AFTER for name, _ in headers):
        return message
    headers.append((_RETRY_AFTER, str(seconds).encode()))
    return {**message, "headers": headers}


class StreamGuard:
    """``StreamGuard(app)``: vLLM adds it with ``app.add_middleware(StreamGuard)``."""

    def __init__(self, app: App, retry_after: int = RETRY_AFTER_SECONDS) -> None:
        self.app = app
        self.retry_after = retry_after

    async def __call__(self, scope: MutableMapping[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        state = _BEFORE
        held: Message | None = None
        retry_after = self.retry_after

        def guarded(message: Message) -> Awaitable[None]:
            # after the first event: the server's own send, no coroutine frame of ours per chunk
            return send(message) if state == _PASS else decide(message)

        async def decide(message: Message) -> None:
            nonlocal state, held
            if state == _BEFORE:
                if message["type"] == "http.response.start":
                    status = message["status"]
                    if status == 200 and _is_event_stream(message.get("headers", ())):
                        held, state = message, _HOLD
                        return
                    state = _PASS
                    if status in OVERLOAD:
                        message = _with_retry_after(message, retry_after)
                await send(message)
            elif state == _HOLD:
                assert held is not None
                if message["type"] == "http.response.body":
                    body = message.get("body", b"")
                    if not body and message.get("more_body", False):
                        return  # an empty chunk: still no event
                    refusal = overload_refusal(body)
                    if refusal is not None:
                        status, payload = refusal
                        state, held = _DROP, None
                        await send(_refusal_start(status, len(payload), retry_after))
                        await send({"type": "http.response.body", "body": payload, "more_body": False})
                        return
                state, start = _PASS, held
                held = None
                await send(start)
                await send(message)
            # _DROP: the rest of a refused stream (its [DONE]) goes nowhere

        await self.app(scope, receive, guarded)
        if state == _HOLD and held is not None:  # the app ended the response without a body message
            await send(held)


def _refusal_start(status: int, length: int, retry_after: int) -> Message:
    return {
        "type": "http.response.start",
        "status": status,
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(length).encode()),
            (_RETRY_AFTER, str(retry_after).encode()),
        ],
    }
