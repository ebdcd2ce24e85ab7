"""Device side: liveness under connection churn on a real GPU engine (issue 31; docs/gpu-validation.md,
"Liveness under churn"; docs/design/liveness-under-churn.md).

  churn.py OUT     the launcher instance of h200-burst.yml (WatchdogSec 20 s) under a NOTIFY_SOCKET we own, the
                   rendered gateway in front (its key file, the admission service, nginx), then two phases:
                   (a) ``gateway``: N lanes of streamed completions (max_tokens 256, ignore_eos), each request on a
                       NEW connection, through the gateway with the lab key, for HOLD s (3 × WatchdogSec);
                   (b) ``direct``: the same at the engine's port.
                   Lanes stop sending at HOLD; what still runs DRAIN s later is cut (counted as ``cut``).
                   Per phase: the WATCHDOG=1 gaps (longest, those > 5 s, whether one reached WatchdogSec: systemd
                   would have killed the unit), the launcher's STATUS= lines and verdicts, outcomes (complete /
                   error_200 / refused by status, reason and Retry-After / dropped / cut), the engine's peak
                   running/waiting, failed connects to the admission socket. OUT/churn-results.json + a summary.
  churn.py client URL OUT [--key K] [--lanes N] [--hold S] [--drain S] [--tokens T] [--model M]
                   only the client side (no launcher): e.g. against a local sim engine or gateway.

Env: VF_LANES (2000), VF_HOLD (60), VF_DRAIN (20), VF_TOKENS (256), VF_PHASES (gateway,direct).
Run after run-device.sh stash/install (the carried stack); no bare engine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import signal
import sys
import time
import urllib.parse
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for p in (REPO, HERE, REPO / "tools"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))
from sandbox_burst import classify, summarize  # noqa: E402  (tools/sandbox_burst.py: the same outcomes)

NAME = "qwen3-8b"
ENGINE_PORT, GW_PORT = 8002, 8000
WATCHDOG_S = 20.0
BIG_GAP_S = 5.0
CONNECT_TIMEOUT_S = 30.0
PROMPT = "once upon a time"

# ---- the client: asyncio sockets, one new connection per request (HTTP/1.1, Connection: close) ----


def request_bytes(host: str, port: int, path: str, body: bytes, key: str | None) -> bytes:
    head = [
        f"POST {path} HTTP/1.1",
        f"Host: {host}:{port}",
        "Content-Type: application/json",
        "Accept: text/event-stream",
        f"Content-Length: {len(body)}",
        "Connection: close",
    ]
    if key:
        head.append(f"Authorization: Bearer {key}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


async def read_body(reader: asyncio.StreamReader, headers: dict[str, str], first: list[float]) -> bytes:
    """The response body (de-chunked); ``first`` gets the time the first body bytes came. Raises on a cut
    (IncompleteReadError, a reset): the caller keeps what came through ``parts``."""
    parts: list[bytes] = []
    try:
        if "chunked" in headers.get("transfer-encoding", "").lower():
            while True:
                size_line = await reader.readline()
                if not size_line:
                    raise asyncio.IncompleteReadError(b"", None)
                size = int(size_line.split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    await reader.readline()
                    break
                parts.append(await reader.readexactly(size))
                if not first:
                    first.append(time.monotonic())
                await reader.readexactly(2)
        elif "content-length" in headers:
            parts.append(await reader.readexactly(int(headers["content-length"])))
        else:
            while chunk := await reader.read(65536):
                parts.append(chunk)
                if not first:
                    first.append(time.monotonic())
    except BaseException as exc:
        exc.partial_body = b"".join(parts)  # type: ignore[attr-defined]
        raise
    return b"".join(parts)


async def exchange(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str, port: int, path: str, body: bytes,
    key: str | None,
) -> tuple[int | None, dict[str, str], str, str | None, list[float]]:  # fmt: skip
    """One POST on an open connection, which it closes: (status, headers, body text — what came before a
    failure —, the failure or None, [monotonic time of the body's first byte] or [])."""
    status: int | None = None
    headers: dict[str, str] = {}
    first: list[float] = []
    text, error = "", None
    try:
        writer.write(request_bytes(host, port, path, body, key))
        await writer.drain()
        line = await reader.readline()
        if not line:
            raise ConnectionResetError("closed before a status line")
        status = int(line.split()[1])
        while (h := await reader.readline()) not in (b"\r\n", b"\n", b""):
            k, _, v = h.decode("latin-1").partition(":")
            headers[k.strip().lower()] = v.strip()
        text = (await read_body(reader, headers, first)).decode(errors="replace")
    except (OSError, asyncio.IncompleteReadError, ValueError, IndexError) as exc:
        error = f"{type(exc).__name__}: {exc}"
        text = getattr(exc, "partial_body", b"").decode(errors="replace")
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()
    return status, headers, text, error, first


async def one_request(host: str, port: int, path: str, body: bytes, key: str | None) -> dict[str, Any]:
    t0 = time.monotonic()
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), CONNECT_TIMEOUT_S)
    except (OSError, TimeoutError) as exc:
        rec = classify(None, "", error=f"connect: {type(exc).__name__}: {exc}")
        return {**rec, "seconds": round(time.monotonic() - t0, 3)}
    status, headers, text, error, first = await exchange(reader, writer, host, port, path, body, key)
    rec = classify(
        status,
        text,
        content_type=headers.get("content-type", ""),
        retry_after=headers.get("retry-after"),
        error=error,
    )
    rec["seconds"] = round(time.monotonic() - t0, 3)
    if first and rec["kind"] == "complete":
        rec["ttft"] = first[0] - t0
    return rec


