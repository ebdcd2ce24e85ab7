"""vllm_fleet.host.stream_guard: the engine middleware that turns a stream refused for overload into a 503/429
with Retry-After before any byte is sent, driven with fake ASGI apps (the payloads are vLLM 0.32's own: see
tests/integration/test_engine_contract.py for the real engine)."""

from __future__ import annotations

import asyncio
import importlib
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from vllm_fleet.fleet import engine as fleet_engine
from vllm_fleet.fleet.engine import STREAM_GUARD, engine_command
from vllm_fleet.fleet.spec import load_spec
from vllm_fleet.host import stream_guard
from vllm_fleet.host.stream_guard import StreamGuard, overload_refusal

REPO = Path(__file__).resolve().parents[2]
BUSY = (
    "The engine is currently busy and cannot accept new requests. Please try again later or on a different "
    "instance."
)
# what vLLM 0.32's chat/completion stream generator yields when QueueOverflowError is raised inside it
BUSY_EVENT = (
    "data: "
    + json.dumps({"error": {"message": BUSY, "type": "Service Unavailable", "param": None, "code": 503}})
    + "\n\n"
).encode()
DONE = b"data: [DONE]\n\n"
SSE = [(b"content-type", b"text/event-stream; charset=utf-8")]
JSON_CT = [(b"content-type", b"application/json")]
CHUNK = b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[]}\n\n'


def start(status: int = 200, headers: list[tuple[bytes, bytes]] | None = None) -> dict[str, Any]:
    return {
        "type": "http.response.start",
        "status": status,
        "headers": list(SSE if headers is None else headers),
    }


def body(data: bytes, more: bool = True) -> dict[str, Any]:
    return {"type": "http.response.body", "body": data, "more_body": more}


App = Callable[[Any, Any, Any], Awaitable[None]]


def scripted(*messages: dict[str, Any]) -> App:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        for m in messages:
            await send(m)

    return app


def run(app: App, method: str = "POST", receive: Any = None) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []

    async def send(m: Any) -> None:
        sent.append(m)

    async def idle() -> dict[str, Any]:
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    scope = {"type": "http", "method": method, "path": "/v1/chat/completions", "headers": []}
    asyncio.run(StreamGuard(app)(scope, receive or idle, send))
    return sent


def headers_of(m: dict[str, Any]) -> dict[bytes, bytes]:
    return dict(m["headers"])


def test_an_error_first_event_becomes_a_503_with_retry_after_and_json() -> None:
    sent = run(scripted(start(), body(BUSY_EVENT), body(DONE), body(b"", more=False)))
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    assert sent[0]["status"] == 503
    h = headers_of(sent[0])
    assert h[b"content-type"] == b"application/json"
    assert h[b"retry-after"] == str(stream_guard.RETRY_AFTER_SECONDS).encode() == b"1"
    assert int(h[b"content-length"]) == len(sent[1]["body"]) and sent[1]["more_body"] is False
    assert json.loads(sent[1]["body"]) == {
        "error": {"message": BUSY, "type": "Service Unavailable", "param": None, "code": 503}
    }


def test_429_and_the_older_flat_error_shape() -> None:
    flat = b'data: {"object": "error", "message": "slow down", "type": "TooMany", "param": null, "code": 429}\n\n'
    sent = run(scripted(start(), body(flat), body(DONE, more=False)))
    assert sent[0]["status"] == 429 and headers_of(sent[0])[b"retry-after"] == b"1"
    assert json.loads(sent[1]["body"])["message"] == "slow down"
    assert len(sent) == 2


def test_other_error_events_and_normal_streams_pass_byte_identical() -> None:
    bad_request = (
        b'data: {"error": {"message": "bad", "type": "BadRequestError", "param": null, "code": 400}}\n\n'
    )
    for first in (CHUNK, bad_request, b": keep-alive\n\n", b'data: {"error": not json}\n\n'):
        msgs = [start(), body(first), body(CHUNK), body(DONE), body(b"", more=False)]
        assert run(scripted(*msgs)) == msgs, first


def test_the_start_is_held_only_until_the_first_event() -> None:
    """Nothing reaches the client before the first event; everything after it is forwarded as it comes."""
    sent: list[dict[str, Any]] = []
    seen: list[int] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send(start())
        seen.append(len(sent))  # held
        await send(body(b"", more=True))  # an empty chunk is not an event
        seen.append(len(sent))
        await send(body(CHUNK))
        seen.append(len(sent))  # start + the event
        await send(body(CHUNK))
        seen.append(len(sent))
        await send(body(b"", more=False))

    async def send(m: Any) -> None:
        sent.append(m)

    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    asyncio.run(StreamGuard(app)({"type": "http", "method": "POST"}, receive, send))
    assert seen == [0, 0, 2, 3]
    assert sent[0] == start() and sent[1] == body(CHUNK)


