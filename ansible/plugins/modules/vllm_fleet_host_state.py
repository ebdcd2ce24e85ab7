#!/usr/bin/python
"""Ansible module: what differs on this host from what a role wants, in one round trip (reads only)."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: vllm_fleet_host_state
short_description: Read, in one call, what of a role's files, folders, units, users and groups differs on the host
description:
  - Compares what a role wants with the host and reports what is missing or differs; changes nothing, so it
    runs the same in check mode. The roles then act only on what it reports (one remote call per component
    instead of one per file).
  - Used by the artifacts, engine, gateway and monitoring roles of vllm-fleet.
options:
  files:
    description: Files, each C({path, checksum (sha1), mode, owner, group}); reported in RV(files) when missing
      or differing in content, mode or owner, and in RV(missing) when not there at all.
    type: list
    elements: dict
    default: []
  dirs:
    description: Folders, each C({path, mode, owner, group}); reported in RV(dirs) when missing or differing.
    type: list
    elements: dict
    default: []
  file_dirs:
    description: C({mode, owner, group}) for the parent folders of O(files), checked like O(dirs).
    type: dict
  globs:
    description: C({key, pattern}); RV(globs) maps each key to the sorted paths the pattern matches.
    type: dict
    default: {}
  tree:
    description: Controller folders pushed to host folders, C({roots {controller folder, host folder},
      files [{path, checksum}], mode, dir_mode, owner, group}); RV(tree) lists the controller paths whose copy
      is missing or differs, RV(tree_dirs) the host folders missing or differing.
    type: dict
  units:
    description: systemd unit names or patterns (patterns match loaded units); RV(units) maps each found unit
      to its ActiveState, SubState and UnitFileState.
    type: list
    elements: str
    default: []
  groups:
    description: Group names; RV(groups) lists those that do not exist.
    type: list
    elements: str
    default: []
  users:
    description: Users, each C({name, group, home, shell}); RV(users) lists those missing or differing.
    type: list
    elements: dict
    default: []
  read:
    description: Paths to read; RV(read) maps each to its text, or null when absent.
    type: list
    elements: str
    default: []
  exists:
    description: Paths; RV(exists) lists those that exist.
    type: list
    elements: str
    default: []
author: vllm-fleet
"""

EXAMPLES = r"""
- name: Compare the rendered files with the host
  vllm_fleet_host_state:
    files:
      - {path: /etc/vllm-fleet/instances/a.json, checksum: "{{ sha1 }}", mode: "0644", owner: root, group: root}
    file_dirs: {mode: "0755", owner: root, group: root}
  register: state
"""

RETURN = r"""
files: {description: Paths of O(files) missing or differing., returned: always, type: list, elements: str}
missing: {description: Paths of O(files) not there at all., returned: always, type: list, elements: str}
dirs: {description: Folders missing or differing., returned: always, type: list, elements: str}
groups: {description: Groups that do not exist., returned: always, type: list, elements: str}
users: {description: Users missing or differing., returned: always, type: list, elements: str}
read: {description: Path to text (null when absent)., returned: always, type: dict}
exists: {description: The paths of O(exists) that exist., returned: always, type: list, elements: str}
globs: {description: Key to the sorted matching paths., returned: always, type: dict}
units: {description: Unit to its ActiveState, SubState and UnitFileState., returned: always, type: dict}
tree: {description: Controller paths whose copy is missing or differs., returned: always, type: list, elements: str}
tree_dirs: {description: Host folders of O(tree) missing or differing., returned: always, type: list, elements: str}
"""

import glob
import grp
import hashlib
import os
import pwd
import stat
from collections.abc import Callable
from typing import Any

from ansible.module_utils.basic import AnsibleModule