async def lanes(
    url: str, key: str | None, n: int, hold: float, drain: float, tokens: int, model: str
) -> dict[str, Any]:
    """N lanes, each a new connection per request, sending until ``hold`` s; what still runs ``drain`` s later
    is cut. A refusal with Retry-After waits it (at most 5 s), as the SDKs do."""
    u = urllib.parse.urlsplit(url)
    host, port = u.hostname or "127.0.0.1", u.port or 80
    path = u.path.rstrip("/") + "/v1/completions"
    body = json.dumps(
        {"model": model, "prompt": PROMPT, "max_tokens": tokens, "ignore_eos": True, "stream": True}
    ).encode()
    records: list[dict[str, Any]] = []
    t0 = time.monotonic()
    stop_at = t0 + hold

    async def lane() -> None:
        while time.monotonic() < stop_at:
            rec = await one_request(host, port, path, body, key)
            rec["t"] = round(time.monotonic() - t0, 3)
            records.append(rec)
            if rec["kind"] == "refused" and rec.get("retry_after"):
                with contextlib.suppress(ValueError):
                    await asyncio.sleep(min(5.0, float(rec["retry_after"])))
            elif rec["kind"] in ("dropped", "other_status"):
                await asyncio.sleep(0.2)  # no hot loop on a refused connect

    tasks = [asyncio.create_task(lane()) for _ in range(n)]
    _, pending = await asyncio.wait(tasks, timeout=hold + drain)
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    wall = time.monotonic() - t0
    summary = summarize(records)
    summary["by_kind"]["cut"] = len(pending)
    slow = sorted(r["seconds"] for r in records)
    return {
        "url": url,
        "lanes": n,
        "hold_s": hold,
        "drain_s": drain,
        "tokens": tokens,
        "wall_s": round(wall, 1),
        **summary,
        "requests_per_s": round(len(records) / wall, 1) if wall else None,
        "slowest_request_s": slow[-1] if slow else None,
        "connect_failures": sum(1 for r in records if str(r.get("detail", "")).startswith("connect:")),
    }


def run_lanes(
    url: str, key: str | None, n: int, hold: float, drain: float, tokens: int, model: str
) -> dict[str, Any]:
    return asyncio.run(lanes(url, key, n, hold, drain, tokens, model))


# ---- the watchdog timeline (pure: tests/unit/test_gpu_churn.py) ----


def ping_gaps(ping_times: list[float], t_from: float, t_to: float) -> list[tuple[float, float]]:
    """(start, length) of every gap between WATCHDOG=1 pings over [t_from, t_to]: from the last ping before
    ``t_from`` (else ``t_from``) to ``t_to`` (a phase that ends without a ping counts up to its end)."""
    before = [t for t in ping_times if t < t_from]
    inside = sorted(t for t in ping_times if t_from <= t <= t_to)
    edges = [before[-1] if before else t_from, *inside, t_to]
    return [(a, b - a) for a, b in itertools.pairwise(edges)]


def watchdog_report(
    ping_times: list[float], t_from: float, t_to: float, watchdog_s: float, big: float = BIG_GAP_S
) -> dict[str, Any]:
    gaps = ping_gaps(ping_times, t_from, t_to)
    longest = max((g for _, g in gaps), default=0.0)
    return {
        "pings": sum(1 for t in ping_times if t_from <= t <= t_to),
        "max_ping_gap_s": round(longest, 2),
        "goal_max_gap_s": round(watchdog_s / 3, 2),
        "within_goal": longest <= watchdog_s / 3,
        "gaps_over_5s": [{"at_s": round(a - t_from, 2), "gap_s": round(g, 2)} for a, g in gaps if g > big],
        "systemd_would_kill": longest >= watchdog_s,
    }


