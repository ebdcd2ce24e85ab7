"""Gateway rendering: routing table (routes.json), upstream file, drain state, and `nginx -t` of the rendered config."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from vllm_fleet.contracts import ENGINE_HTTP_KEEPALIVE_SECONDS, GATEWAY_UPSTREAM_KEEPALIVE_SECONDS
from vllm_fleet.devtools.gateway_nginx import HAVE_NGINX, NginxGateway
from vllm_fleet.devtools.gateway_testing import gateway_spec
from vllm_fleet.fleet.context import build_context
from vllm_fleet.fleet.render import make_env, render_fleet, render_host
from vllm_fleet.fleet.routes import SUMMARY_KEYS, gateway_routes, route_index
from vllm_fleet.fleet.spec import Routing, load_spec
from vllm_fleet.host.drain import DrainError, instances, load_routes, set_drained, stranded_models

REPO = Path(__file__).resolve().parents[2]
needs_nginx = pytest.mark.skipif(not HAVE_NGINX, reason="nginx + libnginx-mod-http-js not installed")


def _up(model: str, upstream: str, servers: list[dict[str, object]]) -> dict[str, object]:
    """An upstream as context.upstreams makes it: with the model's routing (here the spec's defaults)."""
    return {"model": model, "upstream": upstream, "servers": servers, "routing": Routing().model_dump()}


def _servers(*specs: tuple[str, str, str]) -> list[dict[str, object]]:
    return [
        {"instance": n, "address": f"127.0.0.1:{8100 + i}", "role": role, "pool": pool, "drained": False}
        for i, (n, role, pool) in enumerate(specs)
    ]


def test_routes_primary_backup_single_pool() -> None:
    ups = [_up("m", "m_m", _servers(("a", "primary", "default"), ("b", "backup", "default")))]
    (rt,) = gateway_routes(ups, {"m": 1024})
    assert rt["default"] == rt["upstream"] == "m_m"
    assert rt["pools"] == {} and rt["fallback"] == ""
    (up,) = rt["upstreams"]
    assert [(s["instance"], s["backup"]) for s in up["servers"]] == [("a", False), ("b", True)]
    assert rt["max_model_len"] == 1024


def test_routes_pools_and_fallback() -> None:
    servers = _servers(
        ("a", "primary", "default"),
        ("b", "primary", "high"),
        ("c", "backup", "default"),
        ("d", "fallback", "cpu"),
    )
    (rt,) = gateway_routes([_up("m", "m_m", servers)], {})
    assert rt["pools"] == {"default": "m_m__default", "high": "m_m__high"}
    assert rt["default"] == "m_m__default"
    assert rt["fallback"] == "m_m__fallback"
    by = {u["name"]: [(s["instance"], s["backup"]) for s in u["servers"]] for u in rt["upstreams"]}
    assert by["m_m"] == [("a", False), ("b", False), ("c", True)]
    # the high pool first, every other GPU instance as nginx backup; the fallback never in a GPU upstream
    assert by["m_m__high"] == [("b", False), ("a", True), ("c", True)]
    assert by["m_m__fallback"] == [("d", False)]


def test_routes_only_fallback_and_name_collisions() -> None:
    ups = [
        _up("x.y", "m_x_y", _servers(("a", "fallback", "default"))),
        _up("x_y", "m_x_y", _servers(("b", "primary", "default"))),
    ]
    r1, r2 = gateway_routes(ups, {})
    assert r1["fallback"] == "" and r1["upstreams"][0]["servers"][0]["backup"] is False
    assert r1["upstream"] != r2["upstream"]


def test_the_index_finds_each_model_and_its_summary_has_no_servers() -> None:
    """What the router reads for every request: the model's position by name and a summary whose size does
    not depend on the model's instances (the server lists stay in routes, read only while drained)."""
    ups = [
        _up(f"m{k}", f"m_m{k}", _servers(*[(f"i{k}-{j}", "primary", "default") for j in range(n)]))
        for k, n in enumerate((1, 50))
    ]
    routes = gateway_routes(ups, {"m0": 512, "m1": 512})
    idx = route_index(routes)
    assert idx["index"] == {"m0": 0, "m1": 1}
    for name, i in idx["index"].items():
        assert routes[i]["model"] == idx["models"][i]["model"] == name
        assert set(idx["models"][i]) == set(SUMMARY_KEYS)
        assert all(idx["models"][i][k] == routes[i][k] for k in SUMMARY_KEYS)
    assert len(json.dumps(idx["models"][0])) == len(json.dumps(idx["models"][1]))


