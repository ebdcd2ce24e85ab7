"""Command line: argument parsing only; the work is in the modules."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from vllm_fleet.fleet.spec import FleetSpec, SpecError, load_spec

if TYPE_CHECKING:
    from vllm_fleet.fleet.plan import Plan

Handler = Callable[[argparse.Namespace], int]
AddArgs = Callable[[argparse.ArgumentParser], None]


class Plugin(NamedTuple):
    """A command that lives in its own module: ``target`` is ``MODULE:FUNCTION``, the function that adds the
    command's arguments to its parser and sets ``handler`` on it."""

    target: str
    help: str

    @property
    def module(self) -> str:
        return self.target.partition(":")[0]

    def add_args(self) -> AddArgs:
        module, _, fn = self.target.partition(":")
        add_args: AddArgs = getattr(importlib.import_module(module), fn)
        return add_args


def _spec(path: str) -> FleetSpec:
    return load_spec(path)


def _running(a: argparse.Namespace) -> FleetSpec:
    """The spec, its held instances as they run (``--deployed``: what the play read on the hosts; docs/rollouts.md)."""
    from vllm_fleet.fleet.spec import running_version

    spec = _spec(a.spec)
    if getattr(a, "deployed", ""):
        text = sys.stdin.read() if a.deployed == "-" else Path(a.deployed).read_text()
        running_version(spec, json.loads(text) if text.strip() else {}, str(a.promote or "").split(","))
    return spec


def _make_plan(a: argparse.Namespace, spec: FleetSpec) -> Plan:
    from vllm_fleet.fleet.plan import make_plan

    text = sys.stdin.read() if a.detected == "-" else Path(a.detected).read_text() if a.detected else ""
    detected = json.loads(text) if text else None
    lock_dir = Path(a.lock_dir) if a.lock_dir else None
    if a.lock_dir is None and Path("locks").is_dir():
        lock_dir = Path("locks")
    return make_plan(
        spec,
        [Path(d) for d in a.models_dir],
        allow_unchecked_flags=a.allow_unchecked_flags,
        detected=detected,
        fit_after_fetch=a.fit_after_fetch,
        lock_dir=lock_dir,
    )


def _cmd_plan(a: argparse.Namespace) -> int:
    from vllm_fleet.fleet.plan import format_plan

    spec = _running(a)
    plan = _make_plan(a, spec)
    if a.json:
        print(json.dumps(plan.to_dict(), indent=2))
    else:
        print(format_plan(plan))
    return 0 if plan.ok else 1


def _cmd_render(a: argparse.Namespace) -> int:
    from vllm_fleet.fleet.plan import format_plan
    from vllm_fleet.fleet.render import render_fleet

    spec = _running(a)
    plan = _make_plan(a, spec)
    if not plan.ok and not a.force:
        print(format_plan(plan), file=sys.stderr)
        print("render: the plan is refused; nothing written", file=sys.stderr)
        return 1
    written = render_fleet(spec, Path(a.out), plan)
    for p in written:
        print(p)
    return 0


def _cmd_context(a: argparse.Namespace) -> int:
    from vllm_fleet.fleet.render import Renderer

    spec = _running(a)
    plan = _make_plan(a, spec)
    if not plan.ok:
        for p in plan.problems:
            print(f"{a.spec}: {p}", file=sys.stderr)
        return 1
    r = Renderer(spec, plan)
    indent = None if a.compact else 2
    if a.all_hosts:
        # one plan for the whole fleet: the shared part once, each host's own part beside it
        # (vf of host H = fleet | hosts[H], what the preflight role sets)
        hosts = {}
        for h in spec.hosts:
            part = r.host_part(h.name)
            part["artifacts"] = r.artifact_list(h.name)
            hosts[h.name] = part
        print(json.dumps({"fleet": r.fleet, "hosts": hosts}, indent=indent))
        return 0
    vf = r.context(a.host)["vf"] if a.host else dict(r.fleet)
    if a.host:
        vf["artifacts"] = r.artifact_list(a.host)
    print(json.dumps(vf, indent=indent))
    return 0


def _cmd_status(a: argparse.Namespace) -> int:
    from vllm_fleet.fleet.status import run

    return run(a, _spec(a.spec))


def _cmd_validate(a: argparse.Namespace) -> int:
    _spec(a.spec)
    print(f"{a.spec}: valid")
    return 0


