"""LoRA adapters through the real nginx gateway, with stub engines (tiny HTTP servers that say who they are and
what reached them): a request naming an adapter goes to its carriers, spills to the base's other instances when
they are down or full, keeps its prefix affinity under cache_aware (apart from another adapter's), is listed by
/v1/models with its parent, is allowed per key only when the key's models name it, and counts against its
base's capacity in the admission service. The engines' administration paths never reach an engine."""

from __future__ import annotations

import http.client
import json
import re
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from vllm_fleet.contracts import ENGINE_ADMIN_PATH_RE
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

pytestmark = pytest.mark.skipif(not HAVE_NGINX, reason="nginx + libnginx-mod-http-js needed")

BASE = "tiny-qwen3"


@pytest.fixture
def stubs() -> Iterator[dict[str, StubEngine]]:
    with stub_engines("a", "b", "c", "d") as s:
        yield s


def _ad(name: str, *carriers: str) -> dict[str, Any]:
    """A spec adapter of the base carried by ``carriers`` (none named: ``any``)."""
    return {"name": name, "instances": list(carriers) or "any"}


def _gateway(tmp: Path, servers: list[dict[str, Any]], adapters: list[dict[str, Any]], **gw: Any) -> Gateway:
    """The rendered fleet of ``servers`` with ``adapters``, served by nginx (and the admission service with
    keys)."""
    return Gateway(
        gateway_spec(servers, tmp, rate_limit=OPEN_RATE_LIMIT, adapters=adapters, **gw), tmp
    ).start()


def ask(
    g: Gateway,
    model: str,
    n: int = 1,
    prompt: str = "hello",
    path: str = "/v1/chat/completions",
    **headers: str,
) -> list[tuple[int, dict[str, Any]]]:
    """n requests naming ``model`` one after the other; returns once the access log has them."""
    seen = len(g.log())
    out = []
    for _ in range(n):
        body = chat_body(model, messages=[{"role": "user", "content": prompt}])
        st, b = http_json("POST", g.url + path, body, headers=headers)
        out.append((st, b))
    assert wait_for(lambda: len(g.log()) >= seen + n, 5)
    return out


def served(got: list[tuple[int, dict[str, Any]]]) -> list[str]:
    assert all(st == 200 for st, _ in got), got
    return [b["served_by"] for _, b in got]


def raw(g: Gateway, method: str, path: str, body: bytes = b"", **headers: str) -> tuple[int, Any]:
    """A request with its path sent exactly as written (no client-side normalisation)."""
    host, _, port = g.url.removeprefix("http://").partition(":")
    c = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        c.putrequest(method, path, skip_accept_encoding=True)
        for k, v in {"Content-Type": "application/json", "Content-Length": str(len(body)), **headers}.items():
            c.putheader(k, v)
        c.endheaders(body)
        r = c.getresponse()
        text = r.read().decode()
        try:
            return r.status, json.loads(text)
        except ValueError:
            return r.status, text
    finally:
        c.close()


