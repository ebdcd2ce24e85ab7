"""LoRA adapters in the gateway's routing table (routes.py) and its rendered files; the engines'
administration paths (contracts.ENGINE_ADMIN_PATHS) in nginx's config. Behaviour through the real nginx:
tests/integration/test_gateway_adapters_nginx.py."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from vllm_fleet.contracts import ENGINE_ADMIN_PATH_RE, ENGINE_ADMIN_PATHS
from vllm_fleet.devtools.gateway_nginx import HAVE_NGINX, NginxGateway
from vllm_fleet.devtools.gateway_testing import gateway_spec, route_upstream
from vllm_fleet.fleet.render import render_fleet, render_host
from vllm_fleet.fleet.routes import SUMMARY_KEYS, gateway_routes, route_index
from vllm_fleet.fleet.spec import load_spec

REPO = Path(__file__).resolve().parents[2]
needs_nginx = pytest.mark.skipif(not HAVE_NGINX, reason="nginx + libnginx-mod-http-js needed")


def _ad(name: str, *carriers: str, base: str = "m") -> dict[str, Any]:
    return {"name": name, "base": base, "carriers": list(carriers), "rank": 8}


# three primaries and a backup
FOUR = [
    ("a", "primary", "default"),
    ("b", "primary", "default"),
    ("c", "primary", "default"),
    ("d", "backup", "default"),
]


def _servers(rt: dict[str, Any], name: str) -> list[tuple[str, bool]]:
    (up,) = [u for u in rt["upstreams"] if u["name"] == name]
    return [(s["instance"], s["backup"]) for s in up["servers"]]


def test_an_adapter_carried_by_every_primary_routes_as_its_base() -> None:
    """Carried by the instances the base's main upstream serves first: no upstream of its own."""
    (rt,) = gateway_routes(
        [route_upstream(FOUR)], {}, [_ad("all", "a", "b", "c"), _ad("every", "a", "b", "c", "d")]
    )
    assert rt["adapters"] == {"all": "m_m", "every": "m_m"}
    assert [u["name"] for u in rt["upstreams"]] == ["m_m"]


def test_an_adapter_carried_by_some_gets_its_carriers_first_and_the_rest_as_backup() -> None:
    ads = [_ad("one", "b"), _ad("two", "a", "c"), _ad("same", "c", "a"), _ad("bk", "d")]
    (rt,) = gateway_routes([route_upstream(FOUR)], {}, ads)
    assert rt["adapters"] == {
        "one": "m_m__lora_one",
        "two": "m_m__lora_same",  # the same servers as "same" (first by name): one upstream for both
        "same": "m_m__lora_same",
        "bk": "m_m__lora_bk",  # a backup instance that carries it comes first when no primary does
    }
    assert _servers(rt, "m_m__lora_one") == [("b", False), ("a", True), ("c", True), ("d", True)]
    assert _servers(rt, "m_m__lora_same") == [("a", False), ("c", False), ("b", True), ("d", True)]
    assert _servers(rt, "m_m__lora_bk") == [("d", False), ("a", True), ("b", True), ("c", True)]
    assert rt["default"] == "m_m" and rt["ca"] == {}  # least_conn: no cache-aware twins


def test_canary_and_fallback_are_never_servers_of_an_adapter_upstream() -> None:
    servers = [*FOUR, ("cpu", "fallback", "cpu"), ("can", "canary", "default")]
    (rt,) = gateway_routes([route_upstream(servers)], {}, [_ad("x", "a", "can", "cpu")])
    assert _servers(rt, "m_m__lora_x") == [("a", False), ("b", True), ("c", True), ("d", True)]
    assert rt["fallback"] == "m_m__fallback" and rt["canary"]["instance"] == "can"
    # carried only by instances outside the main upstream: routed as the base
    (rt,) = gateway_routes([route_upstream(servers)], {}, [_ad("y", "can", "cpu"), _ad("z")])
    assert rt["adapters"] == {"y": "m_m", "z": "m_m"}


def test_cache_aware_twin_for_two_carriers_or_more() -> None:
    (rt,) = gateway_routes([route_upstream(FOUR, "cache_aware")], {}, [_ad("one", "b"), _ad("two", "a", "c")])
    assert rt["ca"] == {
        "m_m": "m_m__ca",
        "m_m__lora_two": "m_m__lora_two__ca",
    }  # one carrier: nothing to choose
    (twin,) = [u for u in rt["ca_upstreams"] if u["of"] == "m_m__lora_two"]
    assert [s["instance"] for s in twin["servers"]] == ["a", "c"]


def test_pools_stay_the_base_s_for_an_adapter_routed_as_its_base() -> None:
    servers = [("a", "primary", "default"), ("b", "primary", "high"), ("c", "primary", "default")]
    (rt,) = gateway_routes([route_upstream(servers)], {}, [_ad("all", "a", "b", "c"), _ad("some", "b")])
    assert rt["default"] == "m_m__default" and rt["adapters"]["all"] == "m_m__default"
    assert rt["adapters"]["some"] == "m_m__lora_some"
    assert _servers(rt, "m_m__lora_some") == [("b", False), ("a", True), ("c", True)]


def test_the_index_finds_an_adapter_at_its_base_and_the_summary_stays_small() -> None:
    ups = [
        route_upstream(FOUR),
        dict(route_upstream([("e", "primary", "default")]), model="n", upstream="m_n"),
    ]
    routes = gateway_routes(ups, {"m": 512}, [_ad("x", "a"), _ad("y", "e", base="n")])
    idx = route_index(routes)
    assert idx["index"] == {"m": 0, "x": 0, "n": 1, "y": 1}
    assert [s["adapters"] for s in idx["models"]] == [{"x": "m_m__lora_x"}, {"y": "m_n"}]
    for s in idx["models"]:
        assert set(s) == set(SUMMARY_KEYS) and "upstreams" not in s


