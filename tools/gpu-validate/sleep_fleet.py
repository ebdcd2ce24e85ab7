"""Device side: sleep mode THROUGH vllm-fleet on the H200 (issue 33; docs/gpu-validation.md, "Sleep mode through
vllm-fleet (sleep_fleet.py)"). sleep.py measured vLLM's own sleep and wake on a bare ``vllm serve``; this runs two
models taking turns on the one GPU the way a host does: the rendered spec (h200-sleep.yml: swap group gpu0,
max_awake 1), both launchers (sd_notify through NOTIFY_SOCKETs we own), the sleep guard in each engine, the
rendered gateway (measure.LabGateway) in front.

  sleep_fleet.py OUT          on the device, after ``run-device.sh install`` (one call of about 6-8 min):
  1. the models: A (qwen3-8b-a) on make_model.py's folder with dummy weights, sleeping at level 1; B (qwen3-8b-b)
     on a copy of it with real random bf16 weights written on the GPU (tinymodel.write_random_weights, in a
     child process: its CUDA context is gone before an engine starts), sleeping at level 2 (the wake reloads the
     weights from disk); the spec moved to the device's non-loopback address (the engines listen there: the
     gateway is a host of its own), rendered and planned (``--lock-dir '' --allow-unchecked-flags``);
  2. launcher A (WATCHDOG_USEC = WatchdogSec 20 s): READY (the cold start), the gateway, the first request's
     TTFT, a greedy probe, a round of 64 streams for 10 s (output tok/s); GPU memory;
  3. launcher B: it waits for the swap group's slot and asks A to yield (A sleeps at level 1: its STATUS and
     state file), then loads; READY; the same first request, probe and round; memory (A asleep + B awake);
  4. N cycles (--cycles, 3): a batch of concurrent requests for A through the gateway (half streamed) — held at
     A's guard, B yields (level-2 sleep), A wakes — every request must be a complete 200; the first answer's
     latency (the swap included), the wake's seconds from A's state file, the peers' STATUS lines and counters;
     then the same for B (A yields at level 1, B wakes with its weights reloaded from disk); after the first
     wake of each a round (throughput after the wake vs before) and the greedy probe (the same answer as
     before it slept); memory at each point;
  5. the development endpoints from outside: straight to each engine's port (the non-loopback address) without
     the admin token and with a wrong one → vLLM's 404 JSON, the engine's sleep state unchanged; through the
     gateway → a JSON 404 (and /vllm-fleet/sleep too);
  6. the watchdog pings of both launchers never a WatchdogSec apart from READY on, both alive with one READY
     each and the same engine (no restart); ``vllm-fleet exporter --once --no-nvml``: the sleep state, wakes and
     wake duration series match the state files;
  7. SIGTERM to both launchers: exit 0, STOPPING=1, the engines gone; memory after.
  OUT/sleep-fleet-results.json (written after every step; a ``timeout``'s SIGTERM stops the launchers and
  writes it, with run_completed false) + the logs, and a summary. Exit 0 when every check passed. Each step
  prints the seconds used of the budget (--budget-s); a cycle that would not leave room for the rest is not
  started (all_cycles_run fails).
  sleep_fleet.py OUT --local  the same steps with the sim engine (vllm_fleet/devtools/sim_engine.py: vLLM's
                              sleep mode and the guard) and the machine's nginx, everything under a temporary
                              folder on free ports, small sizes: no GPU (docs/gpu-validation.md).

Knobs (flags, defaults from the environment): VF_CYCLES (3), VF_BATCH (16; local 8), VF_TOKENS (128; local 16),
VF_ROUND_LANES (64; local 8), VF_ROUND_S (10; local 2), VF_READY_TIMEOUT (300; local 60), VF_BUDGET_S (540).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for p in (REPO, HERE, REPO / "tools"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))
# the siblings: lora_fleet.py's client (a request on a new connection, lanes), its outcome of an answer, its
# spec moving and small helpers; churn.py's watchdog report; measure.py's lab (render flags, gateway, stop)
import lora_fleet as lf  # noqa: E402
from churn import watchdog_report  # noqa: E402
from measure import LAB, LabGateway, kv_lines, kv_tokens, stop_launcher, vf_cli  # noqa: E402

from vllm_fleet.contracts import (  # noqa: E402
    ADMIN_TOKEN_HEADER,
    ASLEEP_GPU_GIB,
    SLEEP_STATE_PATH,
    WAKE_FAILED_PATH,
)

SPEC = HERE / "h200-sleep.yml"
VF = Path("/root/vf")
A, B = "qwen3-8b-a", "qwen3-8b-b"  # the instances and their served models
GPU_HOST, GW_HOST = "h200", "gw"  # the spec's hosts
GROUP = "gpu0"
WATCHDOG_S = 20.0  # h200-sleep.yml's service.watchdog_seconds
REAL_WEIGHTS_SEED = 0
# a greedy probe shorter than a KV block (16 tokens): no prefix cache hit, the same computation before and after
PROBE_PROMPT = "The capital of France is"
PROBE_TOKENS = 8
# the development endpoints asked from outside (method, path): vLLM serves them with VLLM_SERVER_DEV_MODE=1;
# the guard answers them, and its own /vllm-fleet/*, with vLLM's 404 unless the admin token comes with them
DEV_ENDPOINTS = (
    ("POST", "/sleep?level=1"),
    ("POST", "/wake_up"),
    ("GET", "/is_sleeping"),
    ("POST", "/collective_rpc"),
    ("GET", "/server_info"),
    ("POST", "/reset_prefix_cache"),
    ("POST", WAKE_FAILED_PATH),
)
NOT_FOUND = {"detail": "Not Found"}  # FastAPI's own 404 body
RESERVE_S = 100.0  # what a run keeps for the endpoints, the exporter and the stop after the cycles


# ---- the lab's layout: the device's /root/vf, or a temporary folder for --local


@dataclass
class Layout(lf.LabLayout):
    address: str = "127.0.0.1"  # the GPU host's address: the engines listen there (layout() finds it)
    ports: dict[str, int] = field(default_factory=lambda: {A: 8002, B: 8003})

    @property
    def model_a(self) -> Path:
        return self.root / "models" / "qwen3-8b"  # make_model.py's folder (run-device.sh install)

    @property
    def model_b(self) -> Path:
        return self.root / "models" / "qwen3-8b-real"

    @property
    def render_dir(self) -> Path:
        return self.root / "render-sleep"

    def rendered(self, host: str, path: Path) -> Path:
        """Where the render put the file host ``host`` has at ``path`` (absolute)."""
        return self.render_dir / host / str(path).lstrip("/")


# ---- the spec and the verdicts (pure: tests/unit/test_gpu_sleep_fleet.py)


def spec_data(base: dict[str, Any], lay: Layout) -> dict[str, Any]:
    """h200-sleep.yml's data for this run: moved to ``lay`` (root, the GPU host's address, ports)."""
    d: dict[str, Any] = lf.retarget(json.loads(json.dumps(base)), str(VF), str(lay.root))
    for h in d["hosts"]:
        if h["name"] == GPU_HOST:
            h["address"] = lay.address
    for m in d["models"]:
        m["port"] = lay.ports[m["name"]]
    gw = d["gateway"]
    gw["port"], gw["stub_status_port"] = lay.gw_port, lay.stub_port
    gw["limits"]["metrics_port"] = lay.admission_metrics_port
    return d


def sleep_levels(d: dict[str, Any]) -> dict[str, int]:
    return {m["name"]: int(m["sleep"]["level"]) for m in d["models"] if m.get("sleep")}


def expected_counters(cycles: int) -> dict[str, dict[str, int]]:
    """The sleeps and wakes each launcher counts after ``cycles`` full cycles: A slept once for B's load and once
    per cycle, woke once per cycle; B slept and woke once per cycle."""
    return {
        A: {"sleeps_total": cycles + 1, "wakes_total": cycles},
        B: {"sleeps_total": cycles, "wakes_total": cycles},
    }


def batch_summary(records: list[dict[str, Any]], t_send: float) -> dict[str, Any]:
    """A batch's outcomes: by kind and status, the streams and plain answers, the first answer's latency (the
    first byte of any answer after the batch was sent: the swap included), the streams' TTFT and the plain
    answers' seconds, the answers naming another model."""
    firsts = [r["first_byte_at"] - t_send for r in records if r.get("first_byte_at")]
    ttft = sorted(r["ttft"] for r in records if r.get("ttft") is not None)
    plain = sorted(r["seconds"] for r in records if not r["stream"] and r["kind"] == "complete")
    return {
        "requests": len(records),
        "streams": sum(1 for r in records if r["stream"]),
        "by_kind": dict(Counter(r["kind"] for r in records)),
        "by_status": {str(k): v for k, v in sorted(Counter(r["status"] for r in records).items(), key=str)},
        "first_answer_s": round(min(firsts), 3) if firsts else None,
        "ttft_s": {"min": ttft[0] if ttft else None, "max": ttft[-1] if ttft else None},
        "plain_s": {"min": plain[0] if plain else None, "max": plain[-1] if plain else None},
        "model_mismatch": sum(1 for r in records if r["kind"] == "complete" and not r.get("model_ok")),
        "details": dict(Counter(str(r.get("detail"))[:160] for r in records if r["kind"] != "complete")),
    }


