#!/usr/bin/env python3
"""Router overhead of routing.policy cache_aware vs least_conn, in ONE run, against the same upstreams.

Two real nginx gateways rendered from the same spec but for the policy, in front of the same two stub
engines (a tiny HTTP server answering a fixed JSON body at once, so what differs is the gateway's work:
the router's canonical prompt + SHA-1 prefix key and nginx's consistent hash with max_conns, vs least_conn).
Sequential non-streaming chat requests with a realistic body (a system prompt of --system-chars characters
and a short question), one persistent connection per gateway, in pairs whose order alternates (A B, B A, …)
so that load swings hit both sides alike. Per round: p50 and p99 of each side and of the paired differences
(B − A); over the rounds: median and spread. Light: no engines.

    .venv/bin/python tools/route_overhead.py --rounds 5 --pairs 400 --json /tmp/route-overhead.json
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vllm_fleet.devtools.gateway_testing import Gateway, gateway_spec

RATE = {"per_key_rps": 100000, "per_key_burst": 100000, "per_ip_rps": 100000, "per_ip_burst": 100000}
ANSWER = json.dumps({"id": "x", "object": "chat.completion", "choices": [{"index": 0, "message": {
    "role": "assistant", "content": "ok"}, "finish_reason": "stop"}]}).encode()  # fmt: skip


class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # headers and body in one write: two small writes meet Nagle + delayed ACK (40 ms per request)
    wbufsize = 1 << 16

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(ANSWER)))
        self.end_headers()
        self.wfile.write(ANSWER)

    def log_message(self, *a: Any) -> None:
        pass


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(p / 100 * (len(s) - 1)))]


def spread(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--pairs", type=int, default=400)
    ap.add_argument("--system-chars", type=int, default=4000)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    stubs = [ThreadingHTTPServer(("127.0.0.1", 0), H) for _ in range(2)]
    for s in stubs:
        threading.Thread(target=s.serve_forever, daemon=True).start()
    work = Path(tempfile.mkdtemp(prefix="vf-route-overhead-"))
    servers = [{"name": f"s{i}", "port": s.server_address[1]} for i, s in enumerate(stubs)]
    ca = {"policy": "cache_aware", "max_conns": 64}
    gws = {}
    for label, routing in (("least_conn", None), ("cache_aware", ca)):
        wd = work / label
        wd.mkdir()
        srv = [dict(s, routing=routing) if routing else s for s in servers]
        gws[label] = Gateway(gateway_spec(srv, wd, rate_limit=RATE), wd).start()
    system = ("You are a careful assistant for the support desk of an example company. " * 100)[
        : a.system_chars
    ]
    conns = {k: http.client.HTTPConnection("127.0.0.1", int(g.url.rsplit(":", 1)[1])) for k, g in gws.items()}

    def one(label: str, i: int) -> float:
        body = json.dumps({"model": "tiny-qwen3", "max_tokens": 8, "messages": [
            {"role": "system", "content": system + str(i % 50)},
            {"role": "user", "content": f"question {i}"}]})  # fmt: skip
        c = conns[label]
        t = time.perf_counter()
        c.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        r = c.getresponse()
        r.read()
        dt = time.perf_counter() - t
        assert r.status == 200, r.status
        return dt * 1000

    rounds = []
    try:
        for i in range(200):  # warm-up: connections, njs, upstream keepalive
            one("least_conn", i)
            one("cache_aware", i)
        for _ in range(a.rounds):
            lat: dict[str, list[float]] = {"least_conn": [], "cache_aware": []}
            diffs = []
            for i in range(a.pairs):
                order = ("least_conn", "cache_aware") if i % 2 == 0 else ("cache_aware", "least_conn")
                got = {lab: one(lab, i) for lab in order}
                for lab, v in got.items():
                    lat[lab].append(v)
                diffs.append(got["cache_aware"] - got["least_conn"])
            rounds.append({
                "least_conn_p50_ms": pct(lat["least_conn"], 50), "least_conn_p99_ms": pct(lat["least_conn"], 99),
                "cache_aware_p50_ms": pct(lat["cache_aware"], 50),
                "cache_aware_p99_ms": pct(lat["cache_aware"], 99),
                "added_p50_ms": pct(lat["cache_aware"], 50) - pct(lat["least_conn"], 50),
                "added_p99_ms": pct(lat["cache_aware"], 99) - pct(lat["least_conn"], 99),
                "paired_diff_p50_ms": pct(diffs, 50),
            })  # fmt: skip
    finally:
        for g in gws.values():
            g.stop()
        for s in stubs:
            s.shutdown()
    out = {
        "rounds": rounds,
        "pairs_per_round": a.pairs,
        "system_chars": a.system_chars,
        "loadavg_end": os.getloadavg(),
        "over_rounds": {k: spread([r[k] for r in rounds]) for k in rounds[0]},
    }
    for k, s in out["over_rounds"].items():
        print(f"{k:<22} median {s['median']:7.3f}  min {s['min']:7.3f}  max {s['max']:7.3f}")
    print(f"load average at the end: {out['loadavg_end']}")
    if a.json:
        a.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
