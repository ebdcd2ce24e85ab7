"""Dashboards (grafanalib) and Grafana provisioning files: shapes checked against Grafana's documented
file-provisioning schema (no Grafana server can run here), thresholds drawn at the spec's alert values."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from vllm_fleet.fleet.observability import VLLM_METRICS
from vllm_fleet.fleet.observability.dashboards import (
    INSTANCE_UID,
    KEYS_ROW,
    OVERVIEW_UID,
    key_panels,
    panel_queries,
)
from vllm_fleet.fleet.render import render_monitoring
from vllm_fleet.fleet.spec import parse_spec

REPO = Path(__file__).resolve().parents[2]
PROV = "etc/grafana/provisioning"
DASH = "var/lib/grafana/dashboards/vllm-fleet"

# --- Grafana's file-provisioning formats (grafana.com/docs/grafana/latest/administration/provisioning/ and
# .../alerting/set-up/provision-alerting-resources/file-provisioning/), as JSON Schema


def _closed(required: list[str], properties: dict[str, Any]) -> dict[str, Any]:
    """An object with the ``required`` keys and no key outside ``properties``."""
    return {"type": "object", "required": required, "properties": properties, "additionalProperties": False}


def _provisioning_file(
    key: str, item: dict[str, Any], min_items: int = 0, closed: bool = False
) -> dict[str, Any]:
    """A provisioning file: ``apiVersion: 1`` and a list of ``item`` under ``key``."""
    items: dict[str, Any] = {"type": "array", **({"minItems": min_items} if min_items else {}), "items": item}
    doc: dict[str, Any] = {
        "type": "object",
        "required": ["apiVersion", key],
        "properties": {"apiVersion": {"const": 1}, key: items},
    }
    return {**doc, "additionalProperties": False} if closed else doc


DATASOURCES = _provisioning_file(
    "datasources",
    _closed(
        ["name", "type", "access", "url", "uid"],
        {
            "name": {"type": "string"},
            "type": {"const": "prometheus"},
            "access": {"enum": ["proxy", "direct"]},
            "url": {"type": "string", "pattern": "^https?://"},
            "uid": {"type": "string", "maxLength": 40},
            "isDefault": {"type": "boolean"},
            "editable": {"type": "boolean"},
            "jsonData": {"type": "object"},
            # Grafana's documented basic-auth fields (secureJsonData.basicAuthPassword, $__file{} expanded)
            "basicAuth": {"type": "boolean"},
            "basicAuthUser": {"type": "string"},
            "secureJsonData": {
                "type": "object",
                "properties": {"basicAuthPassword": {"type": "string", "pattern": "^\\$__file\\{/.+\\}$"}},
                "additionalProperties": False,
            },
        },
    ),
    min_items=1,
    closed=True,
)
PROVIDERS = _provisioning_file(
    "providers",
    _closed(
        ["name", "type", "options"],
        {
            "name": {"type": "string"},
            "orgId": {"type": "integer"},
            "folder": {"type": "string"},
            "folderUid": {"type": "string"},
            "type": {"const": "file"},
            "disableDeletion": {"type": "boolean"},
            "allowUiUpdates": {"type": "boolean"},
            "updateIntervalSeconds": {"type": "integer"},
            "options": _closed(
                ["path"],
                {"path": {"type": "string"}, "foldersFromFilesStructure": {"type": "boolean"}},
            ),
        },
    ),
)
DURATION = {"type": "string", "pattern": r"^([0-9]+(ms|s|m|h|d|w|y))+$"}
QUERY = _closed(
    ["refId", "datasourceUid", "model", "relativeTimeRange"],
    {
        "refId": {"type": "string"},
        "datasourceUid": {"type": "string"},
        "relativeTimeRange": {
            "type": "object",
            "required": ["from", "to"],
            "properties": {
                "from": {"type": "integer", "minimum": 0},
                "to": {"type": "integer", "minimum": 0},
            },
        },
        "model": {"type": "object", "required": ["refId"]},
        "queryType": {"type": "string"},
    },
)
STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
ALERT_RULE = _closed(
    ["uid", "title", "condition", "data", "noDataState", "execErrState", "for"],
    {
        "uid": {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,40}$"},
        "title": {"type": "string"},
        "condition": {"type": "string"},
        "data": {"type": "array", "minItems": 1, "items": QUERY},
        "noDataState": {"enum": ["Alerting", "NoData", "OK"]},
        "execErrState": {"enum": ["Alerting", "Error", "OK"]},
        "for": DURATION,
        "labels": STRING_MAP,
        "annotations": STRING_MAP,
        "isPaused": {"type": "boolean"},
    },
)
ALERT_RULES = _provisioning_file(
    "groups",
    _closed(
        ["orgId", "name", "folder", "interval", "rules"],
        {
            "orgId": {"type": "integer"},
            "name": {"type": "string"},
            "folder": {"type": "string"},
            "interval": DURATION,
            "rules": {"type": "array", "minItems": 1, "items": ALERT_RULE},
        },
    ),
    closed=True,
)
CONTACT_POINTS = _provisioning_file(
    "contactPoints",
    _closed(
        ["orgId", "name", "receivers"],
        {
            "orgId": {"type": "integer"},
            "name": {"type": "string"},
            "receivers": {
                "type": "array",
                "items": _closed(
                    ["uid", "type", "settings"],
                    {
                        "uid": {"type": "string"},
                        "type": {"const": "slack"},
                        "disableResolveMessage": {"type": "boolean"},
                        "settings": {
                            "type": "object",
                            "anyOf": [{"required": ["url"]}, {"required": ["token", "recipient"]}],
                        },
                    },
                ),
            },
        },
    ),
)
POLICIES = _provisioning_file(
    "policies",
    _closed(
        ["orgId", "receiver"],
        {
            "orgId": {"type": "integer"},
            "receiver": {"type": "string"},
            "group_by": {"type": "array", "items": {"type": "string"}},
            "group_wait": DURATION,
            "group_interval": DURATION,
            "repeat_interval": DURATION,
            "routes": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["receiver"],
                    "properties": {
                        "receiver": {"type": "string"},
                        "object_matchers": {
                            "type": "array",
                            "items": {
                                "type": "array",
                                "minItems": 3,
                                "maxItems": 3,
                                "prefixItems": [
                                    {"type": "string"},
                                    {"enum": ["=", "!=", "=~", "!~"]},
                                ],
                            },
                        },
                    },
                },
            },
        },
    ),
)


def spec_data() -> dict[str, Any]:
    data = yaml.safe_load((REPO / "alerts" / "tests" / "spec.yml").read_text())
    data["slack"] = {"enabled": True, "webhook_url_file": "/etc/vllm-fleet/secrets/slack_webhook_url"}
    data["alerts"].update(kv_cache_warning=0.913, kv_cache_critical=0.971, queue_wait_p99_seconds=1.5)
    data["alerts"].update(ttft_p99_slo_seconds=5.0, preemptions_per_second=0.37, gateway_5xx_ratio=0.021)
    data["alerts"]["decode_rate_floor"] = 42
    return data


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("grafana")
    render_monitoring(parse_spec(spec_data()), d, folders=("dashboards",))
    return d / "h1"


def _yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def test_provisioning_files_match_grafana_schema(out: Path) -> None:
    jsonschema.validate(_yaml(out / PROV / "datasources/vllm-fleet.yml"), DATASOURCES)
    jsonschema.validate(_yaml(out / PROV / "dashboards/vllm-fleet.yml"), PROVIDERS)
    jsonschema.validate(_yaml(out / PROV / "alerting/vllm-fleet-rules.yml"), ALERT_RULES)
    jsonschema.validate(_yaml(out / PROV / "alerting/vllm-fleet-contact-points.yml"), CONTACT_POINTS)
    jsonschema.validate(_yaml(out / PROV / "alerting/vllm-fleet-policies.yml"), POLICIES)


def test_schema_rejects_the_unconverted_grafanalib_shape() -> None:
    """AlertRulev9.to_json_data() (Ruler API shape, nested under grafana_alert) is not file provisioning."""
    from vllm_fleet.fleet.observability.grafana import rules

    ctx_vf = {**parse_spec(spec_data()).model_dump(mode="json")}
    raw = rules(ctx_vf)[0].to_json_data()
    doc = {
        "apiVersion": 1,
        "groups": [{"orgId": 1, "name": "g", "folder": "f", "interval": "1m", "rules": [raw]}],
    }
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(json.dumps(raw and doc)), ALERT_RULES)


def test_alert_rules_are_consistent(out: Path) -> None:
    doc = _yaml(out / PROV / "alerting/vllm-fleet-rules.yml")
    for rule in doc["groups"][0]["rules"]:
        refs = {q["refId"] for q in rule["data"]}
        assert rule["condition"] in refs
        prom = [q for q in rule["data"] if q["datasourceUid"] != "-100"]
        assert prom and all(q["datasourceUid"] == "vllm-fleet-prom" for q in prom)
        assert all(q["model"]["datasource"] == {"type": "prometheus", "uid": "vllm-fleet-prom"} for q in prom)
        assert rule["noDataState"] == "OK" and rule["execErrState"] == "Error"
        assert rule["annotations"]["runbook_url"].endswith(f"/{rule['title']}.md")
    math = {r["title"]: r["data"][-1]["model"]["expression"] for r in doc["groups"][0]["rules"]}
    assert math["VllmKvCacheUsageCritical"] == "$B > 0.971"
    assert math["VllmQueueWaitHigh"] == "$B > 1.5"
    assert math["VllmTtftSloBreached"] == "$B > 5.0"


def test_contact_point_reads_the_secret_file(out: Path) -> None:
    cp = _yaml(out / PROV / "alerting/vllm-fleet-contact-points.yml")
    settings = cp["contactPoints"][0]["receivers"][0]["settings"]
    assert settings["url"] == "$__file{/etc/vllm-fleet/secrets/slack_webhook_url}"
    pol = _yaml(out / PROV / "alerting/vllm-fleet-policies.yml")
    names = {c["name"] for c in cp["contactPoints"]}
    assert pol["policies"][0]["receiver"] in names
    assert all(r["receiver"] in names for r in pol["policies"][0]["routes"])
    for f in (out / PROV).rglob("*.yml"):
        assert "hooks.slack" not in f.read_text()


def _dash(out: Path, uid: str) -> dict[str, Any]:
    d = json.loads((out / DASH / f"{uid}.json").read_text())
    assert isinstance(d, dict)
    return d


def test_dashboards_shape_and_datasource(out: Path) -> None:
    ds = _yaml(out / PROV / "datasources/vllm-fleet.yml")["datasources"][0]["uid"]
    for uid in (OVERVIEW_UID, INSTANCE_UID):
        d = _dash(out, uid)
        assert d["uid"] == uid and d["title"]
        ids = [p["id"] for p in d["panels"]]
        assert len(ids) == len(set(ids)) and len(ids) >= 9
        for p in d["panels"]:
            if p["type"] == "row":  # a row header (the overview's "Keys"): no query of its own
                assert p["title"] and p["gridPos"]["w"] == 24
                continue
            assert p["datasource"] == {"type": "prometheus", "uid": ds}
            assert p["targets"] and all(t["expr"] for t in p["targets"])
            assert p["gridPos"]["w"] > 0
        names = [t["name"] for t in d["templating"]["list"]]
        assert names == (["model"] if uid == OVERVIEW_UID else ["instance", "host"])


def _steps(d: dict[str, Any], title: str) -> list[float]:
    panel = next(p for p in d["panels"] if p["title"].startswith(title))
    return [
        s["value"] for s in panel["fieldConfig"]["defaults"]["thresholds"]["steps"] if s["value"] is not None
    ]


def test_thresholds_drawn_at_the_alert_thresholds(out: Path) -> None:
    ov = _dash(out, OVERVIEW_UID)
    assert _steps(ov, "KV cache usage") == [0.913, 0.971]
    assert _steps(ov, "Queue wait p99") == [1.5]
    assert _steps(ov, "Time to first token") == [5.0]
    assert _steps(ov, "Preemptions/s") == [0.37]
    assert _steps(ov, "Errors") == [0.021]
    inst = _dash(out, INSTANCE_UID)
    assert _steps(inst, "Decode rate") == [42]
    assert _steps(inst, "KV cache usage") == [0.913, 0.971]


def test_panel_queries_use_only_real_metric_names() -> None:
    exporter = re.compile(r"^vllm_fleet_[a-z_]+$")
    for where, expr, _gpu in panel_queries(parse_spec(spec_data()).alerts.model_dump()):
        for name in re.findall(r"(?<![\w:$])([a-zA-Z_][\w:]*)\s*\{", expr):
            assert name in VLLM_METRICS or exporter.match(name) or name == "up", (where, name)
        assert "gpu_cache_usage" not in expr and "time_per_output_token_seconds" not in expr


def _cells(d: dict[str, Any]) -> set[tuple[int, int]]:
    """Every grid cell a panel covers: panels must not overlap."""
    cells: list[tuple[int, int]] = []
    for p in d["panels"]:
        g = p["gridPos"]
        cells += [(g["x"] + i, g["y"] + j) for i in range(g["w"]) for j in range(g["h"])]
    assert len(cells) == len(set(cells)), "overlapping panels"
    return set(cells)


def test_keys_row_only_where_the_gateway_runs_the_admission_service(out: Path, tmp_path: Path) -> None:
    """The test spec's gateway has keys and limits (the defaults): the overview ends with the "Keys" row, its
    panels below it, each query one of panel_queries; without the admission service, no row."""
    ov = _dash(out, OVERVIEW_UID)
    _cells(ov)
    titles = [p["title"] for p in ov["panels"]]
    at = titles.index(KEYS_ROW)
    row = ov["panels"][at]
    assert row["type"] == "row" and all(
        p["gridPos"]["y"] > row["gridPos"]["y"] for p in ov["panels"][at + 1 :]
    )
    keyed = ov["panels"][at + 1 :]
    assert [p["title"] for p in keyed] == [p.title for p in key_panels({})] and len(keyed) == 6
    exprs = {t["expr"] for p in keyed for t in p["targets"]}
    assert all("vllm_fleet_gateway_key_" in e for e in exprs)
    for family in (
        "admitted_total",
        "queued",
        "refused_total",
        'kind="settled"',
        "wait_seconds_bucket",
        "used_ratio",
    ):
        assert any(family in e for e in exprs), family
    assert "topk(10," in " ".join(exprs) and "histogram_quantile(0.9," in " ".join(exprs)
    listed = {e for _w, e, _g in panel_queries(parse_spec(spec_data()).alerts.model_dump())}
    assert exprs <= listed and not exprs & {
        e for _w, e, _g in panel_queries(parse_spec(spec_data()).alerts.model_dump(), admission=False)
    }
    assert _steps(ov, "Top 10 keys: budget used") == [1.0]
    data = spec_data()
    data["gateway"]["limits"] = {"enabled": False}
    render_monitoring(parse_spec(data), tmp_path, folders=("dashboards",))
    off = _dash(tmp_path / "h1", OVERVIEW_UID)
    assert KEYS_ROW not in [p["title"] for p in off["panels"]]
    assert not any(
        "vllm_fleet_gateway_key_" in t["expr"] for p in off["panels"] for t in p.get("targets", [])
    )
    assert len(off["panels"]) == at


def test_generator_entries_are_importable() -> None:
    from vllm_fleet.fleet.render import _generator

    entries = yaml.safe_load((REPO / "dashboards" / "artifacts.yml").read_text())
    gens = [e["generator"] for e in entries if "generator" in e]
    assert len(gens) == 3
    for g in gens:
        assert callable(_generator(g))


def test_queries_not_provable_here_are_listed_in_the_docs() -> None:
    """The live test skips GPU-only and systemd-only queries; docs/observability.md must name them."""
    doc = (REPO / "docs" / "observability.md").read_text()
    assert "GPU-only" in doc and "systemd-only" in doc
    for _where, expr, gpu_only in panel_queries(parse_spec(spec_data()).alerts.model_dump()):
        for name in re.findall(r"vllm_fleet_gpu_[a-z_]+", expr):
            assert gpu_only and name.removeprefix("vllm_fleet_gpu").removesuffix("_total") in doc, name
    assert "vllm_fleet_instance_restarts_total" in doc


def test_canary_and_stable_compared_per_model_and_the_canary_share(out: Path) -> None:
    """The overview compares the canary and the stable instances of each model (TTFT and end-to-end p95 by the
    engines' track label) and shows each gateway's canary share; the failover panel leaves the canary out."""
    from vllm_fleet.fleet.observability.dashboards import CANARY_PANEL, CANARY_SHARE_PANEL

    panels = {p["title"]: p for p in _dash(out, OVERVIEW_UID)["panels"]}
    exprs = [t["expr"] for t in panels[CANARY_PANEL]["targets"]]
    for metric in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds"):
        assert (
            f'histogram_quantile(0.95, sum by (model, track, le) (rate({metric}_bucket{{model=~"$model"}}'
            "[$__rate_interval])))" in exprs
        ), metric
    assert {t["legendFormat"] for t in panels[CANARY_PANEL]["targets"]} >= {"{{model}} {{track}} TTFT p95"}
    share = panels[CANARY_SHARE_PANEL]
    assert [t["expr"] for t in share["targets"]] == [
        'max by (model, host) (vllm_fleet_gateway_canary_share{model=~"$model"})'
    ]
    assert share["fieldConfig"]["defaults"]["unit"] == "percentunit"
    failover = next(p for t, p in panels.items() if t.startswith("Failover"))
    assert 'role!~"primary|canary"' in failover["targets"][0]["expr"]


def test_only_the_rollout_families_may_lack_series_outside_a_rollout() -> None:
    """The deployed-fleet check lets a family be absent only by an ABSENT_BY_DESIGN kind: "rollout" covers the
    gateways' two canary families (ROLLOUT_METRICS) and nothing else an alert or a panel reads."""
    from vllm_fleet.devtools.promql import absent_by_design, metric_name, selectors
    from vllm_fleet.fleet.observability import ROLLOUT_METRICS
    from vllm_fleet.fleet.observability.alerts import ALERTS

    read = {
        metric_name(s)
        for expr in [e for _w, e, _g in panel_queries(parse_spec(spec_data()).alerts.model_dump())]
        + [a.expression for a in ALERTS]
        for s in selectors(expr)
    }
    assert {n for n in read if absent_by_design(n, ["rollout"])} == {"vllm_fleet_gateway_canary_share"}
    for other in ("vllm_fleet_gateway_track_requests_total", "vllm_fleet_gateway_canary_share_x",
                  "vllm:time_to_first_token_seconds", "vllm_fleet_gateway_drained"):  # fmt: skip
        assert not absent_by_design(other, ["rollout"]), other
    assert all(absent_by_design(n, ["rollout"]) for n in ROLLOUT_METRICS)


def test_only_the_adapter_family_may_lack_series_without_lora_adapters() -> None:
    """ "lora" covers the carried adapters' loaded gauge (LORA_METRICS, VllmFleetAdapterNotLoaded's) and nothing else
    an alert or a panel reads: a fleet without adapters exports none."""
    from vllm_fleet.devtools.promql import absent_by_design, metric_name, selectors
    from vllm_fleet.fleet.observability import LORA_METRICS
    from vllm_fleet.fleet.observability.alerts import ALERTS

    read = {
        metric_name(s)
        for expr in [e for _w, e, _g in panel_queries(parse_spec(spec_data()).alerts.model_dump())]
        + [a.expression for a in ALERTS]
        for s in selectors(expr)
    }
    assert {n for n in read if absent_by_design(n, ["lora"])} == set(LORA_METRICS)
    for other in (
        "vllm_fleet_instance_adapter_loaded_x",
        "vllm_fleet_instance_state",
        "vllm:lora_requests_info",
    ):
        assert not absent_by_design(other, ["lora"]), other


def test_the_overview_marks_canary_rollouts(out: Path) -> None:
    """A region on every overview panel while a gateway sends a canary its share; its query is checked with the
    panels' (panel_queries)."""
    from vllm_fleet.fleet.observability.dashboards import CANARY_ANNOTATION_EXPR

    [path] = out.glob("var/lib/grafana/dashboards/*/vllm-fleet-overview.json")
    ann = json.loads(path.read_text())["annotations"]["list"]
    [canary] = [a for a in ann if a.get("name") == "Canary rollouts"]
    assert canary["expr"] == CANARY_ANNOTATION_EXPR and "vllm_fleet_gateway_canary_share" in canary["expr"]
    assert canary["datasource"]["type"] == "prometheus" and canary["enable"] is True
    exprs = [e for _, e, _ in panel_queries(parse_spec(spec_data()).alerts.model_dump())]
    assert CANARY_ANNOTATION_EXPR in exprs


# ------------------------------------------------------------------------------- sleep mode (docs/sleep.md)


def _overview(tmp_path: Path, sleeping: list[int]) -> dict[str, Any]:
    """The test fleet's overview as rendered, the models at the indexes ``sleeping`` given ``sleep`` (level 1)."""
    data = spec_data()
    for k in sleeping:
        data["models"][k]["sleep"] = {"level": 1}
    out = tmp_path / "-".join(map(str, sleeping))
    render_monitoring(parse_spec(data), out, folders=("dashboards",))
    return _dash(out / "h1", OVERVIEW_UID)


def test_sleep_row_only_where_a_model_sleeps(tmp_path: Path) -> None:
    """A fleet with a sleeping instance gets the overview's "Sleep" row before "Keys": the state timeline per
    instance, wakes per hour, the mean wake duration (its line at alerts.wake_slow_seconds), failed wakes, time
    asleep; each query one of panel_queries. A fleet without one gets no row."""
    from vllm_fleet.fleet.observability.dashboards import SLEEP_ROW, SLEEP_STATE_PANEL, sleep_panels

    off = _overview(tmp_path, [])
    assert SLEEP_ROW not in [p["title"] for p in off["panels"]]
    assert not any(
        "sleep" in t["expr"] or "wake" in t["expr"] for p in off["panels"] for t in p.get("targets", [])
    )
    on = _overview(tmp_path, [0])
    _cells(on)
    titles = [p["title"] for p in on["panels"]]
    at, keys = titles.index(SLEEP_ROW), titles.index(KEYS_ROW)
    assert on["panels"][at]["type"] == "row" and at < keys
    assert titles[at + 1 : keys] == [p.title for p in sleep_panels(spec_data()["alerts"])]
    assert len(on["panels"]) == len(off["panels"]) + 1 + 5
    timeline = on["panels"][at + 1]
    assert timeline["title"] == SLEEP_STATE_PANEL and timeline["type"] == "state-timeline"
    [mapping] = timeline["fieldConfig"]["defaults"]["mappings"]
    assert {k: v["text"] for k, v in mapping["options"].items()} == {
        "0": "awake", "1": "sleeping", "2": "asleep", "3": "waking"
    }  # fmt: skip
    assert _steps(on, "Mean wake duration") == [30.0]  # alerts/tests/spec.yml's wake_slow_seconds
    exprs = {t["expr"] for p in on["panels"][at + 1 : keys] for t in p["targets"]}
    alerts = parse_spec(spec_data()).alerts.model_dump()
    assert exprs <= {e for _w, e, _g in panel_queries(alerts)}
    assert not exprs & {e for _w, e, _g in panel_queries(alerts, sleep=False)}
    for family in (
        "sleep_state",
        "wakes_total",
        "wake_duration_seconds_sum",
        "failed_wakes_total",
        "asleep_seconds",
    ):
        assert any(family in e for e in exprs), family


def test_only_the_sleep_families_may_lack_series_without_a_sleeping_model() -> None:
    """ "sleep" covers the sleep-mode families an alert or a panel reads (SLEEP_METRICS, the wake summary's _sum and
    _count) and nothing else: a fleet without a sleeping model (the CI fleet: vLLM-CPU cannot sleep) has none."""
    from vllm_fleet.devtools.promql import absent_by_design, metric_name, selectors
    from vllm_fleet.fleet.observability import SLEEP_METRICS
    from vllm_fleet.fleet.observability.alerts import ALERTS

    read = {
        metric_name(s)
        for expr in [e for _w, e, _g in panel_queries(parse_spec(spec_data()).alerts.model_dump())]
        + [a.expression for a in ALERTS]
        for s in selectors(expr)
    }
    absent = {n for n in read if absent_by_design(n, ["sleep"])}
    assert absent == {
        "vllm_fleet_instance_sleep_state", "vllm_fleet_instance_wakes_total", "vllm_fleet_instance_failed_wakes_total",
        "vllm_fleet_instance_wake_duration_seconds_sum", "vllm_fleet_instance_wake_duration_seconds_count",
        "vllm_fleet_instance_asleep_seconds_total",
    }  # fmt: skip
    assert all(absent_by_design(n, ["sleep"]) for n in SLEEP_METRICS)
    for other in ("vllm_fleet_instance_state", "vllm_fleet_instance_state_present", "vllm_fleet_probes_total",
                  "vllm_fleet_instance_sleep_state_x", "vllm_fleet_instance_ready_timestamp_seconds"):  # fmt: skip
        assert not absent_by_design(other, ["sleep"]), other


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian prometheus) missing")
def test_sleep_queries_compute_what_their_panels_say(tmp_path: Path) -> None:
    """The Sleep row's queries on synthetic exporter series (promtool's PromQL engine): instance a asleep, then
    waking, then awake, reads 2, 3, 0 on the state timeline; b sleeping reads 1; wakes of 2 s and 4 s in the last
    30m mean 3 s; a asleep 30 of the last 60 minutes is a share of 0.5."""
    from vllm_fleet.devtools.promql import substitute
    from vllm_fleet.fleet.observability.dashboards import sleep_panels

    panels = {p.title: p.exprs[0][0] for p in sleep_panels(spec_data()["alerts"])}

    def q(title_start: str) -> str:
        return substitute(next(e for t, e in panels.items() if t.startswith(title_start)), "", "", "1m")

    def exp(instance: str) -> str:
        return f'job="vllm-fleet-exporter", host="h1", instance="{instance}", model="m"'

    def one_hot(instance: str, states: dict[str, str]) -> list[dict[str, str]]:
        return [
            {
                "series": f'vllm_fleet_instance_sleep_state{{{exp(instance)}, state="{s}"}}',
                "values": states.get(s, "0x90"),
            }
            for s in ("awake", "sleeping", "asleep", "waking")
        ]

    wake = "vllm_fleet_instance_wake_duration_seconds"
    series = [
        *one_hot("a", {"asleep": "1x60 0x30", "waking": "0x60 1 0x29", "awake": "0x61 1x29"}),
        *one_hot("b", {"sleeping": "1x90"}),
        # a: two wakes in the last 30m (at 65m and 80m) of 2 s and 4 s; asleep from 30m to 60m
        {"series": f"{wake}_sum{{{exp('a')}}}", "values": "0x64 2x15 6x10"},
        {"series": f"{wake}_count{{{exp('a')}}}", "values": "0x64 1x15 2x10"},
        {
            "series": f"vllm_fleet_instance_asleep_seconds_total{{{exp('a')}}}",
            "values": "0x30 0+60x30 1800x30",
        },
    ]

    def sample(instance: str, value: float) -> dict[str, Any]:
        return {"labels": f'{{instance="{instance}", model="m"}}', "value": value}

    tests = [
        {"expr": q("Sleep state"), "eval_time": "30m", "exp_samples": [sample("a", 2), sample("b", 1)]},
        {"expr": q("Sleep state"), "eval_time": "61m", "exp_samples": [sample("a", 3), sample("b", 1)]},
        {"expr": q("Sleep state"), "eval_time": "70m", "exp_samples": [sample("a", 0), sample("b", 1)]},
        {"expr": q("Mean wake duration"), "eval_time": "90m", "exp_samples": [sample("a", 3)]},
        {"expr": q("Time asleep"), "eval_time": "90m", "exp_samples": [sample("a", 0.5)]},
    ]
    doc = {"rule_files": [], "evaluation_interval": "1m",
           "tests": [{"interval": "1m", "input_series": series, "promql_expr_test": tests}]}  # fmt: skip
    (tmp_path / "sleep.test.yml").write_text(yaml.safe_dump(doc, sort_keys=False))
    r = subprocess.run(
        ["promtool", "test", "rules", "sleep.test.yml"], cwd=tmp_path, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stdout + r.stderr
