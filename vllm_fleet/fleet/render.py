"""Render every artifact for every host from the templates in the top-level folders.

Each template folder (units/, nginx/, alerts/, dashboards/, ...) holds an ``artifacts.yml`` listing its
artifacts::

    - template: vllm@.service.j2        # Jinja template in this folder (or `generator: module:function`)
      dest: /etc/systemd/system/vllm@.service   # Jinja string, may use vf / instance
      scope: engine_host                 # host | engine_host | instance | worker | gateway | monitoring
      component: engine                  # engine | gateway | monitoring (Ansible handlers key on it)
      mode: "0644"
      when: vf.slack.enabled             # optional Jinja expression
      on_change: adapters_sync           # optional: what a change of it does to its instance (scope instance):
                                         # restart (the default) or adapters_sync (`vllm-fleet adapters sync`)

The Ansible role gets the same list (``vllm-fleet context --all-hosts``, or ``--host H``) and renders the same templates with
the same variables through ``ansible.builtin.template``.
"""

from __future__ import annotations

import importlib
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import yaml

from vllm_fleet.fleet.context import HostVars, fleet_vars, host_context, repo_root
from vllm_fleet.fleet.plan import Plan, make_plan
from vllm_fleet.fleet.spec import FleetSpec

SCOPES = {"host", "engine_host", "instance", "worker", "gateway", "monitoring"}
# what a changed per-instance artifact does to its running instance (vllm_fleet/fleet/playfacts.py)
ON_CHANGE = {"restart", "adapters_sync"}


@dataclass
class ArtifactDef:
    folder: str
    template: str | None
    generator: str | None
    dest: str
    scope: str
    component: str
    mode: str
    when: str | None
    on_change: str = "restart"

    @property
    def src(self) -> str:
        return f"{self.folder}/{self.template}" if self.template else f"generator:{self.generator}"


@dataclass
class Rendered:
    host: str
    dest: str
    content: str
    mode: str
    component: str
    src: str
    instance: str | None = None


def load_artifact_defs(root: Path | None = None) -> list[ArtifactDef]:
    root = root or repo_root()
    defs: list[ArtifactDef] = []
    for manifest in sorted(root.glob("*/artifacts.yml")):
        entries = yaml.safe_load(manifest.read_text()) or []
        for n, e in enumerate(entries):
            where = f"{manifest.relative_to(root)}[{n}]"
            if ("template" in e) == ("generator" in e):
                raise ValueError(f"{where}: give exactly one of template, generator")
            if e.get("scope") not in SCOPES:
                raise ValueError(f"{where}: scope must be one of {sorted(SCOPES)}")
            if e.get("on_change", "restart") not in ON_CHANGE:
                raise ValueError(f"{where}: on_change must be one of {sorted(ON_CHANGE)}")
            defs.append(
                ArtifactDef(
                    folder=manifest.parent.name,
                    template=e.get("template"),
                    generator=e.get("generator"),
                    dest=e["dest"],
                    scope=e["scope"],
                    component=e.get("component", "engine"),
                    mode=str(e.get("mode", "0644")),
                    when=e.get("when"),
                    on_change=e.get("on_change", "restart"),
                )
            )
    return defs


def make_env(root: Path | None = None) -> jinja2.Environment:
    root = root or repo_root()
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(root)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    # filters the Ansible template module also has, so templates render the same in both
    env.filters["to_json"] = lambda v, **kw: __import__("json").dumps(v, **kw)
    env.filters["to_nice_json"] = lambda v, indent=4: __import__("json").dumps(
        v, indent=indent, sort_keys=True
    )
    env.filters["to_nice_yaml"] = lambda v, indent=2: yaml.safe_dump(v, indent=indent, sort_keys=False)
    env.filters["quote"] = lambda v: __import__("shlex").quote(str(v))
    return env


def _hosts_for(spec: FleetSpec, scope: str) -> list[str]:
    if scope == "host":
        return [h.name for h in spec.hosts]
    if scope in ("engine_host", "instance"):
        # a host that runs only a headless rank of a multi-node instance is an engine host too
        with_models = {m.host for m in spec.models} | {n.host for m in spec.models for n in m.placement}
        return [h.name for h in spec.hosts if h.name in with_models]
    if scope == "worker":
        return [h.name for h in spec.hosts if spec.workers_on(h.name)]
    if scope == "gateway":
        return spec.gateway_hosts if spec.gateway.enabled else []
    if scope == "monitoring":
        return spec.monitoring_hosts if spec.monitoring.enabled else []
    raise ValueError(scope)


def _generator(path: str) -> Callable[[dict[str, Any]], str]:
    mod, _, fn = path.partition(":")
    return getattr(importlib.import_module(mod), fn)