@pytest.mark.parametrize(
    "ads,field",
    [
        ([_ad("m", "a")], "adapters[0].name"),  # a served model's name
        ([_ad("x", "a"), _ad("x", "b")], "adapters[1].name"),
        ([_ad("x", "a", base="nope")], "adapters[0].base"),
        ([_ad("x", "a", "zz")], "adapters[0].instances"),
    ],
)
def test_refused_adapters_name_the_field(ads: list[dict[str, Any]], field: str) -> None:
    with pytest.raises(ValueError, match=re.escape(field)):
        gateway_routes([route_upstream(FOUR)], {}, ads)


@pytest.mark.parametrize(
    "path,admin",
    [
        *[(p, True) for p in ENGINE_ADMIN_PATHS],
        ("/adapters/tiny-sql", True),
        ("/v1/load_lora_adapter/", True),
        ("/V1/Load_LoRA_Adapter", True),
        ("/v1/chat/completions", False),
        ("/v1/models", False),
        ("/adaptersx", False),
        ("/v1/load_lora_adapters", False),
        ("/tokenize", False),
        ("/invocations", False),
    ],
)
def test_engine_admin_path_re(path: str, admin: bool) -> None:
    assert bool(re.match(ENGINE_ADMIN_PATH_RE, path, re.IGNORECASE)) is admin


def _render_with_adapters(tmp: Path, adapters: list[dict[str, Any]], **gw: Any) -> Path:
    """Render a stub fleet (primaries a, b, c, backup d) with the spec's ``adapters`` into tmp/out; returns the
    gateway host's /etc/nginx."""
    servers = [{"name": n, "port": 9101 + i} for i, n in enumerate("abc")]
    servers.append({"name": "d", "port": 9104, "role": "backup"})
    render_fleet(gateway_spec(servers, tmp, adapters=adapters, **gw), tmp / "out")
    return tmp / "out" / "h1" / "etc" / "nginx"


def _spec_ad(name: str, *carriers: str) -> dict[str, Any]:
    return {"name": name, "instances": list(carriers)}


def test_rendered_files_carry_the_adapter_upstreams(tmp_path: Path) -> None:
    etc = _render_with_adapters(tmp_path, [_spec_ad("ad-sub", "a"), _spec_ad("ad-all", "a", "b", "c")])
    doc = json.loads((etc / "vllm-fleet" / "routes.json").read_text())
    assert doc["index"] == {"tiny-qwen3": 0, "ad-sub": 0, "ad-all": 0}
    assert doc["models"][0]["adapters"] == {"ad-sub": "m_tiny_qwen3__lora_ad_sub", "ad-all": "m_tiny_qwen3"}
    ups = (etc / "vllm-fleet" / "upstreams.conf").read_text()
    block = ups.split("upstream m_tiny_qwen3__lora_ad_sub {", 1)[1].split("}", 1)[0]
    assert re.findall(r"server 127\.0\.0\.1:(\d+) .*?(backup)?;", block) == [
        ("9101", ""),
        ("9102", "backup"),
        ("9103", "backup"),
        ("9104", "backup"),
    ]
    conf = (etc / "conf.d" / "vllm-fleet.conf").read_text()
    for loc in ("/_vf/m_tiny_qwen3__lora_ad_sub/", "@vf_spill_m_tiny_qwen3__lora_ad_sub"):
        assert f"location {loc} " in conf
    assert '"model":"$vf_model","base":"$vf_base"' in conf  # the log names the adapter and its base
    assert f'location ~* "{ENGINE_ADMIN_PATH_RE}" {{' in conf
    js = (etc / "vllm-fleet" / "router.js").read_text()
    assert f"new RegExp({json.dumps(ENGINE_ADMIN_PATH_RE)}, 'i')" in js and "ad-sub" not in js


def test_the_lora_example_routes_tiny_chat_to_its_carrier_first() -> None:
    spec = load_spec(REPO / "examples" / "tiny-cpu-lora.yml")
    files = {r.dest: r.content for r in render_host(spec, spec.gateway_host)}
    doc = json.loads(files["/etc/nginx/vllm-fleet/routes.json"])
    assert doc["index"] == {"tiny-qwen3": 0, "tiny-chat": 0, "tiny-sql": 0}
    (rt,) = doc["routes"]
    assert rt["adapters"] == {"tiny-chat": "m_tiny_qwen3__lora_tiny_chat", "tiny-sql": "m_tiny_qwen3"}
    assert _servers(rt, "m_tiny_qwen3__lora_tiny_chat") == [("tiny-b", False), ("tiny-a", True)]


@needs_nginx
def test_nginx_t_accepts_a_fleet_with_adapters(tmp_path: Path) -> None:
    ads = [_spec_ad("ad-sub", "a"), _spec_ad("ad-two", "a", "b"), _spec_ad("ad-all", "a", "b", "c")]
    etc = _render_with_adapters(
        tmp_path, ads, limits={"default_key": {"max_in_flight": 4}}, api_keys_file="/dev/null"
    )
    conf = (etc / "conf.d" / "vllm-fleet.conf").read_text()
    # gateway.limits: the admission service counts an adapter's request against its base's capacity
    assert "proxy_set_header X-VF-Model $vf_base;" in conf and "auth_request /_vf_admit;" in conf
    r = NginxGateway(etc, tmp_path / "prefix").check()
    assert r.returncode == 0, r.stderr
