"""The variables every template sees — the same for ``vllm-fleet render`` and the Ansible role.

``vf``: the normalised fleet spec (plain dicts) plus derived facts: ``vf.host`` (the host being rendered),
``vf.instances`` (instances on that host, each with its engine command, env, listen address, unit name),
``vf.all_instances`` (every instance in the fleet), ``vf.upstreams`` (gateway pools per served model),
``vf.plan`` (the capacity plan), ``vf.host_contract`` (the host's contract: ``{config_dir}/host.json``).
Per-instance templates also get ``instance``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from vllm_fleet import __version__
from vllm_fleet.contracts import (
    ADMISSION_SYSLOG_TAG,
    ENGINE_ADMIN_PATH_RE,
    ENGINE_HTTP_KEEPALIVE_SECONDS,
    GATEWAY_UPSTREAM_KEEPALIVE_SECONDS,
    SERVICE_DEFAULTS,
    SleepConfig,
)
from vllm_fleet.fleet.admission_config import (
    ADMISSION_UNIT_FILE,
    admission_config,
    admission_config_path,
    admission_files,
    gateway_sysctl,
    host_admission_config,
    model_capacity,
    runtime_directory,
)
from vllm_fleet.fleet.engine import (
    engine_command,
    engine_env,
    listen_address,
    master_port,
    model_path,
    rank_address,
)
from vllm_fleet.fleet.ha import drained_set_file, gateway_ha_vars, keepalived_plan, monitoring_server
from vllm_fleet.fleet.host_contract import HostContracts, adapter_entries
from vllm_fleet.fleet.hostplan import host_deploy_plan
from vllm_fleet.fleet.network import (
    exporter_address,
    exporter_addresses,
    firewall_rules,
    monitoring_address,
    monitoring_listen_address,
)
from vllm_fleet.fleet.plan import InstancePlan, Plan, make_plan
from vllm_fleet.fleet.plan_checks import worker_connections
from vllm_fleet.fleet.routes import gateway_routes, route_index
from vllm_fleet.fleet.sleepwatch_plan import sleepwatch_files, sleepwatch_plan
from vllm_fleet.fleet.spec import DEFAULT_STACK, FleetSpec, Host, ModelInstance, Routing, spec_hash

ANSIBLE_MANAGED = "Ansible managed"
# the host exporter's system user (vllm-fleet-exporter.service)
EXPORTER_USER = "vllm-fleet-exporter"


def stack_ctx(spec: FleetSpec, m: ModelInstance, command: list[str]) -> dict[str, Any]:
    """The stack an instance (or its rank) runs: ``stack_name`` (``default``: the fleet's ``stack``), its
    profile and release, and ``stack_venv``, the venv `vllm-fleet render` shows in its command: paths.venv for
    the fleet's stack, PREFIX/stacks/NAME for a named one (the engine role puts the venv it installed:
    PREFIX/stacks/PROFILE-VERSION-HASH12, ``vllm_fleet_stack_venvs[stack_name]``)."""
    name = spec.stack_name(m)
    st = spec.stack_of(m)
    return {
        # the engine's executable inside its venv and its arguments: the instance config prints the venv the
        # engine role installed (or stack_venv) before it
        "engine_exe": command[0].removeprefix(spec.paths.venv + "/"),
        "engine_args": command[1:],
        "stack_name": name,
        "stack_profile": st.profile,
        "stack_vllm_version": st.vllm_version,
        "stack_venv": spec.paths.venv if name == DEFAULT_STACK else f"{spec.paths.prefix}/stacks/{name}",
    }


def sleep_config(spec: FleetSpec, m: ModelInstance) -> dict[str, Any] | None:
    """The instance config's ``sleep`` (contracts.SleepConfig, read by the launcher; docs/sleep.md): the model's
    ``sleep`` with its swap group's ``max_awake`` and the group's other instances on its host (sorted); None when
    the model does not sleep."""
    if m.sleep is None:
        return None
    group = spec.swap_group(m)
    return dataclasses.asdict(
        SleepConfig(
            level=m.sleep.level,
            idle_seconds=m.sleep.idle_seconds,
            wake_wait_seconds=m.sleep.wake_wait_seconds,
            group=group,
            max_awake=spec.swap_groups[group].max_awake if group else 1,
            group_members=sorted(x.name for x in spec.swap_members(group, m.host) if x.name != m.name),
        )
    )


def instance_ctx(
    spec: FleetSpec,
    plan: Plan,
    m: ModelInstance,
    ip: InstancePlan | None = None,
    host: Host | None = None,
) -> dict[str, Any]:
    """One instance's variables; ``ip`` (its plan) and ``host`` are looked up when not given."""
    d = m.model_dump(mode="json")
    ip = ip or plan.instance(m.name)
    host = host or spec.host(m.host)
    command = engine_command(spec, m)
    entry = m.model_dump(mode="json")
    if entry["lora"] is None:  # an instance without `lora` keeps the config it had before the field
        del entry["lora"]
    if entry["sleep"] is None:  # nor one without `sleep`
        del entry["sleep"]
    d.update(
        unit=f"vllm@{m.name}.service",
        # the label that sets a rollout's canary apart from the stable instances in Prometheus (docs/rollouts.md)
        track="canary" if m.role == "canary" else "stable",
        # its `models` entry as deployed (instance.json "spec"): while a rollout holds a change, the next play
        # reads it back and plans the instance as it runs (spec.running_version)
        spec_entry=entry,
        # LoRA (docs/lora.md): on or off, its adapters file (rendered only when on; a change of it is synced on
        # the running engine, never a restart) and every adapter of its served model, carried or not
        lora_on=spec.lora_on(m),
        adapters_file=spec.adapters_file(m),
        adapters=[dataclasses.asdict(a) for a in adapter_entries(spec, m)],
        # sleep mode (the instance config's `sleep`, contracts.SleepConfig), or None
        sleep=sleep_config(spec, m),
        model_path=model_path(spec, m),
        listen_address=listen_address(spec, m),
        host_address=host.private_address or host.address,
        command=command,
        environment=engine_env(spec, m),
        start_after_units=[f"vllm@{n}.service" for n in ip.start_after],
        plan=ip.__dict__,
        source_kind=m.source.kind,
        source_repo=m.source.repo,
        source_revision=m.source.revision,
        **stack_ctx(spec, m, command),
    )
    return d


