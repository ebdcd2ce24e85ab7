#!/usr/bin/python
"""Ansible module: which process (and systemd unit) listens on each of some TCP ports (reads only)."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: vllm_fleet_ports_in_use
short_description: Find the listeners of TCP ports, with their process and systemd unit
description:
  - Parses C(/proc/net/tcp) and C(/proc/net/tcp6) (LISTEN sockets) and maps their inodes to processes and their
    systemd unit (from C(/proc/PID/cgroup)). The preflight tells "free", "ours" and "taken" apart with it.
    Reads only, so it runs the same in check mode.
options:
  ports: {description: The TCP ports., type: list, elements: int, required: true}
author: vllm-fleet
"""

EXAMPLES = r"""
- name: Find listeners on the planned ports
  vllm_fleet_ports_in_use:
    ports: [8000, 8101]
  register: ports
"""

RETURN = r"""
listeners:
  description: Port to {pid, comm, unit} of the process that listens on it (ports without a listener absent).
  returned: always
  type: dict
"""

import os
import re
from typing import Any

from ansible.module_utils.basic import AnsibleModule


def _read(path: str) -> str:
    with open(path) as fh:
        return fh.read()


def listeners(wanted: set[int]) -> dict[int, dict[str, Any]]:
    """Port to {pid, comm, unit} of its listener, for the ports of ``wanted`` that have one."""
    inodes: dict[str, int] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = _read(table).splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            port = int(f[1].rsplit(":", 1)[1], 16)
            if f[3] == "0A" and port in wanted:
                inodes[f[9]] = port
    found: dict[int, dict[str, Any]] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            m = re.match(r"socket:\[(\d+)\]", link)
            if m and m.group(1) in inodes and inodes[m.group(1)] not in found:
                unit = ""
                try:
                    for cg in _read(f"/proc/{pid}/cgroup").splitlines():
                        u = re.search(r"/([^/]+\.service)", cg)
                        if u:
                            unit = u.group(1)
                            break
                    comm = _read(f"/proc/{pid}/comm").strip()
                except OSError:
                    comm = "?"
                found[inodes[m.group(1)]] = {"pid": int(pid), "comm": comm, "unit": unit}
    return found


def main() -> None:
    module = AnsibleModule(argument_spec={"ports": {"type": "list", "elements": "int", "required": True}},
                           supports_check_mode=True)  # fmt: skip
    module.exit_json(
        changed=False, listeners={str(k): v for k, v in listeners(set(module.params["ports"])).items()}
    )


if __name__ == "__main__":
    main()
