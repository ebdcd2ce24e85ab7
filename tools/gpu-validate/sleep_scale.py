"""Sleep mode at fleet scale (issue 33; docs/gpu-validation.md, "Sleep mode at fleet scale (sleep_scale.py)"):
many sleeping models in several swap groups under random traffic, through the parts a host and a gateway run.
sleep_fleet.py took two models through alternating swaps; this one takes ``--models`` (12) models, each one
instance with a served name of its own, in ``--groups`` (3) swap groups of one GPU each (``max_awake`` 2), under
``--lanes`` (16) clients that pick a model with a Zipf skew (a few hot models, a long cold tail) for
``--seconds`` (90).

  sleep_scale.py OUT --local  the sim engine (vllm_fleet/devtools/sim_engine.py: vLLM's sleep mode, its
                              --sim-sleep-seconds and --sim-wake-seconds) in vLLM's place, this machine's nginx,
                              everything under a temporary folder on free ports: no GPU.
  sleep_scale.py OUT          the device mode: vLLM under the launchers on the H200 (what `run-device.sh install`
                              left under /root/vf: the carried vLLM, nginx, make_model.py's Qwen3-8B-shaped folder
                              with dummy weights), every model at level 1 (vLLM reloads no dummy weights, so no
                              level 2), one swap group on the one GPU: ``--models`` 4, ``--groups`` 1, ``--max-awake``
                              2 unless given; the GPU's memory read at each step (an asleep engine within the plan's
                              reserve); the spec's GPU as nvidia-smi names it and
                              its memory (an H100 too). `run-device.sh sleep-scale OUT`.

  1. the spec: h200-sleep.yml's shape (a gpu-profile host, its GPUs written out: ``--groups`` of them) with the
     models spread over the groups (model i in group i mod G, so the hottest ones land in different groups), every
     one sleeping after the spec's least ``idle_seconds``, the last ``--level2-groups`` group(s) at level 2 (the
     launcher's wake reloads the weights: /collective_rpc reload_weights), each model's
     ``gpu_memory_utilization`` the most the plan's GPU rule allows; rendered and planned (``--lock-dir ''
     --allow-unchecked-flags``); ``--replicas K``: the K hottest models get a second instance in the next group
     (then a route sleeps and the render has the sleep watch);
  2. every launcher at once (sd_notify through NOTIFY_SOCKETs we own, WATCHDOG_USEC = WatchdogSec): a group's
     members beyond ``max_awake`` wait for a slot and ask a ready peer to yield; all READY; the sampler runs from
     here on: every 50 ms each launcher's state file (``sleep_state`` and the counters) and each swap group's slot
     files (which are held: swap_group.Slots.holders);
  3. the rendered gateway (measure.LabGateway: the admission service, nginx with the njs router) and, when the
     render has it, ``vllm-fleet sleepwatch`` on its rendered config (its file moved under the lab's root);
  4. traffic: the lanes (lora_fleet.lanes: one request after another, each a chat completion on a new
     connection, every other one streamed); each record says its status, whether it is complete (a stream up to
     [DONE]), its time to the first byte and in all; a request counts as held for a wake when no instance of its
     model stayed awake (the state files' samples) from its sending to its first byte;
  5. settle: every instance asleep again within idle_seconds after the last request;
  6. the launchers alive with one READY each and the same engine, the watchdog pings, the counters (wakes and
     sleeps happened, no failed wake), ``vllm-fleet exporter --once --no-nvml`` against the state files;
  7. SIGTERM to every launcher: exit 0.
  OUT/sleep-scale-results.json (written after every step), the logs, a summary table. Exit 0 when every check
  passed.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for p in (REPO, HERE, REPO / "tools"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))
# the siblings: sleep_fleet.py's lab (its Layout, Run: the launchers, READY, the stop, the logs; its exporter
# verdict), lora_fleet.py's client (lanes, the outcome of an answer, percentiles), churn.py's watchdog report,
# measure.py's render flags and gateway
import lora_fleet as lf  # noqa: E402
import sleep_fleet as sf  # noqa: E402
from churn import watchdog_report  # noqa: E402
from measure import LAB, LabGateway, vf_cli  # noqa: E402

from vllm_fleet.contracts import ASLEEP_GPU_GIB, SLEEPWATCH_CONFIG_FILE  # noqa: E402
from vllm_fleet.fleet.spec import SleepSettings  # noqa: E402
from vllm_fleet.host.swap_group import group_dir  # noqa: E402

# h200-sleep.yml: the shape (paths, the GPU host and its GPU, the gateway host, a model's fields)
SPEC = sf.SPEC
GPU_HOST, GW_HOST = sf.GPU_HOST, sf.GW_HOST
WATCHDOG_S = sf.WATCHDOG_S
SAMPLE_S = 0.05  # the sampler's period
MAX_UTILIZATION = 0.85  # a group no bigger than max_awake: each model's share as h200-sleep.yml's
# the spec's least idle_seconds (models[].sleep.idle_seconds' lower bound)
LEAST_IDLE_S = min(int(getattr(m, "ge", 10**9)) for m in SleepSettings.model_fields["idle_seconds"].metadata)
AWAKE_LIKE = ("awake", "waking")  # what holds (or is about to hold) GPU memory of its group
SETTLE_EXTRA_S = 15.0  # after idle_seconds: the guard poll (1 s), a sleep, the state file
RESULTS = "sleep-scale-results.json"
# the device (one H200): one swap group of 4 Qwen3-8B-shaped models, 2 awake (0.47 of the GPU each: the plan's
# rule with 2 sleepers' reserve), every one at level 1 (dummy weights), answers of 64 tokens, vLLM's starts (a
# cold one compiles; a slot's wait includes a peer's first sleep, 12 s) within one call of 570 s
DEVICE_DEFAULTS: dict[str, Any] = {
    "models": 4,
    "groups": 1,
    "max_awake": 2,
    "level2_groups": 0,
    "tokens": 64,
    "max_num_seqs": 64,
    "ready_timeout": 330.0,
    "drain_s": 60.0,
    "budget_s": 570.0,
}


# ---- the fleet's shape (pure: tests/unit/test_sleep_scale.py)


@dataclass(frozen=True)
class Member:
    """One instance: its name, the model it serves (the Zipf rank is the model's index), its swap group."""

    name: str
    served: str
    rank: int  # 0: the hottest model
    group: str
    gpu: int
    level: int


def model_name(i: int) -> str:
    return f"m{i:02d}"


def members(models: int, groups: int, replicas: int = 0, level2_groups: int = 1) -> list[Member]:
    """Model i in group ``gpu{i mod groups}`` (on GPU i mod groups), the last ``level2_groups`` groups at level 2;
    the ``replicas`` hottest models get a second instance (``mNN-b``) in the next group."""
    levels = [2 if g >= groups - level2_groups else 1 for g in range(groups)]

    def one(name: str, i: int, g: int) -> Member:
        return Member(name, model_name(i), i, f"gpu{g}", g, levels[g])

    out = [one(model_name(i), i, i % groups) for i in range(models)]
    out += [one(f"{model_name(i)}-b", i, (i + 1) % groups) for i in range(min(replicas, models))]
    return out


def group_members(ms: list[Member]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for m in ms:
        out.setdefault(m.group, []).append(m.name)
    return {g: sorted(v) for g, v in sorted(out.items())}


def utilization(n_members: int, max_awake: int, gpu_gib: float) -> float:
    """The largest equal ``gpu_memory_utilization`` the plan lets ``n_members`` models of one swap group take on
    a GPU of ``gpu_gib`` (docs/sleep.md: the ``max_awake`` largest + the others' ASLEEP_GPU_GIB each ≤ 1),
    rounded down to a hundredth, at most MAX_UTILIZATION."""
    awake = min(n_members, max_awake)
    room = 1.0 - max(0, n_members - max_awake) * ASLEEP_GPU_GIB / gpu_gib
    return min(MAX_UTILIZATION, math.floor(room / awake * 100) / 100)


def spec_data(
    base: dict[str, Any], lay: Layout, ms: list[Member], max_awake: int, max_num_seqs: int
) -> dict[str, Any]:
    """h200-sleep.yml moved to ``lay`` with ``ms`` as its models: the GPU host with one GPU per group (the base's
    GPU written out that many times), a model entry each from the base's level-1 one (its level, group, GPU,
    port, ``max_num_seqs``; the least idle_seconds; the default wake_wait_seconds), the swap groups. Local: the
    host's memory as 1 TiB (the sim holds no weights); the device: the base's (the plan checks that the sleepers'
    level-1 weights fit it)."""
    d: dict[str, Any] = lf.retarget(json.loads(json.dumps(base)), str(sf.VF), str(lay.root))
    groups = group_members(ms)
    gpu: dict[str, Any] = {}
    for h in d["hosts"]:
        if h["name"] == GPU_HOST:
            h["address"] = lay.address
            h["gpus"]["count"] = len(groups)
            gpu = h["gpus"]
            if lay.local:
                h["memory_gib"] = max(h.get("memory_gib") or 0, 1024)  # the lab's: the sim holds no weights
    template = next(m for m in d["models"] if m["sleep"]["level"] == 1)
    out = []
    for m in ms:
        e = json.loads(json.dumps(template))
        e.update(name=m.name, served_model_name=m.served, gpus=[m.gpu], port=lay.ports[m.name])
        e["source"] = {"path": str(lay.model)}
        e["max_num_seqs"] = max_num_seqs
        e["gpu_memory_utilization"] = utilization(len(groups[m.group]), max_awake, float(gpu["memory_gib"]))
        e["sleep"] = {"level": m.level, "idle_seconds": LEAST_IDLE_S, "group": m.group}
        if m.level == 2:  # as h200-sleep.yml's level-2 model: vLLM reloads no dummy weights
            e.pop("extra_args", None)
        out.append(e)
    d["models"] = out
    d["swap_groups"] = {g: {"max_awake": max_awake} for g in groups}
    gw = d["gateway"]
    gw["port"], gw["stub_status_port"] = lay.gw_port, lay.stub_port
    gw["limits"]["metrics_port"] = lay.admission_metrics_port
    return d


# ---- the traffic's skew (pure)


def zipf_weights(n: int, s: float) -> list[float]:
    """P(rank r) ∝ 1 / r^s, r = 1..n (normalized)."""
    w = [1.0 / (r**s) for r in range(1, n + 1)]
    total = sum(w)
    return [x / total for x in w]


class Picker:
    """A model index for request ``k`` of lane ``lane``: Zipf(``s``) over ``n`` ranks, the same for the same seed
    (each (lane, k) its own draw: the order in which lanes run does not change what each one asks)."""

    def __init__(self, n: int, s: float, seed: int) -> None:
        self.seed = seed
        self.cum: list[float] = []
        acc = 0.0
        for x in zipf_weights(n, s):
            acc += x
            self.cum.append(acc)

    def pick(self, lane: int, k: int) -> int:
        u = random.Random(f"{self.seed}/{lane}/{k}").random()
        return min(len(self.cum) - 1, bisect.bisect_right(self.cum, u * self.cum[-1]))


# ---- the verdicts (pure)


def spread(xs: list[float]) -> dict[str, Any]:
    """n, p50, p95 (lora_fleet.pct: the nearest rank) and max."""
    return {
        "n": len(xs),
        "p50": lf.pct(xs, 0.5),
        "p95": lf.pct(xs, 0.95),
        "max": round(max(xs), 3) if xs else None,
    }


def request_class(r: dict[str, Any]) -> str:
    """``ok``: a complete 200 (a stream up to [DONE], a plain answer with content) naming the model asked;
    ``refused``: a 429 or 503 with a JSON error and Retry-After (docs/sleep.md: a failed or too long wake's
    answer, the gateway's own when nothing can take it); ``failed``: anything else (a 200 carrying an error, a
    5xx without Retry-After, a cut stream, no answer)."""
    if r.get("kind") == "complete":
        return "ok" if r.get("model_ok") else "failed"
    if r.get("kind") == "refused" and r.get("retry_after") and r.get("json_error"):
        return "refused"
    return "failed"


def ttfb_of(r: dict[str, Any]) -> float | None:
    """Seconds from sending to the answer's first byte: a stream's first event; a plain answer comes whole (its
    Content-Length body), so its whole time. None without an answer."""
    if r["stream"]:
        return r["first_byte_at"] - r["start"] if r.get("first_byte_at") and r.get("start") else None
    return float(r["seconds"]) if r.get("status") is not None and r.get("seconds") is not None else None


def request_verdict(records: list[dict[str, Any]], cut: int) -> dict[str, Any]:
    classes = Counter(request_class(r) for r in records)
    bad = [r for r in records if request_class(r) == "failed"]
    return {
        "requests": len(records),
        "ok": classes.get("ok", 0),
        "refused_with_retry_after": classes.get("refused", 0),
        "failed": len(bad),
        "cut": cut,
        "by_status": {
            str(k): v for k, v in sorted(Counter(r.get("status") for r in records).items(), key=str)
        },
        "refusals": lf.refusal_counts(records),
        "failures": dict(
            Counter(
                f"{r.get('status')} {r.get('kind')}: {str(r.get('detail'))[:120]}" for r in bad
            ).most_common(10)
        ),
        "failed_examples": [
            {k: r.get(k) for k in ("model", "stream", "status", "kind", "detail", "t", "seconds")}
            for r in bad[:10]
        ],
    }


# a sample: (monotonic time, instance → its state file's keys, swap group → its slot holders)
Sample = tuple[float, dict[str, dict[str, Any]], dict[str, list[str]]]


def group_peaks(
    samples: list[Sample], groups: dict[str, list[str]], max_awake: int
) -> dict[str, dict[str, Any]]:
    """Per swap group over the samples: the most slot holders and the most members awake or waking (the state
    files) at once, the samples where either was above ``max_awake`` (their times and who), and how often a
    member awake or waking held no slot as read in the same sample (a read race, or a defect)."""
    out: dict[str, dict[str, Any]] = {}
    for g, names in groups.items():
        peak_h = peak_a = 0
        over: list[dict[str, Any]] = []
        unslotted = 0
        for t, states, holders in samples:
            h = holders.get(g, [])
            a = [n for n in names if (states.get(n) or {}).get("sleep_state") in AWAKE_LIKE]
            peak_h, peak_a = max(peak_h, len(h)), max(peak_a, len(a))
            if len(h) > max_awake or len(a) > max_awake:
                over.append({"t": round(t, 3), "holders": h, "awake_or_waking": a})
            unslotted += sum(1 for n in a if n not in h)
        out[g] = {
            "max_slot_holders": peak_h,
            "max_awake_or_waking": peak_a,
            "over": over[:20],
            "over_samples": len(over),
            "awake_without_slot_samples": unslotted,
        }
    return out


def timelines(samples: list[Sample]) -> dict[str, list[tuple[float, str]]]:
    """Each instance's sleep_state changes over the samples: [(t, state)], the first sample's state first."""
    out: dict[str, list[tuple[float, str]]] = {}
    for t, states, _ in samples:
        for n, st in states.items():
            s = str(st.get("sleep_state"))
            line = out.setdefault(n, [])
            if not line or line[-1][1] != s:
                line.append((t, s))
    return out


def stayed_awake(line: list[tuple[float, str]], t0: float, t1: float) -> bool:
    """The instance was awake at the last sample at or before ``t0`` and no sample up to ``t1`` said otherwise."""
    i = bisect.bisect_right([t for t, _ in line], t0) - 1
    if i < 0 or line[i][1] != "awake":
        return False
    return all(s == "awake" for t, s in line[i + 1 :] if t <= t1)


def was_held(lines: dict[str, list[tuple[float, str]]], instances: list[str], t0: float, t1: float) -> bool:
    """A request for a model served by ``instances``, sent at ``t0``, its first byte at ``t1``: held for a wake
    when none of them stayed awake in between (the guard holds a request only while its engine is not awake)."""
    return not any(stayed_awake(lines.get(n, []), t0, t1) for n in instances)


def wake_durations(samples: list[Sample]) -> tuple[dict[str, list[float]], int]:
    """Each wake's seconds as the state files said (``last_wake_seconds`` when ``wakes_total`` went up), per
    instance; and how many wakes the samples missed (two wakes of one instance between two samples)."""
    out: dict[str, list[float]] = {}
    seen: dict[str, int] = {}
    missed = 0
    for _, states, _ in samples:
        for n, st in states.items():
            w = int(st.get("wakes_total") or 0)
            before = seen.get(n, 0)
            if w > before and isinstance(st.get("last_wake_seconds"), int | float):
                out.setdefault(n, []).append(float(st["last_wake_seconds"]))
                missed += w - before - 1
            seen[n] = max(before, w)
    return out, missed


def sleep_reasons(statuses: list[str]) -> dict[str, int]:
    """A launcher's STATUS lines: its sleeps by why (``peer``: a peer of its swap group needed the room, i.e. it
    was evicted; ``idle``), and the sleeps it started that the guard refused (a request slipped in)."""
    out = {"peer": 0, "idle": 0, "refused": 0}
    pending = ""
    for s in statuses:
        if s.startswith("Going to sleep"):
            pending = "peer" if "needs the room" in s else "idle"
        elif pending and s.startswith("Asleep ("):
            out[pending] += 1
            pending = ""
        elif pending and s.startswith("Serving"):
            out["refused"] += 1  # the guard's 409: still awake
            pending = ""
    return out


def spans(messages: list[tuple[float, dict[str, str]]], start: str, end: str) -> list[float]:
    """Every span from a STATUS starting with ``start`` to the next one starting with ``end`` (a launcher's notify
    messages, in order): e.g. "Waking" → "Serving", each wake alone (no slot wait); "Going to sleep" → "Asleep",
    each sleep (one the guard refused, "Going to sleep" → "Serving", is none)."""
    out, t0 = [], None
    for t, f in messages:
        st = f.get("STATUS")
        if st is None:
            continue
        if st.startswith(start):
            t0 = t
        elif t0 is not None and st.startswith(end):
            out.append(round(t - t0, 3))
            t0 = None
        elif t0 is not None and not st.startswith(start) and st.startswith(("Serving", "Asleep")):
            t0 = None  # the transition ended otherwise
    return out


def exporter_counts_verdict(text: str, states: dict[str, dict[str, Any]]) -> tuple[bool, Any]:
    """The exporter's sleeps_total, wakes_total and failed_wakes_total of every instance equal to its state
    file's."""
    got: dict[str, dict[str, tuple[float | None, Any]]] = {}
    bad: dict[str, dict[str, tuple[float | None, Any]]] = {}
    for name, st in states.items():
        row: dict[str, tuple[float | None, Any]] = {}
        for k in ("sleeps_total", "wakes_total", "failed_wakes_total"):
            vals = [
                v for lb, v in sf.prom_series(text, "vllm_fleet_instance_" + k) if lb.get("instance") == name
            ]
            row[k] = (vals[0] if len(vals) == 1 else None, st.get(k))
            if row[k][0] is None or row[k][0] != float(st.get(k) or 0):
                bad[name] = row
        got[name] = row
    seen = {n: {k: v[0] for k, v in r.items()} for n, r in got.items()}
    return bool(states) and not bad, bad or seen


# ---- the lab


@dataclass
class Layout(sf.Layout):
    ports: dict[str, int] = field(default_factory=dict)

    @property
    def model(self) -> Path:
        return self.root / "models" / "qwen3-8b"

    @property
    def render_dir(self) -> Path:
        return self.root / "render-scale"

    @property
    def asleep_file(self) -> Path:
        return self.root / "run-sleepwatch" / "asleep.json"


def make_local_lab(lay: Layout, token_delay: float, sleep_s: float, wake_s: float) -> dict[str, Any]:
    """--local: the Qwen3-8B config as the models' folder (the sim engine reads no weights; the plan reads the
    config) and the spec's engine command as a script that runs the sim engine with the rendered arguments."""
    lay.model.mkdir(parents=True, exist_ok=True)
    shutil.copy(REPO / "vllm_fleet/data/qwen3-8b-config.json", lay.model / "config.json")
    sim = f"--sim-token-delay {token_delay} --sim-sleep-seconds {sleep_s} --sim-wake-seconds {wake_s}"
    lf.sim_engine_script(lay.root, "sleep_scale.py", sim)
    return {"engine": f"sim engine: {sim}", "weights": "none (the sim reads none)"}


def device_gpu(line: str) -> dict[str, Any]:
    """nvidia-smi's ``name, memory.total`` (MiB, no units) of the first GPU → the spec's ``gpus.model`` and
    ``gpus.memory_gib`` (rounded down to a tenth)."""
    name, mib = (x.strip() for x in line.strip().splitlines()[0].rsplit(",", 1))
    return {"model": name, "memory_gib": math.floor(int(mib) / 1024 * 10) / 10}


def make_device_lab(lay: Layout) -> dict[str, Any]:
    """The device: what ``run-device.sh install`` left (make_model.py's folder, the carried vLLM behind the spec's
    ``$venv/bin/vllm``), on a GPU nothing else uses (each model's share is sized for its group alone)."""
    lf.require_free_gpu()
    sf.require_install(lay.model)
    return {"engine": "vLLM (run-device.sh install)", "weights": "dummy (make_model.py's folder)"}


def flock_writers(locks: str) -> dict[str, int]:
    """``/proc/locks``: the file (``MAJ:MIN:INODE``) of every exclusive flock held → its holder's pid (a waiter's
    ``->`` line holds nothing)."""
    out = {}
    for ln in locks.splitlines():
        f = ln.split()
        if len(f) >= 6 and f[1] == "FLOCK" and f[3] == "WRITE" and f[4].isdigit():
            out[f[5]] = int(f[4])
    return out


def file_key(path: Path) -> str:
    """A file as ``/proc/locks`` names it: ``MAJ:MIN:INODE`` (major and minor in hex)."""
    st = path.stat()
    return f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"


def pings_of(i: sf.Inst) -> list[float]:
    """When a launcher sent WATCHDOG=1 (monotonic)."""
    return [t for t, f in i.lis.messages if f.get("WATCHDOG") == "1"] if i.lis else []


def proc_facts(pid: int) -> dict[str, Any]:
    """A live process's state as the kernel tells it: each thread's wait channel (``futex_wait_queue``: a lock),
    its state and signal masks (pending, blocked, caught)."""
    out: dict[str, Any] = {}
    with contextlib.suppress(OSError):
        status = Path(f"/proc/{pid}/status").read_text().splitlines()
        out["status"] = [
            ln for ln in status if ln.startswith(("State", "SigPnd", "ShdPnd", "SigBlk", "SigCgt"))
        ]
        out["wchan"] = {
            t: (Path(f"/proc/{pid}/task/{t}/wchan").read_text() or "-")
            for t in sorted(os.listdir(f"/proc/{pid}/task"))
        }
    return out


class Sampler:
    """Every SAMPLE_S: each launcher's state file and each swap group's slot holders. A slot's holder is read
    from the kernel's lock table (``/proc/locks``), not by trying the lock as ``swap_group.Slots.holders`` does:
    a reader's shared lock, however short, can make a launcher's ``LOCK_NB`` take of that slot fail (the
    observer would cause yields). ``owners``: launcher pid → instance (filled as the launchers start)."""

    def __init__(self, state_dir: Path, groups: dict[str, list[str]], owners: dict[int, str]) -> None:
        self.state_dir, self.groups, self.owners = state_dir, groups, owners
        self.samples: list[Sample] = []
        self.gaps: list[float] = []
        self.ev = threading.Event()
        self.t = threading.Thread(target=self.run, daemon=True)
        self.t.start()

    def holders(self, writers: dict[str, int]) -> dict[str, list[str]]:
        out = {}
        for g in self.groups:
            held = []
            for f in sorted(group_dir(self.state_dir, g).glob("slot-*.lock")):
                with contextlib.suppress(OSError):
                    pid = writers.get(file_key(f))
                    if pid is not None:
                        held.append(self.owners.get(pid, f"pid {pid}"))
            out[g] = sorted(held)
        return out

    def run(self) -> None:
        keys = (
            "state",
            "sleep_state",
            "wakes_total",
            "sleeps_total",
            "failed_wakes_total",
            "last_wake_seconds",
        )
        names = [n for ns in self.groups.values() for n in ns]
        while not self.ev.is_set():
            t = time.monotonic()
            holders = self.holders(flock_writers(Path("/proc/locks").read_text()))
            states = {}
            for n in names:
                st = lf.read_json(self.state_dir / f"{n}.json")
                if st is not None:
                    states[n] = {k: st.get(k) for k in keys}
            if self.samples:
                self.gaps.append(t - self.samples[-1][0])
            self.samples.append((t, states, holders))
            self.ev.wait(max(0.0, SAMPLE_S - (time.monotonic() - t)))

    def stop(self) -> None:
        self.ev.set()
        self.t.join(5)


class Run(sf.Run):
    results_file = RESULTS
    notify_kept = 300
    detail_chars = 800

    def __init__(self, out: Path, a: argparse.Namespace, lay: Layout) -> None:
        super().__init__(out, a, lay)
        self.lay: Layout = lay
        self.res["mode"] = (
            "local (sim engine, this machine's nginx)" if lay.local else "device (vLLM under the launchers)"
        )
        self.ms = members(a.models, a.groups, a.replicas, a.level2_groups)
        self.groups = group_members(self.ms)
        self.levels = {m.name: m.level for m in self.ms}
        self.sampler: Sampler | None = None
        self.watch: subprocess.Popen[bytes] | None = None
        self.t_traffic: tuple[float, float] | None = None
        self.records: list[dict[str, Any]] = []

    def states(self) -> dict[str, dict[str, Any]]:
        return {m.name: self.state(m.name) for m in self.ms}

    # -- 1. the spec, render, plan

    def prepare(self) -> None:
        import yaml

        self.step("1. spec, render, plan")
        lay, a = self.lay, self.a
        self.res["models"] = (
            make_local_lab(lay, a.token_delay, a.sim_sleep_s, a.sim_wake_s)
            if lay.local
            else make_device_lab(lay)
        )
        self.res["fleet"] = {
            "members": [m.__dict__ for m in self.ms],
            "groups": self.groups,
            "max_awake": a.max_awake,
            "idle_seconds": LEAST_IDLE_S,
        }
        base = yaml.safe_load(SPEC.read_text())
        if not lay.local:  # the spec's GPU as this machine's (an H100's 80 GiB sizes the shares as it should)
            gpu = device_gpu(lf.nvidia_smi_gpu())
            self.res["gpu"] = gpu
            next(h for h in base["hosts"] if h["name"] == GPU_HOST)["gpus"].update(gpu)
        self.spec = spec_data(base, lay, self.ms, a.max_awake, a.max_num_seqs)
        self.spec_path = lay.root / "sleep-scale-spec.yml"
        self.spec_path.write_text(yaml.safe_dump(self.spec, sort_keys=False))
        shutil.rmtree(lay.render_dir, ignore_errors=True)
        r = vf_cli("render", str(self.spec_path), "--out", str(lay.render_dir), *LAB)
        if r.returncode:
            raise sf.RunStop(f"render failed: {r.stdout[-2000:]}{r.stderr[-2000:]}")
        dest = lay.etc / "instances"
        dest.mkdir(parents=True, exist_ok=True)
        configs = {}
        for m in self.ms:
            src = lay.rendered(GPU_HOST, lay.etc / "instances" / f"{m.name}.json")
            shutil.copy(src, dest / f"{m.name}.json")
            cfg = json.loads(src.read_text())
            configs[m.name] = {k: cfg.get(k) for k in ("command", "sleep")}
        rc, _, err = lf.cli_json("plan", str(self.spec_path), "--json", *LAB)
        text = vf_cli("plan", str(self.spec_path), *LAB).stdout
        lines = [ln.strip() for ln in text.splitlines() if "swap group" in ln and " on " in ln]
        self.res["plan"] = {"rc": rc, "stderr": err, "swap_group_lines": lines}
        for ln in lines:
            print("   plan:", ln, flush=True)
        self.check(
            "plan_ok_with_every_swap_group",
            rc == 0 and all(any(ln.startswith(f"swap group {g} on ") for ln in lines) for g in self.groups),
            self.res["plan"],
        )
        bad = {}
        for m in self.ms:
            c, s = configs[m.name]["command"], configs[m.name]["sleep"] or {}
            peers = sorted(n for n in self.groups[m.group] if n != m.name)
            if not (
                "--enable-sleep-mode" in c
                and "vllm_fleet.host.sleep_guard.SleepGuard" in c
                and (s.get("level"), s.get("group"), s.get("max_awake")) == (m.level, m.group, a.max_awake)
                and s.get("group_members") == peers
                and s.get("idle_seconds") == LEAST_IDLE_S
            ):
                bad[m.name] = s
        self.check("rendered_engines_sleep_in_their_groups", not bad, bad or None)
        watch_cfg = lay.rendered(GW_HOST, Path(SLEEPWATCH_CONFIG_FILE))
        self.res["sleepwatch_rendered"] = watch_cfg.exists()
        # docs/sleep.md: the watch is rendered when some model has two or more instances and one sleeps
        self.check(
            "sleepwatch_rendered_when_a_model_has_replicas",
            watch_cfg.exists() == (a.replicas > 0),
            {"rendered": watch_cfg.exists(), "replicas": a.replicas},
        )
        self.save()

    # -- 2. the launchers

    def start_all(self) -> bool:
        self.step(f"2. {len(self.ms)} launchers at once")
        owners: dict[int, str] = {}
        self.sampler = Sampler(self.lay.state_dir, self.groups, owners)
        t0 = time.monotonic()
        for m in self.ms:
            lp = self.launch(m.name).lp
            assert lp is not None
            owners[lp.pid] = m.name
        ready = {m.name: self.wait_ready(self.insts[m.name]) for m in self.ms}
        took = {n: round((i.t_ready or t0) - t0, 2) for n, i in self.insts.items()}
        print(f"   READY after (s): {took}", flush=True)
        self.check(
            "every_launcher_ready", all(ready.values()), {n: v for n, v in ready.items() if not v} or None
        )
        starts: dict[str, Any] = {}
        waited_ok = True
        for g, names in self.groups.items():
            waited = [
                n
                for n in names
                if any(
                    s.startswith(f"Waiting for a slot of swap group {g}") for s in self.insts[n].statuses()
                )
            ]
            yielded = {n: sleep_reasons(self.insts[n].statuses())["peer"] for n in names}
            starts[g] = {
                "waited_for_a_slot": waited,
                "yielded_for_a_start": {n: k for n, k in yielded.items() if k},
                "ready_s": {n: took[n] for n in names},
            }
            waited_ok &= len(waited) == max(0, len(names) - self.a.max_awake)
        self.res["starts"] = starts
        for g, s in starts.items():
            print(
                f"   {g}: waited for a slot {s['waited_for_a_slot']}; yielded for them {s['yielded_for_a_start']}",
                flush=True,
            )
        self.check("members_beyond_max_awake_waited_for_a_slot", waited_ok, starts)
        self.memory("after_the_starts")  # the device: each engine's share (a sleeper's within the reserve)
        self.save()
        return all(ready.values())

    # -- 3. the gateway and the sleep watch

    def gateway(self) -> bool:
        self.step("3. the gateway" + (" and the sleep watch" if self.res.get("sleepwatch_rendered") else ""))
        lay = self.lay
        gw_root = lay.render_dir / GW_HOST
        if self.res.get("sleepwatch_rendered"):
            # the watch writes under the lab's root (as test_gateway_sleep.py's): its config's output and the
            # router's routes.json asleep_file moved there
            lay.asleep_file.parent.mkdir(parents=True, exist_ok=True)
            cfg_path = lay.rendered(GW_HOST, Path(SLEEPWATCH_CONFIG_FILE))
            cfg = json.loads(cfg_path.read_text())
            moved = {"from": cfg["output"], "to": str(lay.asleep_file)}
            cfg["output"] = str(lay.asleep_file)
            cfg_path.write_text(json.dumps(cfg, indent=2))
            for routes in gw_root.rglob("routes.json"):
                doc = json.loads(routes.read_text())
                if doc.get("asleep_file"):
                    doc["asleep_file"] = str(lay.asleep_file)
                    routes.write_text(json.dumps(doc, indent=2))
            self.res["sleepwatch"] = {"moved": moved, "instances": [i["instance"] for i in cfg["instances"]]}
            code = "import sys; from vllm_fleet.cli import main; sys.exit(main())"
            self.watch = subprocess.Popen(
                [sys.executable, "-c", code, "sleepwatch", "--config", str(cfg_path)],
                cwd=REPO,
                stdout=subprocess.DEVNULL,
                stderr=(lay.log / "sleepwatch.log").open("ab"),
                start_new_session=True,
                env={k: v for k, v in os.environ.items() if k != "NOTIFY_SOCKET"},
            )
            deadline = time.monotonic() + 15
            while not lay.asleep_file.exists() and time.monotonic() < deadline and self.watch.poll() is None:
                time.sleep(0.1)
            self.check("sleepwatch_up", lay.asleep_file.exists(), lf.read_json(lay.asleep_file))
        self.gw = LabGateway(gw_root, lay.root / "nginx-prefix-scale", lay.log / "admission-sleep.log",
                             vf=lay.root, nginx_root=lay.nginx_root)  # fmt: skip
        try:
            self.gw.start(lay.gw_port)
        except (RuntimeError, TimeoutError) as exc:
            self.res["gateway_setup"] = self.gw.info
            self.check("gateway_up", False, str(exc)[-1500:])
            return False
        self.res["gateway_setup"] = self.gw.info
        self.check("gateway_up", True)
        self.save()
        return True

    # -- 4. the traffic

    def traffic(self) -> None:
        a = self.a
        self.step(
            f"4. traffic: {a.lanes} lanes for {a.seconds:g} s, Zipf s={a.zipf_s} over {a.models} models"
        )
        assert self.gw is not None
        picker = Picker(a.models, a.zipf_s, a.seed)

        def plan(lane: int, k: int) -> tuple[str, bool]:
            return model_name(picker.pick(lane, k)), (lane + k) % 2 == 0

        t0 = time.monotonic()
        records, cut = asyncio.run(
            lf.lanes(
                "127.0.0.1",
                self.lay.gw_port,
                self.gw.key,
                a.lanes,
                plan,
                a.tokens,
                a.seconds,
                a.drain_s,
                chat=True,
            )
        )
        t1 = time.monotonic()
        self.t_traffic = (t0, t1)
        self.records = records
        v = request_verdict(records, cut)
        v["wall_s"] = round(t1 - t0, 2)
        v["requests_per_s"] = round(len(records) / (t1 - t0), 2) if t1 > t0 else None
        v["by_model"] = dict(sorted(Counter(r["model"] for r in records).items()))
        self.res["traffic"] = v
        print(
            f"   {v['requests']} requests in {v['wall_s']} s: ok {v['ok']}, refused (Retry-After) "
            f"{v['refused_with_retry_after']}, failed {v['failed']}, cut {cut}; {v['by_status']}",
            flush=True,
        )
        self.count("traffic", records)
        proc = self.gw.nginx.proc
        rc = proc.poll() if proc is not None else "never started"
        # nginx's master gone (tools/setup.sh, run by `make setup`/`make test` and so by CI, does `pkill -x nginx`)
        self.check("gateway_alive_through_the_traffic", rc is None, None if rc is None else {"nginx_rc": rc})
        # a 429/503 with JSON and Retry-After is docs/sleep.md's answer to a wake that failed or took longer than
        # wake_wait_seconds (and the gateway's when nothing can take the request): counted apart, shown, not a
        # failure here (a failed wake fails no_failed_wake)
        ok = v["requests"] > 0 and v["failed"] == 0 and cut == 0
        keys = ("by_status", "refusals", "failures", "failed_examples", "cut")
        self.check(
            "every_request_a_complete_200_or_a_defined_refusal", ok, None if ok else {k: v[k] for k in keys}
        )
        if v["refused_with_retry_after"]:
            print(f"   refused with Retry-After (docs/sleep.md's answer): {v['refusals']}", flush=True)
        self.memory("after_the_traffic")
        self.save()

    # -- 5. settle: every instance idle asleep again

    def settle(self) -> None:
        self.step(
            f"5. settle: every instance asleep within idle_seconds ({LEAST_IDLE_S} s) + {SETTLE_EXTRA_S:g} s"
        )
        deadline = time.monotonic() + LEAST_IDLE_S + SETTLE_EXTRA_S
        while time.monotonic() < deadline:
            if all(st.get("sleep_state") == "asleep" for st in self.states().values()):
                break
            time.sleep(0.5)
        now = {n: st.get("sleep_state") for n, st in self.states().items()}
        t = round(time.monotonic() - (self.t_traffic[1] if self.t_traffic else time.monotonic()), 1)
        print(f"   {t} s after the traffic: {Counter(now.values())}", flush=True)
        self.check("every_instance_asleep_after_idle", set(now.values()) == {"asleep"}, now)
        self.memory("settled")
        self.save()

    # -- 6. the samples, liveness, counters, the exporter

    def observe(self) -> None:
        self.step("6. samples, liveness, counters, the exporter")
        assert self.sampler is not None
        self.sampler.stop()
        samples = self.sampler.samples
        gaps = self.sampler.gaps
        self.res["sampler"] = {"samples": len(samples), "period_s": SAMPLE_S, "gap": spread(gaps)}
        peaks = group_peaks(samples, self.groups, self.a.max_awake)
        lines = timelines(samples)
        self.res["timelines"] = {
            n: [(round(t - self.tstart, 3), s) for t, s in ln] for n, ln in lines.items()
        }
        self.check(
            "no_group_above_max_awake",
            all(p["over_samples"] == 0 for p in peaks.values()) and len(samples) > 0,
            {
                g: {k: p[k] for k in ("max_slot_holders", "max_awake_or_waking", "over")}
                for g, p in peaks.items()
            },
        )
        # held or awake: from the samples
        inst_of: dict[str, list[str]] = {}
        for m in self.ms:
            inst_of.setdefault(m.served, []).append(m.name)
        ttfb: dict[str, list[float]] = {"awake": [], "held": []}
        ttfb_streams: dict[str, list[float]] = {"awake": [], "held": []}
        total: dict[str, list[float]] = {"awake": [], "held": []}
        for r in self.records:
            if request_class(r) != "ok" or (first := ttfb_of(r)) is None:
                continue
            held = was_held(lines, inst_of[r["model"]], r["start"], r["start"] + first)
            r["held"] = held
            key = "held" if held else "awake"
            ttfb[key].append(first)
            if r["stream"]:
                ttfb_streams[key].append(first)
            total[key].append(float(r["seconds"]))
        self.out.mkdir(parents=True, exist_ok=True)
        with (self.out / "requests.jsonl").open("w") as f:  # every request: when, what, how it went
            for r in self.records:
                row = {
                    k: r.get(k)
                    for k in ("t", "model", "stream", "status", "kind", "seconds", "held", "detail")
                }
                row["ttfb"] = ttfb_of(r)
                f.write(json.dumps(row, default=str) + "\n")
        durations, missed = wake_durations(samples)
        st = self.states()
        per_group = {}
        for g, names in self.groups.items():
            reasons = [sleep_reasons(self.insts[n].statuses()) for n in names if n in self.insts]
            lvl = {self.levels[n] for n in names}
            per_group[g] = {
                "members": len(names),
                "level": sorted(lvl),
                "requests": sum(1 for r in self.records if set(inst_of[r["model"]]) & set(names)),
                "wakes": sum(int(st[n].get("wakes_total") or 0) for n in names),
                "sleeps": sum(int(st[n].get("sleeps_total") or 0) for n in names),
                "evictions": sum(x["peer"] for x in reasons),
                "idle_sleeps": sum(x["idle"] for x in reasons),
                "sleeps_refused": sum(x["refused"] for x in reasons),
                "failed_wakes": sum(int(st[n].get("failed_wakes_total") or 0) for n in names),
                "max_slot_holders": peaks[g]["max_slot_holders"],
                "max_awake_or_waking": peaks[g]["max_awake_or_waking"],
                "awake_without_slot_samples": peaks[g]["awake_without_slot_samples"],
                "wake_s": spread([x for n in names for x in durations.get(n, [])]),
            }
        figures = {
            "ttfb_awake_s": spread(ttfb["awake"]),
            "ttfb_held_s": spread(ttfb["held"]),
            "ttfb_streams_awake_s": spread(ttfb_streams["awake"]),
            "ttfb_streams_held_s": spread(ttfb_streams["held"]),
            "total_awake_s": spread(total["awake"]),
            "total_held_s": spread(total["held"]),
            "wake_s": spread([x for v in durations.values() for x in v]),
            "wake_alone_s": spread(
                [x for i in self.insts.values() for x in spans(i.lis.messages, "Waking", "Serving")]
            ),
            "sleep_alone_s": spread(
                [x for i in self.insts.values() for x in spans(i.lis.messages, "Going to sleep", "Asleep (")]
            ),
            "wake_s_by_level": {
                lv: spread([x for n, v in durations.items() if self.levels[n] == lv for x in v])
                for lv in sorted(set(self.levels.values()))
            },
            "wakes_missed_by_the_samples": missed,
            "groups": per_group,
        }
        self.res["figures"] = figures
        # liveness: alive, one READY, the same engine, the watchdog
        now = time.monotonic()
        alive: dict[str, dict[str, Any]] = {}
        wd: dict[str, Any] = {}
        for n, i in self.insts.items():
            alive[n] = {
                "launcher_alive": i.lp is not None and i.lp.poll() is None,
                "ready_count": i.ready_count(),
                "engine_pid": [i.pid, st[n].get("engine_pid")],
                "state": st[n].get("state"),
            }
            wd[n] = watchdog_report(pings_of(i), i.t_ready or i.t0, now, WATCHDOG_S)
        self.res["alive"], self.res["watchdog"] = alive, wd
        # a launcher alive whose pings stopped (systemd would have killed it): what the kernel says it waits on
        silent = {
            n: i.lp.pid
            for n, i in self.insts.items()
            if i.lp is not None and i.lp.poll() is None and now - max(pings_of(i), default=i.t0) > WATCHDOG_S
        }
        if silent:
            self.res["silent_launchers"] = {n: proc_facts(pid) for n, pid in silent.items()}
            print(
                f"   launchers alive without a ping for {WATCHDOG_S:g} s: {self.res['silent_launchers']}",
                flush=True,
            )
        self.check(
            "launchers_alive_one_ready_each_same_engine",
            len(alive) == len(self.ms)
            and all(
                v["launcher_alive"]
                and v["ready_count"] == 1
                and v["engine_pid"][0] == v["engine_pid"][1] is not None
                for v in alive.values()
            ),
            {n: v for n, v in alive.items() if not (v["launcher_alive"] and v["ready_count"] == 1)} or alive,
        )
        self.check(
            "watchdog_never_reached_watchdogsec",
            all(not w["systemd_would_kill"] and w["pings"] > 0 for w in wd.values()),
            {n: w["max_ping_gap_s"] for n, w in wd.items()},
        )
        # the launcher's own goal (launcher_state.next_check_at): two pings at most a probe interval, a third of
        # WatchdogSec, apart; a member woken just before a ping was due once went two intervals without one
        self.check(
            "watchdog_pings_within_a_third_of_watchdogsec",
            all(w["within_goal"] for w in wd.values()),
            {n: w["max_ping_gap_s"] for n, w in wd.items() if not w["within_goal"]} or None,
        )
        gap = max(wd.items(), key=lambda x: x[1]["max_ping_gap_s"], default=None)
        figures["watchdog_max_gap_s"] = (
            {"instance": gap[0], "gap_s": gap[1]["max_ping_gap_s"]} if gap else None
        )
        wakes = sum(g["wakes"] for g in per_group.values())
        sleeps = sum(g["sleeps"] for g in per_group.values())
        self.check("wakes_and_sleeps_happened", wakes > 0 and sleeps > 0, {"wakes": wakes, "sleeps": sleeps})
        self.check(
            "no_failed_wake",
            all(int(s.get("failed_wakes_total") or 0) == 0 for s in st.values()),
            {
                n: [s.get("failed_wakes_total"), s.get("last_wake_failure")]
                for n, s in st.items()
                if s.get("failed_wakes_total")
            },
        )
        ex = sf.exporter_once(self.lay)
        st = self.states()  # every instance asleep (step 5): nothing changes under the exporter
        self.res["exporter"] = {"rc": ex.returncode, "stderr": ex.stderr[-1500:]}
        for k, (ok, detail) in sf.exporter_verdict(ex.stdout, st).items():
            self.check(k, ex.returncode == 0 and ok, None if ok else detail)
        ok, detail = exporter_counts_verdict(ex.stdout, st)
        self.check(
            "exporter_sleeps_wakes_failed_wakes_match", ex.returncode == 0 and ok, None if ok else detail
        )
        self.save()

    # -- the run

    def steps(self) -> None:
        if self.start_all() and self.gateway():
            self.traffic()
            self.settle()
        if self.sampler is not None:
            self.observe()

    def close(self) -> None:
        if self.sampler is not None:
            self.sampler.stop()
        if self.watch is not None and self.watch.poll() is None:
            self.watch.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.watch.wait(10)
        super().close()
        lf.keep_logs(self.lay.log, self.out, ["sleepwatch.log", "nginx-access.log"], 200, 400)

    def summary(self) -> None:
        summary(self.res)


def summary(res: dict[str, Any]) -> None:
    print("=== sleep-scale summary", flush=True)
    k = res.get("knobs", {})
    print(
        f"{res['mode']}; wall {res.get('wall_s')} s; {k.get('models')} models in {k.get('groups')} groups, "
        f"max_awake {k.get('max_awake')}, {k.get('lanes')} lanes x {k.get('seconds')} s, Zipf s={k.get('zipf_s')}, "
        f"seed {k.get('seed')}"
    )
    t = res.get("traffic") or {}
    print(
        f"requests {t.get('requests')}, ok {t.get('ok')}, refused with Retry-After {t.get('refused_with_retry_after')}, "
        f"failed {t.get('failed')}, cut {t.get('cut')}; {t.get('requests_per_s')} requests/s"
    )
    f = res.get("figures") or {}

    def row(label: str, s: dict[str, Any] | None) -> None:
        s = s or {}
        n, p50, p95, top = (str(s.get(k)) for k in ("n", "p50", "p95", "max"))
        print(f"  {label:<26} n {n:>6}  p50 {p50:>7}  p95 {p95:>7}  max {top:>7}")

    row("TTFB, model awake (s)", f.get("ttfb_awake_s"))
    row("TTFB, held for a wake (s)", f.get("ttfb_held_s"))
    row("  streams, model awake", f.get("ttfb_streams_awake_s"))
    row("  streams, held", f.get("ttfb_streams_held_s"))
    row("total, model awake (s)", f.get("total_awake_s"))
    row("total, held (s)", f.get("total_held_s"))
    row("wake (s), slot wait included", f.get("wake_s"))
    row("  the wake alone (s)", f.get("wake_alone_s"))
    row("the sleep alone (s)", f.get("sleep_alone_s"))
    for lv, s in (f.get("wake_s_by_level") or {}).items():
        row(f"wake, level {lv} (s)", s)
    if gap := f.get("watchdog_max_gap_s"):
        print(
            f"  longest gap between two WATCHDOG=1: {gap['gap_s']} s ({gap['instance']}; WatchdogSec {WATCHDOG_S:g})"
        )
    groups = f.get("groups") or {}
    if groups:
        print(f"  {'group':<6} {'lvl':>3} {'mem':>3} {'reqs':>6} {'wakes':>5} {'sleeps':>6} {'evict':>5} {'idle':>4} "
              f"{'refus':>5} {'fail':>4} {'maxAw':>5} {'maxSl':>5}  wake p50/p95 s")  # fmt: skip
        for g, x in groups.items():
            print(
                f"  {g:<6} {','.join(map(str, x['level'])):>3} {x['members']:>3} {x['requests']:>6} {x['wakes']:>5} "
                f"{x['sleeps']:>6} {x['evictions']:>5} {x['idle_sleeps']:>4} {x['sleeps_refused']:>5} "
                f"{x['failed_wakes']:>4} {x['max_awake_or_waking']:>5} {x['max_slot_holders']:>5}  "
                f"{x['wake_s'].get('p50')}/{x['wake_s'].get('p95')}"
            )
    passed = len(res["checks"]) - len(res.get("failed_checks", []))
    print(f"checks {passed}/{len(res['checks'])} passed; failed: {res.get('failed_checks')}", flush=True)


def parse(argv: list[str]) -> argparse.Namespace:
    """The defaults: --local's 12 models in 3 groups of 2 awake (one at level 2), 16 tokens; the device's
    (DEVICE_DEFAULTS) one GPU: 4 models in 1 group of 2 awake, all at level 1, 64 tokens, room for vLLM's starts
    in one call."""
    ap = argparse.ArgumentParser(
        prog="sleep_scale.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("out", type=Path)
    ap.add_argument("--local", action="store_true", help="the sim engine and this machine's nginx (no GPU)")
    ap.add_argument("--models", type=int, default=12, help="models, one instance each, a served name each")
    ap.add_argument("--groups", type=int, default=3, help="swap groups, one GPU each")
    ap.add_argument("--max-awake", type=int, default=2, help="swap_groups.NAME.max_awake")
    ap.add_argument("--level2-groups", type=int, default=1, help="the last this many groups sleep at level 2")
    ap.add_argument(
        "--replicas", type=int, default=0, help="the hottest this many models get a second instance"
    )
    ap.add_argument("--lanes", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=90.0, help="how long the lanes send")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--zipf-s", type=float, default=1.1, help="the skew: P(rank r) ∝ 1/r^s")
    ap.add_argument("--tokens", type=int, default=16, help="max_tokens of each request")
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--token-delay", type=float, default=0.01, help="the sim engine's seconds per step")
    ap.add_argument(
        "--sim-sleep-s", type=float, default=0.4, help="the sim's sleep (H200 L1 after the first: 0.4 s)"
    )
    ap.add_argument("--sim-wake-s", type=float, default=0.6, help="the sim's /wake_up (H200 L1: 0.61 s)")
    ap.add_argument("--drain-s", type=float, default=150.0, help="how long requests in flight may finish")
    ap.add_argument("--ready-timeout", type=float, default=180.0)
    ap.add_argument("--budget-s", type=float, default=900.0, help="printed with each step")
    if "--local" not in argv:
        ap.set_defaults(**DEVICE_DEFAULTS)
    a = ap.parse_args(argv)
    if not a.local and a.level2_groups:
        ap.error("the device mode's models have dummy weights: vLLM reloads none after a level-2 sleep")
    if a.groups < 1 or a.models < a.groups or a.max_awake < 1 or not 0 <= a.level2_groups <= a.groups:
        ap.error("need models ≥ groups ≥ 1, max_awake ≥ 1, 0 ≤ level2_groups ≤ groups")
    return a


def layout(a: argparse.Namespace) -> Layout:
    # local: a short folder (the admission service's unix sockets live under it: at most 107 bytes a path); the
    # device: run-device.sh install's /root/vf, nginx from its unpacked packages, the engines on the machine's
    # non-loopback address
    root = Path(tempfile.mkdtemp(prefix="vf-scale-", dir="/tmp")) if a.local else sf.VF
    address = sf.non_loopback_ipv4()
    if not a.local and address is None:
        raise SystemExit("no non-loopback IPv4 address on this machine: the engines listen there")
    names = [m.name for m in members(a.models, a.groups, a.replicas, a.level2_groups)]
    ports: list[int] = []
    while len(ports) < len(names) + 3:  # a free port asked twice may be the same one
        if (port := lf.free_port()) not in ports:
            ports.append(port)
    return Layout(
        root,
        local=a.local,
        address=address or "127.0.0.1",
        ports=dict(zip(names, ports, strict=False)),
        gw_port=ports[-3],
        stub_port=ports[-2],
        admission_metrics_port=ports[-1],
        nginx_root=Path("/") if a.local else None,
    )


if __name__ == "__main__":
    args = parse(sys.argv[1:])
    # SIGTERM (`timeout`): the finally blocks stop the launchers and write the results
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    lay = layout(args)
    try:
        rc = Run(args.out, args, lay).main()
    finally:
        if lay.local:
            shutil.rmtree(lay.root, ignore_errors=True)
    sys.exit(rc)