def build_parser(
    unavailable: dict[str, str] | None = None, loaded: set[str] | None = None
) -> argparse.ArgumentParser:
    """The parser of the built-in commands and the PLUGINS commands: those of ``loaded`` (all when None);
    ``unavailable`` (command → why its module cannot be imported) are listed too, marked so, and only report
    that when run."""
    p = argparse.ArgumentParser(
        prog="vllm-fleet",
        description="Deploy and operate vLLM fleets on systemd hosts: plan, render, launch, gateway, monitoring, bench.",
    )
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    def spec_cmd(name: str, help_text: str, fn: Handler) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help_text, description=help_text)
        sp.add_argument("spec", help="fleet spec YAML")
        sp.add_argument(
            "--models-dir",
            action="append",
            default=[],
            metavar="DIR",
            help="where local copies of models are looked up for config.json (repeatable)",
        )
        sp.add_argument(
            "--detected",
            default="",
            metavar="FILE",
            help="JSON ('-': stdin) of what the play read on the hosts: {HOST: {gpus: [{name, memory_mib, "
            "compute_capability}], memory_mib, models: {INSTANCE: {config, weight_bytes}}}}: detected GPUs "
            "replace gpus.detect and fill unset GPU fields; the fetched models' config.json gives their size",
        )
        sp.add_argument(
            "--fit-after-fetch",
            action="store_true",
            help="a model of unknown size or GPUs still to be detected are notes, not refusals (the play's "
            "first plan; it plans again after the fetch)",
        )
        sp.add_argument(
            "--allow-unchecked-flags",
            action="store_true",
            help="plan extra_args even when no argument list of the pinned vLLM release is captured "
            "(managed flags are still refused)",
        )
        sp.add_argument(
            "--deployed",
            default="",
            metavar="FILE",
            help="JSON ('-': stdin) of the instance configs on the hosts ({INSTANCE: config}): the running "
            "instances of a served model with a rollout are planned as deployed, not as the spec's held change "
            "(docs/rollouts.md)",
        )
        sp.add_argument(
            "--promote",
            default="",
            metavar="MODELS",
            help="served models (comma-separated) whose held change this run applies (with --deployed)",
        )
        sp.add_argument(
            "--lock-dir",
            default=None,
            metavar="DIR",
            help="the lock folder: each stack an instance runs needs DIR/PROFILE-VERSION.txt (default: ./locks "
            "when it exists, as where the playbook runs; '' = not checked)",
        )
        sp.set_defaults(handler=fn)
        return sp

    sp = spec_cmd("validate", "check a fleet spec's fields", _cmd_validate)
    sp = spec_cmd("plan", "plan GPUs, ports and memory; exit 1 when refused", _cmd_plan)
    sp.add_argument("--json", action="store_true", help="machine-readable output")
    sp = spec_cmd("render", "render every artifact for every host", _cmd_render)
    sp.add_argument("--out", required=True, help="output folder (OUT/HOST/etc/...)")
    sp.add_argument("--force", action="store_true", help="render even if the plan is refused")
    sp = spec_cmd("context", "print the template variables (used by the Ansible role)", _cmd_context)
    which = sp.add_mutually_exclusive_group()
    which.add_argument("--host", help="include host-specific variables and the artifact list")
    which.add_argument(
        "--all-hosts",
        action="store_true",
        help='every host at once: {"fleet": shared variables, "hosts": {HOST: its own variables and artifacts}}',
    )
    sp.add_argument("--compact", action="store_true")
    sp = spec_cmd(
        "status",
        "the fleet in one table from the monitoring host's Prometheus; exit 0 serving, 1 degraded, 2 a model down, "
        "3 Prometheus unreachable",
        _cmd_status,
    )
    sp.add_argument("--json", action="store_true", help="machine-readable output")
    sp.add_argument("--watch", type=float, default=0, metavar="SECONDS", help="repeat every SECONDS")
    sp.add_argument(
        "--prometheus",
        default="",
        metavar="URL",
        help="default: the spec's monitoring hosts' Prometheus, in turn (the first that answers)",
    )
    sp.add_argument(
        "--prometheus-user",
        default="",
        help="basic auth user (password: --prometheus-password-file or $VLLM_FLEET_PROMETHEUS_PASSWORD)",
    )
    sp.add_argument("--prometheus-password-file", default="", metavar="FILE")
    broken = unavailable or {}
    for name, plugin in sorted(PLUGINS.items()):
        if name in broken:
            text = f"UNAVAILABLE: {broken[name]}"
            sub.add_parser(name, help=text, description=text).set_defaults(handler=_unavailable(name, text))
            continue
        if loaded is not None and name not in loaded:
            continue  # its module is not in this installation (the harness of a product-only install)
        sp = sub.add_parser(name, help=plugin.help, description=plugin.help)
        plugin.add_args()(sp)
    return p


def _unavailable(name: str, text: str) -> Handler:
    def handler(a: argparse.Namespace) -> int:
        print(f"vllm-fleet {name}: {text}", file=sys.stderr)
        return 1

    return handler


