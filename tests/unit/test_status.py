"""fleet.status: rows, verdicts and exit codes from one Prometheus answer; the command against a fake server."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from vllm_fleet.fleet.spec import FleetSpec, parse_spec, spec_hash
from vllm_fleet.fleet.status import EXIT_DEGRADED, EXIT_DOWN, EXIT_SERVING, QUERY, Sample, judge, table

NOW = 1_800_000_000.0


def spec_doc() -> dict[str, Any]:
    m = {"source": {"path": "/models/tiny"}, "kv_cache_memory_bytes": 67108864, "max_model_len": 1024}
    return {
        "name": "st",
        "stack": {"profile": "cpu"},
        "hosts": [
            {"name": "h1", "address": "10.0.0.1", "memory_gib": 16},
            {"name": "h2", "address": "10.0.0.2", "memory_gib": 16},
        ],
        "models": [
            {**m, "name": "a", "served_model_name": "qwen", "host": "h1", "port": 8001},
            {**m, "name": "b", "served_model_name": "qwen", "host": "h2", "port": 8001},
            {**m, "name": "c", "served_model_name": "other", "host": "h2", "port": 8002, "role": "fallback"},
        ],
        "gateway": {"host": "h1"},
        "monitoring": {"host": "h1"},
    }


@pytest.fixture
def spec() -> FleetSpec:
    return parse_spec(spec_doc(), "test")


def healthy(spec: FleetSpec, **hosts_up: int) -> list[Sample]:
    out: list[Sample] = []
    exp = "vllm-fleet-exporter"
    for h in ("h1", "h2"):
        out.append(({"__name__": "up", "job": exp, "host": h, "instance": h}, float(hosts_up.get(h, 1))))
        out.append(
            (
                {"__name__": "vllm_fleet_deployed_info", "job": exp, "host": h, "instance": h,
                 "spec_hash": spec_hash(spec), "profile": "cpu", "pinned_vllm": "0.32.0", "vllm": "0.32.0"},
                1.0,
            )
        )  # fmt: skip
    for name, host, model in (("a", "h1", "qwen"), ("b", "h2", "qwen"), ("c", "h2", "other")):
        if hosts_up.get(host, 1) == 0:
            continue
        lab = {"job": exp, "host": host, "instance": name, "model": model}
        for state in ("loading", "ready", "draining", "failed", "stopped"):
            out.append(
                ({"__name__": "vllm_fleet_instance_state", **lab, "state": state}, float(state == "ready"))
            )
        out += [
            ({"__name__": "vllm_fleet_instance_phase_info", **lab, "phase": "serving", "reason": ""}, 1.0),
            ({"__name__": "vllm_fleet_instance_stack_info", **lab, "stack": f"cpu-0.32.0-{name * 12}"}, 1.0),
            ({"__name__": "vllm_fleet_instance_ready_timestamp_seconds", **lab}, NOW - 3725),
            ({"__name__": "vllm_fleet_instance_restarts_total", **lab, "unit": f"vllm@{name}.service"}, 1.0),
            ({"__name__": "vllm_fleet_probe_success", **lab}, 1.0),
            ({"__name__": "vllm_fleet_probe_latency_seconds", **lab}, 0.042),
        ]
        eng = {"job": "vllm", "host": host, "instance": name, "model": model}
        out += [
            ({"__name__": "up", **eng}, 1.0),
            ({"__name__": "vllm:num_requests_running", **eng, "engine": "0"}, 3.0),
            ({"__name__": "vllm:num_requests_waiting", **eng, "engine": "0"}, 1.0),
            ({"__name__": "vllm:kv_cache_usage_perc", **eng, "engine": "0"}, 0.25),
        ]
    return out


def set_value(samples: list[Sample], name: str, value: float, **labels: str) -> list[Sample]:
    return [
        (lv, value if lv["__name__"] == name and all(lv.get(k) == v for k, v in labels.items()) else v)
        for lv, v in samples
    ]


def test_a_healthy_fleet_is_serving(spec: FleetSpec) -> None:
    st = judge(spec, healthy(spec), "http://p", now=NOW)
    assert [r.verdict for r in st.rows] == ["serving"] * 3 and st.exit_code == EXIT_SERVING
    a = st.rows[0]
    assert (a.host, a.instance, a.model, a.state, a.restarts, a.running, a.waiting, a.kv_cache, a.rotation) == (
        "h1", "a", "qwen", "ready", 1, 3, 1, 0.25, "in",
    )  # fmt: skip
    text = table(st)
    assert text.splitlines()[0].split() == [
        "HOST", "INSTANCE", "MODEL", "GPUS", "STATE", "SINCE", "RESTARTS", "PROBE", "RUN/WAIT", "KV", "GATEWAY",
        "STACK",
    ]  # fmt: skip
    # each instance's engine stack, as its exporter reports it (an upgrade in progress shows two)
    assert [r.stack for r in st.rows] == [
        "cpu-0.32.0-aaaaaaaaaaaa",
        "cpu-0.32.0-bbbbbbbbbbbb",
        "cpu-0.32.0-cccccccccccc",
    ]
    assert text.splitlines()[1].split()[-1] == "cpu-0.32.0-aaaaaaaaaaaa"
    assert "1h2m" in text and "ok 42ms" in text and "25%" in text and "c [fallback]" in text
    assert text.splitlines()[-1].startswith("3/3 instances serving")
    assert "\x1b[" not in text and "\x1b[32m" in table(st, colour=True)


def test_drained_is_degraded_and_a_model_without_a_serving_instance_is_down(spec: FleetSpec) -> None:
    drained = [
        *healthy(spec),
        ({"__name__": "vllm_fleet_gateway_drained", "host": "h1", "instance": "b"}, 1.0),
    ]
    st = judge(spec, drained, now=NOW)
    b = st.rows[1]
    assert (b.verdict, b.rotation, b.phase) == ("degraded", "drained", "drained at the gateway")
    assert st.exit_code == EXIT_DEGRADED and st.models_down == []  # a still serves qwen
    failed = set_value(healthy(spec), "vllm_fleet_instance_state", 0.0, instance="c")
    failed = set_value(failed, "vllm_fleet_instance_state", 1.0, instance="c", state="failed")
    st = judge(spec, failed, now=NOW)
    assert st.rows[2].verdict == "down" and st.rows[2].state == "failed"
    assert st.models_down == ["other"] and st.exit_code == EXIT_DOWN


def test_loaded_adapters_are_listed_and_a_carried_one_not_loaded_degrades_its_instance(
    spec: FleetSpec,
) -> None:
    """adapters[]: the exporter's vllm_fleet_instance_adapter_loaded per carried adapter (1 loaded, 0 not)."""
    assert "vllm_fleet_instance_adapter_loaded" in QUERY

    def loaded(instance: str, adapter: str, v: float) -> Sample:
        return (
            {"__name__": "vllm_fleet_instance_adapter_loaded", "job": "vllm-fleet-exporter", "instance": instance,
             "model": "qwen", "adapter": adapter},
            v,
        )  # fmt: skip

    samples = [*healthy(spec), loaded("a", "sql", 1), loaded("a", "chat", 1), loaded("b", "sql", 1)]
    st = judge(spec, samples, now=NOW)
    assert [r.verdict for r in st.rows] == ["serving"] * 3
    assert (st.rows[0].adapters, st.rows[1].adapters, st.rows[2].adapters) == (["chat", "sql"], ["sql"], [])
    text = table(st)
    assert "Adapters a: chat, sql loaded" in text and "Adapters b: sql loaded" in text
    assert "Adapters c" not in text
    st = judge(spec, [*samples[:-1], loaded("b", "sql", 0)], now=NOW)
    b = st.rows[1]
    assert (b.verdict, b.phase, b.adapters_missing) == ("degraded", "adapter sql not loaded", ["sql"])
    assert st.exit_code == EXIT_DEGRADED and st.models_down == []
    assert "Adapters b: none loaded; NOT LOADED: sql" in table(st)


