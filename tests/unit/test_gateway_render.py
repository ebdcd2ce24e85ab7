"""Gateway rendering: routing table, upstream file, drain edits, and `nginx -t` of the rendered config."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from vllm_fleet.devtools.gateway_nginx import JS_MODULE, NginxGateway
from vllm_fleet.devtools.gateway_testing import gateway_spec
from vllm_fleet.fleet.context import build_context
from vllm_fleet.fleet.render import make_env, render_fleet, render_host
from vllm_fleet.fleet.routes import gateway_routes
from vllm_fleet.fleet.spec import load_spec
from vllm_fleet.host.drain import (
    DrainError,
    apply_drained,
    instances,
    needs_marks,
    parse_upstreams,
    set_drained,
    stranded_models,
)

REPO = Path(__file__).resolve().parents[2]
HAVE_NGINX = shutil.which("nginx") is not None and Path(JS_MODULE).exists()
needs_nginx = pytest.mark.skipif(not HAVE_NGINX, reason="nginx + libnginx-mod-http-js not installed")


def _servers(*specs: tuple[str, str, str]) -> list[dict[str, object]]:
    return [
        {"instance": n, "address": f"127.0.0.1:{8100 + i}", "role": role, "pool": pool, "drained": False}
        for i, (n, role, pool) in enumerate(specs)
    ]


def test_routes_primary_backup_single_pool() -> None:
    ups = [
        {
            "model": "m",
            "upstream": "m_m",
            "servers": _servers(("a", "primary", "default"), ("b", "backup", "default")),
        }
    ]
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
    (rt,) = gateway_routes([{"model": "m", "upstream": "m_m", "servers": servers}], {})
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
        {"model": "x.y", "upstream": "m_x_y", "servers": _servers(("a", "fallback", "default"))},
        {"model": "x_y", "upstream": "m_x_y", "servers": _servers(("b", "primary", "default"))},
    ]
    r1, r2 = gateway_routes(ups, {})
    assert r1["fallback"] == "" and r1["upstreams"][0]["servers"][0]["backup"] is False
    assert r1["upstream"] != r2["upstream"]


def _render(spec_path: Path, host: str) -> dict[str, str]:
    spec = load_spec(spec_path)
    return {r.dest: r.content for r in render_host(spec, host)}


@pytest.mark.parametrize("example,host", [("tiny-cpu.yml", "h1"), ("seed-004-4xa100.yml", "gpu-a")])
def test_examples_render_gateway(example: str, host: str) -> None:
    files = _render(REPO / "examples" / example, host)
    conf = files["/etc/nginx/conf.d/vllm-fleet.conf"]
    ups = files["/etc/nginx/vllm-fleet/upstreams.conf"]
    js = files["/etc/nginx/vllm-fleet/router.js"]
    assert "Ansible managed" in conf and "Ansible managed" in ups and "Ansible managed" in js
    assert "proxy_buffering off;" in conf and 'proxy_set_header Connection "";' in conf
    assert "proxy_http_version 1.1;" in conf and "stub_status;" in conf
    assert "least_conn;" in ups and "keepalive 32;" in ups and "zone " in ups
    spec = load_spec(REPO / "examples" / example)
    for m in spec.models:
        assert f"# vf-instance={m.name} " in ups
        assert json.dumps(m.served_model_name) in js


def test_drained_from_spec_and_from_ansible_var(tmp_path: Path) -> None:
    spec = gateway_spec([{"name": "a", "port": 9001}, {"name": "b", "port": 9002}], tmp_path, drained=["a"])
    ctx = build_context(spec, "h1")
    tpl = make_env().get_template("nginx/upstreams.conf.j2")
    text = tpl.render(**ctx)
    assert {i for u in parse_upstreams(text) for i, _, d in u.servers if d} == {"a"}
    # the Ansible role passes the gateway host's drained.json as vllm_fleet_gateway_drained
    text = tpl.render(**ctx, vllm_fleet_gateway_drained=["b"])
    assert {i for u in parse_upstreams(text) for i, _, d in u.servers if d} == {"a", "b"}


def test_apply_drained_round_trip(tmp_path: Path) -> None:
    spec = gateway_spec(
        [
            {"name": "a", "port": 9001},
            {"name": "b", "port": 9002, "pool": "high"},
            {"name": "c", "port": 9003, "role": "backup"},
        ],
        tmp_path,
    )
    text = make_env().get_template("nginx/upstreams.conf.j2").render(**build_context(spec, "h1"))
    assert instances(text) == {"a": "127.0.0.1:9001", "b": "127.0.0.1:9002", "c": "127.0.0.1:9003"}
    drained = apply_drained(text, {"a", "c"})
    for up in parse_upstreams(drained):
        for inst, _, down in up.servers:
            assert down == (inst in {"a", "c"})
    assert "backup down;" in drained  # other parameters kept
    assert apply_drained(drained, set()) == text
    assert stranded_models(drained) == []
    assert stranded_models(apply_drained(text, {"a", "b", "c"})) == ["tiny-qwen3"]


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
    """The check can fail: a broken upstream file is refused, and drain restores the previous file."""
    ups = rendered.upstreams_file
    good = ups.read_text()
    ups.write_text(good.replace("least_conn;", "least_conn_typo;", 1))
    assert rendered.check().returncode != 0
    ups.write_text(good)


@needs_nginx
def test_set_drained_checks_and_refuses(rendered: NginxGateway, tmp_path: Path) -> None:
    state = tmp_path / "drained.json"
    nginx = rendered.argv()
    ups = rendered.upstreams_file
    assert set_drained("a", True, ups, state, nginx, reload=False) == {"a"}
    assert json.loads(state.read_text())["drained"] == ["a"]
    assert set_drained("b", True, ups, state, nginx, reload=False) == {"a", "b"}
    assert set_drained("c", True, ups, state, nginx, reload=False) == {"a", "b", "c"}
    with pytest.raises(DrainError) as exc:  # d is the model's last server in rotation
        set_drained("d", True, ups, state, nginx, reload=False)
    assert exc.value.code == 3
    with pytest.raises(DrainError):
        set_drained("nope", True, ups, state, nginx, reload=False)
    assert set_drained("b", False, ups, state, nginx, reload=False) == {"a", "c"}
    # a broken config is detected by nginx -t and the previous upstream file is restored
    before = ups.read_text()
    conf = rendered.etc_nginx / "conf.d" / "vllm-fleet.conf"
    good_conf = conf.read_text()
    conf.write_text(good_conf + "\nbroken_directive;\n")
    with pytest.raises(DrainError):
        set_drained("b", True, ups, state, nginx, reload=False)
    assert ups.read_text() == before
    conf.write_text(good_conf)


@needs_nginx
def test_apply_restores_the_drained_set_after_a_re_render(rendered: NginxGateway, tmp_path: Path) -> None:
    """`vllm-fleet drain --apply`: a freshly rendered upstream file gets the state file's drained set back."""
    state = tmp_path / "drained.json"
    ups = rendered.upstreams_file
    fresh = ups.read_text()
    set_drained("b", True, ups, state, rendered.argv(), reload=False)
    set_drained(
        "c", True, ups, state, rendered.argv(), reload=False
    )  # the main upstream loses b and c: marks
    ups.write_text(fresh)  # what a re-render without the state does
    assert set_drained(None, True, ups, state, rendered.argv(), reload=False) == {"b", "c"}
    assert {i for u in parse_upstreams(ups.read_text()) for i, _, d in u.servers if d} == {"b", "c"}