def swap_verdict(
    s: dict[str, Any], target: str, other: str, levels: dict[str, int]
) -> dict[str, tuple[bool, Any]]:
    """What one swap must show (``s``: its record — the batch's summary, the guards' readings, both state files
    before and after, both launchers' STATUS lines during it): every request a complete 200 naming its model,
    held at the target's guard, the other asleep at its level with one more sleep, the target awake with one
    more wake and its duration, the STATUS lines of both. {check: (ok, detail)}."""
    b = s["batch"]
    before, after = s["state_before"], s["state_after"]
    t_b, t_a, o_b, o_a = before[target], after[target], before[other], after[other]
    yield_status = f"Going to sleep (level {levels[other]}): a peer of swap group {GROUP} needs the room"
    return {
        "every_request_complete_200": (
            b["requests"] > 0 and b["by_kind"] == {"complete": b["requests"]} and b["model_mismatch"] == 0,
            {k: b[k] for k in ("by_kind", "by_status", "details")},
        ),
        "held_at_the_guard": (s["guards"][target]["max_held"] >= 1, s["guards"][target]),
        "peer_yielded_asleep_at_its_level": (
            o_a.get("sleep_state") == "asleep"
            and o_a.get("sleep_level") == levels[other]
            and o_a.get("sleeps_total") == (o_b.get("sleeps_total") or 0) + 1
            and any(x.startswith(yield_status) for x in s["status"][other]),
            {
                "state": o_a.get("sleep_state"),
                "level": o_a.get("sleep_level"),
                "sleeps": [o_b.get("sleeps_total"), o_a.get("sleeps_total")],
                "status": s["status"][other],
            },
        ),
        "target_woke_once": (
            t_b.get("sleep_state") == "asleep"
            and t_a.get("sleep_state") == "awake"
            and t_a.get("wakes_total") == (t_b.get("wakes_total") or 0) + 1
            and isinstance(t_a.get("last_wake_seconds"), int | float)
            and any(x.startswith(f"Waking (level {levels[target]})") for x in s["status"][target]),
            {
                "state": [t_b.get("sleep_state"), t_a.get("sleep_state")],
                "wakes": [t_b.get("wakes_total"), t_a.get("wakes_total")],
                "last_wake_seconds": t_a.get("last_wake_seconds"),
                "status": s["status"][target],
            },
        ),
    }


def sim_weights_verdict(swaps: list[dict[str, Any]], levels: dict[str, int]) -> tuple[bool, Any]:
    """--local: the sim engine's own reading after each swap (``GET /sim/control``: ``weights_loaded``, which a
    level-2 sleep clears and only ``/collective_rpc reload_weights`` sets again): a level-2 instance asleep has
    its weights dropped, awake it has them back (the launcher's wake reloaded them)."""
    seen, bad = [], []
    for s in swaps:
        for name, sim in (s.get("sim") or {}).items():
            if levels.get(name) != 2 or not isinstance(sim, dict):
                continue
            state = s["state_after"][name].get("sleep_state")
            row = (s["cycle"], s["target"], name, state, sim.get("weights_loaded"))
            seen.append(row)
            if sim.get("weights_loaded") is not (state == "awake"):
                bad.append(row)
    return bool(seen) and not bad and {r[3] for r in seen} == {"asleep", "awake"}, {"seen": seen, "bad": bad}


def transition_s(
    messages: list[tuple[float, dict[str, str]]], since: float, start: str, end: str
) -> float | None:
    """Seconds from the first STATUS starting with ``start`` at or after ``since`` to the next one starting with
    ``end`` (a launcher's notify messages): e.g. "Waking" → "Serving", the wake alone, without the slot wait."""
    t0 = None
    for t, f in messages:
        st = f.get("STATUS")
        if t < since or st is None:
            continue
        if t0 is None and st.startswith(start):
            t0 = t
        elif t0 is not None and st.startswith(end):
            return round(t - t0, 3)
    return None


def prom_series(text: str, metric: str) -> list[tuple[dict[str, str], float]]:
    """The samples of ``metric`` (exactly that name) in a Prometheus exposition: (labels, value)."""
    out = []
    for ln in text.splitlines():
        if not ln.startswith(metric) or ln[len(metric) : len(metric) + 1] not in ("{", " "):
            continue
        head, _, value = ln.rpartition(" ")
        labels = dict(re.findall(r'(\w+)="([^"]*)"', head[len(metric) :]))
        with contextlib.suppress(ValueError):
            out.append((labels, float(value)))
    return out


def exporter_verdict(text: str, states: dict[str, dict[str, Any]]) -> dict[str, tuple[bool, Any]]:
    """The exporter's sleep series against the launchers' state files (``states``: instance → state file):
    the current sleep state 1 (the others 0), wakes_total, and the wake duration summary (_count the wakes, _sum
    their seconds)."""
    p = "vllm_fleet_instance_"
    got: dict[str, dict[str, Any]] = {}
    for name, st in states.items():

        def one(metric: str, name: str = name) -> float | None:
            vals = [v for lb, v in prom_series(text, p + metric) if lb.get("instance") == name]
            return vals[0] if len(vals) == 1 else None

        current = [
            lb.get("state")
            for lb, v in prom_series(text, p + "sleep_state")
            if lb.get("instance") == name and v == 1
        ]
        got[name] = {
            "state_file": {k: st.get(k) for k in ("sleep_state", "wakes_total", "wake_seconds_total")},
            "sleep_state": current,
            "wakes_total": one("wakes_total"),
            "wake_count": one("wake_duration_seconds_count"),
            "wake_sum": one("wake_duration_seconds_sum"),
        }
    ok_state = all(g["sleep_state"] == [states[n].get("sleep_state")] for n, g in got.items())
    ok_wakes = all(
        g["wakes_total"] == states[n].get("wakes_total") == g["wake_count"] and g["wakes_total"] is not None
        for n, g in got.items()
    )
    ok_sum = all(
        g["wake_sum"] is not None
        and abs(g["wake_sum"] - float(states[n].get("wake_seconds_total") or 0)) < 1e-3
        for n, g in got.items()
    )
    return {
        "exporter_sleep_state_matches": (ok_state, got),
        "exporter_wakes_total_matches": (ok_wakes, got),
        "exporter_wake_duration_matches": (ok_sum, got),
    }


