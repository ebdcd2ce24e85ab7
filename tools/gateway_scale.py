#!/usr/bin/env python3
"""Gateway config size and nginx timings for a large fleet (docs/perf/gateway-scale.md).

Generates a spec of HOSTS hosts with one instance of each of two served models per host (HOSTS × 2
instances), renders the gateway host's artifacts, and reports the size of every gateway file, ``nginx -t``
time, start and graceful-reload time of a private nginx (prefix under a temp folder, like the gateway tests).
With ``--load S`` it also measures the router's per-request cost: every instance address is a loopback
address (127.0.X.Y) served by a second private nginx that answers a fixed JSON 200 (the stub upstream), and
``wrk`` (1 thread, 8 connections, S seconds) posts chat completions through the gateway (one worker), then
GET /health (no njs) as the floor.

    PYTHONPATH=. .venv/bin/python tools/gateway_scale.py --hosts 500 --load 5
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from vllm_fleet.devtools.gateway_nginx import JS_MODULE, NGINX, NginxGateway
from vllm_fleet.devtools.testing import free_port
from vllm_fleet.fleet.render import render_host
from vllm_fleet.fleet.spec import parse_spec

STUB_CONF = """\
worker_processes 1;
pid {prefix}/stub.pid;
error_log {prefix}/stub-error.log warn;
daemon off;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {prefix}/tmp/body;
    server {{
        listen 0.0.0.0:{port_a};
        listen 0.0.0.0:{port_b};
        location / {{
            default_type application/json;
            return 200 '{{"id":"x","object":"chat.completion","choices":[]}}\\n';
        }}
    }}
}}
"""

WRK_LUA = """\
wrk.method = "POST"
wrk.body = '{"model":"tiny-a","messages":[{"role":"user","content":"hi"}],"max_tokens":8}'
wrk.headers["Content-Type"] = "application/json"
"""


def spec_data(hosts: int, work: Path, port_a: int, port_b: int) -> dict[str, Any]:
    hs, models = [], []
    for i in range(hosts):
        name = f"h{i:04d}"
        hs.append({"name": name, "address": f"127.0.{1 + i // 250}.{1 + i % 250}", "memory_gib": 16})
        for served, port in (("tiny-a", port_a), ("tiny-b", port_b)):
            models.append(
                {
                    "name": f"{served}-{i:04d}",
                    "served_model_name": served,
                    "source": {"path": "/var/lib/vllm-fleet/models/tiny"},
                    "host": name,
                    "port": port,
                    "max_model_len": 1024,
                    "kv_cache_memory_bytes": 67108864,
                }
            )
    gw = {
        "host": "h0000",
        "listen_address": "127.0.0.1",
        "port": free_port(),
        "stub_status_port": free_port(),
        "access_log": str(work / "access.log"),
        "error_log": str(work / "gateway-error.log"),
        "state_file": str(work / "drained.json"),
        "auth": "none",  # a scale test of routing, not of keys
        "rate_limit": {
            "per_key_rps": 1e6,
            "per_key_burst": 1000000,
            "per_ip_rps": 1e6,
            "per_ip_burst": 1000000,
        },
    }
    return {
        "name": "scale",
        "stack": {"profile": "cpu"},
        "hosts": hs,
        "models": models,
        "gateway": gw,
        "monitoring": {"host": "h0000", "enabled": False},
    }


def timed(argv: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(argv, check=True, capture_output=True, timeout=300)
    return time.perf_counter() - t0


def workers(master: int) -> set[int]:
    out = set()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text().rsplit(")", 1)[1].split()
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        except OSError:
            continue
        if int(stat[1]) == master and cmd == "nginx: worker process":
            out.add(int(d.name))
    return out


def rss_kib(pid: int) -> int:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    return sum(int(line.split()[1]) for line in text.splitlines() if line.startswith("VmRSS:"))


def reload_time(gw: NginxGateway, master: int) -> float:
    """Seconds from ``nginx -s reload`` until a new worker process accepts (the old ones then stop)."""
    before = workers(master)
    t0 = time.perf_counter()
    subprocess.run(gw.argv("-s", "reload"), check=True, capture_output=True, timeout=60)
    while True:
        now = workers(master)
        if now and not now <= before:
            return time.perf_counter() - t0
        if time.perf_counter() - t0 > 120:
            raise RuntimeError("no new worker after 120 s")
        time.sleep(0.005)


def wrk(url: str, seconds: int, lua: Path | None) -> dict[str, Any]:
    argv = ["wrk", "-t1", "-c8", f"-d{seconds}s", "--latency"] + (["-s", str(lua)] if lua else []) + [url]
    out = subprocess.run(argv, check=True, capture_output=True, text=True, timeout=seconds + 60).stdout
    res: dict[str, Any] = {}
    for line in out.splitlines():
        parts = line.split()
        if line.startswith("Requests/sec:"):
            res["rps"] = float(parts[1])
        elif parts and parts[0] in ("50%", "99%"):
            res["p" + parts[0].rstrip("%")] = parts[1]
        elif "Non-2xx" in line:
            res["non_2xx"] = int(parts[-1])
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=500)
    ap.add_argument("--load", type=int, default=0, metavar="S", help="wrk seconds per run (0: no load)")
    ap.add_argument("--reloads", type=int, default=3, help="graceful reloads to time (median)")
    ap.add_argument("--json", help="write the figures here")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="vf-gw-scale-"))
    port_a, port_b = free_port(), free_port()
    spec = parse_spec(spec_data(a.hosts, work, port_a, port_b), "gateway-scale")
    t0 = time.perf_counter()
    files = render_host(spec, "h0000")
    res: dict[str, Any] = {"hosts": a.hosts, "instances": 2 * a.hosts, "render_s": time.perf_counter() - t0}
    etc = work / "out"
    for r in files:
        if r.component != "gateway":
            continue
        p = etc / r.dest.lstrip("/")
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(r.content)
        res.setdefault("files", {})[r.dest] = {
            "bytes": len(r.content.encode()),
            "lines": r.content.count("\n"),
        }
    ups = next(r.content for r in files if r.dest.endswith("upstreams.conf"))
    res["upstreams"] = len(re.findall(r"(?m)^upstream ", ups))
    res["server_directives"] = len(re.findall(r"(?m)(?:^\s+|\{ )server \S", ups))
    gw = NginxGateway(etc / "etc" / "nginx", work / "prefix", workers=1)
    res["nginx_t_s"] = statistics.median(timed(gw.argv("-t", "-q")) for _ in range(max(1, a.reloads)))
    url = f"http://127.0.0.1:{spec.gateway.port}"
    t0 = time.perf_counter()
    gw.start(url + "/health", timeout=120)
    res["start_s"] = time.perf_counter() - t0
    stub = None
    try:
        assert gw.proc is not None
        res["reload_s"] = statistics.median(reload_time(gw, gw.proc.pid) for _ in range(a.reloads))
        time.sleep(1)  # the old workers exit
        res["rss_kib_worker"] = sum(rss_kib(w) for w in workers(gw.proc.pid))
        if a.load:
            (work / "stub" / "tmp").mkdir(parents=True)
            conf = work / "stub" / "stub.conf"
            conf.write_text(STUB_CONF.format(prefix=work / "stub", port_a=port_a, port_b=port_b))
            stub = subprocess.Popen(
                [NGINX, "-p", str(work / "stub"), "-c", str(conf)], start_new_session=True
            )
            time.sleep(0.5)
            lua = work / "post.lua"
            lua.write_text(WRK_LUA)
            res["wrk_route"] = wrk(url + "/v1/chat/completions", a.load, lua)
            res["wrk_health"] = wrk(url + "/health", a.load, None)
    finally:
        if stub:
            stub.terminate()
            stub.wait(10)
        gw.stop()
    res["js_module"] = JS_MODULE
    print(json.dumps(res, indent=2))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2) + "\n")
    os.system(f"rm -rf {work}")


if __name__ == "__main__":
    main()
