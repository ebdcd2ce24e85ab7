#!/usr/bin/env python3
"""The admission service's round trip as nginx's auth_request sees it (issue 31; docs/design/per-key-limits.md).

Starts `vllm-fleet admission` in a subprocess on sockets in a temporary folder (budgets that admit every
request at once: the hot path, no waiting), opens --connections kept-alive unix-socket connections (nginx's
upstream pool) and sends --requests `GET /admit` in turn over them, --keys keys round-robin, one at a time:
each request's time from the first byte sent to the whole answer read. After each answer the request is
released with the datagram nginx's log phase sends (not timed), so the keys' in-flight counts stay small.
Prints p50 / p90 / p99 / max in microseconds and the rate.

    PYTHONPATH=$PWD .venv/bin/python tools/admission_bench.py --requests 5000 --keys 16 --connections 8

The client runs in this process: on a small shared machine both sides compete for the CPU, so the figure is
an upper bound of the service's own cost.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUDGET = {"max_in_flight": 64, "requests_per_minute": 0, "tokens_per_minute": 10_000_000, "weight": 1}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=5000)
    ap.add_argument("--keys", type=int, default=16)
    ap.add_argument("--connections", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=500)
    ap.add_argument("--json", action="store_true", help="print the figures as JSON too")
    a = ap.parse_args()

    folder = tempfile.mkdtemp(prefix="vfadmbench", dir="/tmp")
    cfg = {
        "schema": 1,
        "fleet": "bench",
        "socket": f"{folder}/admission.sock",
        "log_socket": f"{folder}/admission-log.sock",
        "metrics_address": "127.0.0.1:0",
        "queue_wait_seconds": 5.0,
        "max_queued_per_key": 256,
        "max_queued": 4096,
        "lease_seconds": 630,
        "default_key": BUDGET,
        "keys": {},
        "default_client": {**BUDGET, "max_in_flight": 0},
        "clients": {},
        "per_key": {},
        "capacity": {"m": 1000},
        "socket_group": "",
    }
    (Path(folder) / "admission.json").write_text(json.dumps(cfg))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm_fleet.cli", "admission", "--config", f"{folder}/admission.json"],
        env=env,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while not Path(cfg["socket"]).is_socket():
            if time.monotonic() > deadline or proc.poll() is not None:
                print("the service did not start", file=sys.stderr)
                return 1
            time.sleep(0.05)
        conns = []
        for _ in range(a.connections):
            c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            c.connect(cfg["socket"])
            conns.append(c)
        log = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        times = []
        start = time.perf_counter()
        for i in range(a.warmup + a.requests):
            if i == a.warmup:
                start = time.perf_counter()
            c = conns[i % len(conns)]
            key = f"bench{i % 3}/{i % a.keys:08x}"
            rid = f"r{i:x}"
            req = (
                f"GET /admit HTTP/1.1\r\nHost: vf_admission\r\nX-VF-Key: {key}\r\nX-VF-Client: bench{i % 3}\r\n"
                f"X-VF-Model: m\r\nX-VF-Cost: 300\r\nX-Request-Id: {rid}\r\n\r\n"
            ).encode()
            t0 = time.perf_counter()
            c.sendall(req)
            data = b""
            while not data.endswith(b"\r\n\r\n"):
                data += c.recv(4096)
            t1 = time.perf_counter()
            if not data.startswith(b"HTTP/1.1 204"):
                print(f"not admitted: {data!r}", file=sys.stderr)
                return 1
            if i >= a.warmup:
                times.append(t1 - t0)
            log.sendto(f"<190>Dec  3 20:01:02 vfadmit: {rid}|200|200|250".encode(), cfg["log_socket"])
        wall = time.perf_counter() - start
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(folder, ignore_errors=True)
    us = sorted(t * 1e6 for t in times)
    q = statistics.quantiles(us, n=100)
    figures = {
        "requests": len(us),
        "keys": a.keys,
        "connections": a.connections,
        "p50_us": round(q[49], 1),
        "p90_us": round(q[89], 1),
        "p99_us": round(q[98], 1),
        "max_us": round(us[-1], 1),
        "requests_per_second": round(len(us) / wall),
    }
    print(
        f"admit round trip over {figures['requests']} requests ({a.keys} keys, {a.connections} kept-alive "
        f"connections, one at a time): p50 {figures['p50_us']} µs, p90 {figures['p90_us']} µs, "
        f"p99 {figures['p99_us']} µs, max {figures['max_us']} µs; {figures['requests_per_second']} requests/s "
        "(with a release datagram after each)"
    )
    if a.json:
        print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
