"""No single gateway or monitoring host (issue 30, docs/design/ha.md): what the plan refuses and what every gateway
and monitoring host gets — keepalived.conf, nginx's health questions, Prometheus per host, the Alertmanager
cluster, the firewall between peers."""

from __future__ import annotations

import copy
import http.server
import json
import os
import re
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from vllm_fleet.contracts import GATEWAY_PEERS_FILE, GatewayPeers
from vllm_fleet.devtools.gateway_nginx import HAVE_NGINX, NginxGateway
from vllm_fleet.fleet import ha
from vllm_fleet.fleet.context import build_context
from vllm_fleet.fleet.hostplan import HostDeployPlan
from vllm_fleet.fleet.plan import make_plan
from vllm_fleet.fleet.render import render_fleet, render_host
from vllm_fleet.fleet.spec import FleetSpec, load_spec, parse_spec
from vllm_fleet.host.gateway_check import check, main

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples/tiny-cpu-ha.yml"
BASE: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())


def data(**changes: Any) -> dict[str, Any]:
    d = copy.deepcopy(BASE)
    for section, values in changes.items():
        d[section].update(values)
    return d


def files(spec: FleetSpec, host: str) -> dict[str, str]:
    return {r.dest: r.content for r in render_host(spec, host)}


def _args(text: str) -> str:
    """The ARGS= line of an /etc/default file."""
    return next(x for x in text.splitlines() if x.startswith("ARGS="))


def problems(spec: FleetSpec) -> list[str]:
    return [str(p) for p in make_plan(spec).problems]


# --------------------------------------------------------------------------- decisions


def test_the_router_id_is_derived_from_the_fleet_name_or_given() -> None:
    spec = load_spec(EXAMPLE)
    rid = ha.vrrp_router_id(spec)
    assert rid == ha.vrrp_router_id(load_spec(EXAMPLE))  # the same on every run
    ids = set()
    for n in range(300):
        other = parse_spec({**copy.deepcopy(BASE), "name": f"fleet-{n}"})
        ids.add(ha.vrrp_router_id(other))
    assert min(ids) >= 1 and max(ids) <= 255 and len(ids) > 150  # spread over the range
    given = parse_spec(data(gateway={"vrrp": {"router_id": 7}}))
    assert ha.vrrp_router_id(given) == 7
    assert ha.keepalived_plan(given, "h1").router_id == 7  # type: ignore[union-attr]


def test_each_gateway_advertises_to_the_others_only() -> None:
    d = data()
    d["hosts"].append({"name": "h4", "address": "10.77.0.74", "memory_gib": 4})
    d["gateway"]["hosts"] = ["h1", {"name": "h2", "priority": 150}, "h4"]
    spec = parse_spec(d)
    plans = {h: ha.keepalived_plan(spec, h) for h in ("h1", "h2", "h3", "h4")}
    assert plans["h3"] is None  # not a gateway
    p1, p2, p4 = plans["h1"], plans["h2"], plans["h4"]
    assert p1 and p2 and p4
    assert (p1.unicast_src, p1.unicast_peers) == ("10.77.0.71", ["10.77.0.72", "10.77.0.74"])
    assert (p2.unicast_src, p2.unicast_peers) == ("10.77.0.72", ["10.77.0.71", "10.77.0.74"])
    assert (p1.priority, p2.priority, p4.priority) == (100, 150, 100)
    assert p1.virtual_address == "10.77.0.9/24" and p1.router_id == p2.router_id == p4.router_id
    # nginx down: FAULT (weight 0); no engine reachable: below every gateway that reaches one
    nginx, upstreams = p1.checks
    assert nginx.weight == 0 and nginx.script.endswith("/vf/health --timeout 1.5")
    assert upstreams.weight == -51 and "/vf/upstreams" in upstreams.script
    assert min(p.priority for p in (p1, p2, p4)) > max(p.priority for p in (p1, p2, p4)) + upstreams.weight
    assert nginx.script.startswith("/opt/vllm-fleet/venv/bin/vllm-fleet-gateway-check ")
    assert p1.auth_file == ha.VRRP_AUTH_FILE  # the example names a secret
    assert ha.keepalived_plan(parse_spec(data(gateway={"vrrp": {}})), "h1").auth_file == ""  # type: ignore[union-attr]


def test_one_gateway_and_one_monitoring_host_render_nothing_new() -> None:
    spec = load_spec(REPO / "examples/tiny-cpu-2hosts.yml")
    assert ha.keepalived_plan(spec, "h1") is None and not spec.gateway_ha and not spec.monitoring_ha
    fs = files(spec, "h1")
    assert "/etc/keepalived/keepalived.conf" not in fs
    conf = fs["/etc/nginx/conf.d/vllm-fleet.conf"]
    assert "/vf/upstreams" not in conf and "vf_any_engine" not in conf
    prom = yaml.safe_load(fs["/etc/prometheus/prometheus.yml"])
    assert (
        prom["global"]["external_labels"] == {"fleet": "tiny2"}
        and "alert_relabel_configs" not in prom["alerting"]
    )
    am = _args(fs["/etc/default/prometheus-alertmanager"])
    assert "--cluster.listen-address= " in am and "--cluster.peer" not in am