def _render(spec_path: Path, host: str) -> dict[str, str]:
    spec = load_spec(spec_path)
    return {r.dest: r.content for r in render_host(spec, host)}


@pytest.mark.parametrize("example,host", [("tiny-cpu.yml", "h1"), ("seed-004-4xa100.yml", "gpu-a")])
def test_examples_render_gateway(example: str, host: str) -> None:
    files = _render(REPO / "examples" / example, host)
    conf = files["/etc/nginx/conf.d/vllm-fleet.conf"]
    ups = files["/etc/nginx/vllm-fleet/upstreams.conf"]
    js = files["/etc/nginx/vllm-fleet/router.js"]
    doc = json.loads(files["/etc/nginx/vllm-fleet/routes.json"])
    routes = doc["routes"]
    assert doc["index"] == {rt["model"]: i for i, rt in enumerate(routes)}
    assert [m["model"] for m in doc["models"]] == [rt["model"] for rt in routes]
    assert "Ansible managed" in conf and "Ansible managed" in ups and "Ansible managed" in js
    assert "proxy_buffering off;" in conf and 'proxy_set_header Connection "";' in conf
    assert "proxy_http_version 1.1;" in conf and "stub_status;" in conf
    assert "least_conn;" in ups and "keepalive 32;" in ups and "zone " in ups
    spec = load_spec(REPO / "examples" / example)
    assert instances(routes).keys() == {m.name for m in spec.models}
    for m in spec.models:
        assert f"server {instances(routes)[m.name]} " in ups
        assert m.served_model_name in {rt["model"] for rt in routes}
    assert "vf_routes" in js and "Qwen" not in js  # the router holds no fleet data


def _downs(text: str) -> set[str]:
    return {ln.split()[1] for ln in text.splitlines() if ln.strip().startswith("server ") and " down;" in ln}


def test_drained_from_spec_only(tmp_path: Path) -> None:
    """gateway.drained of the spec is rendered as `down`; nothing else (the Ansible role passes no drained set)."""
    spec = gateway_spec([{"name": "a", "port": 9001}, {"name": "b", "port": 9002}], tmp_path, drained=["a"])
    ctx = build_context(spec, "h1")
    tpl = make_env().get_template("nginx/upstreams.conf.j2")
    text = tpl.render(**ctx)
    assert _downs(text) == {"127.0.0.1:9001"}
    assert tpl.render(**ctx, vllm_fleet_gateway_drained=["b"]) == text


def test_instances_and_stranded_models_from_routes(tmp_path: Path) -> None:
    spec = gateway_spec(
        [
            {"name": "a", "port": 9001},
            {"name": "b", "port": 9002, "pool": "high"},
            {"name": "c", "port": 9003, "role": "backup"},
        ],
        tmp_path,
    )
    routes = build_context(spec, "h1")["vf"]["gateway_routes"]
    assert instances(routes) == {"a": "127.0.0.1:9001", "b": "127.0.0.1:9002", "c": "127.0.0.1:9003"}
    assert stranded_models(routes) == [] and stranded_models(routes, {"a", "c"}) == []
    assert stranded_models(routes, {"a", "b", "c"}) == ["tiny-qwen3"]


@pytest.fixture
def rendered(tmp_path: Path) -> NginxGateway:
    keys = tmp_path / "keys"
    keys.write_text('"sk-unit" unit;\n')
    spec = gateway_spec(
        [
            {"name": "a", "port": 9001},
            {"name": "b", "port": 9002, "pool": "high"},
            {"name": "c", "port": 9003, "role": "backup"},
            {"name": "d", "port": 9004, "role": "fallback"},
            {"name": "q", "port": 9005, "served_model_name": "Qwen/Qwen3-8B"},
        ],
        tmp_path,
        api_keys_file=str(keys),
        rate_limit={"per_key_rps": 0.5, "per_ip_rps": 2.5},
    )
    render_fleet(spec, tmp_path / "out")
    return NginxGateway(tmp_path / "out" / "h1" / "etc" / "nginx", tmp_path / "prefix")


@needs_nginx
def test_nginx_t_accepts_rendered_config(rendered: NginxGateway) -> None:
    r = rendered.check()
    assert r.returncode == 0, r.stderr
    conf = (rendered.etc_nginx / "conf.d" / "vllm-fleet.conf").read_text()
    assert "rate=30r/m" in conf and "rate=150r/m" in conf  # fractional r/s become r/m


