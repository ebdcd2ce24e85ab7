"""Capacity planning and refusals: GPUs → instances, ports, memory fit, FP8 support, engine flags."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from vllm_fleet.contracts import parse_nvidia_smi
from vllm_fleet.fleet import engine_flags
from vllm_fleet.fleet.modelinfo import (
    ModelFacts,
    facts_for,
    facts_from_config,
    kv_bytes_per_token,
    kv_dtype_bytes,
    weight_bytes,
)
from vllm_fleet.fleet.multinode import check_multi_node
from vllm_fleet.fleet.spec import COMMIT_RE, DEFAULT_STACK, FleetSpec, Host, ModelInstance, Stack

GIB = 1024**3
# Memory vLLM needs besides weights and KV cache on each GPU: CUDA context, activations during the
# profile run, NCCL buffers, CUDA graphs. Conservative figures; the real value is logged by vLLM at start.
OVERHEAD_PER_GPU_BYTES = int(2.0 * GIB)
OVERHEAD_EAGER_PER_GPU_BYTES = int(1.25 * GIB)
# on the cpu profile, vLLM's own process overhead besides weights and KV (API server + engine core)
CPU_OVERHEAD_BYTES = int(2.0 * GIB)
MAX_SUGGESTED_SEQS = 512
FP8_MIN_CC = (8, 9)
BF16_MIN_CC = (8, 0)


def apply_detected(host: Host, detected: dict[str, Any] | None) -> Host:
    """``host`` with what the play read on it (``vllm-fleet plan --detected FILE``: per host, ``gpus``: a list of
    {name, memory_mib, compute_capability}, or ``nvidia_smi``: the CSV of ``nvidia-smi --query-gpu=`` with
    doctor's fields, and ``memory_mib`` of the host): detected GPUs replace a
    ``detect: true`` inventory (and fill fields the spec leaves empty); host memory fills ``memory_gib``."""
    if not detected:
        return host
    update: dict[str, Any] = {}
    gpus = detected.get("gpus") or []
    if not gpus and detected.get("nvidia_smi"):
        # nvidia-smi's CSV as the preflight read it: the query of `vllm-fleet doctor` (one parser, a contract)
        gpus = [
            {"name": g["name"], "memory_mib": g["memory.total"], "compute_capability": g["compute_cap"]}
            for g in parse_nvidia_smi(detected["nvidia_smi"])
        ]
    inv = host.gpus
    if gpus and (inv.detect or not (inv.count and inv.memory_gib and inv.compute_capability)):
        update["gpus"] = inv.model_copy(
            update={
                "count": len(gpus) if inv.detect or not inv.count else inv.count,
                "model": inv.model if inv.model and not inv.detect else str(gpus[0].get("name", "")),
                "memory_gib": min(float(g["memory_mib"]) for g in gpus) / 1024
                if inv.detect or not inv.memory_gib
                else inv.memory_gib,
                "compute_capability": min(str(g["compute_capability"]) for g in gpus)
                if inv.detect or not inv.compute_capability
                else inv.compute_capability,
                "detect": False,
            }
        )
    if not host.memory_gib and detected.get("memory_mib"):
        update["memory_gib"] = float(detected["memory_mib"]) / 1024
    return host.model_copy(update=update) if update else host


@dataclass
class Problem:
    path: str
    reason: str

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}"


@dataclass
class InstancePlan:
    name: str
    host: str
    port: int
    gpus: list[int]
    role: str
    served_model_name: str
    # the engine stack it runs (models[].stack; "default": the fleet's `stack`), its profile and release
    stack: str = DEFAULT_STACK
    profile: str = ""
    vllm_version: str = ""
    params: int | None = None
    weight_bytes: int | None = None
    kv_bytes_per_token: int | None = None
    memory_budget_bytes: int | None = None
    kv_cache_bytes: int | None = None
    kv_capacity_tokens: int | None = None
    max_model_len: int | None = None
    max_concurrent_at_max_len: int | None = None
    suggested_max_num_seqs: int | None = None
    configured_max_num_seqs: int | None = None
    queue_bound: int | None = None  # requests in flight before the engine answers 503 (--max-num-queued-reqs)
    start_after: list[str] = field(default_factory=list)
    facts_source: str = "spec"
    notes: list[str] = field(default_factory=list)


@dataclass
class HostPlan:
    name: str
    address: str
    gpu_count: int
    gpu_model: str
    gpu_memory_gib: float
    instances: list[str]
    gpu_map: dict[int, list[str]]
    ports: dict[int, str]


@dataclass
class Plan:
    fleet: str
    profile: str
    vllm_version: str
    hosts: list[HostPlan]
    instances: list[InstancePlan]
    problems: list[Problem]
    warnings: list[str]
    # every stack an instance runs: name → {profile, vllm_version, instances}
    stacks: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems

    def instance(self, name: str) -> InstancePlan:
        return next(i for i in self.instances if i.name == name)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ok"] = self.ok
        d["problems"] = [str(p) for p in self.problems]
        return d


def _host_service_ports(spec: FleetSpec, host: str) -> list[tuple[int, str]]:
    """(port, field) of each of our other services on this host, in spec order (a port may repeat)."""
    ports: list[tuple[int, str]] = []
    if spec.gateway.enabled and spec.gateway_host == host:
        ports.append((spec.gateway.port, "gateway.port"))
        ports.append((spec.gateway.stub_status_port, "gateway.stub_status_port"))
        if spec.gateway.tls:
            ports.append((spec.gateway.tls.port, "gateway.tls.port"))
    if spec.monitoring.enabled and spec.monitoring_host == host:
        ports.append((spec.monitoring.prometheus_port, "monitoring.prometheus_port"))
        ports.append((spec.monitoring.alertmanager_port, "monitoring.alertmanager_port"))
    if spec.monitoring.enabled:
        ports.append((spec.monitoring.node_exporter_port, "monitoring.node_exporter_port"))
        ports.append((spec.monitoring.exporter_port, "monitoring.exporter_port"))
        if spec.gateway.enabled and spec.gateway_host == host:
            ports.append((spec.monitoring.nginx_exporter_port, "monitoring.nginx_exporter_port"))
    return ports


def _models_by_host(spec: FleetSpec) -> dict[str, list[tuple[int, ModelInstance]]]:
    """Each host's instances with their index in ``spec.models``, in spec order (one pass over the models)."""
    by_host: dict[str, list[tuple[int, ModelInstance]]] = {h.name: [] for h in spec.hosts}
    for i, m in enumerate(spec.models):
        by_host.setdefault(m.host, []).append((i, m))
    return by_host


def _service_ports(spec: FleetSpec, host: Host, problems: list[Problem]) -> dict[int, str]:
    """port → owner of the services (gateway, monitoring) on ``host``; a port taken twice is a problem."""
    ports: dict[int, str] = {}
    for port, owner in _host_service_ports(spec, host.name):
        if port in ports:
            problems.append(Problem(owner, f"port {port} on {host.name} is already used by {ports[port]}"))
        else:
            ports[port] = owner
    return ports


def _claim_port(host: Host, i: int, m: ModelInstance, ports: dict[int, str], problems: list[Problem]) -> None:
    """Instance ``models[i]`` takes its port on ``host``, unless a service or an earlier instance has it."""
    if m.port in ports:
        problems.append(
            Problem(f"models[{i}].port", f"port {m.port} on {host.name} is already used by {ports[m.port]}")
        )
    else:
        ports[m.port] = f"models[{i}] ({m.name})"


def _check_gpus(
    spec: FleetSpec,
    host: Host,
    i: int,
    m: ModelInstance,
    gpu_owner: dict[int, int],
    gpu_map: dict[int, list[str]],
    problems: list[Problem],
) -> None:
    """One instance on the gpu profile: tensor parallel size = its GPUs, the GPUs exist and are its own
    (unless both share them), FP8 on a GPU that has it. Records the GPUs it uses in ``gpu_owner`` (first
    instance) and ``gpu_map`` (every instance)."""
    path = f"models[{i}]"
    if m.tensor_parallel_size != len(m.gpus):
        problems.append(
            Problem(
                f"{path}.tensor_parallel_size",
                f"tensor_parallel_size {m.tensor_parallel_size} != {len(m.gpus)} GPU(s) in gpus {m.gpus}",
            )
        )
    if not host.gpus.detect and host.gpus.count:
        bad = [g for g in m.gpus if g >= host.gpus.count]
        if bad:
            problems.append(
                Problem(
                    f"{path}.gpus", f"GPU {bad[0]} does not exist on {host.name} ({host.gpus.count} GPUs)"
                )
            )
    for g in m.gpus:
        if g in gpu_owner:
            j = gpu_owner[g]
            other = spec.models[j]
            if not (m.share_gpus and other.share_gpus):
                problems.append(
                    Problem(
                        f"{path}.gpus",
                        f"GPU {g} on {host.name} is already used by models[{j}] ({other.name})",
                    )
                )
        else:
            gpu_owner[g] = i
        gpu_map.setdefault(g, []).append(m.name)


def _check_dtypes(
    host: Host, i: int, m: ModelInstance, facts: ModelFacts, problems: list[Problem], detected: bool
) -> None:
    """bf16 needs compute capability 8.0, FP8 (weights or KV cache, declared or the checkpoint's) 8.9."""
    cc = host.gpus.cc_tuple()
    if cc is None:
        return
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
    if fp8_field and cc < FP8_MIN_CC:
        what = "an FP8 checkpoint (config.json quantization_config)" if fp8_field == "source" else "FP8"
        problems.append(
            Problem(f"{path}.{fp8_field}", f"{what} needs compute capability >= 8.9; {host.name} has {gpus}")
        )
    if m.dtype == "bfloat16" and cc < BF16_MIN_CC:
        problems.append(
            Problem(
                f"{path}.dtype",
                f"bfloat16 needs compute capability >= 8.0; {host.name} has {gpus}: use dtype float16",
            )
        )


def _check_shared_gpus(
    spec: FleetSpec, host: Host, gpu_map: dict[int, list[str]], problems: list[Problem]
) -> None:
    """Instances sharing a GPU: their gpu_memory_utilization must add up to 0.95 at most."""
    for g, names in gpu_map.items():
        if len(names) > 1 and all(spec.model(n).share_gpus for n in names):
            total = sum(spec.model(n).gpu_memory_utilization for n in names)
            if total > 0.95:
                problems.append(
                    Problem(
                        f"models[{spec.models.index(spec.model(names[-1]))}].gpu_memory_utilization",
                        f"instances sharing GPU {g} on {host.name} ({', '.join(names)}) ask for "
                        f"{total:.2f} of its memory in total (max 0.95)",
                    )
                )


def _check_layout(
    spec: FleetSpec,
    problems: list[Problem],
    by_host: dict[str, list[tuple[int, ModelInstance]]],
    effective: list[Host],
) -> list[HostPlan]:
    """Per host: ports, GPUs (gpu profile) or tensor_parallel_size 1 (cpu profile); its HostPlan.
    ``effective``: ``spec.hosts`` with what the play detected on them."""
    hosts: list[HostPlan] = []
    for host in effective:
        ports = _service_ports(spec, host, problems)
        gpu_map: dict[int, list[str]] = {}
        gpu_owner: dict[int, int] = {}
        for i, m in by_host[host.name]:
            _claim_port(host, i, m, ports, problems)
            if m.placement:
                continue  # devices over several hosts: fleet/multinode.py
            if spec.stack_of(m).profile == "gpu":
                _check_gpus(spec, host, i, m, gpu_owner, gpu_map, problems)
                continue
            if m.tensor_parallel_size != 1:
                problems.append(
                    Problem(
                        f"models[{i}].tensor_parallel_size", "the cpu profile runs tensor_parallel_size 1"
                    )
                )
            if m.gpus:
                # a cpu-profile instance beside gpu ones must not take (or hide) their devices
                problems.append(
                    Problem(
                        f"models[{i}].gpus",
                        f"the cpu profile uses no GPUs (stack {spec.stack_name(m)!r}): leave gpus empty",
                    )
                )
        _check_shared_gpus(spec, host, gpu_map, problems)
        hosts.append(
            HostPlan(
                name=host.name,
                address=host.address,
                gpu_count=host.gpus.count,
                gpu_model=host.gpus.model,
                gpu_memory_gib=host.gpus.memory_gib,
                instances=[m.name for _, m in by_host[host.name]],
                gpu_map=dict(sorted(gpu_map.items())),
                ports=dict(sorted(ports.items())),
            )
        )
    return hosts


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


def _plan_memory(
    spec: FleetSpec,
    i: int,
    m: ModelInstance,
    facts: ModelFacts,
    search_dirs: list[Path],
    problems: list[Problem],
    ip: InstancePlan,
    host: Host,
    on_host: list[tuple[int, ModelInstance]],
    fit_after_fetch: bool,
    weights_on_host: dict[str, int],
) -> None:
    path = f"models[{i}]"
    ip.facts_source = facts.source
    missing = facts.missing()
    if missing:
        where = ", ".join(str(d) for d in search_dirs) or "no --models-dir given"
        text = (
            f"size of {m.source.repo} unknown: no config.json found ({where}) and shape lacks "
            f"{', '.join(missing)}"
        )
        if spec.stack_of(m).profile == "gpu" and not fit_after_fetch:
            problems.append(
                Problem(
                    f"{path}.shape",
                    f"{text}: give {path}.shape or plan with --models-dir DIR (a folder holding the model, "
                    "or a Hugging Face cache)",
                )
            )
        else:
            ip.notes.append(
                f"{text}: memory not estimated"
                + (
                    " yet (the play plans again after the fetch)"
                    if fit_after_fetch
                    else f" (set {path}.shape)"
                )
            )
        return
    assert facts.params is not None and facts.num_layers and facts.num_kv_heads and facts.head_dim
    ip.params = facts.params
    ip.weight_bytes = weight_bytes(m, facts)
    kvb = kv_bytes_per_token(facts.num_layers, facts.num_kv_heads, facts.head_dim, kv_dtype_bytes(m, facts))
    ip.kv_bytes_per_token = kvb
    max_len = m.max_model_len or facts.max_position_embeddings or 4096
    ip.max_model_len = max_len
    if facts.max_position_embeddings and m.max_model_len and m.max_model_len > facts.max_position_embeddings:
        problems.append(
            Problem(
                f"{path}.max_model_len",
                f"{m.max_model_len} exceeds the model's max_position_embeddings {facts.max_position_embeddings}",
            )
        )
    if spec.stack_of(m).profile == "gpu":
        if host.gpus.detect or not host.gpus.memory_gib:
            host_path = f"hosts[{[h.name for h in spec.hosts].index(host.name)}].gpus"
            why = f"GPU memory of {host.name} unknown ({'detect: true' if host.gpus.detect else 'no memory_gib'})"
            if fit_after_fetch:
                ip.notes.append(f"{why}: fit checked when the play plans again with the detected GPUs")
            else:
                problems.append(
                    Problem(
                        host_path,
                        f"{why}, so {path} ({m.name}) cannot be checked to fit: give {host_path}.memory_gib "
                        "and compute_capability, or deploy with the play (it plans again with the GPUs it "
                        "detects)",
                    )
                )
            return
        n_gpu = max(1, sum(len(n.gpus) for n in m.nodes))  # weights ÷ TP·PP over every host
        budget = int(n_gpu * host.gpus.memory_gib * GIB * m.gpu_memory_utilization)
        overhead = n_gpu * (OVERHEAD_EAGER_PER_GPU_BYTES if m.enforce_eager else OVERHEAD_PER_GPU_BYTES)
        kv = m.kv_cache_memory_bytes or budget - ip.weight_bytes - overhead
    else:
        kv = m.kv_cache_memory_bytes or 0
        budget = ip.weight_bytes + kv + CPU_OVERHEAD_BYTES
        if not m.kv_cache_memory_bytes:
            problems.append(
                Problem(
                    f"{path}.kv_cache_memory_bytes",
                    "the cpu profile needs an explicit KV cache size (otherwise vLLM takes most of the RAM)",
                )
            )
            return
        weights_on_host[m.name] = ip.weight_bytes

        def need(x: ModelInstance) -> int:
            return weights_on_host.get(x.name, 0) + (x.kv_cache_memory_bytes or 0) + CPU_OVERHEAD_BYTES

        # the host's instances up to this one: weights (where known), KV cache and overhead; refused at the
        # instance that tips it over
        # (cpu-profile ones: an instance on a gpu stack beside it holds its weights and KV cache on its GPUs)
        used = sum(need(x) for j, x in on_host if j <= i and spec.stack_of(x).profile == "cpu")
        if host.memory_gib and used > host.memory_gib * GIB >= used - need(m):
            problems.append(
                Problem(
                    f"{path}.kv_cache_memory_bytes",
                    f"instances on {host.name} need ≈{used / GIB:.1f} GiB (weights, KV cache, "
                    f"{CPU_OVERHEAD_BYTES / GIB:.0f} GiB overhead each), host has {host.memory_gib:g} GiB",
                )
            )
    ip.memory_budget_bytes = budget
    ip.kv_cache_bytes = kv
    if kv <= 0:
        problems.append(
            Problem(
                f"{path}.gpus" if spec.stack_of(m).profile == "gpu" else f"{path}.kv_cache_memory_bytes",
                f"model does not fit: weights ≈{ip.weight_bytes / GIB:.1f} GiB + overhead exceed the "
                f"{budget / GIB:.1f} GiB budget ({len(m.gpus)} GPU(s) × {host.gpus.memory_gib} GiB × "
                f"gpu_memory_utilization {m.gpu_memory_utilization})",
            )
        )
        return
    ip.kv_capacity_tokens = kv // kvb
    ip.max_concurrent_at_max_len = ip.kv_capacity_tokens // max_len
    if ip.kv_capacity_tokens < max_len:
        problems.append(
            Problem(
                f"{path}.max_model_len",
                f"KV cache holds {ip.kv_capacity_tokens} tokens, less than one sequence of max_model_len {max_len}",
            )
        )
    ip.suggested_max_num_seqs = suggest_max_num_seqs(ip.kv_capacity_tokens, max_len)
    if m.max_num_seqs and m.max_num_seqs > 4 * ip.suggested_max_num_seqs:
        ip.notes.append(
            f"max_num_seqs {m.max_num_seqs} is far above the suggested {ip.suggested_max_num_seqs}: expect preemptions"
        )


def _plan_queue(spec: FleetSpec, i: int, m: ModelInstance, warnings: list[str], ip: InstancePlan) -> None:
    """The engine's admission bound: past it, requests get a fast 503 (the gateway tries another instance)."""
    path = f"models[{i}]"
    stack = spec.stack_of(m)
    if not engine_flags.release_has("--max-num-queued-reqs", stack.profile, stack.vllm_version):
        if m.max_num_queued_reqs:
            warnings.append(
                f"{path}.max_num_queued_reqs: vLLM {stack.vllm_version} has no --max-num-queued-reqs; "
                "its queue stays unbounded"
            )
        return
    ip.queue_bound = m.queue_bound
    if ip.queue_bound is None and m.max_num_queued_reqs != 0:
        hint = f" (suggested {ip.suggested_max_num_seqs})" if ip.suggested_max_num_seqs else ""
        warnings.append(
            f"{path}: unbounded request queue — set max_num_seqs{hint} (the queue bound defaults to twice it) "
            "or max_num_queued_reqs"
        )


def _start_order(
    spec: FleetSpec, instances: list[InstancePlan], by_host: dict[str, list[tuple[int, ModelInstance]]]
) -> None:
    """Instances sharing a GPU start one after another, in spec order."""
    by_name: dict[str, InstancePlan] = {}
    for x in instances:
        by_name.setdefault(x.name, x)
    for host in spec.hosts:
        previous: dict[int, str] = {}
        for _, m in by_host[host.name]:
            ip = by_name[m.name]
            after = sorted({previous[g] for g in m.gpus if g in previous})
            ip.start_after = after
            for g in m.gpus:
                previous[g] = m.name


def _check_extra_args(
    spec: FleetSpec,
    i: int,
    m: ModelInstance,
    known: frozenset[str] | None,
    allow_unchecked: bool,
    problems: list[Problem],
) -> None:
    """Unknown and managed flags in ``extra_args`` on every profile. Without a captured argument list for the
    pinned release, extra_args are refused unless ``allow_unchecked`` (then managed flags still are)."""
    if not m.extra_args:
        return
    stack = spec.stack_of(m)
    if known is None:
        if not allow_unchecked:
            problems.append(
                Problem(
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
    for j, reason in engine_flags.check_args(m.extra_args, known):
        problems.append(Problem(f"models[{i}].extra_args[{j}]", reason))


def _fetched_facts(detected: dict[str, Any], m: ModelInstance) -> ModelFacts | None:
    """The facts of ``m`` as its host read them after the fetch (``detected[HOST]["models"][NAME]``:
    ``config``, the config.json, and ``weight_bytes``; what ``vllm-fleet fetch --json`` reports)."""
    got = (detected.get("models") or {}).get(m.name) or {}
    if not isinstance(got.get("config"), dict):
        return None
    return facts_from_config(got["config"], got.get("weight_bytes"), f"{m.host}:{got.get('path', m.name)}")


def _stack_path(name: str) -> str:
    """The spec field of a stack: ``stack`` (the fleet's) or ``stacks.NAME``."""
    return "stack" if name == DEFAULT_STACK else f"stacks.{name}"


def _plan_stacks(
    spec: FleetSpec, lock_dir: Path | None, problems: list[Problem], warnings: list[str]
) -> dict[str, dict[str, Any]]:
    """Every stack an instance runs (name → profile, release, instances), each with its lock in ``lock_dir``
    (``locks/PROFILE-VERSION.txt``; not checked without one); a named stack no instance runs is a warning."""
    used: dict[str, list[int]] = {}
    for i, m in enumerate(spec.models):
        used.setdefault(spec.stack_name(m), []).append(i)
    out: dict[str, dict[str, Any]] = {}
    for name, idx in used.items():
        st: Stack = spec.named_stack(name)
        out[name] = {
            "profile": st.profile,
            "vllm_version": st.vllm_version,
            "instances": [spec.models[i].name for i in idx],
        }
        if lock_dir is None:
            continue
        lock = lock_dir / f"{st.profile}-{st.vllm_version}.txt"
        if not lock.is_file():
            users = ", ".join(f"models[{i}] ({spec.models[i].name})" for i in idx)
            problems.append(
                Problem(
                    f"{_stack_path(name)}.vllm_version",
                    f"no lock {lock} for {st.profile} vLLM {st.vllm_version} (stack {name!r} of {users}): "
                    f"run `vllm-fleet lock --profile {st.profile} --vllm-version {st.vllm_version}`",
                )
            )
    for name in spec.stacks:
        if name not in used:
            warnings.append(f"stacks.{name}: no instance runs it (models[].stack)")
    return out


def make_plan(
    spec: FleetSpec,
    search_dirs: list[Path] | None = None,
    allow_unchecked_flags: bool = False,
    detected: dict[str, dict[str, Any]] | None = None,
    fit_after_fetch: bool = False,
    lock_dir: Path | None = None,
) -> Plan:
    """The plan of ``spec``. ``search_dirs``: where local copies of the models are (config.json and weight
    sizes); ``detected``: what the play read on each host (GPUs, memory; see ``apply_detected``);
    ``fit_after_fetch``: a model of unknown size or GPUs still to be detected are notes, not refusals (the
    play's first plan, before it has fetched the models and read the GPUs); ``lock_dir``: the controller's
    lock folder, where each stack an instance runs must have its lock. Every per-instance check uses the
    instance's own stack (``models[].stack``): its profile's rules and its release's argument list."""
    problems: list[Problem] = []
    warnings: list[str] = []
    search_dirs = search_dirs or []
    detected = detected or {}
    by_host = _models_by_host(spec)
    effective = [apply_detected(h, detected.get(h.name)) for h in spec.hosts]
    host_of = {h.name: h for h in reversed(effective)}  # the first of a name, as spec.host() finds
    hosts = _check_layout(spec, problems, by_host, effective)
    problems += [Problem(p, r) for p, r in check_multi_node(spec, {h.name: h.ports for h in hosts})]
    weights_on_host: dict[str, int] = {}
    instances: list[InstancePlan] = []
    stacks = _plan_stacks(spec, lock_dir, problems, warnings)
    # each stack's captured argument list (None: nothing captured for that release)
    flag_tables: dict[str, frozenset[str] | None] = {}
    for name, st in stacks.items():
        flag_tables[name] = engine_flags.load(st["profile"], st["vllm_version"])
        if (
            flag_tables[name] is None
            and allow_unchecked_flags
            and any(m.extra_args for m in spec.models if spec.stack_name(m) == name)
        ):
            warnings.append(
                f"no captured argument list for {st['profile']} vLLM {st['vllm_version']}: extra_args "
                "checked for managed flags only (--allow-unchecked-flags)"
            )
    for i, m in enumerate(spec.models):
        if m.source.kind != "path" and not COMMIT_RE.fullmatch(m.source.revision):
            warnings.append(
                f"models[{i}].source.{m.source.kind}.revision {m.source.revision!r} is not a commit hash: "
                "pin the exact commit you validated"
            )
        ip = InstancePlan(
            name=m.name,
            host=m.host,
            port=m.port,
            gpus=list(m.gpus),
            role=m.role,
            served_model_name=m.served_model_name,
            stack=spec.stack_name(m),
            profile=spec.stack_of(m).profile,
            vllm_version=spec.stack_of(m).vllm_version,
            configured_max_num_seqs=m.max_num_seqs,
        )
        facts = facts_for(m, search_dirs, _fetched_facts(detected.get(m.host, {}), m))
        host = host_of[m.host]
        if ip.profile == "gpu":  # the gpu profile's rules for gpu-profile instances only
            _check_dtypes(host, i, m, facts, problems, bool(detected.get(m.host, {}).get("gpus")))
        _plan_memory(
            spec,
            i,
            m,
            facts,
            search_dirs,
            problems,
            ip,
            host,
            by_host[m.host],
            fit_after_fetch,
            weights_on_host,
        )
        _plan_queue(spec, i, m, warnings, ip)
        _check_extra_args(spec, i, m, flag_tables[ip.stack], allow_unchecked_flags, problems)
        instances.append(ip)
    _start_order(spec, instances, by_host)
    # alert thresholds that cannot work (e.g. a TTFT SLO that is not a histogram bucket bound)
    from vllm_fleet.fleet.observability.thresholds import check_alert_thresholds

    problems += [Problem(path, reason) for path, reason in check_alert_thresholds(spec)]
    # every model needs a primary somewhere
    served = {m.served_model_name for m in spec.models}
    for name in sorted(served):
        roles = {m.role for m in spec.models if m.served_model_name == name}
        if "primary" not in roles:
            idx = next(i for i, m in enumerate(spec.models) if m.served_model_name == name)
            problems.append(Problem(f"models[{idx}].role", f"model {name!r} has no primary instance"))
    if spec.gateway.enabled and spec.gateway.auth == "none":
        warnings.append(
            f"gateway.auth: none: the gateway on {spec.gateway_host}:{spec.gateway.port} serves anyone who reaches "
            "it, without an API key (docs/security.md)"
        )
    return Plan(
        fleet=spec.name,
        profile=spec.stack.profile,
        vllm_version=spec.stack.vllm_version,
        hosts=hosts,
        instances=instances,
        problems=problems,
        warnings=warnings,
        stacks=stacks,
    )


def _gib(b: int | None) -> str:
    return "-" if b is None else f"{b / GIB:.2f}"


def format_plan(plan: Plan) -> str:
    out: list[str] = [f"fleet {plan.fleet}: profile {plan.profile}, vLLM {plan.vllm_version}"]
    if set(plan.stacks) - {DEFAULT_STACK}:
        out += [
            f"stack {name}: profile {st['profile']}, vLLM {st['vllm_version']} ({', '.join(st['instances'])})"
            for name, st in plan.stacks.items()
        ]
    for h in plan.hosts:
        gpu = f"{h.gpu_count}× {h.gpu_model} {h.gpu_memory_gib:g} GiB" if h.gpu_count else "no GPUs"
        out.append(f"\nhost {h.name} ({h.address}): {gpu}")
        for g, names in h.gpu_map.items():
            out.append(f"  GPU {g}: {', '.join(names)}")
        for port, owner in h.ports.items():
            out.append(f"  port {port}: {owner}")
    header = (
        f"{'instance':<16} {'host':<10} {'port':>5} {'gpus':<8} {'role':<8} {'stack':<14} {'params':>8} {'weights':>8} "
        f"{'KV/tok':>9} {'KV GiB':>7} {'KV tokens':>10} {'max_len':>7} {'seqs@max':>8} {'suggest':>7} {'set':>5} "
        f"{'queue':>5}"
    )
    out += ["", header, "-" * len(header)]
    for ip in plan.instances:
        params = (
            "-"
            if ip.params is None
            else f"{ip.params / 1e9:.2f}B"
            if ip.params >= 1e8
            else f"{ip.params / 1e6:.2f}M"
        )
        out.append(
            f"{ip.name:<16} {ip.host:<10} {ip.port:>5} {','.join(map(str, ip.gpus)) or '-':<8} {ip.role:<8} {ip.stack:<14} "
            f"{params:>8} {_gib(ip.weight_bytes):>8} {ip.kv_bytes_per_token or '-':>9} {_gib(ip.kv_cache_bytes):>7} "
            f"{ip.kv_capacity_tokens or '-':>10} {ip.max_model_len or '-':>7} "
            f"{'-' if ip.max_concurrent_at_max_len is None else ip.max_concurrent_at_max_len:>8} "
            f"{ip.suggested_max_num_seqs or '-':>7} {ip.configured_max_num_seqs or '-':>5} {ip.queue_bound or '-':>5}"
        )
        for n in ip.notes:
            out.append(f"    note: {n}")
        if ip.start_after:
            out.append(f"    starts after: {', '.join(ip.start_after)} (shared GPU)")
    out.append(
        "(weights and KV in GiB; KV/tok in bytes; seqs@max = sequences of max_model_len that fit at once)"
    )
    for w in plan.warnings:
        out.append(f"warning: {w}")
    if plan.problems:
        out.append(f"\nREFUSED: {len(plan.problems)} problem(s)")
        out += [f"  {p}" for p in plan.problems]
    else:
        out.append("\nOK")
    return "\n".join(out)
