"""tools/gpu-validate/sleep_scale.py's pure parts (issue 33 at fleet scale): the fleet's shape (models spread over
the swap groups, the level-2 group, replicas) and its spec (the plan passes with the utilization it computes and
refuses a hundredth more), the skewed picker, the percentiles, a request's class, the invariant from the sampler's
samples (slot holders and members awake or waking per group), held vs awake, the wakes' seconds from the state
files, a launcher's sleeps by reason, and the exporter's counters against the state files (the real exporter)."""

from __future__ import annotations

import itertools
import json
import os
from collections import Counter
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from vllm_fleet.devtools.testing import load_tool
from vllm_fleet.devtools.testing import strings_in as strings
from vllm_fleet.fleet.plan import make_plan
from vllm_fleet.fleet.render import render_fleet
from vllm_fleet.fleet.spec import parse_spec

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ss() -> ModuleType:
    return load_tool(REPO / "tools" / "gpu-validate" / "sleep_scale.py", "gpu_sleep_scale")


def lab(ss: ModuleType, tmp_path: Path, ms: list[Any]) -> Any:
    return ss.Layout(tmp_path / "vf", local=True, address="192.0.2.7",
                     ports={m.name: 20000 + i for i, m in enumerate(ms)}, gw_port=18000, stub_port=18081,
                     admission_metrics_port=19402)  # fmt: skip


# ---- the fleet's shape and its spec


def test_models_spread_over_the_groups_the_last_at_level_2_replicas_in_the_next(ss: ModuleType) -> None:
    ms = ss.members(12, 3)
    assert [m.name for m in ms] == [f"m{i:02d}" for i in range(12)]
    assert [m.group for m in ms[:4]] == ["gpu0", "gpu1", "gpu2", "gpu0"]  # the hottest three in three groups
    assert {m.group: m.level for m in ms} == {"gpu0": 1, "gpu1": 1, "gpu2": 2}
    assert {g: len(v) for g, v in ss.group_members(ms).items()} == {"gpu0": 4, "gpu1": 4, "gpu2": 4}
    assert {m.level for m in ss.members(4, 2, level2_groups=0)} == {1}
    rep = ss.members(6, 3, replicas=2)
    assert [(m.name, m.served, m.group) for m in rep[6:]] == [
        ("m00-b", "m00", "gpu1"),
        ("m01-b", "m01", "gpu2"),
    ]


def test_the_utilization_is_the_most_the_plan_allows(ss: ModuleType) -> None:
    assert ss.utilization(4, 2, 140.4) == 0.47  # 2u + 2 x 3 GiB / 140.4 GiB <= 1
    assert ss.utilization(2, 2, 140.4) == 0.5
    assert ss.utilization(1, 1, 140.4) == ss.MAX_UTILIZATION


def test_the_spec_moves_to_the_lab_and_plans_and_renders_every_member_in_its_group(
    ss: ModuleType, tmp_path: Path
) -> None:
    ms = ss.members(12, 3)
    lay = lab(ss, tmp_path, ms)
    base = yaml.safe_load(ss.SPEC.read_text())
    d = ss.spec_data(base, lay, ms, 2, 8)
    assert not [s for s in strings(d) if s.startswith("/root/vf")]
    assert len(base["models"]) == 2  # the base is not changed
    gpu_host = next(h for h in d["hosts"] if h["name"] == ss.GPU_HOST)
    assert gpu_host["gpus"]["count"] == 3 and gpu_host["address"] == "192.0.2.7"
    assert d["swap_groups"] == {f"gpu{g}": {"max_awake": 2} for g in range(3)}
    by = {m["name"]: m for m in d["models"]}
    assert by["m02"]["sleep"] == {"level": 2, "idle_seconds": ss.LEAST_IDLE_S, "group": "gpu2"}
    assert "extra_args" not in by["m02"] and "--load-format" in by["m00"]["extra_args"]
    assert by["m05"]["gpus"] == [2] and by["m05"]["port"] == 20005 and by["m05"]["max_num_seqs"] == 8
    plan = make_plan(parse_spec(d, "scale"), allow_unchecked_flags=True)
    assert plan.ok
    out = tmp_path / "render"
    render_fleet(parse_spec(d, "scale"), out)
    cfg = json.loads((out / ss.GPU_HOST / str(lay.etc).lstrip("/") / "instances" / "m03.json").read_text())
    assert cfg["sleep"]["group"] == "gpu0" and cfg["sleep"]["group_members"] == ["m00", "m06", "m09"]
    assert "--enable-sleep-mode" in cfg["command"]
    # a hundredth more per model and the plan refuses the group: the utilization was the most it allows
    for m in d["models"]:
        m["gpu_memory_utilization"] = round(m["gpu_memory_utilization"] + 0.01, 2)
    assert not make_plan(parse_spec(d, "scale"), allow_unchecked_flags=True).ok


