#!/usr/bin/python
"""Ansible module: the engine stacks on a host: which venv a new stack is copied from, which are in use, which
to prune (reads only)."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: vllm_fleet_stacks
short_description: Read the engine stacks (venvs) of a vllm-fleet host and decide seeds and pruning
description:
  - Reads the stack folders under O(stacks_dir), the instance configs, the rollback copies and the running
    engines' state files. Changes nothing (the engine role removes what RV(prune) lists with
    ansible.builtin.file), so it runs the same in check mode.
options:
  stacks_dir: {description: The folder of the stack venvs (one per PROFILE-VERSION-HASH12)., type: path, required: true}
  new:
    description: The stack(s) this host runs (folder names), the fleet's first.
    type: list
    elements: str
    required: true
  keep: {description: Stacks kept besides those in use (the previous one stays for a rollback)., type: int, required: true}
  config_dir: {description: The instance configs (their command names the venv)., type: path, required: true}
  state_dir: {description: The launchers' state files (their stack)., type: path, required: true}
  rollback_dir: {description: The rollback copies of instance configs., type: path, required: true}
  legacy: {description: The fleet's own venv, a seed for a first stack when it has a python., type: path, required: true}
author: vllm-fleet
"""

EXAMPLES = r"""
- name: Read the engine stacks of this host
  vllm_fleet_stacks:
    stacks_dir: /opt/vllm-fleet/stacks
    new: [cpu-0.32.0-0123456789ab]
    keep: 2
    config_dir: /etc/vllm-fleet/instances
    state_dir: /run/vllm-fleet
    rollback_dir: /var/lib/vllm-fleet/rollback
    legacy: /opt/vllm-fleet/venv
  register: stacks
"""

RETURN = r"""
seeds: {description: Per new stack the venv to hard-link it from ('' when none or it exists)., returned: always, type: dict}
seed: {description: The first new stack's seed., returned: always, type: str}
in_use:
  description: Stacks an instance config, a rollback copy or a running engine names.
  returned: always
  type: list
  elements: str
prune:
  description: Stack folders to remove (not new, not in use, beyond keep).
  returned: always
  type: list
  elements: str
"""

import json
import os
from typing import Any

from ansible.module_utils.basic import AnsibleModule

# the contract's own rule (vllm_fleet/contracts.py, shipped to the host as module_utils like the doctor's files)
from ansible.module_utils.vllm_fleet.contracts import stack_of


def named(folder: str, key: str) -> set[str]:
    """The stacks the JSON files of ``folder`` name (``key`` "stack": a state file; "command": a config)."""
    out: set[str] = set()
    if not os.path.isdir(folder):
        return out
    for f in os.listdir(folder):
        if not f.endswith(".json"):
            continue
        try:
            with open(os.path.join(folder, f)) as fh:
                d = json.load(fh)
        except (OSError, ValueError):
            continue
        if isinstance(d, dict):
            out.add(str(d.get("stack") or "") if key == "stack" else stack_of(d.get("command")))
    out.discard("")
    return out


def stacks_state(a: dict[str, Any]) -> dict[str, Any]:
    """Seeds, stacks in use and stacks to prune for the options above (``a``: the module's parameters)."""
    root = a["stacks_dir"]
    news = [a["new"]] if isinstance(a["new"], str) else list(a["new"])
    stacks: list[tuple[float, str]] = []
    if os.path.isdir(root):
        for name in os.listdir(root):
            marker = os.path.join(root, name, ".vllm-fleet-installed.json")
            when = os.stat(marker).st_mtime if os.path.exists(marker) else 0.0
            stacks.append((when, name))
    stacks.sort(reverse=True)
    in_use = (
        named(a["config_dir"], "command")
        | named(a["rollback_dir"], "command")
        | named(a["state_dir"], "stack")
    )
    keep = set(news) | in_use
    # the stacks in use count toward ``keep`` (one more per further new stack): the other newest ones fill what is
    # left (the previous one)
    limit = int(a["keep"]) + len(news) - 1
    kept = len(keep & {n for _, n in stacks} | set(news))
    prune: list[str] = []
    for when, name in stacks:
        if name in keep:
            continue
        if when and kept < limit:
            kept += 1
            continue
        prune.append(os.path.join(root, name))
    seeds: dict[str, str] = {}
    for new in news:
        seed = ""
        if not os.path.exists(os.path.join(root, new, "bin", "python")):
            done = [n for w, n in stacks if w and n != new]
            # PROFILE-VERSION-HASH12: a stack of the same profile shares the most files
            done.sort(key=lambda n: n.split("-")[0] != new.split("-")[0])
            if done:
                seed = os.path.join(root, done[0])
            elif os.path.exists(os.path.join(a["legacy"], "bin", "python")):
                seed = a["legacy"]
        seeds[new] = seed
    return {
        "seed": seeds[news[0]] if news else "",
        "seeds": seeds,
        "in_use": sorted(in_use),
        "prune": sorted(prune),
    }


ARGUMENT_SPEC: dict[str, Any] = {
    "stacks_dir": {"type": "path", "required": True},
    "new": {"type": "list", "elements": "str", "required": True},
    "keep": {"type": "int", "required": True},
    "config_dir": {"type": "path", "required": True},
    "state_dir": {"type": "path", "required": True},
    "rollback_dir": {"type": "path", "required": True},
    "legacy": {"type": "path", "required": True},
}


def main() -> None:
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    try:
        result = stacks_state(module.params)
    except OSError as exc:
        module.fail_json(msg=f"vllm_fleet_stacks: {exc}")
    module.exit_json(changed=False, **result)


if __name__ == "__main__":
    main()
