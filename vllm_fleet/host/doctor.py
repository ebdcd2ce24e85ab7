"""``vllm-fleet doctor``: the engine stack checked layer by layer, one verdict line (and a fix) per layer.

CPU instruction sets (cpu profile: AVX2/AVX-512/BF16/AMX and the AMX permission vLLM-CPU's kernels need) →
driver (nvidia-smi, >= stack.min_driver) → gpus (the GPUs nvidia-smi lists against the spec's
``hosts[].gpus`` and the GPUs the models use) → CUDA runtime (torch's CUDA build vs. the driver) → torch sees
the GPUs → vLLM imports (and is the pinned release) → optional tiny load (``--load MODEL [--dtype D]``: a few
tokens generated in-process in that dtype; a process of the load killed by a signal is named with the signal
and its meaning). A layer that fails blocks the layers above it (they are reported as blocked, not run). On
the cpu profile the GPU layers are skipped with a verdict that says so. ``--layers A,B`` runs only those
layers (the play runs them as tasks, see docs/ansible.md).

Run it with an engine stack's interpreter (``STACK/bin/vllm-fleet``: the layers from cuda-runtime up import
torch and vLLM with ``sys.executable``). The layers below them (cpu-isa, driver, gpus) need only the standard
library and this module's three imports (``contracts``, ``cpu_features``, ``engine_death``, imported relatively):
the preflight role runs them with a fresh host's ``python3``, before anything is installed, as the Ansible
module ``vllm_fleet_doctor`` (ansible/plugins/modules), which carries these files as module_utils.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

# relative imports: the same files also run as ``ansible.module_utils.vllm_fleet...`` inside the bundle's
# vllm_fleet_doctor module on a host that has no vllm-fleet yet (ansible/plugins/module_utils)
from ..contracts import (
    NVSMI_FIELDS,
    ContractError,
    HostContract,
    is_adapters_file,
    nvidia_smi_text,
    parse_nvidia_smi,
)
from . import cpu_features
from .engine_death import cause_in

__all__ = ["NVSMI_FIELDS", "nvidia_smi_text", "parse_nvidia_smi"]  # the host's side of that contract

# every layer, bottom up; the first three need no engine stack (no torch, no vLLM)
LAYERS = ("cpu-isa", "driver", "gpus", "cuda-runtime", "torch-gpus", "vllm-import", "tiny-load")
STACK_FREE_LAYERS = LAYERS[:3]
# the fix of a stack that does not import: the play never installs into a stack venv once it is complete
_REINSTALL = (
    "fix the lock, or remove this stack's venv and rerun the playbook (it installs it from the lock again)"
)
# a unit in one of these states holds (or is about to hold) its GPUs
_UNIT_BUSY_STATES = {"active", "activating", "reloading", "deactivating"}
# a GPU with this much memory in use is taken, even when nvidia-smi lists no process (a container's view)
_BUSY_MIB = 1024
# the load's share of one GPU (decode_check's gpu_memory_utilization); weights above most of it cannot load
_LOAD_GPU_SHARE = 0.2


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


def run(cmd: list[str], timeout: float = 60, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """``cmd``'s exit status, stdout and stderr; ``env``: variables added to this process's environment."""
    try:
        res = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, **env} if env else None,
        )
    except FileNotFoundError:
        return 127, "", f"{cmd[0]}: not found"
    except subprocess.TimeoutExpired:
        return 124, "", f"{' '.join(cmd[:3])}: timed out after {timeout}s"
    return res.returncode, res.stdout, res.stderr


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

# a Python exception line, also behind a process tag ("[rank0]: ModuleNotFoundError: ...")
_EXCEPTION_LINE_RE = re.compile(r"(?:^|[\s:\]])\w*(Error|Exception): ")
_ERROR_LINE_RE = re.compile(r"\b(ERROR|CRITICAL)\b")


def _py_json(
    code: str,
    args: list[str] | None = None,
    timeout: float = 300,
    module: bool = False,
    env: dict[str, str] | None = None,
) -> tuple[dict[str, Any] | None, str]:
    """Run Python code (or ``-m`` a module) in the venv's interpreter; its last stdout line as JSON, or the
    failure's cause: a process killed by a signal (named), else the first exception line (the root cause
    of a chain: vLLM's engine core traceback comes before the API server's "initialization failed"), else
    the last ERROR line, else the last line."""
    rc, out, err = run([sys.executable, "-m" if module else "-c", code, *(args or [])], timeout, env)
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
    exceptions = [ln for ln in lines if _EXCEPTION_LINE_RE.search(ln)]
    if exceptions:
        return None, exceptions[0][:400]
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
        at_least = f" (>= {min_driver})" if min_driver else ""
        return Layer(
            "driver",
            "fail",
            err or "nvidia-smi lists no GPU",
            f"install the NVIDIA driver{at_least} and reboot",
        )
    drv = gpus[0]["driver_version"]
    facts = {
        "driver": drv,
        "cuda_driver": driver_cuda_version(),
        "gpus": gpus,
        "nvidia_smi": nvidia_smi_text(gpus),
    }
    if min_driver and _ver_tuple(drv)[:1] < (min_driver,):
        return Layer("driver", "fail", f"driver {drv} < {min_driver} required by the pinned torch CUDA build",
                     f"install NVIDIA driver >= {min_driver}", facts)  # fmt: skip
    return Layer("driver", "ok", f"driver {drv}, {len(gpus)} GPU(s): {gpus[0]['name']}", facts=facts)


def gpus_layer(
    gpu: bool, gpus: list[dict[str, str]], needed: int = 0, host_gpus: dict[str, Any] | None = None
) -> Layer:
    """The GPUs nvidia-smi lists against the spec: at least the ``needed`` ones the models use, and unless
    ``host_gpus`` (the spec's ``hosts[].gpus``; ``field``: its place in the spec) says ``detect: true``, its
    count, model and compute capability."""
    if not gpu:
        return Layer("gpus", "skip", "cpu profile: no GPUs needed")
    hg = host_gpus or {}
    where = hg.get("field") or "hosts[].gpus"
    names = sorted({g["name"] for g in gpus})
    ccs = sorted({g["compute_cap"] for g in gpus})
    have = f"nvidia-smi lists {len(gpus)}: {', '.join(names) or '-'} (cc {', '.join(ccs) or '-'})"
    facts: dict[str, Any] = {"count": len(gpus), "names": names, "compute_caps": ccs}
    fix = f"fix {where} in the spec (or set {where}.detect: true), or the inventory"
    if not hg.get("detect"):
        count, model, cc = hg.get("count") or 0, hg.get("model") or "", hg.get("compute_capability") or ""
        if count and len(gpus) != count:
            return Layer("gpus", "fail", f"{where}.count: the spec says {count} GPU(s) and the models use "
                         f"{needed}, {have}", fix, facts)  # fmt: skip
        if model and names != [model]:
            return Layer("gpus", "fail", f"{where}.model: the spec says {model}, {have}", fix, facts)
        if cc and ccs != [cc]:
            return Layer(
                "gpus", "fail", f"{where}.compute_capability: the spec says {cc}, {have}", fix, facts
            )
    if len(gpus) < needed:
        return Layer("gpus", "fail", f"the models use {needed} GPU(s) on this host, {have}",
                     f"fix the models' gpus (or {where}) in the spec, or the inventory", facts)  # fmt: skip
    said = "detect: true" if hg.get("detect") else "as the spec says"
    return Layer("gpus", "ok", f"{have}; the models use {needed}; {said}", facts=facts)


def cuda_runtime_layer(gpu: bool, torch_facts: dict[str, Any] | None, err: str, drv_cuda: str) -> Layer:
    """torch imports, is a CUDA build (gpu profile), and the driver supports its CUDA version."""
    if torch_facts is None:
        return Layer("cuda-runtime", "fail", f"import torch failed: {err}", _REINSTALL)
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
        return Layer("vllm-import", "fail", f"import vllm failed: {err}", _REINSTALL)
    if vllm_version and vf["version"].split("+")[0] != vllm_version:
        return Layer("vllm-import", "fail", f"{vf['dist']} {vf['version']} installed, spec pins {vllm_version}",
                     "rerun the playbook (install tag)", vf)  # fmt: skip
    return Layer("vllm-import", "ok", f"{vf['dist']} {vf['version']} imports", facts=vf)


def tiny_load_layer(load_model: str, profile: str, dtype: str, env: dict[str, str] | None = None) -> Layer:
    """A few tokens generated from ``load_model`` in-process, in ``dtype`` (vllm_fleet.host.decode_check),
    with ``env`` added (the instance's ``env`` from the spec, as its unit has it)."""
    res, err = _py_json(
        "vllm_fleet.host.decode_check", [load_model, profile, dtype], timeout=600, module=True, env=env
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


def running_instance_gpus(instances_dir: str) -> dict[int, str]:
    """{GPU index: instance} of the instances (configs in ``instances_dir``) whose ``vllm@`` unit is running
    or starting: the GPUs they hold or are about to hold (the configs on disk are what they run with)."""
    cfgs: dict[str, list[int]] = {}
    try:
        names = sorted(os.listdir(instances_dir))
    except OSError:
        return {}
    for fn in names:
        if fn.endswith(".json") and not is_adapters_file(fn):  # an instance's adapters file is not its config
            try:
                with open(os.path.join(instances_dir, fn)) as f:
                    cfgs[fn[:-5]] = [int(g) for g in json.load(f).get("gpus") or []]
            except (OSError, ValueError, TypeError):
                continue
    if not cfgs:
        return {}
    units = [f"vllm@{n}.service" for n in cfgs]
    _rc, out, _ = run(["systemctl", "show", "-p", "ActiveState", "--value", *units], 30)
    states = out.splitlines()
    busy: dict[int, str] = {}
    for (name, gpus), state in zip(cfgs.items(), states + [""] * len(cfgs), strict=False):
        if state.strip() in _UNIT_BUSY_STATES:
            busy.update({g: name for g in gpus})
    return busy


def gpu_usage() -> dict[str, tuple[int, bool]]:
    """{GPU UUID: (MiB in use, whether nvidia-smi lists a compute process on it)}."""
    _rc, out, _ = run(["nvidia-smi", "--query-gpu=uuid,memory.used", "--format=csv,noheader,nounits"], 30)
    used = {}
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[1].isdigit():
            used[parts[0]] = int(parts[1])
    _rc, out, _ = run(["nvidia-smi", "--query-compute-apps=gpu_uuid", "--format=csv,noheader"], 30)
    procs = {ln.strip() for ln in out.splitlines() if ln.strip()}
    return {u: (mib, u in procs) for u, mib in used.items()}


def pick_idle_gpu(instances_dir: str) -> tuple[dict[str, str] | None, str]:
    """A GPU no running instance uses (not in a running instance's config, no compute process, under
    ``_BUSY_MIB`` in use), and the verdict when there is none."""
    gpus, err = nvidia_gpus()
    if err or not gpus:
        return None, err or "nvidia-smi lists no GPU"
    held, usage = running_instance_gpus(instances_dir), gpu_usage()
    why = []
    for g in gpus:
        mib, procs = usage.get(g["uuid"], (0, False))
        if int(g["index"]) in held:
            why.append(f"GPU {g['index']}: instance {held[int(g['index'])]}")
        elif procs or mib >= _BUSY_MIB:
            why.append(f"GPU {g['index']}: {mib} MiB in use" + (" by a process" if procs else ""))
        else:
            return g, ""
    return (
        None,
        f"every GPU is in use ({'; '.join(why)}): load skipped, it would take a running instance's memory",
    )


def model_weight_bytes(model: str) -> int:
    """Bytes of the weight files in a model folder (0 when it is not a folder)."""
    total = 0
    for root, _dirs, files in os.walk(model):
        total += sum(
            os.path.getsize(os.path.join(root, f))
            for f in files
            if f.endswith((".safetensors", ".bin", ".pt"))
        )
    return total


def check(
    profile: str,
    vllm_version: str = "",
    min_driver: int = 0,
    expect_gpus: int = 0,
    load_model: str = "",
    dtype: str = "auto",
    env: dict[str, str] | None = None,
    layers: list[str] | tuple[str, ...] | None = None,
    host_gpus: dict[str, Any] | None = None,
    idle_gpu: bool = False,
    instances_dir: str = "/etc/vllm-fleet/instances",
) -> list[Layer]:
    """The layers, bottom up (``layers``: only those, in that order; None: all): CPU instruction sets, driver,
    the GPUs against the spec (``host_gpus``: its ``hosts[].gpus``; ``expect_gpus``: the GPUs the models use),
    CUDA runtime, torch sees the GPUs, vLLM imports, the optional tiny load (``idle_gpu``: only on a GPU no
    running instance uses, skipped when there is none); a failed layer blocks the ones above it."""
    want = set(LAYERS if layers is None else layers)
    # "gpu+cpu": a host that runs stacks of both profiles (models[].stack): its CPU checked for the cpu
    # profile, its driver and GPUs for the gpu one
    gpu = profile in ("gpu", "gpu+cpu")
    v = _Verdicts()
    if "cpu-isa" in want:
        v.add(cpu_isa_layer("cpu" if profile == "gpu+cpu" else profile))
    driver: Layer | None = None
    if "driver" in want or "gpus" in want:
        driver = driver_layer(gpu, min_driver)
        if "driver" in want:
            v.add(driver)
    if "gpus" in want and v.gate("gpus"):
        assert driver is not None
        v.add(gpus_layer(gpu, driver.facts.get("gpus", []), expect_gpus, host_gpus))
    torch_facts: dict[str, Any] | None = None
    if {"cuda-runtime", "torch-gpus"} & want and v.gate("cuda-runtime"):
        # one torch import answers the CUDA runtime and the torch-gpus layers
        torch_facts, err = _py_json(PY_TORCH, timeout=120)
        if "cuda-runtime" in want:
            drv_cuda = driver.facts.get("cuda_driver", "") if driver else driver_cuda_version() if gpu else ""
            v.add(cuda_runtime_layer(gpu, torch_facts, err, drv_cuda))
    if "torch-gpus" in want and v.gate("torch-gpus"):
        v.add(torch_gpus_layer(gpu, torch_facts, expect_gpus))
    if "vllm-import" in want and v.gate("vllm-import"):
        v.add(vllm_layer(vllm_version))
    if "tiny-load" not in want:
        return v.layers
    if not load_model:
        v.add(Layer("tiny-load", "skip", "not requested (--load MODEL_PATH)"))
    elif v.gate("tiny-load"):
        load_env = dict(env or {})
        if gpu and idle_gpu:
            chosen, why = pick_idle_gpu(instances_dir)
            if chosen is None:
                return [*v.layers, Layer("tiny-load", "skip", why)]
            share = _LOAD_GPU_SHARE * int(chosen["memory.total"] or 0) * 2**20
            if (weights := model_weight_bytes(load_model)) > 0.75 * share:
                return [*v.layers, Layer("tiny-load", "skip", f"{load_model} holds {weights / 2**30:.1f} GiB of "
                        f"weights, more than the load's share of GPU {chosen['index']} ({share / 2**30:.1f} GiB)",
                        "load a smaller model (--load)")]  # fmt: skip
            load_env["CUDA_VISIBLE_DEVICES"] = chosen["uuid"]
        v.add(tiny_load_layer(load_model, profile, dtype, load_env))
    return v.layers


def _layer_list(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if bad := [n for n in names if n not in LAYERS]:
        raise argparse.ArgumentTypeError(f"unknown layer(s) {', '.join(bad)}; layers: {', '.join(LAYERS)}")
    return sorted(names, key=LAYERS.index)


def add_args(p: argparse.ArgumentParser) -> None:
    """The host's command line: ``--contract`` (this host's CONFIG_DIR/host.json) or ``--profile``;
    ``vllm-fleet doctor`` adds a fleet spec and ``--host`` as another source (vllm_fleet.host_commands)."""
    p.add_argument(
        "--contract",
        metavar="PATH",
        help="this host's contract (CONFIG_DIR/host.json, written by the play): its stacks, its GPUs, the GPUs "
        "its instances use, their dtype and env",
    )
    p.add_argument(
        "--profile",
        choices=["cpu", "gpu", "gpu+cpu"],
        help="without a contract (gpu+cpu: a host running stacks of both profiles; host layers only)",
    )
    p.add_argument(
        "--stack",
        default="",
        help="the stack checked (a name of the host's stacks, or default; default: the first stack the host "
        "runs) and that stack's instances on the host",
    )
    p.add_argument(
        "--layers",
        type=_layer_list,
        default=None,
        metavar="A,B",
        help=f"only these layers (of {','.join(LAYERS)}); default: all",
    )
    p.add_argument("--vllm-version", default=None, help="the pinned vLLM release (default: the stack's)")
    p.add_argument("--min-driver", type=int, default=None, help="lowest NVIDIA driver (default: the stack's)")
    p.add_argument(
        "--expect-gpus",
        type=int,
        default=None,
        help="GPUs the models use (default: the host's on that stack)",
    )
    p.add_argument(
        "--host-gpus",
        type=json.loads,
        default=None,
        metavar="JSON",
        help='the spec\'s hosts[].gpus ({"count", "model", "compute_capability", "detect", "field"}); '
        "default: the contract's",
    )
    p.add_argument(
        "--load", default="", metavar="MODEL_PATH", help="also load this model and generate 4 tokens"
    )
    p.add_argument(
        "--dtype",
        default="",
        help="dtype of the --load decode (default: the instances' dtype on --host, else the model's own)",
    )
    p.add_argument(
        "--idle-gpu",
        action="store_true",
        help="gpu: load on a GPU no running instance uses (skipped with a verdict when every GPU is taken)",
    )
    p.add_argument(
        "--instances-dir",
        default=None,
        help="instance configs of this host (--idle-gpu: the GPUs of the running ones are taken); default: "
        "the contract's CONFIG_DIR/instances, else /etc/vllm-fleet/instances",
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=_run)


def _run(a: argparse.Namespace, contract: HostContract | None = None) -> int:
    """The layers as the arguments say; ``contract``: the host's (else read from ``--contract``, if given)."""
    if contract is None and getattr(a, "contract", None):
        try:
            contract = HostContract.load(a.contract)
        except OSError as exc:
            print(f"doctor: --contract {a.contract}: cannot read it ({exc.strerror})", file=sys.stderr)
            return 2
        except ContractError as exc:
            print(f"doctor: --contract: {exc}", file=sys.stderr)
            return 2
    profile, version, min_driver, expect, dtype = a.profile or "gpu", "", 0, 0, a.dtype or "auto"
    env: dict[str, str] = {}
    host_gpus: dict[str, Any] | None = None
    if contract is not None:
        name = getattr(a, "stack", "") or contract.stacks[0].name
        try:
            stack = contract.stack(name)
        except KeyError:
            runs = ", ".join(s.name for s in contract.stacks)
            print(f"doctor: --stack {name}: host {contract.host} runs the stacks {runs}", file=sys.stderr)
            return 2
        profile, version, min_driver = stack.profile, stack.vllm_version, stack.min_driver
        # the host's instances on that stack (their GPUs, dtype and env)
        mine = [m for m in contract.instances if m.stack == name]
        expect = max((g for m in mine for g in m.gpus), default=-1) + 1
        host_gpus = asdict(contract.gpus)
        dtypes = {m.dtype for m in mine}
        if not a.dtype and len(dtypes) == 1:
            dtype = dtypes.pop()
        # the load runs with the environment the spec gives this host's engines (e.g. a sampler switch
        # a carried stack needs); instances that disagree on a variable leave it out
        envs = [m.env for m in mine]
        env = {k: v for k, v in (envs[0] if envs else {}).items() if all(e.get(k) == v for e in envs)}
    instances_dir = getattr(a, "instances_dir", None) or (
        f"{contract.paths.config_dir}/instances" if contract else "/etc/vllm-fleet/instances"
    )
    version = version if getattr(a, "vllm_version", None) is None else a.vllm_version
    min_driver = min_driver if getattr(a, "min_driver", None) is None else a.min_driver
    expect = expect if getattr(a, "expect_gpus", None) is None else a.expect_gpus
    host_gpus = getattr(a, "host_gpus", None) or host_gpus
    layers = check(a.profile or profile, version, min_driver, expect, a.load, dtype, env,
                   getattr(a, "layers", None), host_gpus, getattr(a, "idle_gpu", False),
                   instances_dir)  # fmt: skip
    if a.json:
        print(json.dumps([asdict(x) for x in layers], indent=2))
    else:
        for layer in layers:
            print(layer.line())
        bad = [x.name for x in layers if x.status == "fail"]
        print(f"verdict: {'FAIL at ' + bad[0] if bad else 'OK'}")
    return 1 if any(x.status == "fail" for x in layers) else 0


def main(argv: list[str]) -> int:
    """``vllm-fleet doctor ARGS`` (``python -m vllm_fleet.host.doctor``)."""
    p = argparse.ArgumentParser(prog="vllm-fleet doctor")
    add_args(p)
    a = p.parse_args(argv)
    return int(a.handler(a))
