"""Capacity planning and refusals: GPUs → instances, ports, memory fit, FP8 support, engine flags."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from vllm_fleet.fleet import engine_flags
from vllm_fleet.fleet.modelinfo import facts_for, kv_bytes_per_token, kv_dtype_bytes, weight_dtype_bytes
from vllm_fleet.fleet.spec import COMMIT_RE, FleetSpec, Host, ModelInstance

GIB = 1024**3
# Memory vLLM needs besides weights and KV cache on each GPU: CUDA context, activations during the
# profile run, NCCL buffers, CUDA graphs. Conservative figures; the real value is logged by vLLM at start.
OVERHEAD_PER_GPU_BYTES = int(2.0 * GIB)
OVERHEAD_EAGER_PER_GPU_BYTES = int(1.25 * GIB)
# on the cpu profile, vLLM's own process overhead besides weights and KV (API server + engine core)
CPU_OVERHEAD_BYTES = int(2.0 * GIB)
MAX_SUGGESTED_SEQS = 512
FP8_MIN_CC = (8, 9)


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
    fp8 = m.quantization == "fp8" or m.kv_cache_dtype.startswith("fp8")
    cc = host.gpus.cc_tuple()
    if fp8 and cc is not None and cc < FP8_MIN_CC:
        field_name = "quantization" if m.quantization == "fp8" else "kv_cache_dtype"
        problems.append(
            Problem(
                f"{path}.{field_name}",
                f"FP8 needs compute capability >= 8.9; {host.name} has {host.gpus.model or 'GPUs'} "
                f"with compute capability {host.gpus.compute_capability}",
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
    spec: FleetSpec, problems: list[Problem], by_host: dict[str, list[tuple[int, ModelInstance]]]
) -> list[HostPlan]:
    """Per host: ports, GPUs (gpu profile) or tensor_parallel_size 1 (cpu profile); its HostPlan."""
    hosts: list[HostPlan] = []
    for host in spec.hosts:
        ports = _service_ports(spec, host, problems)
        gpu_map: dict[int, list[str]] = {}
        gpu_owner: dict[int, int] = {}
        for i, m in by_host[host.name]:
            _claim_port(host, i, m, ports, problems)
            if spec.stack.profile == "gpu":
                _check_gpus(spec, host, i, m, gpu_owner, gpu_map, problems)
            elif m.tensor_parallel_size != 1:
                problems.append(
                    Problem(
                        f"models[{i}].tensor_parallel_size", "the cpu profile runs tensor_parallel_size 1"
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
    search_dirs: list[Path],
    problems: list[Problem],
    ip: InstancePlan,
    host: Host,
    on_host: list[tuple[int, ModelInstance]],
) -> None:
    path = f"models[{i}]"
    facts = facts_for(m, search_dirs)
    ip.facts_source = facts.source
    missing = facts.missing()
    if missing:
        ip.notes.append(
            f"no local config.json and shape lacks {', '.join(missing)}: memory not estimated "
            f"(set models[{i}].shape or fetch the model first)"
        )
        return
    assert facts.params is not None and facts.num_layers and facts.num_kv_heads and facts.head_dim
    ip.params = facts.params
    wbytes = weight_dtype_bytes(m, facts)
    ip.weight_bytes = int(facts.params * wbytes)
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
    if spec.stack.profile == "gpu":
        if host.gpus.detect or not host.gpus.memory_gib:
            # preflight checks the driver and that the GPUs exist, not their memory; vLLM refuses to start
            # when weights and KV cache do not fit
            ip.notes.append(
                f"GPU memory of {host.name} is not in the spec (gpus.detect or no gpus.memory_gib): memory fit "
                "not checked before deploy (vLLM refuses to start when it does not fit)"
            )
            return
        n_gpu = max(1, len(m.gpus))
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
        if host.memory_gib:
            used = sum((x.kv_cache_memory_bytes or 0) + CPU_OVERHEAD_BYTES for _, x in on_host)
            if used > host.memory_gib * GIB:
                problems.append(
                    Problem(
                        f"{path}.kv_cache_memory_bytes",
                        f"instances on {host.name} need ≈{used / GIB:.1f} GiB, host has {host.memory_gib} GiB",
                    )
                )
    ip.memory_budget_bytes = budget
    ip.kv_cache_bytes = kv
    if kv <= 0:
        problems.append(
            Problem(
                f"{path}.gpus" if spec.stack.profile == "gpu" else f"{path}.kv_cache_memory_bytes",
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
    if not engine_flags.release_has("--max-num-queued-reqs", spec.stack.profile, spec.stack.vllm_version):
        if m.max_num_queued_reqs:
            warnings.append(
                f"{path}.max_num_queued_reqs: vLLM {spec.stack.vllm_version} has no --max-num-queued-reqs; "
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


def make_plan(spec: FleetSpec, search_dirs: list[Path] | None = None) -> Plan:
    problems: list[Problem] = []
    warnings: list[str] = []
    search_dirs = search_dirs or []
    by_host = _models_by_host(spec)
    host_of = {h.name: h for h in reversed(spec.hosts)}  # the first of a name, as spec.host() finds
    hosts = _check_layout(spec, problems, by_host)
    instances: list[InstancePlan] = []
    flag_table = engine_flags.load(spec.stack.profile, spec.stack.vllm_version)
    if flag_table is None:
        warnings.append(
            f"no captured argument list for {spec.stack.profile} vLLM {spec.stack.vllm_version}: "
            "extra_args not checked (run `vllm-fleet lock` to capture it)"
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
            configured_max_num_seqs=m.max_num_seqs,
        )
        _plan_memory(spec, i, m, search_dirs, problems, ip, host_of[m.host], by_host[m.host])
        _plan_queue(spec, i, m, warnings, ip)
        if flag_table is not None:
            for j, reason in engine_flags.check_args(m.extra_args, flag_table):
                problems.append(Problem(f"models[{i}].extra_args[{j}]", reason))
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
    )


def _gib(b: int | None) -> str:
    return "-" if b is None else f"{b / GIB:.2f}"


def format_plan(plan: Plan) -> str:
    out: list[str] = [f"fleet {plan.fleet}: profile {plan.profile}, vLLM {plan.vllm_version}"]
    for h in plan.hosts:
        gpu = f"{h.gpu_count}× {h.gpu_model} {h.gpu_memory_gib:g} GiB" if h.gpu_count else "no GPUs"
        out.append(f"\nhost {h.name} ({h.address}): {gpu}")
        for g, names in h.gpu_map.items():
            out.append(f"  GPU {g}: {', '.join(names)}")
        for port, owner in h.ports.items():
            out.append(f"  port {port}: {owner}")
    header = (
        f"{'instance':<16} {'host':<10} {'port':>5} {'gpus':<8} {'role':<8} {'params':>8} {'weights':>8} "
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
            f"{ip.name:<16} {ip.host:<10} {ip.port:>5} {','.join(map(str, ip.gpus)) or '-':<8} {ip.role:<8} "
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
