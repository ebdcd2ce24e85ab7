"""Request classes (gateway.classes): the spec's checks, the engines' priority scheduling and middleware in
their command, plan's refusals, the routes.json table, and the engine middleware that writes the gateway's
X-VF-Priority into the body (driven with fake ASGI apps; the router through nginx: test_gateway_limits.py)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from vllm_fleet.devtools.gateway_testing import gateway_spec
from vllm_fleet.fleet.engine import REQUEST_PRIORITY, STREAM_GUARD, engine_args
from vllm_fleet.fleet.plan import make_plan
from vllm_fleet.fleet.render import render_host
from vllm_fleet.fleet.spec import FleetSpec, SpecError, parse_spec
from vllm_fleet.host.request_priority import RequestPriority, with_priority

CLASSES = {
    "interactive": {"priority": 0},
    "batch": {"priority": 10},
    "long_context": {"priority": 5, "pool": "long"},
}


def _spec(tmp_path: Path, **gw: Any) -> FleetSpec:
    keys = tmp_path / "keys"
    keys.write_text('"sk-unit-0123456789abcdef0123456789abcdef" chat;\n')
    return gateway_spec(
        [{"name": "a", "port": 9001}, {"name": "b", "port": 9002, "pool": "long"}],
        tmp_path,
        api_keys_file=str(keys),
        **gw,
    )


def test_classes_run_the_engines_with_priority_scheduling(tmp_path: Path) -> None:
    spec = _spec(
        tmp_path,
        classes=CLASSES,
        clients={"chat": {"classes": ["interactive"], "default_class": "interactive"}},
    )
    args = engine_args(spec, spec.models[0])
    assert args[args.index("--scheduling-policy") + 1] == "priority"
    middleware = [args[i + 1] for i, a in enumerate(args) if a == "--middleware"]
    assert middleware == [STREAM_GUARD, REQUEST_PRIORITY]
    plain = _spec(tmp_path)
    assert "--scheduling-policy" not in engine_args(plain, plain.models[0])
    assert make_plan(spec).ok
    routes = json.loads(
        {r.dest: r.content for r in render_host(spec, "h1")}["/etc/nginx/vllm-fleet/routes.json"]
    )
    assert routes["classes"] == {
        "classes": {n: {"priority": c["priority"], "pool": c.get("pool", "")} for n, c in CLASSES.items()},
        "clients": {"chat": {"allowed": ["interactive"], "default": "interactive"}},
    }
    conf = {r.dest: r.content for r in render_host(spec, "h1")}["/etc/nginx/conf.d/vllm-fleet.conf"]
    assert (
        conf.count("proxy_set_header X-VF-Priority $vf_priority;") >= 4
    )  # every proxy and the admission ask
    assert (
        "X-VF-Priority"
        not in {r.dest: r.content for r in render_host(plain, "h1")}["/etc/nginx/conf.d/vllm-fleet.conf"]
    )


def test_bad_classes_are_refused_naming_the_field(tmp_path: Path) -> None:
    data = _spec(tmp_path).model_dump(mode="json")
    for gw, where in (
        ({"classes": CLASSES, "clients": {"chat": {"classes": ["gold"]}}}, "clients.chat.classes[0]"),
        ({"classes": CLASSES, "clients": {"chat": {"default_class": "gold"}}}, "clients.chat.default_class"),
        ({"classes": CLASSES, "clients": {"chat": {"classes": ["batch"], "default_class": "interactive"}}},
         "clients.chat.default_class"),
        ({"classes": {"Bad Name": {}}}, "gateway.classes"),
    ):  # fmt: skip
        with pytest.raises(SpecError, match=__import__("re").escape(where)):
            parse_spec({**data, "gateway": {**data["gateway"], **gw}})
    typo = parse_spec({**data, "gateway": {**data["gateway"], "classes": {"x": {"pool": "lnog"}}}})
    assert any("gateway.classes.x.pool" in str(p) for p in make_plan(typo).problems)


def _run(app: Any, scope: dict[str, Any], chunks: list[bytes]) -> tuple[dict[str, Any], bytes, list[str]]:
    """Call the middleware around ``app`` with the body in ``chunks``; returns the scope and body the app saw
    and the message types it received after the body."""
    seen: dict[str, Any] = {}

    async def inner(sc: Any, receive: Any, send: Any) -> None:
        body = b""
        while True:
            m = await receive()
            body += m.get("body", b"")
            if not m.get("more_body"):
                break
        seen["scope"], seen["body"] = sc, body
        seen["after"] = [(await receive())["type"]]

    messages = [
        {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)
    ]
    messages.append({"type": "http.disconnect"})

    async def receive() -> dict[str, Any]:
        return messages.pop(0)

    async def send(m: Any) -> None:
        pass

    asyncio.run(RequestPriority(inner)(scope, receive, send))
    return seen["scope"], seen["body"], seen["after"]


def _scope(headers: list[tuple[bytes, bytes]]) -> dict[str, Any]:
    return {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": headers}


def test_the_middleware_writes_the_priority_into_the_body() -> None:
    body = json.dumps({"model": "m", "messages": [], "priority": -100}).encode()
    scope, seen, after = _run(
        None,
        _scope([(b"content-length", str(len(body)).encode()), (b"x-vf-priority", b"10")]),
        [body[:7], body[7:]],
    )
    assert json.loads(seen) == {"model": "m", "messages": [], "priority": 10}  # the client's own is replaced
    assert dict(scope["headers"])[b"content-length"] == str(len(seen)).encode()
    assert after == ["http.disconnect"]  # the original receive's disconnect, not one made up


@pytest.mark.parametrize(
    "headers,body",
    [
        ([], b'{"model":"m"}'),
        ([(b"x-vf-priority", b"5")], b"not json"),
        ([(b"x-vf-priority", b"x")], b'{"a":1}'),
    ],
    ids=["no header", "not json", "bad header"],
)
def test_anything_else_passes_untouched(headers: list[tuple[bytes, bytes]], body: bytes) -> None:
    scope = _scope([(b"content-length", str(len(body)).encode()), *headers])
    seen_scope, seen, _ = _run(None, scope, [body])
    assert seen == body and seen_scope["headers"] == scope["headers"]


def test_with_priority() -> None:
    assert with_priority(b"[1]", 3) is None and with_priority(b" {", 3) is None
    assert json.loads(with_priority(b'{"a": 1}', 3) or b"") == {"a": 1, "priority": 3}
