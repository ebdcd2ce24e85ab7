"""Every conditional of the playbook (``when``, ``failed_when``, ``changed_when``, ``until``, ``assert``'s
``that``) is a boolean for every spec the schema accepts.

ansible-core 2.19 refuses a conditional whose value is not a bool (``Conditional result (False) was derived
from value of type 'NoneType'``): ``vf.gateway.tls and ...`` failed every deploy of a spec without
``gateway.tls`` (issue 27). Here each expression is evaluated with ansible-core's own conditional machinery
(``Templar.evaluate_conditional``) against the ``vf`` fact exactly as the preflight role builds it (`vllm-fleet
context SPEC --all-hosts --compact --fit-after-fetch`, then ``fleet | combine(hosts[HOST])``), the role's
defaults and vars, and the task's own ``vars``, for every example spec and a set of variants of a minimal spec
(no TLS, no Slack, no monitoring settings; then each of them turned on or off), on every host, with and
without check mode.

Skipped: expressions that name a variable only a run defines (the documented list ``RUNTIME_NAMES`` plus what
the playbook itself registers, sets with set_fact, or passes to an include); a role variable that depends on
one of those must still evaluate (with its ``default()``) or the test fails.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
import jinja2.nodes
import yaml

from vllm_fleet.cli import main as cli_main

REPO = Path(__file__).resolve().parents[2]
ROLES = REPO / "ansible" / "roles"
KEYS = ("when", "failed_when", "changed_when", "until", "that")
# Names only a run defines, besides what the playbook registers, sets and passes to includes (found below):
# the loop variable and the gathered facts. Keep this short: a name here hides its expressions from the test.
RUNTIME_NAMES = {"item", "ansible_facts", "idx"}
# the playbook keywords whose value is a list of registered/loop names or include arguments
INCLUDES = ("ansible.builtin.include_role", "ansible.builtin.include_tasks", "ansible.builtin.import_tasks")

MINIMAL: dict[str, Any] = {
    "name": "minimal",
    "stack": {"profile": "cpu", "vllm_version": "0.32.0"},
    "hosts": [{"name": "h1", "address": "10.0.0.1", "memory_gib": 16}],
    "models": [
        {
            "name": "tiny",
            "source": {"path": "/var/lib/vllm-fleet/models/tiny"},
            "host": "h1",
            "port": 8101,
            "max_model_len": 1024,
            "kv_cache_memory_bytes": 67108864,
        }
    ],
}


def _variant(**changes: Any) -> dict[str, Any]:
    spec = copy.deepcopy(MINIMAL)
    spec.update(changes)
    return spec


TWO_HOSTS = [*copy.deepcopy(MINIMAL["hosts"]), {"name": "h2", "address": "10.0.0.2", "memory_gib": 16}]
VARIANTS: dict[str, dict[str, Any]] = {
    # the defaults: no gateway.tls, no slack, no monitoring settings
    "minimal": _variant(),
    "tls-self-signed": _variant(gateway={"tls": {"self_signed": True}}),
    "tls-own-certificate": _variant(
        gateway={"tls": {"certificate": "/etc/ssl/gw.crt", "certificate_key": "/etc/ssl/gw.key"}}
    ),
    "auth-none": _variant(gateway={"auth": "none"}),
    "slack": _variant(slack={"enabled": True}),
    "no-web-auth": _variant(monitoring={"web_auth": False}),
    "no-gateway-no-monitoring-no-firewall": _variant(
        gateway={"enabled": False}, monitoring={"enabled": False}, firewall={"enabled": False}
    ),
    # a host with no instance, holding the gateway and monitoring
    "two-hosts": _variant(hosts=TWO_HOSTS, gateway={"host": "h2"}, monitoring={"host": "h2"}),
}


@dataclass
class Cond:
    where: str  # file and task name
    key: str
    expr: Any
    role: str | None
    task_vars: dict[str, Any] = field(default_factory=dict)


def _yaml_files() -> Iterator[tuple[Path, str | None]]:
    yield REPO / "site.yml", None
    for role in sorted(p for p in ROLES.iterdir() if p.is_dir()):
        for sub in ("tasks", "handlers"):
            for f in sorted((role / sub).glob("*.yml")):
                yield f, role.name


def _walk(node: Any, out: list[Cond], names: set[str], where: str, role: str | None, tvars: dict) -> None:
    if isinstance(node, list):
        for x in node:
            _walk(x, out, names, where, role, tvars)
        return
    if not isinstance(node, dict):
        return
    here = f"{where} / {node.get('name', '?')}" if "name" in node else where
    scope = {**tvars, **(node.get("vars") or {})}
    if isinstance(node.get("register"), str):
        names.add(node["register"])
    names.update((node.get("ansible.builtin.set_fact") or {}).keys())
    loop_var = (node.get("loop_control") or {}).get("loop_var")
    if loop_var:
        names.add(loop_var)
    if any(k in node for k in INCLUDES):
        # an include passes its vars to the included tasks
        names.update((node.get("vars") or {}).keys())
    for key in KEYS:
        if key not in node:
            continue
        value = node[key]
        for expr in value if isinstance(value, list) else [value]:
            out.append(Cond(here, key, expr, role, scope))
    for k, v in node.items():
        if k not in KEYS and k != "vars":
            _walk(v, out, names, here, role, scope)


def _collect() -> tuple[list[Cond], set[str]]:
    conds: list[Cond] = []
    names: set[str] = set(RUNTIME_NAMES)
    for f, role in _yaml_files():
        _walk(yaml.safe_load(f.read_text()), conds, names, str(f.relative_to(REPO)), role, {})
    return conds, names


def _names(template: str) -> set[str]:
    return {n.name for n in jinja2.Environment().parse(template).find_all(jinja2.nodes.Name)}


def _referenced(expr: str, variables: dict[str, Any]) -> set[str]:
    """The names an expression uses, and through the templated variables it uses (role and task vars), theirs."""
    seen: set[str] = set()
    todo = _names("{{ " + expr + " }}")
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo |= _template_names(variables.get(name)) - seen
    return seen


def _template_names(value: Any) -> set[str]:
    if isinstance(value, str):
        return _names(value) if "{" in value else set()
    if isinstance(value, dict):
        return set().union(*(_template_names(v) for v in value.values()))
    if isinstance(value, list):
        return set().union(*(_template_names(v) for v in value))
    return set()


def _vf_per_host(spec_file: Path) -> dict[str, dict[str, Any]]:
    """The fact ``vf`` of every host, as ansible/roles/preflight/tasks/plan.yml sets it."""
    argv = ["context", str(spec_file), "--all-hosts", "--compact", "--fit-after-fetch"]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert cli_main(argv) == 0, f"vllm-fleet {' '.join(argv)} failed"
    ctx = json.loads(buf.getvalue())
    return {h: {**ctx["fleet"], **part} for h, part in ctx["hosts"].items()}


def _role_vars(loader: Any, role: str | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if role is None:
        return out
    for sub in ("defaults", "vars"):  # role vars win over defaults
        f = ROLES / role / sub / "main.yml"
        if f.is_file():
            out.update(loader.load_from_file(str(f), trusted_as_template=True) or {})
    return out


def _spec_files(tmp_path: Path) -> list[Path]:
    files = sorted((REPO / "examples").glob("*.yml"))
    for name, spec in VARIANTS.items():
        f = tmp_path / f"{name}.yml"
        f.write_text(yaml.safe_dump(spec))
        files.append(f)
    return files


def _as_extra_vars(variables: dict[str, Any]) -> dict[str, Any]:
    """The role's boolean defaults as `-e NAME=false` passes them: strings."""
    return {k: str(not v).lower() for k, v in variables.items() if isinstance(v, bool)}