def test_the_plan_refuses_a_virtual_address_off_the_gateways_network() -> None:
    assert problems(load_spec(EXAMPLE)) == []
    off = parse_spec(data(gateway={"virtual_address": "10.78.0.9/24"}))
    assert problems(off) == [
        "gateway.virtual_address: 10.78.0.9/24 is not in the network of gateway host 'h1' (10.77.0.71): the address "
        "moves between hosts of one network (docs/design/ha.md for gateways across subnets)",
        "gateway.virtual_address: 10.78.0.9/24 is not in the network of gateway host 'h2' (10.77.0.72): the address "
        "moves between hosts of one network (docs/design/ha.md for gateways across subnets)",
    ]
    taken = parse_spec(data(gateway={"virtual_address": "10.77.0.73/24"}))
    assert problems(taken) == [
        "gateway.virtual_address: 10.77.0.73 is the address of host 'h3': the virtual address must be one no host has"
    ]
    bare = make_plan(parse_spec(data(gateway={"virtual_address": "10.99.0.9"})))
    assert bare.ok and any("has no /prefix" in w for w in bare.warnings)


def test_the_plan_refuses_gateways_without_an_ipv4_address_or_a_fixed_listen_address() -> None:
    d = data()
    d["hosts"][1]["address"] = "gw-b.example.net"
    assert problems(parse_spec(d)) == [
        "hosts[1].address: 'gw-b.example.net': gateway host 'h2' needs an IPv4 address here (keepalived's unicast "
        "peers and source are addresses, and the virtual address is IPv4)"
    ]
    d["hosts"][1]["private_address"] = "10.77.0.72"  # the fleet-internal address is the one that counts
    assert problems(parse_spec(d)) == []
    fixed = parse_spec(data(gateway={"listen_address": "10.77.0.71"}))
    (p,) = problems(fixed)
    assert p.startswith(
        "gateway.listen_address: '10.77.0.71': with gateway.hosts nginx must listen on 0.0.0.0"
    )


def test_the_cluster_port_is_a_port_of_each_monitoring_host_and_may_not_clash() -> None:
    plan = make_plan(load_spec(EXAMPLE))
    ports = {h.name: h.ports for h in plan.hosts}
    assert ports["h2"][9094] == ports["h3"][9094] == "monitoring.alertmanager_cluster_port"
    assert 9094 not in ports["h1"]  # not a monitoring host
    clash = parse_spec(data(monitoring={"alertmanager_cluster_port": 9100}))
    assert problems(clash) == [
        "monitoring.node_exporter_port: port 9100 on h2 is already used by monitoring.alertmanager_cluster_port",
        "monitoring.node_exporter_port: port 9100 on h3 is already used by monitoring.alertmanager_cluster_port",
    ]
    engine = parse_spec(data(monitoring={"alertmanager_cluster_port": 8101}))
    assert problems(engine) == [
        "models[0].port: port 8101 on h3 is already used by monitoring.alertmanager_cluster_port"
    ]
    # one monitoring host gossips with nobody: no cluster port
    one = parse_spec(data(monitoring={"hosts": [], "host": "h2"}))
    assert all(9094 not in h.ports for h in make_plan(one).hosts)


def test_every_gateway_and_monitoring_host_gets_its_own_plan() -> None:
    spec = load_spec(EXAMPLE)
    ctx = {h: build_context(spec, h)["vf"] for h in ("h1", "h2", "h3")}
    for h, vf in ctx.items():
        assert HostDeployPlan.model_validate({k: vf[k] for k in HostDeployPlan.model_fields})
        assert vf["is_gateway"] == (h in ("h1", "h2")) and vf["is_monitoring"] == (h in ("h2", "h3"))
    assert ctx["h3"]["keepalived"] is None and ctx["h1"]["monitoring_server"] is None
    # each gateway's admission service serves its metrics where its exporters listen
    assert ctx["h1"]["gateway_admission"]["metrics_address"] == "10.77.0.71:9402"
    assert ctx["h2"]["gateway_admission"]["metrics_address"] == "10.77.0.72:9402"
    assert ctx["h3"]["gateway_admission"] is None
    # each monitoring host's Prometheus and Alertmanager listen on its own address, its exporters too (the
    # other Prometheus scrapes them)
    assert ctx["h2"]["monitoring_address"] == "10.77.0.72" and ctx["h3"]["monitoring_address"] == "10.77.0.73"
    assert ctx["h1"]["monitoring_address"] == "10.77.0.72"  # elsewhere: the first monitoring host's
    assert ctx["h2"]["exporter_address"] == "10.77.0.72"
    # the engines listen where both gateways and both Prometheus servers reach them
    assert {i["listen_address"] for i in ctx["h3"]["instances"]} == {"10.77.0.73"}


# --------------------------------------------------------------------------- keepalived