def test_the_device_mode_is_one_gpu_at_level_1_and_its_spec_keeps_the_hosts_memory(
    ss: ModuleType, tmp_path: Path
) -> None:
    a = ss.parse([str(tmp_path / "out")])
    assert (a.models, a.groups, a.max_awake, a.level2_groups) == (4, 1, 2, 0)
    assert ss.parse([str(tmp_path / "out"), "--local"]).models == 12  # --local keeps its own defaults
    with pytest.raises(SystemExit):  # dummy weights: vLLM reloads none after a level-2 sleep
        ss.parse([str(tmp_path / "out"), "--level2-groups", "1"])
    ms = ss.members(a.models, a.groups, a.replicas, a.level2_groups)
    lay = ss.Layout(tmp_path / "vf", local=False, address="192.0.2.7",
                    ports={m.name: 20000 + i for i, m in enumerate(ms)})  # fmt: skip
    base = yaml.safe_load(ss.SPEC.read_text())
    d = ss.spec_data(base, lay, ms, a.max_awake, a.max_num_seqs)
    host = next(h for h in d["hosts"] if h["name"] == ss.GPU_HOST)
    assert host["memory_gib"] == 128 and host["gpus"]["count"] == 1  # the device's, not the sim's 1 TiB
    assert {m["gpu_memory_utilization"] for m in d["models"]} == {0.47}
    assert all(m["sleep"]["level"] == 1 and "--load-format" in m["extra_args"] for m in d["models"])
    assert make_plan(parse_spec(d, "scale"), allow_unchecked_flags=True).ok
    assert ss.device_gpu("NVIDIA H100 80GB HBM3, 81559\n") == {
        "model": "NVIDIA H100 80GB HBM3",
        "memory_gib": 79.6,
    }
    assert ss.device_gpu("NVIDIA H200, 143771\n")["memory_gib"] == 140.4
    # the plan's host-memory rule is the device's: sleepers' level-1 weights beyond its 128 GiB are refused
    host["memory_gib"] = 16
    assert not make_plan(parse_spec(d, "scale"), allow_unchecked_flags=True).ok


# ---- the skew


def test_zipf_weights_fall_with_the_rank_and_sum_to_one(ss: ModuleType) -> None:
    w = ss.zipf_weights(12, 1.1)
    assert abs(sum(w) - 1) < 1e-9 and all(a > b for a, b in itertools.pairwise(w))
    assert abs(w[0] / w[1] - 2**1.1) < 1e-9
    assert ss.zipf_weights(3, 0) == pytest.approx([1 / 3] * 3)


def test_the_picker_is_skewed_as_asked_and_seeded(ss: ModuleType) -> None:
    p = ss.Picker(12, 1.1, seed=1)
    draws = [p.pick(lane, k) for lane in range(16) for k in range(600)]
    freq = Counter(draws)
    w = ss.zipf_weights(12, 1.1)
    for r in range(12):
        assert abs(freq[r] / len(draws) - w[r]) < 0.015, (r, freq[r] / len(draws), w[r])
    assert freq[0] > 3 * freq[5] > 0 and set(freq) == set(range(12))
    # the same seed, the same picks whatever the order they are asked in; another seed, others
    again = ss.Picker(12, 1.1, seed=1)
    assert [again.pick(lane, k) for lane in reversed(range(16)) for k in range(600)] != draws
    assert sorted(again.pick(lane, k) for lane in reversed(range(16)) for k in range(600)) == sorted(draws)
    assert [again.pick(3, k) for k in range(50)] == [p.pick(3, k) for k in range(50)]
    assert [ss.Picker(12, 1.1, seed=2).pick(3, k) for k in range(50)] != [p.pick(3, k) for k in range(50)]