def test_adapters_reach_their_carriers_spill_and_are_listed(
    stubs: dict[str, StubEngine], tmp_path: Path
) -> None:
    dead = free_port()
    servers = [{"name": n, "port": stubs[n].port} for n in ("a", "b", "c")] + [{"name": "x", "port": dead}]
    ads = [_ad("ad-sub", "a"), _ad("ad-dead", "x"), _ad("ad-all")]
    g = _gateway(tmp_path, servers, ads)
    try:
        # carried by a alone: every request on a, the body's model still the adapter's name
        got = ask(g, "ad-sub", 12)
        assert set(served(got)) == {"a"} and {b["model"] for _, b in got} == {"ad-sub"}
        log = g.log()[-12:]
        assert {(e["model"], e["base"], e["upstream"]) for e in log} == {
            ("ad-sub", BASE, "m_tiny_qwen3__lora_ad_sub")
        }
        # by X-Model-Name and by path too
        assert served(ask(g, "ad-sub", 4, **{"X-Model-Name": "ad-sub"})) == ["a"] * 4
        assert served(ask(g, "ad-sub", 4, path="/models/ad-sub/v1/chat/completions")) == ["a"] * 4
        assert {b["path"] for _, b in ask(g, "ad-sub", 1, path="/models/ad-sub/v1/chat/completions")} == {
            "/v1/chat/completions"
        }
        # the carrier full (503): the base's other instances load it (the engines' resolver) and serve
        stubs["a"].status = 503
        assert set(served(ask(g, "ad-sub", 8))) <= {"b", "c"}
        stubs["a"].status = 200
        # the only carrier down: the same
        assert set(served(ask(g, "ad-dead", 8))) <= {"a", "b", "c"}
        # carried by every instance: the base's own upstream
        assert set(served(ask(g, "ad-all", 9))) <= {"a", "b", "c"}
        assert {e["upstream"] for e in g.log()[-9:]} == {"m_tiny_qwen3"}
        # a drained carrier: the drain walks the adapter's upstream like any of the base's
        g.cli("drain", "a")
        assert set(served(ask(g, "ad-sub", 6))) <= {"b", "c"}
        assert {e["upstream"] for e in g.log()[-6:]} == {"m_tiny_qwen3__lora_ad_sub__x__a"}
        g.cli("undrain", "a")
        assert set(served(ask(g, "ad-sub", 3))) == {"a"}

        # GET /v1/models: every model followed by its adapters, each with its parent
        st, doc = http_json("GET", g.url + "/v1/models")
        assert st == 200
        assert [(m["id"], m["parent"], m["root"]) for m in doc["data"]] == [
            (BASE, None, BASE),
            ("ad-all", BASE, "ad-all"),
            ("ad-dead", BASE, "ad-dead"),
            ("ad-sub", BASE, "ad-sub"),
        ]
        assert doc["data"][3] == {
            "id": "ad-sub",
            "object": "model",
            "created": 0,
            "owned_by": "vllm-fleet",
            "root": "ad-sub",
            "parent": BASE,
        }
        assert http_json("GET", g.url + "/v1/models/ad-sub") == (200, doc["data"][3])
        st, one = http_json("GET", g.url + "/models/ad-sub/v1/models")
        assert st == 200 and [m["id"] for m in one["data"]] == ["ad-sub"]
        st, anth = http_json("GET", g.url + "/v1/models", headers={"anthropic-version": "2023-06-01"})
        assert st == 200 and [m["id"] for m in anth["data"]] == [BASE, "ad-all", "ad-dead", "ad-sub"]
        assert anth["last_id"] == "ad-sub" and anth["data"][1]["type"] == "model"
        st, anth1 = http_json(
            "GET", g.url + "/v1/models/ad-dead", headers={"anthropic-version": "2023-06-01"}
        )
        assert st == 200 and anth1["id"] == "ad-dead" and anth1["display_name"] == "ad-dead"

        # an unknown adapter: the model's 404, in every form
        for st, err in (
            ask(g, "ad-nope")[0],
            ask(g, "ad-nope", path="/models/ad-nope/v1/chat/completions")[0],
            http_json("GET", g.url + "/v1/models/ad-nope"),
        ):
            assert st == 404 and err["error"]["code"] == "model_not_found", err
        # the message names what is served: the models and their adapters
        assert f"(served: {BASE}, ad-all, ad-dead, ad-sub)" in ask(g, "ad-nope")[0][1]["error"]["message"]
        st, err = http_json(
            "POST", g.url + "/v1/messages", {"model": "ad-nope", "max_tokens": 2, "messages": []}
        )
        assert st == 404 and err["type"] == "error" and err["error"]["type"] == "not_found_error", err
    finally:
        g.stop()


def test_the_base_s_canary_takes_its_share_of_an_adapter_s_requests(
    stubs: dict[str, StubEngine], tmp_path: Path
) -> None:
    servers = [{"name": n, "port": stubs[n].port} for n in ("a", "b", "c")]
    rollout = {"model": BASE, "canary": {"name": "can", "port": stubs["d"].port}, "share": 0.25}
    g = _gateway(tmp_path, servers, [_ad("ad-sub", "a")], rollouts=[rollout])
    try:
        assert set(served(ask(g, "ad-sub", 10))) == {"a"}  # no lease: nothing for the canary
        g.cli("canary", "set", "can", "--share", "0.5", "--lease", "120")
        got = served(ask(g, "ad-sub", 60))
        assert set(got) == {"a", "d"} and 10 <= got.count("d") <= 50, got  # binomial(60, 0.5)
        log = g.log()[-60:]
        assert {e["upstream"] for e in log if e["track"] == "canary"} == {"vf_i_can"}
        assert {e["upstream"] for e in log if e["track"] == "stable"} == {"m_tiny_qwen3__lora_ad_sub"}
        stubs["d"].status = 503  # the canary full: the adapter's normal path, its carrier
        assert set(served(ask(g, "ad-sub", 20))) == {"a"}
    finally:
        g.stop()


