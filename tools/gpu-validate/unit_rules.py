"""The rendered gpu unit's sandbox as data, for unit_sandbox.py on a machine without systemd.

    python tools/gpu-validate/unit_rules.py UNIT DROPIN > rules.json

Reads the rendered ``vllm@.service`` and the instance's ``10-fleet.conf`` (the same files systemd reads) and
expands ``SystemCallFilter=`` the way systemd does, with this machine's ``systemd-analyze syscall-filter``
(systemd 252 here, the Debian 12 hosts' version): an allow-list starts with the implicit ``@default`` set,
each later ``~`` entry removes syscalls; ``ProtectKernelModules=``/``ProtectClock=``/``ProtectKernelLogs=``/
``ProtectHostname=`` add their own deny filters. Everything else is passed on as the unit's values.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any


def unit_values(*paths: str) -> dict[str, list[str]]:
    """Every ``Key=value`` of the files, in order (repeated keys accumulate; an empty value resets)."""
    out: dict[str, list[str]] = {}
    for p in paths:
        for raw in Path(p).read_text().splitlines():
            line = raw.strip()
            if not line or line.startswith(("#", ";", "[")) or "=" not in line:
                continue
            k, v = line.split("=", 1)
            if v == "":
                out[k] = []
            else:
                out.setdefault(k, []).append(v)
    return out


def syscall_groups() -> dict[str, list[str]]:
    """systemd-analyze syscall-filter: group -> members (names and nested @groups)."""
    text = subprocess.run(
        ["systemd-analyze", "syscall-filter", "--no-pager"], text=True, capture_output=True, check=True
    ).stdout
    groups: dict[str, list[str]] = {}
    cur = ""
    for raw in text.splitlines():
        if raw.startswith("@"):
            cur = raw.split()[0]
            groups[cur] = []
        elif cur and raw.strip() and not raw.strip().startswith("#"):
            groups[cur].append(raw.split()[0])
    return groups


def expand(item: str, groups: dict[str, list[str]]) -> set[str]:
    if not item.startswith("@"):
        return {item}
    out: set[str] = set()
    for m in groups[item]:
        out |= expand(m, groups)
    return out


def yes(v: list[str] | None) -> bool:
    return bool(v) and v[-1].lower() in ("yes", "true", "1", "on")  # type: ignore[index]


def rules(unit: str, dropin: str) -> dict[str, Any]:
    u = unit_values(unit, dropin)
    groups = syscall_groups()
    allow: set[str] = set()
    allow_list = False
    for entry in u.get("SystemCallFilter", []):
        deny = entry.startswith("~")
        items = entry.lstrip("~").split()
        if not allow_list and not deny:
            allow_list = True
            allow |= expand("@default", groups)
        for it in items:
            if deny:
                allow -= expand(it, groups)
            else:
                allow |= expand(it, groups)
    extra_deny: dict[str, list[str]] = {}
    if yes(u.get("ProtectKernelModules")):
        extra_deny["ProtectKernelModules"] = sorted(expand("@module", groups))
    if yes(u.get("ProtectClock")):
        extra_deny["ProtectClock"] = sorted(expand("@clock", groups))
    if yes(u.get("ProtectKernelLogs")):
        extra_deny["ProtectKernelLogs"] = ["syslog"]
    if yes(u.get("ProtectHostname")):
        extra_deny["ProtectHostname"] = ["sethostname", "setdomainname"]
    return {
        "systemd": subprocess.run(
            ["systemd-analyze", "--version"], text=True, capture_output=True
        ).stdout.split("\n")[0],
        "syscall_allow": sorted(allow) if allow_list else None,
        "syscall_errno": (u.get("SystemCallErrorNumber") or ["EPERM"])[-1],
        "syscall_arch": (u.get("SystemCallArchitectures") or [""])[-1],
        "extra_deny": extra_deny,
        "address_families": " ".join(u.get("RestrictAddressFamilies", [])).split(),
        "restrict_namespaces": yes(u.get("RestrictNamespaces")),
        "lock_personality": yes(u.get("LockPersonality")),
        "restrict_realtime": yes(u.get("RestrictRealtime")),
        "restrict_suid_sgid": yes(u.get("RestrictSUIDSGID")),
        "no_new_privileges": yes(u.get("NoNewPrivileges")),
        "memory_deny_write_execute": yes(u.get("MemoryDenyWriteExecute")),
        "capability_bounding_set": u.get("CapabilityBoundingSet", []),
        "protect_system": (u.get("ProtectSystem") or [""])[-1],
        "protect_home": (u.get("ProtectHome") or [""])[-1],
        "private_tmp": yes(u.get("PrivateTmp")),
        "protect_proc": (u.get("ProtectProc") or [""])[-1],
        "protect_kernel_tunables": yes(u.get("ProtectKernelTunables")),
        "protect_control_groups": yes(u.get("ProtectControlGroups")),
        # ReadWritePaths= plus what systemd creates writable for the unit: RuntimeDirectory=, StateDirectory=
        "read_write_paths": [p.lstrip("-") for v in u.get("ReadWritePaths", []) for p in v.split()]
        + [f"/run/{d}" for v in u.get("RuntimeDirectory", []) for d in v.split()]
        + [f"/var/lib/{d}" for v in u.get("StateDirectory", []) for d in v.split()],
        "user": (u.get("User") or ["root"])[-1],
        "device_policy": (u.get("DevicePolicy") or ["auto"])[-1],
        "device_allow": u.get("DeviceAllow", []),
        "umask": (u.get("UMask") or ["0022"])[-1],
        "limit_nofile": (u.get("LimitNOFILE") or [""])[-1],
        "limit_memlock": (u.get("LimitMEMLOCK") or [""])[-1],
        "environment": u.get("Environment", []),
        "exec_start": (u.get("ExecStart") or [""])[-1],
    }


if __name__ == "__main__":
    json.dump(rules(sys.argv[1], sys.argv[2]), sys.stdout, indent=1)
    print()