@needs_nginx
def test_nginx_t_rejects_a_broken_config(rendered: NginxGateway) -> None:
    """The check can fail: a broken upstream file is refused."""
    ups = rendered.upstreams_file
    good = ups.read_text()
    ups.write_text(good.replace("least_conn;", "least_conn_typo;", 1))
    assert rendered.check().returncode != 0
    ups.write_text(good)


def _routes_file(g: NginxGateway) -> Path:
    return g.etc_nginx / "vllm-fleet" / "routes.json"


def _rendered_files(g: NginxGateway) -> dict[str, str]:
    return {str(p): p.read_text() for p in sorted(g.etc_nginx.rglob("*")) if p.is_file()}


def test_set_drained_checks_and_refuses(rendered: NginxGateway, tmp_path: Path) -> None:
    state = tmp_path / "drained.json"
    routes = _routes_file(rendered)
    fresh = _rendered_files(rendered)
    assert set_drained("a", True, routes, state) == {"a"}
    assert json.loads(state.read_text())["drained"] == ["a"]
    assert set_drained("b", True, routes, state) == {"a", "b"}
    assert set_drained("c", True, routes, state) == {"a", "b", "c"}
    with pytest.raises(DrainError) as exc:  # d is the model's last server in rotation
        set_drained("d", True, routes, state)
    assert exc.value.code == 3
    assert json.loads(state.read_text())["drained"] == ["a", "b", "c"]  # a refusal writes nothing
    assert set_drained("d", True, routes, state, force=True) == {"a", "b", "c", "d"}
    with pytest.raises(DrainError) as exc:
        set_drained("nope", True, routes, state)
    assert exc.value.code == 1 and "unknown instance" in str(exc.value)
    assert set_drained("b", False, routes, state) == {"a", "c", "d"}
    assert set_drained("b", False, routes, state) == {"a", "c", "d"}  # undrain twice: no error
    # no rendered file was touched, and no temp file is left next to the state file
    assert _rendered_files(rendered) == fresh
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".drained")] == []


def test_state_survives_a_re_render_and_forgets_removed_instances(
    rendered: NginxGateway, tmp_path: Path
) -> None:
    """The drained set is not in any rendered file: a re-render (or an Ansible run) cannot lose it; names no
    longer in routes.json are dropped at the next drain/undrain."""
    state = tmp_path / "drained.json"
    routes = _routes_file(rendered)
    set_drained("b", True, routes, state)
    state.write_text(json.dumps({"drained": ["b", "gone"]}))
    assert set_drained("c", True, routes, state) == {"b", "c"}


def test_broken_state_file_is_an_error_not_a_guess(rendered: NginxGateway, tmp_path: Path) -> None:
    state = tmp_path / "drained.json"
    state.write_text("{not json")
    with pytest.raises(DrainError):
        set_drained("a", True, _routes_file(rendered), state)
    with pytest.raises(DrainError):
        load_routes(state)


def test_config_is_linear_in_the_instances(tmp_path: Path) -> None:
    """No per-instance copies of upstreams: with one model, N primaries and a backup, upstreams.conf has
    3 × (N + 1) server lines in the model upstream and its spill and fresh twins, plus one one-server upstream
    each."""
    for n in (2, 8, 32):
        servers = [{"name": f"p{i}", "port": 9000 + i} for i in range(n)]
        servers.append({"name": "bk", "port": 8999, "role": "backup"})
        spec = gateway_spec(servers, tmp_path)
        ups = {r.dest: r.content for r in render_host(spec, "h1")}["/etc/nginx/vllm-fleet/upstreams.conf"]
        assert sum(ln.strip().startswith("server ") for ln in ups.splitlines()) == 3 * (n + 1)
        assert ups.count(" { server ") == n + 1
        (rt,) = build_context(spec, "h1")["vf"]["gateway_routes"]
        assert sorted(rt["solo"]) == sorted(s["name"] for s in servers)
        assert "variants" not in rt and len(rt["upstreams"]) == 1


