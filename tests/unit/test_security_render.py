"""Secure defaults in the rendered files: who listens where (docs/security.md)."""

from __future__ import annotations

import grp
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from vllm_fleet.fleet.render import render_host
from vllm_fleet.fleet.spec import FleetSpec, SpecError, load_spec, parse_spec

REPO = Path(__file__).resolve().parents[2]


def files(spec: FleetSpec, host: str) -> dict[str, str]:
    return {r.dest: r.content for r in render_host(spec, host)}


def two_hosts() -> FleetSpec:
    return load_spec(REPO / "examples/tiny-cpu-2hosts.yml")


def private_net() -> FleetSpec:
    d: dict[str, Any] = yaml.safe_load((REPO / "examples/tiny-cpu-2hosts.yml").read_text())
    d["hosts"][0]["private_address"] = "192.168.7.1"
    d["hosts"][1]["private_address"] = "192.168.7.2"
    d["monitoring"] = {"host": "h2"}
    return parse_spec(d)


def args(text: str) -> str:
    (line,) = [x for x in text.splitlines() if x.startswith("ARGS=")]
    return line


def listen_addresses(fs: dict[str, str]) -> list[str]:
    """Every listen address in the command lines and the exporter unit of one host."""
    found: list[str] = []
    for dest, text in fs.items():
        if dest.startswith("/etc/default/"):
            found += re.findall(r"-?-web\.listen-address=(\S+?)\"?(?:\s|$)", args(text))
        if dest.endswith("vllm-fleet-exporter.service"):
            found += re.findall(r"--listen (\S+)", text)
    return found