def _downs(text: str) -> set[str]:
    return {i for u in parse_upstreams(text) for i, _, d in u.servers if d}


@needs_nginx
def test_one_drained_instance_needs_no_marks_and_no_reload(rendered: NginxGateway, tmp_path: Path) -> None:
    """One instance out of an upstream: the router picks the copy without it (state file only, config
    untouched); a second one out of the same upstream: `down` marks (+ reload); back to one: marks removed."""
    state = tmp_path / "drained.json"
    ups = rendered.upstreams_file
    fresh = ups.read_text()
    copies = {(u.variant_of, u.excludes): u for u in parse_upstreams(fresh) if u.variant_of}
    main = next(u for u in parse_upstreams(fresh) if not u.variant_of and u.model == "tiny-qwen3")
    assert {i for i, _, _ in copies[(main.name, "a")].servers} == {"b", "c"}
    # a and c drained from the default pool's upstream (a first, b and c backups): b serves as a primary
    assert needs_marks(fresh, {"a"}) is False and needs_marks(fresh, set()) is False
    assert set_drained("a", True, ups, state, rendered.argv(), reload=False) == {"a"}
    assert ups.read_text() == fresh
    assert json.loads(state.read_text())["down"] == []
    assert needs_marks(fresh, {"a", "c"}) is True
    set_drained("c", True, ups, state, rendered.argv(), reload=False)
    assert _downs(ups.read_text()) == {"a", "c"}
    assert json.loads(state.read_text())["down"] == ["a", "c"]
    set_drained("a", False, ups, state, rendered.argv(), reload=False)
    assert ups.read_text() == fresh and json.loads(state.read_text()) | {"updated": 0} == {
        "drained": ["c"],
        "down": [],
        "updated": 0,
    }
    # the fallback upstream (d alone) and the other model's (q alone) have no copy: marks
    assert needs_marks(fresh, {"d"}) is True and needs_marks(fresh, {"q"}) is True