def endpoint_verdict(rows: list[dict[str, Any]]) -> dict[str, tuple[bool, Any]]:
    """The development endpoints asked from outside: straight at an engine (without the token, with a wrong
    one) each must be vLLM's own 404 JSON; through the gateway a 404 with a JSON body."""
    direct = [r for r in rows if r["via"] == "engine"]
    gw = [r for r in rows if r["via"] == "gateway"]
    bad_direct = [r for r in direct if not (r["status"] == 404 and r["body"] == NOT_FOUND)]
    bad_gw = [r for r in gw if not (r["status"] == 404 and isinstance(r["body"], dict))]
    return {
        "dev_endpoints_404_at_the_engines_without_the_token": (
            bool(direct) and not bad_direct,
            bad_direct or len(direct),
        ),
        "dev_endpoints_404_json_through_the_gateway": (bool(gw) and not bad_gw, bad_gw or len(gw)),
    }


def memory_point(
    smi: dict[str, Any], sid_of: Callable[[int], int | None], engines: dict[str, int | None]
) -> dict[str, Any]:
    """nvidia-smi's reading (lora_fleet.nvidia_smi) as GPU memory used and per instance (a GPU process belongs to
    the instance whose engine leads its session: the launcher starts each engine in a session of its own)."""
    if "gpu" not in smi:
        return {"skipped": smi.get("skipped", "no nvidia-smi")}
    used = total = None
    m = re.match(r"\s*(\d+)\s*MiB,\s*(\d+)\s*MiB", smi["gpu"])
    if m:
        used, total = int(m.group(1)), int(m.group(2))
    per: dict[str, int] = {}
    for ln in smi.get("apps", []):
        parts = [x.strip() for x in ln.split(",")]
        mm = re.match(r"(\d+)", parts[-1]) if parts else None
        if not (parts and parts[0].isdigit() and mm):
            continue
        sid = sid_of(int(parts[0]))
        who = next((n for n, pid in engines.items() if pid is not None and sid == pid), f"pid {parts[0]}")
        per[who] = per.get(who, 0) + int(mm.group(1))
    return {"used_mib": used, "total_mib": total, "by_instance_mib": per}


def asleep_within_reserve(points: dict[str, dict[str, Any]]) -> tuple[bool, Any]:
    """At every memory point, each instance asleep there keeps at most contracts.ASLEEP_GPU_GIB of the GPU (what
    the plan reserves per sleeper)."""
    limit = ASLEEP_GPU_GIB * 1024
    seen, over = [], []
    for label, pt in points.items():
        for name, state in (pt.get("sleep_state") or {}).items():
            mib = (pt.get("by_instance_mib") or {}).get(name)
            if state == "asleep" and mib is not None:
                seen.append((label, name, mib))
                if mib > limit:
                    over.append((label, name, mib))
    return bool(seen) and not over, {"limit_mib": limit, "asleep": seen, "over": over}


# ---- small helpers


def exporter_once(lay: lf.LabLayout) -> subprocess.CompletedProcess[str]:
    """``vllm-fleet exporter --once --no-nvml`` on the lab's state files and instance configs (what the host's
    exporter serves at a scrape; no GPU read, no workers, access log, drain state or manifest)."""
    return vf_cli(
        "exporter",
        "--once",
        "--no-nvml",
        "--state-dir",
        str(lay.state_dir),
        "--config-dir",
        str(lay.etc / "instances"),
        "--worker-config-dir",
        "",
        "--access-log",
        "",
        "--drain-state",
        "",
        "--manifest",
        "",
        timeout=120,
    )


def non_loopback_ipv4() -> str | None:
    """This machine's first IPv4 address that is not loopback (the interface order of the kernel)."""
    from vllm_fleet.host.netif import ipv4_of

    for _, name in socket.if_nameindex():
        ip = ipv4_of(name)
        if ip and not ip.startswith("127."):
            return ip
    return None


def raw(
    method: str, url: str, headers: dict[str, str] | None = None, body: Any = None, timeout: float = 10
) -> tuple[int, Any]:
    """(status, JSON body or text) of one request with exactly these headers; status 0 when nothing answered."""
    data = json.dumps(body).encode() if body is not None else (b"{}" if method == "POST" else None)
    req = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, text = int(r.status), r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        status, text = int(e.code), e.read().decode(errors="replace")
    except OSError as exc:
        return 0, f"{type(exc).__name__}: {exc}"
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text[:300]


def sid_of(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None


class GuardWatch:
    """Both engines' guards (``GET contracts.SLEEP_STATE_PATH``, straight at the engine) every 0.1 s during a
    swap: the states each went through and the most requests it held."""

    def __init__(self, urls: dict[str, str]) -> None:
        self.urls = urls
        self.seen: dict[str, dict[str, Any]] = {
            n: {"states": [], "max_held": 0, "max_inflight": 0, "polls": 0} for n in urls
        }
        self.ev = threading.Event()
        self.t = threading.Thread(target=self.run, daemon=True)
        self.t.start()

    def run(self) -> None:
        while not self.ev.is_set():
            for name, url in self.urls.items():
                st, doc = raw("GET", url + SLEEP_STATE_PATH, timeout=1)
                s = self.seen[name]
                s["polls"] += 1
                if st == 200 and isinstance(doc, dict):
                    if not s["states"] or s["states"][-1] != doc.get("state"):
                        s["states"].append(doc.get("state"))
                    s["max_held"] = max(s["max_held"], int(doc.get("held") or 0))
                    s["max_inflight"] = max(s["max_inflight"], int(doc.get("inflight") or 0))
            self.ev.wait(0.1)

    def done(self) -> dict[str, dict[str, Any]]:
        self.ev.set()
        self.t.join(5)
        return self.seen


@dataclass
class Inst:
    """One instance under its launcher."""

    name: str
    port: int
    level: int
    lp: subprocess.Popen[bytes] | None = None
    lis: Any = None
    t0: float = 0.0
    t_ready: float | None = None
    pid: int | None = None

    def ready_count(self) -> int:
        return sum(1 for _, f in self.lis.messages if f.get("READY") == "1") if self.lis else 0

    def statuses(self, since: float = 0.0) -> list[str]:
        return [
            str(f["STATUS"])[:160]
            for t, f in (self.lis.messages if self.lis else [])
            if t >= since and "STATUS" in f
        ]


RunStop = lf.RunStop  # a step cannot go on: the run stops the launchers and writes what it has

# ---- the lab: the models and the engine command (device: what run-device.sh install left; local: the sim)


def make_local_lab(lay: Layout, token_delay: float) -> dict[str, Any]:
    """--local: the Qwen3-8B config as both model folders (the sim engine reads no weights) and the spec's engine
    command ($venv/bin/vllm) as a script that runs the sim engine with the rendered arguments."""
    for d in (lay.model_a, lay.model_b):
        d.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / "vllm_fleet/data/qwen3-8b-config.json", d / "config.json")
    sim = f"--sim-token-delay {token_delay} --sim-sleep-seconds 0.3 --sim-wake-seconds 0.1"
    lf.sim_engine_script(lay.root, "sleep_fleet.py", sim)
    return {"engine": f"sim engine, token delay {token_delay} s", "weights": "none (the sim reads none)"}