ADMIN_REQUESTS = [
    # (method, path, body, headers)
    ("POST", "/v1/load_lora_adapter", {"lora_name": "evil", "lora_path": "/tmp/evil", "model": BASE}, {}),
    (
        "POST",
        "/v1/load_lora_adapter",
        {"lora_name": "evil", "lora_path": "/tmp/evil"},
        {"X-Model-Name": BASE},
    ),
    (
        "POST",
        "/v1/unload_lora_adapter",
        {"lora_name": "ad-sub", "model": "ad-sub"},
        {"X-Model-Name": "ad-sub"},
    ),
    ("POST", "/v1/load_lora_adapter/", {"model": BASE}, {}),
    ("POST", "/v1/load_lora_adapter?x=1", {"model": BASE}, {}),
    ("POST", "/v1/load%5Flora_adapter", {"model": BASE}, {}),
    ("POST", "/v1//load_lora_adapter", {"model": BASE}, {}),
    ("POST", "/V1/LOAD_LORA_ADAPTER", {"model": BASE}, {}),
    ("POST", f"/models/{BASE}/v1/load_lora_adapter", {"lora_name": "evil", "lora_path": "/tmp/evil"}, {}),
    ("POST", "/models/ad-sub/v1/unload_lora_adapter", {"lora_name": "ad-sub"}, {}),
    ("POST", f"/models/{BASE}/v1/unload_lora_adapter/", {"lora_name": "ad-sub"}, {}),
    ("POST", "/adapters", {"name": "evil", "src": "/tmp/evil"}, {"X-Model-Name": BASE}),
    ("DELETE", "/adapters/ad-sub", None, {"X-Model-Name": BASE}),
    ("POST", f"/models/{BASE}/adapters", {"name": "evil", "src": "/tmp/evil"}, {}),
    ("POST", "/sleep", {"model": BASE}, {"X-Model-Name": BASE}),
    ("POST", "/wake_up", {"model": BASE}, {}),
    ("GET", "/is_sleeping", None, {"X-Model-Name": BASE}),
    ("POST", "/collective_rpc", {"method": "x"}, {"X-Model-Name": BASE}),
    ("POST", "/reset_prefix_cache", {"model": BASE}, {}),
    ("POST", f"/models/{BASE}/reset_prefix_cache", {}, {}),
    ("POST", f"/models/{BASE}/sleep", {}, {}),
]


def test_engine_admin_paths_are_never_forwarded(stubs: dict[str, StubEngine], tmp_path: Path) -> None:
    servers = [{"name": n, "port": stubs[n].port} for n in ("a", "b")]
    g = _gateway(tmp_path, servers, [_ad("ad-sub", "a")])
    try:
        for method, path, body, headers in ADMIN_REQUESTS:
            st, err = raw(g, method, path, json.dumps(body).encode() if body is not None else b"", **headers)
            assert st == 404, (method, path, st, err)
            assert isinstance(err, dict) and err["error"]["type"] == "invalid_request_error", (path, err)
            assert (
                err["error"]["code"] in ("not_found", "model_not_found")
                and "Unknown path" in (err["error"]["message"])
            ), (path, err)
        # what the engines do serve still passes, in every form
        assert served(ask(g, "ad-sub", 1)) == ["a"]
        for path in (
            "/tokenize",
            f"/models/{BASE}/tokenize",
            "/v1/completions",
            f"/models/{BASE}/v1/embeddings",
        ):
            st, b = raw(
                g, "POST", path, json.dumps({"model": BASE, "prompt": "x"}).encode(), **{"X-Model-Name": BASE}
            )
            assert st == 200 and b["path"] == path.removeprefix(f"/models/{BASE}"), (path, b)
        reached = [p for s in stubs.values() for _, p in s.seen]
        assert reached and not [p for p in reached if re.match(ENGINE_ADMIN_PATH_RE, p, re.IGNORECASE)]
    finally:
        g.stop()


CA = {"policy": "cache_aware", "max_conns": 8}


