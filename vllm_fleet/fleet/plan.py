"""Capacity planning and refusals: GPUs → instances, ports, memory fit, FP8 support, engine flags.

The checks and sizes are pure functions in ``plan_checks`` (they return findings and small typed results);
``make_plan`` composes them and builds the ``Plan`` (hosts, instances, problems, warnings) once."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from vllm_fleet.contracts import ASLEEP_GPU_GIB, parse_nvidia_smi
from vllm_fleet.fleet.modelinfo import ModelFacts, facts_for, facts_from_config
from vllm_fleet.fleet.multinode import check_multi_node
from vllm_fleet.fleet.plan_checks import (
    BF16_MIN_CC,
    CPU_OVERHEAD_BYTES,
    FP8_MIN_CC,
    GIB,
    MAX_SUGGESTED_SEQS,
    OVERHEAD_EAGER_PER_GPU_BYTES,
    OVERHEAD_PER_GPU_BYTES,
    Finding,
    HostLayout,
    MemoryPlan,
    Placed,
    asleep_weights,
    check_alerts,
    check_class_pools,
    check_dtypes,
    check_engine_keepalive,
    check_extra_args,
    check_gateway_auth,
    check_gateway_ha,
    check_lora,
    check_primaries,
    check_request_classes,
    check_revision,
    check_sleep,
    check_sleep_host_memory,
    check_worker_connections,
    host_layout,
    load_flag_tables,
    plan_memory,
    plan_queue,
    plan_stacks,
    serving_capacity,
    start_order,
    suggest_max_num_seqs,
    unused_swap_groups,
)
from vllm_fleet.fleet.spec import DEFAULT_STACK, FleetSpec, Host, ModelInstance

__all__ = [  # the planner's names; the constants and the suggestion live in plan_checks (with the checks)
    "BF16_MIN_CC",
    "CPU_OVERHEAD_BYTES",
    "FP8_MIN_CC",
    "GIB",
    "MAX_SUGGESTED_SEQS",
    "OVERHEAD_EAGER_PER_GPU_BYTES",
    "OVERHEAD_PER_GPU_BYTES",
    "Finding",
    "HostPlan",
    "InstancePlan",
    "Plan",
    "Problem",
    "apply_detected",
    "format_plan",
    "make_plan",
    "suggest_max_num_seqs",
]


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
    """A refusal of the plan (``Plan.problems``): a problem-severity ``Finding`` of fleet/plan_checks.py."""

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
    # LoRA on (docs/lora.md): {max_loras, max_lora_rank, max_cpu_loras} and the slots' bytes (None: not
    # estimated); both left out of the plan's JSON when LoRA is off
    lora: dict[str, int | None] | None = None
    lora_bytes: int | None = None
    # sleep mode (docs/sleep.md): models[].sleep ({level, idle_seconds, wake_wait_seconds, group}); left out of
    # the plan's JSON when the model does not sleep
    sleep: dict[str, Any] | None = None


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
    # swap groups with models here (docs/sleep.md): name → {members, max_awake}; and what the level-1 sleepers
    # keep in host memory at worst (bytes; None: no level-1 sleeper of known size). Both left out of the plan's
    # JSON when there is none
    swap_groups: dict[str, dict[str, Any]] = field(default_factory=dict)
    asleep_weight_bytes: int | None = None


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
        for ip in d["instances"]:
            if ip["lora"] is None:  # a plan without LoRA reads as it did before it
                del ip["lora"], ip["lora_bytes"]
            if ip["sleep"] is None:  # nor one without sleep mode
                del ip["sleep"]
        for hp in d["hosts"]:
            if not hp["swap_groups"] and hp["asleep_weight_bytes"] is None:
                del hp["swap_groups"], hp["asleep_weight_bytes"]
        return d


def _models_by_host(spec: FleetSpec) -> dict[str, Placed]:
    """Each host's instances with their index in ``spec.models``, in spec order (one pass over the models)."""
    by_host: dict[str, Placed] = {h.name: [] for h in spec.hosts}
    for i, m in enumerate(spec.models):
        by_host.setdefault(m.host, []).append((i, m))
    return by_host


