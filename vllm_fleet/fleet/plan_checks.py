"""The planner's checks and sizes as pure functions: each takes the spec (and what an earlier step computed) and
returns a small typed result or its ``Finding``s; nothing here writes into a plan. ``fleet/plan.py`` composes
them and builds the ``Plan`` once."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple

from vllm_fleet.contracts import (
    ASLEEP_GPU_GIB,
    DEV_MODE_ENV,
    ENGINE_HTTP_KEEPALIVE_SECONDS,
    GATEWAY_UPSTREAM_KEEPALIVE_SECONDS,
)
from vllm_fleet.fleet import engine_flags
from vllm_fleet.fleet.modelinfo import (
    ModelFacts,
    kv_bytes_per_token,
    kv_dtype_bytes,
    lora_bytes,
    weight_bytes,
)
from vllm_fleet.fleet.spec import COMMIT_RE, DEFAULT_STACK, LORA_RANKS, FleetSpec, Host, ModelInstance

GIB = 1024**3
# Memory vLLM needs besides weights and KV cache on each GPU: CUDA context, activations during the
# profile run, NCCL buffers, CUDA graphs. Conservative figures; the real value is logged by vLLM at start.
OVERHEAD_PER_GPU_BYTES = int(2.0 * GIB)
OVERHEAD_EAGER_PER_GPU_BYTES = int(1.25 * GIB)
# on the cpu profile, vLLM's own process overhead besides weights and KV (API server + engine core)
CPU_OVERHEAD_BYTES = int(2.0 * GIB)
MAX_SUGGESTED_SEQS = 512
# the most of a GPU's memory instances awake together on it may ask for (gpu_memory_utilization summed): with
# share_gpus (a margin for what each engine holds besides its share), and for a swap group's awake set with
# its sleepers' ASLEEP_GPU_GIB each (vLLM's own start check: its share of the GPU must be free)
SHARED_GPU_MAX = 0.95
SWAP_GPU_MAX = 1.0
FP8_MIN_CC = (8, 9)
BF16_MIN_CC = (8, 0)

Severity = Literal["problem", "warning", "note"]
Placed = list[tuple[int, ModelInstance]]  # a host's instances with their index in spec.models


@dataclass(frozen=True)
class Finding:
    """What a check found about the spec field ``path``. ``problem``: refuses the plan (printed
    ``path: message``); ``warning`` (told with the plan) and ``note`` (told with its instance) are
    informational, their ``message`` is the whole line as printed."""

    path: str
    message: str
    severity: Severity = "problem"

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.severity == "problem" else self.message


def _problem(path: str, message: str) -> Finding:
    return Finding(path, message, "problem")


def _warning(path: str, message: str) -> Finding:
    return Finding(path, message, "warning")


def _note(path: str, message: str) -> Finding:
    return Finding(path, message, "note")


# --------------------------------------------------------------------------- layout: ports and devices per host


class HostLayout(NamedTuple):
    ports: dict[int, str]  # port → owner, sorted
    gpu_map: dict[int, list[str]]  # GPU → the instances on it, sorted
    findings: list[Finding]


def host_service_ports(spec: FleetSpec, host: str) -> list[tuple[int, str]]:
    """(port, field) of each of our other services on this host, in spec order (a port may repeat)."""
    ports: list[tuple[int, str]] = []
    gateway_here = spec.gateway.enabled and host in spec.gateway_hosts
    if gateway_here:
        ports.append((spec.gateway.port, "gateway.port"))
        ports.append((spec.gateway.stub_status_port, "gateway.stub_status_port"))
        if spec.gateway_ha:
            # the peer server: the other gateways' drains and undrains (on the fleet address)
            ports.append((spec.gateway.peer_port, "gateway.peer_port"))
        if spec.gateway.admission:
            ports.append((spec.gateway.limits.metrics_port, "gateway.limits.metrics_port"))
        if spec.gateway.tls:
            ports.append((spec.gateway.tls.port, "gateway.tls.port"))
    if spec.monitoring.enabled and host in spec.monitoring_hosts:
        ports.append((spec.monitoring.prometheus_port, "monitoring.prometheus_port"))
        ports.append((spec.monitoring.alertmanager_port, "monitoring.alertmanager_port"))
        if spec.monitoring_ha:
            # the Alertmanager cluster's gossip (TCP and UDP; one Alertmanager gossips only with --cluster.listen-address=)
            ports.append((spec.monitoring.alertmanager_cluster_port, "monitoring.alertmanager_cluster_port"))
    if spec.monitoring.enabled:
        ports.append((spec.monitoring.node_exporter_port, "monitoring.node_exporter_port"))
        ports.append((spec.monitoring.exporter_port, "monitoring.exporter_port"))
        if gateway_here:
            ports.append((spec.monitoring.nginx_exporter_port, "monitoring.nginx_exporter_port"))
    return ports


def check_port(host: Host, path: str, port: int, ports: Mapping[int, str]) -> list[Finding]:
    """``path`` (a service's field or ``models[i].port``) may take ``port`` unless an earlier owner has it."""
    if port in ports:
        return [_problem(path, f"port {port} on {host.name} is already used by {ports[port]}")]
    return []


def may_share_gpus(spec: FleetSpec, a: ModelInstance, b: ModelInstance) -> bool:
    """Whether two instances of a host may use the same GPU: both in one swap group (they take turns, the
    others asleep: docs/sleep.md), or both set ``share_gpus`` (awake together, memory shares added up)."""
    group = spec.swap_group(a)
    return bool(group and group == spec.swap_group(b)) or (a.share_gpus and b.share_gpus)


def check_gpus(
    spec: FleetSpec, host: Host, i: int, m: ModelInstance, gpu_users: Mapping[int, Sequence[int]]
) -> list[Finding]:
    """One instance on the gpu profile: tensor parallel size = its GPUs, the GPUs exist and are its own
    (unless it may share them with each instance already there: ``may_share_gpus``). ``gpu_users``: GPU →
    indices of the instances on it so far."""
    path = f"models[{i}]"
    found: list[Finding] = []
    if m.tensor_parallel_size != len(m.gpus):
        found.append(
            _problem(
                f"{path}.tensor_parallel_size",
                f"tensor_parallel_size {m.tensor_parallel_size} != {len(m.gpus)} GPU(s) in gpus {m.gpus}",
            )
        )
    bad = [g for g in m.gpus if g >= host.gpus.count] if not host.gpus.detect and host.gpus.count else []
    if bad:
        found.append(
            _problem(f"{path}.gpus", f"GPU {bad[0]} does not exist on {host.name} ({host.gpus.count} GPUs)")
        )
    for g in m.gpus:
        j = next((j for j in gpu_users.get(g, ()) if not may_share_gpus(spec, m, spec.models[j])), None)
        if j is not None:
            other = spec.models[j].name
            found.append(
                _problem(
                    f"{path}.gpus",
                    f"GPU {g} on {host.name} is already used by models[{j}] ({other}); models that take turns "
                    "on a GPU share it in one swap group (models[].sleep.group, swap_groups: docs/sleep.md), "
                    "models awake together set share_gpus on both",
                )
            )
    return found


def check_cpu_devices(spec: FleetSpec, i: int, m: ModelInstance) -> list[Finding]:
    """The cpu profile runs tensor_parallel_size 1 on no GPUs (an instance beside gpu ones must not take or
    hide their devices)."""
    found: list[Finding] = []
    if m.tensor_parallel_size != 1:
        found.append(
            _problem(f"models[{i}].tensor_parallel_size", "the cpu profile runs tensor_parallel_size 1")
        )
    if m.gpus:
        found.append(
            _problem(
                f"models[{i}].gpus",
                f"the cpu profile uses no GPUs (stack {spec.stack_name(m)!r}): leave gpus empty",
            )
        )
    return found


def check_shared_gpus(spec: FleetSpec, host: Host, gpu_map: Mapping[int, list[str]]) -> list[Finding]:
    """Instances sharing a GPU with ``share_gpus`` (awake together): their gpu_memory_utilization must add up to
    SHARED_GPU_MAX at most. A GPU with a swap group's models: ``check_swap_gpus``."""
    found: list[Finding] = []
    for g, names in gpu_map.items():
        models = [spec.model(n) for n in names]
        if len(names) > 1 and all(x.share_gpus for x in models) and not any(map(spec.swap_group, models)):
            total = sum(x.gpu_memory_utilization for x in models)
            if total > SHARED_GPU_MAX:
                found.append(
                    _problem(
                        f"models[{spec.models.index(spec.model(names[-1]))}].gpu_memory_utilization",
                        f"instances sharing GPU {g} on {host.name} ({', '.join(names)}) ask for "
                        f"{total:.2f} of its memory in total (max {SHARED_GPU_MAX:g})",
                    )
                )
    return found


def check_swap_gpus(spec: FleetSpec, host: Host, gpu_map: Mapping[int, list[str]]) -> list[Finding]:
    """A GPU shared by a swap group (docs/sleep.md): at worst ``max_awake`` of the group's models on it are awake,
    those with the largest gpu_memory_utilization, and every other one asleep keeps ASLEEP_GPU_GIB of it. That
    (with any share_gpus instance beside the group, awake) must fit: vLLM starts an engine only when its
    gpu_memory_utilization of the GPU is free, and that share holds the engine's own CUDA context, so an awake
    set of one group alone may reach SWAP_GPU_MAX (1.0); beside others (share_gpus), SHARED_GPU_MAX. The asleep
    part is left out while the GPU's memory is unknown (the play plans again with the detected GPUs)."""
    found: list[Finding] = []
    mem = 0.0 if host.gpus.detect else host.gpus.memory_gib
    for g, names in gpu_map.items():
        users = [spec.model(n) for n in names]
        groups: dict[str, list[ModelInstance]] = {}
        others: list[ModelInstance] = []
        for x in users:
            (groups.setdefault(spec.swap_group(x), []) if spec.swap_group(x) else others).append(x)
        if not groups or len(users) < 2:
            continue
        if not all(may_share_gpus(spec, a, b) for a in users for b in users if a is not b):
            continue  # refused by check_gpus
        parts: list[str] = []
        total = 0.0
        for group, members in groups.items():
            k = min(spec.swap_groups[group].max_awake, len(members))
            awake = sorted((x.gpu_memory_utilization for x in members), reverse=True)[:k]
            asleep = len(members) - k
            total += sum(awake) + (asleep * ASLEEP_GPU_GIB / mem if mem else 0.0)
            what = " + ".join(f"{u:g}" for u in awake)
            gib = f" + {asleep} asleep × {ASLEEP_GPU_GIB:g} GiB / {mem:g} GiB" if asleep and mem else ""
            parts.append(
                f"swap group {group!r} ({', '.join(x.name for x in members)}; max_awake "
                f"{spec.swap_groups[group].max_awake}): {k} awake at gpu_memory_utilization {what}{gib}"
            )
        total += sum(x.gpu_memory_utilization for x in others)
        parts += [f"{x.name} (share_gpus) {x.gpu_memory_utilization:g}" for x in others]
        limit = SWAP_GPU_MAX if len(groups) == 1 and not others else SHARED_GPU_MAX
        if total > limit + 1e-9:
            found.append(
                _problem(
                    f"swap_groups.{next(iter(groups))}",
                    f"GPU {g} on {host.name} at worst: {'; '.join(parts)} = {total:.3f} of its memory (max "
                    f"{limit:g}): lower the models' gpu_memory_utilization or the group's max_awake",
                )
            )
    return found


def host_layout(spec: FleetSpec, host: Host, on_host: Placed) -> HostLayout:
    """The ports (services, then instances in spec order) and GPUs of ``host`` (``on_host``: its instances)."""
    ports: dict[int, str] = {}
    found: list[Finding] = []
    for port, owner in host_service_ports(spec, host.name):
        taken = check_port(host, owner, port, ports)
        found += taken
        ports.setdefault(port, owner)
    gpu_map: dict[int, list[str]] = {}
    gpu_users: dict[int, list[int]] = {}
    for i, m in on_host:
        taken = check_port(host, f"models[{i}].port", m.port, ports)
        found += taken
        ports.setdefault(m.port, f"models[{i}] ({m.name})")
        if m.placement:
            continue  # devices over several hosts: fleet/multinode.py
        if spec.stack_of(m).profile != "gpu":
            found += check_cpu_devices(spec, i, m)
            continue
        found += check_gpus(spec, host, i, m, gpu_users)
        for g in m.gpus:
            gpu_users.setdefault(g, []).append(i)
            gpu_map.setdefault(g, []).append(m.name)
    found += check_shared_gpus(spec, host, gpu_map)
    found += check_swap_gpus(spec, host, gpu_map)
    return HostLayout(dict(sorted(ports.items())), dict(sorted(gpu_map.items())), found)


def start_order(spec: FleetSpec, by_host: Mapping[str, Placed]) -> dict[str, list[str]]:
    """Instance name → the instances it starts after: those sharing a GPU start one after another, in spec
    order."""
    after: dict[str, list[str]] = {}
    for host in spec.hosts:
        previous: dict[int, str] = {}
        for _, m in by_host[host.name]:
            after[m.name] = sorted({previous[g] for g in m.gpus if g in previous})
            for g in m.gpus:
                previous[g] = m.name
    return after


# --------------------------------------------------------------------------- per instance: dtypes, flags, source


def check_dtypes(host: Host, i: int, m: ModelInstance, facts: ModelFacts, detected: bool) -> list[Finding]:
    """bf16 needs compute capability 8.0, FP8 (weights or KV cache, declared or the checkpoint's) 8.9."""
    cc = host.gpus.cc_tuple()
    if cc is None:
        return []
    path = f"models[{i}]"
    gpus = f"{host.gpus.model or 'GPUs'} with compute capability {host.gpus.compute_capability}"
    gpus += " (detected)" if detected else ""
    if m.quantization == "fp8":
        fp8_field = "quantization"
    elif m.kv_cache_dtype.startswith("fp8"):
        fp8_field = "kv_cache_dtype"
    elif not m.quantization and facts.quant_method == "fp8":
        fp8_field = "source"  # an FP8 checkpoint (its config.json says so)
    else:
        fp8_field = ""
    found: list[Finding] = []
    if fp8_field and cc < FP8_MIN_CC:
        what = "an FP8 checkpoint (config.json quantization_config)" if fp8_field == "source" else "FP8"
        found.append(
            _problem(f"{path}.{fp8_field}", f"{what} needs compute capability >= 8.9; {host.name} has {gpus}")
        )
    if m.dtype == "bfloat16" and cc < BF16_MIN_CC:
        found.append(
            _problem(
                f"{path}.dtype",
                f"bfloat16 needs compute capability >= 8.0; {host.name} has {gpus}: use dtype float16",
            )
        )
    return found


def check_extra_args(
    spec: FleetSpec, i: int, m: ModelInstance, known: frozenset[str] | None, allow_unchecked: bool
) -> list[Finding]:
    """Unknown and managed flags in ``extra_args`` on every profile. Without a captured argument list for the
    pinned release, extra_args are refused unless ``allow_unchecked`` (then managed flags still are)."""
    if not m.extra_args:
        return []
    stack = spec.stack_of(m)
    found: list[Finding] = []
    if known is None:
        if not allow_unchecked:
            found.append(
                _problem(
                    f"models[{i}].extra_args",
                    f"no captured argument list for {stack.profile} vLLM {stack.vllm_version}, so "
                    "these flags cannot be checked: capture it (`vllm-fleet lock args --profile "
                    f"{stack.profile} --vllm-version {stack.vllm_version}`) or plan with "
                    "--allow-unchecked-flags",
                )
            )
        # managed flags are refused with or without the list: any option name passes as "known"
        known = frozenset(
            n for a in m.extra_args if (n := engine_flags.option_name(a)) and n not in engine_flags.MANAGED
        )
    found += [
        _problem(f"models[{i}].extra_args[{j}]", r) for j, r in engine_flags.check_args(m.extra_args, known)
    ]
    return found


def check_revision(i: int, m: ModelInstance) -> list[Finding]:
    """A hub source should pin the exact commit (a tag or another name may move)."""
    if m.source.kind == "path" or COMMIT_RE.fullmatch(m.source.revision):
        return []
    path = f"models[{i}].source.{m.source.kind}.revision"
    return [
        _warning(
            path, f"{path} {m.source.revision!r} is not a commit hash: pin the exact commit you validated"
        )
    ]


def check_engine_keepalive(i: int, m: ModelInstance) -> list[Finding]:
    """``models[].env`` may override the engine's HTTP keep-alive (VLLM_HTTP_TIMEOUT_KEEP_ALIVE): vLLM reads it with
    int(), and a value near the gateway's upstream keep-alive lets the engine close connections nginx reuses
    (vllm_fleet/contracts.py, docs/gateway.md)."""
    value = m.env.get("VLLM_HTTP_TIMEOUT_KEEP_ALIVE")
    if value is None:
        return []
    path = f"models[{i}].env.VLLM_HTTP_TIMEOUT_KEEP_ALIVE"
    try:
        seconds = int(value)
    except ValueError:
        return [
            _problem(path, f"{path} {value!r} is not a whole number of seconds: the engine would not start")
        ]
    if seconds <= GATEWAY_UPSTREAM_KEEPALIVE_SECONDS:
        return [
            _problem(
                path,
                f"{path} {seconds} s is not above the gateway's upstream keep-alive "
                f"({GATEWAY_UPSTREAM_KEEPALIVE_SECONDS} s): the engine would close connections the gateway reuses",
            )
        ]
    if seconds < ENGINE_HTTP_KEEPALIVE_SECONDS:
        return [
            _warning(
                path,
                f"{path} {seconds} s is below the fleet's {ENGINE_HTTP_KEEPALIVE_SECONDS} s: a busy engine or a "
                "client whose loop lags longer meets connections the engine closed (docs/gateway.md)",
            )
        ]
    return []


def check_request_classes(spec: FleetSpec, i: int, m: ModelInstance) -> list[Finding]:
    """``gateway.classes`` runs every engine with ``--scheduling-policy priority`` and the priority middleware:
    the instance's release must have both flags; a class's pool that no instance of the fleet has is a typo."""
    if not spec.gateway.classes or not spec.gateway.enabled:
        return []
    stack = spec.stack_of(m)
    missing = [
        f
        for f in ("--scheduling-policy", "--middleware")
        if not engine_flags.release_has(f, stack.profile, stack.vllm_version)
    ]
    if missing:
        return [
            _problem(
                "gateway.classes",
                f"gateway.classes needs the engines' priority scheduling, but vLLM {stack.vllm_version} of "
                f"models[{i}] ({m.name}) has no {' / '.join(missing)}: pin a release that has them or remove the "
                "classes",
            )
        ]
    return []


def check_class_pools(spec: FleetSpec) -> list[Finding]:
    pools = {m.pool for m in spec.models}
    return [
        _problem(
            f"gateway.classes.{name}.pool",
            f"pool {c.pool!r} is not the pool of any instance ({', '.join(sorted(pools))})",
        )
        for name, c in spec.gateway.classes.items()
        if c.pool and c.pool not in pools
    ]


def check_lora(spec: FleetSpec, i: int, m: ModelInstance) -> list[Finding]:
    """An instance with LoRA on (docs/lora.md): its release has the LoRA flags, its max_lora_rank is one vLLM
    accepts, and every adapter of its served model fits a slot (each LoRA instance of the model may load any of
    them: the spill path)."""
    s = spec.lora_settings(m)
    if s is None:
        return []
    assert s.max_lora_rank is not None
    stack = spec.stack_of(m)
    flags = [*engine_flags.LORA_FLAGS, *([engine_flags.LORA_CPU_FLAG] if s.max_cpu_loras is not None else [])]
    missing = [f for f in flags if not engine_flags.release_has(f, stack.profile, stack.vllm_version)]
    found: list[Finding] = []
    if missing:
        version = f"{stack_path(spec.stack_name(m))}.vllm_version"
        found.append(
            _problem(
                f"models[{i}].lora",
                f"LoRA ({m.served_model_name!r} has adapters, or models[{i}].lora is set) needs "
                f"{' / '.join(missing)}, which {stack.profile} vLLM {stack.vllm_version} ({version}) does not "
                "have: pin a release that has them",
            )
        )
    if s.max_lora_rank not in LORA_RANKS:
        found.append(
            _problem(
                f"models[{i}].lora.max_lora_rank",
                f"{s.max_lora_rank} is not a rank vLLM accepts ({', '.join(map(str, LORA_RANKS))})",
            )
        )
    for k, a in spec.adapters_at([m.served_model_name]):
        if a.rank > s.max_lora_rank:
            found.append(
                _problem(
                    f"adapters[{k}].rank",
                    f"rank {a.rank} of {a.name!r} is above max_lora_rank {s.max_lora_rank} of instance "
                    f"{m.name!r} (models[{i}].lora.max_lora_rank), which may load it: raise that, or use an "
                    "adapter of a lower rank",
                )
            )
    return found


def check_sleep(spec: FleetSpec, i: int, m: ModelInstance) -> list[Finding]:
    """A sleeping model (``models[].sleep``; docs/sleep.md) needs vLLM's sleep mode, which is CUDA/ROCm only
    (vLLM-CPU has none: the cpu profile is refused even though its argument list names the flag), a release with
    ``--enable-sleep-mode`` and ``--middleware`` (the sleep guard), and one host (the swap slots and the
    launcher's control are per host). ``models[].env`` never sets VLLM_SERVER_DEV_MODE: it opens vLLM's
    development paths without authentication; vllm-fleet sets it for a sleeping model, behind the guard. Level
    2 is refused with LoRA on: vLLM cannot reload the weights of a LoRA-wrapped model."""
    found: list[Finding] = []
    if DEV_MODE_ENV in m.env:
        found.append(
            _problem(
                f"models[{i}].env.{DEV_MODE_ENV}",
                f"{DEV_MODE_ENV} opens vLLM's development endpoints (/sleep, /collective_rpc, …) without "
                "authentication: vllm-fleet sets it for a model with `sleep`, behind the sleep guard; remove it",
            )
        )
    if m.sleep is None:
        return found
    path = f"models[{i}].sleep"
    stack = spec.stack_of(m)
    version = f"{stack_path(spec.stack_name(m))}.vllm_version"
    if stack.profile != "gpu":
        found.append(
            _problem(
                path,
                f"the {stack.profile} profile cannot sleep (stack {spec.stack_name(m)!r}): vLLM's sleep mode is "
                "CUDA/ROCm only, vLLM-CPU has none",
            )
        )
    else:
        missing = [
            f
            for f in (engine_flags.SLEEP_FLAG, "--middleware")
            if not engine_flags.release_has(f, stack.profile, stack.vllm_version)
        ]
        if missing:
            found.append(
                _problem(
                    path,
                    f"sleep mode needs {' / '.join(missing)}, which {stack.profile} vLLM {stack.vllm_version} "
                    f"({version}) does not have: pin a release that has {'them' if len(missing) > 1 else 'it'}",
                )
            )
    if m.multi_node:
        found.append(
            _problem(path, "an instance over several hosts (placement) cannot sleep: swap slots are per host")
        )
    if m.sleep.level == 2 and spec.lora_on(m):
        # vLLM issue 39934 (fix proposed in pull request 48337, not in a release we pin): with LoRA the model's
        # parameters sit under each LoRA wrapper's base_layer, so the wake's `reload_weights` fails on the
        # checkpoint's names, and the adapters' stacked GPU tensors, discarded with the weights, are not
        # restored: the engine could not be woken (or would answer from garbage adapter slots)
        found.append(
            _problem(
                f"{path}.level",
                "level 2 with LoRA adapters cannot wake: vLLM's weight reload after a level-2 sleep fails with "
                "LoRA on, and leaves the adapters' GPU memory undefined (vLLM issue 39934); use level 1 "
                "(the weights, adapters included, are kept in host memory)",
            )
        )
    return found


class AsleepWeights(NamedTuple):
    total: int  # at worst, the level-1 sleepers' weights in host memory at once
    parts: list[str]  # where they come from, for the plan's lines


def asleep_weights(spec: FleetSpec, on_host: Placed, weights: Mapping[str, int]) -> AsleepWeights:
    """What level-1 sleep puts in a host's memory at worst (vLLM backs the weights up there; level 2 drops them):
    every level-1 sleeper outside a swap group (all may be asleep at once), and per swap group its members beyond
    ``max_awake``, the largest first. ``weights``: instance → weight bytes (unknown ones count 0)."""
    total = 0
    parts: list[str] = []
    groups: dict[str, list[ModelInstance]] = {}
    for _, m in on_host:
        if m.sleep is None:
            continue
        if spec.swap_group(m):
            groups.setdefault(spec.swap_group(m), []).append(m)
        elif m.sleep.level == 1 and weights.get(m.name):
            total += weights[m.name]
            parts.append(f"{m.name} ≈{weights[m.name] / GIB:.1f} GiB")
    for group, members in groups.items():
        asleep = max(0, len(members) - spec.swap_groups[group].max_awake)
        level1 = sorted(
            ((weights.get(x.name, 0), x.name) for x in members if x.sleep and x.sleep.level == 1),
            reverse=True,
        )[:asleep]
        got = sum(w for w, _ in level1)
        if got:
            total += got
            parts.append(
                f"swap group {group!r}: {asleep} of {len(members)} asleep, ≈{got / GIB:.1f} GiB at most"
            )
    return AsleepWeights(total, parts)


def check_sleep_host_memory(
    spec: FleetSpec, host: Host, on_host: Placed, weights: Mapping[str, int], cpu_bytes: int
) -> list[Finding]:
    """The level-1 sleepers' weights at worst (``asleep_weights``) and the cpu-profile instances' memory
    (``cpu_bytes``: weights, KV cache, overhead) must fit the host's memory (``memory_gib``, or what the play
    detected); unknown: a warning, as the play's second plan knows it."""
    asleep = asleep_weights(spec, on_host, weights)
    if not asleep.total:
        return []
    k = spec.host_position(host.name)
    what = "; ".join(asleep.parts)
    if not host.memory_gib:
        return [
            _warning(
                f"hosts[{k}].memory_gib",
                f"hosts[{k}].memory_gib: memory of {host.name} unknown: its level-1 sleepers keep up to "
                f"≈{asleep.total / GIB:.1f} GiB of weights in it ({what}), not checked (give hosts[{k}].memory_gib; "
                "the play's second plan reads the host's)",
            )
        ]
    need = asleep.total + cpu_bytes
    if need <= host.memory_gib * GIB:
        return []
    last = max(i for i, m in on_host if m.sleep is not None and m.sleep.level == 1)
    cpu = (
        f" + the cpu-profile instances' ≈{cpu_bytes / GIB:.1f} GiB = ≈{need / GIB:.1f} GiB"
        if cpu_bytes
        else ""
    )
    return [
        _problem(
            f"models[{last}].sleep.level",
            f"level-1 sleepers on {host.name} keep their weights in host memory: ≈{asleep.total / GIB:.1f} GiB "
            f"at worst ({what}){cpu}, the host has {host.memory_gib:g} GiB: sleep at level 2 (the wake reloads "
            "the weights from disk), or place fewer sleepers on it",
        )
    ]


def unused_swap_groups(spec: FleetSpec) -> list[Finding]:
    """A swap group no model is in (models[].sleep.group) is likely a typo: a warning."""
    used = {spec.swap_group(m) for m in spec.models}
    return [
        _warning(f"swap_groups.{n}", f"swap_groups.{n}: no model is in it (models[].sleep.group)")
        for n in spec.swap_groups
        if n not in used
    ]


class QueuePlan(NamedTuple):
    bound: int | None  # requests in flight before the engine answers 503 (--max-num-queued-reqs)
    findings: list[Finding]


def plan_queue(spec: FleetSpec, i: int, m: ModelInstance, suggested_max_num_seqs: int | None) -> QueuePlan:
    """The engine's admission bound: past it, requests get a fast 503 (the gateway tries another instance)."""
    path = f"models[{i}]"
    stack = spec.stack_of(m)
    if not engine_flags.release_has("--max-num-queued-reqs", stack.profile, stack.vllm_version):
        if m.max_num_queued_reqs == 0:
            return QueuePlan(None, [])  # unbounded on purpose
        version = f"{stack_path(spec.stack_name(m))}.vllm_version"
        message = (
            f"{path}.max_num_queued_reqs: vLLM {stack.vllm_version} ({version}) has no --max-num-queued-reqs, "
            "so the engine's queue cannot be bounded: under overload requests wait without end instead of "
            "getting a fast 503 the gateway spills to another instance; pin a release that has it"
        )
        return QueuePlan(None, [_warning(f"{path}.max_num_queued_reqs", message)])
    if m.queue_bound is not None or m.max_num_queued_reqs == 0:
        return QueuePlan(m.queue_bound, [])
    hint = f" (suggested {suggested_max_num_seqs})" if suggested_max_num_seqs else ""
    message = (
        f"{path}: unbounded request queue — set max_num_seqs{hint} (the queue bound defaults to twice it) "
        "or max_num_queued_reqs"
    )
    return QueuePlan(None, [_warning(f"{path}.max_num_queued_reqs", message)])


# --------------------------------------------------------------------------- memory: weights, KV cache, fit


class ModelSize(NamedTuple):
    params: int
    weight_bytes: int
    kv_bytes_per_token: int
    max_model_len: int


class KvBudget(NamedTuple):
    budget_bytes: int  # the instance's memory: GPUs × utilisation (gpu), weights + KV + overhead (cpu)
    kv_cache_bytes: int


class KvCapacity(NamedTuple):
    tokens: int
    concurrent_at_max_len: int
    suggested_max_num_seqs: int


@dataclass(frozen=True)
class MemoryPlan:
    """What the memory steps computed for one instance (None: not computed, a finding says why)."""

    facts_source: str
    size: ModelSize | None = None
    budget: KvBudget | None = None
    capacity: KvCapacity | None = None
    findings: list[Finding] = field(default_factory=list)
    # the LoRA slots' bytes (taken from the KV cache on the gpu profile, added to host memory on the cpu one);
    # None: LoRA off, or its size not known
    lora_bytes: int | None = None


def suggest_max_num_seqs(kv_tokens: int, max_model_len: int) -> int:
    """A max_num_seqs that the KV cache can hold without preemption storms.

    Assumes an average live sequence uses a quarter of max_model_len (chat traffic is mostly short) but never
    more sequences than KV for 2,048-token sequences; capped at 512 (vLLM's scheduler gains little past it)."""
    typical = max(1, min(max_model_len // 4, 2048))
    n = kv_tokens // typical
    n = max(1, min(MAX_SUGGESTED_SEQS, n))
    if n >= 16:
        n -= n % 8
    return n


def check_facts_known(
    spec: FleetSpec,
    i: int,
    m: ModelInstance,
    facts: ModelFacts,
    search_dirs: list[Path],
    fit_after_fetch: bool,
) -> list[Finding]:
    """The model's size must be known (config.json or ``shape``): a refusal on the gpu profile (a note on the
    cpu profile, or before the play has fetched the model)."""
    missing = facts.missing()
    if not missing:
        return []
    path = f"models[{i}]"
    where = ", ".join(str(d) for d in search_dirs) or "no --models-dir given"
    text = f"size of {m.source.repo} unknown: no config.json found ({where}) and shape lacks {', '.join(missing)}"
    if spec.stack_of(m).profile == "gpu" and not fit_after_fetch:
        fix = f"give {path}.shape or plan with --models-dir DIR (a folder holding the model, or a Hugging Face cache)"
        return [_problem(f"{path}.shape", f"{text}: {fix}")]
    later = " yet (the play plans again after the fetch)" if fit_after_fetch else f" (set {path}.shape)"
    return [_note(f"{path}.shape", f"{text}: memory not estimated{later}")]


def model_size(m: ModelInstance, facts: ModelFacts) -> ModelSize:
    """Weights, KV cache bytes per token and the context length of a model whose facts are known."""
    assert facts.params is not None and facts.num_layers and facts.num_kv_heads and facts.head_dim
    kvb = kv_bytes_per_token(facts.num_layers, facts.num_kv_heads, facts.head_dim, kv_dtype_bytes(m, facts))
    max_len = m.max_model_len or facts.max_position_embeddings or 4096
    return ModelSize(facts.params, weight_bytes(m, facts), kvb, max_len)


def check_max_model_len(i: int, m: ModelInstance, facts: ModelFacts) -> list[Finding]:
    limit = facts.max_position_embeddings
    if limit and m.max_model_len and m.max_model_len > limit:
        return [
            _problem(
                f"models[{i}].max_model_len",
                f"{m.max_model_len} exceeds the model's max_position_embeddings {limit}",
            )
        ]
    return []


def check_gpu_memory_known(
    spec: FleetSpec, i: int, m: ModelInstance, host: Host, fit_after_fetch: bool
) -> list[Finding]:
    """The fit needs the GPUs' memory: a refusal, or a note before the play has detected the GPUs."""
    if not (host.gpus.detect or not host.gpus.memory_gib):
        return []
    host_path = f"hosts[{spec.host_position(host.name)}].gpus"
    why = f"GPU memory of {host.name} unknown ({'detect: true' if host.gpus.detect else 'no memory_gib'})"
    if fit_after_fetch:
        return [_note(host_path, f"{why}: fit checked when the play plans again with the detected GPUs")]
    return [
        _problem(
            host_path,
            f"{why}, so models[{i}] ({m.name}) cannot be checked to fit: give {host_path}.memory_gib "
            "and compute_capability, or deploy with the play (it plans again with the GPUs it detects)",
        )
    ]


def gpu_kv_budget(m: ModelInstance, host: Host, weights: int, lora: int = 0) -> KvBudget:
    """GPUs × memory × utilisation; the KV cache is what weights, overhead and the LoRA slots (``lora`` bytes)
    leave (or the spec's size)."""
    n_gpu = max(1, sum(len(n.gpus) for n in m.nodes))  # weights ÷ TP·PP over every host
    budget = int(n_gpu * host.gpus.memory_gib * GIB * m.gpu_memory_utilization)
    overhead = n_gpu * (OVERHEAD_EAGER_PER_GPU_BYTES if m.enforce_eager else OVERHEAD_PER_GPU_BYTES)
    return KvBudget(budget, m.kv_cache_memory_bytes or budget - weights - overhead - lora)


def check_cpu_kv_explicit(i: int, m: ModelInstance) -> list[Finding]:
    if m.kv_cache_memory_bytes:
        return []
    return [
        _problem(
            f"models[{i}].kv_cache_memory_bytes",
            "the cpu profile needs an explicit KV cache size (otherwise vLLM takes most of the RAM)",
        )
    ]


def cpu_kv_budget(m: ModelInstance, weights: int, lora: int = 0) -> KvBudget:
    """The cpu profile: weights + the spec's KV cache + the process overhead + the LoRA slots, in host RAM."""
    kv = m.kv_cache_memory_bytes or 0
    return KvBudget(weights + kv + CPU_OVERHEAD_BYTES + lora, kv)


def check_host_memory(
    spec: FleetSpec, host: Host, i: int, m: ModelInstance, on_host: Placed, weights: Mapping[str, int]
) -> list[Finding]:
    """The host's cpu-profile instances up to ``models[i]`` (weights and LoRA slots where known: ``weights``, KV
    cache and overhead) fit its RAM; refused at the instance that tips it over (an instance on a gpu stack beside
    them holds its weights and KV cache on its GPUs)."""

    def need(x: ModelInstance) -> int:
        return weights.get(x.name, 0) + (x.kv_cache_memory_bytes or 0) + CPU_OVERHEAD_BYTES

    used = sum(need(x) for j, x in on_host if j <= i and spec.stack_of(x).profile == "cpu")
    if not (host.memory_gib and used > host.memory_gib * GIB >= used - need(m)):
        return []
    return [
        _problem(
            f"models[{i}].kv_cache_memory_bytes",
            f"instances on {host.name} need ≈{used / GIB:.1f} GiB (weights, KV cache, "
            f"{CPU_OVERHEAD_BYTES / GIB:.0f} GiB overhead each), host has {host.memory_gib:g} GiB",
        )
    ]


def plan_lora_bytes(
    spec: FleetSpec, i: int, m: ModelInstance, facts: ModelFacts
) -> tuple[int | None, list[Finding]]:
    """The bytes of ``models[i]``'s LoRA slots (None: LoRA off, or a note that they are not estimated)."""
    s = spec.lora_settings(m)
    if s is None:
        return None, []
    assert s.max_lora_rank is not None
    got = lora_bytes(m, facts, s.max_loras, s.max_lora_rank)
    if got is not None:
        return got, []
    return None, [
        _note(
            f"models[{i}].lora",
            f"models[{i}].lora: the LoRA slots' memory is not estimated (hidden_size, intermediate_size and "
            "num_attention_heads come from the model's config.json: plan with --models-dir DIR)",
        )
    ]


def check_fit(
    spec: FleetSpec, i: int, m: ModelInstance, host: Host, weights: int, kv: KvBudget, lora: int = 0
) -> list[Finding]:
    """The verdict: weights, overhead and LoRA slots must leave room for a KV cache."""
    if kv.kv_cache_bytes > 0:
        return []
    where = "gpus" if spec.stack_of(m).profile == "gpu" else "kv_cache_memory_bytes"
    slots = f" + LoRA slots ≈{lora / GIB:.1f} GiB" if lora else ""
    return [
        _problem(
            f"models[{i}].{where}",
            f"model does not fit: weights ≈{weights / GIB:.1f} GiB{slots} + overhead exceed the "
            f"{kv.budget_bytes / GIB:.1f} GiB budget ({len(m.gpus)} GPU(s) × {host.gpus.memory_gib} GiB × "
            f"gpu_memory_utilization {m.gpu_memory_utilization})",
        )
    ]


def kv_capacity(kv_cache_bytes: int, kv_per_token: int, max_model_len: int) -> KvCapacity:
    tokens = kv_cache_bytes // kv_per_token
    return KvCapacity(tokens, tokens // max_model_len, suggest_max_num_seqs(tokens, max_model_len))


def check_kv_capacity(i: int, m: ModelInstance, max_model_len: int, cap: KvCapacity) -> list[Finding]:
    """One sequence of max_model_len must fit the KV cache; a max_num_seqs far above the suggestion is a note."""
    found: list[Finding] = []
    if cap.tokens < max_model_len:
        found.append(
            _problem(
                f"models[{i}].max_model_len",
                f"KV cache holds {cap.tokens} tokens, less than one sequence of max_model_len {max_model_len}",
            )
        )
    if m.max_num_seqs and m.max_num_seqs > 4 * cap.suggested_max_num_seqs:
        found.append(
            _note(
                f"models[{i}].max_num_seqs",
                f"max_num_seqs {m.max_num_seqs} is far above the suggested {cap.suggested_max_num_seqs}: "
                "expect preemptions",
            )
        )
    return found


def plan_memory(
    spec: FleetSpec,
    i: int,
    m: ModelInstance,
    facts: ModelFacts,
    host: Host,
    on_host: Placed,
    cpu_weights: Mapping[str, int],
    search_dirs: list[Path],
    fit_after_fetch: bool,
) -> MemoryPlan:
    """``models[i]``'s memory: its size, KV budget and capacity, each step stopping at its refusal.
    ``cpu_weights``: weights of the cpu-profile instances planned before it (name → bytes)."""
    found = check_facts_known(spec, i, m, facts, search_dirs, fit_after_fetch)
    if found:
        return MemoryPlan(facts.source, findings=found)
    size = model_size(m, facts)
    found = check_max_model_len(i, m, facts)
    lora, lora_found = plan_lora_bytes(spec, i, m, facts)
    found += lora_found
    if spec.stack_of(m).profile == "gpu":
        stop = check_gpu_memory_known(spec, i, m, host, fit_after_fetch)
        if stop:
            return MemoryPlan(facts.source, size, findings=found + stop, lora_bytes=lora)
        budget = gpu_kv_budget(m, host, size.weight_bytes, lora or 0)
    else:
        stop = check_cpu_kv_explicit(i, m)
        if stop:
            return MemoryPlan(facts.source, size, findings=found + stop, lora_bytes=lora)
        budget = cpu_kv_budget(m, size.weight_bytes, lora or 0)
        resident = {**cpu_weights, m.name: size.weight_bytes + (lora or 0)}
        found += check_host_memory(spec, host, i, m, on_host, resident)
    stop = check_fit(spec, i, m, host, size.weight_bytes, budget, lora or 0)
    if stop:
        return MemoryPlan(facts.source, size, budget, findings=found + stop, lora_bytes=lora)
    cap = kv_capacity(budget.kv_cache_bytes, size.kv_bytes_per_token, size.max_model_len)
    return MemoryPlan(
        facts.source,
        size,
        budget,
        cap,
        found + check_kv_capacity(i, m, size.max_model_len, cap),
        lora_bytes=lora,
    )


# --------------------------------------------------------------------------- fleet-wide


class StackTable(NamedTuple):
    stacks: dict[str, dict[str, Any]]  # name → {profile, vllm_version, instances}
    findings: list[Finding]


def stack_path(name: str) -> str:
    """The spec field of a stack: ``stack`` (the fleet's) or ``stacks.NAME``."""
    return "stack" if name == DEFAULT_STACK else f"stacks.{name}"


def plan_stacks(spec: FleetSpec, lock_dir: Path | None) -> StackTable:
    """Every stack an instance runs (name → profile, release, instances), each with its lock in ``lock_dir``
    (``locks/PROFILE-VERSION.txt``; not checked without one); a named stack no instance runs is a warning."""
    used: dict[str, list[int]] = {}
    for i, m in enumerate(spec.models):
        used.setdefault(spec.stack_name(m), []).append(i)
    out: dict[str, dict[str, Any]] = {}
    found: list[Finding] = []
    for name, idx in used.items():
        st = spec.named_stack(name)
        out[name] = {
            "profile": st.profile,
            "vllm_version": st.vllm_version,
            "instances": [spec.models[i].name for i in idx],
        }
        lock = lock_dir / f"{st.profile}-{st.vllm_version}.txt" if lock_dir is not None else None
        if lock is not None and not lock.is_file():
            users = ", ".join(f"models[{i}] ({spec.models[i].name})" for i in idx)
            found.append(
                _problem(
                    f"{stack_path(name)}.vllm_version",
                    f"no lock {lock} for {st.profile} vLLM {st.vllm_version} (stack {name!r} of {users}): "
                    f"run `vllm-fleet lock --profile {st.profile} --vllm-version {st.vllm_version}`",
                )
            )
    found += [
        _warning(f"stacks.{n}", f"stacks.{n}: no instance runs it (models[].stack)")
        for n in spec.stacks
        if n not in used
    ]
    return StackTable(out, found)


class FlagTables(NamedTuple):
    known: dict[str, frozenset[str] | None]  # stack → its release's captured argument list (None: none)
    findings: list[Finding]


def load_flag_tables(
    spec: FleetSpec, stacks: Mapping[str, dict[str, Any]], allow_unchecked: bool
) -> FlagTables:
    """Each stack's captured argument list; a stack without one whose instances have extra_args is a warning
    when they may go unchecked."""
    known: dict[str, frozenset[str] | None] = {}
    found: list[Finding] = []
    for name, st in stacks.items():
        known[name] = engine_flags.load(st["profile"], st["vllm_version"])
        if (
            known[name] is None
            and allow_unchecked
            and any(m.extra_args for m in spec.models if spec.stack_name(m) == name)
        ):
            message = (
                f"no captured argument list for {st['profile']} vLLM {st['vllm_version']}: extra_args "
                "checked for managed flags only (--allow-unchecked-flags)"
            )
            found.append(_warning(stack_path(name), message))
    return FlagTables(known, found)


def check_alerts(spec: FleetSpec) -> list[Finding]:
    """Alert thresholds that cannot work (e.g. a TTFT SLO that is not a histogram bucket bound)."""
    from vllm_fleet.fleet.observability.thresholds import check_alert_thresholds

    return [_problem(path, reason) for path, reason in check_alert_thresholds(spec)]


def check_primaries(spec: FleetSpec) -> list[Finding]:
    """Every served model needs a primary instance somewhere."""
    found: list[Finding] = []
    for name in sorted({m.served_model_name for m in spec.models}):
        if "primary" not in {m.role for m in spec.models_of(name)}:
            idx = next(i for i, m in enumerate(spec.models) if m.served_model_name == name)
            found.append(_problem(f"models[{idx}].role", f"model {name!r} has no primary instance"))
    return found


# --------------------------------------------------------------------------- the gateway's connections


# connections nginx holds for one request the gateway keeps, waiting or running, with gateway.limits on: the
# client's, the auth_request subrequest's to the admission service (held while the request waits), the
# upstream's to an engine
CONNECTIONS_PER_REQUEST = 3
# what the gateway role writes into nginx.conf at the least (Debian's has 768 per worker), and on top of the
# worst case: the idle keep-alive pools (the engines', the admission service's), health checks, stub_status
NGINX_MIN_WORKER_CONNECTIONS = 4096
NGINX_SPARE_CONNECTIONS = 1024


def serving_capacity(spec: FleetSpec, instances: Iterable[Any]) -> dict[str, int]:
    """Served model → requests in flight its serving instances hold (the sum of their queue bounds; planned
    instances: ``InstancePlan``); a model with an instance whose queue is unbounded is left out (unlimited).
    Backups (they serve only when every primary is down), canaries (rollouts: a leased share of the requests,
    taken from the stable instances', nothing without a live lease) and instances the spec keeps drained do
    not count; fallbacks do (the spill-over reaches them)."""
    bounds: dict[str, list[int | None]] = {}
    seen: set[str] = set()
    for ip in instances:
        if ip.name in seen or ip.name in spec.gateway.drained or ip.role in ("backup", "canary"):
            continue
        seen.add(ip.name)
        bounds.setdefault(ip.served_model_name, []).append(ip.queue_bound)
    return {
        model: sum(b for b in bs if b is not None)
        for model, bs in sorted(bounds.items())
        if bs and all(b is not None for b in bs)
    }


def gateway_worst_case(spec: FleetSpec, capacity: Mapping[str, int]) -> int | None:
    """The connections nginx holds when the gateway is full with gateway.limits on: every request waiting
    (``max_queued``) and every one the engines hold in flight (``capacity``), ``CONNECTIONS_PER_REQUEST`` each;
    None without the admission service (nothing waits in the gateway)."""
    if not spec.gateway.admission:
        return None
    return CONNECTIONS_PER_REQUEST * (spec.gateway.limits.max_queued + sum(capacity.values()))


def worker_connections(spec: FleetSpec, capacity: Mapping[str, int]) -> int:
    """nginx's worker_connections on the gateway host: ``gateway.worker_connections``, else enough for the
    worst case in one worker (nginx spreads new connections over its workers unevenly, and a request's
    subrequest and upstream connections stay in its client's worker) plus the spare."""
    if spec.gateway.worker_connections is not None:
        return spec.gateway.worker_connections
    worst = gateway_worst_case(spec, capacity) or 0
    # rounded up to a power of two: an engine's max_num_seqs or queue bound changed by a day-2 edit must not
    # rewrite nginx.conf, since the reload that follows closes the clients' idle keep-alive connections
    need = max(NGINX_MIN_WORKER_CONNECTIONS, worst + NGINX_SPARE_CONNECTIONS)
    return 1 << (need - 1).bit_length()


def check_worker_connections(spec: FleetSpec, capacity: Mapping[str, int]) -> list[Finding]:
    """A ``gateway.worker_connections`` below the gateway's worst case with limits on: past it nginx refuses
    new connections ("worker_connections are not enough") and an auth_request that cannot connect is admitted
    unlimited (on_failure open) or refused (closed)."""
    given, worst = spec.gateway.worker_connections, gateway_worst_case(spec, capacity)
    if given is None or worst is None or given >= worst:
        return []
    held = sum(capacity.values())
    return [
        _problem(
            "gateway.worker_connections",
            f"{given} is below what the gateway holds at its worst with gateway.limits on: "
            f"{CONNECTIONS_PER_REQUEST} connections per request (the client's, the admission subrequest's, the "
            f"engine's) × (gateway.limits.max_queued {spec.gateway.limits.max_queued} waiting + {held} in flight "
            f"in the engines (their queue bounds: models[].max_num_seqs / max_num_queued_reqs)) = {worst}, in one "
            "nginx worker at worst: raise it, lower gateway.limits.max_queued, or leave it out (the plan's "
            f"figure, {worst + NGINX_SPARE_CONNECTIONS})",
        )
    ]


def check_gateway_auth(spec: FleetSpec) -> list[Finding]:
    if not (spec.gateway.enabled and spec.gateway.auth == "none"):
        return []
    where = spec.gateway.virtual_address.split("/")[0] if spec.gateway_ha else spec.gateway_host
    message = (
        f"gateway.auth: none: the gateway on {where}:{spec.gateway.port} serves anyone who reaches "
        "it, without an API key (docs/security.md)"
    )
    return [_warning("gateway.auth", message)]


def _address_field(spec: FleetSpec, name: str) -> tuple[str, str]:
    """(spec field, value) of host ``name``'s fleet-internal address: private_address, else address."""
    i = spec.host_position(name)
    h = spec.hosts[i]
    return (
        (f"hosts[{i}].private_address", h.private_address)
        if h.private_address
        else (f"hosts[{i}].address", h.address)
    )


def check_gateway_ha(spec: FleetSpec) -> list[Finding]:
    """Two or more gateways behind ``gateway.virtual_address`` (docs/design/ha.md): each gateway's fleet address
    an IPv4 address (keepalived's unicast peers), the virtual address in their network and nobody's own, and
    nginx listening on every address (the virtual one comes and goes)."""
    if not spec.gateway_ha:
        return []
    gw = spec.gateway
    vip = ipaddress.IPv4Interface(gw.virtual_address)
    found: list[Finding] = []
    if gw.listen_address != "0.0.0.0":
        found.append(
            _problem(
                "gateway.listen_address",
                f"{gw.listen_address!r}: with gateway.hosts nginx must listen on 0.0.0.0, so that it answers on "
                f"the virtual address {vip.ip} whenever keepalived moves it to its host",
            )
        )
    for h in spec.hosts:
        for field_, value in (("address", h.address), ("private_address", h.private_address)):
            if value and value == str(vip.ip):
                found.append(
                    _problem(
                        "gateway.virtual_address",
                        f"{vip.ip} is the {field_} of host {h.name!r}: the virtual address must be one no host has",
                    )
                )
    prefixed = "/" in gw.virtual_address
    for name in spec.gateway_hosts:
        path, value = _address_field(spec, name)
        try:
            addr = ipaddress.ip_address(value)
        except ValueError:
            addr = None
        if not isinstance(addr, ipaddress.IPv4Address):
            found.append(
                _problem(
                    path,
                    f"{value!r}: gateway host {name!r} needs an IPv4 address here (keepalived's unicast peers "
                    "and source are addresses, and the virtual address is IPv4)",
                )
            )
        elif prefixed and addr not in vip.network:
            found.append(
                _problem(
                    "gateway.virtual_address",
                    f"{gw.virtual_address} is not in the network of gateway host {name!r} ({value}): the address "
                    "moves between hosts of one network (docs/design/ha.md for gateways across subnets)",
                )
            )
    if not prefixed:
        found.append(
            _warning(
                "gateway.virtual_address",
                f"gateway.virtual_address {vip.ip} has no /prefix: it is added as /32 and plan cannot check that it "
                "is in the gateway hosts' network; give its prefix (e.g. /24)",
            )
        )
    return found