def test_non_stream_responses_pass_untouched() -> None:
    ok = [start(200, JSON_CT), body(b'{"id":"x"}', more=False)]
    assert run(scripted(*ok)) == ok
    err = [start(400, JSON_CT), body(b'{"error":{}}', more=False)]
    assert run(scripted(*err)) == err
    # GET, and anything that is not HTTP, is not looked at at all (even a 503 event stream)
    sse = [start(), body(BUSY_EVENT), body(DONE, more=False)]
    assert run(scripted(*sse), method="GET") == sse


def test_the_engines_own_503_gets_retry_after() -> None:
    """The 503 of vLLM's first admission check (a JSON response) gains Retry-After; one that has it keeps it."""
    payload = json.dumps(
        {"error": {"message": BUSY, "type": "Service Unavailable", "param": None, "code": 503}}
    )
    sent = run(scripted(start(503, JSON_CT), body(payload.encode(), more=False)))
    assert headers_of(sent[0]) == {b"content-type": b"application/json", b"retry-after": b"1"}
    assert sent[1]["body"] == payload.encode()
    own = [start(503, [*JSON_CT, (b"Retry-After", b"7")]), body(b"{}", more=False)]
    assert run(scripted(*own)) == own


def test_client_disconnect_while_the_start_is_held() -> None:
    """The client goes away before the first event: the app sees http.disconnect and stops; the guard neither
    hangs nor raises, and what it held is handed on (the server drops it for a gone client)."""

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send(start())
        msg = await receive()
        assert msg["type"] == "http.disconnect"

    async def gone() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    assert run(app, receive=gone) == [start()]


def test_a_send_to_a_gone_client_raises_to_the_app_as_before() -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send(start())
        await send(body(CHUNK))

    async def send(m: Any) -> None:
        raise OSError("client gone")

    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    with pytest.raises(OSError, match="client gone"):
        asyncio.run(StreamGuard(app)({"type": "http", "method": "POST"}, receive, send))


def test_overload_refusal_reads_only_error_events() -> None:
    assert overload_refusal(CHUNK) is None
    assert overload_refusal(DONE) is None
    assert overload_refusal(b"") is None
    status, payload = overload_refusal(BUSY_EVENT) or (0, b"")
    assert status == 503 and json.loads(payload)["error"]["message"] == BUSY
    # the first event only (vLLM sends one per chunk; a chunk holding two is read up to the blank line)
    assert overload_refusal(BUSY_EVENT + DONE) == (status, payload)


def test_with_starlette_streaming_response() -> None:
    """The real response class vLLM uses: its first chunk is vLLM's overload event → 503; a normal stream is
    forwarded chunk for chunk."""
    responses = pytest.importorskip("starlette.responses")

    def app_of(chunks: list[str]) -> App:
        async def gen() -> Any:
            for c in chunks:
                yield c

        async def app(scope: Any, receive: Any, send: Any) -> None:
            await responses.StreamingResponse(gen(), media_type="text/event-stream")(scope, receive, send)

        return app

    sent = run(app_of([BUSY_EVENT.decode(), DONE.decode()]))
    assert sent[0]["status"] == 503 and json.loads(sent[1]["body"])["error"]["code"] == 503 and len(sent) == 2
    sent = run(app_of([CHUNK.decode(), DONE.decode()]))
    assert sent[0]["status"] == 200 and [m.get("body") for m in sent[1:]] == [CHUNK, DONE, b""]


@pytest.mark.parametrize("example", ["seed-004-4xa100.yml", "tiny-cpu.yml"])
def test_both_profiles_load_it_into_the_engine(example: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """gpu (``vllm serve``) and cpu (``vllm_cpu_entry serve``) argv both name the guard, by a path that imports;
    a release without ``--middleware`` gets none."""
    spec = load_spec(REPO / "examples" / example)
    argv = engine_command(spec, spec.models[0])
    assert argv[argv.index("--middleware") + 1] == STREAM_GUARD
    module, _, name = STREAM_GUARD.rpartition(".")
    assert getattr(importlib.import_module(module), name) is StreamGuard
    monkeypatch.setattr(fleet_engine, "release_has", lambda flag, profile, version: flag != "--middleware")
    assert "--middleware" not in engine_command(spec, spec.models[0])