class Renderer:
    """Renders the artifacts of one fleet. What every host shares is made once: the plan, one Jinja
    environment whose templates (and ``dest`` / ``when`` expressions) are compiled once, the artifact
    definitions, and the fleet part of the context (``fleet_vars``); each host then costs its own artifacts
    and its part of the context only, so a fleet renders in time linear in its size."""

    def __init__(self, spec: FleetSpec, plan: Plan | None = None, root: Path | None = None) -> None:
        self.spec = spec
        self.root = root or repo_root()
        self.plan = plan or make_plan(spec)
        self.env = make_env(self.root)
        self.defs = load_artifact_defs(self.root)
        self.fleet = fleet_vars(spec, self.plan)
        self._host_vars = HostVars(spec, self.fleet)
        self._scope_hosts = {scope: set(_hosts_for(spec, scope)) for scope in SCOPES}
        self._templates: dict[str, jinja2.Template] = {}
        self._expressions: dict[str, Callable[..., Any]] = {}

    def host_part(self, host: str) -> dict[str, Any]:
        """The variables of ``host`` that are its own (``vf.host``, ``vf.instances``, ...)."""
        return self._host_vars(host)

    def context(self, host: str) -> dict[str, Any]:
        """The template variables of ``host`` (``build_context(spec, host, plan)``, from the shared part)."""
        return host_context(self.fleet, self._host_vars(host))

    def _template(self, name: str) -> jinja2.Template:
        """A template file of the root, compiled once."""
        t = self._templates.get(name)
        if t is None:
            t = self._templates[name] = self.env.get_template(name)
        return t

    def _dest(self, source: str) -> jinja2.Template:
        """``dest`` strings are templates too: each compiled once."""
        key = "\0dest:" + source  # not a file name
        t = self._templates.get(key)
        if t is None:
            t = self._templates[key] = self.env.from_string(source)
        return t

    def _when(self, expression: str, local: dict[str, Any]) -> bool:
        fn = self._expressions.get(expression)
        if fn is None:
            fn = self._expressions[expression] = self.env.compile_expression(expression)
        return bool(fn(**local))

    def _items(self, host: str) -> Iterator[tuple[ArtifactDef, dict[str, Any] | None, dict[str, Any], str]]:
        """(definition, instance, template variables, dest) of every artifact of ``host``, in order."""
        ctx = self.context(host)
        for d in self.defs:
            if host not in self._scope_hosts[d.scope]:
                continue
            loops: list[dict[str, Any] | None] = (
                list(ctx["vf"]["instances"])
                if d.scope == "instance"
                else list(ctx["vf"]["workers"])
                if d.scope == "worker"
                else [None]
            )
            for inst in loops:
                local = dict(ctx)
                if inst is not None:
                    local["instance"] = inst
                if d.when and not self._when(d.when, local):
                    continue
                yield d, inst, local, self._dest(d.dest).render(**local)

    def render_host(self, host: str) -> list[Rendered]:
        out: list[Rendered] = []
        for d, inst, local, dest in self._items(host):
            if d.template:
                content = self._template(f"{d.folder}/{d.template}").render(**local)
            else:
                assert d.generator
                content = _generator(d.generator)(local)
            out.append(
                Rendered(
                    host=host,
                    dest=dest,
                    content=content,
                    mode=d.mode,
                    component=d.component,
                    src=d.src,
                    instance=inst["name"] if inst else None,
                )
            )
        return out

    def artifact_list(self, host: str) -> list[dict[str, Any]]:
        """What the Ansible role loops over: template source (absolute), dest, mode, component, instance."""
        items: list[dict[str, Any]] = []
        for d, inst, local, dest in self._items(host):
            item: dict[str, Any] = {
                "dest": dest,
                "mode": d.mode,
                "component": d.component,
                "instance": inst,
                "instance_name": inst["name"] if inst and d.scope == "instance" else "",
            }
            if d.on_change != "restart":  # the roles' playfacts.restarts / adapter_syncs read it
                item["on_change"] = d.on_change
            if d.template:
                item["src"] = str(self.root / d.folder / d.template)
            else:
                assert d.generator
                item["src"] = ""
                item["content"] = _generator(d.generator)(local)
            items.append(item)
        return items

    def write(self, out_dir: Path, hosts: list[str] | None = None, modes: bool = True) -> list[Path]:
        """Write the artifacts of ``hosts`` (default: every host) under ``out_dir/HOST/<absolute dest>``."""
        written: list[Path] = []
        made: set[Path] = set()
        for h in hosts if hosts is not None else [h.name for h in self.spec.hosts]:
            for r in self.render_host(h):
                target = out_dir / h / r.dest.lstrip("/")
                if target.parent not in made:
                    target.parent.mkdir(parents=True, exist_ok=True)
                    made.add(target.parent)
                target.write_text(r.content)
                if modes:
                    target.chmod(int(r.mode, 8))
                written.append(target)
        return written


def render_host(
    spec: FleetSpec, host: str, plan: Plan | None = None, root: Path | None = None
) -> list[Rendered]:
    """One host's artifacts (a whole fleet: ``Renderer``, which shares the fleet-wide work)."""
    return Renderer(spec, plan, root).render_host(host)


def render_fleet(
    spec: FleetSpec, out_dir: Path, plan: Plan | None = None, root: Path | None = None
) -> list[Path]:
    """Write every host's artifacts under ``out_dir/HOST/<absolute dest>``. Returns the written paths."""
    return Renderer(spec, plan, root).write(out_dir)


def artifact_list(
    spec: FleetSpec, host: str, plan: Plan | None = None, root: Path | None = None
) -> list[dict[str, Any]]:
    """What the Ansible role loops over: template source (absolute), dest, mode, component, instance."""
    return Renderer(spec, plan, root).artifact_list(host)


MONITORING_FOLDERS = ("alerts", "monitoring", "dashboards")


def render_monitoring(
    spec: FleetSpec, out_dir: Path, folders: tuple[str, ...] = MONITORING_FOLDERS
) -> list[Path]:
    """Render only the monitoring artifacts (alerts/, monitoring/, dashboards/) of every host into
    ``out_dir/HOST/...`` — what the observability tests use, independent of other template folders."""
    root = repo_root()
    with tempfile.TemporaryDirectory(prefix="vf-monitoring-root-") as tmp:
        for f in folders:
            if (root / f / "artifacts.yml").exists():
                (Path(tmp) / f).symlink_to(root / f)
        written = Renderer(spec, root=Path(tmp)).write(out_dir, modes=False)
    return written
