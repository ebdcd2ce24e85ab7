"""Alert rules: generated from the alerts table for a test spec, checked and unit-tested with promtool,
thresholds from the spec; the table itself (runbooks, names, severities, Grafana copies, the doc's table)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from vllm_fleet.fleet.context import build_context
from vllm_fleet.fleet.observability import (
    ADMISSION_METRICS,
    ALERTMANAGER_CLUSTER_METRICS,
    LORA_METRICS,
    SLEEP_METRICS,
    VLLM_METRICS,
    VRRP_METRICS,
    check_alert_thresholds,
)
from vllm_fleet.fleet.observability.alerts import ALERTS, FIXED_FOR, SPEC_KEYS, SPECIAL, markdown_table
from vllm_fleet.fleet.observability.grafana import alert_rules_yaml
from vllm_fleet.fleet.render import render_monitoring
from vllm_fleet.fleet.spec import ModelAlerts, load_spec, parse_spec
from vllm_fleet.host.exporter import PREFIX, STATE_METRICS

REPO = Path(__file__).resolve().parents[2]
TEST_SPEC = REPO / "alerts" / "tests" / "spec.yml"
RULES_DEST = "etc/prometheus/rules/vllm-fleet.rules.yml"
# the host exporter's series: a few by hand, and every one it derives from the launcher's state file
EXPORTER_METRICS = {
    "vllm_fleet_instance_state",
    "vllm_fleet_instance_restarts_total",
    "vllm_fleet_gateway_requests_total",
    "vllm_fleet_gateway_admission_fail_open_total",
    "vllm_fleet_instance_nodes",
    "vllm_fleet_worker_state",
} | {PREFIX + name + ("_total" if kind == "counter" else "") for kind, name, _help, _key in STATE_METRICS}
EXPORTER_METRICS |= set(ADMISSION_METRICS)  # the gateway admission service's (gateway.limits)
EXPORTER_METRICS |= set(VRRP_METRICS)  # keepalived's state on a gateway of two or more (gateway.hosts)
EXPORTER_METRICS |= set(ALERTMANAGER_CLUSTER_METRICS)  # Alertmanager's own (monitoring.hosts)
EXPORTER_METRICS |= set(LORA_METRICS)  # a LoRA instance's carried adapters (adapters[])
# an instance's sleep mode (models[].sleep); the wake summary's _sum and _count
EXPORTER_METRICS |= set(SLEEP_METRICS) | {n + s for n in SLEEP_METRICS for s in ("_sum", "_count")}

pytestmark = pytest.mark.skipif(
    shutil.which("promtool") is None, reason="promtool (Debian prometheus) missing"
)


def render_rules(spec_data: dict[str, Any], out: Path) -> Path:
    spec = parse_spec(spec_data)
    render_monitoring(spec, out, folders=("alerts",))
    return out / spec.monitoring_host / RULES_DEST


def spec_data() -> dict[str, Any]:
    data = yaml.safe_load(TEST_SPEC.read_text())
    assert isinstance(data, dict)
    return data


def rules_of(path: Path) -> list[dict[str, Any]]:
    doc = yaml.safe_load(path.read_text())
    return [r for g in doc["groups"] for r in g["rules"]]


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return render_rules(spec_data(), tmp_path_factory.mktemp("rules"))


def test_promtool_check_rules(rendered: Path) -> None:
    r = subprocess.run(["promtool", "check", "rules", str(rendered)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_promtool_unit_tests_pass(rendered: Path, tmp_path: Path) -> None:
    shutil.copy(rendered, tmp_path / "vllm-fleet.rules.yml")
    for t in sorted((REPO / "alerts" / "tests").glob("*.test.yml")):
        shutil.copy(t, tmp_path / t.name)
        r = subprocess.run(
            ["promtool", "test", "rules", t.name], cwd=tmp_path, capture_output=True, text=True
        )
        assert r.returncode == 0, r.stdout + r.stderr


def test_promtool_unit_tests_can_fail(rendered: Path, tmp_path: Path) -> None:
    """The same tests against rules with a changed threshold must fail (the tests are not vacuous)."""
    data = spec_data()
    data["alerts"]["queue_wait_p99_seconds"] = 10.0
    data["alerts"]["kv_cache_warning"] = 0.97
    data["alerts"]["multinode_partial_for"] = "10m"
    data["alerts"]["key_at_budget_for"] = "13m"
    data["alerts"]["admission_down_for"] = "5m"
    data["alerts"]["gateway_address_for"] = "3m"
    data["alerts"]["ha_peer_down_for"] = "5m"
    data["alerts"]["wake_slow_seconds"] = 45.0
    changed = render_rules(data, tmp_path / "changed")
    shutil.copy(changed, tmp_path / "vllm-fleet.rules.yml")
    shutil.copy(REPO / "alerts" / "tests" / "vllm-fleet.test.yml", tmp_path)
    r = subprocess.run(
        ["promtool", "test", "rules", "vllm-fleet.test.yml"], cwd=tmp_path, capture_output=True, text=True
    )
    assert r.returncode != 0
    assert "VllmQueueWaitHigh" in r.stdout + r.stderr and "VllmKvCacheUsageHigh" in r.stdout + r.stderr
    assert "VllmMultiNodeGroupPartial" in r.stdout + r.stderr
    assert "VllmFleetKeyAtBudget" in r.stdout + r.stderr
    assert "VllmFleetGatewayAdmissionDown" in r.stdout + r.stderr
    for name in ("VllmFleetGatewayAddressNotHeld", "VllmFleetGatewayAddressSplit", "VllmFleetGatewayPeerDown",
                 "VllmFleetMonitoringPeerDown", "VllmFleetWakeSlow"):  # fmt: skip
        assert name in r.stdout + r.stderr


def test_generated_test_file_is_current() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_tests", REPO / "alerts" / "tests" / "make_tests.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.build() == (REPO / "alerts" / "tests" / "vllm-fleet.test.yml").read_text()


def test_every_alert_has_firing_and_silent_cases(rendered: Path) -> None:
    names = {r["alert"] for r in rules_of(rendered)}
    tests = yaml.safe_load((REPO / "alerts" / "tests" / "vllm-fleet.test.yml").read_text())["tests"]
    fires: set[str] = set()
    silent: set[str] = set()
    for t in tests:
        for a in t.get("alert_rule_test", []):
            (fires if a["exp_alerts"] else silent).add(a["alertname"])
    assert names - fires == set(), "alerts without a firing test"
    assert names - {"Watchdog"} - silent == set(), "alerts without a must-stay-silent test"


def test_alert_conventions_and_runbooks(rendered: Path) -> None:
    for r in rules_of(rendered):
        name = r["alert"]
        assert re.fullmatch(r"(Vllm[A-Z][A-Za-z0-9]+|Watchdog)", name)
        assert r["labels"]["severity"] in {"critical", "warning", "info", "none"}
        ann = r["annotations"]
        assert {"summary", "description", "runbook_url", "dashboard_url"} <= set(ann)
        assert ann["runbook_url"].endswith(f"/{name}.md")
        runbook = REPO / "docs" / "runbooks" / f"{name}.md"
        assert runbook.exists(), f"missing runbook {runbook}"
        assert name in runbook.read_text()


def _metric_names(expr: str) -> set[str]:
    # identifiers directly followed by a selector, a range or used bare; drop PromQL keywords/functions
    names = set(re.findall(r"(?<![\w:])([a-zA-Z_:][\w:]*)\s*(?=\{|\[)", expr))
    names |= set(re.findall(r"\b(vllm:[\w]+|vllm_fleet_\w+)", expr))
    return names


def test_only_known_metric_names(rendered: Path) -> None:
    for r in rules_of(rendered):
        for name in _metric_names(r["expr"]):
            assert name in VLLM_METRICS or name in EXPORTER_METRICS or name == "up", (r["alert"], name)
    # and the removed / invented names from old dashboards never appear
    text = rendered.read_text()
    for wrong in (
        "gpu_cache_usage",
        "time_per_output_token_seconds",
        "time_in_queue",
        "request_waiting_time",
    ):
        assert wrong not in text


def _expr(rules: list[dict[str, Any]], name: str, match: str = "") -> str:
    found = [r["expr"] for r in rules if r["alert"] == name and match in r["expr"]]
    assert found, (name, match)
    return " ".join(found)


def test_thresholds_come_from_the_spec(tmp_path: Path) -> None:
    data = spec_data()
    odd = {
        "kv_cache_warning": 0.912,
        "kv_cache_critical": 0.937,
        "queue_wait_p99_seconds": 3.21,
        "decode_rate_floor": 123.4,
        "gateway_5xx_ratio": 0.0321,
        "ttft_p99_slo_seconds": 7.5,
        "preemptions_per_second": 0.77,
        "restart_loop_count": 7,
        "restart_loop_window": "37m",
        "multinode_partial_for": "11m",
        "decode_stall_for": "3m",
        "rate_window": "4m",
        "kv_cache_for": "13m",
        "key_at_budget_for": "17m",
        "admission_down_for": "3m",
        "gateway_address_for": "2m",
        "ha_peer_down_for": "7m",
        "wake_slow_seconds": 12.5,
    }
    data["alerts"].update(odd)
    data["models"][1]["alerts"] = {
        "decode_rate_floor": 55.5,
        "ttft_p99_slo_seconds": 0.25,
        "wake_slow_seconds": 90,
    }
    rules = rules_of(render_rules(data, tmp_path))
    assert "> 0.912" in _expr(rules, "VllmKvCacheUsageHigh")
    assert "> 0.937" in _expr(rules, "VllmKvCacheUsageCritical")
    assert "> 3.21" in _expr(rules, "VllmQueueWaitHigh")
    assert "[4m]" in _expr(rules, "VllmQueueWaitHigh")
    assert "< 123.4" in _expr(rules, "VllmDecodeRateLow", 'instance!~"tiny-b"')
    assert "< 55.5" in _expr(rules, "VllmDecodeRateLow", 'instance="tiny-b"')
    assert "> 0.0321" in _expr(rules, "VllmGateway5xxRatioHigh")
    assert "> 7.5" in _expr(rules, "VllmTtftSloBreached", 'instance!~"tiny-b"')
    assert "> 0.25" in _expr(rules, "VllmTtftSloBreached", 'instance="tiny-b"')
    assert "> 0.77" in _expr(rules, "VllmPreemptions")
    assert "[37m]) >= 7" in _expr(rules, "VllmUnitRestartLoop")
    assert {r["for"] for r in rules if r["alert"] == "VllmMultiNodeGroupPartial"} == {"11m"}
    assert "[3m]" in _expr(rules, "VllmDecodeStalled")
    assert {r["for"] for r in rules if r["alert"].startswith("VllmKvCache")} == {"13m"}
    assert {r["for"] for r in rules if r["alert"] == "VllmFleetKeyAtBudget"} == {"17m"}
    assert "refused_total[4m]" in _expr(rules, "VllmFleetKeyAtBudget")
    assert {r["for"] for r in rules if r["alert"] == "VllmFleetGatewayAdmissionDown"} == {"3m"}
    assert {r["for"] for r in rules if r["alert"].startswith("VllmFleetGatewayAddress")} == {"2m"}
    assert {r["for"] for r in rules if r["alert"].endswith("PeerDown")} == {"7m"}
    assert "> 12.5" in _expr(rules, "VllmFleetWakeSlow", 'instance!~"tiny-b"')
    assert "> 90.0" in _expr(rules, "VllmFleetWakeSlow", 'instance="tiny-b"')


ADMISSION_ALERTS = {"VllmFleetKeyAtBudget", "VllmFleetGatewayAdmissionDown"}


@pytest.mark.parametrize(
    "gateway",
    [
        {"host": "h1", "limits": {"enabled": False}},
        {"host": "h1", "auth": "none"},
        {"host": "h1", "enabled": False},
    ],
)
def test_admission_alerts_only_where_the_gateway_runs_the_admission_service(
    tmp_path: Path, gateway: dict[str, Any]
) -> None:
    """The per-key alerts read the admission service's series: a fleet without it (limits off, an open
    gateway, no gateway) gets neither rule, and every other alert as before."""
    base = {r["alert"] for r in rules_of(render_rules(spec_data(), tmp_path / "on"))}
    assert base >= ADMISSION_ALERTS
    data = spec_data()
    data["gateway"] = gateway
    names = {r["alert"] for r in rules_of(render_rules(data, tmp_path / "off"))}
    assert names == base - ADMISSION_ALERTS


def test_alerts_needs_names_a_context_flag() -> None:
    """``needs`` is a key of the context's ``vf`` (a typo would otherwise fail only at render time)."""
    vf = build_context(parse_spec(spec_data()), "h1")["vf"]
    needing = [a for a in ALERTS if a.needs]
    assert {a.name for a in needing} == ADMISSION_ALERTS
    for a in needing:
        assert isinstance(vf[a.needs], bool), a.name