def test_keepalived_conf_on_each_gateway_host_only() -> None:
    spec = load_spec(EXAMPLE)
    k1 = files(spec, "h1")["/etc/keepalived/keepalived.conf"]
    k2 = files(spec, "h2")["/etc/keepalived/keepalived.conf"]
    assert "/etc/keepalived/keepalived.conf" not in files(spec, "h3")
    rid = ha.vrrp_router_id(spec)
    for text, own, peer in ((k1, "10.77.0.71", "10.77.0.72"), (k2, "10.77.0.72", "10.77.0.71")):
        assert f"virtual_router_id {rid}\n" in text and "    state BACKUP\n" in text
        assert not [x for x in text.splitlines() if x.strip() == "nopreempt"]  # decided: docs/design/ha.md
        assert f"unicast_src_ip {own}\n" in text
        assert re.search(r"unicast_peer \{\s+" + re.escape(peer) + r"\s+\}", text)
        assert re.search(r"virtual_ipaddress \{\s+10\.77\.0\.9/24\s+\}", text)
        assert "include /etc/keepalived/vllm-fleet-vrrp-auth.conf" in text
        assert f"interface IFACE-OF-{own}\n" in text  # render cannot know it; the gateway role finds it
    given = parse_spec(data(gateway={"vrrp": {"interface": "ens5", "advert_int": 2}}))
    text = files(given, "h1")["/etc/keepalived/keepalived.conf"]
    assert "interface ens5\n" in text and "advert_int 2\n" in text and "include " not in text


def _an_interface() -> str | None:
    """A non-loopback interface of this machine (keepalived's config test wants one that exists)."""
    names = (
        sorted(p.name for p in Path("/sys/class/net").iterdir()) if Path("/sys/class/net").is_dir() else []
    )
    return next((n for n in names if n != "lo"), None)


def _config_test(conf: Path, tmp_path: Path) -> str:
    """keepalived's config test: what it found wrong (nothing: an empty log). Its exit status does not tell:
    2.2.7 ends the test with SIGTERM when scripts are configured."""
    log = tmp_path / f"{conf.name}.log"
    subprocess.run(["keepalived", f"--config-test={log}", "-f", str(conf)], capture_output=True, timeout=30)
    return log.read_text() if log.exists() else ""


@pytest.mark.skipif(shutil.which("keepalived") is None or _an_interface() is None, reason="needs keepalived")
def test_keepalived_accepts_the_rendered_config(tmp_path: Path) -> None:
    spec = parse_spec(data(gateway={"vrrp": {"interface": _an_interface(), "auth_secret": "vrrp-pass"}}))
    auth = tmp_path / "auth.conf"
    auth.write_text("authentication {\n    auth_type PASS\n    auth_pass abcdefgh\n}\n")
    for host in ("h1", "h2"):
        text = files(spec, host)["/etc/keepalived/keepalived.conf"].replace(ha.VRRP_AUTH_FILE, str(auth))
        conf = tmp_path / f"{host}.conf"
        conf.write_text(text)
        assert _config_test(conf, tmp_path) == ""
    # the test can fail: a router id out of range, a misspelt block
    bad = tmp_path / "bad.conf"
    bad.write_text(
        text.replace("virtual_router_id ", "virtual_router_id 3").replace("unicast_peer {", "unicast_peers {")
    )
    found = _config_test(bad, tmp_path)
    assert "outside range" in found and "Unknown keyword 'unicast_peers'" in found


# --------------------------------------------------------------------------- nginx: the health questions


def test_nginx_asks_every_engine_for_keepalived() -> None:
    spec = load_spec(EXAMPLE)
    conf = files(spec, "h1")["/etc/nginx/conf.d/vllm-fleet.conf"]
    assert conf == files(spec, "h2")["/etc/nginx/conf.d/vllm-fleet.conf"]  # the same nginx on each gateway
    up = re.search(r"upstream vf_any_engine \{(.*?)\}", conf, re.S)
    assert up and re.findall(r"server (\S+) max_fails=0;", up.group(1)) == [
        "10.77.0.73:8101",
        "10.77.0.73:8102",
    ]
    status = conf.split("listen 127.0.0.1:8081;", 1)[1]  # the loopback status server
    assert "location = /vf/health {" in status and "location = /vf/upstreams {" in status
    assert "proxy_next_upstream_tries 0;" in status


def local_gateways(tmp_path: Path, engine_ports: list[int]) -> dict[str, Any]:
    """The example on this machine: gateways h1 and h2 on 127.0.0.1 and 127.0.0.2 (their peer servers listen
    there), the engines' host h3 on 127.0.0.1 at ``engine_ports``; free ports, no keys, no limits, logs and the
    drained set under ``tmp_path``."""
    from vllm_fleet.devtools.gateway_testing import free_port

    d = data(gateway={"port": free_port(), "stub_status_port": free_port(), "peer_port": free_port()})
    d["gateway"]["auth"] = "none"
    d["gateway"]["listen_address"] = "127.0.0.1"  # the plan wants 0.0.0.0; a test opens no port to the world
    d["gateway"]["limits"] = {"enabled": False}
    d["gateway"]["access_log"] = str(tmp_path / "access.log")
    d["gateway"]["error_log"] = str(tmp_path / "error.log")
    d["gateway"]["state_file"] = str(tmp_path / "a" / "drained.json")
    for h, addr in zip(d["hosts"], ("127.0.0.1", "127.0.0.2", "127.0.0.1"), strict=True):
        h["address"] = addr
    d["gateway"]["virtual_address"] = "10.77.0.9"  # the hosts left the /24
    for m, port in zip(d["models"], engine_ports, strict=True):
        m["port"] = port
    return d


