"""Print {port: {pid, comm, unit}} for each TCP port given on the command line that has a listener.

Read-only: parses /proc/net/tcp{,6} (LISTEN sockets) and maps socket inodes to processes and their systemd unit
(from /proc/PID/cgroup). Used by the vllm-fleet preflight to tell "free" and "ours" from "taken".
"""

import json
import os
import re
import sys


def _read(path: str) -> str:
    with open(path) as fh:
        return fh.read()


wanted = {int(p) for p in sys.argv[1:]}
inodes = {}
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
found = {}
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
print(json.dumps(found))