def _host_plan(spec: FleetSpec, host: Host, on_host: Placed, layout: HostLayout) -> HostPlan:
    groups: dict[str, dict[str, Any]] = {}
    for _, m in on_host:
        if name := spec.swap_group(m):
            groups.setdefault(name, {"members": [], "max_awake": spec.swap_groups[name].max_awake})
            groups[name]["members"].append(m.name)
    return HostPlan(
        name=host.name,
        address=host.address,
        gpu_count=host.gpus.count,
        gpu_model=host.gpus.model,
        gpu_memory_gib=host.gpus.memory_gib,
        instances=[m.name for _, m in on_host],
        gpu_map=layout.gpu_map,
        ports=layout.ports,
        swap_groups=groups,
    )


def _fetched_facts(detected: dict[str, Any], m: ModelInstance) -> ModelFacts | None:
    """The facts of ``m`` as its host read them after the fetch (``detected[HOST]["models"][NAME]``:
    ``config``, the config.json, and ``weight_bytes``; what ``vllm-fleet fetch --json`` reports)."""
    got = (detected.get("models") or {}).get(m.name) or {}
    if not isinstance(got.get("config"), dict):
        return None
    return facts_from_config(got["config"], got.get("weight_bytes"), f"{m.host}:{got.get('path', m.name)}")


@dataclass(frozen=True)
class _Inputs:
    """What every instance's planning reads: the spec, the options of ``make_plan`` and the fleet-wide steps."""

    spec: FleetSpec
    search_dirs: list[Path]
    detected: dict[str, dict[str, Any]]
    fit_after_fetch: bool
    allow_unchecked_flags: bool
    host_of: dict[str, Host]  # with what the play detected on it
    by_host: dict[str, Placed]
    flags: dict[str, frozenset[str] | None]  # stack → its release's captured argument list
    start_after: dict[str, list[str]]


def _instance_plan(
    spec: FleetSpec,
    m: ModelInstance,
    mem: MemoryPlan,
    queue_bound: int | None,
    notes: list[str],
    after: list[str],
) -> InstancePlan:
    size, budget, cap = mem.size, mem.budget, mem.capacity
    lora = spec.lora_settings(m)
    return InstancePlan(
        name=m.name,
        host=m.host,
        port=m.port,
        gpus=list(m.gpus),
        role=m.role,
        served_model_name=m.served_model_name,
        stack=spec.stack_name(m),
        profile=spec.stack_of(m).profile,
        vllm_version=spec.stack_of(m).vllm_version,
        params=size.params if size else None,
        weight_bytes=size.weight_bytes if size else None,
        kv_bytes_per_token=size.kv_bytes_per_token if size else None,
        memory_budget_bytes=budget.budget_bytes if budget else None,
        kv_cache_bytes=budget.kv_cache_bytes if budget else None,
        kv_capacity_tokens=cap.tokens if cap else None,
        max_model_len=size.max_model_len if size else None,
        max_concurrent_at_max_len=cap.concurrent_at_max_len if cap else None,
        suggested_max_num_seqs=cap.suggested_max_num_seqs if cap else None,
        configured_max_num_seqs=m.max_num_seqs,
        queue_bound=queue_bound,
        start_after=after,
        facts_source=mem.facts_source,
        notes=notes,
        lora=None if lora is None else lora.model_dump(),
        lora_bytes=mem.lora_bytes,
        sleep=None if m.sleep is None else m.sleep.model_dump(),
    )


