#!/usr/bin/python
"""Ansible module: kernel settings kept at least at some values, in a sysctl.d drop-in and now where /proc/sys
lets it (a container's may be read-only: the file then waits for a boot that may apply it, and the module says
so)."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: vllm_fleet_sysctl
short_description: Keep kernel settings at least at some values (a sysctl.d drop-in, and now where possible)
description:
  - Writes O(path), a C(/etc/sysctl.d) drop-in with one C(name = value) line per setting (mode 0644), when its
    content differs.
  - Raises each setting now (C(/proc/sys)) where it is below its value; a setting already at or above it is left
    alone (the values are minimums).
  - Where C(/proc/sys) cannot be written (read-only, as in a systemd-nspawn container without a network
    namespace of its own; no permission; a setting this kernel does not have) the setting is left with the
    reason in RV(not_raised) and RV(msg), and a warning; the task does not fail.
  - The ansible.posix collection (its sysctl module) is not part of the controller's lock (ansible-core only).
  - Check mode reports what it would write and raise.
options:
  path: {description: The drop-in file (e.g. /etc/sysctl.d/60-vllm-fleet-gateway.conf)., type: path, required: true}
  settings:
    description: Setting name (dotted, e.g. net.core.somaxconn) to its least value.
    type: dict
    required: true
  comment: {description: The file's first lines (each written as a comment)., type: str, default: ""}
author: vllm-fleet
"""

EXAMPLES = r"""
- name: Raise the admission socket's kernel limits
  vllm_fleet_sysctl:
    path: /etc/sysctl.d/60-vllm-fleet-gateway.conf
    settings: {net.core.somaxconn: 4096, net.unix.max_dgram_qlen: 4096}
    comment: the gateway's admission service
  register: sysctl
"""

RETURN = r"""
changed:
  description: Whether the file was written or a setting raised (or would be, in check mode).
  returned: always
  type: bool
file_changed:
  description: Whether the file was (or would be) written.
  returned: always
  type: bool
raised:
  description: Setting to its value before and its value now, for the settings raised now.
  returned: always
  type: dict
not_raised:
  description: Setting to why it could not be raised now (the file applies it at the next boot that can).
  returned: always
  type: dict
msg:
  description: What was raised, and what was skipped and why.
  returned: always
  type: str
"""

import errno
import os
import tempfile
from typing import Any

from ansible.module_utils.basic import AnsibleModule

ARGUMENT_SPEC: dict[str, Any] = {
    "path": {"type": "path", "required": True},
    "settings": {"type": "dict", "required": True},
    "comment": {"type": "str", "default": ""},
}


def content(settings: dict[str, int], comment: str) -> str:
    head = "".join(f"# {line}".rstrip() + "\n" for line in comment.splitlines())
    return head + "".join(f"{name} = {int(value)}\n" for name, value in sorted(settings.items()))


def _why(exc: OSError, proc: str) -> str:
    if exc.errno == errno.EROFS:
        return f"{proc} is read-only here (a container without a network namespace of its own?)"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return f"no permission to write {proc} here (a container?)"
    if exc.errno == errno.ENOENT:
        return "no such setting here (this kernel, or this network namespace)"
    return f"{exc.strerror or exc}"


def raise_now(
    settings: dict[str, int], check: bool, proc: str = "/proc/sys"
) -> tuple[dict[str, list[int]], dict[str, str]]:
    """(setting → [before, now] for the settings raised, setting → why for those that could not be)."""
    raised: dict[str, list[int]] = {}
    skipped: dict[str, str] = {}
    for name, value in sorted(settings.items()):
        path = os.path.join(proc, *name.split("."))
        try:
            with open(path) as f:
                current = int(f.read().split()[0])
        except (OSError, ValueError, IndexError) as exc:
            skipped[name] = _why(exc, proc) if isinstance(exc, OSError) else f"unreadable value in {path}"
            continue
        if current >= int(value):
            continue
        if not check:
            try:
                with open(path, "w") as f:
                    f.write(f"{int(value)}\n")
            except OSError as exc:
                skipped[name] = _why(exc, proc)
                continue
        raised[name] = [current, int(value)]
    return raised, skipped


def write_file(path: str, text: str, check: bool) -> bool:
    """Write ``text`` to ``path`` (0644, by a rename) unless it holds it already; True when it differed."""
    try:
        with open(path) as f:
            if f.read() == text and os.stat(path).st_mode & 0o777 == 0o644:
                return False
    except FileNotFoundError:
        pass
    if check:
        return True
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".vf-sysctl-")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.rename(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return True


def ensure(
    path: str, settings: dict[str, int], comment: str, check: bool, proc: str = "/proc/sys"
) -> dict[str, Any]:
    file_changed = write_file(path, content(settings, comment), check)
    raised, skipped = raise_now(settings, check, proc)
    parts = [f"{n} {a} -> {b}" for n, (a, b) in raised.items()]
    parts += [f"{n} not raised now: {why}; {path} applies at the next boot" for n, why in skipped.items()]
    msg = "; ".join(parts) or f"{', '.join(sorted(settings))} already at least as wanted"
    return {
        "changed": file_changed or bool(raised),
        "file_changed": file_changed,
        "raised": raised,
        "not_raised": skipped,
        "msg": msg,
    }


def main() -> None:
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    p = module.params
    try:
        settings = {str(k): int(v) for k, v in p["settings"].items()}
    except (TypeError, ValueError):
        module.fail_json(msg=f"settings: every value must be an integer, got {p['settings']!r}")
    try:
        result = ensure(p["path"], settings, p["comment"], module.check_mode)
    except OSError as exc:
        module.fail_json(msg=f"{p['path']}: {exc}")
    for name, why in result["not_raised"].items():
        module.warn(f"{name} not raised now: {why}; {p['path']} applies at the next boot that can")
    module.exit_json(**result)


if __name__ == "__main__":
    main()
