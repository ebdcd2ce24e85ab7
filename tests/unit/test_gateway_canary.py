"""The gateway side of a canary (rollouts): routes.py keeps it out of every upstream (its one-server upstream and
the route's ``canary`` only), drain does not count it as a server, the state file's format keeps every key its
writer does not own, and ``vllm-fleet canary`` writes, renews and clears a lease."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_fleet.cli import main
from vllm_fleet.devtools.gateway_testing import gateway_spec, route_upstream
from vllm_fleet.fleet.admission_config import model_capacity
from vllm_fleet.fleet.context import fleet_vars
from vllm_fleet.fleet.plan import make_plan
from vllm_fleet.fleet.render import render_fleet
from vllm_fleet.fleet.routes import SUMMARY_KEYS, gateway_routes, route_index
from vllm_fleet.host.canary import CanaryError, canaries, clear_lease, set_lease, show
from vllm_fleet.host.drain import DrainError, instances, load_routes, set_drained, stranded_models
from vllm_fleet.host.exporter.access_log import AccessLogTail, track_outcome
from vllm_fleet.host.exporter.states import Deployment, canary_metrics
from vllm_fleet.host.gateway_state import (
    CanaryLease,
    GatewayState,
    StateFileError,
    read_state,
    update_state,
    write_state,
)

SERVERS = [
    ("a", "primary", "default"),
    ("b", "primary", "high"),
    ("c", "backup", "default"),
    ("can", "canary", "default"),
    ("d", "fallback", "cpu"),
]


@pytest.mark.parametrize("policy", ["least_conn", "cache_aware"])
def test_a_canary_serves_no_upstream_only_its_own(policy: str) -> None:
    (rt,) = gateway_routes([route_upstream(SERVERS, policy)], {})
    every = [s["instance"] for u in rt["upstreams"] + rt["ca_upstreams"] for s in u["servers"]]
    assert "can" not in every
    assert {"a", "b", "c", "d"} <= set(every)
    assert len(rt["upstreams"]) == 4  # main, two pools, fallback: as without the canary
    if policy == "cache_aware":
        assert rt["ca"] and all(
            "can" not in [s["instance"] for s in u["servers"]] for u in rt["ca_upstreams"]
        )
    assert rt["solo"]["can"] == {"upstream": "vf_i_can", "address": "127.0.0.1:8103"}
    assert rt["canary"] == {"instance": "can", "upstream": "vf_i_can"}
    (summary,) = route_index([rt])["models"]
    assert "canary" in SUMMARY_KEYS and summary["canary"] == rt["canary"]


def test_without_a_canary_the_route_says_null() -> None:
    (rt,) = gateway_routes([route_upstream(SERVERS[:3])], {})
    assert rt["canary"] is None and "can" not in rt["solo"]
    assert route_index([rt])["models"][0]["canary"] is None


ROLLOUT = {"model": "tiny-qwen3", "canary": {"name": "can", "port": 18999}, "share": 0.25}


@pytest.fixture
def rendered(tmp_path: Path) -> Path:
    """routes.json of a rendered spec: a, b primaries, c backup, canary ``can``; returns its path."""
    spec = gateway_spec(
        [
            {"name": "a", "port": 18001},
            {"name": "b", "port": 18002},
            {"name": "c", "port": 18003, "role": "backup"},
        ],
        tmp_path,
        rollouts=[ROLLOUT],
    )
    render_fleet(spec, tmp_path / "out")
    return tmp_path / "out" / "h1" / "etc" / "nginx" / "vllm-fleet" / "routes.json"


def test_rendered_gateway_files_keep_the_canary_out(rendered: Path) -> None:
    doc = json.loads(rendered.read_text())
    (rt,) = doc["routes"]
    assert rt["canary"] == {"instance": "can", "upstream": "vf_i_can"}
    assert doc["models"][0]["canary"] == rt["canary"]
    ups = (rendered.parent / "upstreams.conf").read_text()
    # the canary's address appears once: in its one-server upstream
    assert ups.count(":18999") == 1 and "upstream vf_i_can { server 127.0.0.1:18999;" in ups
    main_up = ups.split("upstream m_tiny_qwen3 {", 1)[1].split("}", 1)[0]
    assert ":18001" in main_up and ":18999" not in main_up


def test_admission_capacity_leaves_the_canary_out(tmp_path: Path) -> None:
    servers = [
        {"name": "a", "port": 18001, "max_num_seqs": 8},
        {"name": "b", "port": 18002, "max_num_seqs": 8},
    ]
    plain = gateway_spec(servers, tmp_path)
    spec = gateway_spec(servers, tmp_path, rollouts=[ROLLOUT])
    assert [m.role for m in spec.models] == ["primary", "primary", "canary"]
    assert (
        model_capacity(spec, make_plan(spec)) == model_capacity(plain, make_plan(plain)) == {"tiny-qwen3": 32}
    )
    vf = fleet_vars(spec)
    assert [s["instance"] for u in vf["upstreams"] for s in u["servers"]] == ["a", "b", "can"]


def test_drain_does_not_count_the_canary_as_a_server(rendered: Path, tmp_path: Path) -> None:
    routes = load_routes(rendered)
    assert instances(routes)["can"] == "127.0.0.1:18999"  # drain can take a canary out
    assert stranded_models(routes, {"a", "b", "c"}) == ["tiny-qwen3"]  # the canary left: no server
    state = tmp_path / "drained.json"
    set_drained("a", True, rendered, state)
    set_drained("b", True, rendered, state)
    with pytest.raises(DrainError) as exc:
        set_drained("c", True, rendered, state)
    assert exc.value.code == 3
    assert set_drained("can", True, rendered, state) == {"a", "b", "can"}


# ----------------------------------------------------------------------------- the state file


def test_state_round_trip_keeps_unknown_keys(tmp_path: Path) -> None:
    path = tmp_path / "drained.json"
    assert read_state(path) == GatewayState()  # no file: nothing
    doc = {
        "drained": ["b", "a"],
        "updated": 1.0,
        "future": {"x": 1},
        "canary": {"can": {"model": "m", "share": 0.2, "until": 50.0, "phase": "observing", "since": 10.0}},
    }
    path.write_text(json.dumps(doc))
    st = read_state(path)
    assert st.drained == ["b", "a"]
    assert st.canary == {"can": CanaryLease("m", 0.2, 50.0, "observing", 10.0)}
    write_state(path, st, now=99.0)
    assert json.loads(path.read_text()) == dict(doc, drained=["a", "b"], updated=99.0)
    st.canary.clear()
    write_state(path, st, now=100.0)
    assert "canary" not in json.loads(path.read_text())  # no lease left: no key


def test_state_file_entries_that_are_not_leases_are_dropped_and_bad_files_refused(tmp_path: Path) -> None:
    path = tmp_path / "drained.json"
    path.write_text(
        json.dumps({"drained": [], "canary": {"x": {"share": "lots"}, "y": 3, "z": {"until": 1}}})
    )
    assert read_state(path).canary == {}
    for text in ("{", "[1]"):
        path.write_text(text)
        with pytest.raises(StateFileError):
            read_state(path)


def test_a_lease_is_live_while_it_runs_with_a_share_the_router_takes() -> None:
    assert CanaryLease("m", 0.25, 100.0).live(now=99.9)
    assert not CanaryLease("m", 0.25, 100.0).live(now=100.0)
    assert not CanaryLease("m", 0.0, 100.0).live(now=0)
    assert CanaryLease("m", 0.5, 100.0).live(now=0)
    assert not CanaryLease("m", 0.51, 100.0).live(now=0)


def test_drain_and_undrain_keep_the_canary_lease(rendered: Path, tmp_path: Path) -> None:
    state = tmp_path / "drained.json"
    lease = set_lease("can", 0.25, 60, routes_file=rendered, state=state, now=1000.0)
    set_drained("a", True, rendered, state)
    assert read_state(state).canary == {"can": lease}
    set_drained("a", False, rendered, state)
    st = read_state(state)
    assert st.drained == [] and st.canary == {"can": lease}


def test_an_update_that_raises_writes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "drained.json"
    write_state(path, GatewayState(drained=["a"]), now=1.0)
    before = path.read_text()

    def change(st: GatewayState) -> None:
        st.drained = []
        raise RuntimeError("no")

    with pytest.raises(RuntimeError):
        update_state(path, change)
    assert path.read_text() == before


def test_an_update_reads_again_when_the_file_was_replaced_meanwhile(tmp_path: Path) -> None:
    """nginx's peer handler writes without the lock: an update that finds the file replaced since it read it
    starts over from the new file, so the peer's drain is not undone."""
    path = tmp_path / "drained.json"
    write_state(path, GatewayState(drained=["a"]), now=1.0)
    seen: list[list[str]] = []

    def change(st: GatewayState) -> None:
        seen.append(list(st.drained))
        if len(seen) == 1:  # the peer handler's write, between this read and this write
            path.write_text(json.dumps({"drained": ["a", "b"], "updated": 2.0}))
        st.canary["can"] = CanaryLease("m", 0.2, 10.0)

    update_state(path, change)
    assert seen == [["a"], ["a", "b"]]
    st = read_state(path)
    assert st.drained == ["a", "b"] and set(st.canary) == {"can"}


