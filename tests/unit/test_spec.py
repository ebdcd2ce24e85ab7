"""Fleet spec validation: every error names the field path and the reason."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from vllm_fleet.fleet.spec import SpecError, load_spec, parse_spec

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
