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

``--concurrent N``: the gateway at scale instead (docs/perf/gateway-limits.md, "Admission at 2,000 waiting
requests"). Each of ``--rounds`` rounds opens N new connections at once, as nginx does for N auth_request
subrequests in flight (its pool keeps only idle ones), non-blocking like nginx's connect(): EAGAIN = the listen
backlog was full, a request nginx admits unlimited (``on_failure: open``). Each sends one ``/admit``; the route
holds ``--capacity`` in flight (0: unlimited), the rest wait for a release. Each admitted request is released
``--hold`` seconds after its answer by a datagram from one of ``--senders`` non-blocking datagram sockets (nginx's
workers' syslog sockets): EAGAIN = a lost release, a slot held until its lease expires. The service runs with
the open-file limit systemd gives a unit (``--nofile``, soft 1024). Prints what went wrong and what the service
still holds afterwards (its /metrics: ``route_in_flight``, ``leases_expired``)::

    PYTHONPATH=$PWD .venv/bin/python tools/admission_bench.py --concurrent 2000 --rounds 3 --capacity 64
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import random
import resource
import selectors
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BUDGET = {"max_in_flight": 64, "requests_per_minute": 0, "tokens_per_minute": 10_000_000, "weight": 1}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _config(folder: str, a: argparse.Namespace) -> dict[str, Any]:
    return {
        "schema": 1,
        "fleet": "bench",
        "socket": f"{folder}/admission.sock",
        "log_socket": f"{folder}/admission-log.sock",
        "metrics_address": f"127.0.0.1:{_free_port()}",
        "queue_wait_seconds": float(a.queue_wait),
        "max_queued_per_key": 256,
        "max_queued": 4096,
        "lease_seconds": 630,
        "default_key": BUDGET,
        "keys": {},
        "default_client": {**BUDGET, "max_in_flight": 0},
        "clients": {},
        "per_key": {},
        "capacity": {"m": a.capacity} if a.capacity else {},
        "socket_group": "",
    }


def _start(folder: str, cfg: dict[str, Any], nofile: int) -> subprocess.Popen[bytes] | None:
    """The service on ``cfg`` (written into ``folder``), its soft open-file limit ``nofile`` (0: inherited);
    None when it did not come up."""
    (Path(folder) / "admission.json").write_text(json.dumps(cfg))
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def limit() -> None:
        if nofile:
            hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, hard))

    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm_fleet.cli", "admission", "--config", f"{folder}/admission.json"],
        env=env,
        stderr=(Path(folder) / "service.log").open("wb"),
        preexec_fn=limit,
    )
    deadline = time.monotonic() + 30
    while not Path(cfg["socket"]).is_socket() or not Path(cfg["log_socket"]).is_socket():
        if time.monotonic() > deadline or proc.poll() is not None:
            print("the service did not start", file=sys.stderr)
            return None
        time.sleep(0.05)
    time.sleep(0.2)  # the metrics server comes up after the sockets
    return proc


def _request(key: str, rid: str) -> bytes:
    return (
        f"GET /admit HTTP/1.1\r\nHost: vf_admission\r\nX-VF-Key: {key}\r\nX-VF-Client: {key.split('/')[0]}\r\n"
        f"X-VF-Model: m\r\nX-VF-Cost: 300\r\nX-Request-Id: {rid}\r\n\r\n"
    ).encode()


def _release(rid: str) -> bytes:
    """The line nginx's ``access_log syslog:`` sends at a request's end (nginx/vllm-fleet.conf.j2 vf_admit)."""
    return f"<190>Dec  3 20:01:02 vfadmit: {rid}|200|200|-".encode()


def sequential(a: argparse.Namespace, cfg: dict[str, Any]) -> int:
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
        req = _request(key, rid)
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


