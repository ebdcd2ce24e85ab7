"""Command line: argument parsing only; the work is in the modules."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

from vllm_fleet.fleet.spec import FleetSpec, SpecError, load_spec

Handler = Callable[[argparse.Namespace], int]
_COMMANDS: dict[str, tuple[Callable[[argparse.ArgumentParser], None], Handler, str]] = {}


def command(
    name: str, help_text: str
) -> Callable[[Callable[[argparse.ArgumentParser], None]], Callable[..., None]]:
    """Register ``name``: the decorated function adds arguments; it must set ``handler`` on the parser."""

    def deco(fn: Callable[[argparse.ArgumentParser], None]) -> Callable[..., None]:
        _COMMANDS[name] = (fn, lambda a: 0, help_text)
        return fn

    return deco


def _spec(path: str) -> FleetSpec:
    return load_spec(path)


def _cmd_plan(a: argparse.Namespace) -> int:
    from vllm_fleet.fleet.plan import format_plan, make_plan

    spec = _spec(a.spec)
    plan = make_plan(spec, [Path(d) for d in a.models_dir])
    if a.json:
        print(json.dumps(plan.to_dict(), indent=2))
    else:
        print(format_plan(plan))
    return 0 if plan.ok else 1


def _cmd_render(a: argparse.Namespace) -> int:
    from vllm_fleet.fleet.plan import format_plan, make_plan
    from vllm_fleet.fleet.render import render_fleet

    spec = _spec(a.spec)
    plan = make_plan(spec, [Path(d) for d in a.models_dir])
    if not plan.ok and not a.force:
        print(format_plan(plan), file=sys.stderr)
        print("render: the plan is refused; nothing written", file=sys.stderr)
        return 1
    written = render_fleet(spec, Path(a.out), plan)
    for p in written:
        print(p)
    return 0


def _cmd_context(a: argparse.Namespace) -> int:
    from vllm_fleet.fleet.plan import make_plan
    from vllm_fleet.fleet.render import Renderer

    spec = _spec(a.spec)
    plan = make_plan(spec, [Path(d) for d in a.models_dir])
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


def build_parser(unavailable: dict[str, str] | None = None) -> argparse.ArgumentParser:
    """The parser of the built-in commands and the registered plugin commands; ``unavailable`` (command →
    why its module cannot be imported) are listed too, marked so, and only report that when run."""
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
    sp.add_argument("--prometheus", default="", metavar="URL", help="default: the spec's monitoring host")
    sp.add_argument(
        "--prometheus-user",
        default="",
        help="basic auth user (password: --prometheus-password-file or $VLLM_FLEET_PROMETHEUS_PASSWORD)",
    )
    sp.add_argument("--prometheus-password-file", default="", metavar="FILE")
    broken = {name: why for name, why in (unavailable or {}).items() if name not in _COMMANDS}
    for name in sorted([*_COMMANDS, *broken]):
        if name in broken:
            text = f"UNAVAILABLE: {broken[name]}"
            sub.add_parser(name, help=text, description=text).set_defaults(handler=_unavailable(name, text))
            continue
        add_args, _, help_text = _COMMANDS[name]
        sp = sub.add_parser(name, help=help_text, description=help_text)
        add_args(sp)
    return p


def _unavailable(name: str, text: str) -> Handler:
    def handler(a: argparse.Namespace) -> int:
        print(f"vllm-fleet {name}: {text}", file=sys.stderr)
        return 1

    return handler


BUILTINS = ("validate", "plan", "render", "context", "status")
# sub-commands that live in their own modules (registered there with @command), imported only when needed:
# a module that fails to import breaks its own commands, not the others
PLUGINS: dict[str, str] = {
    "bench": "vllm_fleet.bench.cli",
    "doctor": "vllm_fleet.host.doctor",
    "drain": "vllm_fleet.host.drain",
    "exporter": "vllm_fleet.host.exporter",
    "fetch": "vllm_fleet.host.fetch",
    "launch": "vllm_fleet.host.launcher",
    "lock": "vllm_fleet.fleet.lock",
    "manifest": "vllm_fleet.host.manifest",
    "sandbox": "vllm_fleet.devtools.sandbox",
    "tiny-model": "vllm_fleet.devtools.tinymodel",
    "undrain": "vllm_fleet.host.drain",
}


def _import_plugin(module: str) -> bool:
    """Import ``module`` (it registers its commands). False when it is not there at all: a vllm_fleet
    module missing from this installation is skipped quietly, its commands are not offered."""
    import importlib

    try:
        importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.startswith("vllm_fleet"):
            return False
        raise
    return True


def _load_plugins(argv: list[str]) -> dict[str, str]:
    """Import the module of the command being run, that one only (its import error is that command's
    error). Without a plugin command (``--help``, a built-in command, a mistyped one), built-ins import
    nothing and the others import every module, guarded: returns command → why its module cannot be
    imported, for the listing."""
    cmd = next((x for x in argv if not x.startswith("-")), None)
    if cmd in PLUGINS and _import_plugin(PLUGINS[cmd]):
        return {}
    if cmd in BUILTINS:
        return {}
    unavailable: dict[str, str] = {}
    for name, module in sorted(PLUGINS.items()):
        try:
            _import_plugin(module)
        except Exception as exc:
            unavailable[name] = f"{module} cannot be imported ({type(exc).__name__}: {exc})"
    return unavailable


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(_load_plugins(argv))
    a = parser.parse_args(argv)
    try:
        return int(a.handler(a))
    except SpecError as exc:
        print(exc.render(), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    # `python -m vllm_fleet.cli` runs this file as __main__; plugins register with the importable module
    # `vllm_fleet.cli`, so hand over to that one (else sub-commands of plugins would be missing).
    from vllm_fleet.cli import main as _main

    sys.exit(_main())