# ---- percentiles, requests


def test_spread_is_the_nearest_rank_p50_p95_and_the_max(ss: ModuleType) -> None:
    xs = [float(x) for x in range(100, 0, -1)]  # 1..100, unsorted
    assert ss.spread(xs) == {"n": 100, "p50": 51.0, "p95": 96.0, "max": 100.0}
    assert ss.spread([0.25]) == {"n": 1, "p50": 0.25, "p95": 0.25, "max": 0.25}
    assert ss.spread([]) == {"n": 0, "p50": None, "p95": None, "max": None}


def rec(**kw: Any) -> dict[str, Any]:
    return {"model": "m00", "stream": True, "status": 200, "kind": "complete", "model_ok": True, **kw}


def test_a_request_is_ok_refused_with_retry_after_or_failed(ss: ModuleType) -> None:
    refused = rec(status=503, kind="refused", retry_after="5", json_error=True, code="x", reason="wake")
    cases = {
        "ok": [rec(), rec(stream=False)],
        "refused": [refused, dict(refused, status=429)],
        "failed": [
            rec(model_ok=False),  # another model's answer
            rec(kind="error_200", detail="boom"),  # a 200 carrying an error
            rec(kind="dropped", detail="stream ended without data: [DONE]"),  # a cut stream
            dict(refused, retry_after=None),  # a 503 without Retry-After
            dict(refused, json_error=False),  # nginx's HTML 503
            rec(status=502, kind="other_status"),
            rec(status=None, kind="dropped", detail="connect"),
        ],
    }
    for want, rs in cases.items():
        assert [ss.request_class(r) for r in rs] == [want] * len(rs)
    v = ss.request_verdict([r for rs in cases.values() for r in rs], cut=0)
    assert (v["requests"], v["ok"], v["refused_with_retry_after"], v["failed"]) == (11, 2, 2, 7)
    assert v["by_status"]["200"] == 5 and len(v["failed_examples"]) == 7


# ---- the samples: the invariant, held or awake, the wakes


def sample(t: float, states: dict[str, str], holders: dict[str, list[str]], **extra: Any) -> Any:
    return (t, {n: {"sleep_state": s, **extra.get(n, {})} for n, s in states.items()}, holders)


GROUPS = {"g": ["a", "b", "c"]}


def test_no_group_above_max_awake_from_the_samples(ss: ModuleType) -> None:
    ok = [
        sample(0.0, {"a": "awake", "b": "awake", "c": "asleep"}, {"g": ["a", "b"]}),
        sample(0.05, {"a": "sleeping", "b": "awake", "c": "asleep"}, {"g": ["a", "b"]}),
        sample(0.1, {"a": "asleep", "b": "awake", "c": "waking"}, {"g": ["b", "c"]}),
    ]
    p = ss.group_peaks(ok, GROUPS, 2)["g"]
    assert (p["max_slot_holders"], p["max_awake_or_waking"], p["over_samples"]) == (2, 2, 0)
    assert p["awake_without_slot_samples"] == 0
    three_awake = sample(0.15, {"a": "awake", "b": "awake", "c": "waking"}, {"g": ["b", "c"]})
    p = ss.group_peaks([*ok, three_awake], GROUPS, 2)["g"]
    assert p["over_samples"] == 1 and p["over"][0]["awake_or_waking"] == ["a", "b", "c"]
    assert p["awake_without_slot_samples"] == 1  # a: awake without a slot
    three_slots = sample(0.2, {"a": "asleep", "b": "awake", "c": "awake"}, {"g": ["a", "b", "c"]})
    p = ss.group_peaks([*ok, three_slots], GROUPS, 2)["g"]
    assert (p["max_slot_holders"], p["over_samples"]) == (3, 1)
    assert ss.group_peaks(ok, GROUPS, 1)["g"]["over_samples"] == 3