# (check mode, the boolean role variables given as strings with -e)
MODES = [(False, False), (True, False), (False, True)]


def _check(tmp_path: Path) -> dict[str, Any]:
    """Evaluate them all (in a process of its own: importing ansible patches sys.intern, which breaks a later
    torch import in the same process)."""
    from ansible.errors import AnsibleError, AnsibleUndefinedVariable
    from ansible.parsing.dataloader import DataLoader
    from ansible.plugins.loader import init_plugin_loader
    from ansible.template import Templar, trust_as_template

    from ansible import constants as C

    init_plugin_loader()
    conds, runtime = _collect()
    loader = DataLoader()
    role_vars = {role: _role_vars(loader, role) for role in {c.role for c in conds}}
    # the conditionals that read a boolean role variable (directly or through another role variable)
    reads_bool = {
        id(c)
        for c in conds
        if not isinstance(c.expr, bool)
        and _referenced(str(c.expr), {**role_vars[c.role], **c.task_vars})
        & set(_as_extra_vars(role_vars[c.role]))
    }
    # and those that read ansible_check_mode: the others give the same result in check mode
    reads_check_mode = {
        id(c)
        for c in conds
        if not isinstance(c.expr, bool)
        and "ansible_check_mode" in _referenced(str(c.expr), {**role_vars[c.role], **c.task_vars})
    }
    templar = Templar(loader=loader)
    evaluated: set[tuple[str, str]] = set()
    failures: list[str] = []
    for spec_file in _spec_files(tmp_path):
        per_host = _vf_per_host(spec_file)
        for host, vf in per_host.items():
            for check_mode, strings in MODES:
                for c in conds:
                    if (
                        isinstance(c.expr, bool)
                        or (strings and id(c) not in reads_bool)
                        or (check_mode and id(c) not in reads_check_mode)
                    ):
                        continue
                    expr = str(c.expr)
                    local = {
                        k: trust_as_template(v) if isinstance(v, str) else v for k, v in c.task_vars.items()
                    }
                    templar.available_variables = {
                        **role_vars[c.role],
                        **local,
                        **(_as_extra_vars(role_vars[c.role]) if strings else {}),
                        "vf": vf,
                        "vllm_fleet_spec": str(spec_file),
                        "ansible_check_mode": check_mode,
                        "inventory_hostname": host,
                        "ansible_play_hosts_all": list(per_host),
                        "playbook_dir": str(REPO),
                        "inventory_dir": str(tmp_path),
                        "ansible_playbook_python": sys.executable,
                        "role_path": str(ROLES / (c.role or "")),
                    }
                    try:
                        result = templar.evaluate_conditional(trust_as_template(expr))
                    except AnsibleError as e:
                        templated = {**role_vars[c.role], **c.task_vars}
                        if isinstance(e, AnsibleUndefinedVariable) and _referenced(expr, templated) & runtime:
                            continue  # a run defines it (a registered result, a loop item, a fact)
                        failures.append(
                            f"{spec_file.name} host {host} check_mode={check_mode} -e strings={strings}: "
                            f"{c.where}: {c.key}: {expr}\n    {type(e).__name__}: {str(e).splitlines()[0]}"
                        )
                        continue
                    if not isinstance(result, bool):
                        failures.append(f"{spec_file.name} {host}: {c.where}: {c.key}: {expr} -> {result!r}")
                    evaluated.add((c.where, expr))
    return {
        "allow_broken_conditionals": C.ALLOW_BROKEN_CONDITIONALS,
        "failures": list(dict.fromkeys(failures)),
        "evaluated": len(evaluated),
    }


def test_every_conditional_is_a_boolean_for_every_spec(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, __file__, str(tmp_path)], capture_output=True, text=True, timeout=600, check=False
    )
    assert run.returncode == 0, run.stderr[-4000:]
    got = json.loads(run.stdout.splitlines()[-1])
    # the check means nothing when the setting that lets a non-boolean through is on
    assert got["allow_broken_conditionals"] is False
    assert not got["failures"], "\n".join(got["failures"])
    # it must keep covering the spec-driven conditionals (not skip them all as runtime ones)
    assert got["evaluated"] >= 60, got["evaluated"]


if __name__ == "__main__":
    print(json.dumps(_check(Path(sys.argv[1]))))