DEFAULT_MAX_CONNS = 32


def _max_conns(inst: dict[str, Any]) -> int:
    """Requests in flight on one instance before the cache-aware affinity gives way: ``routing.max_conns``,
    else the instance's ``max_num_seqs`` (its running batch is full), else the planner's suggestion."""
    routing = inst.get("routing") or {}
    plan = inst.get("plan") or {}
    return int(
        routing.get("max_conns")
        or inst.get("max_num_seqs")
        or plan.get("suggested_max_num_seqs")
        or DEFAULT_MAX_CONNS
    )


def worker_ctx(spec: FleetSpec, m: ModelInstance, rank: int) -> dict[str, Any]:
    """One headless rank > 0 of a multi-node instance (``vllm-worker@NAME.service``, docs/multi-node.md)."""
    d = m.model_dump(mode="json")
    command = engine_command(spec, m, rank)
    d.update(
        unit=f"vllm-worker@{m.name}.service",
        rank=rank,
        nnodes=len(m.placement),
        gpus=list(m.placement[rank].gpus),
        model_path=model_path(spec, m),
        command=command,
        environment=engine_env(spec, m, rank),
        master_addr=rank_address(spec, m, 0),
        master_port=master_port(m),
        **stack_ctx(spec, m, command),
    )
    return d


