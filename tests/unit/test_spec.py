"""Fleet spec validation: every error names the field path and the reason."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from vllm_fleet.fleet.spec import SpecError, load_spec, parse_spec, running_version, spec_hash

REPO = Path(__file__).resolve().parents[2]
SEED4 = yaml.safe_load((REPO / "examples/seed-004-4xa100.yml").read_text())


def problems(data: dict) -> list[str]:
    with pytest.raises(SpecError) as exc:
        parse_spec(data)
    return [f"{p}: {r}" for p, r in exc.value.problems]


@pytest.mark.parametrize("path", sorted((REPO / "examples").glob("*.yml")))
def test_examples_are_valid(path: Path) -> None:
    spec = load_spec(path)
    assert spec.models and spec.hosts


def test_unknown_field_is_named() -> None:
    d = copy.deepcopy(SEED4)
    d["models"][1]["max_num_seq"] = 8
    assert problems(d) == ["models[1].max_num_seq: unknown field (check the spelling against docs/spec.md)"]


def test_type_error_is_named() -> None:
    d = copy.deepcopy(SEED4)
    d["models"][0]["port"] = "eighty"
    (p,) = problems(d)
    assert p.startswith("models[0].port: ")


def test_unknown_host_is_named() -> None:
    d = copy.deepcopy(SEED4)
    d["models"][1]["host"] = "gpu-z"
    assert problems(d) == ["models[1].host: unknown host 'gpu-z' (hosts: gpu-a)"]


def test_moving_revision_refused() -> None:
    d = copy.deepcopy(SEED4)
    d["models"][0]["source"]["hf"]["revision"] = "main"
    (p,) = problems(d)
    assert p.startswith("models[0].source.hf.revision: revision must be pinned")


def test_source_needs_exactly_one_kind() -> None:
    d = copy.deepcopy(SEED4)
    d["models"][0]["source"]["path"] = "/models/x"
    (p,) = problems(d)
    assert p.startswith("models[0].source: give exactly one of hf, modelscope, path")


def test_plain_slack_webhook_refused() -> None:
    d = copy.deepcopy(SEED4)
    d["slack"]["webhook_url_file"] = "https://hooks.slack.com/services/T000/B000/XXXX"
    (p,) = problems(d)
    assert p.startswith("slack: webhook_url_file: looks like a Slack webhook URL in plain text")


def test_duplicate_instance_name() -> None:
    d = copy.deepcopy(SEED4)
    d["models"][1]["name"] = d["models"][0]["name"]
    assert "models[1].name: instance name 'r1-distill-7b' already used by models[0]" in problems(d)


def test_several_problems_reported_at_once() -> None:
    d = copy.deepcopy(SEED4)
    d["models"][0]["gpu_memory_utilization"] = 1.5
    d["models"][1]["port"] = 80
    ps = problems(d)
    assert len(ps) == 2
    assert {p.split(":")[0] for p in ps} == {"models[0].gpu_memory_utilization", "models[1].port"}


def test_missing_file_and_bad_yaml(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="cannot read"):
        load_spec(tmp_path / "nope.yml")
    bad = tmp_path / "bad.yml"
    bad.write_text("hosts: [\n")
    with pytest.raises(SpecError, match=r"\(yaml\)"):
        load_spec(bad)


def test_ansible_group_vars_wrapping() -> None:
    spec = parse_spec({"vllm_fleet": copy.deepcopy(SEED4)})
    assert spec.name == "seed-004"


# three hosts: gateways h1 and h2 behind one address, monitoring on h2 and h3, the engine on h3
HA = {
    "name": "ha",
    "stack": {"profile": "cpu"},
    "hosts": [{"name": f"h{i}", "address": f"10.77.0.7{i}", "memory_gib": 8} for i in (1, 2, 3)],
    "models": [{"name": "tiny", "source": {"path": "/m/tiny"}, "host": "h3", "port": 8101,
                "kv_cache_memory_bytes": 67108864}],
    "gateway": {"hosts": ["h1", "h2"], "virtual_address": "10.77.0.9/24"},
    "monitoring": {"hosts": ["h2", "h3"]},
}  # fmt: skip


def test_gateway_hosts_and_monitoring_hosts_with_the_one_host_forms_kept() -> None:
    spec = parse_spec(copy.deepcopy(HA))
    assert spec.gateway_hosts == ["h1", "h2"] and spec.gateway_host == "h1" and spec.gateway_ha
    assert spec.monitoring_hosts == ["h2", "h3"] and spec.monitoring_host == "h2" and spec.monitoring_ha
    one = load_spec(REPO / "examples/tiny-cpu-2hosts.yml")
    assert one.gateway_hosts == ["h1"] and one.monitoring_hosts == ["h1"] and not one.gateway_ha
    d = copy.deepcopy(SEED4)  # neither form: the first host, as before
    d.pop("gateway", None)
    assert parse_spec(d).gateway_hosts == ["gpu-a"]
    d = copy.deepcopy(HA)
    d["gateway"]["hosts"] = ["h1", {"name": "h2", "priority": 200}]
    assert [(h.name, h.priority) for h in parse_spec(d).gateway.hosts] == [("h1", None), ("h2", 200)]


_HA_ERRORS = [  # (section, change, the one problem): each error names its field path
    ("gateway", {"host": "h1"},
     "gateway.hosts", "give gateway.host (one host) or gateway.hosts (two or more), not both"),
    ("gateway", {"hosts": [], "virtual_address": ""},
     "gateway.hosts", "empty: name two or more hosts, or give gateway.host (one)"),
    ("gateway", {"hosts": ["h1"], "virtual_address": ""},
     "gateway.hosts", "one host: write `gateway.host: h1` (gateway.hosts is for two or more)"),
    ("gateway", {"hosts": ["h1", "h9"]},
     "gateway.hosts[1]", "unknown host 'h9' (hosts: h1, h2, h3)"),
    ("gateway", {"hosts": ["h1", {"name": "h1", "priority": 50}]},
     "gateway.hosts[1]", "host 'h1' is already gateway.hosts[0]"),
    ("gateway", {"virtual_address": ""},
     "gateway.virtual_address", "required with two or more gateway.hosts: the address clients use, which "
                                "keepalived moves to a gateway that works (e.g. 10.0.0.100/24)"),
    ("gateway", {"virtual_address": "10.77.0.300/24"},
     "gateway.virtual_address", "'10.77.0.300/24' is not an IPv4 address "
                                "(optionally with its /prefix, e.g. 10.0.0.100/24)"),
    ("gateway", {"virtual_address": "10.77.0.255/24"},
     "gateway.virtual_address", "'10.77.0.255/24' is the network's broadcast address"),
    ("gateway", {"virtual_address": "fd00::9/64"},
     "gateway.virtual_address", "'fd00::9/64' is not an IPv4 address "
                                "(optionally with its /prefix, e.g. 10.0.0.100/24)"),
    ("gateway", {"hosts": ["h1", {"name": "h2", "priority": 255}]},
     "gateway.hosts[1].priority", "Input should be less than or equal to 254"),
    ("gateway", {"vrrp": {"router_id": 256}},
     "gateway.vrrp.router_id", "Input should be less than or equal to 255"),
    ("gateway", {"vrrp": {"router_id": 0}},
     "gateway.vrrp.router_id", "Input should be greater than or equal to 1"),
    ("gateway", {"vrrp": {"auth_secret": "../etc/passwd"}},
     "gateway.vrrp.auth_secret", "String should match pattern '^([A-Za-z0-9][A-Za-z0-9_.-]{0,63})?$'"),
    ("gateway", {"vrrp": {"interface": "a-very-long-interface"}},
     "gateway.vrrp.interface", "String should match pattern '^([A-Za-z0-9_.:-]{1,15})?$'"),
    ("monitoring", {"host": "h2"},
     "monitoring.hosts", "give monitoring.host (one host) or monitoring.hosts (two or more), not both"),
    ("monitoring", {"hosts": ["h3"]},
     "monitoring.hosts", "one host: write `monitoring.host: h3` (monitoring.hosts is for two or more)"),
    ("monitoring", {"hosts": ["h2", "h2"]},
     "monitoring.hosts[1]", "host 'h2' is already monitoring.hosts[0]"),
    ("monitoring", {"hosts": ["h2", "x"]},
     "monitoring.hosts[1]", "unknown host 'x' (hosts: h1, h2, h3)"),
    ("monitoring", {"alertmanager_cluster_port": 0},
     "monitoring.alertmanager_cluster_port", "Input should be greater than or equal to 1"),
]  # fmt: skip


@pytest.mark.parametrize("section,change,path,message", _HA_ERRORS)
def test_ha_layout_errors_name_the_field(section: str, change: dict, path: str, message: str) -> None:
    d = copy.deepcopy(HA)
    d[section].update(change)
    assert problems(d) == [f"{path}: {message}"]


def test_a_virtual_address_needs_two_gateways() -> None:
    d = copy.deepcopy(SEED4)
    d["gateway"]["virtual_address"] = "10.0.0.9/24"
    assert problems(d) == [
        "gateway.virtual_address: only with gateway.hosts (two or more gateways share the address)"
    ]


def test_the_new_fields_at_their_defaults_keep_the_spec_hash() -> None:
    from vllm_fleet.fleet.spec import spec_hash

    d = copy.deepcopy(SEED4)
    before = spec_hash(parse_spec(d))
    d["gateway"].update({"virtual_address": "", "vrrp": {"advert_int": 1}, "peer_port": 8082})
    d["monitoring"] = {**d.get("monitoring", {}), "alertmanager_cluster_port": 9094}
    d["alerts"] = {**d.get("alerts", {}), "gateway_address_for": "1m", "ha_peer_down_for": "3m"}
    assert spec_hash(parse_spec(d)) == before
    d["monitoring"]["alertmanager_cluster_port"] = 9095
    assert spec_hash(parse_spec(d)) != before
    d["monitoring"]["alertmanager_cluster_port"] = 9094
    d["alerts"]["ha_peer_down_for"] = "5m"
    assert spec_hash(parse_spec(d)) != before
    d["alerts"]["ha_peer_down_for"] = "3m"
    d["gateway"]["peer_port"] = 8090
    assert spec_hash(parse_spec(d)) != before


# --------------------------------------------------------------------------- rollouts (issue 29)


def _rollout_spec(**rollout: object) -> dict[str, object]:
    import yaml

    d = yaml.safe_load((Path(__file__).resolve().parents[2] / "examples/tiny-cpu-2hosts.yml").read_text())
    r: dict[str, object] = {
        "model": "tiny-qwen3",
        "canary": {"name": "tiny-canary", "host": "h2", "port": 8111},
    }
    r.update(rollout)
    d["rollouts"] = [r]
    return d


def test_a_rollout_derives_its_canary_from_the_first_primary_as_the_spec_writes_it() -> None:
    d = _rollout_spec(share=0.2)
    d["models"][0]["max_num_seqs"] = 1  # type: ignore[index]  # the new version
    spec = parse_spec(d)
    c = spec.canary_of("tiny-qwen3")
    assert c is not None and c is spec.models[-1]
    assert (c.name, c.host, c.port, c.role, c.served_model_name) == (
        "tiny-canary",
        "h2",
        8111,
        "canary",
        "tiny-qwen3",
    )
    assert c.max_num_seqs == 1 and c.source == spec.models[0].source
    assert c.env == {}  # tiny-a has none, nor has this canary
    d["models"][0]["env"] = {"A": "1", "B": "2"}  # type: ignore[index]
    d["rollouts"][0]["canary"]["env"] = {"B": "3"}  # type: ignore[index]
    assert parse_spec(d).canary_of("tiny-qwen3").env == {"A": "1", "B": "3"}  # type: ignore[union-attr]
    assert spec.rollout_of("tiny-qwen3").share == 0.2  # type: ignore[union-attr]
    # a parsed spec dumped and parsed again derives the same canary once
    again = parse_spec(spec.model_dump(mode="json"))
    assert [m.name for m in again.models] == [m.name for m in spec.models]
    assert spec_hash(again) == spec_hash(spec)


@pytest.mark.parametrize(
    ("change", "path", "words"),
    [
        ({"model": "nope"}, "rollouts[0].model", "no primary instance serves 'nope'"),
        (
            {"canary": {"name": "tiny-a", "host": "h2", "port": 8111}},
            "rollouts[0].canary.name",
            "already used",
        ),
        (
            {"canary": {"name": "c", "host": "h9", "port": 8111}},
            "rollouts[0].canary.host",
            "unknown host 'h9'",
        ),
        ({"share": 0.9}, "rollouts[0].share", "less than or equal to 0.5"),
    ],
)
def test_a_bad_rollout_names_its_field(change: dict[str, object], path: str, words: str) -> None:
    with pytest.raises(SpecError) as e:
        parse_spec(_rollout_spec(**change))
    assert any(p == path and words in msg for p, msg in e.value.problems), e.value.problems


def test_a_canary_is_derived_never_written() -> None:
    d = _rollout_spec()
    d["models"][2]["role"] = "canary"  # type: ignore[index]
    with pytest.raises(SpecError) as e:
        parse_spec(d)
    assert (
        "models[2].role",
        "canary is set by rollouts[].canary: a canary is derived, not written",
    ) in e.value.problems


def test_a_problem_of_the_canary_names_its_rollouts_entry() -> None:
    spec = parse_spec(_rollout_spec())
    assert spec.field_path("models[3].port") == "rollouts[0].canary.port (the canary of 'tiny-qwen3')"
    assert spec.field_path("models[0].port") == "models[0].port"
    assert spec_hash(parse_spec(_rollout_spec())) != spec_hash(
        load_spec(Path(__file__).resolve().parents[2] / "examples/tiny-cpu-2hosts.yml")
    )


def test_the_plan_names_a_canary_problem_by_its_rollouts_entry() -> None:
    from vllm_fleet.fleet.plan import make_plan

    d = _rollout_spec(canary={"name": "tiny-canary", "host": "h2", "port": 8101})  # tiny-backup's port on h2
    problems = [str(p) for p in make_plan(parse_spec(d), []).problems]
    assert problems == [
        "rollouts[0].canary.port (the canary of 'tiny-qwen3'): port 8101 on h2 is already used by models[2] "
        "(tiny-backup)"
    ]


def test_held_instances_are_planned_as_they_run() -> None:
    """The spec writes the new version (max_num_seqs 1); tiny-a and tiny-b run the old one (their deployed
    configs' `spec`): running_version puts the old entries back for everything but the canary, so the gateway's
    bounds and capacity follow what runs; a promoted model, a config without its entry, or another instance of
    the same name keep the spec as written."""
    from vllm_fleet.fleet.context import build_context

    old = parse_spec(_rollout_spec())
    deployed = {
        n: {"name": n, "spec": build_context(old, old.model(n).host)["vf"]["instances"][i]["spec_entry"]}
        for i, n in enumerate(("tiny-a", "tiny-b"))
    }
    d = _rollout_spec()
    for m in d["models"]:  # type: ignore[attr-defined]
        m["max_num_seqs"] = 1
    new = parse_spec(d)
    assert running_version(new, deployed) == ["tiny-a", "tiny-b"]
    assert [m.max_num_seqs for m in new.models] == [
        16,
        16,
        1,
        1,
    ]  # tiny-backup: no config read; the canary: new
    assert new.models_on("h1")[0].max_num_seqs == 16  # the host index follows
    again = parse_spec(d)
    assert running_version(again, deployed, ["tiny-qwen3"]) == []  # promoted: the new version everywhere
    assert running_version(again, {"tiny-a": {"name": "tiny-a"}}) == []  # an older config: as written
    moved = {"tiny-a": {"spec": {**deployed["tiny-a"]["spec"], "host": "h2"}}}
    assert running_version(again, moved) == []
