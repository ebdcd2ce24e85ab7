"""``vllm-fleet bench``: argument parsing; the work is in the other bench modules."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from . import compare as compare_mod
from . import report as report_mod
from . import scenarios
from .session import Hook, Options, run_once
from .workload import Profile, ProfileError, load_profile, override


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", nargs="?", help="base URL of the endpoint, e.g. http://127.0.0.1:8000")
    p.add_argument("--profile", default="tiny", help="bundled profile name (seed, tiny) or a YAML file")
    p.add_argument("--model", help="model to request (default: the profile's, else the first on /v1/models)")
    g = p.add_argument_group("load (override the profile)")
    g.add_argument("--concurrency", type=int, help="closed loop: N users sending back to back")
    g.add_argument("--rate", type=float, help="open loop: requests per second (Poisson arrivals)")
    g.add_argument("--max-concurrency", type=int, help="open loop: cap on requests in flight")
    g.add_argument("--duration", type=float, help="measured seconds (after warm-up)")
    g.add_argument("--requests", type=int, dest="max_requests", help="measured requests to send at most")
    g.add_argument("--warmup", type=float, help="warm-up seconds (excluded from statistics)")
    g.add_argument("--warmup-requests", type=int, help="warm-up requests (excluded from statistics)")
    g.add_argument("--timeout", type=float, help="per-request timeout, seconds")
    g.add_argument("--seed", type=int)
    s = g.add_mutually_exclusive_group()
    s.add_argument("--stream", dest="stream", action="store_const", const=True, help="stream every request")
    s.add_argument("--no-stream", dest="stream", action="store_const", const=False, help="stream none")
    p.add_argument("--header", action="append", default=[], metavar="K=V", help="extra HTTP header")
    p.add_argument("--api-key", help="sent as Authorization: Bearer and x-api-key")
    p.add_argument("--metrics-url", action="append", metavar="URL", help="engine /metrics to watch (repeat)")
    p.add_argument("--no-metrics", action="store_true", help="do not scrape /metrics")
    p.add_argument("--no-tokenize", action="store_true", help="approximate prompt sizes (no /tokenize calls)")
    p.add_argument("--tokenize-url", help="a /tokenize URL (default: URL/tokenize)")
    p.add_argument("--out", default="bench-results", help="folder for the JSON report and the PNG plot")
    p.add_argument("--name", help="file name stem (default: bench-PROFILE-TIMESTAMP)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    p.add_argument("--max-error-rate", type=float, default=None, help="exit 1 above this error rate")
    c = p.add_argument_group("compare mode")
    c.add_argument("--compare", nargs=2, metavar=("URL_A", "URL_B"), help="rounds A B B A …; B/A ratios")
    c.add_argument("--rounds", type=int, default=6, help="rounds per endpoint (default 6)")
    c.add_argument("--round-duration", type=float, default=10.0, help="seconds per round (default 10)")
    c.add_argument(
        "--metrics-url-b",
        action="append",
        help="B's engines' /metrics (repeatable), when they are not A's (default: --metrics-url for both)",
    )
    sc = p.add_argument_group("scenarios")
    sc.add_argument("--scenario", choices=["failover", "rolling-restart"])
    sc.add_argument("--during", metavar="CMD", help="failover: command run at --at, e.g. 'ssh h1 …'")
    sc.add_argument("--at", type=float, default=10.0, help="failover: when to run --during (s)")
    sc.add_argument("--health-url", help="failover: URL polled until 200 after the command")
    sc.add_argument("--health-cmd", help="failover: instead of --health-url, a command retried until exit 0")
    sc.add_argument("--health-timeout", type=float, default=900.0, help="failover: give up polling after S s")
    sc.add_argument("--after-recovery", type=float, help="failover: end the load S s after recovery")
    sc.add_argument("--instances", help="rolling-restart: NAME[@HOST],… restarted one by one")
    sc.add_argument("--drain-cmd", help="rolling-restart: e.g. 'vllm-fleet drain {name}'")
    sc.add_argument("--restart-cmd", help="rolling-restart: e.g. 'ssh {host} systemctl restart vllm@{name}'")
    sc.add_argument(
        "--ready-url", help="rolling-restart: URL polled until 200, e.g. 'http://{host}:8000/health'"
    )
    sc.add_argument("--ready-cmd", help="rolling-restart: command retried until exit 0")
    sc.add_argument("--undrain-cmd", help="rolling-restart: e.g. 'vllm-fleet undrain {name}'")
    sc.add_argument(
        "--drain-wait", type=float, default=0.0, help="rolling-restart: s between drain and restart"
    )
    sc.add_argument("--settle", type=float, default=3.0, help="rolling-restart: seconds after each undrain")
    sc.add_argument(
        "--start-after", type=float, default=5.0, help="rolling-restart: s of load before the first"
    )
    sc.add_argument(
        "--ready-timeout", type=float, default=900.0, help="rolling-restart: wait ready at most S s"
    )
    sc.add_argument("--cmd-timeout", type=float, default=120.0, help="scenario commands' timeout, seconds")
    p.set_defaults(handler=main)


def _headers(a: argparse.Namespace) -> dict[str, str]:
    h = {}
    for kv in a.header:
        k, sep, v = kv.partition("=")
        if not sep:
            raise ProfileError(f"--header {kv}: expected K=V")
        h[k.strip()] = v.strip()
    if a.api_key:
        h.setdefault("Authorization", f"Bearer {a.api_key}")
        h.setdefault("x-api-key", a.api_key)
    return h


def _profile(a: argparse.Namespace) -> Profile:
    prof = load_profile(a.profile)
    keys = ("concurrency", "rate", "max_concurrency", "duration", "max_requests", "warmup", "warmup_requests")
    changes: dict[str, Any] = {k: getattr(a, k) for k in (*keys, "timeout", "seed")}
    if any(v is not None for v in changes.values()):
        prof = override(prof, **changes)
    return prof


def _options(a: argparse.Namespace, url: str) -> Options:
    return Options(
        url=url,
        model=a.model,
        headers=_headers(a),
        stream=a.stream,
        metrics_urls=[] if a.no_metrics else a.metrics_url,
        tokenize_url=None if a.no_tokenize else (a.tokenize_url or "auto"),
        progress=not a.quiet,
    )


def _hooks(a: argparse.Namespace) -> tuple[Hook, ...]:
    if a.scenario == "failover":
        if not a.during:
            raise ProfileError("--scenario failover needs --during CMD")
        return (scenarios.Failover(a.during, a.at, a.health_url, a.health_timeout, a.cmd_timeout,
                                   stop_after_recovery=a.after_recovery, health_cmd=a.health_cmd),)  # fmt: skip
    if a.scenario == "rolling-restart":
        if not a.instances or not a.restart_cmd:
            raise ProfileError("--scenario rolling-restart needs --instances and --restart-cmd")
        return (
            scenarios.RollingRestart(
                [scenarios.Instance.parse(x) for x in a.instances.split(",") if x],
                a.restart_cmd,
                drain_cmd=a.drain_cmd,
                undrain_cmd=a.undrain_cmd,
                ready_url=a.ready_url,
                ready_cmd=a.ready_cmd,
                start_after=a.start_after,
                drain_wait=a.drain_wait,
                settle=a.settle,
                ready_timeout=a.ready_timeout,
                cmd_timeout=a.cmd_timeout,
            ),
        )
    return ()


def main(a: argparse.Namespace) -> int:
    try:
        prof = _profile(a)
        hooks = _hooks(a)
        if not a.compare and not a.url:
            raise ProfileError("give the endpoint URL (or --compare URL_A URL_B)")
    except ProfileError as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 2
    stem = a.name or f"bench-{prof.name}-{datetime.now(UTC).strftime('%Y%m%dT%H%M%S')}"
    out = Path(a.out)
    if a.compare:
        url_a, url_b = a.compare
        res = asyncio.run(
            compare_mod.compare(
                prof,
                url_a,
                url_b,
                a.rounds,
                a.round_duration,
                _options(a, url_a),
                metrics_b=None if a.no_metrics else a.metrics_url_b,
            )
        )
        report_mod.write_json(res, out / f"{stem}-compare.json")
        print(compare_mod.table(res))
        print(f"results: {out / f'{stem}-compare.json'}")
        return 0
    rep = asyncio.run(run_once(prof, _options(a, a.url), hooks))
    if hooks:
        scenarios.summarize(rep)
    path = out / f"{stem}.json"
    report_mod.write_json(rep, path)
    print(report_mod.table(rep))
    if "scenario" in rep:
        sc = {k: v for k, v in rep["scenario"].items() if k != "events"}
        print("scenario: " + json.dumps(sc, indent=1, default=str))
    print(f"results: {path}")
    if not a.no_plot:
        from .plot import plot

        print(f"plot: {plot(rep, out / f'{stem}.png')}")
    o = rep["overall"]
    if o["ok"] == 0:
        print("bench: no request succeeded", file=sys.stderr)
        return 1
    if a.max_error_rate is not None and o["error_rate"] > a.max_error_rate:
        print(f"bench: error rate {o['error_rate']:.3f} above {a.max_error_rate}", file=sys.stderr)
        return 1
    return 0
