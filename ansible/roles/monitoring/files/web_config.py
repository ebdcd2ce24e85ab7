"""Keep a Prometheus web config (basic_auth_users) in step with one password, idempotently.

Run by the monitoring role with the host's python3: argv[1] is JSON {path, user, group, check}; the password
comes on stdin (never on the command line). The file is left alone when its hash for the user already matches
the password (bcrypt salts differ on every hash, so rewriting would report a change on every run); otherwise a
new bcrypt hash is written (mode 0640, root:GROUP). Prints JSON {"changed": bool}.
"""

import grp
import json
import os
import sys
import tempfile
import warnings

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    import crypt  # Debian 12's Python 3.11; libxcrypt hashes bcrypt ($2b$)


def current_hash(path, user):
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


def main():
    args = json.loads(sys.argv[1])
    password = sys.stdin.read().rstrip("\n")
    path, user, check = args["path"], args["user"], bool(args.get("check"))
    old = current_hash(path, user)
    ok = bool(old) and crypt.crypt(password, old) == old
    st = os.stat(path) if os.path.exists(path) else None
    gid = -1 if check else grp.getgrnam(args["group"]).gr_gid
    if (
        ok
        and st is not None
        and st.st_mode & 0o777 == 0o640
        and (check or (st.st_uid, st.st_gid) == (0, gid))
    ):
        print(json.dumps({"changed": False}))
        return
    if not check:
        hashed = old if ok else crypt.crypt(password, crypt.mksalt(crypt.METHOD_BLOWFISH, rounds=1 << 10))
        text = (
            "# Ansible managed (vllm-fleet monitoring role): basic auth of Prometheus, Alertmanager and\n"
            "# node-exporter (--web.config.file). The bcrypt hash only; the password is never stored here.\n"
            "basic_auth_users:\n  " + json.dumps(user) + ": " + json.dumps(hashed) + "\n"
        )
        folder = os.path.dirname(path)
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".vf-web-")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chown(tmp, 0, gid)
        os.chmod(tmp, 0o640)
        os.rename(tmp, path)
    print(json.dumps({"changed": True}))


main()
