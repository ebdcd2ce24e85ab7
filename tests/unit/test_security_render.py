"""Secure defaults in the rendered files: who listens where (docs/security.md)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from vllm_fleet.fleet.render import render_host
from vllm_fleet.fleet.spec import FleetSpec, load_spec, parse_spec

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
