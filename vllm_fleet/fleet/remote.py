"""The controller's way to the fleet's hosts outside a play: OpenSSH, with each host's connection as the Ansible
inventory gives it (``ansible-inventory --list``: ``ansible_host``, ``ansible_user``, ``ansible_port``,
``ansible_ssh_private_key_file``, ``ansible_ssh_common_args`` / ``ansible_ssh_extra_args``), one multiplexed
connection per host (``ControlMaster``): `vllm-fleet rollout` renews a lease on every gateway every few
seconds, so a command costs a round trip, not a handshake.

``Remote.http`` sends a batch of HTTP requests from a host (its ``python3``, standard library only), e.g. to the
monitoring host's own Prometheus and Alertmanager: they admit the monitoring host itself, and their password
file is readable there, so the controller needs neither a firewall opening nor the password.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# connection setup and one command: an unreachable host must not hold a rollout for long
CONNECT_TIMEOUT = 10
COMMAND_TIMEOUT = 60.0


class RemoteError(Exception):
    pass


@dataclass(frozen=True)
class HostConn:
    """How to reach one inventory host over SSH."""

    name: str
    address: str
    user: str = ""
    port: int | None = None
    key: str = ""
    ssh_args: tuple[str, ...] = ()


def ansible_bin(tool: str) -> str:
    """An Ansible tool: from ``$VLLM_FLEET_ANSIBLE_BIN`` (a folder) when set, else from PATH, else next to this
    interpreter (a venv's bin)."""
    folder = os.environ.get("VLLM_FLEET_ANSIBLE_BIN", "")
    if folder:
        return str(Path(folder) / tool)
    found = shutil.which(tool)
    if found:
        return found
    import sys

    return str(Path(sys.executable).parent / tool)


def parse_inventory(doc: dict[str, Any]) -> dict[str, HostConn]:
    """``ansible-inventory --list`` output → each host's connection."""
    hostvars = (doc.get("_meta") or {}).get("hostvars") or {}
    out: dict[str, HostConn] = {}
    for name, hv in hostvars.items():
        args = " ".join(str(hv.get(k) or "") for k in ("ansible_ssh_common_args", "ansible_ssh_extra_args"))
        port = hv.get("ansible_port") or hv.get("ansible_ssh_port")
        out[name] = HostConn(
            name=name,
            address=str(hv.get("ansible_host") or name),
            user=str(hv.get("ansible_user") or hv.get("ansible_ssh_user") or ""),
            port=int(port) if port else None,
            key=str(hv.get("ansible_ssh_private_key_file") or hv.get("ansible_private_key_file") or ""),
            ssh_args=tuple(shlex.split(args)),
        )
    return out


def load_inventory(inventory: str) -> dict[str, HostConn]:
    cmd = [ansible_bin("ansible-inventory"), "-i", inventory, "--list"]
    try:
        cp = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RemoteError(f"cannot read the inventory {inventory}: {exc}") from None
    if cp.returncode != 0:
        raise RemoteError(f"ansible-inventory -i {inventory} failed: {cp.stderr.strip()[-600:]}")
    return parse_inventory(json.loads(cp.stdout))


# Run on a host by Remote.http: reads [{method, url, body, auth_user, auth_file, timeout}] on stdin, answers
# [{status, body} | {error}] on stdout. Standard library only (the host's python3, which Ansible needs too).
_HTTP_SCRIPT = r"""
import base64, json, sys, urllib.request, urllib.error
out = []
for q in json.load(sys.stdin):
    req = urllib.request.Request(q["url"], method=q.get("method", "GET"),
                                 data=None if q.get("body") is None else q["body"].encode())
    if q.get("body") is not None:
        req.add_header("Content-Type", "application/json")
    if q.get("auth_user"):
        try:
            pw = open(q["auth_file"]).read().strip()
        except OSError as exc:
            out.append({"error": "cannot read %s: %s" % (q["auth_file"], exc)})
            continue
        tok = base64.b64encode(("%s:%s" % (q["auth_user"], pw)).encode()).decode()
        req.add_header("Authorization", "Basic " + tok)
    try:
        with urllib.request.urlopen(req, timeout=q.get("timeout", 10)) as r:
            out.append({"status": r.status, "body": r.read().decode("utf-8", "replace")})
    except urllib.error.HTTPError as exc:
        out.append({"status": exc.code, "body": exc.read().decode("utf-8", "replace")})
    except Exception as exc:
        out.append({"error": "%s: %s" % (type(exc).__name__, exc)})
print(json.dumps(out))
"""


@dataclass
class Remote:
    """SSH to the inventory's hosts, one multiplexed connection each."""

    hosts: dict[str, HostConn]
    control_dir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="vf-ssh-"))

    def argv(self, host: str, command: str) -> list[str]:
        try:
            h = self.hosts[host]
        except KeyError:
            raise RemoteError(f"host {host!r} is not in the inventory") from None
        out = [
            "ssh",
            "-o", "BatchMode=yes",
            "-o", f"ConnectTimeout={CONNECT_TIMEOUT}",
            "-o", "ControlMaster=auto",
            "-o", f"ControlPath={self.control_dir}/%C",
            "-o", "ControlPersist=120",
            "-o", "ServerAliveInterval=5",
            *h.ssh_args,
        ]  # fmt: skip
        if h.key:
            out += ["-i", h.key]
        if h.port:
            out += ["-p", str(h.port)]
        if h.user:
            out += ["-l", h.user]
        return [*out, h.address, "--", command]

    def run(
        self, host: str, argv: list[str], stdin: str | None = None, timeout: float = COMMAND_TIMEOUT
    ) -> subprocess.CompletedProcess[str]:
        """``argv`` on ``host`` (quoted for its shell); never raises for the command's exit status."""
        cmd = self.argv(host, " ".join(shlex.quote(a) for a in argv))
        try:
            return subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return subprocess.CompletedProcess(cmd, 255, "", f"no answer from {host} within {timeout:g} s")

    def http(self, host: str, requests: list[dict[str, Any]], timeout: float = 30.0) -> list[dict[str, Any]]:
        """Each request (``method``, ``url``, ``body``, ``auth_user`` + ``auth_file`` read there, ``timeout``)
        sent from ``host``; per request ``{status, body}`` or ``{error}``."""
        cp = self.run(host, ["python3", "-c", _HTTP_SCRIPT], stdin=json.dumps(requests), timeout=timeout)
        if cp.returncode != 0:
            raise RemoteError(f"{host}: HTTP from there failed: {(cp.stderr or cp.stdout).strip()[-400:]}")
        try:
            answers: list[dict[str, Any]] = json.loads(cp.stdout)
        except ValueError:
            raise RemoteError(f"{host}: unreadable answer: {cp.stdout[-300:]!r}") from None
        return answers

    def close(self) -> None:
        for h in self.hosts:
            if h in self.hosts:
                subprocess.run(
                    [*self.argv(h, "true")[:-3], "-O", "exit", self.hosts[h].address],
                    capture_output=True,
                    timeout=10,
                    check=False,
                )
        shutil.rmtree(self.control_dir, ignore_errors=True)
