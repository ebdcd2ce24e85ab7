"""The planner's pure checks (vllm_fleet/fleet/plan_checks.py): each refuses (or tells) with the spec field it is
about, accepts a good spec with no finding, and computes its sizes without touching a plan."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from vllm_fleet.fleet import plan_checks as pc
from vllm_fleet.fleet.modelinfo import ModelFacts, facts_for
from vllm_fleet.fleet.spec import FleetSpec, parse_spec

REPO = Path(__file__).resolve().parents[2]
SEED4: dict[str, Any] = yaml.safe_load((REPO / "examples/seed-004-4xa100.yml").read_text())
TINY: dict[str, Any] = yaml.safe_load((REPO / "examples/tiny-cpu.yml").read_text())
GIB = 1024**3
SMALL = {"params_b": 0.5, "num_layers": 24, "num_kv_heads": 2, "head_dim": 64}


def spec(base: dict[str, Any], **model0: Any) -> FleetSpec:
    d = copy.deepcopy(base)
    d["models"][0].update(model0)
    return parse_spec(d)


def paths(found: list[pc.Finding], severity: str = "problem") -> list[str]:
    assert all(isinstance(f, pc.Finding) for f in found)
    return [f.path for f in found if f.severity == severity]


def placed(s: FleetSpec, host: str) -> list[tuple[int, Any]]:
    return [(i, m) for i, m in enumerate(s.models) if m.host == host]


# --------------------------------------------------------------------------- Finding


def test_a_problem_prints_its_path_and_a_warning_its_own_line() -> None:
    assert str(pc.Finding("models[0].port", "taken")) == "models[0].port: taken"
    assert (
        str(pc.Finding("stacks.x", "stacks.x: no instance runs it", "warning"))
        == "stacks.x: no instance runs it"
    )


# --------------------------------------------------------------------------- layout


def test_check_port() -> None:
    s = parse_spec(SEED4)
    host = s.hosts[0]
    (f,) = pc.check_port(host, "models[1].port", 8001, {8001: "models[0] (a)"})
    assert (f.path, f.severity) == (
        "models[1].port",
        "problem",
    ) and "already used by models[0] (a)" in f.message
    assert pc.check_port(host, "models[1].port", 8002, {8001: "models[0] (a)"}) == []


def test_check_gpus() -> None:
    s = spec(SEED4, gpus=[0, 7], tensor_parallel_size=1)
    m = s.models[0]
    assert paths(pc.check_gpus(s, s.hosts[0], 0, m, {})) == [
        "models[0].tensor_parallel_size",
        "models[0].gpus",
    ]
    s = parse_spec(SEED4)
    (f,) = pc.check_gpus(s, s.hosts[0], 1, s.models[1].model_copy(update={"gpus": [1, 2]}), {0: [0], 1: [0]})
    assert f.path == "models[1].gpus" and f.message.startswith("GPU 1 on gpu-a is already used by models[0]")
    assert "swap group" in f.message  # the way to share a GPU is named
    assert pc.check_gpus(s, s.hosts[0], 1, s.models[1], {0: [0], 1: [0]}) == []


def test_check_cpu_devices() -> None:
    s = spec(TINY, tensor_parallel_size=2, gpus=[0])
    assert paths(pc.check_cpu_devices(s, 0, s.models[0])) == [
        "models[0].tensor_parallel_size",
        "models[0].gpus",
    ]
    s = parse_spec(TINY)
    assert pc.check_cpu_devices(s, 0, s.models[0]) == []


def test_check_shared_gpus() -> None:
    d = copy.deepcopy(SEED4)
    d["models"][1]["gpus"] = [0, 1]
    d["models"][0]["share_gpus"] = d["models"][1]["share_gpus"] = True
    s = parse_spec(d)
    both = {0: ["r1-distill-7b", "qwen3-8b"]}
    (f,) = pc.check_shared_gpus(s, s.hosts[0], both)
    assert f.path == "models[1].gpu_memory_utilization" and "1.80 of its memory" in f.message
    d["models"][0]["gpu_memory_utilization"] = d["models"][1]["gpu_memory_utilization"] = 0.45
    s = parse_spec(d)
    assert pc.check_shared_gpus(s, s.hosts[0], both) == []


def test_host_layout_claims_ports_and_gpus_in_spec_order() -> None:
    s = parse_spec(SEED4)
    lay = pc.host_layout(s, s.hosts[0], placed(s, "gpu-a"))
    assert lay.findings == []
    assert lay.gpu_map == {0: ["r1-distill-7b"], 1: ["r1-distill-7b"], 2: ["qwen3-8b"], 3: ["qwen3-8b"]}
    assert lay.ports[8000] == "gateway.port" and lay.ports[8002] == "models[1] (qwen3-8b)"
    s = spec(SEED4, port=8000)
    lay = pc.host_layout(s, s.hosts[0], placed(s, "gpu-a"))
    assert paths(lay.findings) == ["models[0].port"] and lay.ports[8000] == "gateway.port"


def test_start_order() -> None:
    d = copy.deepcopy(SEED4)
    d["models"][1]["gpus"] = [0, 1]
    s = parse_spec(d)
    by_host = {"gpu-a": placed(s, "gpu-a")}
    assert pc.start_order(s, by_host) == {"r1-distill-7b": [], "qwen3-8b": ["r1-distill-7b"]}
    s = parse_spec(SEED4)
    assert pc.start_order(s, {"gpu-a": placed(s, "gpu-a")}) == {"r1-distill-7b": [], "qwen3-8b": []}


# --------------------------------------------------------------------------- per instance


def test_check_dtypes() -> None:
    s = spec(SEED4, quantization="fp8")
    (f,) = pc.check_dtypes(s.hosts[0], 0, s.models[0], ModelFacts(), detected=True)
    assert f.path == "models[0].quantization" and f.message.endswith("compute capability 8.0 (detected)")
    (f,) = pc.check_dtypes(s.hosts[0], 0, parse_spec(SEED4).models[0], ModelFacts(quant_method="fp8"), False)
    assert f.path == "models[0].source"
    s = parse_spec(SEED4)
    assert pc.check_dtypes(s.hosts[0], 0, s.models[0], ModelFacts(), detected=False) == []


def test_check_extra_args() -> None:
    s = spec(SEED4, extra_args=["--seed", "1", "--max-num-seqz", "4"])
    known = pc.load_flag_tables(s, pc.plan_stacks(s, None).stacks, False).known["default"]
    assert known is not None
    assert paths(pc.check_extra_args(s, 0, s.models[0], known, False)) == ["models[0].extra_args[2]"]
    assert paths(pc.check_extra_args(s, 0, s.models[0], None, False))[0] == "models[0].extra_args"
    s = spec(SEED4, extra_args=["--seed", "1"])
    assert pc.check_extra_args(s, 0, s.models[0], known, False) == []
    assert pc.check_extra_args(s, 0, s.models[0], None, True) == []


def test_check_revision_is_a_warning() -> None:
    s = parse_spec(SEED4)  # PIN-A-COMMIT-SHA
    (f,) = pc.check_revision(0, s.models[0])
    assert (f.path, f.severity) == ("models[0].source.hf.revision", "warning")
    s = spec(SEED4, source={"hf": {"repo": "org/x", "revision": "a" * 40}})
    assert pc.check_revision(0, s.models[0]) == []


def test_an_engine_keep_alive_near_the_gateways_is_refused_or_warned() -> None:
    """models[].env may set VLLM_HTTP_TIMEOUT_KEEP_ALIVE: not a number or not above the gateway's 4 s refuses
    the plan, below the fleet's 75 s warns, none or longer says nothing."""
    assert pc.check_engine_keepalive(0, parse_spec(SEED4).models[0]) == []
    for value, severity in (("abc", "problem"), ("4", "problem"), ("5", "warning"), ("74", "warning")):
        (f,) = pc.check_engine_keepalive(
            0, spec(SEED4, env={"VLLM_HTTP_TIMEOUT_KEEP_ALIVE": value}).models[0]
        )
        assert (f.path, f.severity) == ("models[0].env.VLLM_HTTP_TIMEOUT_KEEP_ALIVE", severity), value
    assert (
        pc.check_engine_keepalive(0, spec(SEED4, env={"VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "300"}).models[0]) == []
    )


def test_plan_queue() -> None:
    s = spec(SEED4, max_num_seqs=None)
    q = pc.plan_queue(s, 0, s.models[0], 96)
    assert q.bound is None and paths(q.findings, "warning") == ["models[0].max_num_queued_reqs"]
    assert "(suggested 96)" in q.findings[0].message
    s = parse_spec(SEED4)
    q = pc.plan_queue(s, 0, s.models[0], 96)
    assert q == pc.QueuePlan(2 * 128, [])  # twice max_num_seqs


def test_plan_queue_warns_when_the_release_cannot_bound_it() -> None:
    """A release without --max-num-queued-reqs (0.21.0 here) gets a warning naming the field and the stack, set
    or not (the GPU burst of issue 31 queued 1,488 requests with a silent plan); 0 (unbounded on purpose) none."""
    d = copy.deepcopy(SEED4)
    d["stack"]["vllm_version"] = "0.21.0"
    for bound in (None, 256):
        s = spec(d, max_num_queued_reqs=bound)
        (f,) = pc.plan_queue(s, 0, s.models[0], 96).findings
        assert (f.path, f.severity) == ("models[0].max_num_queued_reqs", "warning")
        assert f.message.startswith("models[0].max_num_queued_reqs: vLLM 0.21.0 (stack.vllm_version) has no")
    s = spec(d, max_num_queued_reqs=0)
    assert pc.plan_queue(s, 0, s.models[0], 96).findings == []
    d["stacks"] = {"old": dict(d["stack"])}
    d["stack"]["vllm_version"] = "0.33.0"
    s = spec(d, stack="old")
    (f,) = pc.plan_queue(s, 0, s.models[0], 96).findings
    assert "(stacks.old.vllm_version)" in f.message
    assert pc.plan_queue(s, 1, s.models[1], 96).findings == []  # the fleet's 0.33.0 has it


# --------------------------------------------------------------------------- memory steps


def test_check_facts_known() -> None:
    s = spec(SEED4, shape={})
    m = s.models[0]
    (f,) = pc.check_facts_known(s, 0, m, facts_for(m, []), [], fit_after_fetch=False)
    assert (f.path, f.severity) == ("models[0].shape", "problem")
    (f,) = pc.check_facts_known(s, 0, m, facts_for(m, []), [], fit_after_fetch=True)
    assert (f.path, f.severity) == ("models[0].shape", "note") and "plans again after the fetch" in f.message
    s = parse_spec(SEED4)
    assert pc.check_facts_known(s, 0, s.models[0], facts_for(s.models[0], []), [], False) == []


def test_model_size_and_max_model_len() -> None:
    s = parse_spec(SEED4)
    m = s.models[1]  # Qwen3-8B: 36 layers × 8 KV heads × 128 × K,V × bf16
    size = pc.model_size(m, facts_for(m, []))
    params = int(8.19 * 1e9)  # shape.params_b; bf16 weights: 2 bytes each
    assert size == pc.ModelSize(params, 2 * params, 147456, 32768)
    assert pc.check_max_model_len(1, m, facts_for(m, [])) == []
    s = spec(SEED4, max_model_len=200_000)
    (f,) = pc.check_max_model_len(0, s.models[0], facts_for(s.models[0], []))
    assert f.path == "models[0].max_model_len" and "max_position_embeddings 131072" in f.message


def test_check_gpu_memory_known() -> None:
    d = copy.deepcopy(SEED4)
    d["hosts"][0]["gpus"] = {"detect": True}
    s = parse_spec(d)
    (f,) = pc.check_gpu_memory_known(s, 0, s.models[0], s.hosts[0], fit_after_fetch=False)
    assert (f.path, f.severity) == ("hosts[0].gpus", "problem")
    (f,) = pc.check_gpu_memory_known(s, 0, s.models[0], s.hosts[0], fit_after_fetch=True)
    assert (f.path, f.severity) == ("hosts[0].gpus", "note")
    s = parse_spec(SEED4)
    assert pc.check_gpu_memory_known(s, 0, s.models[0], s.hosts[0], False) == []


def test_gpu_kv_budget_and_fit() -> None:
    s = parse_spec(SEED4)
    m, host = s.models[0], s.hosts[0]  # 2 × 80 GiB × 0.9
    b = pc.gpu_kv_budget(m, host, 15 * GIB)
    assert b == pc.KvBudget(int(144 * GIB), int(144 * GIB) - 15 * GIB - 2 * pc.OVERHEAD_PER_GPU_BYTES)
    assert pc.check_fit(s, 0, m, host, 15 * GIB, b) == []
    too_big = pc.gpu_kv_budget(m, host, 150 * GIB)
    (f,) = pc.check_fit(s, 0, m, host, 150 * GIB, too_big)
    assert f.path == "models[0].gpus" and f.message.startswith("model does not fit: weights ≈150.0 GiB")


def test_cpu_kv_explicit_and_budget() -> None:
    s = spec(TINY, kv_cache_memory_bytes=None)
    (f,) = pc.check_cpu_kv_explicit(0, s.models[0])
    assert f.path == "models[0].kv_cache_memory_bytes"
    s = parse_spec(TINY)
    assert pc.check_cpu_kv_explicit(0, s.models[0]) == []
    assert pc.cpu_kv_budget(s.models[0], GIB) == pc.KvBudget(GIB + 67108864 + pc.CPU_OVERHEAD_BYTES, 67108864)


def test_check_host_memory_refuses_the_instance_that_tips_it_over() -> None:
    d = copy.deepcopy(TINY)
    d["hosts"][0]["memory_gib"] = 8
    second = {**d["models"][0], "name": "tiny-2", "port": 8102, "kv_cache_memory_bytes": 3 * GIB}
    d["models"].append(second)
    s = parse_spec(d)
    on_host = placed(s, "h1")
    weights = {"tiny": GIB, "tiny-2": GIB}
    assert pc.check_host_memory(s, s.hosts[0], 0, s.models[0], on_host, weights) == []
    (f,) = pc.check_host_memory(s, s.hosts[0], 1, s.models[1], on_host, weights)
    assert f.path == "models[1].kv_cache_memory_bytes" and "host has 8 GiB" in f.message
    # weights not known (not yet planned) count nothing: 2 × 2 GiB overhead + KV fit
    assert pc.check_host_memory(s, s.hosts[0], 1, s.models[1], on_host, {}) == []


def test_kv_capacity_and_its_check() -> None:
    cap = pc.kv_capacity(100 * 147456 * 1024, 147456, 32768)
    assert cap == pc.KvCapacity(102400, 3, pc.suggest_max_num_seqs(102400, 32768))
    s = spec(SEED4, max_num_seqs=4096)
    (f,) = pc.check_kv_capacity(0, s.models[0], 32768, cap)
    assert (f.path, f.severity) == ("models[0].max_num_seqs", "note")
    small = pc.kv_capacity(1000 * 147456, 147456, 32768)
    s = parse_spec(SEED4)
    assert paths(pc.check_kv_capacity(0, s.models[0], 32768, small)) == ["models[0].max_model_len"]
    assert pc.check_kv_capacity(0, s.models[0], 32768, cap) == []


def test_plan_memory_stops_at_the_first_refusing_step() -> None:
    s = parse_spec(SEED4)
    m, host = s.models[1], s.hosts[0]

    def run(s: FleetSpec, **kw: Any) -> pc.MemoryPlan:
        m = s.models[1]
        args = {"on_host": placed(s, "gpu-a"), "cpu_weights": {}, "search_dirs": [], "fit_after_fetch": False}
        return pc.plan_memory(s, 1, m, facts_for(m, []), s.hosts[0], **{**args, **kw})

    ok = run(s)
    assert ok.findings == [] and ok.size and ok.budget and ok.capacity
    assert ok.capacity.tokens == ok.budget.kv_cache_bytes // 147456
    d = copy.deepcopy(SEED4)
    d["models"][1]["shape"]["params_b"] = 200
    big = run(parse_spec(d))
    assert paths(big.findings) == ["models[1].gpus"] and big.budget and big.capacity is None
    d["models"][1]["shape"] = {}
    unknown = run(parse_spec(d))
    assert paths(unknown.findings) == ["models[1].shape"] and unknown.size is None
    assert (m, host) == (s.models[1], s.hosts[0])  # nothing was changed in place


# --------------------------------------------------------------------------- fleet-wide


def test_plan_stacks_checks_locks(tmp_path: Path) -> None:
    s = parse_spec(SEED4)
    t = pc.plan_stacks(s, tmp_path)
    assert paths(t.findings) == ["stack.vllm_version"]
    assert t.stacks == {
        "default": {"profile": "gpu", "vllm_version": "0.33.0", "instances": ["r1-distill-7b", "qwen3-8b"]}
    }
    assert pc.plan_stacks(s, REPO / "locks").findings == []
    d = copy.deepcopy(SEED4)
    d["stacks"] = {"spare": {"profile": "cpu", "vllm_version": "0.32.0"}}
    assert paths(pc.plan_stacks(parse_spec(d), None).findings, "warning") == ["stacks.spare"]


def test_load_flag_tables() -> None:
    d = copy.deepcopy(SEED4)
    d["stack"]["vllm_version"] = "0.31.0"  # nothing captured for it
    d["models"][0]["extra_args"] = ["--seed", "1"]
    s = parse_spec(d)
    t = pc.load_flag_tables(s, pc.plan_stacks(s, None).stacks, allow_unchecked=True)
    assert t.known == {"default": None} and paths(t.findings, "warning") == ["stack"]
    assert pc.load_flag_tables(s, pc.plan_stacks(s, None).stacks, allow_unchecked=False).findings == []


def test_check_primaries_and_gateway_auth_and_alerts() -> None:
    s = spec(SEED4, role="backup")
    assert paths(pc.check_primaries(s)) == ["models[0].role"]
    s = parse_spec(SEED4)
    assert pc.check_primaries(s) == [] and pc.check_gateway_auth(s) == [] and pc.check_alerts(s) == []
    d = copy.deepcopy(SEED4)
    d["gateway"]["auth"] = "none"
    d["alerts"]["ttft_p99_slo_seconds"] = 2.0
    s = parse_spec(d)
    assert paths(pc.check_gateway_auth(s), "warning") == ["gateway.auth"]
    assert paths(pc.check_alerts(s)) == ["alerts.ttft_p99_slo_seconds"] * 2