def verdict_of(status: str) -> str:
    """The verdict of one of the launcher's STATUS= lines (launcher_state.py): ``flooded`` ("under connection
    churn"), ``starved`` ("slowly: starved of CPU"), ``failing`` ("Probe failing (Nx): ..."), ``serving``, or
    the line's first words."""
    low = status.lower()
    for needle, word in (
        ("connection churn", "flooded"),
        ("flooded", "flooded"),
        ("probe failing", "failing"),
        ("starved", "starved"),
        ("stalled", "stalled"),
        ("stopping", "stopping"),
        ("serving", "serving"),
        ("loading", "loading"),
    ):
        if needle in low:
            return word
    return " ".join(low.split()[:3])


# ---- the device run ----


def phase(
    name: str, url: str, key: str | None, lis: Any, lab: dict[str, Any], knobs: dict[str, Any]
) -> dict[str, Any]:
    from burst import Sampler

    gw = lab.get("gw")
    err_log = lab.get("error_log")
    from measure import admission_connect_failures

    _, at = admission_connect_failures(err_log) if err_log else (0, 0)
    sampler = Sampler()
    tb = time.monotonic()
    res = run_lanes(url, key, knobs["lanes"], knobs["hold"], knobs["drain"], knobs["tokens"], NAME)
    te = time.monotonic()
    rows = sampler.done()
    pings = [t for t, f in lis.messages if f.get("WATCHDOG") == "1"]
    res["watchdog"] = watchdog_report(pings, tb, te, WATCHDOG_S)
    status = [(t, f["STATUS"]) for t, f in lis.messages if tb <= t <= te and "STATUS" in f]
    res["status_lines"] = [{"t": round(t - tb, 2), "status": s[:200]} for t, s in status][:200]
    res["verdicts"] = sorted({verdict_of(s) for _, s in status})
    res["probe_kinds_sampled"] = sorted({str(x.get("kind")) for x in rows})
    res["probe_failed_samples"] = sum(1 for x in rows if x.get("ok") is False)
    res["peak_running"] = max((x.get("num_requests_running", 0) for x in rows), default=0)
    res["peak_waiting"] = max((x.get("num_requests_waiting", 0) for x in rows), default=0)
    res["metrics_samples"] = sum(1 for x in rows if "num_requests_running" in x)
    if err_log:
        res["admission_connect_failures"] = admission_connect_failures(err_log, at)[0]
    if gw is not None:
        res["admission_metrics_tail"] = [
            ln for ln in gw.admission_metrics().splitlines() if ln.startswith("vllm_fleet_admission")
        ][:60]
    print(f"{name}: {json.dumps({k: v for k, v in res.items() if k != 'status_lines'})[:3000]}", flush=True)
    return res


def wait_idle(timeout: float, port: int = ENGINE_PORT) -> float:
    """Seconds until the engine on ``port`` runs and queues nothing (at most ``timeout``)."""
    from burst import metrics

    t = time.monotonic()
    while time.monotonic() - t < timeout:
        m = metrics(port)
        if m and m.get("num_requests_running", 1) == 0 and m.get("num_requests_waiting", 1) == 0:
            break
        time.sleep(1)
    return round(time.monotonic() - t, 1)