# ----------------------------------------------------------------------------- vllm-fleet canary


def test_set_renews_and_clear_is_idempotent(rendered: Path, tmp_path: Path) -> None:
    state = tmp_path / "drained.json"
    assert canaries(load_routes(rendered)) == {"can": "tiny-qwen3"}
    first = set_lease("can", 0.25, 30, "observing", rendered, state, now=1000.0)
    assert first == CanaryLease("tiny-qwen3", 0.25, 1030.0, "observing", 1000.0)
    again = set_lease("can", 0.1, 30, "judging", rendered, state, now=1020.0)
    assert again == CanaryLease("tiny-qwen3", 0.1, 1050.0, "judging", 1000.0)  # since kept while renewed
    late = set_lease("can", 0.1, 30, "observing", rendered, state, now=2000.0)
    assert late.since == 2000.0  # the lease had run out: a new one
    assert show(state, now=2010.0)["canary"]["can"]["live"] is True
    assert show(state, now=2031.0)["canary"]["can"]["live"] is False
    assert clear_lease("can", state) is True
    assert clear_lease("can", state) is False
    assert read_state(state).canary == {}


@pytest.mark.parametrize(
    ("name", "share", "lease", "why"),
    [
        ("a", 0.2, 30, "not a canary"),
        ("nope", 0.2, 30, "not a canary"),
        ("can", 0.0, 30, "not in (0, 0.5]"),
        ("can", 0.51, 30, "not in (0, 0.5]"),
        ("can", float("nan"), 30, "not in (0, 0.5]"),
        ("can", 0.2, 0, "not a positive"),
    ],
)
def test_set_refuses(rendered: Path, tmp_path: Path, name: str, share: float, lease: float, why: str) -> None:
    state = tmp_path / "drained.json"
    with pytest.raises(CanaryError) as exc:
        set_lease(name, share, lease, routes_file=rendered, state=state)
    assert exc.value.code == 2 and why in str(exc.value)
    assert not state.exists()


