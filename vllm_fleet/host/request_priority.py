"""An ASGI middleware the launcher loads into the engine's API server where the fleet has request classes
(``gateway.classes``; ``vllm serve --scheduling-policy priority --middleware
vllm_fleet.host.request_priority.RequestPriority``): the gateway names a request's priority in the header
``X-VF-Priority`` (its class's, docs/gateway.md "Request classes"), and this writes it into the JSON body's
``priority`` field, which vLLM's priority scheduler reads (lower runs first). nginx cannot change a request body;
the gateway always sets the header itself (a client's own ``X-VF-Priority`` never reaches the engine).

A POST with the header and a JSON object body gets ``priority`` set (replacing the client's); anything else
passes untouched. Imports only the standard library: it runs in every engine's API server process.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[MutableMapping[str, Any], Receive, Send], Awaitable[None]]

HEADER = b"x-vf-priority"
# the largest body read into memory to set the field (the gateway's max_body_size is far below); larger passes
MAX_BODY = 64 * 1024 * 1024


def priority_of(headers: list[tuple[bytes, bytes]]) -> int | None:
    for name, value in headers:
        if name.lower() == HEADER:
            try:
                return int(value)
            except ValueError:
                return None
    return None


def with_priority(body: bytes, priority: int) -> bytes | None:
    """``body`` with ``"priority": priority`` when it is a JSON object, else None (left as it is)."""
    if not body.lstrip().startswith(b"{"):
        return None
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    obj["priority"] = priority
    return json.dumps(obj, separators=(",", ":")).encode()


class RequestPriority:
    """``RequestPriority(app)``: vLLM adds it with ``app.add_middleware(RequestPriority)``."""

    def __init__(self, app: App) -> None:
        self.app = app

    async def __call__(self, scope: MutableMapping[str, Any], receive: Receive, send: Send) -> None:
        priority = None
        if scope["type"] == "http" and scope.get("method") == "POST":
            priority = priority_of(list(scope.get("headers", ())))
        if priority is None:
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away: let the app see it
                await self.app(scope, _replay([], message, rest=receive), send)
                return
            chunk = message.get("body", b"")
            chunks.append(chunk)
            size += len(chunk)
            if not message.get("more_body", False) or size > MAX_BODY:
                more = message.get("more_body", False)
                break
        body = b"".join(chunks)
        new = None if more else with_priority(body, priority)
        if new is None:
            await self.app(scope, _replay([body], None, more, rest=receive), send)
            return
        headers = [(k, v) for k, v in scope.get("headers", ()) if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(new)).encode()))
        await self.app({**scope, "headers": headers}, _replay([new], None, rest=receive), send)


def _replay(bodies: list[bytes], final: Message | None, more: bool = False, *, rest: Receive) -> Receive:
    """A ``receive`` that hands the app ``bodies`` as one request message (and ``final``), then the original
    ``receive``'s messages: the rest of a body not read to its end, and the disconnect a streaming response
    listens for (answering a disconnect here would end every stream at once)."""
    queue: list[Message] = []
    if bodies:
        queue.append({"type": "http.request", "body": b"".join(bodies), "more_body": more})
    if final is not None:
        queue.append(final)

    async def receive() -> Message:
        if queue:
            return queue.pop(0)
        return await rest()

    return receive
