"""Device side: the busy-engine liveness on a real GPU engine (docs/gpu-validation.md, "Busy is not hung").

  burst.py OUT   the launcher instance of h200-burst.yml (one H200, max_num_seqs 256, WatchdogSec 20 s) under a
                 NOTIFY_SOCKET we own, then
                 1. a burst far deeper than max_num_seqs, kept in flight for several watchdog periods (lanes that
                    send their next request as one ends): every request must complete and the watchdog pings
                    must never pause for a WatchdogSec, although a decode probe would wait behind the queue;
                 2. the engine core stopped (SIGSTOP) while requests run: /health still answers, the pings must
                    stop within one probe timeout and the status must say "stalled"; after SIGCONT they resume;
                 3. SIGTERM (what systemctl stop sends): the drain and the exit code.
                 Results (notify timeline, verdicts, metrics peaks, outcomes) to OUT/burst-results.json.

Run after run-device.sh stash/install (the same carried stack as measure.py); no bare engine is needed.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import re
import resource
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from measure import LAB, stop_launcher, vf_cli  # noqa: E402  (the sibling script: its plan/render and stop)

VF = Path("/root/vf")
SPEC = REPO / "tools/gpu-validate/h200-burst.yml"
NAME = "qwen3-8b"
PORT = 8002
WATCHDOG_S = 20.0
PY = sys.executable


def metrics(port: int = PORT) -> dict[str, float]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for name in ("num_requests_running", "num_requests_waiting", "generation_tokens_total"):
        vals = re.findall(rf"^vllm:{name}\{{[^}}]*\}} (\S+)$", text, re.M)
        if vals:
            out[name] = sum(float(v) for v in vals)
    return out


def health() -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/health", timeout=2) as r:
            return int(r.status)
    except OSError:
        return 0


def state() -> dict[str, Any]:
    with contextlib.suppress(OSError, ValueError):
        return dict(json.loads((VF / "run" / f"{NAME}.json").read_text()))
    return {}


async def _lanes(n: int, tokens: int, hold: float) -> dict[str, Any]:
    import aiohttp

    body = {"model": NAME, "prompt": "once upon a time", "max_tokens": tokens, "ignore_eos": True}
    url = f"http://127.0.0.1:{PORT}/v1/completions"
    outcomes: dict[str, int] = {}
    slowest = 0.0

    async def one(s: aiohttp.ClientSession) -> str:
        nonlocal slowest
        t = time.monotonic()
        try:
            async with s.post(url, json=body) as r:
                d = await r.json(content_type=None)
                ok = r.status == 200 and d["choices"][0]["finish_reason"] == "length"
                kind = "completed" if ok else f"other-{r.status}"
        except Exception as exc:
            kind = "dropped:" + type(exc).__name__
        slowest = max(slowest, time.monotonic() - t)
        outcomes[kind] = outcomes.get(kind, 0) + 1
        return kind

    async def lane(s: aiohttp.ClientSession, deadline: float) -> None:
        while True:
            kind = await one(s)
            if time.monotonic() >= deadline or kind.startswith("dropped"):
                return

    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=1800)) as s:
        t0 = time.monotonic()
        await asyncio.gather(*(lane(s, t0 + hold) for _ in range(n)))
        wall = time.monotonic() - t0
    return {"lanes": n, "tokens": tokens, "hold_s": hold, "wall_s": round(wall, 1), "outcomes": outcomes,
            "slowest_request_s": round(slowest, 1)}  # fmt: skip


class Sampler:
    """Every 0.5 s: the launcher's verdict and the engine's queue (its /metrics on ``port``), while a phase
    runs."""

    def __init__(self, port: int = PORT) -> None:
        self.port = port
        self.rows: list[dict[str, Any]] = []
        self.stop = threading.Event()
        self.t = threading.Thread(target=self.run, daemon=True)
        self.t.start()

    def run(self) -> None:
        while not self.stop.is_set():
            s = state()
            self.rows.append({"t": time.monotonic(), "kind": s.get("last_probe_kind"), "ok": s.get("last_probe_ok"),
                              **metrics(self.port)})  # fmt: skip
            time.sleep(0.5)

    def done(self) -> list[dict[str, Any]]:
        self.stop.set()
        self.t.join(10)
        return self.rows


def pings(lis: Any, t_from: float, t_to: float) -> list[float]:
    return [t for t, f in lis.messages if f.get("WATCHDOG") == "1" and t_from <= t <= t_to]


def max_gap(times: list[float], t_from: float, t_to: float) -> float:
    edges = [t_from, *times, t_to]
    return round(max(b - a for a, b in itertools.pairwise(edges)), 2)


def main(out: Path) -> int:
    from vllm_fleet.host.notify import NotifyListener

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    out.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {"nofile": [soft, hard]}
    r = vf_cli("render", str(SPEC), "--out", str(VF / "render-burst"), *LAB)
    if r.returncode:
        print(r.stdout, r.stderr)
        return 1
    inst = VF / "render-burst/h200" / str(VF).lstrip("/") / "etc/instances" / f"{NAME}.json"
    (VF / "etc/instances").mkdir(parents=True, exist_ok=True)
    (VF / "etc/instances" / f"{NAME}.json").write_text(inst.read_text())
    cfg = json.loads(inst.read_text())
    res["service"] = cfg["service"]
    res["plan"] = vf_cli("plan", str(SPEC), *LAB).stdout[-2500:]
    print(res["plan"], flush=True)

    sock = str(VF / "notify-burst.sock")
    with contextlib.suppress(OSError):
        os.unlink(sock)
    lis = NotifyListener(sock)
    env = dict(os.environ, NOTIFY_SOCKET=sock, WATCHDOG_USEC=str(int(WATCHDOG_S * 1e6)))
    (VF / "log").mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    lp = subprocess.Popen(
        [PY, "-m", "vllm_fleet.host.launcher", NAME, "--config-dir", str(VF / "etc")],
        env=env, cwd=REPO, stdout=(VF / "log/launcher-burst.log").open("wb"), stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    try:
        lis.wait_for("READY", "1", timeout=480)
    except TimeoutError:
        print("no READY=1", flush=True)
        os.system(f"tail -60 {VF}/log/launcher-burst.log")
        os.killpg(lp.pid, signal.SIGKILL)
        return 1
    res["ready_s"] = round(time.monotonic() - t0, 1)
    print(f"READY=1 after {res['ready_s']}s", flush=True)

    # 1. the burst: 2,000 lanes at max_num_seqs 256 (≈ 1,750 waiting), 60 s of new requests, then the drain
    n, tokens, hold = int(os.environ.get("VF_LANES", "2000")), int(os.environ.get("VF_TOKENS", "256")), 60.0
    pid_before = state().get("engine_pid")
    sampler = Sampler()
    tb = time.monotonic()
    res["burst"] = asyncio.run(_lanes(n, tokens, hold))
    te = time.monotonic()
    rows = sampler.done()
    bp = pings(lis, tb, te)
    res["burst"].update(
        pings=len(bp),
        max_ping_gap_s=max_gap(bp, tb, te),
        watchdog_s=WATCHDOG_S,
        verdicts=sorted({str(x["kind"]) for x in rows}),
        probe_failed_samples=sum(1 for x in rows if x["ok"] is False),
        peak_waiting=max((x.get("num_requests_waiting", 0) for x in rows), default=0),
        peak_running=max((x.get("num_requests_running", 0) for x in rows), default=0),
        launcher_alive=lp.poll() is None,
        same_engine=state().get("engine_pid") == pid_before,
        status_during=sorted({f["STATUS"][:80] for t, f in lis.messages if tb <= t <= te and "STATUS" in f})[:20],
    )  # fmt: skip
    gen = [float(x["generation_tokens_total"]) for x in rows if x.get("generation_tokens_total") is not None]
    if len(gen) > 1:
        res["burst"]["output_tok_s"] = round((gen[-1] - gen[0]) / (rows[-1]["t"] - rows[0]["t"]), 1)
    print("burst:", json.dumps(res["burst"]), flush=True)

    # 2. the engine core stopped while 64 requests run: pings stop, the status says stalled; SIGCONT: resume
    eng = state().get("engine_pid")
    assert eng is not None, "no engine_pid in the state file"
    sid = os.getsid(int(eng))
    found = subprocess.run(
        ["pgrep", "-s", str(sid), "-f", "^VLLM::EngineCore"], text=True, capture_output=True
    )
    core = [int(p) for p in found.stdout.split()]
    if not core:  # no setproctitle: the engine's process on the GPU
        apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                              text=True, capture_output=True).stdout.split()  # fmt: skip
        core = [int(p) for p in apps if p.isdigit() and os.getsid(int(p)) == sid]
    hang: dict[str, Any] = {"engine_core": core}
    stop_load = threading.Event()

    def load() -> None:
        body = json.dumps({"model": NAME, "prompt": "x", "max_tokens": 512, "ignore_eos": True}).encode()
        while not stop_load.is_set():
            req = urllib.request.Request(f"http://127.0.0.1:{PORT}/v1/completions", body,
                                         {"Content-Type": "application/json"})  # fmt: skip
            with contextlib.suppress(OSError):
                urllib.request.urlopen(req, timeout=300).read()

    threads = [threading.Thread(target=load, daemon=True) for _ in range(64)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while state().get("last_probe_kind") != "progress" and time.monotonic() < deadline:
        time.sleep(0.2)
    hang["busy_verdict_before"] = state().get("last_probe_kind")
    if len(core) == 1:
        ts = time.monotonic()
        os.kill(core[0], signal.SIGSTOP)
        probe_timeout = float(cfg["service"].get("probe_timeout_seconds", 10))
        interval = float(cfg["service"].get("probe_interval_seconds", 5))
        time.sleep(probe_timeout + interval + 1)
        tq = time.monotonic()
        time.sleep(10)
        hang["health_while_stopped"] = health()
        hang["pings_in_quiet_10s"] = len(pings(lis, tq, time.monotonic()))
        last = pings(lis, ts - 60, time.monotonic())
        hang["last_ping_after_stop_s"] = round(max(last) - ts, 2) if last else None
        seen = {f["STATUS"][:100] for t, f in lis.messages if t >= ts and "STATUS" in f}
        hang["status"] = sorted(seen)[:10]
        hang["metrics_while_stopped"] = metrics()
        since = len(lis.messages)
        tc = time.monotonic()
        os.kill(core[0], signal.SIGCONT)
        try:
            i = lis.wait_for("WATCHDOG", "1", since=since, timeout=60)
            hang["pings_resume_after_cont_s"] = round(lis.messages[i][0] - tc, 2)
            hang["pings_resumed"] = True
        except TimeoutError:
            hang["pings_resumed"] = False
    stop_load.set()
    for t in threads:
        t.join(120)
    res["hang"] = hang
    print("hang:", json.dumps(hang), flush=True)

    # 3. stop
    rc, took = stop_launcher(lp, 90)
    res["stop"] = {"rc": rc, "seconds": took}
    res["notify"] = [{"t": round(t - t0, 2), **f} for t, f in lis.messages]
    lis.close()
    (out / "burst-results.json").write_text(json.dumps(res, indent=2, default=str))
    lines = (VF / "log/launcher-burst.log").read_text(errors="replace").splitlines()
    (out / "launcher-burst.log").write_text("\n".join([*lines[:200], "...", *lines[-300:]]) + "\n")
    print("stop:", res["stop"], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