def sleep_series(instance: str, host: str, state: str, **values: float) -> list[Sample]:
    """An instance's sleep series as its host exporter exports them (its model sleeps): the one-hot state and the
    ``values`` given (metric name after ``vllm_fleet_instance_``)."""
    lab = {"job": "vllm-fleet-exporter", "host": host, "instance": instance, "model": "qwen"}
    out: list[Sample] = [
        ({"__name__": "vllm_fleet_instance_sleep_state", **lab, "state": s}, float(s == state))
        for s in ("awake", "sleeping", "asleep", "waking")
    ]
    return out + [({"__name__": f"vllm_fleet_instance_{k}", **lab}, v) for k, v in values.items()]


def test_an_instance_that_sleeps_shows_its_sleep_state_and_wakes(spec: FleetSpec) -> None:
    """models[].sleep: a asleep at level 1 for 12m5s after 14 wakes (2 failed), b waking; both serving (the
    gateway wakes them on a request). c does not sleep: no sleep state, no Sleep line, ``sleep`` null in JSON."""
    for name in ("vllm_fleet_instance_sleep_state", "vllm_fleet_instance_wakes_total",
                 "vllm_fleet_instance_asleep_since_timestamp_seconds", "vllm_fleet_instance_last_wake_seconds"):  # fmt: skip
        assert name in QUERY
    samples = [
        # the launcher's phase while its engine sleeps: the sleep state says it
        (lv, v) if lv.get("__name__") != "vllm_fleet_instance_phase_info" or lv["instance"] != "a"
        else ({**lv, "phase": "Asleep (level 1)"}, v)
        for lv, v in healthy(spec)
    ]  # fmt: skip
    samples += sleep_series(
        "a", "h1", "asleep", sleep_level=1, asleep_since_timestamp_seconds=NOW - 725, wakes_total=14,
        failed_wakes_total=2, last_wake_seconds=0.61,
    )  # fmt: skip
    samples += sleep_series("b", "h2", "waking", sleep_level=2, wakes_total=3, failed_wakes_total=0)
    st = judge(spec, samples, now=NOW)
    a, b, c = st.rows
    assert [r.verdict for r in st.rows] == ["serving"] * 3 and st.exit_code == EXIT_SERVING
    assert a.sleep is not None and b.sleep is not None and c.sleep is None
    assert (a.sleep.state, a.sleep.level, a.sleep.wakes, a.sleep.failed_wakes) == ("asleep", 1, 14, 2)
    assert (b.sleep.state, b.sleep.level, b.sleep.asleep_since, b.sleep.last_wake_seconds) == (
        "waking",
        2,
        None,
        None,
    )
    lines = table(st).splitlines()
    row = {line.split()[1]: line for line in lines[1:4]}
    assert "ready · asleep L1 12m5s" in row["a"] and "Asleep (level 1)" not in row["a"]
    assert "ready · waking" in row["b"] and "·" not in row["c"]
    assert "Sleep a: asleep for 12m5s (level 1); wakes 14, failed 2, last wake 0.61s" in lines
    assert "Sleep b: waking (level 2); wakes 3, failed 0" in lines
    assert not [line for line in lines if line.startswith("Sleep c")]
    doc = json.loads(json.dumps(st.to_dict()))
    assert doc["rows"][0]["sleep"] == {
        "state": "asleep", "level": 1, "asleep_since": NOW - 725, "wakes": 14, "failed_wakes": 2,
        "last_wake_seconds": 0.61,
    }  # fmt: skip
    assert doc["rows"][2]["sleep"] is None
    # awake after a wake: the table says so; a probe failing while it sleeps still degrades it, and says why
    samples = [x for x in samples if not (x[0]["__name__"].startswith("vllm_fleet_instance_") and x[0]["instance"] == "a"
                                          and "sleep" in x[0]["__name__"])]  # fmt: skip
    samples += sleep_series("a", "h1", "awake", sleep_level=1, wakes_total=15, failed_wakes_total=2)
    st = judge(spec, set_value(samples, "vllm_fleet_probe_success", 0.0, instance="b"), now=NOW)
    lines = table(st).splitlines()
    assert "ready (Asleep (level 1)) · awake" not in lines[1] and "ready · awake" in lines[1]
    assert (st.rows[1].verdict, st.rows[1].phase) == ("degraded", "probe failing")
    assert "ready (probe failing) · waking" in lines[2]


def test_a_failing_probe_and_loading_are_degraded(spec: FleetSpec) -> None:
    s = set_value(healthy(spec), "vllm_fleet_probe_success", 0.0, instance="a")
    s = set_value(s, "vllm_fleet_instance_state", 0.0, instance="b")
    s = set_value(s, "vllm_fleet_instance_state", 1.0, instance="b", state="loading")
    st = judge(spec, s, now=NOW)
    assert (st.rows[0].verdict, st.rows[0].phase) == ("degraded", "probe failing")
    assert (st.rows[1].verdict, st.rows[1].state) == ("degraded", "loading")
    assert st.models_down == ["qwen"] and st.exit_code == EXIT_DOWN  # neither instance of qwen serves