class _Engine(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:
        self.send_response(self.status if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def engines() -> Iterator[list[http.server.HTTPServer]]:
    """Two engines' /health on loopback: the first answers 503 (its engine died), the second 200."""
    servers = []
    for status in (503, 200):
        handler = type("E", (_Engine,), {"status": status})
        srv = http.server.HTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
    yield servers
    for srv in servers:
        srv.shutdown()
        srv.server_close()


@pytest.mark.skipif(not HAVE_NGINX, reason="needs nginx + njs")
def test_the_rendered_gateway_answers_keepalived(
    tmp_path: Path, engines: list[http.server.HTTPServer]
) -> None:
    """nginx -t passes, and the running nginx answers /vf/upstreams 200 while one engine answers its /health
    (after another that answers 503), 502 when none is reachable; vllm-fleet gateway-check says the same."""
    d = local_gateways(tmp_path, [srv.server_address[1] for srv in engines])
    spec = parse_spec(d)
    render_fleet(spec, tmp_path / "out")
    g = NginxGateway(tmp_path / "out" / "h1" / "etc" / "nginx", tmp_path / "prefix")
    r = g.check()
    assert r.returncode == 0, r.stderr
    health, upstreams = ha.gateway_check_urls(spec)
    g.start(health_url=health)
    try:
        assert check(health, 2) == (True, f"{health}: HTTP 200")
        assert check(upstreams, 5)[0], check(upstreams, 5)
        assert main([upstreams, "--quiet"]) == 0
        for srv in engines:
            srv.shutdown()
            srv.server_close()
        ok, why = check(upstreams, 5)
        assert not ok and why == f"{upstreams}: HTTP 502"
        assert main([upstreams, "--quiet"]) == 1
    finally:
        g.stop()


class _Served(http.server.BaseHTTPRequestHandler):
    """An engine that answers every POST with who it is."""

    protocol_version = "HTTP/1.1"
    name = ""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        body = json.dumps({"served_by": self.name}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def named_engines() -> Iterator[list[http.server.ThreadingHTTPServer]]:
    """The example's two instances, tiny-a and tiny-b, on loopback."""
    servers = []
    for name in ("tiny-a", "tiny-b"):
        srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), type("S", (_Served,), {"name": name}))
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
    yield servers
    for srv in servers:
        srv.shutdown()
        srv.server_close()


def _served(port: int, n: int = 16) -> set[str]:
    """Who served ``n`` chats of distinct prompts through the gateway on ``port`` (cache-aware: each its engine)."""
    from vllm_fleet.devtools.gateway_testing import chat_body
    from vllm_fleet.devtools.testing import http_json

    out = set()
    for i in range(n):
        body = chat_body(messages=[{"role": "user", "content": f"{i} {i * 7919} what is drained?"}])
        status, answer = http_json("POST", f"http://127.0.0.1:{port}/v1/chat/completions", body, timeout=10)
        assert status == 200, answer
        out.add(answer["served_by"])
    return out


def _post(url: str, body: bytes, source: str, method: str = "POST") -> tuple[int, dict[str, Any], str]:
    """A request to a peer location from ``source``: the status, the JSON answer ({} if none), Allow."""
    import http.client
    import urllib.parse

    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname or "", u.port, timeout=5, source_address=(source, 0))
    try:
        conn.request(method, u.path, body=body if method == "POST" else None)
        resp = conn.getresponse()
        raw = resp.read()
        try:
            doc = json.loads(raw)
        except ValueError:
            doc = {}
        return resp.status, doc, resp.getheader("Allow") or ""
    finally:
        conn.close()


def _drained(path: Path) -> list[str]:
    doc = json.loads(path.read_text())
    assert set(doc) == {"drained", "updated"} and isinstance(doc["updated"], float)
    return list(doc["drained"])