def test_held_when_no_instance_of_the_model_stayed_awake(ss: ModuleType) -> None:
    samples = [
        sample(0.0, {"a": "awake", "b": "asleep"}, {}),
        sample(1.0, {"a": "sleeping", "b": "asleep"}, {}),
        sample(1.5, {"a": "asleep", "b": "waking"}, {}),
        sample(2.0, {"a": "waking", "b": "awake"}, {}),
        sample(3.0, {"a": "awake", "b": "awake"}, {}),
    ]
    lines = ss.timelines(samples)
    assert lines["a"] == [(0.0, "awake"), (1.0, "sleeping"), (1.5, "asleep"), (2.0, "waking"), (3.0, "awake")]
    assert not ss.was_held(lines, ["a"], 0.1, 0.5)  # awake all along
    assert ss.was_held(lines, ["a"], 0.5, 1.2)  # it went to sleep under the request: held
    assert ss.was_held(lines, ["a"], 1.6, 3.1)  # asleep at sending
    assert not ss.was_held(lines, ["a"], 3.2, 3.5)
    assert ss.was_held(lines, ["a"], -1.0, 0.5)  # before any sample: not known awake
    assert ss.was_held(lines, ["b"], 0.5, 1.0)
    assert not ss.was_held(lines, ["a", "b"], 2.1, 2.5)  # a replica stayed awake (b)
    assert ss.was_held(lines, ["a", "b"], 1.2, 1.8)


def test_each_wake_s_seconds_from_the_state_files(ss: ModuleType) -> None:
    def s(t: float, wakes: dict[str, tuple[int, float | None]]) -> Any:
        return sample(t, dict.fromkeys(wakes, "awake"), {},
                      **{n: {"wakes_total": w, "last_wake_seconds": x} for n, (w, x) in wakes.items()})  # fmt: skip

    samples = [s(0, {"a": (0, None), "b": (0, None)}), s(1, {"a": (1, 0.7), "b": (0, None)}),
               s(2, {"a": (1, 0.7), "b": (1, 3.1)}), s(3, {"a": (3, 0.9), "b": (1, 3.1)})]  # fmt: skip
    got, missed = ss.wake_durations(samples)
    assert got == {"a": [0.7, 0.9], "b": [3.1]} and missed == 1


def test_a_launcher_s_sleeps_by_reason(ss: ModuleType) -> None:
    statuses = [
        "Serving qwen",
        "Going to sleep (level 1): a peer of swap group gpu0 needs the room",
        "Asleep (level 1), 0 wake(s) so far; a request wakes it",
        "Waking (level 1)",
        "Serving qwen",
        "Going to sleep (level 1): idle for 10s",
        "Serving qwen",  # the guard's 409: a request slipped in
        "Going to sleep (level 1): idle for 11s",
        "Probe failing (1x): probe stuck",  # another line meanwhile: neither an end nor a refusal
        "Asleep (level 1), 1 wake(s) so far; a request wakes it",
    ]
    assert ss.sleep_reasons(statuses) == {"peer": 1, "idle": 1, "refused": 1}
    assert ss.sleep_reasons(statuses[:2]) == {"peer": 0, "idle": 0, "refused": 0}  # not asleep yet


# ---- the exporter against the state files


def test_the_exporter_s_counters_match_the_state_files(ss: ModuleType, tmp_path: Path) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from vllm_fleet.host.exporter import FleetCollector

    states = {
        "m00": {"sleep_state": "asleep", "sleep_level": 1, "swap_group": "gpu0", "sleeps_total": 5,
                "wakes_total": 4, "failed_wakes_total": 0, "wake_seconds_total": 3.0},
        "m01": {"sleep_state": "asleep", "sleep_level": 2, "swap_group": "gpu1", "sleeps_total": 2,
                "wakes_total": 1, "failed_wakes_total": 1, "wake_seconds_total": 1.0},
    }  # fmt: skip
    base = {"port": 8002, "state": "ready", "launcher_pid": 12, "engine_pid": 34, "started_at": 1.0,
            "ready_at": 2.0, "phase": "serving", "probes_total": 3, "probe_failures_total": 0,
            "updated_at": 3.0}  # fmt: skip
    for n, st in states.items():
        (tmp_path / f"{n}.json").write_text(json.dumps({**base, "instance": n, "served_model_name": n, **st}))
    reg = CollectorRegistry()
    reg.register(FleetCollector(tmp_path, None, use_systemd=False))
    text = generate_latest(reg).decode()
    ok, detail = ss.exporter_counts_verdict(text, states)
    assert ok, detail
    for key in ("sleeps_total", "wakes_total", "failed_wakes_total"):
        other = {**states, "m01": {**states["m01"], key: 7}}
        ok, detail = ss.exporter_counts_verdict(text, other)
        assert not ok and list(detail) == ["m01"]
    assert not ss.exporter_counts_verdict("", states)[0]
    assert not ss.exporter_counts_verdict(text, {})[0]