def test_a_powered_off_host_is_named_and_its_instances_are_down(spec: FleetSpec) -> None:
    st = judge(spec, healthy(spec, h2=0), "http://p", now=NOW)
    assert [(r.instance, r.verdict, r.state) for r in st.rows] == [
        ("a", "serving", "ready"), ("b", "down", "unreachable"), ("c", "down", "unreachable"),
    ]  # fmt: skip
    assert [h.reachable for h in st.hosts] == [True, False]
    assert "host h2: unreachable" in table(st) and st.exit_code == EXIT_DOWN
    # a host Prometheus has no series for at all reads the same
    st = judge(spec, [x for x in healthy(spec) if x[0].get("host") != "h2"], now=NOW)
    assert st.hosts[1].reachable is False and st.rows[1].state == "unreachable"


def test_spec_drift_is_shown(spec: FleetSpec) -> None:
    other = set_value(healthy(spec), "vllm_fleet_deployed_info", 1.0)
    other = [
        ({**lv, "spec_hash": "0123456789ab"} if lv["__name__"] == "vllm_fleet_deployed_info" and lv["host"] == "h2"
         else lv, v)
        for lv, v in other
    ]  # fmt: skip
    st = judge(spec, other, now=NOW)
    assert [h.drift for h in st.hosts] == [False, True]
    assert f"host h2: deployed spec 0123456789ab, this spec is {spec_hash(spec)} (drift)" in table(st)


# ------------------------------------------------------------------------- canary rollouts (rollouts[])


@pytest.fixture
def canary_spec() -> FleetSpec:
    """The test fleet with a rollout of qwen: its canary ``a-canary`` (a copy of a, role canary) on h2."""
    doc = spec_doc()
    doc["rollouts"] = [{"model": "qwen", "canary": {"name": "a-canary", "host": "h2", "port": 8011}}]
    return parse_spec(doc, "test")


def canary(state: str, engine_up: float, *gateways: tuple[str, float, float]) -> list[Sample]:
    """The canary's series: its launcher's state ("": no state file, every state 0), its engine target (always
    scraped: job vllm, role and track canary) and each gateway's entry (host, share, lease expiry)."""
    exp = {"job": "vllm-fleet-exporter", "host": "h2", "instance": "a-canary", "model": "qwen"}
    out: list[Sample] = [
        ({"__name__": "vllm_fleet_instance_state", **exp, "state": s}, float(s == state))
        for s in ("loading", "ready", "draining", "failed", "stopped")
    ]
    eng = {
        "job": "vllm",
        "host": "h2",
        "instance": "a-canary",
        "model": "qwen",
        "role": "canary",
        "track": "canary",
    }
    out.append(({"__name__": "up", **eng}, engine_up))
    if state == "ready":
        out += [
            ({"__name__": "vllm_fleet_probe_success", **exp}, 1.0),
            ({"__name__": "vllm:num_requests_running", **eng, "engine": "0"}, 2.0),
        ]
    for host, share, expiry in gateways:
        gw = {"job": "vllm-fleet-exporter", "host": host, "instance": "a-canary", "model": "qwen"}
        out += [
            ({"__name__": "vllm_fleet_gateway_canary_share", **gw}, share),
            ({"__name__": "vllm_fleet_gateway_canary_lease_expiry_timestamp_seconds", **gw}, expiry),
        ]
    return out


def test_the_status_query_asks_for_the_gateways_canary_entries() -> None:
    assert "vllm_fleet_gateway_canary_share" in QUERY
    assert "vllm_fleet_gateway_canary_lease_expiry_timestamp_seconds" in QUERY


@pytest.mark.parametrize("state", ["stopped", "", "failed"])
def test_a_stopped_canary_is_idle_and_not_counted(canary_spec: FleetSpec, state: str) -> None:
    """Stopped after a rollout, never started (no state file), or left failed with no gateway entry: idle, its
    role shown, the fleet still all serving (exit 0)."""
    st = judge(canary_spec, [*healthy(canary_spec), *canary(state, 0.0)], now=NOW)
    row = st.rows[-1]
    assert (row.instance, row.role, row.verdict) == ("a-canary", "canary", "idle")
    assert row.state == (state or "unknown") and row.rotation == "out"
    assert st.exit_code == EXIT_SERVING and st.models_down == [] and st.rollouts == []
    text = table(st)
    line = next(x for x in text.splitlines() if "a-canary" in x)
    assert "a-canary [canary]" in line and " out " in line
    assert "Rollout" not in text
    assert text.splitlines()[-1].startswith("3/3 instances serving, 1 canary idle")
    assert "\x1b[2m" in table(st, colour=True)  # dimmed, not red


def test_a_running_canary_is_judged_but_never_decides_its_model(canary_spec: FleetSpec) -> None:
    # serving its share on the gateway h1 (lease 42 s left): a serving row, in rotation as the canary
    st = judge(canary_spec, [*healthy(canary_spec), *canary("ready", 1.0, ("h1", 0.25, NOW + 42))], now=NOW)
    row = st.rows[-1]
    assert (row.verdict, row.rotation, row.running) == ("serving", "canary 25%", 2)
    assert st.exit_code == EXIT_SERVING
    assert "Rollout qwen: canary a-canary (serving); h1: share 25%, lease 42s left" in table(st)
    # its engine stops answering: a down row (exit 1), while qwen keeps its verdict from a and b
    st = judge(canary_spec, [*healthy(canary_spec), *canary("ready", 0.0, ("h1", 0.25, NOW + 42))], now=NOW)
    assert st.rows[-1].verdict == "degraded" and st.exit_code == EXIT_DEGRADED and st.models_down == []
    st = judge(canary_spec, [*healthy(canary_spec), *canary("failed", 0.0, ("h1", 0.25, NOW + 42))], now=NOW)
    assert st.rows[-1].verdict == "down" and st.exit_code == EXIT_DEGRADED and st.models_down == []
    # a and b down: qwen is down although its canary serves
    s = [*healthy(canary_spec), *canary("ready", 1.0, ("h1", 0.25, NOW + 42))]
    for name in ("a", "b"):
        s = set_value(s, "vllm_fleet_instance_state", 0.0, instance=name)
        s = set_value(s, "vllm_fleet_instance_state", 1.0, instance=name, state="failed")
    st = judge(canary_spec, s, now=NOW)
    assert st.rows[-1].verdict == "serving" and st.models_down == ["qwen"] and st.exit_code == EXIT_DOWN


