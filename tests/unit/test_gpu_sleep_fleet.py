"""tools/gpu-validate/sleep_fleet.py's pure parts and its spec (issue 33): the device spec moved to another root and
address (the engines listen on the GPU host's address behind the sleep guard, in swap group gpu0, and the plan
passes), the verdict of one swap (every request a complete 200, held at the guard, the peer asleep at its level
with one more sleep, the target awake with one more wake), the exporter's sleep series against the state files
(from the real exporter), the development endpoints' verdict, GPU memory per instance; and tinymodel's real random
weights (the names and shapes of Hugging Face's Qwen3, sharded, and their parameter count)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from vllm_fleet.devtools.testing import load_tool
from vllm_fleet.devtools.testing import strings_in as strings
from vllm_fleet.devtools.tinymodel import (
    qwen3_8b_config,
    qwen3_weight_shapes,
    weight_shards,
    write_random_weights,
)
from vllm_fleet.fleet.plan import make_plan
from vllm_fleet.fleet.render import render_fleet
from vllm_fleet.fleet.spec import parse_spec

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def sf() -> ModuleType:
    return load_tool(REPO / "tools" / "gpu-validate" / "sleep_fleet.py", "gpu_sleep_fleet")


# ---- the spec


def test_the_spec_moves_to_the_root_and_address_and_its_engines_sleep_in_one_swap_group(
    sf: ModuleType, tmp_path: Path
) -> None:
    root = tmp_path / "vf"
    lay = sf.Layout(root, local=True, address="192.0.2.7", ports={sf.A: 18002, sf.B: 18003}, gw_port=18000,
                    stub_port=18081, admission_metrics_port=19402)  # fmt: skip
    base = yaml.safe_load(sf.SPEC.read_text())
    d = sf.spec_data(base, lay)
    assert not [s for s in strings(d) if s.startswith("/root/vf")]
    assert base["hosts"][0]["address"] == "10.0.0.2" and base["models"][0]["port"] == 8002  # a copy changed
    assert sf.sleep_levels(d) == {sf.A: 1, sf.B: 2}
    assert d["swap_groups"] == {sf.GROUP: {"max_awake": 1}}
    # A on dummy weights, B on the folder of real weights (a level-2 wake reloads from disk)
    a, b = d["models"]
    assert "--load-format" in a["extra_args"] and "extra_args" not in b
    assert (a["source"]["path"], b["source"]["path"]) == (str(lay.model_a), str(lay.model_b))
    plan = make_plan(parse_spec(d, "sleep"), allow_unchecked_flags=True)
    assert plan.ok, plan.to_dict() if hasattr(plan, "to_dict") else plan
    render_fleet(parse_spec(d, "sleep"), lay.render_dir)
    cfgs = {
        n: json.loads(lay.rendered(sf.GPU_HOST, lay.etc / "instances" / f"{n}.json").read_text())
        for n in (sf.A, sf.B)
    }
    for n, port in ((sf.A, 18002), (sf.B, 18003)):
        cmd = cfgs[n]["command"]
        # the engines listen on the GPU host's address (the gateway is a host of its own), behind the guard
        assert cmd[cmd.index("--host") + 1] == "192.0.2.7" and cmd[cmd.index("--port") + 1] == str(port)
        assert "--enable-sleep-mode" in cmd and "vllm_fleet.host.sleep_guard.SleepGuard" in cmd
        assert cfgs[n]["environment"]["VLLM_SERVER_DEV_MODE"] == "1"
        sleep = cfgs[n]["sleep"]
        assert (sleep["group"], sleep["max_awake"], sleep["level"], sleep["wake_wait_seconds"]) == (
            sf.GROUP, 1, sf.sleep_levels(d)[n], 90.0,
        )  # fmt: skip
        assert sleep["group_members"] == [sf.B if n == sf.A else sf.A]
    # the gateway host's render: nginx to the engines' address, the admission service's config
    gw = lay.render_dir / sf.GW_HOST
    ups = (gw / "etc/nginx/vllm-fleet/upstreams.conf").read_text()
    assert "server 192.0.2.7:18002" in ups and "server 192.0.2.7:18003" in ups
    assert next(gw.glob("**/etc/gateway/admission.json"))


def test_the_counters_after_n_cycles(sf: ModuleType) -> None:
    # A slept for B's load, then once per cycle; each woke once per cycle
    assert sf.expected_counters(3) == {
        sf.A: {"sleeps_total": 4, "wakes_total": 3},
        sf.B: {"sleeps_total": 3, "wakes_total": 3},
    }


# ---- one swap


def rec(
    status: int = 200, kind: str = "complete", stream: bool = True, first: float | None = 101.5
) -> dict[str, Any]:
    r: dict[str, Any] = {"status": status, "kind": kind, "stream": stream, "seconds": 2.0, "model_ok": True}
    if first is not None:
        r["first_byte_at"] = first
        if stream and kind == "complete":
            r["ttft"] = first - 100.0
    return r


def a_swap(sf: ModuleType, records: list[dict[str, Any]], **over: Any) -> dict[str, Any]:
    """A swap to A (asleep at level 1 before) while B (awake) yields at level 2."""
    s = {
        "batch": sf.batch_summary(records, 100.0),
        "guards": {sf.A: {"max_held": 4, "states": ["asleep", "waking", "awake"]}, sf.B: {"max_held": 0}},
        "state_before": {
            sf.A: {"sleep_state": "asleep", "sleep_level": 1, "sleeps_total": 1, "wakes_total": 0},
            sf.B: {"sleep_state": "awake", "sleep_level": 2, "sleeps_total": 0, "wakes_total": 0},
        },
        "state_after": {
            sf.A: {"sleep_state": "awake", "sleep_level": 1, "sleeps_total": 1, "wakes_total": 1, "last_wake_seconds": 0.7},
            sf.B: {"sleep_state": "asleep", "sleep_level": 2, "sleeps_total": 1, "wakes_total": 0},
        },
        "status": {
            sf.A: ["Asleep: waiting for a slot of swap group gpu0 to wake", "Waking (level 1)", "Serving qwen3-8b-a"],
            sf.B: ["Going to sleep (level 2): a peer of swap group gpu0 needs the room", "Asleep (level 2), 0 wake(s)"],
        },
    }  # fmt: skip
    for path, value in over.items():
        *keys, last = path.split(".")
        d = s
        for k in keys:
            d = d[k]
        d[last] = value
    return s


def verdict(sf: ModuleType, s: dict[str, Any]) -> dict[str, bool]:
    return {k: ok for k, (ok, _) in sf.swap_verdict(s, sf.A, sf.B, {sf.A: 1, sf.B: 2}).items()}


def test_a_swap_passes_when_held_requests_all_complete_after_the_peer_yielded_and_the_target_woke(
    sf: ModuleType,
) -> None:
    records = [
        rec(first=101.5),
        rec(stream=False, first=101.9),
        rec(first=101.2),
        rec(stream=False, first=102.0),
    ]
    b = sf.batch_summary(records, 100.0)
    assert (b["requests"], b["streams"], b["by_status"], b["by_kind"]) == (4, 2, {"200": 4}, {"complete": 4})
    # the first answer: the first byte of any answer after the batch was sent (the swap included)
    assert b["first_answer_s"] == 1.2 and b["ttft_s"]["min"] == pytest.approx(1.2)
    assert all(verdict(sf, a_swap(sf, records)).values())


@pytest.mark.parametrize(
    ("change", "failing"),
    [
        ({"guards.qwen3-8b-a.max_held": 0}, "held_at_the_guard"),
        # the peer still awake, asleep at the wrong level, no new sleep, or no yield STATUS
        ({"state_after.qwen3-8b-b.sleep_state": "awake"}, "peer_yielded_asleep_at_its_level"),
        ({"state_after.qwen3-8b-b.sleep_level": 1}, "peer_yielded_asleep_at_its_level"),
        ({"state_after.qwen3-8b-b.sleeps_total": 0}, "peer_yielded_asleep_at_its_level"),
        ({"status.qwen3-8b-b": ["Asleep (level 2), 0 wake(s)"]}, "peer_yielded_asleep_at_its_level"),
        # the target was not asleep before, is not awake, woke twice, or without its Waking STATUS
        ({"state_before.qwen3-8b-a.sleep_state": "awake"}, "target_woke_once"),
        ({"state_after.qwen3-8b-a.sleep_state": "waking"}, "target_woke_once"),
        ({"state_after.qwen3-8b-a.wakes_total": 2}, "target_woke_once"),
        ({"state_after.qwen3-8b-a.last_wake_seconds": None}, "target_woke_once"),
        ({"status.qwen3-8b-a": ["Serving qwen3-8b-a"]}, "target_woke_once"),
    ],
)
def test_a_swap_fails_on_what_it_must_show(sf: ModuleType, change: dict[str, Any], failing: str) -> None:
    v = verdict(sf, a_swap(sf, [rec(), rec(stream=False)], **change))
    assert [k for k, ok in v.items() if not ok] == [failing]


@pytest.mark.parametrize(
    "bad",
    [
        rec(status=503, kind="refused"),  # the wake did not come within the guard's wait
        rec(kind="error_200"),  # an error carried by a 200 stream
        rec(kind="dropped", first=None),  # no answer at all
        {**rec(), "model_ok": False},  # another model answered
    ],
)
def test_a_swap_with_one_failed_request_fails(sf: ModuleType, bad: dict[str, Any]) -> None:
    v = verdict(sf, a_swap(sf, [rec(), rec(stream=False), bad]))
    assert [k for k, ok in v.items() if not ok] == ["every_request_complete_200"]
    assert [k for k, ok in verdict(sf, a_swap(sf, [])).items() if not ok] == ["every_request_complete_200"]


def test_the_wake_alone_and_the_peer_s_sleep_from_the_status_lines(sf: ModuleType) -> None:
    msgs = [
        (9.0, {"STATUS": "Waking (level 1)"}),  # an earlier swap
        (9.5, {"STATUS": "Serving qwen3-8b-a"}),
        (10.0, {"STATUS": "Asleep: waiting for a slot of swap group gpu0 to wake"}),
        (10.2, {"WATCHDOG": "1"}),
        (11.0, {"STATUS": "Waking (level 1)"}),
        (11.6, {"STATUS": "Serving qwen3-8b-a on 10.0.0.2:8002"}),
    ]
    assert sf.transition_s(msgs, 10.0, "Waking", "Serving") == 0.6
    assert sf.transition_s(msgs, 0.0, "Waking", "Serving") == 0.5
    assert sf.transition_s(msgs[:5], 10.0, "Waking", "Serving") is None  # not awake yet
    peer = [(10.1, {"STATUS": "Going to sleep (level 1): a peer of swap group gpu0 needs the room"}),
            (19.8, {"STATUS": "Asleep (level 1), 0 wake(s) so far; a request wakes it"})]  # fmt: skip
    assert sf.transition_s(peer, 10.0, "Going to sleep", "Asleep") == 9.7


def test_local_level_2_weights_dropped_asleep_and_back_awake(sf: ModuleType) -> None:
    levels = {sf.A: 1, sf.B: 2}

    def swap(cycle: int, target: str, b_state: str, b_weights: bool) -> dict[str, Any]:
        return {"cycle": cycle, "target": target, "state_after": {sf.B: {"sleep_state": b_state}, sf.A: {}},
                "sim": {sf.A: {"weights_loaded": True}, sf.B: {"weights_loaded": b_weights}}}  # fmt: skip

    good = [swap(1, sf.A, "asleep", False), swap(1, sf.B, "awake", True)]
    ok, detail = sf.sim_weights_verdict(good, levels)
    assert ok and len(detail["seen"]) == 2  # only the level-2 instance is read
    # awake without its weights (the wake skipped reload_weights), asleep with them (level 1's behaviour)
    assert not sf.sim_weights_verdict([good[0], swap(1, sf.B, "awake", False)], levels)[0]
    assert not sf.sim_weights_verdict([swap(1, sf.A, "asleep", True), good[1]], levels)[0]
    assert not sf.sim_weights_verdict(good[1:], levels)[0]  # never seen asleep: nothing shown
    assert not sf.sim_weights_verdict([], levels)[0]


# ---- the exporter's series against the state files (the real exporter)


def exposition(tmp_path: Path, states: dict[str, dict[str, Any]]) -> str:
    from prometheus_client import CollectorRegistry, generate_latest

    from vllm_fleet.host.exporter import FleetCollector

    base = {"port": 8002, "state": "ready", "launcher_pid": 12, "engine_pid": 34, "started_at": 1.0, "ready_at": 2.0,
            "phase": "serving", "probes_total": 3, "probe_failures_total": 0, "updated_at": 3.0}  # fmt: skip
    for n, st in states.items():
        (tmp_path / f"{n}.json").write_text(json.dumps({**base, "instance": n, "served_model_name": n, **st}))
    reg = CollectorRegistry()
    reg.register(FleetCollector(tmp_path, None, use_systemd=False))
    return str(generate_latest(reg).decode())


def test_the_exporter_s_sleep_series_match_the_state_files(sf: ModuleType, tmp_path: Path) -> None:
    states = {
        sf.A: {"sleep_state": "asleep", "sleep_level": 1, "swap_group": "gpu0", "sleeps_total": 4, "wakes_total": 3,
               "failed_wakes_total": 0, "wake_seconds_total": 12.5, "asleep_seconds_total": 30.0},
        sf.B: {"sleep_state": "awake", "sleep_level": 2, "swap_group": "gpu0", "sleeps_total": 3, "wakes_total": 3,
               "failed_wakes_total": 0, "wake_seconds_total": 40.25, "asleep_seconds_total": 20.0},
    }  # fmt: skip
    text = exposition(tmp_path, states)
    got = sf.prom_series(text, "vllm_fleet_instance_wakes_total")
    assert sorted((lb["instance"], v) for lb, v in got) == [(sf.A, 3.0), (sf.B, 3.0)]
    assert not sf.prom_series(text, "vllm_fleet_instance_wake")  # a name's prefix is not the name
    v = sf.exporter_verdict(text, states)
    assert all(ok for ok, _ in v.values()), v
    # a state file that says otherwise than the scrape: each check catches its own
    for key, value, failing in (
        ("sleep_state", "awake", "exporter_sleep_state_matches"),
        ("wakes_total", 4, "exporter_wakes_total_matches"),
        ("wake_seconds_total", 13.0, "exporter_wake_duration_matches"),
    ):
        other = {**states, sf.A: {**states[sf.A], key: value}}
        assert [k for k, (ok, _) in sf.exporter_verdict(text, other).items() if not ok] == [failing]
    # an exporter without the sleep series (before sleep-obs): every check fails
    assert not any(ok for ok, _ in sf.exporter_verdict("", states).values())


# ---- the development endpoints, GPU memory


def test_the_endpoints_verdict(sf: ModuleType) -> None:
    good = [
        {"via": "engine", "status": 404, "body": {"detail": "Not Found"}},
        {"via": "gateway", "status": 404, "body": {"error": {"message": "not found", "code": "not_found"}}},
    ]
    assert all(ok for ok, _ in sf.endpoint_verdict(good).values())
    # vLLM's answer (the guard let it through), another 404 body at the engine, a gateway 404 in HTML
    engine, gateway = (
        "dev_endpoints_404_at_the_engines_without_the_token",
        "dev_endpoints_404_json_through_the_gateway",
    )
    for bad, failing in (
        ({"via": "engine", "status": 200, "body": {"is_sleeping": False}}, engine),
        ({"via": "engine", "status": 404, "body": "<html>"}, engine),
        ({"via": "gateway", "status": 404, "body": "<html>404</html>"}, gateway),
        ({"via": "gateway", "status": 200, "body": {}}, gateway),
    ):
        assert [k for k, (ok, _) in sf.endpoint_verdict([*good, bad]).items() if not ok] == [failing]
    assert not any(ok for ok, _ in sf.endpoint_verdict([]).values())


def test_gpu_memory_per_instance_and_the_asleep_reserve(sf: ModuleType) -> None:
    apps = [
        "5001, VLLM::EngineCore, 2688 MiB",
        "6001, VLLM::EngineCore, 122400 MiB",
        "7001, python3, 100 MiB",
    ]
    smi = {"gpu": "125212 MiB, 143771 MiB", "apps": apps}
    sids = {5001: 500, 6001: 600, 7001: 700}
    pt = sf.memory_point(smi, sids.get, {sf.A: 500, sf.B: 600})
    assert pt == {"used_mib": 125212, "total_mib": 143771,
                  "by_instance_mib": {sf.A: 2688, sf.B: 122400, "pid 7001": 100}}  # fmt: skip
    assert sf.memory_point({"skipped": "no nvidia-smi (local)"}, sids.get, {}) == {
        "skipped": "no nvidia-smi (local)"
    }
    points = {"a_asleep_b_awake": {**pt, "sleep_state": {sf.A: "asleep", sf.B: "awake"}}}
    ok, detail = sf.asleep_within_reserve(points)
    assert ok and detail["asleep"] == [("a_asleep_b_awake", sf.A, 2688)]
    points["x"] = {"by_instance_mib": {sf.B: 3500}, "sleep_state": {sf.B: "asleep"}}  # over the plan's 3 GiB
    assert sf.asleep_within_reserve(points)[0] is False
    assert sf.asleep_within_reserve({})[0] is False  # nothing asleep was seen: nothing shown


# ---- tinymodel's real random weights


def test_the_qwen3_8b_shape_s_tensors_count_make_model_s_parameters() -> None:
    mm = load_tool(REPO / "tools" / "gpu-validate" / "make_model.py", "gpu_make_model")
    cfg = qwen3_8b_config()
    shapes = qwen3_weight_shapes(cfg)
    assert sum(math.prod(s) for s in shapes.values()) == mm.params(cfg) == 8_190_735_360
    assert shapes["lm_head.weight"] == (151936, 4096) and shapes["model.layers.35.mlp.down_proj.weight"] == (
        4096,
        12288,
    )
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (1024, 4096)
    assert shapes["model.layers.0.self_attn.q_norm.weight"] == (128,)
    # 16.4 GB in shards of at most 4 GiB: four, in order
    shards = weight_shards(shapes, 4 << 30)
    assert len(shards) == 4 and [n for s in shards for n in s] == list(shapes)
    assert all(sum(2 * math.prod(shapes[n]) for n in s) <= 4 << 30 for s in shards)
    assert weight_shards({"a": (10,), "b": (10,), "c": (30,)}, 40) == [["a", "b"], ["c"]]
    assert weight_shards({"a": (30,)}, 40) == [["a"]]  # one tensor larger than a shard: alone


TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 256, "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000, "attention_bias": False}  # fmt: skip


@pytest.mark.parametrize("tied", [False, True])
def test_random_weights_have_the_names_and_shapes_of_hugging_face_s_qwen3(tmp_path: Path, tied: bool) -> None:
    import torch
    from safetensors.torch import load_file
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = {**TINY, "tie_word_embeddings": tied}
    hf = Qwen3ForCausalLM(Qwen3Config(**cfg))
    want = {k: tuple(v.shape) for k, v in hf.state_dict().items() if not (tied and k == "lm_head.weight")}
    assert qwen3_weight_shapes(cfg) == want
    got = write_random_weights(cfg, tmp_path, seed=3, max_shard_bytes=60_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert got["files"] == len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert set(index["weight_map"].values()) == set(files) and set(index["weight_map"]) == set(want)
    tensors = {k: v for f in files for k, v in load_file(str(tmp_path / f)).items()}
    assert {k: tuple(v.shape) for k, v in tensors.items()} == want
    assert index["metadata"]["total_size"] == got["bytes"] == sum(2 * math.prod(s) for s in want.values())
    assert all(v.dtype == torch.bfloat16 for v in tensors.values())
    assert torch.equal(tensors["model.norm.weight"], torch.ones(64, dtype=torch.bfloat16))
    emb = tensors["model.embed_tokens.weight"].float()
    assert 0.015 < emb.std().item() < 0.025 and abs(emb.mean().item()) < 0.002
    # what transformers loads from the folder: the same tensors (a config.json beside them)
    (tmp_path / "config.json").write_text(
        json.dumps({**cfg, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"})
    )
    loaded = Qwen3ForCausalLM.from_pretrained(str(tmp_path), torch_dtype=torch.bfloat16)
    q = "model.layers.1.self_attn.q_proj.weight"
    assert torch.equal(loaded.state_dict()[q], tensors[q])
    # the same seed draws the same weights
    again = tmp_path / "again"
    write_random_weights(cfg, again, seed=3, max_shard_bytes=60_000)
    assert torch.equal(
        load_file(str(again / files[0]))["model.embed_tokens.weight"], tensors["model.embed_tokens.weight"]
    )
