"""The real nginx gateway without engines: authentication, limits, JSON error shapes, model listing, TLS,
stub_status and the access log. Instances point at ports where nothing listens (a down engine)."""

from __future__ import annotations

import http.client
import json
import ssl
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from vllm_fleet.devtools.gateway_nginx import HAVE_NGINX
from vllm_fleet.devtools.gateway_testing import Gateway, chat_body, gateway_spec
from vllm_fleet.devtools.testing import free_port, http_json
from vllm_fleet.fleet.tls import self_signed

pytestmark = pytest.mark.skipif(not HAVE_NGINX, reason="nginx + libnginx-mod-http-js needed")

KEY1, KEY2 = "sk-vf-test-one-0123456789abcdef", "sk-vf-test-two-0123456789abcdef"
# client-three may use only Qwen/Qwen3-8B and the pool "high" (gateway.clients)
KEY3 = "sk-vf-test-three-0123456789abcdef"
CLIENTS = {"client-three": {"models": ["Qwen/Qwen3-8B"], "pools": ["high"]}}


def _gateway(tmp: Path, **gw: Any) -> Gateway:
    keys = tmp / "api_keys"
    keys.write_text(f'"{KEY1}" client-one;\n"{KEY2}" client-two;\n"{KEY3}" client-three;\n')
    spec = gateway_spec(
        [
            {"name": "a", "port": free_port()},
            {"name": "b", "port": free_port(), "role": "backup"},
            {"name": "q", "port": free_port(), "served_model_name": "Qwen/Qwen3-8B", "max_model_len": 4096},
        ],
        tmp,
        api_keys_file=str(keys),
        **gw,
    )
    return Gateway(spec, tmp).start()


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    tmp = tmp_path_factory.mktemp("gateway-errors")
    # the certificate gateway.tls.self_signed makes (vllm-fleet tls self-signed), for the loopback address
    made = self_signed(tmp / "tls", [], ["127.0.0.1"])
    cert, key = made.certificate, made.key
    g = _gateway(
        tmp,
        max_body_size="64k",
        rate_limit={"per_key_rps": 1000, "per_key_burst": 1000, "per_ip_rps": 1000, "per_ip_burst": 1000},
        # the API on the plain port too (these tests use it); the default, a redirect: test_tls_redirects_plain_http
        tls={
            "certificate": str(cert),
            "certificate_key": str(key),
            "port": free_port(),
            "plain_http": "serve",
        },
        clients=CLIENTS,
    )
    try:
        yield g
    finally:
        g.stop()


