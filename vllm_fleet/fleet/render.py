"""Render every artifact for every host from the templates in the top-level folders.

Each template folder (units/, nginx/, alerts/, dashboards/, ...) holds an ``artifacts.yml`` listing its
artifacts::

    - template: vllm@.service.j2        # Jinja template in this folder (or `generator: module:function`)
      dest: /etc/systemd/system/vllm@.service   # Jinja string, may use vf / instance
      scope: engine_host                 # host | engine_host | instance | gateway | monitoring
      component: engine                  # engine | gateway | monitoring (Ansible handlers key on it)
      mode: "0644"
      when: vf.slack.enabled             # optional Jinja expression

The Ansible role gets the same list (``vllm-fleet context --host H``) and renders the same templates with
the same variables through ``ansible.builtin.template``.
"""

from __future__ import annotations

import importlib
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import yaml

from vllm_fleet.fleet.context import build_context, repo_root
from vllm_fleet.fleet.plan import Plan, make_plan
from vllm_fleet.fleet.spec import FleetSpec

SCOPES = {"host", "engine_host", "instance", "gateway", "monitoring"}


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
        return [h.name for h in spec.hosts if spec.models_on(h.name)]
    if scope == "gateway":
        return [spec.gateway_host] if spec.gateway.enabled else []
    if scope == "monitoring":
        return [spec.monitoring_host] if spec.monitoring.enabled else []
    raise ValueError(scope)


def _generator(path: str) -> Callable[[dict[str, Any]], str]:
    mod, _, fn = path.partition(":")
    return getattr(importlib.import_module(mod), fn)


def render_host(
    spec: FleetSpec, host: str, plan: Plan | None = None, root: Path | None = None
) -> list[Rendered]:
    plan = plan or make_plan(spec)
    env = make_env(root)
    ctx = build_context(spec, host, plan)
    out: list[Rendered] = []
    for d in load_artifact_defs(root):
        if host not in _hosts_for(spec, d.scope):
            continue
        loops: list[dict[str, Any] | None] = list(ctx["vf"]["instances"]) if d.scope == "instance" else [None]
        for inst in loops:
            local = dict(ctx)
            if inst is not None:
                local["instance"] = inst
            if d.when and not env.compile_expression(d.when)(**local):
                continue
            dest = env.from_string(d.dest).render(**local)
            if d.template:
                content = env.get_template(f"{d.folder}/{d.template}").render(**local)
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


def render_fleet(
    spec: FleetSpec, out_dir: Path, plan: Plan | None = None, root: Path | None = None
) -> list[Path]:
    """Write every host's artifacts under ``out_dir/HOST/<absolute dest>``. Returns the written paths."""
    plan = plan or make_plan(spec)
    written: list[Path] = []
    for h in spec.hosts:
        for r in render_host(spec, h.name, plan, root):
            target = out_dir / h.name / r.dest.lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(r.content)
            target.chmod(int(r.mode, 8))
            written.append(target)
    return written


def artifact_list(
    spec: FleetSpec, host: str, plan: Plan | None = None, root: Path | None = None
) -> list[dict[str, Any]]:
    """What the Ansible role loops over: template source (absolute), dest, mode, component, instance."""
    root = root or repo_root()
    plan = plan or make_plan(spec)
    env = make_env(root)
    ctx = build_context(spec, host, plan)
    items: list[dict[str, Any]] = []
    for d in load_artifact_defs(root):
        if host not in _hosts_for(spec, d.scope):
            continue
        loops: list[dict[str, Any] | None] = list(ctx["vf"]["instances"]) if d.scope == "instance" else [None]
        for inst in loops:
            local = dict(ctx)
            if inst is not None:
                local["instance"] = inst
            if d.when and not env.compile_expression(d.when)(**local):
                continue
            item: dict[str, Any] = {
                "dest": env.from_string(d.dest).render(**local),
                "mode": d.mode,
                "component": d.component,
                "instance": inst,
                "instance_name": inst["name"] if inst else "",
            }
            if d.template:
                item["src"] = str(root / d.folder / d.template)
            else:
                assert d.generator
                item["src"] = ""
                item["content"] = _generator(d.generator)(local)
            items.append(item)
    return items


MONITORING_FOLDERS = ("alerts", "monitoring", "dashboards")


def render_monitoring(
    spec: FleetSpec, out_dir: Path, folders: tuple[str, ...] = MONITORING_FOLDERS
) -> list[Path]:
    """Render only the monitoring artifacts (alerts/, monitoring/, dashboards/) of every host into
    ``out_dir/HOST/...`` — what the observability tests use, independent of other template folders."""
    root = repo_root()
    written: list[Path] = []
    with tempfile.TemporaryDirectory(prefix="vf-monitoring-root-") as tmp:
        for f in folders:
            if (root / f / "artifacts.yml").exists():
                (Path(tmp) / f).symlink_to(root / f)
        for h in spec.hosts:
            for r in render_host(spec, h.name, root=Path(tmp)):
                target = out_dir / h.name / r.dest.lstrip("/")
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(r.content)
                written.append(target)
    return written