BUILTINS = ("validate", "plan", "render", "context", "status")
# The one list of the sub-commands that live in their own modules, imported only when needed: a module that
# fails to import breaks its own commands, not the others.
PLUGINS: dict[str, Plugin] = {
    "adapters": Plugin(
        "vllm_fleet.host.adapters:add_args",
        "an instance's LoRA adapters on its running engine: sync with its adapters file (load, unload, "
        "reload; run by the play), show what is loaded",
    ),
    "admission": Plugin(
        "vllm_fleet.host.admission_service:add_args",
        "the gateway's per-key admission service (nginx auth_request; vllm-fleet-admission.service)",
    ),
    "bench": Plugin(
        "vllm_fleet.bench.cli:add_args",
        "load-test an OpenAI/Anthropic-compatible endpoint (profiles, compare, scenarios)",
    ),
    "canary": Plugin(
        "vllm_fleet.host.canary:add_args",
        "a canary's lease in this gateway's state file: set (share, lease), clear, show (rollouts; per gateway)",
    ),
    "doctor": Plugin(
        "vllm_fleet.host_commands:add_doctor_args",
        "check the engine stack layer by layer (driver, CUDA, torch, vLLM, tiny load)",
    ),
    "drain": Plugin(
        "vllm_fleet.host.drain:add_drain_args",
        "take an engine instance out of the gateway's rotation, every gateway's with gateway.hosts (no nginx "
        "reload, no config change)",
    ),
    "exporter": Plugin(
        "vllm_fleet.host.exporter:add_args",
        "host exporter: launcher states, probes, restarts, NVML GPU metrics, gateway log (Prometheus)",
    ),
    "fetch": Plugin(
        "vllm_fleet.host_commands:add_fetch_args",
        "download models (HF / ModelScope / local path), verify sha256 checksums",
    ),
    "launch": Plugin(
        "vllm_fleet.host.launcher:add_args",
        "run one engine instance under systemd (the main process of vllm@NAME.service)",
    ),
    "gateway-check": Plugin(
        "vllm_fleet.host.gateway_check:add_args",
        "ask the gateway's nginx whether it answers, or whether an engine answers through it (keepalived's check "
        "with gateway.hosts)",
    ),
    "lock": Plugin(
        "vllm_fleet.fleet.lock:add_args",
        "resolve a pinned, hashed engine stack (locks/) or build its offline wheelhouse",
    ),
    "manifest": Plugin(
        "vllm_fleet.host_commands:add_manifest_args",
        "write the deployment manifest JSON of a host (versions, GPUs, models, checksums)",
    ),
    "restart": Plugin(
        "vllm_fleet.host.restart:add_args",
        "on an engine host: restart vllm@NAME, returning when READY (a start systemd failed to spawn is tried "
        "again; any other failure exits 1 with its cause)",
    ),
    "rollout": Plugin(
        "vllm_fleet.fleet.rollout:add_args",
        "roll a served model's new version out through a canary judged on its SLOs (docs/rollouts.md)",
    ),
    "canary-guard": Plugin(
        "vllm_fleet.host.canary_guard:add_args",
        "on a canary's host: stop the canary when the rollout's lease runs out (started by vllm-fleet rollout)",
    ),
    "sandbox": Plugin(
        "vllm_fleet.devtools.sandbox:add_args",
        "real systemd hosts as systemd-nspawn containers (tests, CI, demo)",
    ),
    "sleepwatch": Plugin(
        "vllm_fleet.host.sleepwatch:add_args",
        "on a gateway host: which instances of a model that sleeps are not awake, for the router "
        "(vllm-fleet-sleepwatch.service)",
    ),
    "tiny-model": Plugin(
        "vllm_fleet.devtools.tinymodel:add_args", "build the tiny random Qwen3 model + tokenizer offline"
    ),
    "tiny-adapter": Plugin(
        "vllm_fleet.devtools.tinymodel:add_adapter_args",
        "build a tiny random LoRA adapter (PEFT) of the tiny model offline",
    ),
    "tls": Plugin(
        "vllm_fleet.fleet.tls:add_args",
        "make the gateway's self-signed certificate (gateway.tls.self_signed; used by the gateway role)",
    ),
    "why": Plugin(
        "vllm_fleet.host.failure_cause:add_args",
        "on an engine host: why vllm@NAME did not come up or stopped, in one line (the launcher's failure reason, "
        "else what systemd and the journal say)",
    ),
    "undrain": Plugin(
        "vllm_fleet.host.drain:add_undrain_args",
        "put a drained engine instance back into the gateway's rotation (every gateway's with gateway.hosts)",
    ),
}


def _import_plugin(module: str) -> bool:
    """Import ``module``. False when it is not there at all: a vllm_fleet module missing from this
    installation is skipped quietly, its commands are not offered."""
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.startswith("vllm_fleet"):
            return False
        raise
    return True


def _load_plugins(argv: list[str]) -> tuple[dict[str, str], set[str]]:
    """Import the module of the command being run, that one only (its import error is that command's
    error). Without a plugin command (``--help``, a built-in command, a mistyped one), built-ins import
    nothing and the others import every module, guarded. Returns (command → why its module cannot be
    imported, for the listing; the commands whose module is loaded)."""
    cmd = next((x for x in argv if not x.startswith("-")), None)
    if cmd in PLUGINS and _import_plugin(PLUGINS[cmd].module):
        return {}, {cmd}
    if cmd in BUILTINS:
        return {}, set()
    unavailable: dict[str, str] = {}
    loaded: set[str] = set()
    for name, plugin in sorted(PLUGINS.items()):
        try:
            if _import_plugin(plugin.module):
                loaded.add(name)
        except Exception as exc:
            unavailable[name] = f"{plugin.module} cannot be imported ({type(exc).__name__}: {exc})"
    return unavailable, loaded


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(*_load_plugins(argv))
    a = parser.parse_args(argv)
    try:
        return int(a.handler(a))
    except SpecError as exc:
        print(exc.render(), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