def test_copies_promote_backups_when_no_primary_is_left(tmp_path: Path) -> None:
    spec = gateway_spec(
        [{"name": "a", "port": 9001}, {"name": "c", "port": 9003, "role": "backup"}], tmp_path
    )
    (rt,) = build_context(spec, "h1")["vf"]["gateway_routes"]
    (copy_a, copy_c) = rt["variants"]
    assert (copy_a["excludes"], [(s["instance"], s["backup"]) for s in copy_a["servers"]]) == (
        "a",
        [("c", False)],
    )
    assert (copy_c["excludes"], [(s["instance"], s["backup"]) for s in copy_c["servers"]]) == (
        "c",
        [("a", False)],
    )
    assert rt["without"] == {rt["upstream"]: {"a": copy_a["name"], "c": copy_c["name"]}}
    assert rt["members"] == {rt["upstream"]: ["a", "c"]}


def test_retry_policy_follows_the_spec(tmp_path: Path) -> None:
    for flag in (True, False):
        spec = gateway_spec([{"name": "a", "port": 9001}], tmp_path, retry_non_idempotent=flag)
        conf = {r.dest: r.content for r in render_host(spec, "h1")}["/etc/nginx/conf.d/vllm-fleet.conf"]
        assert ("non_idempotent" in conf.split("proxy_next_upstream error")[1].splitlines()[0]) is flag
        assert "proxy_next_upstream_tries 3;" in conf and "proxy_next_upstream_timeout 10s;" in conf


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
    )
    ctx = build_context(spec, "h1")
    ours, ansible_like = make_env(REPO), make_env(REPO)
    ansible_like.lstrip_blocks = False
    for t in ("nginx/vllm-fleet.conf.j2", "nginx/upstreams.conf.j2", "nginx/router.js.j2"):
        assert ours.get_template(t).render(**ctx) == ansible_like.get_template(t).render(**ctx), t


def test_reload_command_uses_the_given_nginx_outside_systemd() -> None:
    from vllm_fleet.host.drain import reload_command

    # a prefix-run nginx (tests, bench lab) is always reloaded with its own -s reload
    assert reload_command(["nginx", "-p", "/x", "-c", "/y"]) == [
        "nginx",
        "-p",
        "/x",
        "-c",
        "/y",
        "-s",
        "reload",
    ]
    # the default nginx: through systemd only where systemd manages it (not on this test machine)
    assert reload_command(["nginx"])[-1] == "reload"
