"""gateway.limits as rendered: the admission service's file (what it counts, each model's capacity), the nginx
config that asks it (auth_request on every internal location that proxies to an engine, the release in the log
phase), the unit, the ports, the firewall and the scrape job; off without keys or when disabled."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from vllm_fleet.devtools.gateway_nginx import HAVE_NGINX, NginxGateway
from vllm_fleet.devtools.gateway_testing import gateway_spec
from vllm_fleet.fleet.admission_config import admission_config, model_capacity
from vllm_fleet.fleet.context import build_context
from vllm_fleet.fleet.network import firewall_rules
from vllm_fleet.fleet.plan import make_plan
from vllm_fleet.fleet.render import render_fleet, render_host
from vllm_fleet.fleet.spec import FleetSpec, SpecError, parse_spec

REPO = Path(__file__).resolve().parents[2]
needs_nginx = pytest.mark.skipif(not HAVE_NGINX, reason="nginx + libnginx-mod-http-js not installed")

SERVERS: list[dict[str, Any]] = [
    {"name": "a", "port": 9001, "max_num_seqs": 4},  # queue bound 8 (twice max_num_seqs)
    {"name": "b", "port": 9002, "max_num_seqs": 2, "max_num_queued_reqs": 5, "pool": "high"},
    {"name": "c", "port": 9003, "max_num_seqs": 4, "role": "backup"},  # serves only when a and b are down
    {"name": "d", "port": 9004, "max_num_seqs": 1, "role": "fallback"},  # the spill-over reaches it: 2
    {"name": "q", "port": 9005, "served_model_name": "open-ended"},  # no bound: the engine queues
]


def _spec(tmp_path: Path, **gw: Any) -> FleetSpec:
    keys = tmp_path / "keys"
    keys.write_text('"sk-unit-0123456789abcdef0123456789abcdef" chat;\n')
    return gateway_spec(SERVERS, tmp_path, api_keys_file=str(keys), **gw)


def _files(spec: FleetSpec) -> dict[str, str]:
    return {r.dest: r.content for r in render_host(spec, "h1")}


def test_capacity_is_what_the_serving_engines_hold(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    assert model_capacity(spec, make_plan(spec)) == {"tiny-qwen3": 8 + 5 + 2}
    drained = _spec(tmp_path, drained=["b"])
    assert model_capacity(drained, make_plan(drained)) == {"tiny-qwen3": 8 + 2}


def test_the_service_file_carries_the_budgets(tmp_path: Path) -> None:
    spec = _spec(
        tmp_path,
        limits={
            "queue_wait_seconds": 7,
            "default_key": {"max_in_flight": 3, "tokens_per_minute": 9000},
            "keys": {"chat/0a1b2c3d": {"requests_per_minute": 60, "weight": 2}},
        },
        clients={"chat": {"limits": {"max_in_flight": 40}, "per_key": {"max_in_flight": 10}}, "batch": {}},
    )
    files = _files(spec)
    conf = json.loads(files[f"{spec.paths.config_dir}/gateway/admission.json"])
    assert conf == admission_config(spec, make_plan(spec))
    assert conf["queue_wait_seconds"] == 7.0 and conf["lease_seconds"] == 600 + 7 + 30
    assert conf["default_key"] == {"max_in_flight": 3, "requests_per_minute": 0, "tokens_per_minute": 9000,
                                   "weight": 1.0}  # fmt: skip
    assert conf["keys"]["chat/0a1b2c3d"]["weight"] == 2.0
    assert conf["clients"] == {"chat": {"max_in_flight": 40, "requests_per_minute": 0, "tokens_per_minute": 0,
                                        "weight": 1.0}}  # fmt: skip
    assert conf["per_key"]["chat"]["max_in_flight"] == 10 and "batch" not in conf["per_key"]
    run = spec.gateway.limits.runtime_dir
    assert conf["socket"] == f"{run}/admit.sock" and conf["log_socket"] == f"{run}/log.sock"
    assert conf["metrics_address"] == f"127.0.0.1:{spec.gateway.limits.metrics_port}"
    unit = files["/etc/systemd/system/vllm-fleet-admission.service"]
    assert f"admission --config {spec.paths.config_dir}/gateway/admission.json" in unit
    assert "RuntimeDirectory=" not in unit and f"ReadWritePaths={run}" in unit  # a test folder outside /run
    default = parse_spec({**spec.model_dump(mode="json"), "gateway": {
        **spec.model_dump(mode="json")["gateway"], "limits": {}}})  # fmt: skip
    assert (
        "RuntimeDirectory=vllm-fleet-admission\n"
        in _files(default)["/etc/systemd/system/vllm-fleet-admission.service"]
    )


def test_the_gateway_is_sized_for_its_worst_case_with_limits_on(tmp_path: Path) -> None:
    """Every request the gateway holds (max_queued waiting + the engines' 15 in flight) may open a connection to
    the admission socket at once: its backlog, the kernel's somaxconn and datagram queue for the releases, and
    nginx's worker_connections (3 connections per request) follow from the spec."""
    from vllm_fleet.fleet.context import fleet_vars

    spec = _spec(tmp_path, limits={"max_queued": 5000})
    conf = admission_config(spec, make_plan(spec))
    assert conf["listen_backlog"] == 5000 + 15
    vf = fleet_vars(spec)
    assert vf["gateway_sysctl"] == {"net.core.somaxconn": 5015, "net.unix.max_dgram_qlen": 5015}
    assert vf["gateway_worker_connections"] == 16384  # 3 × 5015 + 1024 spare, rounded up to a power of two
    # a day-2 change of an engine's queue bound keeps nginx.conf as it was (no reload closing keep-alives)
    assert fleet_vars(_spec(tmp_path, limits={"max_queued": 5001}))["gateway_worker_connections"] == 16384
    assert fleet_vars(_spec(tmp_path, limits={"max_queued": 5200}))["gateway_worker_connections"] == 32768
    small = _spec(tmp_path, limits={"max_queued": 100})  # the least: a burst of new requests connects too
    assert admission_config(small, make_plan(small))["listen_backlog"] == 4096
    assert fleet_vars(small)["gateway_worker_connections"] == 4096
    given = _spec(tmp_path, worker_connections=20000)
    assert fleet_vars(given)["gateway_worker_connections"] == 20000 and not make_plan(given).problems
    off = _spec(tmp_path, limits={"enabled": False})
    assert fleet_vars(off)["gateway_sysctl"] == {} and fleet_vars(off)["gateway_worker_connections"] == 4096


def test_a_worker_connections_below_the_worst_case_is_refused_naming_the_fields(tmp_path: Path) -> None:
    spec = _spec(tmp_path, worker_connections=768)  # Debian's nginx.conf
    (problem,) = make_plan(spec).problems
    assert problem.path == "gateway.worker_connections"
    text = str(problem)
    assert text.startswith("gateway.worker_connections: 768 is below")
    for words in ("gateway.limits.max_queued 4096", "15 in flight", "models[].max_num_seqs", f"= {3 * 4111}"):
        assert words in text, (words, text)
    enough = _spec(tmp_path, worker_connections=3 * 4111)
    assert not make_plan(enough).problems
    # without the admission service nothing waits in the gateway: no worst case to refuse
    assert not make_plan(_spec(tmp_path, worker_connections=768, limits={"enabled": False})).problems


def _locations(conf: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for m in re.finditer(r"^    location (?:= |\^~ |~ )?(\S+) \{", conf, re.M):
        depth, k = 1, m.end()
        while depth:
            depth += {"{": 1, "}": -1}.get(conf[k], 0)
            k += 1
        out[m.group(1)] = conf[m.end() : k - 1]
    return out


def test_every_location_that_proxies_to_an_engine_first_asks_the_service(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    conf = _files(spec)["/etc/nginx/conf.d/vllm-fleet.conf"]
    locs = _locations(conf)
    entries = [n for n in locs if n.startswith(("/_vf/", "/_vfi/"))]
    assert len(entries) >= 4
    for name in entries:
        assert "auth_request /_vf_admit;" in locs[name], name
        assert "error_page 403 = @vf_refused;" in locs[name], name
    # the named locations a request reaches after it was admitted do not ask again
    assert not any("auth_request" in body for n, body in locs.items() if n.startswith("@vf_spill"))
    admit = locs["/_vf_admit"]
    assert "proxy_pass_request_body off;" in admit and "proxy_pass_request_headers off;" in admit
    assert 'proxy_set_header Content-Length "";' in admit  # else the service waits for a body never sent
    assert "error_page 500 502 504 = @vf_admit_open;" in admit
    assert f"proxy_read_timeout {spec.gateway.limits.queue_wait_seconds + 5}s;" in admit
    # the release: nginx's log phase, once per admitted request
    assert re.search(
        r"access_log syslog:server=unix:\S+/log\.sock,nohostname,tag=vfadmit vf_admit if=\$vf_admitted;", conf
    )
    # the tokens the answer used: every location that proxies to an engine (the spill-over, fallback and
    # drained walk too) passes the answer through the usage filter; the release line carries what it saw
    proxying = [n for n, body in locs.items() if "proxy_pass http://" in body and n != "/_vf_admit"]
    assert len(proxying) > len(entries)
    for name in proxying:
        assert locs[name].count("js_body_filter vf.tally;") == 1, name
    assert "js_body_filter" not in admit
    assert "js_set $vf_usage vf.usage;" in conf
    assert "log_format vf_admit '$request_id|$status|$upstream_status|$vf_usage';" in conf
    # the per-key leaky bucket is replaced, the per-IP one stays
    assert "zone=vf_per_key burst" not in conf and "zone=vf_per_ip burst" in conf
    closed = _files(_spec(tmp_path, limits={"on_failure": "closed"}))["/etc/nginx/conf.d/vllm-fleet.conf"]
    assert "= @vf_admit_closed;" in closed


def test_no_admission_without_keys_or_when_disabled(tmp_path: Path) -> None:
    for spec in (
        gateway_spec(SERVERS, tmp_path),  # auth: none: nothing to count by
        _spec(tmp_path, limits={"enabled": False}),
    ):
        assert not spec.gateway.admission
        files = _files(spec)
        conf = files["/etc/nginx/conf.d/vllm-fleet.conf"]
        assert "auth_request" not in conf and "vf_admit" not in conf
        assert "js_body_filter" not in conf and "vf_usage" not in conf
        assert not any("admission" in dest for dest in files)
        assert json.loads(files["/etc/nginx/vllm-fleet/routes.json"])["admission"] is None
    conf = _files(_spec(tmp_path, limits={"enabled": False}))["/etc/nginx/conf.d/vllm-fleet.conf"]
    assert "zone=vf_per_key burst=40 nodelay" in conf  # the older per-key bucket where limits are off


def test_the_role_removes_the_service_s_files_when_limits_are_off(tmp_path: Path) -> None:
    """What limits on renders is what the role removes once they are off (stopped and disabled first, then the
    files, then systemd told): a host that had limits keeps no unit to start nor budgets no longer wanted."""
    on, off = _spec(tmp_path), _spec(tmp_path, limits={"enabled": False})
    rendered = {dest for dest in _files(on) if "admission" in dest}
    assert len(rendered) == 2
    for spec in (on, off):
        assert set(build_context(spec, "h1")["vf"]["gateway_admission_files"]) == rendered
    run = {t["name"]: t for t in yaml.safe_load((REPO / "ansible/roles/gateway/tasks/run.yml").read_text())}
    names = list(run)
    stop, remove = (
        "Stop the admission service (gateway.limits off)",
        "Remove the admission service's config and unit (gateway.limits off)",
    )
    forget = "Forget the removed units (systemctl daemon-reload)"
    assert names.index(stop) < names.index(remove) < names.index(forget)
    task = run[remove]
    assert (
        task["ansible.builtin.file"]["state"] == "absent"
        and task["loop"] == "{{ vf.gateway_admission_files }}"
    )
    assert task["when"].startswith("not vf.gateway_admission_on and")
    assert f"{task['register']} is changed" in run[forget]["when"]


def test_bad_limits_are_refused_naming_the_field(tmp_path: Path) -> None:
    data = _spec(tmp_path).model_dump(mode="json")
    for limits, where in (
        ({"queue_wait_seconds": 600}, "read_timeout_seconds"),
        ({"default_key": {"max_in_flight": -1}}, "gateway.limits.default_key.max_in_flight"),
        ({"default_key": {"weight": 0}}, "gateway.limits.default_key.weight"),
        ({"keys": {"chat/XYZ": {}}}, "gateway.limits.keys"),
        ({"runtime_dir": "relative"}, "gateway.limits.runtime_dir"),
    ):
        bad = {**data, "gateway": {**data["gateway"], "limits": limits}}
        with pytest.raises(SpecError, match=re.escape(where)):
            parse_spec(bad)


def test_metrics_port_is_checked_open_to_monitoring_and_scraped(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    clash = parse_spec({**spec.model_dump(mode="json"), "gateway": {
        **spec.model_dump(mode="json")["gateway"],
        "limits": {"metrics_port": 9001, "runtime_dir": "/run/x"}}})  # fmt: skip
    assert any("gateway.limits.metrics_port" in str(p) for p in make_plan(clash).problems)
    data = spec.model_dump(mode="json")
    data["hosts"] = [{"name": "h1", "address": "10.0.0.1", "memory_gib": 16},
                     {"name": "mon", "address": "10.0.0.2", "memory_gib": 8}]  # fmt: skip
    data["monitoring"] = {"host": "mon", "enabled": True}
    two = parse_spec(data)
    port = two.gateway.limits.metrics_port
    assert any(port in r["ports"] and r["comment"].startswith("exporters") for r in firewall_rules(two, "h1"))
    assert admission_config(two, make_plan(two))["metrics_address"] == f"10.0.0.1:{port}"
    render_fleet(two, tmp_path / "out")
    prom = (tmp_path / "out" / "mon" / "etc" / "prometheus" / "prometheus.yml").read_text()
    assert "job_name: vllm-fleet-admission" in prom and f'"10.0.0.1:{port}"' in prom


@needs_nginx
def test_nginx_t_accepts_the_admission_config(tmp_path: Path) -> None:
    for gw in ({}, {"limits": {"on_failure": "closed"}}, {"clients": {"chat": {"models": ["tiny-qwen3"]}}}):
        out = tmp_path / f"out{len(gw)}{'c' if 'clients' in gw else ''}"
        render_fleet(_spec(tmp_path, **gw), out)
        r = NginxGateway(out / "h1" / "etc" / "nginx", tmp_path / "prefix").check()
        assert r.returncode == 0, r.stderr