def scrape(address: str) -> dict[str, float]:
    """The service's unlabelled and summed series (name → value) from its /metrics."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        base = name.split("{", 1)[0]
        out[base] = out.get(base, 0.0) + float(value)
    return out


def concurrent_round(
    a: argparse.Namespace, cfg: dict[str, Any], rnd: int, senders: list[socket.socket]
) -> Counter[str]:
    """One round of ``--concurrent`` requests on new connections at once (see the module's docstring)."""
    n = Counter[str]()
    rng = random.Random(rnd)
    sel = selectors.DefaultSelector()
    bufs: dict[socket.socket, tuple[str, bytearray]] = {}
    for i in range(a.concurrent):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setblocking(False)
        try:
            s.connect(cfg["socket"])
        except (
            BlockingIOError
        ):  # nginx: "connect() to unix:... failed (11: Resource temporarily unavailable)"
            n["connect_eagain"] += 1
            s.close()
            continue
        except OSError:
            n["connect_error"] += 1
            s.close()
            continue
        rid = f"c{rnd}-{i}"
        try:
            s.send(_request(f"bench{i % 3}/{i % a.keys:08x}", rid))
        except OSError:
            n["send_error"] += 1
            s.close()
            continue
        sel.register(s, selectors.EVENT_READ)
        bufs[s] = (rid, bytearray())
    n["connected"] = len(bufs)
    due: list[tuple[float, str]] = []  # (when, request id) of the releases still to send
    sent = 0
    deadline = time.monotonic() + a.queue_wait + 15
    while (bufs or due) and time.monotonic() < deadline:
        timeout = max(0.0, min(0.05, due[0][0] - time.monotonic())) if due else 0.05
        for key, _ in sel.select(timeout):
            fo = key.fileobj
            assert isinstance(fo, socket.socket)
            s = fo
            rid, buf = bufs[s]
            try:
                data = s.recv(4096)
            except OSError:
                data = b""
            buf += data
            if data and b"\r\n\r\n" not in buf:
                continue
            sel.unregister(s)
            s.close()
            del bufs[s]
            if buf.startswith(b"HTTP/1.1 204"):
                n["admitted"] += 1
                heapq.heappush(due, (time.monotonic() + a.hold + rng.uniform(0, a.spread), rid))
            elif buf.startswith(b"HTTP/1.1 403"):
                n["refused"] += 1
            else:
                n["closed_without_answer"] += 1
        now = time.monotonic()
        while due and due[0][0] <= now:
            _, rid = heapq.heappop(due)
            try:
                senders[sent % len(senders)].sendto(_release(rid), cfg["log_socket"])
                n["released"] += 1
            except BlockingIOError:  # nginx: "send() to syslog failed" — the release is lost
                n["release_eagain"] += 1
            sent += 1
    n["unanswered"] = len(bufs)
    for s in bufs:
        s.close()
    sel.close()
    return n


def concurrent(a: argparse.Namespace, cfg: dict[str, Any]) -> int:
    senders = []
    for _ in range(a.senders):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        s.setblocking(False)
        senders.append(s)
    total = Counter[str]()
    rounds = []
    for rnd in range(a.rounds):
        t0 = time.monotonic()
        got = concurrent_round(a, cfg, rnd, senders)
        got["seconds_x1000"] = round((time.monotonic() - t0) * 1000)
        rounds.append(dict(got))
        total.update(got)
        print(f"round {rnd + 1}: {dict(got)}", flush=True)
        time.sleep(0.5)
    time.sleep(1.0)  # the last releases reach the service
    m = scrape(cfg["metrics_address"])
    figures = {
        "concurrent": a.concurrent,
        "rounds": a.rounds,
        "capacity": a.capacity,
        "senders": a.senders,
        "hold_seconds": a.hold,
        "spread_seconds": a.spread,
        "nofile": a.nofile,
        "requests": a.concurrent * a.rounds,
        "connect_eagain": total["connect_eagain"],
        "connect_error": total["connect_error"],
        "admitted": total["admitted"],
        "refused": total["refused"],
        "closed_without_answer": total["closed_without_answer"],
        "unanswered": total["unanswered"],
        "release_eagain": total["release_eagain"],
        "held_after": int(m.get("vllm_fleet_gateway_route_in_flight", -1)),
        "leases_expired": int(m.get("vllm_fleet_gateway_admission_leases_expired_total", -1)),
        "per_round": rounds,
    }
    print(
        f"{a.rounds} rounds of {a.concurrent} admits on new connections at once (capacity "
        f"{a.capacity or 'unlimited'}, {a.senders} release senders, hold {a.hold:g} s + up to {a.spread:g} s, "
        f"service nofile {a.nofile or 'inherited'}): connect EAGAIN (fail open) {figures['connect_eagain']}, other connect "
        f"errors {figures['connect_error']}, admitted {figures['admitted']}, refused {figures['refused']}, closed "
        f"without an answer {figures['closed_without_answer']}, unanswered {figures['unanswered']}; releases "
        f"lost (EAGAIN) {figures['release_eagain']}; the service still holds {figures['held_after']} "
        f"(leases that expire later)"
    )
    if a.json:
        print(json.dumps(figures))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=5000)
    ap.add_argument("--keys", type=int, default=16)
    ap.add_argument("--connections", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=500)
    ap.add_argument(
        "--concurrent", type=int, default=0, metavar="N", help="N admits on new connections at once"
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--capacity", type=int, default=0, help="the route's capacity (0: unlimited)")
    ap.add_argument("--senders", type=int, default=4, help="release datagram sockets (nginx's workers)")
    ap.add_argument("--hold", type=float, default=0.0, help="seconds from an admission to its release")
    ap.add_argument("--spread", type=float, default=0.0, help="plus up to this many seconds (uniform)")
    ap.add_argument("--queue-wait", type=float, default=30.0, help="queue_wait_seconds")
    ap.add_argument(
        "--nofile", type=int, default=1024, help="the service's soft open-file limit (0: inherited)"
    )
    ap.add_argument("--json", action="store_true", help="print the figures as JSON too")
    a = ap.parse_args()
    if a.concurrent:
        resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)

    folder = tempfile.mkdtemp(prefix="vfadmbench", dir="/tmp")
    cfg = _config(folder, a)
    proc = _start(folder, cfg, a.nofile if a.concurrent else 0)
    try:
        if proc is None:
            return 1
        return concurrent(a, cfg) if a.concurrent else sequential(a, cfg)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(10)
        if a.concurrent:
            log = (Path(folder) / "service.log").read_text(errors="replace").strip().splitlines()
            if log:
                print("service log (last lines):\n  " + "\n  ".join(log[-5:]), file=sys.stderr)
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