def upstreams(spec: FleetSpec, all_instances: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One gateway upstream per served model: primaries, backups and fallbacks, with how to reach each."""
    out: dict[str, dict[str, Any]] = {}
    for inst in all_instances:
        name = inst["served_model_name"]
        up = out.setdefault(
            name,
            {
                "model": name,
                "upstream": "m_" + "".join(c if c.isalnum() else "_" for c in name),
                "servers": [],
                "routing": Routing().model_dump(),  # the spec's defaults: written in one place
            },
        )
        if inst.get("routing"):
            up["routing"] = dict(inst["routing"])
        same_host = spec.gateway_host == inst["host"]
        address = "127.0.0.1" if same_host and inst["listen_address"] == "127.0.0.1" else inst["host_address"]
        up["servers"].append(
            {
                "instance": inst["name"],
                "address": f"{address}:{inst['port']}",
                "role": inst["role"],
                "pool": inst["pool"],
                "drained": inst["name"] in spec.gateway.drained,
                # its model sleeps when idle (models[].sleep): the router tries it after the awake replicas
                # (docs/sleep.md "Gateway")
                "sleeps": inst.get("sleep") is not None,
                # the cache-aware policy's bound (routing.max_conns, else the batch size); none under
                # least_conn, so that a batch-size change there does not change the gateway's files (a reload
                # closes the clients' idle keep-alive connections)
                "max_conns": _max_conns(inst)
                if (inst.get("routing") or {}).get("policy") == "cache_aware"
                else None,
            }
        )
    return sorted(out.values(), key=lambda u: u["model"])


def upstream_addresses(ups: list[dict[str, Any]]) -> dict[str, str]:
    """Instance name -> the address its gateway upstream reaches it at."""
    return {srv["instance"]: srv["address"] for u in ups for srv in u["servers"]}


def fleet_vars(spec: FleetSpec, plan: Plan | None = None) -> dict[str, Any]:
    """The part of ``vf`` that is the same for every host (the spec, every instance, upstreams, the plan):
    built once per fleet. ``host_vars`` adds a host's part."""
    plan = plan or make_plan(spec)
    vf: dict[str, Any] = spec.model_dump(mode="json")
    plans: dict[str, InstancePlan] = {}
    for ip in plan.instances:
        plans.setdefault(ip.name, ip)  # the first of a name, as plan.instance() finds
    hosts = {h.name: h for h in reversed(spec.hosts)}  # the first of a name, as spec.host() finds
    all_instances = [instance_ctx(spec, plan, m, plans[m.name], hosts[m.host]) for m in spec.models]
    vf["all_instances"] = all_instances
    vf["upstreams"] = upstreams(spec, all_instances)
    # the gateway's view of the adapters (it replaces the spec's `adapters`: the hosts get theirs from their
    # contracts): each routes to its base's instances, its carriers first (docs/lora.md)
    vf["adapters"] = [
        {"name": a.name, "base": a.base, "carriers": spec.adapter_carriers(a), "rank": a.rank}
        for a in spec.adapters
    ]
    # where the rolling restart asks an instance for a completion: from the gateway host at its upstream
    # address, else on its own host
    reach = upstream_addresses(vf["upstreams"])
    for inst in all_instances:
        inst["check_address"] = (
            reach[inst["name"]] if spec.gateway.enabled else f"{inst['listen_address']}:{inst['port']}"
        )
    mml = {m.served_model_name: m.max_model_len for m in reversed(spec.models)}
    # the gateway's table and the router's index of it (vllm_fleet/fleet/routes.py)
    vf["gateway_routes"] = gateway_routes(vf["upstreams"], mml, vf["adapters"])
    vf["gateway_admin_path_re"] = ENGINE_ADMIN_PATH_RE  # never forwarded (contracts.ENGINE_ADMIN_PATHS)
    vf["gateway_index"] = route_index(vf["gateway_routes"])
    vf["gateway_host"] = spec.gateway_host
    # every gateway host (two or more: behind gateway.virtual_address, keepalived; fleet/ha.py)
    vf["gateway_hosts"] = spec.gateway_hosts
    vf["gateway_ha"] = gateway_ha_vars(spec, vf["upstreams"])
    vf["gateway_state_file"] = drained_set_file(spec)
    # models that sleep (models[].sleep): the sleep watch's config and unit on every gateway host, the file the
    # router reads (None: no routed model sleeps, nothing rendered, nothing read; fleet/sleepwatch_plan.py)
    vf["gateway_sleepwatch"] = sleepwatch_plan(spec.name, vf["gateway_routes"])
    vf["gateway_sleepwatch_on"] = vf["gateway_sleepwatch"] is not None
    # its files, also when off: the role removes them then (a stopped watch leaves nothing to start)
    vf["gateway_sleepwatch_files"] = sleepwatch_files()
    # a served model has a `rollouts` entry: the preflight reads its running instances' configs and plans them
    # as they run (docs/rollouts.md)
    vf["rollouts_hold"] = bool(spec.rollouts)
    # gateway.limits: the admission service's file (fleet/admission_config.py), where nginx reaches it
    vf["gateway_admission"] = admission_config(spec, plan) if spec.gateway.admission else None
    vf["gateway_admission_on"] = spec.gateway.admission
    vf["gateway_admission_file"] = admission_config_path(spec)
    vf["gateway_admission_unit_file"] = ADMISSION_UNIT_FILE
    # its files, also when off: the role removes them then (a stopped service leaves nothing to start)
    vf["gateway_admission_files"] = admission_files(spec)
    vf["gateway_admission_tag"] = ADMISSION_SYSLOG_TAG
    # the kernel settings the gateway role writes with gateway.limits on (admission socket backlog, release
    # datagram queue), and nginx's worker_connections it writes into nginx.conf (plan_checks)
    vf["gateway_sysctl"] = gateway_sysctl(spec, plan)
    vf["gateway_worker_connections"] = worker_connections(spec, model_capacity(spec, plan))
    # gateway.classes, as the router reads them (routes.json): each class's priority and pool, and per client
    # the classes its keys may name (null: every one) and its default
    vf["gateway_classes"] = (
        {
            "classes": {n: {"priority": c.priority, "pool": c.pool} for n, c in spec.gateway.classes.items()},
            "clients": {
                n: {"allowed": list(c.classes) or None, "default": c.default_class}
                for n, c in spec.gateway.clients.items()
            },
        }
        if spec.gateway.classes
        else None
    )
    vf["gateway_admission_runtime_directory"] = runtime_directory(spec.gateway.limits.runtime_dir)
    # nginx gives up an idle engine connection well before the engine does (vllm_fleet/contracts.py)
    vf["gateway_upstream_keepalive_seconds"] = GATEWAY_UPSTREAM_KEEPALIVE_SECONDS
    vf["engine_http_keepalive_seconds"] = ENGINE_HTTP_KEEPALIVE_SECONDS
    # decided here, tested in the roles: an Ansible conditional must be a bool (ansible-core 2.19 refuses the
    # None of `vf.gateway.tls` when the spec has no gateway.tls)
    vf["gateway_tls"] = spec.gateway.tls is not None
    vf["gateway_tls_self_signed"] = spec.gateway.tls is not None and spec.gateway.tls.self_signed
    vf["monitoring_host"] = spec.monitoring_host
    vf["monitoring_hosts"] = spec.monitoring_hosts
    # where Prometheus and Alertmanager are reached (the first monitoring host's; on a monitoring host, its own:
    # the host part): vllm_fleet/fleet/network.py
    vf["monitoring_address"] = monitoring_address(spec)
    # host name → where its exporters listen, where Prometheus scrapes them
    vf["exporter_addresses"] = exporter_addresses(spec)
    # the host exporter's static system user (monitoring/vllm-fleet-exporter.sysusers.conf.j2, the monitoring
    # role): not DynamicUser=, whose uid the system bus cannot resolve without nss-systemd (Debian 12's default)
    vf["exporter_user"] = EXPORTER_USER
    # the units' RuntimeDirectory= (paths.state_dir under /run) and StateDirectory= (paths.cache_dir under
    # /var/lib), relative as systemd wants them; '' = elsewhere (the units then allow writing there)
    vf["unit_dirs"] = {
        "runtime": spec.paths.state_dir.removeprefix("/run/")
        if spec.paths.state_dir.startswith("/run/")
        else "",
        "state": spec.paths.cache_dir.removeprefix("/var/lib/")
        if spec.paths.cache_dir.startswith("/var/lib/")
        else "",
    }
    vf["spec_hash"] = spec_hash(spec)
    vf["vllm_fleet_version"] = __version__
    vf["plan"] = plan.to_dict()
    # the defaults of models[].service (the base unit's StartLimit*/TimeoutStartSec/RestartSec)
    vf["service_defaults"] = dataclasses.asdict(SERVICE_DEFAULTS)
    return vf


class HostVars:
    """A host's part of ``vf`` (``host``, ``instances``, ``is_gateway``, ``is_monitoring``) from the fleet
    part, with the fleet's instances grouped by host once: each host then costs its own instances only."""

    def __init__(self, spec: FleetSpec, fleet: dict[str, Any]) -> None:
        self.spec = spec
        self.fleet = fleet
        self.reach = upstream_addresses(fleet["upstreams"])
        self.hosts = {h.name: h for h in reversed(spec.hosts)}
        self.dumped: dict[str, dict[str, Any]] = {}
        for h, d in zip(spec.hosts, fleet["hosts"], strict=True):
            self.dumped.setdefault(h.name, d)
        self.ports: dict[str, dict[str, str]] = {}
        for hp in fleet["plan"]["hosts"]:
            self.ports.setdefault(hp["name"], {str(p): o for p, o in hp["ports"].items()})
        self.weights: dict[str, int] = {}
        for ip in fleet["plan"]["instances"]:
            self.weights[ip["host"]] = self.weights.get(ip["host"], 0) + int(ip.get("weight_bytes") or 0)
        self.instances: dict[str, list[dict[str, Any]]] = {}
        for i in fleet["all_instances"]:
            self.instances.setdefault(i["host"], []).append(i)
        self.contracts = HostContracts(spec, fleet["spec_hash"])

    def worker(self, m: ModelInstance, rank: int) -> dict[str, Any]:
        """A headless rank's variables, with where the rolling restart checks its group: its rank 0 at the
        gateway's upstream address, else at the master address on the instance's port."""
        w = worker_ctx(self.spec, m, rank)
        w["check_address"] = (
            self.reach[m.name] if self.spec.gateway.enabled else f"{w['master_addr']}:{w['port']}"
        )
        return w

    def __call__(self, host: str) -> dict[str, Any]:
        """``host``'s part of ``vf``: its typed plan (``HostDeployPlan``, fleet/hostplan.py), dumped."""
        spec = self.spec
        if host not in self.hosts:
            raise KeyError(host)
        return host_deploy_plan(
            spec,
            host,
            self.dumped[host],
            ports=self.ports.get(host, {}),
            weight_bytes=self.weights.get(host, 0),
            instances=list(self.instances.get(host, [])),
            workers=[self.worker(m, r) for m, r in spec.workers_on(host)],
            # what this host's firewall lets in (firewall/nftables.conf.j2)
            firewall=firewall_rules(spec, host),
            # where this host's exporters listen (loopback on the monitoring host, else the internal address)
            exporter_address=exporter_address(spec, host),
            # what fetch, manifest and doctor read on this host ({config_dir}/host.json; vllm_fleet/contracts.py)
            host_contract=self.contracts(host),
            # two or more gateways: this one's keepalived.conf; a monitoring host: its Prometheus and Alertmanager
            keepalived=keepalived_plan(spec, host),
            monitoring_server=monitoring_server(spec, host),
            monitoring_address=monitoring_listen_address(spec, host)
            if host in spec.monitoring_hosts
            else self.fleet["monitoring_address"],
            gateway_admission=host_admission_config(self.fleet["gateway_admission"], spec, host),
        ).model_dump(mode="json")


def host_context(fleet: dict[str, Any], host_part: dict[str, Any] | None) -> dict[str, Any]:
    """The template variables of one host: a new top-level ``vf`` over the shared fleet part."""
    vf = dict(fleet)
    if host_part is not None:
        vf.update(host_part)
    return {"vf": vf, "ansible_managed": ANSIBLE_MANAGED}


def build_context(spec: FleetSpec, host: str | None = None, plan: Plan | None = None) -> dict[str, Any]:
    fleet = fleet_vars(spec, plan)
    return host_context(fleet, HostVars(spec, fleet)(host) if host is not None else None)


def repo_root() -> Path:
    """Folder holding the template folders (units/, nginx/, alerts/, dashboards/ ...): $VLLM_FLEET_TEMPLATES,
    else the checkout this module runs from, else the copy installed with the package (setup.py puts it in
    the wheel as vllm_fleet/templates/)."""
    import os

    env = os.environ.get("VLLM_FLEET_TEMPLATES")
    if env:
        return Path(env)
    here = Path(__file__).resolve()
    checkout = here.parents[2]  # vllm_fleet/fleet/context.py
    if (checkout / "units" / "artifacts.yml").is_file():
        return checkout
    return here.parents[1] / "templates"