def device(out: Path) -> int:
    from burst import SPEC, state
    from measure import (
        LOG,
        VF,
        LabGateway,
        keep_logs,
        raise_nofile,
        render_instance,
        start_launcher,
        stop_launcher,
        wait_ready,
    )

    knobs = {
        "lanes": int(os.environ.get("VF_LANES", "2000")),
        "hold": float(os.environ.get("VF_HOLD", "60")),
        "drain": float(os.environ.get("VF_DRAIN", "20")),
        "tokens": int(os.environ.get("VF_TOKENS", "256")),
    }
    phases = os.environ.get("VF_PHASES", "gateway,direct").split(",")
    out.mkdir(parents=True, exist_ok=True)
    LOG.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {"nofile": raise_nofile(), "knobs": knobs, "phases": phases}
    render_dir = VF / "render-churn"
    res["service"] = render_instance(SPEC, render_dir)["service"]

    lp, lis, t0 = start_launcher("churn", WATCHDOG_S)
    gw: Any = None
    try:
        res["ready_s"] = wait_ready(lis, t0, "churn")
        if res["ready_s"] is None:
            return 1
        print(f"READY=1 after {res['ready_s']}s", flush=True)
        pid_before = state().get("engine_pid")

        lab: dict[str, Any] = {}
        if "gateway" in phases:
            gw = LabGateway(render_dir / "h200", VF / "nginx-prefix-churn", LOG / "admission-churn.log")
            try:
                gw.start(GW_PORT)
            except (RuntimeError, TimeoutError) as exc:
                res["gateway_error"] = str(exc)
                print("gateway failed:", exc, flush=True)
            res["gateway_setup"] = gw.info
            lab = {"gw": gw, "error_log": error_log_of(render_dir)}
            # one request with the key first: the key file, admission and routing work
            body = json.dumps({"model": NAME, "prompt": PROMPT, "max_tokens": 8, "stream": True}).encode()
            check = asyncio.run(one_request("127.0.0.1", GW_PORT, "/v1/completions", body, gw.key))
            res["gateway_check"] = {k: v for k, v in check.items() if k != "ttft"}
            print("gateway check:", res["gateway_check"], flush=True)
        for name in phases:
            if name == "gateway" and gw is not None and "gateway_error" not in res:
                res["gateway"] = phase(name, f"http://127.0.0.1:{GW_PORT}", gw.key, lis, lab, knobs)
            elif name == "direct":
                res["direct"] = phase(name, f"http://127.0.0.1:{ENGINE_PORT}", None, lis, {}, knobs)
            # what is measured so far survives a call cut at its time limit
            (out / "churn-results.json").write_text(json.dumps(res, indent=2, default=str))
            res[f"idle_after_{name}_s"] = wait_idle(20)
        res["launcher_alive"] = lp.poll() is None
        res["same_engine"] = state().get("engine_pid") == pid_before
        res["restarts_seen"] = sum(1 for _, f in lis.messages if f.get("READY") == "1") - 1
    finally:
        rc, took = stop_launcher(lp, 60)
        res["stop"] = {"rc": rc, "seconds": took}
        if gw is not None:
            gw.stop()
        res["notify"] = [{"t": round(t - t0, 2), **f} for t, f in lis.messages]
        lis.close()
        (out / "churn-results.json").write_text(json.dumps(res, indent=2, default=str))
        keep_logs(("launcher-churn.log", "admission-churn.log", "nginx-error.log"), out)
        print_summary(res)
    return 0


def error_log_of(render_dir: Path) -> Path:
    """The rendered gateway's error log (nginx's ``error_log PATH`` in the rendered conf)."""
    conf = (render_dir / "h200/etc/nginx/conf.d/vllm-fleet.conf").read_text()
    for ln in conf.splitlines():
        parts = ln.split()
        if len(parts) >= 2 and parts[0] == "error_log":
            return Path(parts[1].rstrip(";"))
    return Path("/dev/null")


def print_summary(res: dict[str, Any]) -> None:
    print("=== churn summary")
    print(f"READY after {res.get('ready_s')} s; stop {res.get('stop')}; launcher alive {res.get('launcher_alive')}, "
          f"same engine {res.get('same_engine')}, READY again {res.get('restarts_seen')}")  # fmt: skip
    for name in ("gateway", "direct"):
        p = res.get(name)
        if not p:
            continue
        w = p["watchdog"]
        print(f"[{name}] {p['lanes']} lanes {p['hold_s']:g}+{p['drain_s']:g} s: {p['requests']} requests "
              f"({p['requests_per_s']}/s) {p['by_kind']}")  # fmt: skip
        big = [g["gap_s"] for g in w["gaps_over_5s"]]
        print(f"  watchdog: {w['pings']} pings, longest gap {w['max_ping_gap_s']} s (goal ≤ {w['goal_max_gap_s']}), "
              f"gaps > 5 s {big}, systemd would kill: {w['systemd_would_kill']}")  # fmt: skip
        print(f"  verdicts {p['verdicts']}; peak running {p['peak_running']:g} waiting {p['peak_waiting']:g}; "
              f"refusals {p['refusals']}; admission connect failures {p.get('admission_connect_failures')}")  # fmt: skip


def client_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="churn.py client")
    ap.add_argument("url")
    ap.add_argument("out", type=Path)
    ap.add_argument("--key")
    ap.add_argument("--lanes", type=int, default=50)
    ap.add_argument("--hold", type=float, default=5)
    ap.add_argument("--drain", type=float, default=10)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--model", default=NAME)
    a = ap.parse_args(argv)
    from measure import raise_nofile

    raise_nofile()
    res = run_lanes(a.url, a.key, a.lanes, a.hold, a.drain, a.tokens, a.model)
    a.out.write_text(json.dumps(res, indent=2))
    print(json.dumps(res, indent=2)[:3000])
    return 0


if __name__ == "__main__":
    # SIGTERM (`timeout` at the end of the call): the finally blocks stop the launcher and write the results
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if len(sys.argv) > 1 and sys.argv[1] == "client":
        sys.exit(client_main(sys.argv[2:]))
    sys.exit(device(Path(sys.argv[1])))
