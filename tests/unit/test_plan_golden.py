"""Golden plans: `vllm-fleet plan SPEC [--json]` over every example spec and the fixtures in tests/fixtures/plan
(refusals, notes and warnings of both profiles, multi-node, detected GPUs and fetched model facts) must print
exactly what the snapshot in tests/fixtures/plan/golden/ holds. Re-record deliberately with
``VLLM_FLEET_UPDATE_GOLDEN=1`` (and review the diff): the snapshot pins the planner's output through refactors."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from vllm_fleet import cli

REPO = Path(__file__).resolve().parents[2]
FIX = REPO / "tests/fixtures/plan"
GOLDEN = FIX / "golden"
LOCKS = ["--lock-dir", str(REPO / "locks")]

CASES: dict[str, list[str]] = {
    **{f"example-{p.stem}": [str(p), *LOCKS] for p in sorted((REPO / "examples").glob("*.yml"))},
    **{
        f"example-{p.stem}-fit-after-fetch": [str(p), "--fit-after-fetch"]
        for p in sorted((REPO / "examples").glob("*.yml"))
    },
    "gpu-refusals": [str(FIX / "gpu-refusals.yml"), *LOCKS],
    "gpu-refusals-unchecked-flags": [str(FIX / "gpu-refusals.yml"), "--allow-unchecked-flags"],
    "cpu-refusals": [str(FIX / "cpu-refusals.yml"), *LOCKS],
    "cpu-refusals-fit-after-fetch": [str(FIX / "cpu-refusals.yml"), "--fit-after-fetch"],
    "multinode-gpu": [str(FIX / "multinode-gpu.yml"), *LOCKS],
    "sleep-refusals": [str(FIX / "sleep-refusals.yml"), *LOCKS],
    "detect-undetected": [str(FIX / "detect-h200.yml")],
    "detect-fit-after-fetch": [str(FIX / "detect-h200.yml"), "--fit-after-fetch"],
    "detect-gpus-models-dir": [
        str(FIX / "detect-h200.yml"),
        "--detected",
        str(FIX / "detected-h200.json"),
        "--models-dir",
        str(FIX / "models"),
    ],
    "lora-gpu-models-dir": [str(FIX / "lora-gpu.yml"), *LOCKS, "--models-dir", str(FIX / "models")],
    "detect-nvidia-smi-fetched": [
        str(FIX / "detect-h200.yml"),
        "--detected",
        str(FIX / "detected-nvidia-smi.json"),
        "--models-dir",
        str(FIX / "models"),
    ],
}


def _run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    rc = cli.main(["plan", *args])
    out = capsys.readouterr().out.replace(str(REPO), "<REPO>")
    return rc, out


@pytest.mark.parametrize("case", sorted(CASES))
def test_plan_output_matches_the_snapshot(
    case: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # a model folder of the spec that exists on this machine (a controller that also serves) changes the plan:
    # the snapshot is of a machine without it
    local = [m["source"]["path"] for m in yaml.safe_load(Path(CASES[case][0]).read_text()).get("models") or []
             if isinstance(m.get("source"), dict) and m["source"].get("path")]  # fmt: skip
    if any(Path(p).exists() for p in local):
        pytest.skip(f"{[p for p in local if Path(p).exists()]} exists here: the plan would read its model")
    monkeypatch.chdir(FIX)  # no ./locks here: the lock folder is only the one given
    rc_json, out_json = _run([*CASES[case], "--json"], capsys)
    rc_text, out_text = _run(CASES[case], capsys)
    assert rc_json == rc_text
    got = {"args": CASES[case], "exit": rc_json, "plan": json.loads(out_json), "text": out_text.splitlines()}
    got["args"] = [a.replace(str(REPO), "<REPO>") for a in got["args"]]
    path = GOLDEN / f"{case}.json"
    if os.environ.get("VLLM_FLEET_UPDATE_GOLDEN"):
        GOLDEN.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(got, indent=1, ensure_ascii=False) + "\n")
    assert path.is_file(), f"no snapshot {path}: record it with VLLM_FLEET_UPDATE_GOLDEN=1"
    assert got == json.loads(path.read_text())


def test_the_snapshots_cover_refusals_notes_and_warnings() -> None:
    """The golden cases exercise the planner's branches, not only the happy path."""
    plans = {p.stem: json.loads(p.read_text()) for p in GOLDEN.glob("*.json")}
    assert set(plans) == set(CASES)
    problems = [x for g in plans.values() for x in g["plan"]["problems"]]
    fields = {
        p.split(":")[0].split("[", 1)[-1].split(".", 1)[-1] for p in problems if p.startswith("models[")
    }
    for f in ("gpus", "tensor_parallel_size", "port", "quantization", "kv_cache_dtype", "dtype", "max_model_len",
              "kv_cache_memory_bytes", "gpu_memory_utilization", "role", "shape", "extra_args"):  # fmt: skip
        assert any(x == f or x.startswith(f + "[") for x in fields), (f, sorted(fields))
    assert any(p.startswith("hosts[0].gpus:") for p in problems)
    assert any(p.startswith("stacks.old.vllm_version:") for p in problems)
    # LoRA (docs/lora.md): a rank vLLM does not accept, an adapter above its instances' slots, slots estimated
    assert any(p.startswith("models[0].lora.max_lora_rank:") for p in problems)
    assert any(p.startswith("adapters[0].rank:") for p in problems)
    assert any(ip.get("lora_bytes") for g in plans.values() for ip in g["plan"]["instances"])
    # sleep mode (docs/sleep.md): a profile and a release without it, a swap group over its GPU, level-1 weights
    # over the host's memory, the development mode set by hand; the way to share a GPU named in an overlap
    for path in ("models[5].sleep:", "models[6].sleep:", "swap_groups.pair:", "models[2].sleep.level:",
                 "models[7].env.VLLM_SERVER_DEV_MODE:"):  # fmt: skip
        assert any(p.startswith(path) for p in plans["sleep-refusals"]["plan"]["problems"]), path
    assert all("swap group" in p for p in problems if "is already used by models[" in p)
    warnings = plans["sleep-refusals"]["plan"]["warnings"]
    assert any(w.startswith("hosts[1].memory_gib:") for w in warnings)
    assert any(w.startswith("swap_groups.spare:") for w in warnings)
    assert plans["example-gpu-sleep"]["plan"]["ok"]
    notes = [n for g in plans.values() for ip in g["plan"]["instances"] for n in ip["notes"]]
    assert any("far above the suggested" in n for n in notes) and any("not estimated" in n for n in notes)
    assert any(g["plan"]["ok"] for g in plans.values()) and not all(g["plan"]["ok"] for g in plans.values())