def test_retry_policy_follows_the_spec(tmp_path: Path) -> None:
    for flag in (True, False):
        spec = gateway_spec([{"name": "a", "port": 9001}], tmp_path, retry_non_idempotent=flag)
        conf = {r.dest: r.content for r in render_host(spec, "h1")}["/etc/nginx/conf.d/vllm-fleet.conf"]
        assert ("non_idempotent" in conf.split("proxy_next_upstream error")[1].splitlines()[0]) is flag
        assert "proxy_next_upstream_tries 3;" in conf and "proxy_next_upstream_timeout 10s;" in conf


def _blocks(text: str, opener: str) -> dict[str, str]:
    """The ``opener NAME { ... }`` blocks of a rendered nginx file by name (their bodies, braces counted)."""
    out: dict[str, str] = {}
    for m in re.finditer(rf"^\s*{opener} (\S+) {{", text, re.M):
        depth, k = 1, m.end()
        while depth:
            depth += {"{": 1, "}": -1}.get(text[k], 0)
            k += 1
        out[m.group(1)] = text[m.end() : k - 1]
    return out


def test_upstream_keep_alive_is_closed_by_nginx_long_before_the_engine(tmp_path: Path) -> None:
    """The keep-alive contract (vllm_fleet/contracts.py): every pooled upstream gives an idle connection up after
    GATEWAY_UPSTREAM_KEEPALIVE_SECONDS, the engines (VLLM_HTTP_TIMEOUT_KEEP_ALIVE in their environment) only
    after ENGINE_HTTP_KEEPALIVE_SECONDS, far longer; the __fresh twins pool nothing."""
    spec = gateway_spec(
        [
            {"name": "a", "port": 9001},
            {"name": "b", "port": 9002},
            {"name": "d", "port": 9004, "role": "fallback"},
        ],
        tmp_path,
    )
    files = {r.dest: r.content for r in render_host(spec, "h1")}
    ups = _blocks(files["/etc/nginx/vllm-fleet/upstreams.conf"], "upstream")
    assert {
        "m_tiny_qwen3",
        "m_tiny_qwen3__spill",
        "m_tiny_qwen3__fresh",
        "m_tiny_qwen3__fallback__fresh",
    } <= set(ups)
    for name, body in ups.items():
        if name.endswith("__fresh"):
            assert "keepalive" not in body and "max_fails=0" in body, name
        else:
            assert f"keepalive_timeout {GATEWAY_UPSTREAM_KEEPALIVE_SECONDS}s;" in body, name
    assert ENGINE_HTTP_KEEPALIVE_SECONDS >= GATEWAY_UPSTREAM_KEEPALIVE_SECONDS + 60
    for m in spec.models:
        cfg = json.loads(files[f"{spec.paths.config_dir}/instances/{m.name}.json"])
        assert cfg["environment"]["VLLM_HTTP_TIMEOUT_KEEP_ALIVE"] == str(ENGINE_HTTP_KEEPALIVE_SECONDS)


def test_a_pooled_connection_that_failed_gets_a_second_pass_on_new_ones(tmp_path: Path) -> None:
    """A 502 of a model's upstream or its spill-over goes to the router's respill, which sends the request once
    more over the __fresh twin or on to the fallback/JSON 502; the spill-over and the second pass retry a
    connection error (and a POST) only with retry_non_idempotent."""
    for flag in (True, False):
        spec = gateway_spec(
            [{"name": "a", "port": 9001}, {"name": "b", "port": 9002}], tmp_path, retry_non_idempotent=flag
        )
        conf = {r.dest: r.content for r in render_host(spec, "h1")}["/etc/nginx/conf.d/vllm-fleet.conf"]
        locs = _blocks(conf, "location")
        up = "m_tiny_qwen3"
        assert "error_page 502 = @vf_respill_" + up + ";" in locs[f"/_vf/{up}/"]
        assert "error_page 502 = @vf_respill_" + up + ";" in locs[f"@vf_spill_{up}"]
        respill = locs[f"@vf_respill_{up}"]
        assert f"set $vf_respill_of @vf_fresh_{up};" in respill and "set $vf_respill_to @vf_e502;" in respill
        assert "js_content vf.respill;" in respill
        fresh = locs[f"@vf_fresh_{up}"]
        assert f"proxy_pass http://{up}__fresh;" in fresh and "error_page 502 @vf_e502;" in fresh
        want = ("error timeout " if flag else "") + "http_503 non_idempotent;"
        for loc in (f"@vf_spill_{up}", f"@vf_fresh_{up}"):
            assert f"proxy_next_upstream {want}" in locs[loc], (flag, loc)
        # the drain walk: nginx retries a failed reused connection itself only with the flag
        assert ("non_idempotent" in locs["/_vfi/"].split("proxy_next_upstream ")[1].splitlines()[0]) is flag