def test_cache_aware_keeps_an_adapter_on_one_engine_and_apart_from_another(
    stubs: dict[str, StubEngine], tmp_path: Path
) -> None:
    servers = [{"name": n, "port": stubs[n].port, "routing": CA} for n in ("a", "b", "c", "d")]
    ads = [_ad("ad-x", "a", "b", "c"), _ad("ad-y", "a", "b", "c")]
    g = _gateway(tmp_path, servers, ads)
    try:
        where: dict[tuple[str, int], set[str]] = {}
        keys: dict[tuple[str, int], set[str]] = {}
        for _turn in range(3):
            for p in range(8):
                for model in ("ad-x", "ad-y", BASE):
                    (who,) = served(ask(g, model, 1, prompt=f"You are the assistant of tenant {p}. " * 20))
                    where.setdefault((model, p), set()).add(who)
                    keys.setdefault((model, p), set()).add(g.log()[-1]["prefix_key"])
        # one engine per adapter and prompt, over every turn; only the carriers
        assert all(len(w) == 1 for w in where.values()), where
        assert set().union(*(where[("ad-x", p)] | where[("ad-y", p)] for p in range(8))) <= {"a", "b", "c"}
        # the adapter's name is in the key: same prompt, three keys; and the two adapters part somewhere
        for p in range(8):
            assert len(keys[("ad-x", p)] | keys[("ad-y", p)] | keys[(BASE, p)]) == 3
        assert any(where[("ad-x", p)] != where[("ad-y", p)] for p in range(8)), where
        # both adapters: one upstream of their carriers (the same servers), its cache-aware twin
        assert {e["upstream"] for e in g.log() if e["model"] != BASE} == {"m_tiny_qwen3__lora_ad_x__ca"}
    finally:
        g.stop()


KEYS = {"open": "sk-open-" + "o" * 32, "basic": "sk-basic-" + "b" * 32, "lora": "sk-lora-" + "l" * 32}


def _metrics(g: Gateway) -> dict[str, float]:
    with urllib.request.urlopen(g.admission_metrics_url, timeout=5) as r:
        text = r.read().decode()
    return {
        k: float(v)
        for line in text.splitlines()
        if line and not line.startswith("#")
        for k, _, v in [line.rpartition(" ")]
    }


def test_per_key_permissions_and_the_base_s_capacity(stubs: dict[str, StubEngine], tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("".join(f'"{k}" {client};\n' for client, k in KEYS.items()))
    bound = {"max_num_seqs": 1, "max_num_queued_reqs": 1}  # each engine holds 1: the model's capacity is 2
    servers = [{"name": n, "port": stubs[n].port, **bound} for n in ("a", "b")]
    g = _gateway(
        tmp_path,
        servers,
        [_ad("ad-x", "a"), _ad("ad-y", "a")],
        api_keys_file=str(keys),
        clients={"basic": {"models": [BASE]}, "lora": {"models": [BASE, "ad-x"]}},
        limits={"queue_wait_seconds": 20, "default_key": {"max_in_flight": 8}},
    )

    def key(client: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {KEYS[client]}"}

    try:
        # a key whose models name the base only may not use its adapters; one that names an adapter may
        for client, model, want in [
            ("basic", BASE, 200),
            ("basic", "ad-x", 403),
            ("lora", "ad-x", 200),
            ("lora", "ad-y", 403),
            ("open", "ad-x", 200),
            ("open", "ad-y", 200),
        ]:
            ((st, b),) = ask(g, model, **key(client))
            assert st == want, (client, model, b)
            if want == 403:
                assert b["error"]["code"] == "model_not_allowed", b
            elif model != BASE:
                assert b["served_by"] == "a" and b["model"] == model, b  # the adapters' carrier
        st, err = http_json(
            "POST",
            g.url + "/v1/messages",
            {"model": "ad-x", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
            headers=key("basic"),
        )
        assert st == 403 and err["error"]["type"] == "permission_error", err  # the Anthropic form
        ((st, err),) = ask(g, "ad-nope", **key("open"))
        assert st == 404 and err["error"]["code"] == "model_not_found"

        # the admission service counts adapters against their base: two adapter requests fill the model
        m = _metrics(g)
        assert m['vllm_fleet_gateway_route_capacity{model="tiny-qwen3"}'] == 2
        assert not [k for k in m if "ad-x" in k or "ad-y" in k]
        for s in stubs.values():
            s.delay = 2.0
        held = [
            threading.Thread(target=ask, args=(g, ad), kwargs=key("open"), daemon=True)
            for ad in ("ad-x", "ad-y")
        ]
        for t in held:
            t.start()
        assert wait_for(
            lambda: _metrics(g).get('vllm_fleet_gateway_route_in_flight{model="tiny-qwen3"}') == 2, 5, 0.05
        )
        t0 = time.monotonic()
        ((st, _),) = ask(g, BASE, **key("open"))  # waits in the gateway for a slot an adapter holds
        waited = time.monotonic() - t0
        for t in held:
            t.join(30)
        assert st == 200 and waited >= 1.0, waited
        assert not [k for k in _metrics(g) if "ad-x" in k or "ad-y" in k]
    finally:
        g.stop()
