"""What differs on this host from what a role wants, in one round trip (run with the host's python3 by the
artifacts and engine roles; reads only, so it also runs in check mode).

argv[1]: JSON with any of
  files:  [{path, checksum (sha1), mode, owner, group}]  -> "files": paths missing or differing in content,
                                                             mode or owner; "missing": those not there at all
  dirs:   [{path, mode, owner, group}]                    -> "dirs": folders missing or differing
  globs:  {key: pattern}                                  -> "globs": {key: [matching paths]}
  tree:   {roots: {controller folder: host folder}, files: [{path, checksum}], mode, dir_mode, owner, group}:
          controller folders pushed to host folders -> "tree": [controller paths whose copy is missing or
          differs], "tree_dirs": [host folders (and their subfolders) missing or differing]
  units:  [name or pattern]                               -> "units": {unit: {ActiveState, SubState,
                                                             UnitFileState}} (systemctl show; patterns
                                                             match loaded units)
  file_dirs: {mode, owner, group}                         -> the files' parent folders are checked as dirs too
  groups: [name]                                          -> "groups": groups that do not exist
  users:  [{name, group, home, shell}]                    -> "users": users missing or differing
  read:   [path]                                          -> "read": {path: text, or null when absent}
  exists: [path]                                          -> "exists": the paths that exist
Prints one JSON object with those keys.
"""

import glob
import grp
import hashlib
import json
import os
import pwd
import stat
import subprocess
import sys


def differs(path, mode, owner, group, kind):
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


def sha1(path):
    h = hashlib.sha1()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def user_differs(u):
    try:
        pw = pwd.getpwnam(u["name"])
        return (grp.getgrgid(pw.pw_gid).gr_name, pw.pw_dir, pw.pw_shell) != (
            u["group"],
            u["home"],
            u["shell"],
        )
    except KeyError:
        return True


def group_missing(name):
    try:
        grp.getgrnam(name)
        return False
    except KeyError:
        return True


def read(path):
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        return None


def units(names):
    if not names:
        return {}
    props = ["Id", "ActiveState", "SubState", "UnitFileState"]
    res = subprocess.run(
        ["systemctl", "show", "--property=" + ",".join(props), "--", *names],
        stdout=subprocess.PIPE,
        universal_newlines=True,  # noqa: UP021 - hosts may run an older python3
        check=True,
    )
    found = {}
    for block in res.stdout.strip().split("\n\n"):
        kv = dict(line.split("=", 1) for line in block.splitlines() if "=" in line)
        if kv.get("Id"):
            found[kv.pop("Id")] = kv
    return found


want = json.loads(sys.argv[1])
files = want.get("files", [])
dirs = list(want.get("dirs", []))
if want.get("file_dirs"):
    parents = sorted({os.path.dirname(f["path"]) for f in files} - {d["path"] for d in dirs})
    dirs += [dict(want["file_dirs"], path=p) for p in parents]
out = {
    "files": [
        f["path"]
        for f in files
        if differs(f["path"], f["mode"], f["owner"], f["group"], stat.S_ISREG)
        or sha1(f["path"]) != f["checksum"]
    ],
    "missing": [f["path"] for f in files if not os.path.lexists(f["path"])],
    "dirs": [d["path"] for d in dirs if differs(d["path"], d["mode"], d["owner"], d["group"], stat.S_ISDIR)],
    "groups": [g for g in want.get("groups", []) if group_missing(g)],
    "users": [u["name"] for u in want.get("users", []) if user_differs(u)],
    "read": {p: read(p) for p in want.get("read", [])},
    "exists": [p for p in want.get("exists", []) if os.path.lexists(p)],
    "globs": {k: sorted(glob.glob(g)) for k, g in want.get("globs", {}).items()},
    "units": units(want.get("units", [])),
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
print(json.dumps(out))
