"""Lookup ``vllm_fleet_host_stacks``: each engine stack of a host with its lock, wheelhouse, id and venv, decided
in Python (``vllm_fleet.fleet.hostplan.stack_installs``); the engine role only prints it."""

from __future__ import annotations

from typing import Any

from ansible.errors import AnsibleError
from ansible.plugins.lookup import LookupBase

DOCUMENTATION = """
name: vllm_fleet_host_stacks
short_description: the engine stacks of a vllm-fleet host, decided by vllm_fleet.fleet.hostplan
description:
  - Returns, per stack of vf.host_stacks, what the engine role installs (lock, wheelhouse, id, venv, install
    record, the files and globs it compares). Reads the locks on the controller.
options:
  _terms: {description: vf.host_stacks, required: true}
  fleet_stack: {description: vf.stack, type: dict, required: true}
  prefix: {type: str, required: true}
  stacks_dir: {type: str, required: true}
  lock_dir: {type: str, required: true}
  install_lock: {type: str, required: true}
  stack_install_locks: {type: dict, default: {}}
  wheelhouse: {type: str, default: ""}
  host_wheelhouse: {type: str, default: ""}
  wheel_sha1: {type: str, required: true}
  cpu_exclude: {type: list, default: []}
"""


class LookupModule(LookupBase):
    def run(self, terms: list[Any], variables: dict[str, Any] | None = None, **kwargs: Any) -> list[Any]:
        self.set_options(var_options=variables, direct=kwargs)
        try:
            from vllm_fleet.fleet.hostplan import StackSources, stack_installs
        except ImportError as exc:  # pragma: no cover - the controller's venv has vllm-fleet
            raise AnsibleError(f"vllm_fleet_host_stacks needs vllm-fleet on the controller: {exc}") from exc
        o = self.get_option
        src = StackSources(
            prefix=o("prefix"), stacks_dir=o("stacks_dir"), lock_dir=o("lock_dir"), install_lock=o("install_lock"),
            stack_install_locks=dict(o("stack_install_locks") or {}), wheelhouse=o("wheelhouse") or "",
            host_wheelhouse=o("host_wheelhouse") or "", wheel_sha1=o("wheel_sha1"),
            cpu_exclude=tuple(o("cpu_exclude") or ()),
        )  # fmt: skip
        stacks = terms[0] if len(terms) == 1 and isinstance(terms[0], list) else terms
        try:
            return stack_installs([dict(s) for s in stacks], dict(o("fleet_stack")), src)
        except OSError as exc:
            raise AnsibleError(f"vllm_fleet_host_stacks: cannot read a lock: {exc}") from exc
