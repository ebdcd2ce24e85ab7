"""The command lines of ``vllm-fleet fetch``, ``manifest`` and ``doctor``.

On a host they read the host's contract (``--contract CONFIG_DIR/host.json``: what the play passes,
``vllm_fleet.contracts.HostContract``) and run the host code (``vllm_fleet.host.fetch``, ``manifest``,
``doctor``), which never reads the fleet spec. Given a fleet spec instead (on the controller, e.g.
``vllm-fleet fetch SPEC --dest DIR``, or by hand), the contract is built from the spec here
(``vllm_fleet.fleet.host_contract``, as the render builds ``host.json``) and the same host code runs. The
controller's modules are imported only then.
"""

from __future__ import annotations

import argparse
import sys

from vllm_fleet.contracts import HostContract
from vllm_fleet.host import doctor, fetch, manifest

_SPEC_HELP = "a fleet spec, on the controller or by hand, instead of a host's --contract"


def _add_spec(p: argparse.ArgumentParser, spec_help: str, host_help: str) -> None:
    p.add_argument("spec", nargs="?", metavar="SPEC", help=f"{_SPEC_HELP}: {spec_help}")
    p.add_argument("--host", help=f"with SPEC: {host_help}")


def _source_problem(a: argparse.Namespace, command: str, need_one: bool = True) -> str:
    """What is wrong with the arguments' source (a spec or a contract; ``need_one``: one of them is
    required), '' when nothing."""
    if need_one and not a.spec and not a.contract:
        return f"{command}: give this host's --contract CONFIG_DIR/host.json (on a host) or SPEC (on the controller)"
    if a.spec and a.contract:
        return f"{command}: give SPEC (on the controller) or --contract (on a host), not both"
    if not a.spec and a.host:
        return (
            f"{command}: --host goes with SPEC (a contract names its own host: {a.contract or 'none given'})"
        )
    return ""


def _contract_of(spec_path: str, host: str, command: str) -> HostContract | None:
    """The contract of ``host`` built from the spec at ``spec_path``; None (the reason printed) when the spec
    has no such host. A spec that is not valid raises ``SpecError`` (the CLI prints its problems)."""
    from vllm_fleet.fleet.host_contract import host_contract
    from vllm_fleet.fleet.spec import load_spec

    spec = load_spec(spec_path)
    try:
        return host_contract(spec, host)
    except KeyError:
        hosts = ", ".join(h.name for h in spec.hosts)
        print(f"{command}: --host {host}: not a host of {spec_path} (its hosts: {hosts})", file=sys.stderr)
        return None


def _fail(text: str) -> int:
    print(text, file=sys.stderr)
    return 2


# ------------------------------------------------------------------------------------------------ fetch


def add_fetch_args(p: argparse.ArgumentParser) -> None:
    fetch.add_args(p)
    _add_spec(
        p, "its models and adapters (of --host, else every one)", "only the models and adapters of this host"
    )
    p.set_defaults(handler=_fetch)


def _fetch(a: argparse.Namespace) -> int:
    if problem := _source_problem(a, "fetch"):
        return _fail(problem)
    if not a.spec:
        return fetch._run(a)
    if not a.host:
        from vllm_fleet.fleet.host_contract import fleet_adapters, fleet_models
        from vllm_fleet.fleet.spec import load_spec

        spec = load_spec(a.spec)
        return fetch.run(a, fleet_models(spec), fleet_adapters(spec))
    contract = _contract_of(a.spec, a.host, "fetch")
    return 2 if contract is None else fetch.run(a, contract.models, contract.adapters)


# --------------------------------------------------------------------------------------------- manifest


def add_manifest_args(p: argparse.ArgumentParser) -> None:
    manifest.add_args(p)
    _add_spec(p, "the manifest of --host", "the host whose manifest is written (required with SPEC)")
    p.set_defaults(handler=_manifest)


def _manifest(a: argparse.Namespace) -> int:
    if problem := _source_problem(a, "manifest"):
        return _fail(problem)
    if not a.spec:
        return manifest._run(a)
    if not a.host:
        return _fail("manifest: SPEC needs --host (the host whose manifest is written)")
    contract = _contract_of(a.spec, a.host, "manifest")
    return 2 if contract is None else manifest.run(a, contract)


# ----------------------------------------------------------------------------------------------- doctor


def add_doctor_args(p: argparse.ArgumentParser) -> None:
    doctor.add_args(p)
    _add_spec(
        p,
        "the profile, release and driver of its stack (--stack, default: the fleet's) and, with --host, that "
        "host's contract",
        "the host checked (its stacks and GPUs, the GPUs its instances use, their dtype and env)",
    )
    p.set_defaults(handler=_doctor)


def _doctor(a: argparse.Namespace) -> int:
    if problem := _source_problem(a, "doctor", need_one=False):
        return _fail(problem)
    if not a.spec:
        return doctor._run(a)
    if a.host:
        contract = _contract_of(a.spec, a.host, "doctor")
        return 2 if contract is None else doctor._run(a, contract)
    # no host: the stack's own facts (its profile, release and driver), no host's GPUs or instances
    from vllm_fleet.fleet.spec import DEFAULT_STACK, load_spec

    spec = load_spec(a.spec)
    name = a.stack or DEFAULT_STACK
    try:
        stack = spec.named_stack(name)
    except KeyError:
        return _fail(f"doctor: --stack {name}: not a stack of {a.spec} (default, {', '.join(spec.stacks)})")
    a.profile = a.profile or stack.profile
    a.vllm_version = stack.vllm_version if a.vllm_version is None else a.vllm_version
    a.min_driver = stack.min_driver if a.min_driver is None else a.min_driver
    return doctor._run(a)
