"""keepalived's ``notify`` on a gateway host of two or more (docs/design/ha.md): the VRRP state, for the exporter.

keepalived runs ``VENV/bin/vllm-fleet-vrrp-notify --state-file PATH`` (this module's console script) after
every state change of the gateway's ``vrrp_instance``, with four arguments of its own appended
(keepalived.conf(5), ``notify``): TYPE (``INSTANCE``), NAME (the instance), STATE (``MASTER`` | ``BACKUP``
| ``FAULT`` | ``STOP``) and PRIORITY. This
writes them, with the time and keepalived's process id (the notify's parent), as one JSON object
(``vllm_fleet.contracts.VrrpStateFile``) to the state file, replaced atomically (a temp file in the same folder
+ rename): the host exporter reads it at every scrape (``vllm_fleet_gateway_vrrp_master``,
``vllm_fleet_gateway_vrrp_state``). Standard library only (keepalived starts it on every change; the CLI would
load the spec model first).

It runs as root — the notify line names the user (``notify "..." root``), the checks run as ``script_user``
(nobody): the folder it creates under /run (0755) and the file (0644) are root's, so only root can say which
gateway holds the address, and every user (the exporter's) can read it. keepalived ignores a notify's exit
status; this one exits 0 when the file was written, 1 (with a line on stderr, keepalived's journal) when not.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from vllm_fleet.contracts import VRRP_STATE_FILE, VrrpStateFile
from vllm_fleet.files import write_json_atomic


def record(kind: str, name: str, state: str, priority: int, now: float | None = None) -> VrrpStateFile:
    """What the state file says after keepalived reported ``state`` for ``name``."""
    return {
        "state": state.upper(),
        "type": kind.upper(),
        "name": name,
        "priority": priority,
        "since": time.time() if now is None else now,
        "keepalived_pid": os.getppid(),
    }


def write(path: Path, rec: VrrpStateFile) -> None:
    """Replace ``path`` with ``rec`` atomically: the folder 0755 (made when missing), the file 0644."""
    path.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(path.parent, 0o755)  # whatever the umask (mkdir's mode is masked by it)
    write_json_atomic(path, rec)  # 0644 whatever the umask: the exporter's user reads it


def _priority(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a priority: {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m vllm_fleet.host.vrrp_notify", description=__doc__.splitlines()[0]
    )
    p.add_argument("--state-file", default=VRRP_STATE_FILE, help=f"default {VRRP_STATE_FILE}")
    p.add_argument("type", help="INSTANCE or GROUP (keepalived)")
    p.add_argument("name", help="the vrrp_instance's name (keepalived)")
    p.add_argument("state", help="MASTER, BACKUP, FAULT or STOP (keepalived)")
    p.add_argument("priority", type=_priority, help="the instance's priority (keepalived)")
    a = p.parse_args(argv)
    try:
        write(Path(a.state_file), record(a.type, a.name, a.state, a.priority))
    except OSError as exc:
        print(f"vrrp_notify: cannot write {a.state_file}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