def test_single_host_binds_everything_to_loopback() -> None:
    spec = load_spec(REPO / "examples/tiny-cpu.yml")
    fs = files(spec, "h1")
    found = listen_addresses(fs)
    # node-exporter, nginx exporter, Prometheus, Alertmanager, the vllm-fleet exporter
    assert len(found) == 5, found
    assert all(a.startswith("127.0.0.1:") for a in found), found
    prom = yaml.safe_load(fs["/etc/prometheus/prometheus.yml"])
    targets = [t for job in prom["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]]
    assert all(t.startswith("127.0.0.1:") for t in targets), targets


def test_no_service_listens_on_every_interface() -> None:
    for spec in (load_spec(REPO / "examples/tiny-cpu.yml"), two_hosts(), private_net()):
        for h in spec.hosts:
            for a in listen_addresses(files(spec, h.name)):
                assert not a.startswith((":", "0.0.0.0", "[::]")), (h.name, a)


def test_across_hosts_bind_to_the_internal_address() -> None:
    spec = private_net()  # monitoring on h2, gateway on h1, private addresses set
    h1, h2 = files(spec, "h1"), files(spec, "h2")
    assert "--web.listen-address=192.168.7.1:9100" in args(h1["/etc/default/prometheus-node-exporter"])
    assert "-web.listen-address=192.168.7.1:9113" in args(h1["/etc/default/prometheus-nginx-exporter"])
    assert "--listen 192.168.7.1:9400" in h1["/etc/systemd/system/vllm-fleet-exporter.service"]
    # the monitoring host scrapes its own exporters on loopback; Prometheus and Alertmanager on its address
    assert "--web.listen-address=127.0.0.1:9100" in args(h2["/etc/default/prometheus-node-exporter"])
    assert "--web.listen-address=192.168.7.2:9090" in args(h2["/etc/default/prometheus"])
    assert "--web.listen-address=192.168.7.2:9093" in args(h2["/etc/default/prometheus-alertmanager"])
    prom = yaml.safe_load(h2["/etc/prometheus/prometheus.yml"])
    assert prom["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] == ["192.168.7.2:9093"]
    ds = yaml.safe_load(h2["/etc/grafana/provisioning/datasources/vllm-fleet.yml"])
    assert ds["datasources"][0]["url"] == "http://192.168.7.2:9090"


def test_prometheus_has_no_lifecycle_endpoint() -> None:
    for spec in (load_spec(REPO / "examples/tiny-cpu.yml"), two_hosts()):
        text = files(spec, spec.monitoring_host)["/etc/default/prometheus"]
        assert "--web.enable-lifecycle" not in args(text)


def test_web_auth_on_prometheus_alertmanager_node_exporter() -> None:
    spec = two_hosts()
    h1, h2 = files(spec, "h1"), files(spec, "h2")
    web = "--web.config.file=/etc/prometheus/vllm-fleet-web.yml"
    for fs, dest in ((h1, "prometheus"), (h1, "prometheus-alertmanager"), (h1, "prometheus-node-exporter"),
                     (h2, "prometheus-node-exporter")):  # fmt: skip
        assert web in args(fs[f"/etc/default/{dest}"]), dest
    # the nginx exporter 0.11 has no web config: address and firewall only
    assert "web.config" not in args(h1["/etc/default/prometheus-nginx-exporter"])
    prom = yaml.safe_load(h1["/etc/prometheus/prometheus.yml"])
    auth = {"username": "vllm-fleet", "password_file": "/etc/prometheus/vllm-fleet-web.password"}
    jobs = {j["job_name"]: j for j in prom["scrape_configs"]}
    for name in ("prometheus", "alertmanager", "node"):
        assert jobs[name]["basic_auth"] == auth, name
    for name in ("vllm", "vllm-fleet-exporter", "nginx"):
        assert "basic_auth" not in jobs[name], name
    assert prom["alerting"]["alertmanagers"][0]["basic_auth"] == auth
    ds = yaml.safe_load(h1["/etc/grafana/provisioning/datasources/vllm-fleet.yml"])["datasources"][0]
    assert ds["basicAuth"] is True and ds["basicAuthUser"] == "vllm-fleet"
    assert ds["secureJsonData"]["basicAuthPassword"] == "$__file{/etc/prometheus/vllm-fleet-web.password}"


def test_web_auth_off_renders_no_auth() -> None:
    d: dict[str, Any] = yaml.safe_load((REPO / "examples/tiny-cpu.yml").read_text())
    d["monitoring"]["web_auth"] = False
    fs = files(parse_spec(d), "h1")
    assert "basic_auth" not in fs["/etc/prometheus/prometheus.yml"]
    assert "web.config" not in args(fs["/etc/default/prometheus"])


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_rendered_prometheus_config_and_role_web_config_pass_promtool(tmp_path: Path) -> None:
    """The rendered prometheus.yml (basic auth from a password file) and the web config the monitoring role
    writes (the vllm_fleet_web_config module, ansible/plugins/modules: bcrypt, rewritten only when the password
    changes)."""
    d: dict[str, Any] = yaml.safe_load((REPO / "examples/tiny-cpu-2hosts.yml").read_text())
    d["monitoring"].update(web_config_file=str(tmp_path / "web.yml"), web_password_file=str(tmp_path / "pw"))
    spec = parse_spec(d)
    (tmp_path / "pw").write_text("s3cret-password")
    (tmp_path / "prometheus.yml").write_text(files(spec, "h1")["/etc/prometheus/prometheus.yml"])
    (tmp_path / "rules").mkdir()
    res = subprocess.run(["promtool", "check", "config", str(tmp_path / "prometheus.yml")],
                         capture_output=True, text=True)  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    from ansible_module_loader import load  # no ansible import in the test process

    module = load("vllm_fleet_web_config")
    group = grp.getgrgid(os.getgid()).gr_name

    def run(password: str, check: bool = False) -> bool:
        return bool(module.ensure(str(tmp_path / "web.yml"), "vllm-fleet", password, group, check))

    assert run("s3cret-password") is True
    first = (tmp_path / "web.yml").read_text()
    assert "s3cret" not in first and "$2b$" in first
    assert run("s3cret-password") is False  # same password: the hash stays (idempotent)
    assert run("another", check=True) is True and (tmp_path / "web.yml").read_text() == first
    res = subprocess.run(["promtool", "check", "web-config", str(tmp_path / "web.yml")],
                         capture_output=True, text=True)  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    assert oct((tmp_path / "web.yml").stat().st_mode & 0o777) == "0o640"


def nft(fs: dict[str, str]) -> list[str]:
    return [
        x.strip() for x in fs["/etc/nftables.conf"].splitlines() if x.strip().endswith('"') and "accept" in x
    ]


def test_firewall_rules_from_the_spec() -> None:
    spec = private_net()  # gateway h1, monitoring h2; private addresses
    h1, h2 = nft(files(spec, "h1")), nft(files(spec, "h2"))
    assert h1 == [
        'udp sport 67 udp dport 68 accept comment "DHCP answers"',
        'tcp dport { 22 } accept comment "ssh"',
        'tcp dport { 8000 } accept comment "the gateway (clients)"',
        "ip saddr { 192.168.7.1, 192.168.7.2 } tcp dport { 8101, 8102 } accept comment "
        '"engines: the gateway and monitoring hosts"',
        'ip saddr { 192.168.7.2 } tcp dport { 9100, 9113, 9400, 9402 } accept comment "exporters: the monitoring host"',
    ]
    # h2: no gateway port; its engine for the gateway (h1) and Prometheus (itself); no admin sources: Prometheus
    # and Alertmanager only from the host itself
    assert 'tcp dport { 8000 } accept comment "the gateway (clients)"' not in h2
    assert any("{ 192.168.7.1, 192.168.7.2 } tcp dport { 8101 }" in r for r in h2)
    assert not any("9090" in r or "9093" in r for r in h1 + h2)
    text = files(spec, "h2")["/etc/nftables.conf"]
    assert "policy drop;" in text and 'iif "lo" accept' in text


def test_firewall_options() -> None:
    d: dict[str, Any] = yaml.safe_load((REPO / "examples/tiny-cpu-2hosts.yml").read_text())
    d["firewall"] = {"admin_sources": ["10.1.0.0/16", "fd00::/8"], "open_tcp_ports": {"h1": [3000]},
                     "ssh_port": 2222, "allow_dhcp": False}  # fmt: skip
    d["gateway"]["tls"] = {"certificate": "/c.pem", "certificate_key": "/k.pem", "port": 8443}
    rules = nft(files(parse_spec(d), "h1"))
    assert 'tcp dport { 2222 } accept comment "ssh"' in rules
    assert 'tcp dport { 8000, 8443 } accept comment "the gateway (clients)"' in rules
    assert 'tcp dport { 3000 } accept comment "firewall.open_tcp_ports"' in rules
    assert 'ip saddr { 10.1.0.0/16 } tcp dport { 9090, 9093 } accept comment ' \
        '"Prometheus and Alertmanager: firewall.admin_sources"' in rules  # fmt: skip
    assert any(r.startswith("ip6 saddr { fd00::/8 } tcp dport { 9090, 9093 }") for r in rules)
    assert not any("DHCP" in r for r in rules)
    d["firewall"] = {"enabled": False}
    assert "/etc/nftables.conf" not in files(parse_spec(d), "h1")


def test_firewall_unknown_host_refused() -> None:
    d: dict[str, Any] = yaml.safe_load((REPO / "examples/tiny-cpu.yml").read_text())
    d["firewall"] = {"open_tcp_ports": {"nope": [3000]}}
    with pytest.raises(SpecError, match=r"firewall.open_tcp_ports.nope"):
        parse_spec(d)


@pytest.mark.skipif(shutil.which("nft") is None or shutil.which("unshare") is None or os.geteuid() != 0,
                    reason="needs nft, unshare and root")  # fmt: skip
def test_rendered_firewall_loads_in_nftables(tmp_path: Path) -> None:
    """nft accepts every host's rules (in a private network namespace), twice in a row (reload)."""
    for spec in (load_spec(REPO / "examples/tiny-cpu.yml"), two_hosts(), private_net()):
        for h in spec.hosts:
            path = tmp_path / f"{spec.name}-{h.name}.nft"
            path.write_text(files(spec, h.name)["/etc/nftables.conf"])
            # a minimal host (debootstrap minbase) has no /etc/protocols or /etc/services: hide them
            script = (f"mount --bind /dev/null /etc/protocols && mount --bind /dev/null /etc/services && "
                      f"nft -f {path} && nft -f {path} && nft list ruleset")  # fmt: skip
            res = subprocess.run(["unshare", "-n", "-m", "sh", "-c", script],
                                 capture_output=True, text=True)  # fmt: skip
            assert res.returncode == 0, res.stderr
            assert res.stdout.count("table inet vllm_fleet") == 1
