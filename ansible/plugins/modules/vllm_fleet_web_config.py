#!/usr/bin/python
"""Ansible module: a Prometheus web config (basic_auth_users) kept in step with one password, idempotently."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: vllm_fleet_web_config
short_description: Keep a Prometheus web config's bcrypt hash in step with a password
description:
  - Writes the C(--web.config.file) of Prometheus, Alertmanager and node-exporter with one user's bcrypt hash
    (mode 0640, root and O(group)).
  - Leaves the file alone when its hash for the user already matches the password and its mode and owners are
    right (bcrypt salts differ on every hash, so a rewrite would report a change on every run). Check mode
    reports whether it would write.
options:
  path: {description: The web config file., type: path, required: true}
  user: {description: The basic-auth user., type: str, required: true}
  password: {description: The password (hashed; never written in clear)., type: str, required: true, no_log: true}
  group: {description: The group that may read the file., type: str, required: true}
author: vllm-fleet
"""

EXAMPLES = r"""
- name: Keep the web config in step with the password
  vllm_fleet_web_config:
    path: /etc/prometheus/web-config.yml
    user: vllm-fleet
    password: "{{ secret }}"
    group: prometheus
"""

RETURN = r"""
changed: {description: Whether the file was (or, in check mode, would be) written., returned: always, type: bool}
"""

import grp
import json
import os
import tempfile
import warnings
from typing import Any

from ansible.module_utils.basic import AnsibleModule

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    import crypt  # Debian 12's Python 3.11; libxcrypt hashes bcrypt ($2b$)

HEADER = (
    "# Ansible managed (vllm-fleet monitoring role): basic auth of Prometheus, Alertmanager and\n"
    "# node-exporter (--web.config.file). The bcrypt hash only; the password is never stored here.\n"
)


def current_hash(path: str, user: str) -> str:
    """The user's hash in the file, '' when the file or the user is not there."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return ""
    for line in lines:
        key, _, value = line.strip().partition(":")
        if key.strip().strip("\"'") == user:
            return value.strip().strip("\"'")
    return ""


def up_to_date(path: str, user: str, password: str, gid: int | None) -> tuple[bool, str]:
    """(nothing to do, the hash to keep or ''): the hash matches, the mode is 0640, the owners root and gid
    (``gid`` None: the group is not there yet, as in check mode on a fresh host: not up to date)."""
    old = current_hash(path, user)
    ok = bool(old) and crypt.crypt(password, old) == old
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False, old if ok else ""
    fine = ok and st.st_mode & 0o777 == 0o640 and gid is not None and (st.st_uid, st.st_gid) == (0, gid)
    return fine, old if ok else ""


def write(path: str, user: str, password: str, keep: str, gid: int) -> None:
    hashed = keep or crypt.crypt(password, crypt.mksalt(crypt.METHOD_BLOWFISH, rounds=1 << 10))
    text = HEADER + "basic_auth_users:\n  " + json.dumps(user) + ": " + json.dumps(hashed) + "\n"
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".vf-web-")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chown(tmp, 0, gid)
    os.chmod(tmp, 0o640)
    os.rename(tmp, path)


ARGUMENT_SPEC: dict[str, Any] = {
    "path": {"type": "path", "required": True},
    "user": {"type": "str", "required": True},
    "password": {"type": "str", "required": True, "no_log": True},
    "group": {"type": "str", "required": True},
}


def ensure(path: str, user: str, password: str, group: str, check: bool) -> bool:
    """Bring the file in step (not in check mode); True when it was, or would be, written. A missing group
    fails (KeyError) unless in check mode (a fresh host before prometheus is installed)."""
    try:
        gid: int | None = grp.getgrnam(group).gr_gid
    except KeyError:
        if not check:
            raise
        gid = None
    fine, keep = up_to_date(path, user, password, gid)
    if not fine and not check:
        assert gid is not None
        write(path, user, password, keep, gid)
    return not fine


def main() -> None:
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    p = module.params
    try:
        changed = ensure(p["path"], p["user"], p["password"], p["group"], module.check_mode)
    except KeyError:
        module.fail_json(msg=f"group {p['group']!r} does not exist (install prometheus first)")
    except OSError as exc:
        module.fail_json(msg=f"{p['path']}: {exc}")
    module.exit_json(changed=changed)


if __name__ == "__main__":
    main()
