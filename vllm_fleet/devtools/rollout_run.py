"""A canary rollout under steady traffic, measured (docs/perf/rollouts.md).

    python -m vllm_fleet.devtools.rollout_run SPEC MODEL -i INVENTORY --gateway http://GW:8000 \\
        --api-key-file KEYFILE [--warmup 60] [--kill-after-rotation] [--lanes 6 --prefixes 32] \\
        [--ansible-arg=-e --ansible-arg=vllm_fleet_models_src=DIR ...] [--json OUT]

Client traffic (``failover.FailoverLoad``: ``lanes`` lanes, plain and streamed, ``prefixes`` distinct system
prompts, no client retries) runs for ``--warmup`` seconds, then ``vllm-fleet rollout SPEC MODEL`` runs beside it
(its own output shown), and the traffic stops when the rollout ends (or, with ``--kill-after-rotation``, once the
controller was SIGKILLed as soon as a gateway reports the canary in rotation and the canary's host has stopped
it). It prints: the rollout's outcome and exit status, its times (start → in rotation → verdict → end), the
requests sent and failed (each failure with when and why), the requests the gateways sent the canary and the
stable instances during the rollout (the gateways' track counter), and the fleet's prefix-cache hit rate over
the warm-up and over the canary's time in rotation (the engines' counters, from the monitoring host's
Prometheus, asked over SSH as `vllm-fleet rollout` does).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path
from typing import Any

from vllm_fleet.devtools.failover import FailoverLoad
from vllm_fleet.fleet.network import monitoring_listen_address
from vllm_fleet.fleet.remote import Remote, load_inventory
from vllm_fleet.fleet.spec import FleetSpec, load_spec


def prom(remote: Remote, spec: FleetSpec, expr: str, at: float) -> float | None:
    """One instant query at time ``at`` on the first monitoring host's Prometheus (asked from that host)."""
    mon, m = spec.monitoring_host, spec.monitoring
    url = (
        f"http://{monitoring_listen_address(spec, mon)}:{m.prometheus_port}/api/v1/query?"
        + urllib.parse.urlencode({"query": expr, "time": f"{at:.3f}"})
    )
    [a] = remote.http(mon, [{"url": url, "auth_user": m.web_user if m.web_auth else "",
                             "auth_file": m.web_password_file}])  # fmt: skip
    if a.get("status") != 200:
        raise RuntimeError(f"Prometheus: {a}")
    res = json.loads(a["body"])["data"]["result"]
    return float(res[0]["value"][1]) if res else None


def hit_rate(remote: Remote, spec: FleetSpec, model: str, start: float, end: float) -> float | None:
    secs = max(30, int(end - start))
    sel = f'{{model="{model}"}}'
    expr = (
        f"sum(increase(vllm:prefix_cache_hits_total{sel}[{secs}s])) / "
        f"sum(increase(vllm:prefix_cache_queries_total{sel}[{secs}s]))"
    )
    return prom(remote, spec, expr, end)


def tracks(remote: Remote, spec: FleetSpec, model: str, start: float, end: float) -> dict[str, float]:
    secs = max(30, int(end - start))
    out = {}
    for track in ("canary", "stable"):
        expr = f'sum(increase(vllm_fleet_gateway_track_requests_total{{model="{model}", track="{track}"}}[{secs}s]))'
        out[track] = prom(remote, spec, expr, end) or 0.0
    return out


def canary_in_rotation(remote: Remote, spec: FleetSpec, name: str) -> bool:
    gw = spec.gateway_hosts[0]
    cp = remote.run(gw, ["cat", spec.gateway.state_file or f"{spec.paths.config_dir}/gateway/drained.json"])
    try:
        lease = (json.loads(cp.stdout or "{}").get("canary") or {}).get(name) or {}
    except ValueError:
        return False
    return float(lease.get("until", 0)) > time.time()


def canary_lines(remote: Remote, spec: FleetSpec, since: int) -> tuple[int, int]:
    """(the access log's line count now, how many of the lines after ``since`` the canary served)."""
    gw, log = spec.gateway_hosts[0], spec.gateway.access_log
    cp = remote.run(
        gw, ["sh", "-c", f'wc -l < {log}; tail -n +{since + 1} {log} | grep -c \'"track":"canary"\'']
    )
    n, c = [*cp.stdout.split(), "0", "0"][:2]
    return int(n), int(c)


