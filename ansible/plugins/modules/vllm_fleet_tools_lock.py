#!/usr/bin/python
"""Ansible module: the lock entries of the packages vllm-fleet itself needs (the fleet's own venv)."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: vllm_fleet_tools_lock
short_description: Write the pins (with their hashes) of the named packages from a hashed lock
description:
  - Writes O(dest) with the C(name==version) lines and their C(--hash) lines of O(packages) (names
    normalised) taken from O(lock), so that pip still installs them with C(--require-hashes). Written only when
    the content differs; check mode reports whether it would be.
options:
  lock: {description: The hashed lock (pip-compile --generate-hashes)., type: path, required: true}
  dest: {description: The file to write., type: path, required: true}
  packages: {description: The packages to take., type: list, elements: str, required: true}
author: vllm-fleet
"""

EXAMPLES = r"""
- name: Pick the lock's pins of what vllm-fleet needs
  vllm_fleet_tools_lock:
    lock: /opt/vllm-fleet/lock.txt
    dest: /opt/vllm-fleet/venv/tools-lock.txt
    packages: [pydantic, pyyaml]
"""

RETURN = r"""
pins: {description: How many pins were taken., returned: success, type: int}
"""

import os
import re
from typing import Any

from ansible.module_utils.basic import AnsibleModule


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(lock_text: str, packages: list[str]) -> list[str]:
    """The lock's entries (one line each, hashes included) of ``packages``; ValueError naming any missing."""
    names = {norm(n) for n in packages}
    entries = lock_text.replace("\\\n", " ").splitlines()
    keep = [
        e.strip()
        for e in entries
        if "==" in e and not e.startswith("#") and norm(e.split("==")[0].strip()) in names
    ]
    missing = names - {norm(e.split("==")[0].strip()) for e in keep}
    if missing:
        raise ValueError(f"no pin for {', '.join(sorted(missing))} (vllm-fleet needs them in its own venv)")
    return keep


def main() -> None:
    spec: dict[str, Any] = {
        "lock": {"type": "path", "required": True},
        "dest": {"type": "path", "required": True},
        "packages": {"type": "list", "elements": "str", "required": True},
    }
    module = AnsibleModule(argument_spec=spec, supports_check_mode=True)
    p = module.params
    try:
        with open(p["lock"]) as f:
            keep = pins(f.read(), p["packages"])
    except (OSError, ValueError) as exc:
        module.fail_json(msg=f"{p['lock']}: {exc}")
    text = "".join(e + "\n" for e in keep)
    try:
        with open(p["dest"]) as f:
            same = f.read() == text
    except FileNotFoundError:
        same = False
    if not same and not module.check_mode:
        tmp = p["dest"] + ".tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, p["dest"])
    module.exit_json(changed=not same, pins=len(keep))


if __name__ == "__main__":
    main()