def _plan_instance(
    x: _Inputs, i: int, m: ModelInstance, cpu_weights: dict[str, int]
) -> tuple[InstancePlan, list[Finding]]:
    """``models[i]``: its checks in order (source, dtypes, memory, queue, flags) and its InstancePlan, whose
    notes are the notes among them. ``cpu_weights``: weights of the cpu-profile instances planned before it."""
    spec, seen, host = x.spec, x.detected.get(m.host, {}), x.host_of[m.host]
    facts = facts_for(m, x.search_dirs, _fetched_facts(seen, m))
    found = check_revision(i, m) + check_engine_keepalive(i, m) + check_request_classes(spec, i, m)
    found += check_lora(spec, i, m) + check_sleep(spec, i, m)
    if spec.stack_of(m).profile == "gpu":  # the gpu profile's rules for gpu-profile instances only
        found += check_dtypes(host, i, m, facts, bool(seen.get("gpus")))
    on_host = x.by_host[m.host]
    mem = plan_memory(spec, i, m, facts, host, on_host, cpu_weights, x.search_dirs, x.fit_after_fetch)
    queue = plan_queue(spec, i, m, mem.capacity.suggested_max_num_seqs if mem.capacity else None)
    found += mem.findings + queue.findings
    found += check_extra_args(spec, i, m, x.flags[spec.stack_name(m)], x.allow_unchecked_flags)
    notes = [str(f) for f in found if f.severity == "note"]
    return _instance_plan(spec, m, mem, queue.bound, notes, x.start_after.get(m.name, [])), found


def _plan_instances(x: _Inputs) -> tuple[list[InstancePlan], list[Finding]]:
    """Every instance in spec order, with what its checks found."""
    cpu_weights: dict[str, int] = {}  # the host-RAM fit sums the cpu-profile instances planned so far
    instances: list[InstancePlan] = []
    found: list[Finding] = []
    for i, m in enumerate(x.spec.models):
        ip, got = _plan_instance(x, i, m, cpu_weights)
        instances.append(ip)
        found += got
        if ip.profile == "cpu" and ip.weight_bytes is not None and m.kv_cache_memory_bytes:
            cpu_weights[m.name] = ip.weight_bytes + (ip.lora_bytes or 0)  # resident: weights and LoRA slots
    return instances, found