def require_install(model: Path) -> None:
    """The device: make_model.py's folder where ``run-device.sh install`` puts it, or RunStop."""
    if not (model / "config.json").exists():
        raise RunStop(f"no {model}: run `run-device.sh install` first")


def make_real_model(src: Path, dst: Path) -> dict[str, Any]:
    """B's folder: make_model.py's config and tokenizer (``src``) with real random bf16 weights of the Qwen3-8B
    shape, written on the GPU in a child process (its CUDA context and torch's cached blocks go with it, before an
    engine sizes its share of the GPU); kept when a marker says the same weights are there (a rerun)."""
    marker = dst / "vllm-fleet-random-weights.json"
    want = {"seed": REAL_WEIGHTS_SEED, "shape_of": "qwen3-8b", "version": 1}
    if marker.exists() and lf.read_json(marker) == want:
        return {"reused": True, "bytes": sum(f.stat().st_size for f in dst.glob("*.safetensors"))}
    t = time.monotonic()
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    code = (
        f"import json, sys; from pathlib import Path; sys.path.insert(0, {str(REPO)!r})\n"
        "from vllm_fleet.devtools.tinymodel import write_random_weights\n"
        f"d = Path({str(dst)!r}); cfg = json.loads((d / 'config.json').read_text())\n"
        f"print(json.dumps(write_random_weights(cfg, d, seed={REAL_WEIGHTS_SEED}, device='cuda')))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=400)
    if r.returncode:
        raise RunStop(f"write_random_weights failed: {r.stdout[-1500:]}{r.stderr[-1500:]}")
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    marker.write_text(json.dumps(want))
    return {"reused": False, "seconds": round(time.monotonic() - t, 1), **doc}


# ---- the run


class Run(lf.LabRun):
    detail_chars = 600
    results_file = "sleep-fleet-results.json"  # under OUT (sleep_scale.py's Run keeps its own)
    notify_kept = 1500  # each launcher's last notify messages kept in the results

    def __init__(self, out: Path, a: argparse.Namespace, lay: Layout) -> None:
        self.out, self.a, self.lay = out, a, lay
        self.res: dict[str, Any] = {
            "mode": "local (sim engine, this machine's nginx)"
            if lay.local
            else "device (vLLM under the launchers)",
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "knobs": {k: v for k, v in vars(a).items() if k != "out"},
            "root": str(lay.root),
            "address": lay.address,
            "checks": {},
            "memory": {},
            "requests": {},
        }
        self.insts: dict[str, Inst] = {}
        self.gw: LabGateway | None = None
        self.tstart = time.monotonic()
        self.levels: dict[str, int] = {}

    # -- bookkeeping

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        for n, i in self.insts.items():
            if i.lis is not None:
                self.res.setdefault("notify", {})[n] = [
                    {"t": round(t - i.t0, 3), **f} for t, f in i.lis.messages
                ][-self.notify_kept :]
        (self.out / self.results_file).write_text(json.dumps(self.res, indent=2, default=str))

    def step(self, title: str) -> None:
        self.res["last_step"] = title
        self.res.setdefault("step_started_s", {})[title] = round(self.elapsed(), 1)
        print(f"== {title} ({self.elapsed():.0f} s of the {self.a.budget_s:g} s budget)", flush=True)

    @property
    def gw_url(self) -> str:
        return f"http://127.0.0.1:{self.lay.gw_port}"

    def engine_url(self, name: str) -> str:
        return f"http://{self.lay.address}:{self.lay.ports[name]}"

    def state(self, name: str) -> dict[str, Any]:
        return lf.read_json(self.lay.state_dir / f"{name}.json") or {}

    def states(self) -> dict[str, dict[str, Any]]:
        return {n: self.state(n) for n in (A, B)}

    def count(self, phase: str, records: list[dict[str, Any]]) -> None:
        """Every request's outcome, by phase: the run's 0-failed check reads these."""
        c = self.res["requests"].setdefault(phase, {})
        for r in records:
            k = f"{r.get('status')} {r.get('kind')}"
            c[k] = c.get(k, 0) + 1

    def memory(self, label: str) -> dict[str, Any]:
        engines = {n: i.pid for n, i in self.insts.items()}
        pt = memory_point(lf.nvidia_smi(), sid_of, engines)
        pt["sleep_state"] = {n: self.state(n).get("sleep_state") for n in self.insts}
        self.res["memory"][label] = pt
        if "used_mib" in pt:
            print(
                f"   GPU memory {label}: {pt['used_mib']} MiB used; {pt['by_instance_mib']} ({pt['sleep_state']})",
                flush=True,
            )
        return pt

    # -- 1. models, spec, render, plan

    def prepare(self) -> None:
        import yaml

        self.step("1. models, spec, render, plan")
        lay = self.lay
        if not lay.local:
            self.res["gpu_apps_before"] = lf.require_free_gpu()  # each instance takes 0.85 of the GPU
            require_install(lay.model_a)
            self.res["models"] = {
                "a": "make_model.py's folder, dummy weights",
                "b": make_real_model(lay.model_a, lay.model_b),
            }
            print(f"   B's weights: {self.res['models']['b']}", flush=True)
        else:
            self.res["models"] = make_local_lab(lay, self.a.token_delay)
        self.spec = spec_data(yaml.safe_load(SPEC.read_text()), lay)
        self.levels = sleep_levels(self.spec)
        self.spec_path = lay.root / "sleep-spec.yml"
        self.spec_path.write_text(yaml.safe_dump(self.spec, sort_keys=False))
        shutil.rmtree(lay.render_dir, ignore_errors=True)
        r = vf_cli("render", str(self.spec_path), "--out", str(lay.render_dir), *LAB)
        if r.returncode:
            raise RunStop(f"render failed: {r.stdout[-2000:]}{r.stderr[-2000:]}")
        dest = lay.etc / "instances"
        dest.mkdir(parents=True, exist_ok=True)
        configs = {}
        for n in (A, B):
            src = lay.rendered(GPU_HOST, lay.etc / "instances" / f"{n}.json")
            shutil.copy(src, dest / f"{n}.json")
            cfg = json.loads(src.read_text())
            configs[n] = {k: cfg.get(k) for k in ("command", "environment", "sleep", "listen_address")}
        self.res["instance_configs"] = configs
        rc, plan, err = lf.cli_json("plan", str(self.spec_path), "--json", *LAB)
        text = vf_cli("plan", str(self.spec_path), *LAB).stdout
        self.res["plan_text"] = text
        lines = [
            ln.strip()
            for ln in text.splitlines()
            if "swap group" in ln or ln.strip().startswith(("sleep:", "level-1"))
        ]
        self.res["plan"] = {
            "rc": rc,
            "stderr": err,
            "lines": lines,
            "instances": {i.get("name"): i.get("sleep") for i in (plan.get("instances") or [])}
            if isinstance(plan, dict)
            else plan,
        }
        for ln in lines:
            print("   plan:", ln, flush=True)
        self.check(
            "plan_ok_with_the_swap_group",
            rc == 0 and any(f"swap group {GROUP}" in ln for ln in lines),
            self.res["plan"],
        )
        cmds = {n: c["command"] for n, c in configs.items()}
        self.check(
            "rendered_engines_sleep_behind_the_guard_on_the_address",
            all(
                "--enable-sleep-mode" in c
                and "vllm_fleet.host.sleep_guard.SleepGuard" in c
                and c[c.index("--host") + 1] == lay.address
                for c in cmds.values()
            )
            and all(
                configs[n]["sleep"]["level"] == self.levels[n] and configs[n]["sleep"]["group"] == GROUP
                for n in (A, B)
            ),
            {
                n: {"sleep": configs[n]["sleep"], "host": c[c.index("--host") + 1] if "--host" in c else None}
                for n, c in cmds.items()
            },
        )
        self.save()

    # -- launchers

    def launch(self, name: str) -> Inst:
        from vllm_fleet.host.notify import NotifyListener

        lay = self.lay
        lay.log.mkdir(parents=True, exist_ok=True)
        sock = str(lay.root / f"notify-{name}.sock")
        with contextlib.suppress(OSError):
            os.unlink(sock)
        inst = Inst(name, lay.ports[name], self.levels[name], lis=NotifyListener(sock))
        env = dict(os.environ, NOTIFY_SOCKET=sock, WATCHDOG_USEC=str(int(WATCHDOG_S * 1e6)))
        inst.t0 = time.monotonic()
        inst.lp = subprocess.Popen(
            [sys.executable, "-m", "vllm_fleet.host.launcher", name, "--config-dir", str(lay.etc)],
            env=env,
            cwd=REPO,
            stdout=self.launcher_log(name).open("wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.insts[name] = inst
        return inst

    def launcher_log(self, name: str) -> Path:
        return self.lay.log / f"launcher-{name}.log"

    def wait_ready(self, inst: Inst) -> bool:
        try:
            i = inst.lis.wait_for("READY", "1", timeout=self.a.ready_timeout)
        except TimeoutError:
            print(f"no READY=1 from {inst.name}; its launcher's log:", flush=True)
            print(
                "\n".join(self.launcher_log(inst.name).read_text(errors="replace").splitlines()[-60:]),
                flush=True,
            )
            self.check(
                f"{inst.name}_ready",
                False,
                f"no READY=1 in {self.a.ready_timeout:g} s (rc {inst.lp.poll() if inst.lp else None})",
            )
            return False
        inst.t_ready = inst.lis.messages[i][0]
        deadline = time.monotonic() + 10
        while not self.state(inst.name).get("engine_pid") and time.monotonic() < deadline:
            time.sleep(0.2)
        inst.pid = self.state(inst.name).get("engine_pid")
        return True

    # -- requests through the gateway

    def one(self, model: str, stream: bool, prompt: str, tokens: int | None = None) -> dict[str, Any]:
        assert self.gw is not None
        return asyncio.run(
            lf.one_request(
                "127.0.0.1", self.lay.gw_port, model, stream, self.gw.key, tokens or self.a.tokens, prompt
            )
        )

    def batch(self, model: str, n: int, tag: str) -> tuple[list[dict[str, Any]], float]:
        """``n`` requests for ``model`` at once through the gateway, every other one streamed, each on a new
        connection: (their records, when they were sent)."""
        assert self.gw is not None
        key = self.gw.key

        async def go() -> list[dict[str, Any]]:
            return list(
                await asyncio.gather(
                    *(
                        lf.one_request(
                            "127.0.0.1",
                            self.lay.gw_port,
                            model,
                            i % 2 == 0,
                            key,
                            self.a.tokens,
                            f"{tag} request {i}: "
                            + " ".join(lf.lora.WORDS[(i + j) % len(lf.lora.WORDS)] for j in range(40)),
                        )
                        for i in range(n)
                    )
                )
            )

        t = time.monotonic()
        return asyncio.run(go()), t

    def probe(self, model: str) -> dict[str, Any]:
        """A greedy completion (PROBE_PROMPT, temperature 0): its text, to compare before a sleep and after the wake."""
        assert self.gw is not None
        t = time.monotonic()
        st, doc = lf.http(
            "POST",
            self.gw_url + "/v1/completions",
            {"model": model, "prompt": PROBE_PROMPT, "max_tokens": PROBE_TOKENS, "temperature": 0},
            self.gw.key,
            timeout=120,
        )
        text = (
            doc["choices"][0].get("text")
            if st == 200 and isinstance(doc, dict) and doc.get("choices")
            else None
        )
        self.count(f"probe {model}", [{"status": st, "kind": "complete" if text is not None else "failed"}])
        return {"status": st, "text": text, "seconds": round(time.monotonic() - t, 3)}

    def load_round(self, model: str, label: str) -> dict[str, Any]:
        """--round-lanes streams for --round-s s through the gateway (lora_fleet.lanes: a new connection per
        request, ignore_eos): output tokens/s."""
        assert self.gw is not None
        t = time.monotonic()
        records, cut = asyncio.run(
            lf.lanes(
                "127.0.0.1",
                self.lay.gw_port,
                self.gw.key,
                self.a.round_lanes,
                lambda i, k: (model, True),
                self.a.tokens,
                self.a.round_s,
                60,
            )
        )
        wall = time.monotonic() - t
        done = [r for r in records if r["kind"] == "complete"]
        ttft = sorted(r["ttft"] for r in done if r.get("ttft") is not None)
        self.count(f"round {label}", records)
        out = {
            "lanes": self.a.round_lanes,
            "seconds": self.a.round_s,
            "wall_s": round(wall, 2),
            "requests": len(records),
            "complete": len(done),
            "cut": cut,
            "by_kind": dict(Counter(r["kind"] for r in records)),
            "out_tok_per_s": round(len(done) * self.a.tokens / wall, 1) if wall else None,
            "ttft_p50_s": lf.pct(ttft, 0.5),
            "ttft_p90_s": lf.pct(ttft, 0.9),
        }
        print(
            f"   round {label}: {out['requests']} requests {out['by_kind']}, {out['out_tok_per_s']} output tok/s, "
            f"TTFT p50 {out['ttft_p50_s']} s",
            flush=True,
        )
        return out

    def first_request(self, model: str) -> dict[str, Any]:
        rec = self.one(model, True, f"the first request for {model}: " + " ".join(lf.lora.WORDS[:40]))
        self.count(f"first {model}", [rec])
        return {k: rec.get(k) for k in ("status", "kind", "ttft", "seconds", "model_ok")}

    # -- 2. launcher A, the gateway

    def start_a(self) -> bool:
        self.step("2. launcher A (level 1), the gateway")
        ia = self.launch(A)
        if not self.wait_ready(ia):
            return False
        ra: dict[str, Any] = {
            "ready_s": round((ia.t_ready or 0) - ia.t0, 2),
            "engine_pid": ia.pid,
            "ready_status": ia.statuses()[-1:],
        }
        print(f"   {A} READY=1 after {ra['ready_s']} s (cold start)", flush=True)
        self.check(f"{A}_ready", True)
        st = self.state(A)
        self.check(
            f"{A}_awake_holding_the_slot",
            st.get("sleep_state") == "awake" and st.get("swap_group") == GROUP,
            {k: st.get(k) for k in ("sleep_state", "sleep_level", "swap_group")},
        )
        self.gw = LabGateway(
            self.lay.render_dir / GW_HOST,
            self.lay.root / "nginx-prefix-sleep",
            self.lay.log / "admission-sleep.log",
            vf=self.lay.root,
            nginx_root=self.lay.nginx_root,
        )
        try:
            self.gw.start(self.lay.gw_port)
        except (RuntimeError, TimeoutError) as exc:
            self.res["gateway_setup"] = self.gw.info
            self.check("gateway_up", False, str(exc)[-1500:])
            return False
        self.res["gateway_setup"] = self.gw.info
        self.check("gateway_up", True)
        ra["first_request"] = self.first_request(A)
        print(f"   first request after the cold start: {ra['first_request']}", flush=True)
        self.check(
            f"{A}_first_request_complete", ra["first_request"]["kind"] == "complete", ra["first_request"]
        )
        ra["probe"] = self.probe(A)
        ra["round_before"] = self.load_round(A, "A before")
        self.res["a"] = ra
        self.memory("a_awake")
        self.save()
        return True

    # -- 3. launcher B: waits for the slot, A yields, then it loads

    def start_b(self) -> bool:
        self.step("3. launcher B (level 2): the slot, A yields, B loads")
        ia = self.insts[A]
        a_from = len(ia.lis.messages)
        ib = self.launch(B)
        ok = self.wait_ready(ib)
        t_ready = ib.t_ready or time.monotonic()
        a_status = [str(f["STATUS"])[:160] for _, f in ia.lis.messages[a_from:] if "STATUS" in f]
        b_status = ib.statuses()
        starting = next(
            (t for t, f in ib.lis.messages if str(f.get("STATUS", "")).startswith("Starting engine")), None
        )
        a_asleep = next(
            (
                t
                for t, f in ia.lis.messages[a_from:]
                if str(f.get("STATUS", "")).startswith("Asleep (level 1)")
            ),
            None,
        )
        log = self.launcher_log(B).read_text(errors="replace")
        took = re.search(r"took slot (\d+) of swap group (\S+) after ([\d.]+)s", log)
        st_a = self.state(A)
        rb: dict[str, Any] = {
            "ready_s": round(t_ready - ib.t0, 2) if ok else None,
            "load_s": round(t_ready - starting, 2) if ok and starting else None,
            "slot_wait_s": float(took.group(3)) if took else None,
            "engine_pid": ib.pid,
            "b_status": b_status[:8],
            "a_status": a_status[:8],
            "a_state": {
                k: st_a.get(k) for k in ("sleep_state", "sleep_level", "sleeps_total", "asleep_since")
            },
        }
        self.res["b"] = rb
        self.check(
            f"{B}_waited_for_the_slot",
            any(s.startswith(f"Waiting for a slot of swap group {GROUP}") for s in b_status),
            b_status[:6],
        )
        self.check(
            f"{A}_yielded_at_level_1",
            st_a.get("sleep_state") == "asleep"
            and st_a.get("sleep_level") == 1
            and st_a.get("sleeps_total") == 1
            and any(
                s.startswith(f"Going to sleep (level 1): a peer of swap group {GROUP} needs the room")
                for s in a_status
            )
            and any(s.startswith("Asleep (level 1)") for s in a_status),
            rb["a_state"] | {"status": a_status[:6]},
        )
        self.check(
            f"{B}_loaded_after_{A}_was_asleep",
            bool(starting and a_asleep and a_asleep <= starting),
            {
                "a_asleep_at": a_asleep and round(a_asleep - ib.t0, 2),
                "b_starting_at": starting and round(starting - ib.t0, 2),
            },
        )
        if not ok:
            return False
        print(
            f"   {B} READY=1 after {rb['ready_s']} s (slot wait {rb['slot_wait_s']} s, load {rb['load_s']} s)",
            flush=True,
        )
        self.check(f"{B}_ready", True)
        self.memory("a_asleep_b_awake")
        rb["first_request"] = self.first_request(B)
        print(f"   first request after the cold start: {rb['first_request']}", flush=True)
        self.check(
            f"{B}_first_request_complete", rb["first_request"]["kind"] == "complete", rb["first_request"]
        )
        rb["probe"] = self.probe(B)
        rb["round_before"] = self.load_round(B, "B before")
        self.save()
        return True

    # -- 4. alternating traffic

    def swap(self, cycle: int, target: str) -> dict[str, Any]:
        """A batch for ``target`` (asleep) through the gateway: the other yields, the target wakes."""
        other = B if target == A else A
        s: dict[str, Any] = {"cycle": cycle, "target": target, "state_before": self.states()}
        t_from = time.monotonic()
        watch = GuardWatch({n: self.engine_url(n) for n in (A, B)})
        records, t_send = self.batch(target, self.a.batch, f"cycle {cycle}")
        s["guards"] = watch.done()
        s["batch"] = batch_summary(records, t_send)
        self.count(f"cycle {cycle} {target}", records)
        deadline = time.monotonic() + 10  # the state file follows the wake at once; the other's sleep is done
        while time.monotonic() < deadline and self.state(other).get("sleep_state") != "asleep":
            time.sleep(0.2)
        s["state_after"] = self.states()
        s["status"] = {n: self.insts[n].statuses(t_from) for n in (A, B)}
        s["wake_seconds"] = s["state_after"][target].get(
            "last_wake_seconds"
        )  # the signal to awake, slot wait included
        s["wake_only_s"] = transition_s(self.insts[target].lis.messages, t_from, "Waking", "Serving")
        s["peer_sleep_s"] = transition_s(self.insts[other].lis.messages, t_from, "Going to sleep", "Asleep")
        if self.lay.local:  # the sim's own reading of its weights (not behind the guard)
            s["sim"] = {n: raw("GET", self.engine_url(n) + "/sim/control")[1] for n in (A, B)}
        pt = self.memory(f"cycle{cycle}_{target}_awake")
        s["memory_used_mib"] = pt.get("used_mib")
        s["verdict"] = {k: v[0] for k, v in swap_verdict(s, target, other, self.levels).items()}
        s["verdict_detail"] = {
            k: v[1] for k, v in swap_verdict(s, target, other, self.levels).items() if not v[0]
        }
        b = s["batch"]
        print(
            f"   cycle {cycle} → {target}: {b['requests']} requests {b['by_status']} {b['by_kind']}; first answer "
            f"{b['first_answer_s']} s; wake {s['wake_seconds']} s ({other} asleep in {s['peer_sleep_s']} s, "
            f"wake alone {s['wake_only_s']} s); held ≤ {s['guards'][target]['max_held']}; "
            f"{other} {s['state_after'][other].get('sleep_state')}",
            flush=True,
        )
        return s

    def cycles(self) -> None:
        self.step("4. alternating traffic")
        swaps: list[dict[str, Any]] = []
        after: dict[str, Any] = {}
        self.res["swaps"] = swaps
        pids = {n: i.pid for n, i in self.insts.items()}
        run = 0
        for c in range(1, self.a.cycles + 1):
            left = self.a.budget_s - self.elapsed()
            last = self.res.get("cycle_s", [0.0])[-1]
            if c > 1 and left < last + RESERVE_S:
                print(
                    f"   cycle {c} not started: {left:.0f} s left, a cycle took {last:.0f} s (+{RESERVE_S:g} s kept)",
                    flush=True,
                )
                break
            tc = time.monotonic()
            for target in (A, B):
                s = self.swap(c, target)
                swaps.append(s)
                if c == 1:  # after the first wake of each: the greedy probe and a round
                    after[target] = {
                        "probe": self.probe(target),
                        "round": self.load_round(target, f"{target} after wake"),
                    }
                self.save()
            run = c
            self.res.setdefault("cycle_s", []).append(round(time.monotonic() - tc, 1))
        self.res["after_wake"] = after
        self.res["cycles_run"] = run
        self.check("all_cycles_run", run == self.a.cycles, {"run": run, "asked": self.a.cycles})
        for k in (
            "every_request_complete_200",
            "held_at_the_guard",
            "peer_yielded_asleep_at_its_level",
            "target_woke_once",
        ):
            bad = {
                f"cycle {s['cycle']} {s['target']}": s["verdict_detail"].get(k)
                for s in swaps
                if not s["verdict"][k]
            }
            self.check(f"swaps_{k}", bool(swaps) and not bad, bad or None)
        for n, before in (("a", self.res.get("a", {})), ("b", self.res.get("b", {}))):
            name = A if n == "a" else B
            aw = after.get(name)
            if not aw:
                continue
            p0, p1 = before.get("probe", {}), aw["probe"]
            aw["probe_same_as_before"] = p0.get("text") is not None and p0.get("text") == p1.get("text")
            if (
                not self.lay.local
            ):  # the sim's text is not a function of the prompt: --local checks its weights
                self.check(
                    f"{name}_greedy_answer_same_after_the_wake",
                    aw["probe_same_as_before"],
                    {"before": p0, "after": p1},
                )
            r0, r1 = before.get("round_before") or {}, aw["round"]
            ratio = (
                round(r1["out_tok_per_s"] / r0["out_tok_per_s"], 3)
                if r0.get("out_tok_per_s") and r1.get("out_tok_per_s")
                else None
            )
            aw["throughput_after_over_before"] = ratio
            self.check(
                f"{name}_rounds_complete",
                r0.get("by_kind") == {"complete": r0.get("requests")}
                and r1["by_kind"] == {"complete": r1["requests"]}
                and r1["requests"] > 0,
                {"before": r0, "after": r1},
            )
        if self.lay.local:
            ok, detail = sim_weights_verdict(swaps, self.levels)
            self.check("level_2_weights_dropped_asleep_reloaded_awake", ok, detail)
        self.check(
            "same_engines_through_the_swaps",
            all(self.state(n).get("engine_pid") == pid for n, pid in pids.items()),
            {n: [pid, self.state(n).get("engine_pid")] for n, pid in pids.items()},
        )
        if run:
            want = expected_counters(run)
            got = {n: {k: self.state(n).get(k) for k in want[n]} for n in want}
            self.check("sleep_and_wake_counters", got == want, {"got": got, "want": want})
        self.save()

    # -- 5. the development endpoints from outside

    def endpoints(self) -> None:
        self.step("5. the development endpoints from outside")
        assert self.gw is not None
        before = {n: raw("GET", self.engine_url(n) + SLEEP_STATE_PATH)[1] for n in (A, B)}
        rows: list[dict[str, Any]] = []
        for n in (A, B):
            for method, path in DEV_ENDPOINTS:
                for label, headers in (
                    ("no token", {}),
                    ("wrong token", {ADMIN_TOKEN_HEADER: "not-the-token"}),
                ):
                    st, body = raw(method, self.engine_url(n) + path, headers)
                    rows.append(
                        {
                            "via": "engine",
                            "instance": n,
                            "method": method,
                            "path": path,
                            "token": label,
                            "status": st,
                            "body": body,
                        }
                    )
        auth = {"Authorization": f"Bearer {self.gw.key}"}
        for method, path in (*DEV_ENDPOINTS, ("GET", SLEEP_STATE_PATH)):
            st, body = raw(method, self.gw_url + path, auth)
            rows.append(
                {
                    "via": "gateway",
                    "method": method,
                    "path": path,
                    "token": "lab key",
                    "status": st,
                    "body": body,
                }
            )
        after = {n: raw("GET", self.engine_url(n) + SLEEP_STATE_PATH)[1] for n in (A, B)}
        self.res["endpoints"] = {"rows": rows, "guard_before": before, "guard_after": after}
        for k, (ok, detail) in endpoint_verdict(rows).items():
            self.check(k, ok, detail)
        same = all(
            isinstance(before[n], dict)
            and isinstance(after[n], dict)
            and before[n].get("state") == after[n].get("state")
            for n in (A, B)
        )
        self.check("guard_state_unchanged_by_them", same, {"before": before, "after": after})
        self.check(
            "guard_sleep_state_public_at_the_engine",
            all(isinstance(after[n], dict) and "state" in after[n] for n in (A, B)),
            after,
        )
        self.save()

    # -- 6. watchdog, liveness, the exporter

    def observe(self) -> None:
        self.step("6. watchdog, liveness, the exporter")
        now = time.monotonic()
        wd = {}
        for n, i in self.insts.items():
            pings = [t for t, f in i.lis.messages if f.get("WATCHDOG") == "1"]
            wd[n] = watchdog_report(pings, i.t_ready or i.t0, now, WATCHDOG_S)
        self.res["watchdog"] = wd
        print(f"   longest ping gaps: { {n: w['max_ping_gap_s'] for n, w in wd.items()} } s", flush=True)
        self.check(
            "watchdog_never_reached_watchdogsec",
            all(not w["systemd_would_kill"] and w["pings"] > 0 for w in wd.values()),
            wd,
        )
        alive: dict[str, dict[str, Any]] = {
            n: {
                "launcher_alive": i.lp is not None and i.lp.poll() is None,
                "ready_count": i.ready_count(),
                "engine_pid": [i.pid, self.state(n).get("engine_pid")],
                "state": self.state(n).get("state"),
            }
            for n, i in self.insts.items()
        }
        self.res["alive"] = alive
        self.check(
            "launchers_alive_one_ready_each_same_engine",
            len(alive) == 2
            and all(
                v["launcher_alive"]
                and v["ready_count"] == 1
                and v["engine_pid"][0] == v["engine_pid"][1]
                and v["engine_pid"][0] is not None
                for v in alive.values()
            ),
            alive,
        )
        r = exporter_once(self.lay)
        states = self.states()
        lines = [
            ln
            for ln in r.stdout.splitlines()
            if re.match(r"vllm_fleet_instance_(sleep|wake|asleep|failed_wake)", ln)
        ]
        self.res["exporter"] = {"rc": r.returncode, "stderr": r.stderr[-1500:], "sleep_lines": lines}
        for ln in lines:
            if "_sleep_state{" not in ln or ln.endswith(" 1.0"):
                print("  ", ln, flush=True)
        for k, (ok, detail) in exporter_verdict(r.stdout, states).items():
            self.check(k, r.returncode == 0 and ok, detail)
        self.check(
            "no_failed_wake",
            all((st.get("failed_wakes_total") or 0) == 0 for st in states.values()),
            {n: [st.get("failed_wakes_total"), st.get("last_wake_failure")] for n, st in states.items()},
        )
        failed = {
            ph: {k: v for k, v in c.items() if k != "200 complete"} for ph, c in self.res["requests"].items()
        }
        failed = {ph: c for ph, c in failed.items() if c}
        total = sum(sum(c.values()) for c in self.res["requests"].values())
        self.res["requests_total"] = total
        self.check("every_request_200_none_failed", total > 0 and not failed, failed or total)
        self.save()

    # -- 7. the stop

    def stop(self) -> None:
        self.step("7. stop")
        running = {n: i for n, i in self.insts.items() if i.lp is not None}
        if not running:
            return
        self.memory("before_stop")
        n_before = {n: len(i.lis.messages) for n, i in running.items()}
        results: dict[str, tuple[int, float]] = {}

        def term(n: str, i: Inst) -> None:
            assert i.lp is not None
            results[n] = stop_launcher(i.lp, 90)

        ts = [threading.Thread(target=term, args=(n, i)) for n, i in running.items()]
        for t in ts:
            t.start()
        for t in ts:
            t.join(120)
        stop = {}
        for n, i in running.items():
            rc, took = results.get(n, (None, None))
            stopping = any(f.get("STOPPING") == "1" for _, f in i.lis.messages[n_before[n] :])
            gone = i.pid is not None and not Path(f"/proc/{i.pid}").exists()
            stop[n] = {
                "rc": rc,
                "seconds": took,
                "stopping": stopping,
                "engine_gone": gone,
                "sleep_state_at_stop": self.state(n).get("sleep_state"),
            }
            i.lp = None
        self.res["stop"] = stop
        print(f"   {stop}", flush=True)
        self.check(
            "stop_exit_0_with_stopping", all(v["rc"] == 0 and v["stopping"] for v in stop.values()), stop
        )
        self.check("engines_exited", all(v["engine_gone"] for v in stop.values()), stop)
        deadline = time.monotonic() + 15  # the engine cores' CUDA contexts go a moment after the launchers
        while (smi := lf.nvidia_smi()).get("apps") and time.monotonic() < deadline:
            time.sleep(1)
        pt = self.memory("after_stop")
        if not self.lay.local:
            self.check("gpu_memory_freed_after_stop", not smi.get("apps"), pt)
            ok, detail = asleep_within_reserve(self.res["memory"])
            self.check("asleep_engine_within_the_plans_reserve", ok, detail)

    def close(self) -> None:
        for i in self.insts.values():
            if i.lp is not None:
                with contextlib.suppress(Exception):
                    stop_launcher(i.lp, 20)  # a `timeout` cut: little time left in the call
        if self.gw is not None:
            with contextlib.suppress(Exception):
                self.gw.stop()
        self.save()
        for i in self.insts.values():
            if i.lis is not None:
                i.lis.close()
        for n in self.insts:
            p = self.launcher_log(n)
            if p.exists():
                self.res.setdefault("kv", {})[n] = kv_tokens(kv_lines(p))
        names = [*(f"launcher-{n}.log" for n in self.insts), "admission-sleep.log", "nginx-error.log"]
        lf.keep_logs(self.lay.log, self.out, names, 400, 500)
        if getattr(self, "spec_path", None) and self.spec_path.exists():
            shutil.copy(self.spec_path, self.out / "spec.yml")

    def steps(self) -> None:
        if self.start_a() and self.start_b():
            self.cycles()
            self.endpoints()
            self.observe()

    def summary(self) -> None:
        summary(self.res)


def summary(res: dict[str, Any]) -> None:
    print("=== sleep-fleet summary", flush=True)
    print(f"{res['mode']}; wall {res.get('wall_s')} s; engines on {res.get('address')}")
    for key, name, level in (("a", A, 1), ("b", B, 2)):
        r = res.get(key) or {}
        first = (r.get("first_request") or {}).get("ttft")
        tok = (r.get("round_before") or {}).get("out_tok_per_s")
        wait = f" (slot wait {r.get('slot_wait_s')} s, load {r.get('load_s')} s)" if key == "b" else " (cold)"
        print(
            f"{name} (level {level}): READY after {r.get('ready_s')} s{wait}; first TTFT {first} s; {tok} tok/s"
        )
    for s in res.get("swaps") or []:
        bt = s["batch"]
        print(
            f"cycle {s['cycle']} → {s['target']}: first answer {bt['first_answer_s']} s, wake "
            f"{s['wake_seconds']} s (peer asleep in {s.get('peer_sleep_s')} s, wake alone {s.get('wake_only_s')} s), "
            f"{bt['by_status']}" + (f", GPU {s['memory_used_mib']} MiB" if s.get("memory_used_mib") else "")
        )
    for n, aw in (res.get("after_wake") or {}).items():
        print(
            f"{n} after its first wake: {aw['round'].get('out_tok_per_s')} tok/s "
            f"(x{aw.get('throughput_after_over_before')} of before)"
        )
    mem = {k: v.get("used_mib") for k, v in (res.get("memory") or {}).items() if "used_mib" in v}
    if mem:
        print(f"GPU memory used (MiB): {mem}")
    print(f"requests {res.get('requests_total')}; stop {res.get('stop')}")
    passed = len(res["checks"]) - len(res.get("failed_checks", []))
    print(f"checks {passed}/{len(res['checks'])} passed; failed: {res.get('failed_checks')}", flush=True)


def parse(argv: list[str]) -> argparse.Namespace:
    local = "--local" in argv
    env = os.environ.get
    ap = argparse.ArgumentParser(
        prog="sleep_fleet.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("out", type=Path)
    ap.add_argument("--local", action="store_true", help="the sim engine and this machine's nginx (no GPU)")
    ap.add_argument(
        "--token-delay", type=float, default=0.01, help="--local: the sim engine's seconds per step"
    )
    ap.add_argument(
        "--cycles", type=int, default=int(env("VF_CYCLES", "3")), help="A then B, this many times"
    )
    ap.add_argument(
        "--batch",
        type=int,
        default=int(env("VF_BATCH", "8" if local else "16")),
        help="requests at once per swap, every other one streamed",
    )
    ap.add_argument("--tokens", type=int, default=int(env("VF_TOKENS", "16" if local else "128")))
    ap.add_argument("--round-lanes", type=int, default=int(env("VF_ROUND_LANES", "8" if local else "64")))
    ap.add_argument("--round-s", type=float, default=float(env("VF_ROUND_S", "2" if local else "10")))
    ap.add_argument(
        "--ready-timeout", type=float, default=float(env("VF_READY_TIMEOUT", "60" if local else "300"))
    )
    ap.add_argument(
        "--budget-s",
        type=float,
        default=float(env("VF_BUDGET_S", "540")),
        help="the call's seconds: a cycle is started only with room left for it and the rest",
    )
    return ap.parse_args(argv)


def layout(a: argparse.Namespace) -> Layout:
    address = non_loopback_ipv4()
    if not a.local:
        if address is None:
            raise SystemExit("no non-loopback IPv4 address on this machine: the engines listen there")
        return Layout(VF, local=False, address=address)
    # a short folder: the admission service's unix sockets live under it (at most 107 bytes a path)
    root = Path(tempfile.mkdtemp(prefix="vf-sleep-", dir="/tmp"))
    return Layout(
        root,
        local=True,
        address=address or "127.0.0.1",
        ports={A: lf.free_port(), B: lf.free_port()},
        gw_port=lf.free_port(),
        stub_port=lf.free_port(),
        admission_metrics_port=lf.free_port(),
        nginx_root=Path("/"),
    )


if __name__ == "__main__":
    # SIGTERM (`timeout` at the end of the call): the finally blocks stop the launchers and write the results
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args = parse(sys.argv[1:])
    lay = layout(args)
    try:
        rc = Run(args.out, args, lay).main()
    finally:
        if lay.local:
            shutil.rmtree(lay.root, ignore_errors=True)
    sys.exit(rc)
