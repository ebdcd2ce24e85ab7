"""fleet/hostplan.py: what the play does on one host, decided in Python (the roles print it)."""

from __future__ import annotations

from pathlib import Path

import yaml

from vllm_fleet.fleet.context import build_context
from vllm_fleet.fleet.hostplan import doctor_checks
from vllm_fleet.fleet.spec import load_spec, parse_spec

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_doctor_checks_of_a_host_with_gpu_and_cpu_stacks() -> None:
    """seed-001-cpu-fallback: GPU primaries on the gpu stack and a CPU fallback on a cpu stack on one host."""
    spec = load_spec(EXAMPLES / "seed-001-cpu-fallback.yml")
    d = doctor_checks(spec, "h100-a")
    assert d.profile == "gpu+cpu"
    assert d.min_driver == spec.stack.min_driver
    used = [g for m in spec.models_on("h100-a") if spec.stack_of(m).profile == "gpu" for g in m.gpus]
    assert d.expect_gpus == max(used) + 1 == 2
    assert d.host_gpus["field"] == "hosts[0].gpus" and d.host_gpus["count"] == 2


def test_doctor_checks_of_a_cpu_host_and_of_a_host_without_instances() -> None:
    raw = yaml.safe_load((EXAMPLES / "tiny-cpu-2hosts.yml").read_text())
    raw["hosts"].append({"name": "spare", "address": "10.0.0.9", "memory_gib": 8})
    spec = parse_spec(raw)
    assert doctor_checks(spec, "h1").profile == "cpu" and doctor_checks(spec, "h1").expect_gpus == 0
    spare = doctor_checks(spec, "spare")  # no instance: the fleet's stack, index of the host in the spec
    assert spare.profile == spec.stack.profile and spare.host_gpus["field"] == "hosts[2].gpus"


def test_the_context_hands_the_roles_the_decided_values() -> None:
    spec = load_spec(EXAMPLES / "seed-004-4xa100.yml")
    host = spec.hosts[0].name
    vf = build_context(spec, host)["vf"]
    assert vf["doctor"] == doctor_checks(spec, host).as_vars()
    assert vf["doctor"]["profile"] == "gpu" and vf["doctor"]["expect_gpus"] == 4