def test_the_command(rendered: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = tmp_path / "drained.json"
    where = ["--routes", str(rendered), "--state", str(state)]
    assert main(["canary", "set", "a", "--share", "0.2", "--lease", "30", *where]) == 2
    assert "not a canary" in capsys.readouterr().err
    assert main(["canary", "set", "can", "--share", "0.2", "--lease", "30", "--phase", "p1", *where]) == 0
    capsys.readouterr()
    assert main(["canary", "show", *where]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["canary"]["can"]["share"] == 0.2 and shown["canary"]["can"]["phase"] == "p1"
    assert shown["canary"]["can"]["live"] is True
    assert main(["canary", "clear", "can", *where]) == 0
    assert main(["canary", "clear", "can", *where]) == 0
    assert read_state(state).canary == {}


# ----------------------------------------------------------------------------- the exporter


@pytest.mark.parametrize(
    ("track", "status", "statuses", "outcome"),
    [
        ("canary", 200, "200", "ok"),
        ("canary", 400, "400", "ok"),
        ("canary", 200, "502 : 200", "error"),  # the canary refused the connection: stable served it
        ("canary", 200, "504 : 200", "error"),
        ("canary", 200, "503 : 200", "shed"),  # the canary was full
        ("canary", 200, "502, 200", "ok"),  # a failed keep-alive connection, retried on the canary itself
        ("canary", 500, "500", "error"),
        ("stable", 200, "200", "ok"),
        ("stable", 502, "502", "error"),
        ("stable", 503, "503, 503", "shed"),
        ("stable", 200, "503 : 200", "ok"),  # a spill-over
    ],
)
def test_track_outcome(track: str, status: int, statuses: str, outcome: str) -> None:
    assert track_outcome(track, status, statuses) == outcome


def _line(**kw: object) -> str:
    rec = {"status": 200, "model": "m", "upstream_addr": "127.0.0.1:1", "upstream_status": "200"}
    return json.dumps({**rec, **kw}) + "\n"


def test_the_track_counter_counts_lines_with_a_track_only(tmp_path: Path) -> None:
    log = tmp_path / "access.log"
    log.write_text(
        _line()  # an older line: no track
        + _line(track="stable")
        + _line(track="canary", upstream_status="502 : 200", upstream_addr="127.0.0.1:2 : 127.0.0.1:1")
        + _line(track="canary")
        + _line(track="canary", upstream_status="503 : 200")
        + _line(track="")  # not routed to a model's upstream
    )
    tail = AccessLogTail(log, from_start=True)
    got = {
        tuple(s.labels[k] for k in ("model", "track", "outcome")): s.value
        for fam in tail.metrics()
        if fam.name == "vllm_fleet_gateway_track_requests"
        for s in fam.samples
    }
    assert got[("m", "canary", "error")] == 1
    assert got[("m", "canary", "ok")] == 1
    assert got[("m", "canary", "shed")] == 1
    assert got[("m", "stable", "ok")] == 1
    assert sum(got.values()) == 4 and len(got) == 6  # every track and outcome exported


def test_canary_gauges_from_the_state_file(tmp_path: Path) -> None:
    state = tmp_path / "drained.json"
    doc = {
        "drained": ["c2"],
        "canary": {
            "c1": {"model": "m", "share": 0.25, "until": 200.0, "phase": "observing", "since": 1.0},
            "c2": {"model": "n", "share": 0.1, "until": 200.0, "phase": "observing", "since": 1.0},
            "c3": {"model": "o", "share": 0.3, "until": 50.0, "phase": "observing", "since": 1.0},
        },
    }
    got = {(f.name, s.labels["instance"]): s.value for f in canary_metrics(doc, now=100.0) for s in f.samples}
    assert got[("vllm_fleet_gateway_canary_share", "c1")] == 0.25
    assert got[("vllm_fleet_gateway_canary_share", "c2")] == 0.0  # drained
    assert got[("vllm_fleet_gateway_canary_share", "c3")] == 0.0  # the lease ran out
    assert got[("vllm_fleet_gateway_canary_lease_expiry_timestamp_seconds", "c3")] == 50.0
    assert list(canary_metrics({"drained": []})) == []
    state.write_text(json.dumps(doc))
    names = {f.name for f in Deployment(drain_state=state).collect()}
    assert {"vllm_fleet_gateway_canary_share", "vllm_fleet_gateway_drained"} <= names