@pytest.mark.skipif(not HAVE_NGINX, reason="needs nginx + njs")
def test_a_drain_on_either_gateway_reaches_the_other(
    tmp_path: Path, named_engines: list[http.server.ThreadingHTTPServer], capsys: pytest.CaptureFixture[str]
) -> None:
    """Two real nginx gateways rendered from one spec, h1 on 127.0.0.1 and h2 on 127.0.0.2 (each its own client
    port and drained-set file, as on two hosts): `vllm-fleet drain` on h1 changes both drained sets and neither
    gateway sends the instance a request; undrain on h2 likewise; a peer that refuses or is down is exit 4, the
    local change staying; the peer location takes only a well-formed operation, from the other gateway only."""
    from vllm_fleet import cli
    from vllm_fleet.devtools.gateway_testing import free_port

    spec = parse_spec(local_gateways(tmp_path, [srv.server_address[1] for srv in named_engines]))
    render_fleet(spec, tmp_path / "out")
    etc = {h: tmp_path / "out" / h / "etc" / "nginx" for h in ("h1", "h2")}
    state = {"h1": tmp_path / "a" / "drained.json", "h2": tmp_path / "b" / "drained.json"}
    for p in state.values():
        p.parent.mkdir()
    # h2 on this same machine: its own client and status ports and drained-set file
    port = {"h1": spec.gateway.port, "h2": free_port()}
    stub = {"h1": spec.gateway.stub_status_port, "h2": free_port()}
    conf = etc["h2"] / "conf.d" / "vllm-fleet.conf"
    text = conf.read_text()
    for old, new in ((port["h1"], port["h2"]), (stub["h1"], stub["h2"])):
        assert text.count(f"listen 127.0.0.1:{old};") == 1
        text = text.replace(f"listen 127.0.0.1:{old};", f"listen 127.0.0.1:{new};")
    conf.write_text(text)
    routes = {h: etc[h] / "vllm-fleet" / "routes.json" for h in etc}
    doc = json.loads(routes["h2"].read_text())
    assert doc["state_file"] == str(state["h1"])
    routes["h2"].write_text(json.dumps(dict(doc, state_file=str(state["h2"]))))
    peers = {h: etc[h] / "vllm-fleet" / "peers.json" for h in etc}
    url = {h: f"http://127.0.0.{h[1]}:{spec.gateway.peer_port}/vf/drained" for h in etc}
    assert [p.url for p in GatewayPeers.load(peers["h1"]).peers] == [url["h2"]]

    def run(cmd: str, host: str, *extra: str) -> tuple[int, str, str]:
        capsys.readouterr()
        argv = [cmd, "tiny-a", "--routes", str(routes[host]), "--state", str(state[host]), *extra]
        rc = cli.main(argv if "--peers" in extra else [*argv, "--peers", str(peers[host])])
        out, err = capsys.readouterr()
        return rc, out, err

    gw = {h: NginxGateway(etc[h], tmp_path / f"prefix-{h}", workers=1) for h in etc}
    for h, g in gw.items():
        g.start(health_url=f"http://127.0.0.1:{stub[h]}/vf/health")
    try:
        assert _served(port["h1"]) == _served(port["h2"]) == {"tiny-a", "tiny-b"}

        assert run("drain", "h1") == (0, "drained: tiny-a\npeer h2: drained: tiny-a\n", "")
        assert _drained(state["h1"]) == _drained(state["h2"]) == ["tiny-a"]
        assert oct(state["h2"].stat().st_mode & 0o777) == "0o644"  # the router and the exporter read it
        # no temp file left
        assert [p.name for p in state["h2"].parent.iterdir()] == ["drained.json"]
        assert _served(port["h1"]) == _served(port["h2"]) == {"tiny-b"}
        log = Path(spec.gateway.error_log).read_text()
        assert "vllm-fleet: drain tiny-a from gateway 127.0.0.1: drained [tiny-a]" in log

        assert run("undrain", "h2") == (0, "drained: (none)\npeer h1: drained: (none)\n", "")
        assert _drained(state["h1"]) == _drained(state["h2"]) == []
        assert _served(port["h1"]) == _served(port["h2"]) == {"tiny-a", "tiny-b"}

        # the peer location: a POST of one operation on a known instance, from the other gateway only
        assert _post(url["h2"], b"", "127.0.0.1", "GET")[::2] == (405, "POST")
        for bad in (
            b"nope",
            b'{"evict": "tiny-a"}',
            b'{"drain": "tiny-a", "undrain": "tiny-b"}',
            b'{"drain": 1}',
        ):
            status, answer, _ = _post(url["h2"], bad, "127.0.0.1")
            assert (status, answer["error"].startswith("expected {")) == (400, True), bad
        status, answer, _ = _post(url["h2"], b'{"drain": "tiny-x"}', "127.0.0.1")
        assert (status, answer) == (
            400,
            {"error": 'unknown instance "tiny-x" in the routing table of this gateway'},
        )
        assert _post(url["h2"], b'{"drain": "tiny-a"}', "127.0.0.3")[0] == 403  # not a gateway's address
        assert _post(url["h1"], b'{"drain": "tiny-a"}', "127.0.0.1")[0] == 403  # h1 does not take its own
        assert _drained(state["h2"]) == []

        # refused by the peer (here: from an address it does not allow): exit 4, the local change stays
        wrong = tmp_path / "peers-wrong-source.json"
        wrong.write_text(peers["h1"].read_text().replace('"127.0.0.1"', '"127.0.0.3"'))
        rc, out, err = run("drain", "h1", "--peers", str(wrong))
        assert (rc, out) == (4, "drained: tiny-a\n")
        assert err.startswith("peer h2: REFUSED (HTTP 403: Forbidden)\ndrain: h2 did not take it:")
        assert _drained(state["h1"]) == ["tiny-a"] and _drained(state["h2"]) == []

        # a peer that is down: exit 4, named, the local change stays; --local tells nobody
        gw["h2"].stop()
        rc, out, err = run("undrain", "h1")
        assert (rc, out) == (4, "drained: (none)\n")
        assert err.startswith(f"peer h2: NOT reached ({url['h2']}: Connection refused)\n"), err
        assert "rerun `vllm-fleet undrain tiny-a` once they answer" in err
        assert _drained(state["h1"]) == []
        assert run("drain", "h1", "--local") == (0, "drained: tiny-a\n", "")
        assert _drained(state["h1"]) == ["tiny-a"] and _drained(state["h2"]) == []
    finally:
        for g in gw.values():
            g.stop()


