#!/usr/bin/env python3
"""Gateway cost per request of per-key limits (gateway.limits) vs before, in ONE run, against the same upstream.

Two real nginx gateways rendered from the same spec (API keys, auth on) but for ``gateway.limits``, in front of
the same instant stub engine (a tiny HTTP server answering a fixed JSON body at once, so what differs is the
gateway's own work):

* ``before``: ``limits: {enabled: false}``, the old per-key leaky bucket (``limit_req``) set so high that
  nothing is refused;
* ``limits``: limits on (the default) with the admission service running: nginx's ``auth_request`` over a
  kept-alive unix socket before each request and the log-phase datagram that releases it; a budget that never
  refuses (``default_key: {max_in_flight: 0}``: unlimited; the stub has no queue bound, so no capacity).

With ``--baseline no-filter`` the ``before`` side is limits on too, but with the usage filter taken out of its
rendered config (no ``js_body_filter vf.tally``, a release line without ``$vf_usage``): what the filter that
settles tokens from the answer adds on its own.

Both keep the per-IP bucket, set out of the way. Sequential chat requests with a realistic body (a system
prompt of --system-chars characters and a short question), one persistent connection per gateway, in pairs
whose order alternates (A B, B A, …) so that load swings hit both sides alike. The stub's answer carries
vLLM's ``usage``; with ``--stream-events N`` the requests stream and the answer is N events (each its own HTTP
chunk, as vLLM sends them), then the usage event and ``[DONE]``. Per round: p50 and p99 of each side and of
the paired differences (limits − before); over the rounds: median and spread. At the end the admission
service's own counters must show every request of the ``limits`` side admitted (else the figure measured
nothing). Light: no engines.

    .venv/bin/python tools/limits_overhead.py --rounds 5 --pairs 400 --json /tmp/limits-overhead.json
    .venv/bin/python tools/limits_overhead.py --baseline no-filter --stream-events 200 --rounds 3 --pairs 100
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vllm_fleet.devtools.gateway_testing import Gateway, gateway_spec

KEY = "sk-bench-" + "b" * 32
RATE = {"per_key_rps": 100000, "per_key_burst": 100000, "per_ip_rps": 100000, "per_ip_burst": 100000}
SIDES = {
    "before": {"enabled": False},
    "limits": {"default_key": {"max_in_flight": 0}},
}
WARMUP = 200
USAGE = {"prompt_tokens": 1000, "total_tokens": 1002, "completion_tokens": 2}
ANSWER = json.dumps({"id": "x", "object": "chat.completion", "choices": [{"index": 0, "message": {
    "role": "assistant", "content": "ok"}, "finish_reason": "stop"}], "usage": USAGE},
    separators=(",", ":")).encode()  # fmt: skip
EVENT = (
    b'data: {"id":"chatcmpl-x","object":"chat.completion.chunk","created":0,"model":"tiny-qwen3","choices":'
    b'[{"index":0,"delta":{"content":" token"},"logprobs":null,"finish_reason":null}]}\n\n'
)
LAST = b'data: {"id":"chatcmpl-x","choices":[],"usage":%s}\n\ndata: [DONE]\n\n' % json.dumps(USAGE).encode()
STREAM_EVENTS = [0]  # --stream-events


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # headers and body in one write: two small writes meet Nagle + delayed ACK (40 ms per request)
    wbufsize = 1 << 16

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(200)
        if not STREAM_EVENTS[0]:
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(ANSWER)))
            self.end_headers()
            self.wfile.write(ANSWER)
            return
        # one HTTP chunk per event (nginx hands each to its filters as a buffer), written at once
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.wfile.write(b"".join([chunk(EVENT)] * STREAM_EVENTS[0]) + chunk(LAST) + b"0\r\n\r\n")

    def log_message(self, *a: Any) -> None:
        pass


def without_usage_filter(g: Gateway) -> None:
    """Take the usage filter out of a rendered gateway (before it starts): no body filter, no $vf_usage."""
    conf = g.nginx.etc_nginx / "conf.d" / "vllm-fleet.conf"
    text = conf.read_text()
    out = re.sub(r"^\s*js_body_filter vf\.tally;\n", "", text, flags=re.M).replace("|$vf_usage'", "|-'")
    assert "js_body_filter" not in out and "|$vf_usage'" not in out and out != text
    conf.write_text(out)


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(p / 100 * (len(s) - 1)))]


def spread(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def counter(metrics_url: str, name: str = "key_admitted_total", label: str = "") -> float:
    """A counter of the admission service, all keys together (``label``: only samples with it, e.g.
    ``kind="settled"``)."""
    with urllib.request.urlopen(metrics_url, timeout=5) as r:
        text = r.read().decode()
    return sum(
        float(ln.rsplit(" ", 1)[1])
        for ln in text.splitlines()
        if not ln.startswith("#") and ln.split("{", 1)[0].endswith(name) and label in ln
    )


def admitted(metrics_url: str) -> float:
    """Requests the admission service admitted, all keys together (its Prometheus counter)."""
    return counter(metrics_url)


def settled(metrics_url: str, n: int) -> float:
    """Tokens settled, all keys together, once the last of ``n`` requests' release has arrived."""
    deadline = time.monotonic() + 5
    while True:
        got = counter(metrics_url, "key_tokens_total", 'kind="settled"')
        if got >= n * USAGE["total_tokens"] or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--pairs", type=int, default=400)
    ap.add_argument("--system-chars", type=int, default=4000)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--baseline", choices=("limits-off", "no-filter"), default="limits-off",
                    help="the `before` side: limits off (default), or limits on without the usage filter")  # fmt: skip
    ap.add_argument("--stream-events", type=int, default=0, help="stream answers of N events (0: one JSON)")
    a = ap.parse_args()
    STREAM_EVENTS[0] = a.stream_events
    sides = dict(SIDES)
    if a.baseline == "no-filter":
        sides["before"] = sides["limits"]
    stub = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=stub.serve_forever, daemon=True).start()
    work = Path(tempfile.mkdtemp(prefix="vf-limits-overhead-"))
    servers = [{"name": "s0", "port": stub.server_address[1]}]
    gws: dict[str, Gateway] = {}
    try:
        for label, limits in sides.items():
            wd = work / label
            wd.mkdir()
            keys = wd / "keys"
            keys.write_text(f'"{KEY}" bench;\n')
            spec = gateway_spec(servers, wd, api_keys_file=str(keys), rate_limit=RATE, limits=limits)
            g = Gateway(spec, wd, admission=True)
            if label == "before" and a.baseline == "no-filter":
                without_usage_filter(g)
            gws[label] = g.start()
        assert gws["limits"].admission is not None
        assert (gws["before"].admission is None) == (a.baseline == "limits-off")
    except BaseException:
        for g in gws.values():
            g.stop()
        stub.shutdown()
        raise
    system = ("You are a careful assistant for the support desk of an example company. " * 100)[
        : a.system_chars
    ]
    conns = {k: http.client.HTTPConnection("127.0.0.1", g.spec.gateway.port) for k, g in gws.items()}
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}

    def one(label: str, i: int) -> float:
        body = json.dumps({"model": "tiny-qwen3", "max_tokens": 8, "stream": bool(a.stream_events), "messages": [
            {"role": "system", "content": system + str(i % 50)},
            {"role": "user", "content": f"question {i}"}]})  # fmt: skip
        c = conns[label]
        t = time.perf_counter()
        c.request("POST", "/v1/chat/completions", body, headers)
        r = c.getresponse()
        data = r.read()
        dt = time.perf_counter() - t
        assert r.status == 200, (label, r.status, data[:300])
        return dt * 1000

    rounds = []
    try:
        for i in range(WARMUP):  # warm-up: connections, njs, upstream and admission keep-alive
            one("before", i)
            one("limits", i)
        for _ in range(a.rounds):
            lat: dict[str, list[float]] = {"before": [], "limits": []}
            diffs = []
            for i in range(a.pairs):
                order = ("before", "limits") if i % 2 == 0 else ("limits", "before")
                got = {lab: one(lab, i) for lab in order}
                for lab, v in got.items():
                    lat[lab].append(v)
                diffs.append(got["limits"] - got["before"])
            rounds.append({
                "before_p50_ms": pct(lat["before"], 50), "before_p99_ms": pct(lat["before"], 99),
                "limits_p50_ms": pct(lat["limits"], 50), "limits_p99_ms": pct(lat["limits"], 99),
                "added_p50_ms": pct(lat["limits"], 50) - pct(lat["before"], 50),
                "added_p99_ms": pct(lat["limits"], 99) - pct(lat["before"], 99),
                "paired_diff_p50_ms": pct(diffs, 50),
                "paired_diff_p99_ms": pct(diffs, 99),
            })  # fmt: skip
        n_admitted = admitted(gws["limits"].admission_metrics_url)
        n_settled = settled(gws["limits"].admission_metrics_url, WARMUP + a.rounds * a.pairs)
    finally:
        for c in conns.values():
            c.close()
        for g in gws.values():
            g.stop()
        stub.shutdown()
        shutil.rmtree(work, ignore_errors=True)
    sent = WARMUP + a.rounds * a.pairs
    out = {
        "baseline": a.baseline,
        "stream_events": a.stream_events,
        "rounds": rounds,
        "pairs_per_round": a.pairs,
        "system_chars": a.system_chars,
        "limits_side_admitted": n_admitted,
        "limits_side_sent": sent,
        "limits_side_settled_tokens": n_settled,
        "loadavg_end": os.getloadavg(),
        "over_rounds": {k: spread([r[k] for r in rounds]) for k in rounds[0]},
    }
    for k, s in out["over_rounds"].items():
        print(f"{k:<22} median {s['median']:7.3f}  min {s['min']:7.3f}  max {s['max']:7.3f}")
    print(f"admitted by the admission service: {n_admitted:.0f} of {sent} requests of the limits side")
    print(f"tokens settled: {n_settled:.0f} (the answers' usage: {sent * USAGE['total_tokens']})")
    print(f"load average at the end: {out['loadavg_end']}")
    if a.json:
        a.json.write_text(json.dumps(out, indent=2) + "\n")
    if n_admitted < sent:
        print("the limits side did not go through the admission service for every request", file=sys.stderr)
        return 1
    if n_settled != sent * USAGE["total_tokens"]:
        print("the limits side did not settle every answer's usage (the usage filter)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