def test_templates_do_not_depend_on_lstrip_blocks(tmp_path: Path) -> None:
    """Ansible's template module defaults to lstrip_blocks=False; the gateway templates render the same."""
    keys = tmp_path / "k"
    spec = gateway_spec(
        [
            {"name": "a", "port": 9001},
            {"name": "b", "port": 9002, "pool": "high"},
            {"name": "c", "port": 9003, "role": "fallback"},
        ],
        tmp_path,
        api_keys_file=str(keys),
        tls={"certificate": "/c.pem", "certificate_key": "/k.pem"},
        clients={"team-a": {"models": ["tiny-qwen3"], "pools": ["high"]}, "team-b": {"pools": ["default"]}},
    )
    ctx = build_context(spec, "h1")
    ours, ansible_like = make_env(REPO), make_env(REPO)
    ansible_like.lstrip_blocks = False
    for t in (
        "nginx/vllm-fleet.conf.j2",
        "nginx/upstreams.conf.j2",
        "nginx/routes.json.j2",
        "nginx/router.js.j2",
    ):
        assert ours.get_template(t).render(**ctx) == ansible_like.get_template(t).render(**ctx), t


def test_the_router_finds_a_missing_state_file_without_a_throw() -> None:
    """njs 0.7.9 walks every global (the preloaded routing table too) to name a thrown error's backtrace:
    the per-request state-file read (gatewayState) lists the folder first instead of catching readFileSync's ENOENT."""
    js = _render(REPO / "examples" / "tiny-cpu.yml", "h1")["/etc/nginx/vllm-fleet/router.js"]
    body = js.split("function gatewayState() {", 1)[1].split("\n}\n", 1)[0]
    assert body.index("fs.readdirSync(STATE_DIR)") < body.index("fs.readFileSync(STATE_FILE")


@needs_nginx
def test_nginx_t_accepts_client_permissions_and_the_tls_redirect(tmp_path: Path) -> None:
    """gateway.clients (per-client models and pools) and tls with the plain port redirecting: nginx -t passes;
    the permission maps list each allowed pair, the redirect server answers only /health and a 308."""
    import subprocess

    keys = tmp_path / "keys"
    # as long as the role's generated keys and beyond (nginx's default map bucket refuses these)
    keys.write_text('"sk-unit" team-a;\n"' + "k" * 48 + '" team-a;\n"' + "x" * 160 + '" team-b;\n')
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=x",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)  # fmt: skip
    spec = gateway_spec(
        [{"name": "a", "port": 9001}, {"name": "b", "port": 9002, "pool": "high"}],
        tmp_path,
        api_keys_file=str(keys),
        tls={"certificate": str(cert), "certificate_key": str(key), "port": 9443},
        clients={"team-a": {"models": ["tiny-qwen3"], "pools": ["high"]}},
    )
    render_fleet(spec, tmp_path / "out")
    g = NginxGateway(tmp_path / "out" / "h1" / "etc" / "nginx", tmp_path / "prefix")
    r = g.check()
    assert r.returncode == 0, r.stderr
    conf = (g.etc_nginx / "conf.d" / "vllm-fleet.conf").read_text()
    assert '"team-a:tiny-qwen3" 0;' in conf and '"team-a:high" 0;' in conf
    assert "return 308 https://$host:9443$request_uri;" in conf
    assert conf.count(f"listen 127.0.0.1:{spec.gateway.port};") == 1  # the redirect server only


def test_open_gateway_only_when_asked_and_plan_warns(tmp_path: Path) -> None:
    """Authentication is the default; `gateway.auth: none` is needed for an open gateway, and plan warns."""
    from vllm_fleet.fleet.plan import make_plan
    from vllm_fleet.fleet.spec import SpecError, parse_spec

    spec = load_spec(REPO / "examples/tiny-cpu.yml")
    assert spec.gateway.auth == "api_keys" and spec.gateway.api_keys_file
    conf = {r.dest: r.content for r in render_host(spec, "h1")}["/etc/nginx/conf.d/vllm-fleet.conf"]
    assert f"include {spec.gateway.api_keys_file};" in conf and "return 401;" in conf
    assert not any("gateway.auth" in w for w in make_plan(spec).warnings)
    data = spec.model_dump(mode="json")
    data["gateway"]["api_keys_file"] = ""
    with pytest.raises(SpecError, match="auth: none"):
        parse_spec(data)
    data["gateway"]["auth"] = "none"
    open_spec = parse_spec(data)
    assert any("gateway.auth: none" in w for w in make_plan(open_spec).warnings)
    conf = {r.dest: r.content for r in render_host(open_spec, "h1")}["/etc/nginx/conf.d/vllm-fleet.conf"]
    assert "return 401;" not in conf


