"""A host's contract (``vllm_fleet.contracts.HostContract``, ``{config_dir}/host.json``) built from the fleet
spec on the controller: what ``vllm-fleet fetch``, ``manifest`` and ``doctor`` need on that host, so that a
host reads its own file and never the whole spec.

``HostContracts`` builds one per host (the context puts it in ``vf.host_contract``; the engine artifact
``host.json`` is ``host_json`` of it, the same text for ``vllm-fleet render`` and the roles); ``fleet_models``
and ``fleet_adapters`` list every model and adapter of the spec, for a fetch run on the controller without
``--host``.
"""

from __future__ import annotations

from typing import Any

from vllm_fleet.contracts import (
    ADAPTERS_FILE_SCHEMA,
    HOST_CONTRACT_SCHEMA,
    AdapterEntry,
    AdaptersFile,
    HostAdapter,
    HostContract,
    HostGpus,
    HostInstance,
    HostModel,
    HostModelSource,
    HostPaths,
    HostStack,
    dumps_host_contract,
)
from vllm_fleet.fleet.engine import engine_args, model_path
from vllm_fleet.fleet.spec import (
    DEFAULT_STACK,
    Adapter,
    FleetSpec,
    ModelInstance,
    ModelSource,
    spec_hash,
)


def _source(src: ModelSource) -> HostModelSource:
    return HostModelSource(kind=src.kind, repo=src.repo, revision=src.revision, checksums=dict(src.checksums))


def host_model(spec: FleetSpec, m: ModelInstance) -> HostModel:
    return HostModel(name=m.name, model_path=model_path(spec, m), source=_source(m.source))


def host_adapter(spec: FleetSpec, a: Adapter) -> HostAdapter:
    return HostAdapter(
        name=a.name, model_path=spec.adapter_path(a), source=_source(a.source), base=a.base, rank=a.rank
    )


def host_adapters(spec: FleetSpec, instances: list[ModelInstance]) -> list[HostAdapter]:
    """Every adapter of the served model of each LoRA instance of ``instances`` (each may load any of them), in
    the spec's order."""
    bases = {m.served_model_name for m in instances if spec.lora_on(m)}
    return [host_adapter(spec, a) for _, a in spec.adapters_at(bases)]


def host_instance(spec: FleetSpec, m: ModelInstance) -> HostInstance:
    return HostInstance(
        name=m.name,
        unit=f"vllm@{m.name}.service",
        served_model_name=m.served_model_name,
        port=m.port,
        gpus=list(m.gpus),
        tensor_parallel_size=m.tensor_parallel_size,
        quantization=m.quantization,
        max_model_len=m.max_model_len,
        gpu_memory_utilization=m.gpu_memory_utilization,
        role=m.role,
        args=engine_args(spec, m),
        stack=spec.stack_name(m),
        dtype=m.dtype,
        env=dict(m.env),
    )


def fleet_models(spec: FleetSpec) -> list[HostModel]:
    """Every model of the spec, in its order (a fetch on the controller for every host)."""
    return [host_model(spec, m) for m in spec.models]


def fleet_adapters(spec: FleetSpec) -> list[HostAdapter]:
    """Every adapter of the spec, in its order (a fetch on the controller for every host)."""
    return [host_adapter(spec, a) for a in spec.adapters]


class HostContracts:
    """The contract of each host of one spec: the spec hash (``spec_hash``: pass the one already computed) and
    the models' order are computed once, so each host costs its own instances and ranks only."""

    def __init__(self, spec: FleetSpec, hash_: str | None = None) -> None:
        self.spec = spec
        self.hash = hash_ if hash_ is not None else spec_hash(spec)
        self.order = {m.name: i for i, m in reversed(list(enumerate(spec.models)))}
        self.index = {h.name: i for i, h in reversed(list(enumerate(spec.hosts)))}

    def __call__(self, host: str) -> HostContract:
        spec = self.spec
        if host not in self.index:
            raise KeyError(host)
        i = self.index[host]
        # the models of its instances and of the multi-node groups it has a rank of, in the spec's order
        needed = {m.name: m for m in [*spec.models_on(host), *spec.groups_on(host)]}
        models = sorted(needed.values(), key=lambda m: self.order[m.name])
        stacks = spec.stacks_on(host) or [DEFAULT_STACK]
        gpus = spec.hosts[i].gpus
        return HostContract(
            schema=HOST_CONTRACT_SCHEMA,
            fleet=spec.name,
            host=host,
            spec_hash=self.hash,
            paths=HostPaths(
                config_dir=spec.paths.config_dir,
                models_dir=spec.paths.models_dir,
                cache_dir=spec.paths.cache_dir,
                state_dir=spec.paths.state_dir,
            ),
            gpus=HostGpus(
                count=gpus.count,
                model=gpus.model,
                memory_gib=float(gpus.memory_gib),
                compute_capability=gpus.compute_capability,
                detect=gpus.detect,
                field=f"hosts[{i}].gpus",
            ),
            stacks=[
                HostStack(
                    name=n,
                    profile=spec.named_stack(n).profile,
                    vllm_version=spec.named_stack(n).vllm_version,
                    min_driver=spec.named_stack(n).min_driver,
                )
                for n in stacks
            ],
            models=[host_model(spec, m) for m in models],
            instances=[host_instance(spec, m) for m in spec.models_on(host)],
            # its instances' and its ranks' adapters: a headless rank loads an adapter's weights from its own copy
            adapters=host_adapters(spec, models),
        )


def host_contract(spec: FleetSpec, host: str) -> HostContract:
    """The contract of ``host`` (``KeyError`` when the spec has no such host)."""
    return HostContracts(spec)(host)


def host_json(ctx: dict[str, Any]) -> str:
    """The artifact generator of ``{config_dir}/host.json`` (units/artifacts.yml): the host's contract of the
    template variables (``vf.host_contract``) as the file's text."""
    return dumps_host_contract(ctx["vf"]["host_contract"])


def adapter_entries(spec: FleetSpec, m: ModelInstance) -> list[AdapterEntry]:
    """Every adapter of ``m``'s served model with its folder and whether ``m`` carries it ([] with LoRA off)."""
    return [
        AdapterEntry(name=a.name, path=spec.adapter_path(a), rank=a.rank, carry=carry)
        for a, carry in spec.instance_adapters(m)
    ]


def adapters_json(ctx: dict[str, Any]) -> str:
    """The artifact generator of an instance's adapters file (units/artifacts.yml,
    ``{config_dir}/instances/NAME.adapters.json``): from the instance's variables (``instance.adapters``)."""
    inst = ctx["instance"]
    return AdaptersFile(
        schema=ADAPTERS_FILE_SCHEMA,
        instance=inst["name"],
        model=inst["served_model_name"],
        adapters=[AdapterEntry(**a) for a in inst["adapters"]],
    ).dumps()