def test_decode_floor_zero_disables_the_rule(tmp_path: Path) -> None:
    data = spec_data()
    data["alerts"]["decode_rate_floor"] = 0
    data["models"][1].pop("alerts")
    assert not [r for r in rules_of(render_rules(data, tmp_path)) if r["alert"] == "VllmDecodeRateLow"]


def test_ttft_slo_must_be_a_bucket_bound(tmp_path: Path) -> None:
    data = spec_data()
    data["alerts"]["ttft_p99_slo_seconds"] = 2.0  # vLLM's TTFT buckets go 1.0, 2.5: no 2.0 bound
    with pytest.raises(ValueError, match="not a bucket bound of vLLM's TTFT histogram"):
        render_rules(data, tmp_path)
    problems = check_alert_thresholds(parse_spec(data))
    assert problems and problems[0][0] == "alerts.ttft_p99_slo_seconds" and "2.5" in problems[0][1]
    # a bound added with --custom-histogram-buckets is accepted
    for m in data["models"]:
        m["extra_args"] = ["--custom-histogram-buckets", '{"time_to_first_token": [0.5, 1.0, 2.0, 5.0]}']
    data["models"][1]["alerts"]["ttft_p99_slo_seconds"] = 2.0
    assert check_alert_thresholds(parse_spec(data)) == []
    render_rules(data, tmp_path / "custom")