def test_cache_aware_renders_a_bounded_hash_twin_per_upstream(tmp_path: Path) -> None:
    """routing.policy cache_aware: per upstream of the model with two primaries or more (main, pools) a twin
    over its primaries only (nginx's hash takes no backup servers), `hash $vf_pkey consistent`, max_conns
    from routing.max_conns or max_num_seqs; least_conn models get none; nginx -t passes."""
    from vllm_fleet.fleet.spec import SpecError

    ca = {"policy": "cache_aware", "prefix_chars": 256}
    spec = gateway_spec(
        [
            {"name": "a", "port": 9001, "routing": ca, "max_num_seqs": 7},
            {"name": "b", "port": 9002, "routing": ca, "max_num_seqs": 7, "pool": "high"},
            {"name": "e", "port": 9006, "routing": ca, "max_num_seqs": 7, "pool": "high"},
            {"name": "c", "port": 9003, "routing": ca, "role": "backup"},
            {"name": "d", "port": 9004, "routing": ca, "role": "fallback"},
            {"name": "q", "port": 9005, "served_model_name": "other"},
            {"name": "r", "port": 9007, "served_model_name": "other"},
        ],
        tmp_path,
    )
    render_fleet(spec, tmp_path / "out")
    g = NginxGateway(tmp_path / "out" / "h1" / "etc" / "nginx", tmp_path / "prefix")
    routes = json.loads(_routes_file(g).read_text())
    tiny = routes["models"][routes["index"]["tiny-qwen3"]]
    assert tiny["policy"] == "cache_aware" and tiny["prefix_chars"] == 256
    # main (a, b, e) and the high pool (b, e); the default pool has one primary: nothing to choose
    assert tiny["ca"] == {"m_tiny_qwen3": "m_tiny_qwen3__ca", "m_tiny_qwen3__high": "m_tiny_qwen3__high__ca"}
    other = routes["models"][routes["index"]["other"]]
    assert other["policy"] == "least_conn" and other["ca"] == {}
    ups = g.upstreams_file.read_text()
    block = ups.split("upstream m_tiny_qwen3__ca {")[1].split("}")[0]
    assert "hash $vf_pkey consistent;" in block and "backup" not in block
    assert block.count("max_conns=7") == 3 and ":9003" not in block and ":9004" not in block
    assert ups.count("hash $vf_pkey") == 2
    if HAVE_NGINX:
        r = g.check()
        assert r.returncode == 0, r.stderr
    with pytest.raises(SpecError, match="share one routing policy"):
        gateway_spec(
            [
                {"name": "a", "port": 9001, "routing": ca},
                {"name": "b", "port": 9002, "routing": {"max_conns": 3}},
            ],
            tmp_path,
        )


def test_a_batch_size_change_under_least_conn_leaves_the_gateway_files_alone() -> None:
    """A flag change (max_num_seqs) restarts only that instance: under least_conn no gateway file depends on
    it, so nginx is not reloaded (a reload closes clients' idle keep-alive connections mid-rollout); under
    cache_aware the bound follows it (max_conns defaults to max_num_seqs)."""
    from vllm_fleet.fleet.spec import parse_spec

    data = load_spec(REPO / "examples/tiny-cpu-2hosts.yml").model_dump(mode="json")

    def gateway_files(d: dict[str, object]) -> dict[str, str]:
        spec = parse_spec(json.loads(json.dumps(d)))
        return {r.dest: r.content for r in render_host(spec, spec.gateway.host) if "/nginx/" in r.dest}

    before = gateway_files(data)
    data["models"][1]["max_num_seqs"] = 3
    assert gateway_files(data) == before
    for m in data["models"]:
        m["routing"] = {"policy": "cache_aware"}
    ca_before = gateway_files(data)
    data["models"][1]["max_num_seqs"] = 5
    changed = gateway_files(data)
    assert changed != ca_before and "max_conns=5" in "".join(changed.values())
