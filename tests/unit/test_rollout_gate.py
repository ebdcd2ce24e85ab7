"""The canary gate (vllm_fleet.fleet.rollout_gate): judge()'s rules, read_figures() against a Prometheus
answering canned JSON, the PromQL through the real promtool (valid, and what it computes on known series),
report()'s lines, the VllmFleetRollout alert and the Alertmanager route that takes it to Slack."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import urllib.parse
from collections.abc import Iterator
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from vllm_fleet.fleet import rollout_gate as rg
from vllm_fleet.fleet.render import render_monitoring
from vllm_fleet.fleet.rollout_gate import Figures, judge, read_figures, report
from vllm_fleet.fleet.spec import FleetSpec, Rollout, parse_spec

REPO = Path(__file__).resolve().parents[2]
MODEL = "tiny-qwen3"


def rollout(**kw: Any) -> Rollout:
    data: dict[str, Any] = {
        "model": MODEL,
        "canary": {"name": "tiny-canary", "host": "h1", "port": 8103},
        "window_seconds": 600,
        "extra_wait_seconds": 300,
        "min_requests": 100,
        "margin": 0.25,
        "slo": {"ttft_p95_seconds": 1.0, "e2e_p95_seconds": 4.0, "error_ratio": 0.02},
    }
    data.update(kw)
    return Rollout.model_validate(data)


def figs(
    track: str, requests: float, errors: float = 0, ttft: float | None = 0.4, e2e: float | None = 2.0
) -> Figures:
    return Figures(track, requests, errors, ttft, e2e, seconds=60)


GOOD_STABLE = figs("stable", 2000, 10, 0.4, 2.0)  # 0.5 % errors


# ------------------------------------------------------------------------------------------------ judge


def test_too_few_canary_requests_waits_even_after_the_window() -> None:
    r = rollout()
    for elapsed in (30, 600, 899):
        v = judge(r, figs("canary", 40), GOOD_STABLE, elapsed)
        assert (v.action, v.rule) == ("wait", rg.TOO_FEW), elapsed
        assert "40 of 100 requests" in v.reason and v.checks == ()
    # a breach on too few requests decides nothing
    v = judge(r, figs("canary", 99, errors=50, ttft=9.0), GOOD_STABLE, 120)
    assert v.action == "wait"


def test_inconclusive_after_the_extra_wait_rolls_back_and_says_how_many() -> None:
    v = judge(rollout(), figs("canary", 40), GOOD_STABLE, 900)
    assert (v.action, v.rule) == ("rollback", rg.INCONCLUSIVE)
    assert v.reason.startswith("inconclusive") and "40 of 100 requests" in v.reason and "15m00s" in v.reason


def test_canary_without_latency_samples_is_not_judged() -> None:
    # the gateways counted enough, the engine's histograms have nothing of the track: never promote blind
    v = judge(rollout(), figs("canary", 500, ttft=None), GOOD_STABLE, 650)
    assert (v.action, v.rule) == ("wait", rg.TOO_FEW) and "no TTFT samples" in v.reason
    v = judge(rollout(), figs("canary", 500, ttft=None), GOOD_STABLE, 900)
    assert (v.action, v.rule) == ("rollback", rg.INCONCLUSIVE) and "no TTFT samples" in v.reason


@pytest.mark.parametrize(
    ("canary", "rule"),
    [
        (figs("canary", 150, ttft=1.2), rg.SLO_TTFT),
        (figs("canary", 150, e2e=4.5), rg.SLO_E2E),
        # 3 % errors; stable 2.5 %: within stable + 2 points, above the SLO's 2 %
        (figs("canary", 200, errors=6), rg.SLO_ERRORS),
    ],
)
def test_absolute_slo_breach_rolls_back_before_the_window_ends(canary: Figures, rule: str) -> None:
    stable = figs("stable", 2000, 50, 1.1, 4.4)  # as slow as the canary: the relative rules hold
    v = judge(rollout(), canary, stable, 60)
    assert (v.action, v.rule) == ("rollback", rule)
    assert [c.rule for c in v.breaches] == [rule]


def test_absolute_slo_breach_rolls_back_when_stable_has_too_few() -> None:
    v = judge(rollout(), figs("canary", 150, ttft=1.5), figs("stable", 10), 60)
    assert (v.action, v.rule) == ("rollback", rg.SLO_TTFT)
    assert "1500 ms > 1000 ms (slo.ttft_p95_seconds)" in v.reason


@pytest.mark.parametrize(
    ("canary", "rule"),
    [
        (figs("canary", 150, ttft=0.51), rg.STABLE_TTFT),  # stable 0.4 x 1.25 = 0.5
        (figs("canary", 150, e2e=2.6), rg.STABLE_E2E),  # stable 2.0 x 1.25 = 2.5
    ],
)
def test_worse_than_stable_by_more_than_the_margin_rolls_back_at_once(canary: Figures, rule: str) -> None:
    v = judge(rollout(), canary, GOOD_STABLE, 60)
    assert (v.action, v.rule) == ("rollback", rule)
    assert [c.rule for c in v.breaches] == [rule]  # within every absolute SLO
    # within the margin: no breach
    ok = judge(rollout(), figs("canary", 150, ttft=0.49, e2e=2.4), GOOD_STABLE, 60)
    assert ok.action == "wait" and not ok.breaches
    # no comparison without enough stable requests
    few = judge(rollout(), canary, figs("stable", 99), 60)
    assert few.action == "wait" and rule not in {c.rule for c in few.checks}


def test_error_ratio_worse_than_stable_by_more_than_the_slo_rolls_back() -> None:
    # canary 5 %, stable 0.5 %: 4.5 points worse (allowed 2); also above the absolute 2 %
    v = judge(rollout(), figs("canary", 200, errors=10), GOOD_STABLE, 60)
    assert v.action == "rollback"
    assert {c.rule for c in v.breaches} == {rg.SLO_ERRORS, rg.STABLE_ERRORS}
    rel = next(c for c in v.checks if c.rule == rg.STABLE_ERRORS)
    assert rel.limit == pytest.approx(0.025) and rel.value == pytest.approx(0.05)


def test_good_canary_waits_for_the_window_then_promotes() -> None:
    canary = figs("canary", 150, errors=1, ttft=0.45, e2e=2.2)
    v = judge(rollout(), canary, GOOD_STABLE, 599)
    assert (v.action, v.rule) == ("wait", rg.WATCHING) and not v.breaches
    assert {c.rule for c in v.checks} == {
        rg.SLO_TTFT, rg.SLO_E2E, rg.SLO_ERRORS, rg.STABLE_TTFT, rg.STABLE_E2E, rg.STABLE_ERRORS
    }  # fmt: skip
    v = judge(rollout(), canary, GOOD_STABLE, 600)
    assert (v.action, v.rule) == ("promote", rg.PASSED)


def test_stable_with_too_few_waits_for_the_extra_wait_then_judges_on_the_absolute_slos_only() -> None:
    canary = figs("canary", 150, ttft=0.9, e2e=3.0)
    stable = figs("stable", 60, ttft=0.3, e2e=1.0)  # the canary is far slower, but stable has too few
    v = judge(rollout(), canary, stable, 700)
    assert (v.action, v.rule) == ("wait", rg.STABLE_TOO_FEW)
    assert "60 of 100 requests" in v.reason and "absolute SLOs only" in v.reason
    v = judge(rollout(), canary, stable, 900)
    assert (v.action, v.rule) == ("promote", rg.ABSOLUTE_ONLY)
    assert "absolute SLOs only" in v.reason and "60 of 100 requests" in v.reason
    assert {c.rule for c in v.checks} == {rg.SLO_TTFT, rg.SLO_E2E, rg.SLO_ERRORS}
    # no latency SLO in the spec: said so (only the error ratio was judged)
    bare = rollout(slo={"error_ratio": 0.02})
    v = judge(bare, canary, stable, 900)
    assert v.action == "promote" and "(error ratio)" in v.reason


# ------------------------------------------------------------------------------------------------ report


def test_report_shows_both_sides_the_rule_and_every_check() -> None:
    canary, stable = (
        figs("canary", 150, errors=2, ttft=0.812, e2e=2.13),
        figs("stable", 1412, 3, 0.4, 2.012),
    )
    v = judge(rollout(), canary, stable, 250)
    text = report(v, canary, stable)
    lines = text.splitlines()
    assert lines[0].startswith(f"ROLLBACK {MODEL} canary tiny-canary: canary TTFT p95 812 ms > 500 ms")
    assert f"rule {rg.STABLE_TTFT}" in lines[1] and "4m10s in rotation" in lines[1] and "min 100" in lines[1]
    row = {
        ln.split()[0]: ln.split()
        for ln in lines
        if ln.strip().split(" ")[0] in ("requests", "errors", "TTFT")
    }
    assert row["requests"][1:] == ["150", "1412"]
    assert row["errors"][1:] == ["2", "(1.33%)", "3", "(0.21%)"]
    assert row["TTFT"][2:] == ["812", "ms", "400", "ms"]
    assert "  BREACH TTFT p95 812 ms > 500 ms (stable x (1 + margin 0.25))" in lines
    assert "  ok     e2e p95 2130 ms <= 4000 ms (slo.e2e_p95_seconds)" in lines
    assert len(lines) <= 14
    waiting = report(judge(rollout(), figs("canary", 3), stable, 10), figs("canary", 3), stable)
    assert "no rule judged yet" in waiting and waiting.startswith("WAIT")


# ------------------------------------------------------------------------------------------------ read_figures


class CannedPrometheus:
    """/api/v1/query answering canned JSON per expression; records what it was asked."""

    def __init__(self, answers: dict[str, dict[str, Any]]) -> None:
        self.asked: list[str] = []
        asked = self.asked

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                expr = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)["query"][0]
                asked.append(expr)
                doc = answers.get(expr, {"status": "success", "data": {"resultType": "vector", "result": []}})
                body = json.dumps(doc).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()


def vector(value: str | None) -> dict[str, Any]:
    result = [] if value is None else [{"metric": {}, "value": [1700000000.0, value]}]
    return {"status": "success", "data": {"resultType": "vector", "result": result}}


EXPECTED = {
    ("canary", "requests"): 'sum(increase(vllm_fleet_gateway_track_requests_total{job="vllm-fleet-exporter", '
    'model="tiny-qwen3", track="canary"}[125s]))',
    ("canary", "errors"): 'sum(increase(vllm_fleet_gateway_track_requests_total{job="vllm-fleet-exporter", '
    'model="tiny-qwen3", track="canary", outcome=~"error|shed"}[125s]))',
    (
        "canary",
        "ttft_p95",
    ): "histogram_quantile(0.95, sum by (le) (increase(vllm:time_to_first_token_seconds_bucket"
    '{job="vllm", model="tiny-qwen3", track="canary"}[125s])))',
    (
        "stable",
        "e2e_p95",
    ): "histogram_quantile(0.95, sum by (le) (increase(vllm:e2e_request_latency_seconds_bucket"
    '{job="vllm", model="tiny-qwen3", track="stable", role="primary"}[125s])))',
}


@pytest.fixture
def spec() -> FleetSpec:
    data = yaml.safe_load((REPO / "examples" / "tiny-cpu-2hosts.yml").read_text())
    data["rollouts"] = [{"model": MODEL, "canary": {"name": "tiny-canary", "host": "h2", "port": 8103}}]
    return parse_spec(data)


def test_read_figures_from_canned_prometheus_answers(spec: FleetSpec) -> None:
    q = rg.queries(MODEL, "canary", 125)
    s = rg.queries(MODEL, "stable", 125)
    for (track, key), expr in EXPECTED.items():
        assert (q if track == "canary" else s)[key] == expr
    answers = {
        q["requests"]: vector("150.4"),
        q["errors"]: vector("3"),
        q["ttft_p95"]: vector("0.812"),
        q["e2e_p95"]: vector("NaN"),  # a quantile of buckets that did not increase
        s["requests"]: vector("1412"),
        # s["errors"]: no series at all (no stable error yet) -> 0
        s["ttft_p95"]: vector("0.402"),
        s["e2e_p95"]: vector("2.012"),
    }
    prom = CannedPrometheus(answers)
    try:
        ask = rg.prometheus_asker(spec, ["http://127.0.0.1:9", prom.url])  # the first does not answer
        canary, stable = read_figures(ask, spec.rollouts[0], 124.2, scrape_interval=15)
    finally:
        prom.close()
    assert set(prom.asked) == set(q.values()) | set(s.values()) and len(prom.asked) == 8
    assert (canary.requests, canary.errors, canary.ttft_p95, canary.e2e_p95) == (150.4, 3.0, 0.812, None)
    assert canary.error_ratio == pytest.approx(3 / 150.4) and canary.seconds == 125 and canary.queries == q
    assert (stable.requests, stable.errors, stable.error_ratio, stable.e2e_p95) == (1412.0, 0.0, 0.0, 2.012)


def test_range_is_the_elapsed_time_at_least_two_scrape_intervals(spec: FleetSpec) -> None:
    assert rg.scrape_interval_seconds(spec) == 15.0  # monitoring.scrape_interval, the rendered global
    assert rg.range_seconds(3.2, 15) == 30 and rg.range_seconds(600.1, 15) == 601
    assert rg.duration_seconds("1m30s") == 90 and rg.duration_seconds("500ms") == 0.5
    with pytest.raises(ValueError):
        rg.duration_seconds("15")
    # the rendered prometheus.yml has the spec's interval as its global one, and no job sets its own
    spec.monitoring.scrape_interval = "7s"
    assert rg.scrape_interval_seconds(spec) == 7.0


def test_scrape_interval_is_the_rendered_one(spec: FleetSpec, tmp_path: Path) -> None:
    data = spec.model_dump(mode="json", exclude_unset=True)
    data["monitoring"] = {**data.get("monitoring", {}), "scrape_interval": "1m30s"}
    other = parse_spec(data)
    render_monitoring(other, tmp_path, folders=("monitoring",))
    prom = yaml.safe_load((tmp_path / "h1" / "etc" / "prometheus" / "prometheus.yml").read_text())
    assert all("scrape_interval" not in j for j in prom["scrape_configs"])
    assert rg.duration_seconds(prom["global"]["scrape_interval"]) == rg.scrape_interval_seconds(other) == 90


def test_model_names_are_quoted() -> None:
    q = rg.queries('org/m"x\\', "canary", 60)
    assert 'model="org/m\\"x\\\\"' in q["requests"]


# ------------------------------------------------------------------------------------------------ promtool

needs_promtool = pytest.mark.skipif(
    shutil.which("promtool") is None, reason="promtool (Debian prometheus) missing"
)


def _rules_file(tmp_path: Path, seconds: int) -> Path:
    rules = [
        {"record": f"vllm_fleet_rollout:{track}_{key}", "expr": expr}
        for track in ("canary", "stable")
        for key, expr in rg.queries(MODEL, track, seconds).items()
    ]
    rules.append(
        {"record": "vllm_fleet_rollout:quoted", "expr": rg.queries('a"b\\c', "stable", 60)["errors"]}
    )
    path = tmp_path / "rollout.rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "rollout", "rules": rules}]}, sort_keys=False))
    return path


@needs_promtool
def test_every_query_is_valid_promql(tmp_path: Path) -> None:
    r = subprocess.run(
        ["promtool", "check", "rules", str(_rules_file(tmp_path, 125))], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS: 9 rules found" in r.stdout


@needs_promtool
def test_queries_compute_the_figures_on_known_series(tmp_path: Path) -> None:
    """promtool test rules: two gateways' counters (summed), the canary's shed and the stable errors, and the
    engines' buckets — the stable backup's slow ones must not count."""
    gw = (
        'vllm_fleet_gateway_track_requests_total{{job="vllm-fleet-exporter", host="{h}", instance="{h}", '
        'model="{m}", track="{t}", outcome="{o}"}}'
    )
    eng = '{name}{{job="vllm", host="h1", instance="{i}", model="{m}", role="{r}", track="{t}", le="{le}"}}'

    def buckets(
        name: str, i: str, r: str, t: str, per_minute: list[int], m: str = MODEL
    ) -> list[dict[str, str]]:
        return [
            {"series": eng.format(name=name, i=i, m=m, r=r, t=t, le=le), "values": f"0+{n}x10"}
            for le, n in zip(("0.1", "0.5", "1", "+Inf"), per_minute, strict=True)
        ]

    series = [
        {"series": gw.format(h="g1", m=MODEL, t="canary", o="ok"), "values": "0+10x10"},
        {"series": gw.format(h="g2", m=MODEL, t="canary", o="ok"), "values": "0+10x10"},
        {"series": gw.format(h="g1", m=MODEL, t="canary", o="shed"), "values": "0+1x10"},
        {"series": gw.format(h="g1", m=MODEL, t="stable", o="ok"), "values": "0+100x10"},
        {"series": gw.format(h="g2", m=MODEL, t="stable", o="error"), "values": "0+2x10"},
        {"series": gw.format(h="g1", m="other", t="canary", o="error"), "values": "0+50x10"},
    ]
    ttft = "vllm:time_to_first_token_seconds_bucket"
    e2e = "vllm:e2e_request_latency_seconds_bucket"
    series += buckets(ttft, "tiny-canary", "canary", "canary", [0, 0, 10, 10])  # all in (0.5, 1]
    series += buckets(ttft, "tiny-a", "primary", "stable", [0, 10, 10, 10])  # all in (0.1, 0.5]
    series += buckets(ttft, "tiny-b", "primary", "stable", [0, 10, 10, 10])
    series += buckets(ttft, "tiny-backup", "backup", "stable", [0, 0, 0, 40])  # slow: must not count
    series += buckets(e2e, "tiny-canary", "canary", "canary", [0, 10, 10, 10])
    series += buckets(e2e, "tiny-a", "primary", "stable", [0, 10, 10, 10])
    series += buckets(ttft, "x-canary", "canary", "canary", [10, 10, 10, 10], m="other")

    def sample(track: str, key: str, value: float) -> dict[str, Any]:
        return {
            "expr": rg.queries(MODEL, track, 300)[key],
            "eval_time": "10m",
            "exp_samples": [{"labels": "{}", "value": value}],
        }

    tests = {
        "rule_files": [str(_rules_file(tmp_path, 300))],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": series,
                "promql_expr_test": [
                    sample("canary", "requests", 105),  # 50 + 50 ok on two gateways, 5 shed
                    sample("canary", "errors", 5),
                    sample("stable", "requests", 510),
                    sample("stable", "errors", 10),
                    sample("canary", "ttft_p95", 0.5 + 0.5 * 0.95),
                    sample("stable", "ttft_p95", 0.1 + 0.4 * 0.95),  # the backup's +Inf bucket left out
                    sample("canary", "e2e_p95", 0.1 + 0.4 * 0.95),
                    sample("stable", "e2e_p95", 0.1 + 0.4 * 0.95),
                ],
            }
        ],
    }
    path = tmp_path / "rollout.test.yml"
    path.write_text(yaml.safe_dump(tests, sort_keys=False))
    r = subprocess.run(["promtool", "test", "rules", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


# ------------------------------------------------------------------------------------------------ events


def test_rollout_event_is_an_alertmanager_v2_alert(spec: FleetSpec) -> None:
    r = spec.rollouts[0]
    started = 1700000000.0
    ev = rg.rollout_event(spec, r, started, "in_rotation", "tiny-canary in rotation (10 % of tiny-qwen3)")
    a = ev.alert()
    labels = a["labels"]
    assert labels == {
        "alertname": "VllmFleetRollout", "fleet": "tiny2", "model": MODEL, "canary": "tiny-canary",
        "rollout": "20231114T221320Z", "step": "in_rotation", "severity": "info",
    }  # fmt: skip
    start, end = (datetime.fromisoformat(str(a[k]).replace("Z", "+00:00")) for k in ("startsAt", "endsAt"))
    assert (end - start).total_seconds() == rg.EVENT_SECONDS
    ann = a["annotations"]
    assert isinstance(ann, dict) and ann["runbook_url"].endswith("/docs/runbooks/VllmFleetRollout.md")
    assert (REPO / "docs" / "runbooks" / "VllmFleetRollout.md").exists()
    assert "var-model=tiny-qwen3" in ann["dashboard_url"]
    for step in ("rolled_back", "failed_to_start", "reverted_by_lease"):
        assert rg.rollout_event(spec, r, started, step, "x").alert()["labels"]["severity"] == "warning"  # type: ignore[index]
    canary, stable = figs("canary", 150, ttft=1.5), GOOD_STABLE
    v = judge(r, canary, stable, 60)
    ve = rg.verdict_event(spec, r, started, v, canary, stable).alert()
    assert ve["labels"]["severity"] == "warning" and ve["labels"]["step"] == "verdict"  # type: ignore[index]
    assert ve["annotations"]["description"] == f"```\n{report(v, canary, stable)}\n```"  # type: ignore[index]


def test_alertmanager_urls_are_every_monitoring_host(spec: FleetSpec) -> None:
    assert rg.alertmanager_urls(spec) == ["http://10.77.0.61:9093"]


# ------------------------------------------------------------------------------------------------ routing

needs_amtool = pytest.mark.skipif(
    shutil.which("amtool") is None, reason="amtool (Debian alertmanager) missing"
)


@pytest.fixture
def alertmanager_yml(spec: FleetSpec, tmp_path: Path) -> Iterator[Path]:
    data = spec.model_dump(mode="json", exclude_unset=True)
    data["slack"] = {"enabled": True, "webhook_url_file": str(tmp_path / "url")}
    render_monitoring(parse_spec(data), tmp_path, folders=("monitoring",))
    yield tmp_path / "h1" / "etc" / "prometheus" / "alertmanager.yml"


@needs_amtool
@pytest.mark.parametrize(
    ("labels", "receiver"),
    [
        (["alertname=VllmFleetRollout", "severity=info", "step=in_rotation"], "slack-rollouts"),
        (["alertname=VllmFleetRollout", "severity=warning", "step=rolled_back"], "slack-rollouts"),
        (
            ["alertname=VllmKvCacheUsageHigh", "severity=info"],
            "blackhole",
        ),  # other info alerts: still dropped
        (["alertname=VllmKvCacheUsageHigh", "severity=warning"], "slack"),
    ],
)
def test_rollout_events_route_to_slack(alertmanager_yml: Path, labels: list[str], receiver: str) -> None:
    r = subprocess.run(
        ["amtool", "config", "routes", "test", f"--config.file={alertmanager_yml}", *labels],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0 and r.stdout.split() == [receiver], r.stdout + r.stderr


def test_rollout_receiver_sends_no_resolved(alertmanager_yml: Path) -> None:
    am = yaml.safe_load(alertmanager_yml.read_text())
    receivers = {r["name"]: r for r in am["receivers"]}
    rollouts, slack = receivers["slack-rollouts"]["slack_configs"][0], receivers["slack"]["slack_configs"][0]
    assert rollouts["send_resolved"] is False and slack["send_resolved"] is True
    assert {k: v for k, v in rollouts.items() if k != "send_resolved"} == {
        k: v for k, v in slack.items() if k != "send_resolved"
    }
    route = next(r for r in am["route"]["routes"] if r["matchers"] == ['alertname = "VllmFleetRollout"'])
    assert route["group_by"] == ["alertname", "fleet", "model", "rollout", "step"]
    # no inhibition rule can silence it: each names an instance, which a rollout event does not carry
    assert all("instance" in rule["equal"] for rule in am["inhibit_rules"])