def unit_active(remote: Remote, host: str, unit: str) -> str:
    return remote.run(host, ["systemctl", "is-active", unit]).stdout.strip()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rollout_run", description=__doc__.split("\n")[0])
    p.add_argument("spec")
    p.add_argument("model")
    p.add_argument("-i", "--inventory", required=True)
    p.add_argument("--gateway", required=True, help="the clients' base URL, e.g. http://10.77.0.81:8000")
    p.add_argument("--api-key-file", default="")
    p.add_argument("--warmup", type=float, default=60.0)
    p.add_argument("--lanes", type=int, default=6)
    p.add_argument("--prefixes", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--pause", type=float, default=0.1)
    p.add_argument("--kill-after-rotation", action="store_true")
    p.add_argument("--ansible-arg", action="append", default=[])
    p.add_argument("--json", default="")
    a = p.parse_args(argv)
    spec = load_spec(a.spec)
    canary = spec.canary_of(a.model)
    if canary is None:
        p.error(f"no rollouts entry for {a.model}")
    remote = Remote(load_inventory(a.inventory))
    key = Path(a.api_key_file).read_text().split()[0] if a.api_key_file else None
    report = Path(a.json or "/tmp/rollout-run-report.json").with_suffix(".rollout.json")
    cmd = [str(Path(sys.executable).parent / "vllm-fleet"), "rollout", a.spec, a.model, "-i", a.inventory,
           "--report", str(report), *(f"--ansible-arg={x}" for x in a.ansible_arg)]  # fmt: skip
    load = FailoverLoad(a.gateway, a.model, api_key=key, lanes=a.lanes, prefixes=a.prefixes,
                        max_tokens=a.max_tokens, pause=a.pause, read_timeout=30, timeout=60, connect_timeout=5)  # fmt: skip
    out: dict[str, Any] = {"model": a.model, "canary": canary.name, "lanes": a.lanes, "prefixes": a.prefixes}
    with load:
        t_warm = time.time()
        time.sleep(a.warmup)  # the hit rate's "before": traffic without a canary for this long
        t0 = time.time()
        load.mark("rollout")
        proc = subprocess.Popen(cmd, env=dict(os.environ))
        killed_at = stopped_at = None
        after = 0
        if a.kill_after_rotation:
            while proc.poll() is None and not canary_in_rotation(remote, spec, canary.name):
                time.sleep(1)
            time.sleep(10)  # some canary traffic first
            proc.send_signal(signal.SIGKILL)
            killed_at = time.time()
            load.mark("killed")
            while unit_active(remote, canary.host, f"vllm@{canary.name}.service") == "active":
                time.sleep(1)
            stopped_at = time.time()
            seen, _ = canary_lines(remote, spec, 0)
            n = len(load.records)
            while len(load.records) < n + 60:  # 60 requests after: none of them may reach the canary
                time.sleep(0.5)
            _, after = canary_lines(remote, spec, seen)
        rc = proc.wait()
        t1 = time.time()
        load.mark("end")
    recs = load.records
    failed = [r for r in recs if r.outcome != "ok"]
    rec = json.loads(report.read_text()) if report.is_file() else {}
    steps = {s["step"]: s["at"] for s in rec.get("steps", [])}
    out.update(
        rc=rc,
        outcome=rec.get("outcome", "killed" if killed_at else "?"),
        requests=len(recs),
        failed=len(failed),
        failures=[r.__dict__ for r in failed[:10]],
        rollout_seconds=round(t1 - t0, 1),
        in_rotation_after_s=round(steps["rotation"] - t0, 1) if "rotation" in steps else None,
        verdict=(rec.get("verdict") or {}).get("reason"),
        verdict_report=(rec.get("verdict") or {}).get("report"),
        hit_rate_before=hit_rate(remote, spec, a.model, t_warm, t0),
        hit_rate_during=hit_rate(remote, spec, a.model, steps.get("rotation", t0), killed_at or t1),
        tracks_during=tracks(remote, spec, a.model, t0, t1),
    )
    if killed_at:
        out["canary_stopped_after_kill_s"] = round((stopped_at or killed_at) - killed_at, 1)
        out["canary_requests_after_stop"] = after
    remote.close()
    print(json.dumps(out, indent=2, default=str))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