def differs(path: str, mode: str, owner: str, group: str, kind: Callable[[int], bool]) -> bool:
    """Missing, another kind of file, another mode, or another owner or group."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return True
    if not kind(st.st_mode) or stat.S_IMODE(st.st_mode) != int(str(mode), 8):
        return True
    try:
        return (pwd.getpwuid(st.st_uid).pw_name, grp.getgrgid(st.st_gid).gr_name) != (owner, group)
    except KeyError:
        return True


def sha1(path: str) -> str:
    h = hashlib.sha1()  # Ansible's own file checksum (copy, stat): not a security use
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def user_differs(u: dict[str, str]) -> bool:
    try:
        pw = pwd.getpwnam(u["name"])
        return (grp.getgrgid(pw.pw_gid).gr_name, pw.pw_dir, pw.pw_shell) != (
            u["group"],
            u["home"],
            u["shell"],
        )
    except KeyError:
        return True


def group_missing(name: str) -> bool:
    try:
        grp.getgrnam(name)
        return False
    except KeyError:
        return True


def read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        return None


def units(module: AnsibleModule | None, names: list[str]) -> dict[str, dict[str, str]]:
    if not names:
        return {}
    props = ["Id", "ActiveState", "SubState", "UnitFileState"]
    argv = ["systemctl", "show", "--property=" + ",".join(props), "--", *names]
    if module is None:
        raise ValueError("reading units needs the module (systemctl through run_command)")
    _rc, out, _err = module.run_command(argv, check_rc=True)
    found = {}
    for block in out.strip().split("\n\n"):
        kv = dict(line.split("=", 1) for line in block.splitlines() if "=" in line)
        if kv.get("Id"):
            found[kv.pop("Id")] = kv
    return found


def host_state(want: dict[str, Any], module: AnsibleModule | None = None) -> dict[str, Any]:
    """What differs, for the options above (``want``: the module's parameters)."""
    files = want.get("files") or []
    dirs = list(want.get("dirs") or [])
    if want.get("file_dirs"):
        parents = sorted({os.path.dirname(f["path"]) for f in files} - {d["path"] for d in dirs})
        dirs += [dict(want["file_dirs"], path=p) for p in parents]
    out: dict[str, Any] = {
        "files": [
            f["path"]
            for f in files
            if differs(f["path"], f["mode"], f["owner"], f["group"], stat.S_ISREG)
            or sha1(f["path"]) != f["checksum"]
        ],
        "missing": [f["path"] for f in files if not os.path.lexists(f["path"])],
        "dirs": [
            d["path"] for d in dirs if differs(d["path"], d["mode"], d["owner"], d["group"], stat.S_ISDIR)
        ],
        "groups": [g for g in want.get("groups") or [] if group_missing(g)],
        "users": [u["name"] for u in want.get("users") or [] if user_differs(u)],
        "read": {p: read(p) for p in want.get("read") or []},
        "exists": [p for p in want.get("exists") or [] if os.path.lexists(p)],
        "globs": {k: sorted(glob.glob(g)) for k, g in (want.get("globs") or {}).items()},
        "units": units(module, want.get("units") or []),
    }
    tree = want.get("tree") or {"roots": {}, "files": []}
    roots = {r.rstrip("/"): d.rstrip("/") for r, d in tree["roots"].items()}
    out["tree"], folders = [], set(roots.values())
    for f in tree["files"]:
        root = max((r for r in roots if f["path"].startswith(r + "/")), key=len)
        rel = f["path"][len(root) + 1 :]
        target = os.path.join(roots[root], rel)
        if (
            differs(target, tree["mode"], tree["owner"], tree["group"], stat.S_ISREG)
            or sha1(target) != f["checksum"]
        ):
            out["tree"].append(f["path"])
        parts = rel.split("/")[:-1]
        folders |= {os.path.join(roots[root], *parts[: n + 1]) for n in range(len(parts))}
    out["tree_dirs"] = [
        d
        for d in sorted(folders)
        if differs(d, tree.get("dir_mode", "0755"), tree["owner"], tree["group"], stat.S_ISDIR)
    ]
    return out


ARGUMENT_SPEC: dict[str, Any] = {
    "files": {"type": "list", "elements": "dict", "default": []},
    "dirs": {"type": "list", "elements": "dict", "default": []},
    "file_dirs": {"type": "dict"},
    "globs": {"type": "dict", "default": {}},
    "tree": {"type": "dict"},
    "units": {"type": "list", "elements": "str", "default": []},
    "groups": {"type": "list", "elements": "str", "default": []},
    "users": {"type": "list", "elements": "dict", "default": []},
    "read": {"type": "list", "elements": "str", "default": []},
    "exists": {"type": "list", "elements": "str", "default": []},
}


def main() -> None:
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    try:
        result = host_state(module.params, module)
    except (OSError, KeyError, ValueError) as exc:
        module.fail_json(msg=f"vllm_fleet_host_state: {type(exc).__name__}: {exc}")
    module.exit_json(changed=False, **result)


if __name__ == "__main__":
    main()