def test_example_specs_render_valid_rules(tmp_path: Path) -> None:
    for example in sorted((REPO / "examples").glob("*.yml")):
        spec = load_spec(example)
        assert check_alert_thresholds(spec) == [], example
        render_monitoring(spec, tmp_path / example.stem, folders=("alerts",))
        path = tmp_path / example.stem / spec.monitoring_host / RULES_DEST
        r = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True)
        assert r.returncode == 0, (example, r.stdout + r.stderr)


@pytest.mark.parametrize("slack", [False, True])
def test_rendered_prometheus_and_alertmanager_configs_are_valid(tmp_path: Path, slack: bool) -> None:
    data = spec_data()
    data["hosts"][1]["gpus"] = {"count": 2}
    data["monitoring"] = {"host": "h1", "gpu_exporter_port": 9401}
    secret = tmp_path / "slack_url"
    secret.write_text("http://127.0.0.1:9/slack\n")
    data["slack"] = {"enabled": slack, "webhook_url_file": str(secret)}
    spec = parse_spec(data)
    render_monitoring(spec, tmp_path, folders=("alerts", "monitoring"))
    etc = tmp_path / "h1" / "etc" / "prometheus"
    r = subprocess.run(
        ["promtool", "check", "config", str(etc / "prometheus.yml")], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS: 1 rule files found" in r.stdout + r.stderr
    prom = yaml.safe_load((etc / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in prom["scrape_configs"]}
    assert set(jobs) == {
        "prometheus", "alertmanager", "vllm", "node", "vllm-fleet-exporter", "nginx", "gpu", "vllm-fleet-admission"
    }  # fmt: skip
    # the test spec's gateway runs the admission service (auth api_keys, limits on: the defaults)
    adm = jobs["vllm-fleet-admission"]["static_configs"][0]
    assert adm["targets"] == ["127.0.0.1:9402"] and adm["labels"] == {"host": "h1", "instance": "h1"}
    engines = {c["labels"]["instance"]: c for c in jobs["vllm"]["static_configs"]}
    assert engines["tiny"]["targets"] == ["127.0.0.1:8101"]  # on the monitoring host: loopback
    assert (
        engines["tiny-b"]["targets"] == ["10.0.0.2:8101"] and engines["tiny-b"]["labels"]["role"] == "backup"
    )
    assert jobs["gpu"]["static_configs"][0]["labels"]["host"] == "h2"
    if shutil.which("amtool"):
        r = subprocess.run(
            ["amtool", "check-config", str(etc / "alertmanager.yml")], capture_output=True, text=True
        )
        assert r.returncode == 0, r.stdout + r.stderr
    am = yaml.safe_load((etc / "alertmanager.yml").read_text())
    text = (etc / "alertmanager.yml").read_text()
    assert "http://127.0.0.1:9/slack" not in text  # the secret stays in its file
    inhibit = am["inhibit_rules"][0]
    assert inhibit["source_matchers"] == ['alertname = "VllmInstanceDown"'] and inhibit["equal"] == [
        "instance"
    ]
    if slack:
        assert am["global"]["slack_api_url_file"] == str(secret)
        cfg = next(r for r in am["receivers"] if r["name"] == "slack")["slack_configs"][0]
        assert cfg["send_resolved"] is True and "runbook_url" in cfg["title_link"]
        assert (
            ".Labels.model" in cfg["text"]
            and ".Labels.host" in cfg["text"]
            and ".Annotations.description" in cfg["text"]
        )
    else:
        assert am["route"]["receiver"] == "blackhole"


def test_templates_render_the_same_without_lstrip_blocks() -> None:
    """Ansible's template module defaults to lstrip_blocks=False; our templates must not depend on it."""
    from vllm_fleet.fleet.render import make_env

    data = spec_data()
    data["slack"] = {"enabled": True}
    ctx = build_context(parse_spec(data), "h1")
    ours, ansible_like = make_env(REPO), make_env(REPO)
    ansible_like.lstrip_blocks = False
    templates = [
        p.relative_to(REPO).as_posix()
        for f in ("alerts", "monitoring", "dashboards")
        for p in (REPO / f).glob("*.j2")
    ]
    assert len(templates) >= 7
    for t in templates:
        assert ours.get_template(t).render(**ctx) == ansible_like.get_template(t).render(**ctx), t


# ------------------------------------------------------------------------------------- the alerts table


def test_table_entries_follow_the_conventions(rendered: Path) -> None:
    """Every table alert: CamelCase name, known severity, a runbook naming it, rendered into the rules."""
    names = [a.name for a in ALERTS]
    assert len(names) == len(set(names))
    rendered_names = {r["alert"] for r in rules_of(rendered)}
    for a in ALERTS:
        assert re.fullmatch(r"(?:[A-Z][a-z0-9]+)+", a.name), a.name
        assert a.severity in {"critical", "warning", "info", "none"}, a.name
        runbook = REPO / a.runbook
        assert runbook.is_file(), f"missing runbook {runbook}"
        assert a.name in runbook.read_text()
        assert a.name in rendered_names  # the test spec enables every alert
        assert a.summary and a.description


def test_table_placeholders_and_spec_keys() -> None:
    for a in ALERTS:
        texts = (a.expression, a.summary, a.description)
        used = set(re.findall(r"\$\{(\w+)\}", " ".join(texts)))
        assert used <= SPEC_KEYS | SPECIAL, (a.name, used - SPEC_KEYS - SPECIAL)
        assert not {"value", "op"} & used, a.name  # filled in by .expression
        assert a.for_ is None or a.for_ in SPEC_KEYS or FIXED_FOR.fullmatch(a.for_), a.name
        assert not isinstance(a.threshold, str) or a.threshold in SPEC_KEYS, a.name
        assert set(a.spec_keys) <= SPEC_KEYS
        if a.per_instance:  # the per-instance override has the fleet-wide key's name
            assert isinstance(a.threshold, str) and a.threshold in ModelAlerts.model_fields, a.name
            assert "${sel}" in a.expression, a.name
        else:
            assert "${sel}" not in a.expression, a.name
        assert "${threshold}" not in a.description or a.per_instance, a.name


def test_grafana_rules_are_the_table_alerts_with_a_uid(tmp_path: Path) -> None:
    data = spec_data()
    doc = yaml.safe_load(alert_rules_yaml(build_context(parse_spec(data), "h1")))
    got = {r["title"]: r for r in doc["groups"][0]["rules"]}
    want = {a.name: a for a in ALERTS if a.grafana_uid}
    assert set(got) == set(want) and len(want) >= 4
    data["models"][1].pop("alerts")  # no per-instance variants: one Prometheus rule per alert
    prom = {r["alert"]: r for r in rules_of(render_rules(data, tmp_path))}
    for name, a in want.items():
        r = got[name]
        assert r["uid"] == a.grafana_uid and r["labels"]["severity"] == a.severity
        assert r["annotations"]["summary"] == prom[name]["annotations"]["summary"]
        query = r["data"][0]["model"]["expr"]
        assert query in prom[name]["expr"], name  # Grafana queries the value the Prometheus rule compares
        threshold = data["alerts"].get(a.threshold) if isinstance(a.threshold, str) else a.threshold
        assert r["data"][-1]["model"]["expression"] == f"$B {a.op} {threshold}"
        assert r["for"] == prom[name]["for"]


def test_observability_doc_lists_the_table() -> None:
    """docs/observability.md holds the table's markdown (rewrite it with tools/alerts_doc.py)."""
    doc = (REPO / "docs" / "observability.md").read_text()
    assert markdown_table() in doc, (
        "docs/observability.md is behind the alerts table: run tools/alerts_doc.py"
    )
    assert len(markdown_table().splitlines()) == 2 + len(ALERTS)


def test_canary_cases_fail_against_rules_blind_to_canaries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The canary cases are not vacuous: with the rules as they were before canaries (every stopped target down,
    any role but primary a failover), promtool reports a stopped canary as down and a running one as failover."""
    import dataclasses

    from vllm_fleet.fleet.observability import alerts

    old = {
        "VllmInstanceDown": dict(
            value='up{job="vllm"}',
            expr='${value} ${op} ${threshold}\nunless on (instance) (vllm_fleet_instance_state{state="loading"} == 1)',
        ),
        "VllmFailoverActive": dict(
            value='sum by (model) (rate(vllm:request_success_total{role!="primary"}[${rate_window}]))'
            ' + sum by (model) (vllm:num_requests_running{role!="primary"})'
        ),
    }
    blind = tuple(dataclasses.replace(a, **old[a.name]) if a.name in old else a for a in alerts.ALERTS)
    monkeypatch.setattr(alerts, "ALERTS", blind)
    shutil.copy(render_rules(spec_data(), tmp_path / "blind"), tmp_path / "vllm-fleet.rules.yml")
    shutil.copy(REPO / "alerts" / "tests" / "vllm-fleet.test.yml", tmp_path)
    r = subprocess.run(
        ["promtool", "test", "rules", "vllm-fleet.test.yml"], cwd=tmp_path, capture_output=True, text=True
    )
    out = r.stdout + r.stderr
    assert r.returncode != 0
    # a stopped canary reported down, and one never started / left failed
    assert "alertname: VllmInstanceDown, time: 25m" in out and "alertname: VllmInstanceDown, time: 5m" in out
    assert 'instance="tiny-canary"' in out and 'instance="other-canary"' in out
    assert "alertname: VllmFailoverActive, time: 5m" in out  # the canary's share taken for a failover