def test_the_rollout_line_names_each_gateway_and_an_expired_lease(canary_spec: FleetSpec) -> None:
    s = [*healthy(canary_spec), *canary("ready", 1.0, ("h1", 0.1, NOW + 30.4), ("h2", 0.1, NOW - 5))]
    st = judge(canary_spec, s, now=NOW)
    (r,) = st.rollouts
    assert (r.model, r.canary, [g.host for g in r.gateways]) == ("qwen", "a-canary", ["h1", "h2"])
    line = next(x for x in table(st).splitlines() if x.startswith("Rollout "))
    assert line == (
        "Rollout qwen: canary a-canary (serving); h1: share 10%, lease 30s left; "
        "h2: lease expired: out of rotation"
    )
    # every lease expired (the controller died): out of rotation; stopped on its host then, idle
    s = [*healthy(canary_spec), *canary("failed", 0.0, ("h1", 0.1, NOW - 1))]
    st = judge(canary_spec, s, now=NOW)
    assert (st.rows[-1].verdict, st.rows[-1].rotation) == ("idle", "out") and st.exit_code == EXIT_SERVING
    assert "Rollout qwen: canary a-canary (idle); h1: lease expired: out of rotation" in table(st)
    assert st.to_dict()["rollouts"][0]["gateways"][0]["lease_left"] == -1.0


# ------------------------------------------------------------------------- gateway keys (admission service)

ADM = {"job": "vllm-fleet-admission", "host": "h1", "instance": "h1"}


def keyed(spec: FleetSpec, up: float = 1.0) -> list[Sample]:
    """A healthy fleet whose gateway's admission service reports seven keys: what Prometheus answers to
    QUERY (the gauges as scraped, the counters' increases under status' own names, by client and key)."""
    out = [*healthy(spec), ({"__name__": "up", **ADM}, up)]
    keys = [  # key, client, in flight, queued, admitted 5m, refused 5m, {budget: used}
        ("chat/1a2b3c4d", "chat", 8, 3, 412.0, 37.0, {"in_flight": 1.0, "rpm": 0.5}),
        ("chat/5e6f7a8b", "chat", 1, 0, 90.0, 0.0, {"in_flight": 0.125}),
        ("batch/0c0d0e0f", "batch", 2, 0, 120.0, 4.0, {"tpm": 1.0, "rpm": 1.0}),
        ("web/00000001", "web", 0, 0, 5.0, 0.0, {}),
        ("web/00000002", "web", 0, 0, 5.0, 0.0, {}),
        ("web/00000003", "web", 0, 1, 1.0, 0.0, {"rpm": 1.0}),  # sixth: at its budget, outside the top 5
        ("idle/ffffffff", "idle", 0, 0, 0.0, 0.0, {"in_flight": 0.0}),  # nothing in the window
    ]
    for key, client, inflight, queued, admitted, refused, used in keys:
        lab = {**ADM, "client": client, "key": key}
        out += [
            ({"__name__": "vllm_fleet_gateway_key_in_flight", **lab}, float(inflight)),
            ({"__name__": "vllm_fleet_gateway_key_queued", **lab}, float(queued)),
            (
                {
                    "__name__": (n := "vllm_fleet_status_key_admitted"),
                    "vf_status": n,
                    "client": client,
                    "key": key,
                },
                admitted,
            ),
            (
                {
                    "__name__": (n := "vllm_fleet_status_key_refused"),
                    "vf_status": n,
                    "client": client,
                    "key": key,
                },
                refused,
            ),
        ]
        out += [
            ({"__name__": "vllm_fleet_gateway_key_budget_used_ratio", **lab, "budget": b}, v)
            for b, v in used.items()
        ]
    return out


def test_the_busiest_keys_under_the_table(spec: FleetSpec) -> None:
    assert spec.gateway.admission  # auth api_keys and limits on: the defaults
    st = judge(spec, keyed(spec), "http://p", now=NOW)
    assert st.admission and st.admission_up is True and st.exit_code == EXIT_SERVING
    assert [
        (k.key, k.client, k.in_flight, k.queued, k.admitted, k.refused, k.at_budget) for k in st.keys
    ] == [
        ("chat/1a2b3c4d", "chat", 8, 3, 412.0, 37.0, ["in_flight"]),
        ("batch/0c0d0e0f", "batch", 2, 0, 120.0, 4.0, ["rpm", "tpm"]),
        ("chat/5e6f7a8b", "chat", 1, 0, 90.0, 0.0, []),
        ("web/00000001", "web", 0, 0, 5.0, 0.0, []),
        ("web/00000002", "web", 0, 0, 5.0, 0.0, []),
    ]
    assert [(k.key, k.at_budget) for k in st.keys_at_budget] == [("web/00000003", ["rpm"])]
    lines = table(st).splitlines()
    at = lines.index("Top keys (gateway admission, last 5m):")
    assert at > 3 and lines[at + 1].split() == [
        "KEY", "CLIENT", "IN-FLIGHT", "QUEUED", "ADMITTED(5m)", "REFUSED(5m)", "AT", "BUDGET",
    ]  # fmt: skip
    assert lines[at + 2].split() == ["chat/1a2b3c4d", "chat", "8", "3", "412", "37", "in_flight"]
    assert lines[at + 3].split() == ["batch/0c0d0e0f", "batch", "2", "0", "120", "4", "rpm,tpm"]
    assert lines[at + 4].split()[-1] == "-"
    assert lines[at + 7] == "key web/00000003 (client web): at its rpm budget"
    assert lines[-1].startswith("3/3 instances serving")  # the summary stays last
    doc = json.loads(json.dumps(st.to_dict()))
    assert doc["admission"] is True and doc["admission_up"] is True
    assert doc["keys"][0] == {
        "key": "chat/1a2b3c4d", "client": "chat", "in_flight": 8, "queued": 3, "admitted": 412.0,
        "refused": 37.0, "at_budget": ["in_flight"],
    }  # fmt: skip
    assert [k["key"] for k in doc["keys_at_budget"]] == ["web/00000003"]