def test_slot_holders_from_the_kernel_s_lock_table(ss: ModuleType, tmp_path: Path) -> None:
    from vllm_fleet.host.swap_group import Slots

    a, b = Slots(tmp_path, "g", 2, "a"), Slots(tmp_path, "g", 2, "b")
    assert a.try_take() and b.try_take()
    b.release()
    writers = ss.flock_writers(Path("/proc/locks").read_text())
    files = sorted((tmp_path / "swap" / "g").glob("slot-*.lock"))
    assert [ss.file_key(f) in writers for f in files] == [True, False]
    assert writers[ss.file_key(files[0])] == os.getpid()
    a.release()
    assert ss.file_key(files[0]) not in ss.flock_writers(Path("/proc/locks").read_text())
    text = "1: FLOCK  ADVISORY  WRITE 41 fe:00:7 0 EOF\n1: -> FLOCK  ADVISORY  WRITE 42 fe:00:7 0 EOF\n" + (
        "2: FLOCK  ADVISORY  READ 43 fe:00:8 0 EOF\n3: POSIX  ADVISORY  WRITE 44 fe:00:9 0 EOF\n"
    )
    assert ss.flock_writers(text) == {"fe:00:7": 41}  # a waiter, a shared lock, a POSIX lock: no holder


def test_the_time_to_the_first_byte_of_a_stream_and_of_a_plain_answer(ss: ModuleType) -> None:
    assert ss.ttfb_of(rec(start=10.0, first_byte_at=10.25, seconds=1.0)) == 0.25
    assert ss.ttfb_of(rec(stream=False, start=10.0, seconds=0.75)) == 0.75  # the body comes whole
    assert ss.ttfb_of(rec(start=10.0, seconds=1.0)) is None  # a stream with no byte
    assert ss.ttfb_of(rec(stream=False, status=None, kind="dropped", seconds=3.0)) is None


def test_the_spans_of_the_wakes_and_the_sleeps_from_the_status_lines(ss: ModuleType) -> None:
    msgs = [
        (1.0, {"STATUS": "Serving m"}),
        (2.0, {"STATUS": "Going to sleep (level 1): idle for 10s"}),
        (2.4, {"STATUS": "Asleep (level 1), 0 wake(s) so far; a request wakes it"}),
        (3.0, {"STATUS": "Asleep: waiting for a slot of swap group g to wake"}),
        (3.5, {"WATCHDOG": "1"}),
        (5.0, {"STATUS": "Waking (level 1)"}),
        (5.6, {"STATUS": "Serving m"}),
        (7.0, {"STATUS": "Going to sleep (level 1): a peer of swap group g needs the room"}),
        (7.1, {"STATUS": "Serving m"}),  # refused: no sleep
        (9.0, {"STATUS": "Going to sleep (level 1): idle for 10s"}),
        (9.5, {"STATUS": "Asleep (level 1), 1 wake(s) so far; a request wakes it"}),
        (12.0, {"STATUS": "Waking (level 1)"}),
        (12.5, {"STATUS": "Asleep (level 1): wake failed: boom"}),  # failed: no wake
    ]
    assert ss.spans(msgs, "Waking", "Serving") == [0.6]
    assert ss.spans(msgs, "Going to sleep", "Asleep (") == [0.4, 0.5]