def _plan_sleep(
    spec: FleetSpec,
    effective: list[Host],
    by_host: dict[str, Placed],
    hosts: list[HostPlan],
    instances: list[InstancePlan],
) -> list[Finding]:
    """Sleep mode per host (docs/sleep.md): what the level-1 sleepers keep in host memory at worst (into each
    ``HostPlan``) and whether it fits beside the cpu-profile instances; swap groups no model is in."""
    if not any(m.sleep is not None for m in spec.models):
        return unused_swap_groups(spec)
    weights = {ip.name: ip.weight_bytes for ip in instances if ip.weight_bytes is not None}
    found: list[Finding] = []
    for h, hp in zip(effective, hosts, strict=True):
        on_host = by_host[h.name]
        asleep = asleep_weights(spec, on_host, weights).total
        hp.asleep_weight_bytes = asleep or None
        names = {m.name for _, m in on_host}
        cpu = sum(ip.memory_budget_bytes or 0 for ip in instances if ip.name in names and ip.profile == "cpu")
        found += check_sleep_host_memory(spec, h, on_host, weights, cpu)
    return found + unused_swap_groups(spec)


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
    instance's own stack (``models[].stack``): its profile's rules and its release's argument list.
    The checks (fleet/plan_checks.py) return findings; the plan is built from them once."""
    detected = detected or {}
    by_host = _models_by_host(spec)
    effective = [apply_detected(h, detected.get(h.name)) for h in spec.hosts]
    layouts = [(h, host_layout(spec, h, by_host[h.name])) for h in effective]
    hosts = [_host_plan(spec, h, by_host[h.name], layout) for h, layout in layouts]
    found = [f for _, layout in layouts for f in layout.findings]
    found += [Finding(p, r) for p, r in check_multi_node(spec, {h.name: h.ports for h in hosts})]
    stacks = plan_stacks(spec, lock_dir)
    flags = load_flag_tables(spec, stacks.stacks, allow_unchecked_flags)
    inputs = _Inputs(
        spec=spec,
        search_dirs=search_dirs or [],
        detected=detected,
        fit_after_fetch=fit_after_fetch,
        allow_unchecked_flags=allow_unchecked_flags,
        host_of={h.name: h for h in reversed(effective)},  # the first of a name, as spec.host() finds
        by_host=by_host,
        flags=flags.known,
        start_after=start_order(spec, by_host),
    )
    instances, per_instance = _plan_instances(inputs)
    found += stacks.findings + flags.findings + per_instance
    found += _plan_sleep(spec, effective, by_host, hosts, instances)
    found += check_alerts(spec) + check_primaries(spec) + check_gateway_auth(spec) + check_class_pools(spec)
    found += check_gateway_ha(spec)
    found += check_worker_connections(spec, serving_capacity(spec, instances))
    return Plan(
        fleet=spec.name,
        profile=spec.stack.profile,
        vllm_version=spec.stack.vllm_version,
        hosts=hosts,
        instances=instances,
        problems=[Problem(spec.field_path(f.path), f.message) for f in found if f.severity == "problem"],
        warnings=[str(f) for f in found if f.severity == "warning"],
        stacks=stacks.stacks,
    )


def _gib(b: int | None) -> str:
    return "-" if b is None else f"{b / GIB:.2f}"


def _lora_line(ip: InstancePlan) -> str:
    """An instance's LoRA line: its slots and what they take (from the KV cache on the gpu profile)."""
    assert ip.lora is not None
    cpu = f", max_cpu_loras {ip.lora['max_cpu_loras']}" if ip.lora.get("max_cpu_loras") else ""
    head = f"lora: max_loras {ip.lora['max_loras']} × max_lora_rank {ip.lora['max_lora_rank']}{cpu}"
    if ip.lora_bytes is None:
        return f"{head}, lora_bytes not estimated"
    where = "taken from the KV cache" if ip.profile == "gpu" else "in host memory"
    return f"{head}: lora_bytes {ip.lora_bytes} ({_gib(ip.lora_bytes)} GiB, {where})"


def _swap_lines(h: HostPlan) -> list[str]:
    """A host's swap groups and what its level-1 sleepers keep in its memory at worst (docs/sleep.md)."""
    out = []
    for name, g in h.swap_groups.items():
        n, k = len(g["members"]), g["max_awake"]
        out.append(
            f"  swap group {name} on {h.name}: {n} model{'s' if n != 1 else ''} ({', '.join(g['members'])}), "
            f"{min(k, n)} awake at a time; asleep each keeps ≈{ASLEEP_GPU_GIB:g} GiB of its GPUs"
        )
    if h.asleep_weight_bytes:
        out.append(f"  level-1 sleepers' weights in host memory at worst: {_gib(h.asleep_weight_bytes)} GiB")
    return out


def _sleep_line(sleep: dict[str, Any]) -> str:
    """An instance's sleep line: level, when it sleeps, how long a request waits for its wake, its group."""
    idle = sleep["idle_seconds"]
    when = f"after {idle} s idle" if idle is not None else "only when its swap group needs the room"
    what = "weights to host memory" if sleep["level"] == 1 else "weights dropped, reloaded at wake"
    group = f", swap group {sleep['group']}" if sleep.get("group") else ""
    return (
        f"sleep: level {sleep['level']} ({what}) {when}{group}; a request waits up to "
        f"{sleep['wake_wait_seconds']:g} s for the wake"
    )


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
        out += _swap_lines(h)
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
        if ip.lora is not None:
            out.append(f"    {_lora_line(ip)}")
        if ip.sleep is not None:
            out.append(f"    {_sleep_line(ip.sleep)}")
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