def test_keys_when_the_admission_service_is_down_idle_or_absent(spec: FleetSpec) -> None:
    st = judge(spec, keyed(spec, up=0.0), now=NOW)
    assert st.admission_up is False and st.exit_code == EXIT_SERVING  # the instances still serve
    assert "gateway admission service: not scraped" in table(st) and "Top keys (" not in table(st)
    st = judge(spec, [*healthy(spec), ({"__name__": "up", **ADM}, 1.0)], now=NOW)
    assert (
        st.keys == []
        and "Top keys: no key admitted, refused, in flight or queued in the last 5m" in table(st)
    )
    # limits off (or an open gateway): no admission service, no section, whatever Prometheus holds
    doc = spec_doc()
    doc["gateway"]["limits"] = {"enabled": False}
    off = parse_spec(doc, "t")
    st = judge(off, keyed(off), now=NOW)
    assert (st.admission, st.admission_up, st.keys) == (False, None, [])
    assert "Top keys" not in table(st) and "admission" not in table(st)


class _FakePrometheus(BaseHTTPRequestHandler):
    samples: list[Sample] = []
    queries: list[str] = []
    password = ""  # basic auth of the spec's web_user with this password, when set

    def do_GET(self) -> None:
        import base64
        from urllib.parse import parse_qs, urlparse

        want = "Basic " + base64.b64encode(f"vllm-fleet:{self.password}".encode()).decode()
        if self.password and self.headers.get("Authorization") != want:
            self.send_response(401)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        q = parse_qs(urlparse(self.path).query)["query"][0]
        type(self).queries.append(q)
        result = [{"metric": lv, "value": [NOW, str(v)]} for lv, v in self.samples]
        body = json.dumps({"status": "success", "data": {"resultType": "vector", "result": result}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def fake_prometheus(spec: FleetSpec) -> Iterator[str]:
    _FakePrometheus.samples = healthy(spec)
    _FakePrometheus.queries = []
    _FakePrometheus.password = ""
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _FakePrometheus)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()


def test_the_command_asks_once_and_exits_by_verdict(tmp_path: Path, fake_prometheus: str) -> None:
    path = tmp_path / "spec.yml"
    path.write_text(yaml.safe_dump(spec_doc()))
    cmd = [sys.executable, "-m", "vllm_fleet.cli", "status", str(path), "--prometheus", fake_prometheus]
    out = subprocess.run([*cmd, "--json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == EXIT_SERVING, out.stderr
    doc = json.loads(out.stdout)
    assert doc["exit_code"] == 0 and [r["instance"] for r in doc["rows"]] == ["a", "b", "c"]
    assert _FakePrometheus.queries == [QUERY]  # one round trip
    assert doc["admission"] is True and doc["keys"] == [] and doc["admission_up"] is False
    _FakePrometheus.samples = keyed(parse_spec(spec_doc(), "t"))
    out = subprocess.run([*cmd, "--json"], capture_output=True, text=True, timeout=60)
    doc = json.loads(out.stdout)
    assert [k["key"] for k in doc["keys"]][:2] == ["chat/1a2b3c4d", "batch/0c0d0e0f"], doc
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert "Top keys (gateway admission, last 5m):" in out.stdout and "rpm,tpm" in out.stdout, out
    assert len(_FakePrometheus.queries) == 3  # still one query a run
    _FakePrometheus.samples = healthy(parse_spec(spec_doc(), "t"), h2=0)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == EXIT_DOWN and "host h2: unreachable" in out.stdout, out
    assert "\x1b[" not in out.stdout  # piped: no colours


def test_an_unreachable_prometheus_exits_3_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "spec.yml"
    path.write_text(yaml.safe_dump(spec_doc()))
    out = subprocess.run(
        [sys.executable, "-m", "vllm_fleet.cli", "status", str(path), "--prometheus", "http://127.0.0.1:9"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 3 and "Prometheus at http://127.0.0.1:9" in out.stderr, out


def test_basic_auth_with_the_monitoring_password(tmp_path: Path, fake_prometheus: str) -> None:
    """Prometheus behind basic auth (docs/security.md): without the password exit 3 naming what to give; with
    --prometheus-password-file the spec's web_user and that password are sent."""
    _FakePrometheus.password = "s3cret"
    path = tmp_path / "spec.yml"
    path.write_text(yaml.safe_dump(spec_doc()))
    cmd = [sys.executable, "-m", "vllm_fleet.cli", "status", str(path), "--prometheus", fake_prometheus]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 3 and "HTTP 401" in out.stderr and "--prometheus-password-file" in out.stderr, (
        out
    )
    (tmp_path / "pw").write_text("s3cret\n")
    out = subprocess.run(
        [*cmd, "--prometheus-password-file", str(tmp_path / "pw")], capture_output=True, text=True
    )
    assert out.returncode == 0, out
    out = subprocess.run(
        [*cmd, "--prometheus-password-file", str(tmp_path / "none")], capture_output=True, text=True
    )
    assert out.returncode == 3 and "cannot read the password file" in out.stderr, out


# ------------------------------------------------------------------------- a multi-node instance's workers


def mn_doc() -> dict[str, Any]:
    """spec_doc plus ``mn``: one model over h1 (rank 0) and h2 (rank 1, vllm-worker@mn)."""
    doc = spec_doc()
    doc["models"].append(
        {"name": "mn", "served_model_name": "big", "source": {"path": "/models/tiny"}, "host": "h1",
         "port": 8003, "placement": [{"host": "h1"}, {"host": "h2"}], "tensor_parallel_size": 2,
         "kv_cache_memory_bytes": 67108864, "max_model_len": 1024}
    )  # fmt: skip
    return doc


def group(spec: FleetSpec, worker: str = "joined", worker_host: str = "h2", **hosts_up: int) -> list[Sample]:
    """healthy() plus mn's rank 0 (ready on h1) and its rank-1 worker's series (in state ``worker``)."""
    out = healthy(spec, **hosts_up)
    exp = "vllm-fleet-exporter"
    lab = {"job": exp, "host": "h1", "instance": "mn", "model": "big"}
    for state in ("loading", "ready", "draining", "failed", "stopped"):
        out.append(
            ({"__name__": "vllm_fleet_instance_state", **lab, "state": state}, float(state == "ready"))
        )
    out += [
        ({"__name__": "vllm_fleet_probe_success", **lab}, 1.0),
        ({"__name__": "up", "job": "vllm", "host": "h1", "instance": "mn", "model": "big"}, 1.0),
    ]
    if hosts_up.get(worker_host, 1):
        w = {"job": exp, "host": worker_host, "instance": "mn", "model": "big", "rank": "1"}
        for state in ("waiting", "joined", "rank0_gone", "exited"):
            out.append(({"__name__": "vllm_fleet_worker_state", **w, "state": state}, float(state == worker)))
        out += [
            ({"__name__": "vllm_fleet_worker_state_since_timestamp_seconds", **w}, NOW - 125),
            ({"__name__": "vllm_fleet_worker_restarts_total", **w, "unit": "vllm-worker@mn.service"}, 2.0),
        ]
    return out


def test_a_joined_worker_is_a_serving_row_under_its_instance() -> None:
    spec = parse_spec(mn_doc(), "test")
    st = judge(spec, group(spec), "http://p", now=NOW)
    assert [r.verdict for r in st.rows] == ["serving"] * 4 and st.exit_code == EXIT_SERVING
    [w] = st.workers
    assert (w.host, w.instance, w.model, w.rank, w.state, w.verdict, w.restarts, w.since) == (
        "h2", "mn", "big", 1, "joined", "serving", 2, NOW - 125,
    )  # fmt: skip
    lines = table(st).splitlines()
    i = next(n for n, line in enumerate(lines) if line.split()[1] == "mn")
    assert lines[i + 1].split()[:7] == ["h2", "mn", "[rank", "1]", "big", "-", "joined"]
    assert "2m5s" in lines[i + 1] and lines[i + 1].split()[-6] == "2"  # SINCE, RESTARTS
    assert lines[-1].startswith("4/4 instances serving, 1/1 multi-node workers joined")
    doc = st.to_dict()
    assert doc["workers"][0]["state"] == "joined" and doc["exit_code"] == 0
    # a spec without multi-node instances has no worker rows and the summary it always had
    plain = parse_spec(spec_doc(), "t")
    assert judge(plain, healthy(plain), now=NOW).workers == []


@pytest.mark.parametrize(
    ("worker", "verdict"), [("waiting", "degraded"), ("rank0_gone", "down"), ("exited", "down")]
)
def test_a_worker_not_joined_makes_its_group_not_serving(worker: str, verdict: str) -> None:
    spec = parse_spec(mn_doc(), "test")
    st = judge(spec, group(spec, worker), now=NOW)
    [w] = st.workers
    assert (w.state, w.verdict) == (worker, verdict)
    mn = st.rows[3]
    assert (mn.state, mn.verdict, mn.phase) == ("ready", "degraded", "rank 1 not joined")
    # big has no other instance: no serving one left (exit 2, like any model without a serving instance)
    assert st.models_down == ["big"] and st.exit_code == EXIT_DOWN
    assert "ready (rank 1 not joined)" in table(st) and "0/1 multi-node workers joined" in table(st)


def test_a_worker_nobody_reports_is_unknown_and_its_host_down_unreachable() -> None:
    spec = parse_spec(mn_doc(), "test")
    # the worker's series come from another host than its placement's: not this rank's (a stale state file)
    st = judge(spec, group(spec, worker_host="h1"), now=NOW)
    assert (st.workers[0].state, st.workers[0].verdict) == ("unknown", "down")
    st = judge(spec, group(spec, h2=0), now=NOW)
    assert (st.workers[0].state, st.workers[0].verdict) == ("unreachable", "down")
    assert st.exit_code == EXIT_DOWN  # b's and c's host too; qwen still has a, other has none


def test_a_waiting_worker_alone_degrades_the_exit_code() -> None:
    """A group still forming while the model has another serving instance: exit 1, not 0."""
    doc = mn_doc()
    doc["models"][3]["served_model_name"] = "qwen"
    spec = parse_spec(doc, "test")
    samples = [
        ({**lv, "model": "qwen"} if lv.get("instance") == "mn" else lv, v) for lv, v in group(spec, "waiting")
    ]
    st = judge(spec, samples, now=NOW)
    assert st.models_down == [] and st.exit_code == EXIT_DEGRADED
    assert [r.verdict for r in st.rows] == ["serving", "serving", "serving", "degraded"]


def test_a_prometheus_that_does_not_answer_names_the_firewall_and_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """From a controller the monitoring host's firewall does not admit, the connection is dropped, not refused:
    a bare `URLError: timed out` said nothing; the error names the address tried, the admitted sources and the
    ways out."""
    import argparse
    import socket

    from vllm_fleet.fleet import status

    silent = (
        socket.socket()
    )  # accepts connections (the backlog) and never answers: a dropped reply, in effect
    silent.bind(("127.0.0.1", 0))
    silent.listen(4)
    url = f"http://127.0.0.1:{silent.getsockname()[1]}"
    doc = spec_doc()
    doc["firewall"] = {"admin_sources": ["192.0.2.0/24"]}
    spec = parse_spec(doc, "t")
    try:
        with pytest.raises(status.StatusError) as err:
            status.query(url, QUERY, timeout=0.3, timeout_hint=status.unanswered_hint(spec, url))
        msg = str(err.value)
        assert msg.startswith(f"Prometheus at {url}: no answer within 0.3 s. "), msg
        assert "firewall (h1) admits Prometheus only from h1 itself and firewall.admin_sources" in msg
        assert (
            "(configured: 192.0.2.0/24)" in msg
            and "this machine's address towards 127.0.0.1 is 127.0.0.1" in msg
        )
        assert "add this machine's address (or its network) to firewall.admin_sources" in msg
        assert "run `vllm-fleet status` on h1" in msg and "URLError" not in msg
        # the command: exit 3 with that message (the query's timeout shortened for the test)
        query = status.query
        monkeypatch.setattr(status, "query", lambda *a, **k: query(*a, **{**k, "timeout": 0.3}))
        args = argparse.Namespace(
            prometheus=url, prometheus_user="", prometheus_password_file="", json=False, watch=0
        )
        spec = parse_spec({**doc, "monitoring": {"host": "h1", "web_auth": False}}, "t")
        assert status.run(args, spec) == 3
        assert "(configured: 192.0.2.0/24)" in capsys.readouterr().err
    finally:
        silent.close()
    # a dropped SYN times out in connect(): urllib wraps that one in URLError
    import urllib.error

    assert status._timed_out(urllib.error.URLError(TimeoutError("timed out")))
    assert not status._timed_out(urllib.error.URLError(ConnectionRefusedError()))
    # no firewall in the spec: no firewall advice
    doc["firewall"] = {"enabled": False}
    assert "firewall" not in status.unanswered_hint(parse_spec(doc, "t"), url)
    # none admitted
    doc["firewall"] = {}
    assert "(configured: none)" in status.unanswered_hint(parse_spec(doc, "t"), url)


# ------------------------------------------------------------------------- high availability (docs/design/ha.md)


def ha_doc() -> dict[str, Any]:
    """spec_doc with both hosts gateways behind 10.0.0.9 and both monitoring hosts."""
    doc = spec_doc()
    doc["gateway"] = {"hosts": ["h1", "h2"], "virtual_address": "10.0.0.9/24"}
    doc["monitoring"] = {"hosts": ["h1", "h2"]}
    return doc


def ha_samples(
    spec: FleetSpec,
    vrrp: dict[str, str],
    members: dict[str, int],
    down: tuple[str, ...] = (),
    **hosts_up: int,
) -> list[Sample]:
    """healthy() plus each gateway's VRRP state (``vrrp``: host → state, as its exporter reports it; none for a
    host whose exporter is down), its nginx exporter, and each monitoring host's Prometheus and Alertmanager
    (``down``: jobs as ``JOB@HOST`` not scraped) with their cluster members."""
    out = healthy(spec, **hosts_up)
    exp = "vllm-fleet-exporter"
    for h in ("h1", "h2"):
        up = hosts_up.get(h, 1)
        out.append(({"__name__": "up", "job": "nginx", "host": h, "instance": h}, float(up)))
        for job, port in (("prometheus", 9090), ("alertmanager", 9093)):
            lab = {"job": job, "host": h, "instance": f"10.0.0.{h[1]}:{port}"}
            out.append(({"__name__": "up", **lab}, float(up and f"{job}@{h}" not in down)))
            if job == "alertmanager" and h in members:
                out.append(({"__name__": "alertmanager_cluster_members", **lab}, float(members[h])))
        if not up:
            continue  # a dead host's exporter has no series
        lab = {"job": exp, "host": h, "instance": h}
        out.append(({"__name__": "vllm_fleet_gateway_vrrp_master", **lab}, float(vrrp[h] == "MASTER")))
        for state in ("MASTER", "BACKUP", "FAULT", "STOP", "UNKNOWN"):
            out.append(
                (
                    {"__name__": "vllm_fleet_gateway_vrrp_state", **lab, "state": state},
                    float(vrrp[h] == state),
                )
            )
        if vrrp[h] != "UNKNOWN":
            out.append(
                ({"__name__": "vllm_fleet_gateway_vrrp_state_since_timestamp_seconds", **lab}, NOW - 7260)
            )
    return out


def _line(text: str, start: str) -> str:
    return next(x for x in text.splitlines() if x.startswith(start))


def test_an_ha_fleet_shows_who_holds_the_address_and_each_monitoring_host() -> None:
    spec = parse_spec(ha_doc(), "t")
    st = judge(
        spec, ha_samples(spec, {"h1": "MASTER", "h2": "BACKUP"}, {"h1": 2, "h2": 2}), "http://p", now=NOW
    )
    assert st.holders == ["h1"] and st.virtual_address == "10.0.0.9/24" and st.exit_code == EXIT_SERVING
    assert [(g.host, g.state, g.holds, g.since, g.nginx_up) for g in st.gateways] == [
        ("h1", "MASTER", True, NOW - 7260, True), ("h2", "BACKUP", False, NOW - 7260, True),
    ]  # fmt: skip
    text = table(st)
    assert _line(text, "gateway address") == (
        "gateway address 10.0.0.9/24: held by h1; h1 MASTER for 2h1m, h2 BACKUP for 2h1m"
    )
    assert _line(text, "monitoring h1") == "monitoring h1: Prometheus up, Alertmanager up (cluster of 2/2)"
    assert _line(text, "monitoring h2") == "monitoring h2: Prometheus up, Alertmanager up (cluster of 2/2)"
    assert text.splitlines()[-1].startswith("3/3 instances serving")  # the summary stays last
    doc = json.loads(json.dumps(st.to_dict()))
    assert doc["holders"] == ["h1"] and doc["gateways"][1]["state"] == "BACKUP"
    assert doc["monitoring"][0] == {
        "host": "h1", "prometheus_up": True, "alertmanager_up": True, "cluster_members": 2,
    }  # fmt: skip
    # one gateway and one monitoring host: no such lines, whatever Prometheus holds
    plain = parse_spec(spec_doc(), "t")
    st = judge(plain, ha_samples(plain, {"h1": "MASTER", "h2": "BACKUP"}, {"h1": 1}), now=NOW)
    assert (st.gateways, st.holders, st.monitoring, st.virtual_address) == ([], [], [], "")
    assert "gateway address" not in table(st) and "monitoring h" not in table(st)


def test_no_holder_two_holders_and_a_lost_monitoring_host_are_named() -> None:
    spec = parse_spec(ha_doc(), "t")
    # both gateways' nginx fail their check: FAULT on each, nobody holds the address
    st = judge(spec, ha_samples(spec, {"h1": "FAULT", "h2": "FAULT"}, {"h1": 2, "h2": 2}), now=NOW)
    assert st.holders == [] and _line(table(st), "gateway address") == (
        "gateway address 10.0.0.9/24: HELD BY NO GATEWAY; h1 FAULT for 2h1m, h2 FAULT for 2h1m"
    )
    assert st.exit_code == EXIT_SERVING  # the engines serve; the address is the alerts' (docs/status.md)
    # split brain
    st = judge(spec, ha_samples(spec, {"h1": "MASTER", "h2": "MASTER"}, {"h1": 2, "h2": 2}), now=NOW)
    assert _line(table(st), "gateway address").startswith(
        "gateway address 10.0.0.9/24: HELD BY 2 GATEWAYS: h1, h2 (split brain); h1 MASTER"
    )
    # the holder h1 powered off: its exporter has no series, h2 has not taken over yet; h2's keepalived has not
    # reported since boot
    st = judge(spec, ha_samples(spec, {"h1": "MASTER", "h2": "UNKNOWN"}, {"h2": 1}, h1=0), now=NOW)
    assert _line(table(st), "gateway address") == (
        "gateway address 10.0.0.9/24: HELD BY NO GATEWAY; h1 unreachable (its exporter is not scraped), "
        "h2 UNKNOWN"
    )
    assert [(m.host, m.prometheus_up, m.alertmanager_up, m.cluster_members) for m in st.monitoring] == [
        ("h1", False, False, None), ("h2", True, True, 1),
    ]  # fmt: skip
    assert _line(table(st), "monitoring h1") == "monitoring h1: Prometheus DOWN, Alertmanager DOWN"
    assert (
        _line(table(st), "monitoring h2") == "monitoring h2: Prometheus up, Alertmanager up (cluster of 1/2)"
    )
    # nginx's exporter down on a backup whose host exporter answers; an Alertmanager target Prometheus lacks
    samples = ha_samples(spec, {"h1": "MASTER", "h2": "BACKUP"}, {"h1": 2}, down=("alertmanager@h2",))
    samples = set_value(samples, "up", 0.0, job="nginx", host="h2")
    samples = [
        (lv, v)
        for lv, v in samples
        if not (lv["__name__"] == "up" and (lv.get("job"), lv.get("host")) == ("prometheus", "h2"))
    ]
    st = judge(spec, samples, now=NOW)
    assert _line(table(st), "gateway address").endswith("h2 BACKUP for 2h1m (nginx exporter not scraped)")
    assert _line(table(st), "monitoring h2") == "monitoring h2: Prometheus not scraped, Alertmanager DOWN"


def test_an_instance_drained_on_one_gateway_only_is_named() -> None:
    """A drain that did not reach every gateway (vllm-fleet drain's exit 4, a gateway down at the time): each
    gateway's exporter reports its own drained set, and status names the instances they disagree on."""
    spec = parse_spec(ha_doc(), "t")

    def drained(samples: list[Sample], host: str, *names: str) -> list[Sample]:
        lab = {"__name__": "vllm_fleet_gateway_drained", "job": "vllm-fleet-exporter", "host": host}
        return samples + [({**lab, "instance": n}, 1.0) for n in names]

    base = ha_samples(spec, {"h1": "MASTER", "h2": "BACKUP"}, {"h1": 2, "h2": 2})
    st = judge(spec, drained(drained(base, "h1", "a", "b"), "h2", "b"), now=NOW)
    assert [(g.host, g.drained) for g in st.gateways] == [("h1", ["a", "b"]), ("h2", ["b"])]
    assert st.drained_on_some == {"a": ["h1"]}
    assert _line(table(st), "instance a") == (
        "instance a: drained on h1, NOT on h2 (a drain or undrain did not reach every gateway: rerun "
        "`vllm-fleet drain a` or `undrain a` on a gateway host)"
    )
    assert "instance b" not in table(st)  # drained on both: the table's ROTATION says so
    assert {r.instance: r.rotation for r in st.rows} == {"a": "drained", "b": "drained", "c": "in"}
    assert json.loads(json.dumps(st.to_dict()))["drained_on_some"] == {"a": ["h1"]}
    # the same sets: nothing to say; a gateway whose exporter is down is not compared
    st = judge(spec, drained(drained(base, "h1", "b"), "h2", "b"), now=NOW)
    assert st.drained_on_some == {} and "instance " not in table(st)
    down = ha_samples(spec, {"h1": "MASTER", "h2": "BACKUP"}, {"h1": 2}, h2=0)
    st = judge(spec, drained(down, "h1", "c"), now=NOW)
    assert st.drained_on_some == {} and st.gateways[1].drained is None


def test_status_asks_each_monitoring_host_s_prometheus_in_turn(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The first monitoring host's Prometheus does not answer (nothing listens there): the second one's is read,
    and the output names the first and why; neither answering is exit 3 naming both."""
    import argparse

    from vllm_fleet.fleet import status

    srv = ThreadingHTTPServer(("127.0.0.3", 0), _FakePrometheus)
    port = srv.server_address[1]
    doc = spec_doc()
    doc["hosts"][0]["address"], doc["hosts"][1]["address"] = "127.0.0.2", "127.0.0.3"
    doc["monitoring"] = {"hosts": ["h1", "h2"], "prometheus_port": port, "web_auth": False}
    spec = parse_spec(doc, "t")
    first, second = f"http://127.0.0.2:{port}", f"http://127.0.0.3:{port}"
    assert status.prometheus_urls(spec) == [first, second] and status.prometheus_url(spec) == first
    assert "firewall (h2) admits Prometheus only from h2 itself" in status.unanswered_hint(spec, second)
    _FakePrometheus.samples = healthy(spec)
    _FakePrometheus.queries = []
    _FakePrometheus.password = ""
    args = argparse.Namespace(
        prometheus="", prometheus_user="", prometheus_password_file="", json=True, watch=0
    )
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        assert status.run(args, spec) == EXIT_SERVING
        out = json.loads(capsys.readouterr().out)
        assert out["prometheus"] == second and _FakePrometheus.queries == [QUERY]
        [why] = out["prometheus_errors"]
        assert why.startswith(f"Prometheus at {first}: ") and "refused" in why.lower()
        args.json = False
        assert status.run(args, spec) == EXIT_SERVING
        assert (
            f"read from Prometheus at {second}; before it: Prometheus at {first}: " in capsys.readouterr().out
        )
        # --prometheus: that one only
        args.prometheus = first
        assert status.run(args, spec) == 3
        assert second not in capsys.readouterr().err
    finally:
        srv.shutdown()
        srv.server_close()
    args.prometheus = ""
    assert status.run(args, spec) == 3
    err = capsys.readouterr().err
    assert f"Prometheus at {first}: " in err and f"Prometheus at {second}: " in err


def test_a_host_without_engines_is_not_asked_for_a_deployment_manifest() -> None:
    """A gateway- or monitoring-only host has no deployment manifest (the engine role writes it): status says
    nothing about its drift; an engine host without one is still named."""
    doc = spec_doc()
    doc["hosts"].append({"name": "g3", "address": "10.0.0.3"})
    spec = parse_spec(doc, "t")
    samples = healthy(spec)
    samples.append(({"__name__": "up", "job": "vllm-fleet-exporter", "host": "g3", "instance": "g3"}, 1.0))
    text = table(judge(spec, samples, now=NOW))
    assert "host g3" not in text, text
    # h1's manifest gone: named
    no_h1 = [
        (lab, v)
        for lab, v in samples
        if not (lab["__name__"] == "vllm_fleet_deployed_info" and lab["host"] == "h1")
    ]
    assert "host h1: no deployment manifest exported" in table(judge(spec, no_h1, now=NOW))