def test_drain_waits_on_no_silent_peer_and_tells_none_when_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A peer that takes the connection but never answers costs the timeout and is named; a peers file that is
    not one is exit 4 after the local change; a drain refused here (exit 3) tells no peer."""
    import socket
    import time

    from vllm_fleet import cli
    from vllm_fleet.contracts import GatewayPeer
    from vllm_fleet.host.drain import tell_peer

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(1)  # connects, never accepted, never answered
    try:
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/vf/drained"
        t0 = time.monotonic()
        outcome = tell_peer(GatewayPeer("h2", url), "tiny-a", True, "127.0.0.1", timeout=0.5)
        assert time.monotonic() - t0 < 10  # its 0.5 s timeout: the peer never answers
        assert (outcome.ok, outcome.line()) == (False, f"peer h2: NOT reached ({url}: timed out)")
    finally:
        silent.close()

    spec = parse_spec(local_gateways(tmp_path, [9101, 9102]))
    render_fleet(spec, tmp_path / "out")
    routes = tmp_path / "out" / "h1" / "etc" / "nginx" / "vllm-fleet" / "routes.json"
    state = tmp_path / "drained.json"
    bad = tmp_path / "peers.json"
    bad.write_text(
        '{"schema": 1, "fleet": "tinyha", "host": "h1", "source": "127.0.0.1", "peers": [{"name": "h2"}]}'
    )
    capsys.readouterr()
    assert (
        cli.main(["drain", "tiny-a", "--routes", str(routes), "--state", str(state), "--peers", str(bad)])
        == 4
    )
    out, err = capsys.readouterr()
    assert out == "drained: tiny-a\n" and err == (
        f"drain: peers file {bad}: {bad}: peers[0].url: missing: the other gateways were NOT told\n"
    )
    # tiny-b is the model's last server in rotation: refused, nothing changed, no peer asked (none is there)
    closed = tmp_path / "peers-closed.json"
    closed.write_text(
        bad.read_text().replace('{"name": "h2"}', '{"name": "h2", "url": "http://127.0.0.1:9/x"}')
    )
    assert (
        cli.main(["drain", "tiny-b", "--routes", str(routes), "--state", str(state), "--peers", str(closed)])
        == 3
    )
    out, err = capsys.readouterr()
    assert out == "" and "refused: draining tiny-b leaves model(s) tiny-qwen3" in err and "peer" not in err
    assert _drained(state) == ["tiny-a"]


def test_gateway_check_fails_without_an_answer(tmp_path: Path) -> None:
    from vllm_fleet import cli
    from vllm_fleet.devtools.gateway_testing import free_port

    url = f"http://127.0.0.1:{free_port()}/vf/health"
    ok, why = check(url, 1)
    assert not ok and "refused" in why.lower()
    assert cli.main(["gateway-check", "--quiet", url]) == 1  # the command an operator runs


# --------------------------------------------------------------------------- drains between the gateways


def _peer_conf(spec: FleetSpec, host: str) -> str:
    return files(spec, host)["/etc/nginx/vllm-fleet/peer.conf"]


def test_each_gateway_takes_drains_from_the_other_gateways_only() -> None:
    spec = load_spec(EXAMPLE)
    conf = files(spec, "h1")["/etc/nginx/conf.d/vllm-fleet.conf"]
    assert conf == files(spec, "h2")["/etc/nginx/conf.d/vllm-fleet.conf"]  # still the same on each gateway
    assert "\ninclude vllm-fleet/peer.conf;\n" in conf
    for host, own, other in (("h1", "10.77.0.71", "10.77.0.72"), ("h2", "10.77.0.72", "10.77.0.71")):
        server = _peer_conf(spec, host)
        assert re.findall(r"^\s*listen (\S+);", server, re.M) == [f"{own}:8082"]  # its fleet address only
        assert re.findall(r"^\s*(allow|deny) (\S+);", server, re.M) == [("allow", other), ("deny", "all")]
        assert re.search(r"location = /vf/drained \{\s+js_content vf\.peer;\s+\}", server)
        peers = GatewayPeers.from_dict(json.loads(files(spec, host)[GATEWAY_PEERS_FILE]))
        assert (peers.host, peers.source) == (host, own)
        assert [(p.name, p.url) for p in peers.peers] == [
            ("h2" if host == "h1" else "h1", f"http://{other}:8082/vf/drained")
        ]
    assert not [d for d in files(spec, "h3") if "peer" in d]  # not a gateway
    # three gateways: each allows the two others, and tells them
    d = data(gateway={"hosts": ["h1", "h2", "h3"], "peer_port": 8090})
    three = parse_spec(d)
    server = _peer_conf(three, "h2")
    assert re.findall(r"^\s*(allow|deny) (\S+);", server, re.M) == [
        ("allow", "10.77.0.71"),
        ("allow", "10.77.0.73"),
        ("deny", "all"),
    ]
    assert "listen 10.77.0.72:8090;" in server
    peers = GatewayPeers.from_dict(json.loads(files(three, "h3")[GATEWAY_PEERS_FILE]))
    assert [p.url for p in peers.peers] == [
        "http://10.77.0.71:8090/vf/drained",
        "http://10.77.0.72:8090/vf/drained",
    ]


def test_one_gateway_has_no_peer_server_and_keeps_its_drained_set_root_s() -> None:
    spec = load_spec(REPO / "examples/tiny-cpu-2hosts.yml")
    fs = files(spec, spec.gateway_host)
    assert not [d for d in fs if "peer" in d] and "peer.conf" not in fs["/etc/nginx/conf.d/vllm-fleet.conf"]
    vf = build_context(spec, spec.gateway_host)["vf"]
    assert vf["gateway_peer"] is None
    assert vf["gateway_state_folder"] == {
        "path": "/etc/vllm-fleet/gateway",
        "owner": "root",
        "group": "root",
        "mode": "0755",
    }
    assert all(8082 not in h.ports for h in make_plan(spec).hosts)
    assert not any("8082" in r for h in spec.hosts for r in _rules(spec, h.name))


def test_the_drained_set_folder_is_nginx_s_to_write_on_a_gateway_of_two() -> None:
    """nginx's workers (www-data) apply the other gateways' drains: a temp file in the folder, then a rename."""
    spec = parse_spec(data(gateway={"state_file": "/var/lib/vf-gw/drained.json"}))
    for host in ("h1", "h2"):
        vf = build_context(spec, host)["vf"]
        assert vf["gateway_state_folder"] == {
            "path": "/var/lib/vf-gw",
            "owner": "root",
            "group": "www-data",
            "mode": "0775",
        }
    assert build_context(spec, "h3")["vf"]["gateway_state_folder"] is None


def test_the_peer_port_is_a_port_of_each_gateway_and_may_not_clash() -> None:
    plan = make_plan(load_spec(EXAMPLE))
    ports = {h.name: h.ports for h in plan.hosts}
    assert ports["h1"][8082] == ports["h2"][8082] == "gateway.peer_port"
    assert 8082 not in ports["h3"]  # not a gateway
    clash = parse_spec(data(gateway={"peer_port": 8081}))
    assert problems(clash) == [
        "gateway.peer_port: port 8081 on h1 is already used by gateway.stub_status_port",
        "gateway.peer_port: port 8081 on h2 is already used by gateway.stub_status_port",
    ]


def test_the_peer_port_is_open_to_the_other_gateways_only() -> None:
    spec = load_spec(EXAMPLE)
    h1, h2, h3 = (_rules(spec, h) for h in ("h1", "h2", "h3"))
    assert 'ip saddr { 10.77.0.72 } tcp dport { 8082 } accept comment "drains: the other gateway hosts"' in h1
    assert 'ip saddr { 10.77.0.71 } tcp dport { 8082 } accept comment "drains: the other gateway hosts"' in h2
    assert not any("8082" in r for r in h3)
    assert sum("8082" in r for r in h1) == 1  # nowhere else (not with the clients' port)


# --------------------------------------------------------------------------- Prometheus and Alertmanager


def test_each_prometheus_differs_in_its_replica_only_and_alerts_every_alertmanager(tmp_path: Path) -> None:
    spec = load_spec(EXAMPLE)
    p2 = yaml.safe_load(files(spec, "h2")["/etc/prometheus/prometheus.yml"])
    p3 = yaml.safe_load(files(spec, "h3")["/etc/prometheus/prometheus.yml"])
    assert p2["global"]["external_labels"] == {"fleet": "tinyha", "replica": "h2"}
    assert p3["global"]["external_labels"] == {"fleet": "tinyha", "replica": "h3"}
    for p in (p2, p3):
        # the alerts both send are identical: the Alertmanager cluster deduplicates them
        assert p["alerting"]["alert_relabel_configs"] == [{"action": "labeldrop", "regex": "replica"}]
        (am,) = p["alerting"]["alertmanagers"]
        assert am["static_configs"][0]["targets"] == ["10.77.0.72:9093", "10.77.0.73:9093"]
        jobs = {j["job_name"]: j for j in p["scrape_configs"]}
        peers = [(c["targets"], c["labels"]["host"]) for c in jobs["prometheus"]["static_configs"]]
        assert peers == [(["10.77.0.72:9090"], "h2"), (["10.77.0.73:9090"], "h3")]
        # both gateways' nginx and admission service; every host's exporters on its own address
        assert [c["labels"]["host"] for c in jobs["nginx"]["static_configs"]] == ["h1", "h2"]
        assert [c["targets"] for c in jobs["vllm-fleet-admission"]["static_configs"]] == [
            ["10.77.0.71:9402"],
            ["10.77.0.72:9402"],
        ]
        assert [c["targets"] for c in jobs["node"]["static_configs"]] == [
            ["10.77.0.71:9100"],
            ["10.77.0.72:9100"],
            ["10.77.0.73:9100"],
        ]
    same = {k: v for k, v in p2.items() if k != "global"}
    assert same == {k: v for k, v in p3.items() if k != "global"}  # the same targets, rules and alerting
    if shutil.which("promtool"):
        for host in ("h2", "h3"):
            etc = tmp_path / host
            etc.mkdir()
            (etc / "prometheus.yml").write_text(files(spec, host)["/etc/prometheus/prometheus.yml"])
            (etc / "rules").mkdir()
            r = subprocess.run(["promtool", "check", "config", str(etc / "prometheus.yml")],
                               capture_output=True, text=True)  # fmt: skip
            assert r.returncode == 0, r.stdout + r.stderr


def test_the_alertmanagers_gossip_with_each_other() -> None:
    spec = load_spec(EXAMPLE)
    args = {h: _args(files(spec, h)["/etc/default/prometheus-alertmanager"]) for h in ("h2", "h3")}
    assert "--web.listen-address=10.77.0.72:9093 --cluster.listen-address=10.77.0.72:9094 " in args["h2"]
    assert "--cluster.peer=10.77.0.73:9094 " in args["h2"] and "--cluster.peer=10.77.0.72" not in args["h2"]
    assert "--cluster.listen-address=10.77.0.73:9094 --cluster.peer=10.77.0.72:9094 " in args["h3"]
    other = parse_spec(data(monitoring={"alertmanager_cluster_port": 9500}))
    assert "--cluster.peer=10.77.0.73:9500" in files(other, "h2")["/etc/default/prometheus-alertmanager"]


# --------------------------------------------------------------------------- firewall


def _rules(spec: FleetSpec, host: str) -> list[str]:
    text = files(spec, host)["/etc/nftables.conf"]
    return [x.strip() for x in text.splitlines() if "accept comment" in x]


def test_vrrp_only_between_gateways_gossip_only_between_monitoring_hosts() -> None:
    spec = load_spec(EXAMPLE)
    h1, h2, h3 = (_rules(spec, h) for h in ("h1", "h2", "h3"))
    assert 'ip saddr { 10.77.0.72 } meta l4proto 112 accept comment "VRRP: the other gateway hosts"' in h1
    assert 'ip saddr { 10.77.0.71 } meta l4proto 112 accept comment "VRRP: the other gateway hosts"' in h2
    assert not any("112" in r for r in h3)
    for rules, peer in ((h2, "10.77.0.73"), (h3, "10.77.0.72")):
        for proto in ("tcp", "udp"):
            rule = f"ip saddr {{ {peer} }} {proto} dport {{ 9094 }} accept comment "
            assert rule + '"Alertmanager cluster: the other monitoring hosts"' in rules
        assert f"ip saddr {{ {peer} }} tcp dport {{ 9090, 9093 }}" in " ".join(rules)
    assert not any("9094" in r or "9090" in r for r in h1)
    # both gateways and both Prometheus servers reach the engines
    assert "ip saddr { 10.77.0.71, 10.77.0.72, 10.77.0.73 } tcp dport { 8101, 8102 }" in " ".join(h3)


@pytest.mark.skipif(shutil.which("nft") is None or shutil.which("unshare") is None or os.geteuid() != 0,
                    reason="needs nft, unshare and root")  # fmt: skip
def test_the_ha_firewall_loads_in_nftables(tmp_path: Path) -> None:
    spec = load_spec(EXAMPLE)
    for h in spec.hosts:
        path = tmp_path / f"{h.name}.nft"
        path.write_text(files(spec, h.name)["/etc/nftables.conf"])
        script = (f"mount --bind /dev/null /etc/protocols && mount --bind /dev/null /etc/services && "
                  f"nft -f {path} && nft list ruleset")  # fmt: skip
        res = subprocess.run(["unshare", "-n", "-m", "sh", "-c", script], capture_output=True, text=True)
        assert res.returncode == 0, res.stderr
        vrrp = [x for x in res.stdout.splitlines() if "VRRP" in x]
        assert [x.split(" accept")[0].strip() for x in vrrp] == (
            [] if h.name == "h3" else [f"ip saddr 10.77.0.7{3 - int(h.name[1])} meta l4proto 112"]
        )


def test_a_self_signed_certificate_names_the_virtual_address_too() -> None:
    """Clients of an HA fleet connect to the virtual address: each gateway's certificate must name it, beside
    the host's own addresses (one gateway: the host's addresses only)."""
    spec = parse_spec(data())
    assert build_context(spec, "h1")["vf"]["gateway_cert_addresses"] == ["10.77.0.71", "10.77.0.9"]
    assert build_context(spec, "h3")["vf"]["gateway_cert_addresses"] == []  # not a gateway
    raw = data()
    raw["gateway"] = {"host": "h1", "port": 8000}
    one = parse_spec(raw)
    assert build_context(one, "h1")["vf"]["gateway_cert_addresses"] == ["10.77.0.71"]


def test_keepalived_stops_before_nginx_at_shutdown() -> None:
    """A clean poweroff of the holder: keepalived (ordered after nginx, so stopped before it) gives the address
    up first, while nginx still finishes what it holds. Only on gateways of two or more."""
    spec = load_spec(EXAMPLE)
    drop_in = "/etc/systemd/system/keepalived.service.d/vllm-fleet.conf"
    text = files(spec, "h1")[drop_in]
    (after,) = [ln for ln in text.splitlines() if ln.startswith("After=")]
    assert after.split("=", 1)[1].split() == ["nginx.service", "vllm-fleet-admission.service"]
    assert drop_in not in files(spec, "h3")  # not a gateway