def H(key: str = KEY1, **extra: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", **extra}


def openai_error(payload: Any, code: object = None) -> dict[str, Any]:
    assert isinstance(payload, dict) and set(payload) == {"error"}, payload
    err = payload["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert {"message", "type", "param", "code"} <= set(err)
    if code is not None:
        assert err["code"] == code, err
    return err  # type: ignore[no-any-return]


def anthropic_error(payload: Any, etype: str) -> dict[str, Any]:
    assert isinstance(payload, dict) and payload.get("type") == "error", payload
    assert payload["error"]["type"] == etype and payload["error"]["message"], payload
    return payload["error"]  # type: ignore[no-any-return]


def test_401_without_or_with_a_wrong_key(gw: Gateway) -> None:
    st, p = http_json("POST", gw.url + "/v1/chat/completions", chat_body())
    assert st == 401
    assert openai_error(p, "invalid_api_key")["type"] == "invalid_request_error"
    st, p = http_json(
        "POST", gw.url + "/v1/messages", {"model": "tiny-qwen3"}, headers={"x-api-key": "sk-wrong"}
    )
    assert st == 401
    anthropic_error(p, "authentication_error")
    st, p = http_json("GET", gw.url + "/v1/models", headers=H("Bearer-less"))
    assert st == 401


def test_403_key_not_allowed_the_model_or_the_pool(gw: Gateway) -> None:
    """gateway.clients: client-three may call Qwen/Qwen3-8B in the pool "high" only; 403 JSON otherwise, in both
    shapes. (Allowed requests get the 502 of a fleet whose engines are down here: they passed the check.)"""
    st, p = http_json("POST", gw.url + "/v1/chat/completions", chat_body(), headers=H(KEY3))
    assert st == 403, p
    assert openai_error(p, "model_not_allowed")["type"] == "permission_error"
    st, p = http_json("POST", gw.url + "/v1/messages", {"model": "tiny-qwen3", "max_tokens": 5,
                      "messages": [{"role": "user", "content": "hi"}]}, headers={"x-api-key": KEY3})  # fmt: skip
    assert st == 403, p
    anthropic_error(p, "permission_error")
    qwen = dict(chat_body(), model="Qwen/Qwen3-8B")
    assert http_json("POST", gw.url + "/v1/chat/completions", qwen, headers=H(KEY3))[0] == 502
    assert (
        http_json("POST", gw.url + "/v1/chat/completions", qwen, headers=H(KEY3, **{"X-Priority": "HIGH"}))[0]
        == 502
    )
    st, p = http_json(
        "POST", gw.url + "/v1/chat/completions", qwen, headers=H(KEY3, **{"X-Priority": "batch"})
    )
    assert st == 403, p
    openai_error(p, "model_not_allowed")
    # path routing is checked the same way
    st, _ = http_json("POST", gw.url + "/models/tiny-qwen3/v1/chat/completions", chat_body(), headers=H(KEY3))
    assert st == 403
    # a client without restrictions may use the pool client-three may not (Qwen/Qwen3-8B only: a 502 on
    # tiny-qwen3 would mark its servers failed for fail_timeout, which the 502 test below counts on)
    st, _ = http_json(
        "POST", gw.url + "/v1/chat/completions", qwen, headers=H(KEY1, **{"X-Priority": "batch"})
    )
    assert st == 502


def test_tls_redirects_plain_http(tmp_path: Path) -> None:
    """With tls: set, the plain port redirects to the TLS port (and still answers /health)."""
    made = self_signed(tmp_path / "tls", ["localhost"], ["127.0.0.1"])
    cert, key = made.certificate, made.key
    tls_port = free_port()
    g = _gateway(tmp_path, tls={"certificate": str(cert), "certificate_key": str(key), "port": tls_port})
    try:
        conn = http.client.HTTPConnection("127.0.0.1", g.spec.gateway.port, timeout=10)
        conn.request("POST", "/v1/chat/completions", body=json.dumps(chat_body()), headers=H(KEY1))
        r = conn.getresponse()
        assert r.status == 308
        assert r.getheader("Location") == f"https://127.0.0.1:{tls_port}/v1/chat/completions"
        assert http_json("GET", g.url + "/health")[0] == 200
        ctx = ssl.create_default_context(cafile=str(cert))  # verified: its names include 127.0.0.1
        req = urllib.request.Request(f"https://127.0.0.1:{tls_port}/v1/models", headers=H(KEY1))
        with urllib.request.urlopen(req, context=ctx, timeout=10) as resp:
            assert resp.status == 200
    finally:
        g.stop()


def test_400_malformed_json_and_missing_model(gw: Gateway) -> None:
    req = urllib.request.Request(
        gw.url + "/v1/chat/completions", data=b'{"model": "tiny', method="POST", headers=H()
    )
    try:
        urllib.request.urlopen(req, timeout=10)
        raise AssertionError("expected 400")
    except urllib.error.HTTPError as e:
        assert e.code == 400
        assert "not valid JSON" in openai_error(json.loads(e.read()))["message"]
    for body in ({"messages": []}, {"model": 3}, {"model": ""}):
        st, p = http_json("POST", gw.url + "/v1/chat/completions", body, headers=H())
        assert st == 400, (body, p)
        assert "model" in openai_error(p)["message"]
    st, p = http_json("POST", gw.url + "/v1/messages", {"max_tokens": 5}, headers={"x-api-key": KEY2})
    assert st == 400
    anthropic_error(p, "invalid_request_error")


def test_404_unknown_model_and_path(gw: Gateway) -> None:
    st, p = http_json("POST", gw.url + "/v1/chat/completions", chat_body("no-such-model"), headers=H())
    assert st == 404
    assert "no-such-model" in openai_error(p, "model_not_found")["message"]
    st, p = http_json("POST", gw.url + "/v1/messages", {"model": "no-such-model"}, headers=H())
    assert st == 404
    anthropic_error(p, "not_found_error")
    st, p = http_json("POST", gw.url + "/models/no-such-model/v1/messages", {"max_tokens": 3}, headers=H())
    assert st == 404
    anthropic_error(p, "not_found_error")
    st, p = http_json("GET", gw.url + "/v1/models/no-such-model", headers=H())
    assert st == 404
    st, p = http_json("GET", gw.url + "/not/an/api", headers=H())
    assert st == 404
    openai_error(p, "not_found")
    st, p = http_json(
        "POST", gw.url + "/v1/completions", {"prompt": "x"}, headers=H(**{"X-Model-Name": "nope"})
    )
    assert st == 404


def test_413_body_too_large(gw: Gateway) -> None:
    big = chat_body(extra="x" * 100_000)
    st, p = http_json("POST", gw.url + "/v1/chat/completions", big, headers=H())
    assert st == 413
    openai_error(p, "request_too_large")
    st, p = http_json("POST", gw.url + "/v1/messages", big, headers=H())
    assert st == 413
    anthropic_error(p, "request_too_large")


def test_502_json_when_every_instance_is_down(gw: Gateway) -> None:
    st, p = http_json("POST", gw.url + "/v1/chat/completions", chat_body(), headers=H(KEY2))
    assert st == 502
    assert "tiny-qwen3" in openai_error(p, "upstream_unavailable")["message"]
    (last,) = gw.find(lambda e: e["status"] == 502 and e["model"] == "tiny-qwen3")
    assert last["model"] == "tiny-qwen3" and last["client"] == "client-two" and last["route"] == "body"
    assert len(last["upstream_addr"].split(",")) == 2  # the primary, then the backup


def test_models_listed_from_the_spec(gw: Gateway) -> None:
    import anthropic
    import openai

    oc = openai.OpenAI(base_url=gw.url + "/v1", api_key=KEY1, max_retries=0)
    assert sorted(m.id for m in oc.models.list()) == ["Qwen/Qwen3-8B", "tiny-qwen3"]
    assert oc.models.retrieve("tiny-qwen3").id == "tiny-qwen3"
    ac = anthropic.Anthropic(base_url=gw.url, api_key=KEY2, max_retries=0)
    assert sorted(m.id for m in ac.models.list()) == ["Qwen/Qwen3-8B", "tiny-qwen3"]
    st, p = http_json("GET", gw.url + "/models/Qwen/Qwen3-8B/v1/models", headers=H(KEY2))
    assert (
        st == 200
        and [m["id"] for m in p["data"]] == ["Qwen/Qwen3-8B"]
        and p["data"][0]["max_model_len"] == 4096
    )


def test_405_get_without_model(gw: Gateway) -> None:
    st, p = http_json("GET", gw.url + "/v1/chat/completions", headers=H(KEY2))
    assert st == 405
    openai_error(p)


def test_429_per_key_limit_is_per_key(tmp_path: Path) -> None:
    """gateway.limits off (the admission service's budgets: test_gateway_limits.py): nginx's per-key bucket,
    1 r/s burst 2: the 4th quick request of one key gets 429 JSON; another key still passes."""
    g = _gateway(
        tmp_path,
        rate_limit={"per_key_rps": 1, "per_key_burst": 2, "per_ip_rps": 1000, "per_ip_burst": 1000},
        limits={"enabled": False},
    )
    try:
        statuses = [http_json("GET", g.url + "/v1/models", headers=H(KEY1))[0] for _ in range(6)]
        assert statuses[:3] == [200, 200, 200] and 429 in statuses, statuses
        st, p = http_json("POST", g.url + "/v1/chat/completions", chat_body(), headers=H(KEY1))
        assert st == 429
        openai_error(p, "rate_limit_exceeded")
        st, p = http_json(
            "POST", g.url + "/v1/messages", {"model": "tiny-qwen3"}, headers={"x-api-key": KEY1}
        )
        assert st == 429
        anthropic_error(p, "rate_limit_error")
        st, _ = http_json("GET", g.url + "/v1/models", headers=H(KEY2))
        assert st == 200  # KEY2 has its own budget
        assert g.find(lambda e: e["limit_req"] == "REJECTED" and e["client"] == "client-one")
    finally:
        g.stop()


def test_429_per_ip_limit(tmp_path: Path) -> None:
    g = _gateway(
        tmp_path, rate_limit={"per_key_rps": 1000, "per_key_burst": 1000, "per_ip_rps": 1, "per_ip_burst": 3}
    )
    try:
        a = [http_json("GET", g.url + "/v1/models", headers=H(KEY1))[0] for _ in range(3)]
        b = [http_json("GET", g.url + "/v1/models", headers=H(KEY2))[0] for _ in range(3)]
        assert a == [200, 200, 200] and b[-1] == 429, (a, b)  # both keys share the address's budget
    finally:
        g.stop()


def test_tls_listener(gw: Gateway) -> None:
    assert gw.spec.gateway.tls is not None
    ctx = ssl.create_default_context(cafile=gw.spec.gateway.tls.certificate)
    req = urllib.request.Request(f"https://127.0.0.1:{gw.spec.gateway.tls.port}/v1/models", headers=H(KEY2))
    with urllib.request.urlopen(req, timeout=10, context=ctx) as r:
        assert r.status == 200 and "tiny-qwen3" in r.read().decode()


def test_stub_status_on_loopback(gw: Gateway) -> None:
    with urllib.request.urlopen(
        f"http://127.0.0.1:{gw.spec.gateway.stub_status_port}/stub_status", timeout=5
    ) as r:
        text = r.read().decode()
    assert text.startswith("Active connections:") and "server accepts handled requests" in text


def test_access_log_is_json_with_routing_fields(gw: Gateway) -> None:
    entries = gw.log()
    assert entries
    for key in (
        "model",
        "upstream_addr",
        "upstream_status",
        "request_time",
        "upstream_response_time",
        "client",
    ):
        assert all(key in e for e in entries), key
    assert not any(k in json.dumps(e) for e in entries for k in (KEY1, KEY2, KEY3))  # keys never logged
