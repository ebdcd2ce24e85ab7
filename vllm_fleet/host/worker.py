"""The headless rank of a multi-node instance: ``vllm-worker@NAME.service`` (docs/multi-node.md).

It starts ``vllm serve ... --node-rank R --headless`` in its own process group and watches rank 0, because
vLLM does not: with every rank-0 process killed, the spike saw the headless worker stay alive for minutes with
no connection left to rank 0, so a restarted rank 0 would wait for a worker that never joins again.

- **joined**: an established TCP connection to ``master_addr:master_port`` (rank 0's TCPStore) shows in the
  network namespace's ``/proc/net/tcp{,6}``; then ``READY=1``.
- **rank 0 gone**: after joining, the connection disappeared (rank 0's kernel closed it: a killed rank 0) or the
  master port does not accept a connection (a network cut, a dead host) for ``grace`` seconds: the worker ends
  its engine and exits 1; ``Restart=always`` starts a fresh one, which waits for rank 0 and joins it.
- the engine exiting (a dead peer ends it: vLLM's executor shuts down) ends the worker with its code.

Config: ``{config_dir}/workers/NAME.json`` (``units/worker.json.j2``): command, environment, master_addr,
master_port, state_dir, grace_seconds, check_interval_seconds.

State: ``{state_dir}/workers/NAME.json`` (``vllm_fleet.contracts.WorkerStateFile``), rewritten atomically on
every change: ``waiting`` → ``joined`` → ``rank0_gone`` or ``exited``; the host exporter reads it.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from vllm_fleet.contracts import DEFAULT_CONFIG_DIR, WorkerStateFile, worker_state_path
from vllm_fleet.files import write_json_atomic
from vllm_fleet.host.netif import with_rank_interface
from vllm_fleet.host.notify import Notifier

TCP_ESTABLISHED = "01"


@dataclass
class WorkerConfig:
    name: str
    rank: int
    command: list[str]
    master_addr: str
    master_port: int
    environment: dict[str, str] = field(default_factory=dict)
    grace_seconds: float = 10.0
    check_interval_seconds: float = 2.0
    served_model_name: str = ""
    nnodes: int = 0  # 0: unknown (a config of an older release)
    state_dir: str = "/run/vllm-fleet"

    @classmethod
    def load(cls, path: Path) -> WorkerConfig:
        d = json.loads(path.read_text())
        missing = [k for k in ("name", "rank", "command", "master_addr", "master_port") if k not in d]
        if missing:
            raise ValueError(f"{path}: missing {', '.join(missing)}")
        return cls(
            name=str(d["name"]),
            rank=int(d["rank"]),
            command=[str(a) for a in d["command"]],
            master_addr=str(d["master_addr"]),
            master_port=int(d["master_port"]),
            environment={str(k): str(v) for k, v in (d.get("environment") or {}).items()},
            grace_seconds=float(d.get("grace_seconds", 10.0)),
            check_interval_seconds=float(d.get("check_interval_seconds", 2.0)),
            served_model_name=str(d.get("served_model_name") or d["name"]),
            nnodes=int(d.get("nnodes", 0)),
            state_dir=str(d.get("state_dir") or "/run/vllm-fleet"),
        )


def _hex_endpoint(text: str) -> tuple[str, int]:
    """``0100007F:1F90`` (IPv4) or the 32-digit IPv6 form of /proc/net/tcp → (address, port)."""
    addr_hex, port_hex = text.split(":")
    raw = bytes.fromhex(addr_hex)
    # the kernel prints each 32-bit word in host (little-endian) order
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(words)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
        ip = ip.ipv4_mapped
    return str(ip), int(port_hex, 16)


def established_to(tables: list[str], addr: str, port: int) -> int:
    """How many established TCP connections in the ``/proc/net/tcp``-format ``tables`` go to addr:port."""
    want = str(ipaddress.ip_address(addr))
    n = 0
    for table in tables:
        for line in table.splitlines()[1:]:
            parts = line.split()
            if len(parts) < 4 or parts[3] != TCP_ESTABLISHED:
                continue
            try:
                remote = _hex_endpoint(parts[2])
            except ValueError:
                continue
            if remote == (want, port):
                n += 1
    return n


def read_tables() -> list[str]:
    out = []
    for p in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            out.append(Path(p).read_text())
    return out


def port_answers(addr: str, port: int, timeout: float = 3.0) -> bool:
    try:
        with socket.create_connection((addr, port), timeout=timeout):
            return True
    except OSError:
        return False


@dataclass
class Watch:
    """The rank-0 rule as a state machine, fed one observation per check (pure: unit-tested)."""

    grace: float
    joined_at: float | None = None
    bad_since: float | None = None

    def observe(self, now: float, connected: bool, answers: bool) -> str:
        """``waiting`` (not joined yet), ``ok``, ``suspect`` (bad, within grace) or ``gone``."""
        if self.joined_at is None:
            if connected:
                self.joined_at = now
                return "ok"
            return "waiting"
        if connected and answers:
            self.bad_since = None
            return "ok"
        if self.bad_since is None:
            self.bad_since = now
        return "gone" if now - self.bad_since >= self.grace else "suspect"


class StateWriter:
    """The worker's state file: ``set`` records a phase and rewrites the file (tmp file + rename) when the
    state changes. Best effort: a state dir that cannot be written is logged once, never fatal."""

    def __init__(self, cfg: WorkerConfig) -> None:
        self.cfg = cfg
        self.path = worker_state_path(cfg.state_dir, cfg.name)
        self.data: WorkerStateFile = {
            "instance": cfg.name,
            "served_model_name": cfg.served_model_name or cfg.name,
            "rank": cfg.rank,
            "nnodes": cfg.nnodes,
            "state": "",
            "since": time.time(),
            "master": f"{cfg.master_addr}:{cfg.master_port}",
            "worker_pid": os.getpid(),
            "engine_pid": None,
            "exit_code": None,
            "reason": None,
            "updated_at": time.time(),
        }
        self._warned = False

    def set(self, state: str, **fields: object) -> None:
        now = time.time()
        if state != self.data.get("state"):
            self.data["since"] = now
        self.data.update(fields)  # type: ignore[typeddict-item]
        self.data["state"] = state
        self.data["updated_at"] = now
        self.write()

    def write(self) -> None:
        try:
            d = self.path.parent
            if not d.is_dir():
                d.mkdir(parents=True, exist_ok=True)
                d.chmod(0o755)  # the unit's UMask=0077; the exporter (another user) lists it
            write_json_atomic(self.path, self.data)
        except OSError as exc:
            if not self._warned:
                self._warned = True
                print(f"worker {self.cfg.name}: cannot write {self.path}: {exc}", file=sys.stderr, flush=True)


def run(cfg: WorkerConfig, notifier: Notifier | None = None) -> int:
    notify = notifier or Notifier()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NOTIFY_SOCKET", "WATCHDOG_"))}
    env.update(cfg.environment)
    env = with_rank_interface(env)  # gloo's interface from the rank's fleet address (host/netif.py)
    proc = subprocess.Popen(cfg.command, env=env, stdin=subprocess.DEVNULL, start_new_session=True)
    master = f"{cfg.master_addr}:{cfg.master_port}"
    state = StateWriter(cfg)
    state.set("waiting", engine_pid=proc.pid)
    stopping = False

    def on_term(_sig: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_term)
        signal.signal(signal.SIGINT, on_term)
    watch = Watch(grace=cfg.grace_seconds)
    notify.status(f"Rank {cfg.rank} of {cfg.name}: waiting for rank 0 at {master}")
    ready = False

    def kill(sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)

    while True:
        rc = proc.poll()
        if rc is not None:
            print(f"worker {cfg.name} rank {cfg.rank}: engine exited ({rc})", file=sys.stderr, flush=True)
            code = 0 if stopping else (128 - rc if rc < 0 else rc) or 1
            state.set("exited", exit_code=code, reason="stopped" if stopping else f"engine exited ({rc})")
            return code
        if stopping:
            notify.send("STOPPING=1")
            kill(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                kill(signal.SIGKILL)
                proc.wait()
            state.set("exited", exit_code=0, reason="stopped")
            return 0
        connected = established_to(read_tables(), cfg.master_addr, cfg.master_port) > 0
        answers = port_answers(cfg.master_addr, cfg.master_port) if watch.joined_at is not None else False
        seen = watch.observe(time.monotonic(), connected, answers)
        if seen == "ok" and not ready:
            ready = True
            state.set("joined")
            notify.send("READY=1", f"STATUS=Rank {cfg.rank} of {cfg.name}: joined rank 0 at {master}")
        elif seen == "suspect":
            notify.status(f"Rank {cfg.rank} of {cfg.name}: rank 0 at {master} not reachable")
        elif seen == "gone":
            why = "connection closed" if not connected else "master port does not answer"
            state.set("rank0_gone", reason=f"rank 0 at {master} gone ({why})")
            print(
                f"worker {cfg.name} rank {cfg.rank}: rank 0 at {master} gone ({why}) for {cfg.grace_seconds:.0f}s: "
                "ending the engine (the unit restarts it to join again)",
                file=sys.stderr,
                flush=True,
            )
            notify.status(f"Failed: rank 0 at {master} gone ({why})")
            kill(signal.SIGKILL)
            proc.wait()
            state.set("rank0_gone", exit_code=1)
            return 1
        time.sleep(cfg.check_interval_seconds)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vllm_fleet.host.worker", description=__doc__.splitlines()[0])
    p.add_argument("name")
    p.add_argument("--config-dir", default=DEFAULT_CONFIG_DIR)
    a = p.parse_args(argv)
    path = Path(a.config_dir) / "workers" / f"{a.name}.json"
    try:
        cfg = WorkerConfig.load(path)
    except (OSError, ValueError) as e:
        print(f"worker {a.name}: {e}", file=sys.stderr)
        return 78
    return run(cfg)


if __name__ == "__main__":
    sys.exit(main())
