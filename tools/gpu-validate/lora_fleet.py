"""Device side: LoRA adapters THROUGH vllm-fleet on the H200 (issue 32; docs/gpu-validation.md, "LoRA through
vllm-fleet (lora_fleet.py)"). lora.py measured the adapters on a bare ``vllm serve``; this runs them the way a
host does: the rendered spec, ``vllm-fleet fetch``, the launcher (sd_notify through a NOTIFY_SOCKET we own), the
rendered gateway (nginx + njs + the admission service, measure.LabGateway) and ``vllm-fleet adapters sync``.

  lora_fleet.py OUT           on the device, after ``run-device.sh install`` (one call of about 5-7 min):
  1. nine random rank-16 adapters of the Qwen3-8B shape (lora.make_adapters: a00..a08 under /root/vf/adapters);
     the spec h200-lora.yml (a00-a03 carried by the instance, a04-a07 listed only: the engine's resolver loads
     them on a first request) with every adapter file's sha256, rendered (``--lock-dir '' --allow-unchecked-flags``
     as measure.py), planned (the LoRA slots' estimate) and fetched (``vllm-fleet fetch --contract``: checksums
     and ranks verified);
  2. the launcher on the rendered instance (WATCHDOG_USEC = WatchdogSec 20 s): its notify messages with their
     times; READY=1 must come after the STATUS "loading adapters" and after the engine's "Loaded new LoRA
     adapter" line of every carried adapter; the adapter state file at READY;
  3. the rendered gateway (its key file: the lab key of client ``lab`` and one of client ``narrow``, which may use
     the base and a00 only): GET /v1/models lists the adapters with ``parent``; one request per adapter (the
     listed ones through the resolver); an unknown adapter is a 404 JSON; a01 with the narrow key a 403 JSON; the
     engines' LoRA administration paths are never forwarded;
  4. a burst: 6 x max_num_seqs lanes for 40 s through the gateway, a new connection per request, every other
     request for the base, the rest spread over the eight adapters, half the lanes streaming: outcomes by kind
     and status (every non-200 must be a 429/503 JSON with Retry-After; no 200 carrying an error; every answer
     names the model asked), TTFT p50/p90 of the base vs the adapters, the watchdog pings (never a gap of
     WatchdogSec), the launcher alive, the same engine, one READY=1; the engine's queue and
     ``vllm:lora_requests_info`` sampled every second (and how many series that gauge has at the end);
  5. under steady traffic (4 lanes: the base, a00, a01, a05): the spec edited (a08 added to the carried set, a03
     removed), rendered again (the instance config must not change), fetched, the adapters file installed,
     ``vllm-fleet adapters sync qwen3-8b --json`` (timed: loaded [a08], unloaded [a03]), the gateway's new
     config reloaded; 0 failed requests, the same engine; /v1/models through the gateway and at the engine
     follow; a second sync changes nothing;
  6. ``vllm-fleet exporter --once --no-nvml``: the ``vllm_fleet_instance_adapter_loaded`` lines; the engine's
     ``vllm:lora_requests_info`` series;
  7. 4 streams in flight (the base and a00), then SIGTERM to the launcher: the streams must complete (the drain),
     exit code 0 with STOPPING=1, the engine gone, the adapter state file empty after it;
     nvidia-smi before and after; OUT/lora-fleet-results.json (written after every step; a ``timeout``'s SIGTERM
     stops the launcher and writes it) + the logs, and a summary. Exit 0 when every check passed.
  lora_fleet.py OUT --local   the same steps with the sim engine (vllm_fleet/devtools/sim_engine.py: the engine
                              command of the rendered instance runs it) and the machine's nginx, everything under
                              a temporary folder on free ports, small sizes: no GPU (docs/gpu-validation.md).

Knobs (flags, defaults from the environment): VF_MAX_NUM_SEQS (64; local 8), VF_BURST_S (40; local 8),
VF_LANES_PER_SEQ (6), VF_TOKENS (128; local 16), VF_STEADY_S (5; local 2), VF_DRAIN_S (30),
VF_READY_TIMEOUT (420; local 60).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for p in (REPO, HERE, REPO / "tools"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))
# the siblings: churn.py's raw-socket client pieces and watchdog report, lora.py's adapters (make_adapters) and
# prompt words, measure.py's lab (render flags, gateway, launcher stop), sandbox_burst.py's outcome classification
import lora  # noqa: E402
from churn import CONNECT_TIMEOUT_S, exchange, watchdog_report  # noqa: E402
from measure import LAB, LabGateway, kv_lines, kv_tokens, raise_nofile, stop_launcher, vf_cli  # noqa: E402
from sandbox_burst import classify  # noqa: E402

from vllm_fleet.devtools.testing import resolver_pythonpath  # noqa: E402

SPEC = HERE / "h200-lora.yml"
VF = Path("/root/vf")
NAME = "qwen3-8b"  # the instance and its served model
ADDED, REMOVED = "a08", "a03"  # step 5: a new adapter carried, a carried one removed from the spec
STEADY_MODELS = (NAME, "a00", "a01", "a05")  # step 5's lanes: the base, two carried, one listed
WATCHDOG_S = 20.0  # h200-lora.yml's service.watchdog_seconds
RANK = lora.RANK  # 16
NARROW_CLIENT = "narrow"
# vllm-fleet's LoRA resolver is a vllm.general_plugins entry point (pyproject.toml); the device runs vllm-fleet
# from the repository (PYTHONPATH), with no installed distribution to declare it: a shim distribution does


# ---- the lab's layout: the device's /root/vf, or a temporary folder for --local


@dataclass
class LabLayout:
    """What every lab through vllm-fleet has (this one and sleep_fleet.py's): the spec's paths.prefix, local or
    the device, the gateway's ports, nginx's files."""

    root: Path  # the spec's paths.prefix
    local: bool
    gw_port: int = 8000
    stub_port: int = 8081
    admission_metrics_port: int = 9402
    nginx_root: Path | None = None  # LabGateway's (None: root/nginx, the unpacked Debian packages)

    @property
    def log(self) -> Path:
        return self.root / "log"

    @property
    def etc(self) -> Path:
        return self.root / "etc"

    @property
    def state_dir(self) -> Path:
        return self.root / "run"


@dataclass
class Layout(LabLayout):
    engine_port: int = 8002

    @property
    def adapters(self) -> Path:
        return self.root / "adapters"

    @property
    def model(self) -> Path:
        return self.root / "models" / NAME

    def render_dir(self, tag: str) -> Path:
        return self.root / f"render-lora-{tag}"

    def host_root(self, tag: str) -> Path:
        """The render's host folder (OUT/h200)."""
        return self.render_dir(tag) / "h200"

    def rendered(self, tag: str, path: Path) -> Path:
        """Where the render put the file the host has at ``path`` (absolute)."""
        return self.host_root(tag) / str(path).lstrip("/")


# ---- the spec (pure: tests/unit/test_gpu_lora_fleet.py)


def retarget(x: Any, old: str, new: str) -> Any:
    """``x`` with every string that starts with ``old`` (a path prefix) starting with ``new`` instead."""
    if isinstance(x, str):
        return new + x[len(old) :] if x == old or x.startswith(old + "/") else x
    if isinstance(x, dict):
        return {k: retarget(v, old, new) for k, v in x.items()}
    if isinstance(x, list):
        return [retarget(v, old, new) for v in x]
    return x


def spec_data(
    base: dict[str, Any], lay: Layout, max_num_seqs: int, sums: dict[str, dict[str, str]]
) -> dict[str, Any]:
    """h200-lora.yml's data for this run: moved to ``lay`` (root, ports), its instance at ``max_num_seqs`` and
    the lab key's budget scaled with it (1.5 x in flight, 2 x queued), each adapter's ``source.checksums`` from
    ``sums`` (adapter → relative path → sha256)."""
    d: dict[str, Any] = retarget(json.loads(json.dumps(base)), str(VF), str(lay.root))
    m = d["models"][0]
    m["max_num_seqs"] = max_num_seqs
    m["port"] = lay.engine_port
    gw = d["gateway"]
    gw["port"], gw["stub_status_port"] = lay.gw_port, lay.stub_port
    lim = gw["limits"]
    lim["metrics_port"] = lay.admission_metrics_port
    lim["default_key"] = {"max_in_flight": max_num_seqs * 3 // 2}
    lim["max_queued_per_key"] = 2 * max_num_seqs
    for a in d["adapters"]:
        if a["name"] in sums:
            a["source"]["checksums"] = dict(sums[a["name"]])
    return d


def edit_adapters(
    d: dict[str, Any], add: str, remove: str, adapters_dir: Path, sums: dict[str, str]
) -> dict[str, Any]:
    """The spec change of step 5: adapter ``add`` (its folder in ``adapters_dir``, checksums ``sums``) carried by
    the instance, adapter ``remove`` gone from the spec."""
    e = json.loads(json.dumps(d))
    e["adapters"] = [a for a in e["adapters"] if a["name"] != remove]
    e["adapters"].append(
        {"name": add, "base": NAME, "source": {"path": str(adapters_dir / add), "checksums": dict(sums)},
         "rank": RANK, "instances": [NAME]}
    )  # fmt: skip
    return dict(e)


def carried(d: dict[str, Any]) -> list[str]:
    return sorted(a["name"] for a in d["adapters"] if a["instances"] == "any" or NAME in a["instances"])


def listed(d: dict[str, Any]) -> list[str]:
    return sorted(a["name"] for a in d["adapters"])


# ---- the outcomes (pure: tests/unit/test_gpu_lora_fleet.py)


def answered_model(text: str, stream: bool) -> str | None:
    """The ``model`` an answer names: the first event's of a stream, the body's of a plain answer."""
    if stream:
        for line in text.splitlines():
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                with contextlib.suppress(ValueError):
                    ev = json.loads(line[5:])
                    if isinstance(ev, dict) and ev.get("model"):
                        return str(ev["model"])
        return None
    with contextlib.suppress(ValueError):
        doc = json.loads(text)
        if isinstance(doc, dict) and doc.get("model"):
            return str(doc["model"])
    return None


def outcome(
    status: int | None,
    text: str,
    content_type: str,
    retry_after: str | None,
    error: str | None,
    stream: bool,
    model: str,
) -> dict[str, Any]:
    """One request's outcome (sandbox_burst.classify's kinds; a plain 200 JSON completion, text or chat, is
    ``complete`` too): ``model_ok`` (a complete answer names the model asked), ``json_error`` (a refusal's body is
    a JSON error)."""
    rec = classify(status, text, content_type=content_type, retry_after=retry_after, error=error)
    if status == 200 and not stream and rec["kind"] == "other_status":
        with contextlib.suppress(ValueError):
            doc = json.loads(text)
            first = doc["choices"][0] if isinstance(doc, dict) and doc.get("choices") else None
            if isinstance(first, dict) and (
                first.get("text") is not None or (first.get("message") or {}).get("content") is not None
            ):
                rec["kind"] = "complete"
    if rec["kind"] == "complete":
        rec["model_ok"] = answered_model(text, stream) == model
    elif status is not None and status != 200:
        try:
            rec["json_error"] = isinstance(json.loads(text).get("error"), dict)
        except (ValueError, AttributeError):
            rec["json_error"] = False
    return rec


def pct(xs: list[float], q: float) -> float | None:
    s = sorted(xs)
    return round(s[min(len(s) - 1, int(q * len(s)))], 3) if s else None


def refusal_counts(records: list[dict[str, Any]]) -> dict[str, int]:
    """How many refusals of each status, error code and reason."""
    return dict(
        Counter(
            f"{r['status']} {r.get('code')} ({r.get('reason') or '-'})"
            for r in records
            if r["kind"] == "refused"
        )
    )


def tally(records: list[dict[str, Any]], cut: int = 0) -> dict[str, Any]:
    """The outcomes of a set of requests: by kind and status, refusals, TTFT (streams) and end-to-end seconds
    (plain answers) of the complete ones, per group (``base``: the base model, ``adapter``: any adapter)."""
    out: dict[str, Any] = {
        "requests": len(records),
        "cut": cut,
        "by_kind": dict(Counter(r["kind"] for r in records)),
        "by_status": {str(k): v for k, v in sorted(Counter(r["status"] for r in records).items(), key=str)},
        "refusals": refusal_counts(records),
        "refused_without_retry_after": sum(
            1 for r in records if r["kind"] == "refused" and not r.get("retry_after")
        ),
        "refused_not_json": sum(1 for r in records if r["kind"] == "refused" and not r.get("json_error")),
        "model_mismatch": sum(1 for r in records if r["kind"] == "complete" and not r.get("model_ok")),
        "details": dict(
            Counter(
                str(r.get("detail"))[:160] for r in records if r["kind"] not in ("complete", "refused")
            ).most_common(8)
        ),
    }
    groups: dict[str, Any] = {}
    for g in ("base", "adapter"):
        rs = [r for r in records if r["group"] == g]
        ttft = [r["ttft"] for r in rs if r["kind"] == "complete" and r.get("ttft") is not None]
        e2e = [r["seconds"] for r in rs if r["kind"] == "complete" and not r["stream"]]
        groups[g] = {
            "requests": len(rs),
            "complete": sum(1 for r in rs if r["kind"] == "complete"),
            "refused": sum(1 for r in rs if r["kind"] == "refused"),
            "ttft_p50_s": pct(ttft, 0.5),
            "ttft_p90_s": pct(ttft, 0.9),
            "ttft_n": len(ttft),
            "plain_e2e_p50_s": pct(e2e, 0.5),
            "plain_e2e_p90_s": pct(e2e, 0.9),
        }
    out["groups"] = groups
    out["by_model"] = dict(sorted(Counter(r["model"] for r in records if r["kind"] == "complete").items()))
    return out


def burst_verdict(t: dict[str, Any]) -> dict[str, bool]:
    """What a burst through the gateway must hold: every request complete or refused (429/503, JSON, with
    Retry-After), none cut, every answer naming the model asked."""
    k = t["by_kind"]
    return {
        "only_complete_or_refused": set(k) <= {"complete", "refused"},
        "refusals_429_503_json_with_retry_after": t["refused_without_retry_after"] == 0
        and t["refused_not_json"] == 0,
        "no_error_200": k.get("error_200", 0) == 0,
        "none_cut": t["cut"] == 0,
        "answers_name_their_model": t["model_mismatch"] == 0,
        "base_and_adapters_served": all(t["groups"][g]["complete"] > 0 for g in ("base", "adapter")),
    }


def lora_info_lines(metrics_text: str) -> list[str]:
    return [ln for ln in metrics_text.splitlines() if ln.startswith("vllm:lora_requests_info")]


def lora_info_labels(line: str) -> dict[str, str]:
    return dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0]))


# ---- the client: a new connection per request (churn.py's pieces), lanes until a deadline or a stop


async def one_request(
    host: str, port: int, model: str, stream: bool, key: str | None, tokens: int, prompt: str,
    chat: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """One request on a new connection: a completion of ``prompt`` (``chat``: a chat completion with it as the
    user's message)."""
    ask: dict[str, Any] = {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
    body = json.dumps({"model": model, **ask, "max_tokens": tokens, "ignore_eos": True, "stream": stream,
                       "temperature": 0}).encode()  # fmt: skip
    path = "/v1/chat/completions" if chat else "/v1/completions"
    t0 = time.monotonic()
    base = {"model": model, "stream": stream, "group": "base" if model == NAME else "adapter"}
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), CONNECT_TIMEOUT_S)
    except (OSError, TimeoutError) as exc:
        rec = outcome(None, "", "", None, f"connect: {type(exc).__name__}: {exc}", stream, model)
        return {**base, **rec, "seconds": round(time.monotonic() - t0, 3)}
    status, headers, text, error, first = await exchange(reader, writer, host, port, path, body, key)
    rec = outcome(
        status, text, headers.get("content-type", ""), headers.get("retry-after"), error, stream, model
    )
    out = {**base, **rec, "seconds": round(time.monotonic() - t0, 3), "start": t0}
    if first:
        out["first_byte_at"] = first[0]  # monotonic: whether it was streaming at a given moment
        if stream and rec["kind"] == "complete":
            out["ttft"] = round(first[0] - t0, 4)
    return out


Plan = Callable[[int, int], tuple[str, bool]]  # (lane, its request number) → (model, stream)


async def lanes(
    host: str, port: int, key: str | None, n: int, plan: Plan, tokens: int, hold: float, drain: float,
    stop: threading.Event | None = None, chat: bool = False,
) -> tuple[list[dict[str, Any]], int]:  # fmt: skip
    """``n`` lanes sending one request after another (``plan`` picks each one's model and streaming; ``chat``:
    chat completions) until ``hold`` s or ``stop``; a refusal with Retry-After waits it (at most 5 s), as the SDKs
    do. What still runs ``drain`` s after the lanes stop sending is cut. (records, cut)"""
    rng = random.Random(7)
    records: list[dict[str, Any]] = []
    t0 = time.monotonic()

    def stopped() -> bool:
        return time.monotonic() >= t0 + hold or (stop is not None and stop.is_set())

    async def lane(i: int) -> None:
        k = 0
        while not stopped():
            model, stream = plan(i, k)
            k += 1
            prompt = f"{i}.{k} " + " ".join(rng.choice(lora.WORDS) for _ in range(48))
            rec = await one_request(host, port, model, stream, key, tokens, prompt, chat)
            rec["t"] = round(time.monotonic() - t0, 3)
            rec["at"] = time.monotonic()
            records.append(rec)
            if rec["kind"] == "refused" and rec.get("retry_after"):
                with contextlib.suppress(ValueError):
                    await asyncio.sleep(min(5.0, float(rec["retry_after"])))
            elif rec["kind"] != "complete":
                await asyncio.sleep(0.2)  # no hot loop on a failure

    tasks = [asyncio.create_task(lane(i)) for i in range(n)]
    while not stopped():
        await asyncio.sleep(0.1)
    _, pending = await asyncio.wait(tasks, timeout=drain)
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    return records, len(pending)


class Steady:
    """``lanes`` in a thread of its own until ``stop()``: step 5's steady traffic, step 7's streams at SIGTERM."""

    def __init__(self, host: str, port: int, key: str, plan: Plan, n: int, tokens: int) -> None:
        self.ev = threading.Event()
        self.result: tuple[list[dict[str, Any]], int] = ([], 0)

        def run() -> None:
            self.result = asyncio.run(lanes(host, port, key, n, plan, tokens, 1e9, 60, self.ev))

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def stop(self) -> tuple[list[dict[str, Any]], int]:
        self.ev.set()
        self.thread.join(90)
        return self.result


# ---- small HTTP and process helpers


def http(
    method: str, url: str, body: Any = None, key: str | None = None, timeout: float = 120
) -> tuple[int, Any]:
    """(status, the JSON body or its text); status 0 when nothing answered."""
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw = int(r.status), r.read()
    except urllib.error.HTTPError as e:
        status, raw = int(e.code), e.read()
    except OSError as exc:
        return 0, f"{type(exc).__name__}: {exc}"
    text = raw.decode(errors="replace")
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text[:500]


def error_code(doc: Any) -> str | None:
    err = doc.get("error") if isinstance(doc, dict) else None
    return str(err.get("code") or err.get("type")) if isinstance(err, dict) else None


def completion(url: str, model: str, key: str | None, tokens: int = 4) -> dict[str, Any]:
    t = time.monotonic()
    st, doc = http(
        "POST", url + "/v1/completions", {"model": model, "prompt": "hello", "max_tokens": tokens}, key
    )
    out: dict[str, Any] = {"status": st, "seconds": round(time.monotonic() - t, 3)}
    if st == 200 and isinstance(doc, dict):
        out["model"] = doc.get("model")
    else:
        out["code"] = error_code(doc)
        out["json"] = isinstance(doc, dict)
    return out


def model_list(url: str, key: str | None) -> dict[str, Any] | None:
    """{id: parent} of ``GET URL/v1/models``; None when it does not answer 200 with a list."""
    st, doc = http("GET", url + "/v1/models", key=key, timeout=30)
    if st != 200 or not isinstance(doc, dict):
        return None
    return {str(m["id"]): m.get("parent") for m in doc.get("data", [])}


def metrics_text(port: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            return str(r.read().decode())
    except OSError:
        return ""


class Sampler:
    """Every second the engine's running/waiting requests and its ``vllm:lora_requests_info`` (the adapters in
    the batch and waiting for a slot). vLLM keeps a series of that gauge per set of adapters it saw, so its
    /metrics grows under a mixed burst: the sampler asks once a second and reports the size."""

    def __init__(self, port: int) -> None:
        self.port, self.rows = port, []  # type: ignore[var-annotated]
        self.ev = threading.Event()
        self.t = threading.Thread(target=self.run, daemon=True)
        self.t.start()

    def run(self) -> None:
        while not self.ev.is_set():
            text = metrics_text(self.port)
            row: dict[str, Any] = {"t": time.monotonic()}
            for name in ("num_requests_running", "num_requests_waiting"):
                vals = re.findall(rf"^vllm:{name}\{{[^}}]*\}} (\S+)$", text, re.M)
                if vals:
                    row[name] = sum(float(v) for v in vals)
            # the newest lora_requests_info sample (its value: when vLLM last saw that set)
            info = [(float(ln.rsplit(" ", 1)[1]), lora_info_labels(ln)) for ln in lora_info_lines(text)]
            if info:
                row["lora"] = max(info, key=lambda x: x[0])[1]
            row["bytes"], row["lora_series"] = len(text), len(lora_info_lines(text))
            self.rows.append(row)
            self.ev.wait(1.0)

    def done(self) -> dict[str, Any]:
        self.ev.set()
        self.t.join(10)
        rows = self.rows
        running_sets = [r["lora"].get("running_lora_adapters", "") for r in rows if "lora" in r]
        waiting_sets = [r["lora"].get("waiting_lora_adapters", "") for r in rows if "lora" in r]
        return {
            "samples": len(rows),
            "peak_running": max((r.get("num_requests_running", 0) for r in rows), default=None),
            "peak_waiting": max((r.get("num_requests_waiting", 0) for r in rows), default=None),
            "lora_info_samples": len(running_sets),
            "most_adapters_running": max(
                (len([x for x in s.split(",") if x]) for s in running_sets), default=0
            ),
            "adapters_seen_running": sorted({x for s in running_sets for x in s.split(",") if x}),
            "adapters_seen_waiting": sorted({x for s in waiting_sets for x in s.split(",") if x}),
            "max_lora": next((r["lora"].get("max_lora") for r in rows if "lora" in r), None),
            "metrics_bytes_last": rows[-1]["bytes"] if rows else None,
            "lora_info_series_last": rows[-1]["lora_series"] if rows else None,
        }


def read_json(path: Path) -> dict[str, Any] | None:
    with contextlib.suppress(OSError, ValueError):
        return dict(json.loads(path.read_text()))
    return None


def nvidia_smi() -> dict[str, Any]:
    if shutil.which("nvidia-smi") is None:
        return {"skipped": "no nvidia-smi (local)"}
    q = ["nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv,noheader"]
    apps = ["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory", "--format=csv,noheader"]
    run = lambda a: subprocess.run(a, capture_output=True, text=True, timeout=30).stdout.strip()  # noqa: E731
    return {"gpu": run(q), "apps": [ln for ln in run(apps).splitlines() if ln[:1].isdigit()]}


def require_free_gpu() -> list[str]:
    """The GPU's compute apps before a device run: none, or RunStop naming them (each lab sizes its engines'
    shares for a GPU of its own: an engine left over from an earlier call would fail the starts)."""
    busy: list[str] = nvidia_smi().get("apps") or []
    if busy:
        raise RunStop(f"the GPU is in use already (stop those engines first): {busy}")
    return busy


def nvidia_smi_gpu() -> str:
    """``name, memory.total`` of the GPUs (MiB, no units), one line each."""
    q = ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"]
    return subprocess.run(q, capture_output=True, text=True, timeout=30, check=True).stdout


def cli_json(*args: str, timeout: float = 180) -> tuple[int, Any, str]:
    """``vllm-fleet ARGS`` (measure.vf_cli): (rc, its stdout as JSON or text, the tail of stderr)."""
    r = vf_cli(*args, timeout=timeout)
    try:
        doc: Any = json.loads(r.stdout)
    except ValueError:
        doc = r.stdout[-3000:]
    return r.returncode, doc, r.stderr[-2000:]


def sha256s(folder: Path) -> dict[str, str]:
    """Relative path → sha256 of every file of an adapter folder, as ``vllm-fleet fetch`` hashes it."""
    from vllm_fleet.host.fetch import hash_tree

    return {k: v["sha256"] for k, v in hash_tree(folder).items()}


class RunStop(Exception):
    """A step cannot go on (its message says why): the run stops the launcher(s) and writes what it has."""


def sim_engine_script(root: Path, tool: str, sim_args: str) -> None:
    """--local: the spec's engine command ($venv/bin/vllm under ``root``) as a script that runs the sim engine with
    the rendered arguments and ``sim_args`` (the sim's own flags)."""
    vllm = root / "venv/bin/vllm"
    vllm.parent.mkdir(parents=True, exist_ok=True)
    vllm.write_text(
        f"#!/bin/sh\n# {tool} --local: the rendered engine command runs the sim engine\n"
        f'PYTHONPATH={REPO}${{PYTHONPATH:+:$PYTHONPATH}} exec {sys.executable} -m vllm_fleet.devtools.sim_engine "$@" '
        f"{sim_args}\n"
    )
    vllm.chmod(0o755)


# ---- the lab: adapters, model, engine command (device: what run-device.sh install left; local: the sim)


def make_local_lab(lay: Layout, n: int, token_delay: float) -> dict[str, Any]:
    """--local: the Qwen3-8B config as the model folder (the plan's LoRA estimate reads it), ``n`` adapter
    folders (their adapter_config.json: the sim engine reads no weights), and the spec's engine command
    ($venv/bin/vllm) as a script that runs the sim engine with the rendered arguments."""
    lay.model.mkdir(parents=True, exist_ok=True)
    shutil.copy(REPO / "vllm_fleet/data/qwen3-8b-config.json", lay.model / "config.json")
    for i in range(n):
        d = lay.adapters / f"a{i:02d}"
        d.mkdir(parents=True, exist_ok=True)
        conf = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": NAME, "r": RANK,
                "lora_alpha": 2 * RANK, "lora_dropout": 0.0, "bias": "none",
                "target_modules": ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]}  # fmt: skip
        (d / "adapter_config.json").write_text(json.dumps(conf, indent=2))
    sim_engine_script(lay.root, "lora_fleet.py", f"--sim-token-delay {token_delay}")
    return {"adapters": n, "engine": f"sim engine, token delay {token_delay} s"}


def make_device_adapters(n: int) -> dict[str, Any]:
    """lora.py's make_adapters: ``n`` random rank-16 adapters of the Qwen3-8B shape (a00..) in /root/vf/adapters
    (kept when there: a rerun reuses them). In a child process: its CUDA context (and torch's cached blocks) go
    with it, before the engine sizes its share of the GPU."""
    t = time.monotonic()
    code = f"import json, sys; sys.path.insert(0, {str(HERE)!r}); import lora; print(json.dumps(lora.make_adapters({n})))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    if r.returncode:
        raise RunStop(f"make_adapters failed: {r.stdout[-1500:]}{r.stderr[-1500:]}")
    names = json.loads(r.stdout.strip().splitlines()[-1])
    size = sum(f.stat().st_size for f in (lora.ADAPTERS / names[0]).iterdir())
    return {"adapters": len(names), "seconds": round(time.monotonic() - t, 1), "bytes_each": size}


def free_port() -> int:
    from vllm_fleet.devtools.testing import free_port as fp

    return int(fp())


# ---- the run


class LabRun:
    """What a lab run through vllm-fleet does around its steps (this one's and sleep_fleet.py's ``Run``): the
    results (``res``), a check printed and kept (``check``), and ``main``: ``prepare``, ``steps``, ``stop``, then
    whatever happened the verdict (a run cut by a ``timeout``'s SIGTERM or an exception is a failed
    ``run_completed``), ``close``, ``save`` and the summary; exit 0 when every check passed."""

    res: dict[str, Any]
    tstart: float
    detail_chars: int | None = None  # how much of a failed check's detail is printed (None: all)

    def check(self, name: str, ok: bool, detail: Any = None) -> bool:
        self.res["checks"][name] = bool(ok) if detail is None else {"ok": bool(ok), "detail": detail}
        shown = "" if detail is None or ok else f": {str(detail)[: self.detail_chars]}"
        print(f"  [{'ok' if ok else 'FAILED'}] {name}" + shown, flush=True)
        return ok

    def elapsed(self) -> float:
        return time.monotonic() - self.tstart

    def prepare(self) -> None:
        raise NotImplementedError

    def steps(self) -> None:
        """The run's steps between ``prepare`` and ``stop``."""
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def save(self) -> None:
        raise NotImplementedError

    def summary(self) -> None:
        raise NotImplementedError

    def main(self) -> int:
        self.res["nofile"] = raise_nofile()
        try:
            self.prepare()
            self.steps()
            self.stop()
            self.check("run_completed", True)
        except RunStop as exc:
            print(f"stopped: {exc}", flush=True)
            self.check("run_completed", False, str(exc))
        finally:
            self.res["wall_s"] = round(self.elapsed(), 1)
            if "run_completed" not in self.res["checks"]:  # cut (a `timeout`'s SIGTERM) or an exception
                self.check("run_completed", False, f"cut in step {self.res.get('last_step')}")
            self.res["failed_checks"] = [
                k
                for k, v in self.res["checks"].items()
                if not (v is True or (isinstance(v, dict) and v["ok"]))
            ]
            self.close()
            self.save()
            self.summary()
        return 1 if self.res["failed_checks"] or not self.res["checks"] else 0


class Run(LabRun):
    def __init__(self, out: Path, a: argparse.Namespace, lay: Layout) -> None:
        self.out, self.a, self.lay = out, a, lay
        self.res: dict[str, Any] = {
            "mode": "local (sim engine, this machine's nginx)"
            if lay.local
            else "device (vLLM under the launcher)",
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "knobs": {k: v for k, v in vars(a).items() if k != "out"},
            "root": str(lay.root),
            "checks": {},
        }
        self.lp: subprocess.Popen[bytes] | None = None
        self.lis: Any = None
        self.t0 = 0.0
        self.gw: LabGateway | None = None
        self.narrow_key = ""
        self.tstart = time.monotonic()

    # -- bookkeeping

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        if self.lis is not None:
            self.res["notify"] = [{"t": round(t - self.t0, 3), **f} for t, f in self.lis.messages][-3000:]
        (self.out / "lora-fleet-results.json").write_text(json.dumps(self.res, indent=2, default=str))

    def step(self, title: str) -> None:
        self.res["last_step"] = title
        print(f"== {title} ({self.elapsed():.0f} s)", flush=True)

    @property
    def gw_url(self) -> str:
        return f"http://127.0.0.1:{self.lay.gw_port}"

    @property
    def engine_url(self) -> str:
        return f"http://127.0.0.1:{self.lay.engine_port}"

    def engine_pid(self) -> int | None:
        st = read_json(self.lay.state_dir / f"{NAME}.json") or {}
        return st.get("engine_pid")

    def adapter_state(self) -> dict[str, Any] | None:
        return read_json(self.lay.state_dir / "adapters" / f"{NAME}.json")

    def launcher_log(self) -> Path:
        return self.lay.log / "launcher-lora.log"

    # -- 1. adapters, spec, render, plan, fetch

    def prepare(self) -> None:
        import yaml

        self.step("1. adapters, spec, render, plan, fetch")
        if not self.lay.local:  # the instance takes 0.85 of the GPU
            self.res["gpu_apps_before"] = require_free_gpu()
        lay, n = self.lay, 9
        if not lay.local and (lay.adapters, lay.model) != (lora.ADAPTERS, lora.MODEL):
            raise RunStop(f"lora.py writes {lora.ADAPTERS} for {lora.MODEL}: not the spec's {lay.adapters}")
        self.res["adapters_made"] = (
            make_local_lab(lay, n, self.a.token_delay) if lay.local else make_device_adapters(n)
        )
        names = [f"a{i:02d}" for i in range(n)]
        sums = {x: sha256s(lay.adapters / x) for x in names}
        base = yaml.safe_load(SPEC.read_text())
        self.spec1 = spec_data(base, lay, self.a.max_num_seqs, {x: s for x, s in sums.items() if x != ADDED})
        self.spec2 = edit_adapters(self.spec1, ADDED, REMOVED, lay.adapters, sums[ADDED])
        specs = lay.root / "lora-specs"
        specs.mkdir(parents=True, exist_ok=True)
        self.spec_paths = {}
        for tag, d in (("initial", self.spec1), ("edited", self.spec2)):
            p = specs / f"{tag}.yml"
            p.write_text(yaml.safe_dump(d, sort_keys=False))
            self.spec_paths[tag] = p
        self.res["spec"] = {"carried": carried(self.spec1), "listed": listed(self.spec1),
                            "edited_carried": carried(self.spec2), "edited_listed": listed(self.spec2),
                            "max_num_seqs": self.a.max_num_seqs, "key_budget": self.spec1["gateway"]["limits"]}  # fmt: skip
        inst = self.render("initial")
        self.res["instance_config"] = {k: inst.get(k) for k in ("command", "environment", "service")}
        # the plan, with the model's config.json (the LoRA slots' estimate needs it)
        models_dir = str(lay.root / "models")
        rc, plan, err = cli_json(
            "plan", str(self.spec_paths["initial"]), "--json", "--models-dir", models_dir, *LAB
        )
        ip = (plan.get("instances") or [{}])[0] if isinstance(plan, dict) else {}
        self.res["plan"] = {"rc": rc, "ok": plan.get("ok") if isinstance(plan, dict) else None, "stderr": err,
                            **{k: ip.get(k) for k in ("lora", "lora_bytes", "kv_cache_bytes", "kv_capacity_tokens",
                                                      "weight_bytes", "suggested_max_num_seqs", "queue_bound")},
                            "warnings": plan.get("warnings") if isinstance(plan, dict) else None}  # fmt: skip
        text = vf_cli("plan", str(self.spec_paths["initial"]), "--models-dir", models_dir, *LAB).stdout
        self.res["plan_text"] = text
        lora_line = next((ln.strip() for ln in text.splitlines() if ln.strip().startswith("lora:")), None)
        self.res["plan"]["lora_line"] = lora_line
        print("   plan:", lora_line, flush=True)
        self.check("plan_ok_with_lora_estimate", rc == 0 and bool(ip.get("lora_bytes")), self.res["plan"])
        self.res["fetch_initial"] = self.fetch("initial")
        self.check("fetch_verified_adapters", self.res["fetch_initial"]["ok"], self.res["fetch_initial"])
        # install the instance config and its adapters file where the launcher reads them
        self.install("initial")
        self.save()

    def render(self, tag: str) -> dict[str, Any]:
        out = self.lay.render_dir(tag)
        shutil.rmtree(out, ignore_errors=True)
        r = vf_cli("render", str(self.spec_paths[tag]), "--out", str(out), *LAB)
        if r.returncode:
            raise RunStop(f"render {tag} failed: {r.stdout[-2000:]}{r.stderr[-2000:]}")
        return dict(json.loads(self.rendered_instance(tag).read_text()))

    def rendered_instance(self, tag: str, suffix: str = ".json") -> Path:
        return self.lay.rendered(tag, self.lay.etc / "instances" / f"{NAME}{suffix}")

    def fetch(self, tag: str) -> dict[str, Any]:
        """``vllm-fleet fetch --contract`` of the render's host contract: the model and every adapter folder
        hashed, checked against the spec's checksums and ranks."""
        contract = self.lay.rendered(tag, self.lay.etc / "host.json")
        t = time.monotonic()
        rc, doc, err = cli_json("fetch", "--contract", str(contract), "--json")
        ads = doc.get("adapters", []) if isinstance(doc, dict) else []
        return {"rc": rc, "seconds": round(time.monotonic() - t, 1), "stderr": err,
                "adapters": {x["adapter"]: len(x.get("files", {})) for x in ads},
                "ok": rc == 0 and len(ads) == len(self.spec1["adapters"])}  # fmt: skip

    def install(self, tag: str) -> None:
        """The render's instance config and adapters file to ROOT/etc/instances (the adapters file replaced
        atomically, as the play writes it)."""
        dest = self.lay.etc / "instances"
        dest.mkdir(parents=True, exist_ok=True)
        for suffix in (".json", ".adapters.json"):
            tmp = dest / f".{NAME}{suffix}.tmp"
            shutil.copy(self.rendered_instance(tag, suffix), tmp)
            os.replace(tmp, dest / f"{NAME}{suffix}")

    # -- 2. the launcher: READY=1 after the carried adapters

    def start(self) -> bool:
        from vllm_fleet.host.notify import NotifyListener

        self.step("2. the launcher")
        lay = self.lay
        lay.log.mkdir(parents=True, exist_ok=True)
        extra, how = resolver_pythonpath(lay.root)
        self.res["resolver_entry_point"] = how
        sock = str(lay.root / "notify-lora.sock")
        with contextlib.suppress(OSError):
            os.unlink(sock)
        self.lis = NotifyListener(sock)
        env = dict(os.environ, NOTIFY_SOCKET=sock, WATCHDOG_USEC=str(int(WATCHDOG_S * 1e6)))
        if extra:
            env["PYTHONPATH"] = os.pathsep.join(x for x in (extra, env.get("PYTHONPATH", "")) if x)
        self.t0 = time.monotonic()
        self.lp = subprocess.Popen(
            [sys.executable, "-m", "vllm_fleet.host.launcher", NAME, "--config-dir", str(lay.etc)],
            env=env, cwd=REPO, stdout=self.launcher_log().open("wb"), stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        try:
            i = self.lis.wait_for("READY", "1", timeout=self.a.ready_timeout)
        except TimeoutError:
            print("no READY=1; the launcher's log:", flush=True)
            print("\n".join(self.launcher_log().read_text(errors="replace").splitlines()[-60:]), flush=True)
            self.check(
                "ready", False, f"no READY=1 in {self.a.ready_timeout:g} s (launcher rc {self.lp.poll()})"
            )
            return False
        t_ready, f_ready = self.lis.messages[i]
        self.res["ready_s"] = round(t_ready - self.t0, 2)
        print(f"   READY=1 after {self.res['ready_s']} s", flush=True)
        statuses = [f.get("STATUS", "") for _, f in self.lis.messages[:i] if f.get("STATUS")]
        self.res["statuses_before_ready"] = statuses[-12:]
        self.res["ready_status"] = f_ready.get("STATUS")
        want = carried(self.spec1)
        # the launcher logs "ready after" just after READY=1; the engine's own lines come through it
        deadline = time.monotonic() + 10
        while (
            "ready after" not in self.launcher_log().read_text(errors="replace")
            and time.monotonic() < deadline
        ):
            time.sleep(0.2)
        log = self.launcher_log().read_text(errors="replace")
        ready_at = log.find("ready after")
        loaded_at = {x: log.find(f"Loaded new LoRA adapter: name '{x}'") for x in want}
        self.res["launcher_adapter_lines"] = [
            ln[-160:] for ln in log.splitlines() if re.search(r"adapter a\d\d (loaded|was)", ln)
        ]
        self.res["engine_loaded_lines"] = [
            ln[-200:] for ln in log.splitlines() if "Loaded new LoRA adapter" in ln
        ]
        deadline = time.monotonic() + 10
        while not self.engine_pid() and time.monotonic() < deadline:
            time.sleep(0.2)
        self.pid = self.engine_pid()
        self.res["engine_pid"] = self.pid
        self.res["adapter_state_at_ready"] = self.adapter_state()
        self.check("ready", True)
        self.check("loading_adapters_status_before_ready", any("loading adapters" in s.lower() for s in statuses),
                   statuses[-6:])  # fmt: skip
        self.check("ready_status_names_the_adapters",
                   str(f_ready.get("STATUS", "")).startswith(f"Serving {NAME} on 127.0.0.1:{lay.engine_port}, adapters "),
                   f_ready.get("STATUS"))  # fmt: skip
        self.check("engine_loaded_each_carried_adapter_before_ready",
                   ready_at > 0 and all(0 <= at < ready_at for at in loaded_at.values()), loaded_at)  # fmt: skip
        st = self.res["adapter_state_at_ready"] or {}
        self.check("adapter_state_file_lists_the_carried", st.get("loaded") == want, st)
        self.res["kv_lines"] = kv_lines(self.launcher_log())
        self.res["kv_parsed"] = kv_tokens(self.res["kv_lines"])
        self.res["nvidia_smi_ready"] = nvidia_smi()
        self.save()
        return True

    # -- 3. the gateway and its adapter answers

    def gateway(self) -> bool:
        import secrets

        self.step("3. the gateway")
        lay = self.lay
        self.gw = LabGateway(lay.host_root("initial"), lay.root / "nginx-prefix-lora", lay.log / "admission-lora.log",
                             vf=lay.root, nginx_root=lay.nginx_root)  # fmt: skip
        # a second key, of client `narrow` (the spec: the base and a00 only), in the same key file
        self.narrow_key = "sk-narrow-" + secrets.token_hex(20)
        for inc in self.gw.info["includes"]:
            with open(inc, "a") as f:
                f.write(f'"{self.narrow_key}" {NARROW_CLIENT};\n')
        try:
            self.gw.start(lay.gw_port)
        except (RuntimeError, TimeoutError) as exc:
            self.res["gateway_setup"] = self.gw.info
            self.check("gateway_up", False, str(exc)[-1500:])
            return False
        self.res["gateway_setup"] = self.gw.info
        self.check("gateway_up", True)
        key = self.gw.key
        g: dict[str, Any] = {}
        ml = model_list(self.gw_url, key)
        g["models"] = ml
        want = {x: NAME for x in listed(self.spec1)} | {NAME: None}
        self.check("gateway_lists_adapters_with_parent", ml == want, ml)
        st, doc = http("GET", self.gw_url + "/v1/models/a05", key=key)
        g["model_a05"] = doc
        self.check(
            "gateway_model_object_of_an_adapter",
            st == 200 and isinstance(doc, dict) and doc.get("parent") == NAME,
            doc,
        )
        # one request per adapter: the carried ones are loaded, the listed ones load through the resolver now
        g["first_requests"] = {x: completion(self.gw_url, x, key) for x in listed(self.spec1)}
        bad = {x: r for x, r in g["first_requests"].items() if r["status"] != 200 or r.get("model") != x}
        self.check("every_adapter_answers_through_the_gateway", not bad, bad or None)
        g["base"] = completion(self.gw_url, NAME, key)
        self.check("base_answers_through_the_gateway", g["base"]["status"] == 200, g["base"])
        g["unknown"] = completion(self.gw_url, "a99-unknown", key)
        self.check("unknown_adapter_404_json", g["unknown"]["status"] == 404 and g["unknown"].get("json") is True,
                   g["unknown"])  # fmt: skip
        g["narrow_a01"] = completion(self.gw_url, "a01", self.narrow_key)
        g["narrow_a00"] = completion(self.gw_url, "a00", self.narrow_key)
        self.check("narrow_key_403_for_an_adapter_it_lacks",
                   g["narrow_a01"]["status"] == 403 and g["narrow_a01"].get("code") == "model_not_allowed"
                   and g["narrow_a00"]["status"] == 200, {"a01": g["narrow_a01"], "a00": g["narrow_a00"]})  # fmt: skip
        st, doc = http(
            "POST", self.gw_url + "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/tmp"}, key
        )
        g["admin_path"] = {"status": st, "body": doc}
        self.check("admin_path_not_forwarded", st == 404 and isinstance(doc, dict), g["admin_path"])
        eng = model_list(self.engine_url, None) or {}
        g["engine_models"] = eng
        self.check("engine_loaded_every_adapter_after_first_requests",
                   sorted(x for x, p in eng.items() if p == NAME) == listed(self.spec1), eng)  # fmt: skip
        log = self.launcher_log().read_text(errors="replace")
        g["resolver_lines"] = [
            ln[-200:] for ln in log.splitlines() if "Resolved and loaded LoRA adapter" in ln
        ]
        resolved = sorted(set(listed(self.spec1)) - set(carried(self.spec1)))
        by_resolver = all(any(f"'{x}'" in ln for ln in g["resolver_lines"]) for x in resolved)
        self.check("listed_adapters_loaded_by_the_resolver", by_resolver, g["resolver_lines"])
        self.res["gateway"] = g
        self.save()
        return True

    # -- 4. the burst

    def burst(self) -> None:
        self.step("4. the burst")
        a = self.a
        n = a.lanes_per_seq * a.max_num_seqs
        ads = listed(self.spec1)

        def plan(lane: int, k: int) -> tuple[str, bool]:
            j = lane + k
            return (NAME if j % 2 == 0 else ads[(j // 2) % len(ads)]), lane % 2 == 0

        assert self.gw is not None
        pid, ready_before = self.engine_pid(), self.ready_count()
        sampler = Sampler(self.lay.engine_port)
        tb = time.monotonic()
        records, cut = asyncio.run(
            lanes("127.0.0.1", self.lay.gw_port, self.gw.key, n, plan, a.tokens, a.burst_s, a.drain_s)
        )
        te = time.monotonic()
        engine = sampler.done()
        t = tally(records, cut)
        wall = te - tb
        t.update(lanes=n, hold_s=a.burst_s, tokens=a.tokens, wall_s=round(wall, 1),
                 requests_per_s=round(len(records) / wall, 1) if wall else None, engine=engine)  # fmt: skip
        pings = [x for x, f in self.lis.messages if f.get("WATCHDOG") == "1"]
        t["watchdog"] = watchdog_report(pings, tb, te, WATCHDOG_S)
        t["status_lines"] = sorted(
            {str(f["STATUS"])[:120] for x, f in self.lis.messages if tb <= x <= te and "STATUS" in f}
        )[:20]
        t["verdict"] = burst_verdict(t)
        self.res["burst"] = t
        print(f"   {len(records)} requests over {n} lanes: {t['by_kind']} {t['by_status']}; refusals {t['refusals']}",
              flush=True)  # fmt: skip
        print(f"   TTFT base p50/p90 {t['groups']['base']['ttft_p50_s']}/{t['groups']['base']['ttft_p90_s']} s, "
              f"adapters {t['groups']['adapter']['ttft_p50_s']}/{t['groups']['adapter']['ttft_p90_s']} s; "
              f"engine {engine}", flush=True)  # fmt: skip
        for k, ok in t["verdict"].items():
            self.check(f"burst_{k}", ok, {kk: t[kk] for kk in ("by_kind", "refusals", "details", "cut")})
        self.check(
            "burst_watchdog_never_reached_watchdogsec", not t["watchdog"]["systemd_would_kill"], t["watchdog"]
        )
        self.check("burst_launcher_alive_same_engine_no_restart",
                   self.lp is not None and self.lp.poll() is None and self.engine_pid() == pid
                   and self.ready_count() == ready_before == 1,
                   {"pid_before": pid, "pid_after": self.engine_pid(), "ready_count": self.ready_count()})  # fmt: skip
        self.res["idle_after_burst_s"] = self.wait_idle(60)
        self.save()

    def ready_count(self) -> int:
        return sum(1 for _, f in self.lis.messages if f.get("READY") == "1")

    def wait_idle(self, timeout: float) -> float:
        t = time.monotonic()
        while time.monotonic() - t < timeout:
            text = metrics_text(self.lay.engine_port)
            vals = [
                float(v)
                for v in re.findall(r"^vllm:num_requests_(?:running|waiting)\{[^}]*\} (\S+)$", text, re.M)
            ]
            if vals and sum(vals) == 0:
                break
            time.sleep(1)
        return round(time.monotonic() - t, 1)

    # -- 5. the spec changes under steady traffic: adapters sync

    def sync(self) -> None:
        self.step("5. adapters sync under steady traffic")
        assert self.gw is not None
        a, lay = self.a, self.lay
        s: dict[str, Any] = {}
        pid = self.engine_pid()
        inst = self.render("edited")
        running = json.loads((lay.etc / "instances" / f"{NAME}.json").read_text())
        s["instance_config_unchanged"] = inst == running
        self.check("edited_spec_leaves_the_instance_config_unchanged", s["instance_config_unchanged"])
        s["fetch"] = self.fetch("edited")
        self.check(
            "fetch_verified_the_added_adapter",
            s["fetch"]["ok"] and ADDED in s["fetch"]["adapters"],
            s["fetch"],
        )
        s["admission_config_unchanged"] = (
            self.lay.rendered("edited", lay.etc / "gateway/admission.json").read_text()
            == self.lay.rendered("initial", lay.etc / "gateway/admission.json").read_text()
        )

        def plan(lane: int, k: int) -> tuple[str, bool]:
            return STEADY_MODELS[lane % len(STEADY_MODELS)], (lane + k) % 2 == 0

        steady = Steady("127.0.0.1", lay.gw_port, self.gw.key, plan, len(STEADY_MODELS), a.tokens)
        time.sleep(a.steady_s)
        t_change = time.monotonic()
        self.install("edited")  # what the play writes: the adapters file (the instance config is the same)
        t = time.monotonic()
        rc, doc, err = cli_json("adapters", "sync", NAME, "--config-dir", str(lay.etc), "--json")
        s["sync"] = {"rc": rc, "seconds": round(time.monotonic() - t, 3), "result": doc, "stderr": err}
        # the gateway's new config (the play's nginx reload): its routes and /v1/models from the edited spec
        t = time.monotonic()
        etc_nginx = self.lay.host_root("initial") / "etc/nginx"
        new = self.lay.host_root("edited") / "etc/nginx"
        shutil.copy(new / "conf.d/vllm-fleet.conf", etc_nginx / "conf.d/vllm-fleet.conf")
        shutil.rmtree(etc_nginx / "vllm-fleet")
        shutil.copytree(new / "vllm-fleet", etc_nginx / "vllm-fleet")
        chk = self.gw.nginx.check()
        self.gw.nginx.reload()
        s["gateway_reload"] = {"nginx_t_rc": chk.returncode, "stderr": chk.stderr[-500:],
                               "seconds": round(time.monotonic() - t, 3)}  # fmt: skip
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and ADDED not in (model_list(self.gw_url, self.gw.key) or {}):
            time.sleep(0.2)
        s["gateway_follows_after_s"] = round(time.monotonic() - t_change, 2)
        time.sleep(a.steady_s)
        records, cut = steady.stop()
        st = tally(records, cut)
        s["steady"] = st
        s["steady"]["during_change"] = tally([r for r in records if r["at"] >= t_change - 1], 0)["by_kind"]
        res = doc if isinstance(doc, dict) else {}
        print(f"   sync {s['sync']['seconds']} s: loaded {res.get('loaded')} unloaded {res.get('unloaded')}; steady "
              f"{st['requests']} requests {st['by_kind']}", flush=True)  # fmt: skip
        self.check("sync_loaded_the_added_unloaded_the_removed",
                   rc == 0 and res.get("loaded") == [ADDED] and res.get("unloaded") == [REMOVED] and not res.get("error"),
                   s["sync"])  # fmt: skip
        self.check("steady_traffic_no_failed_request",
                   st["requests"] > 0 and set(st["by_kind"]) == {"complete"} and cut == 0 and st["model_mismatch"] == 0,
                   {k: st[k] for k in ("by_kind", "by_status", "details", "cut")})  # fmt: skip
        self.check("sync_same_engine", self.engine_pid() == pid and self.ready_count() == 1,
                   {"pid_before": pid, "pid_after": self.engine_pid()})  # fmt: skip
        gw_models = model_list(self.gw_url, self.gw.key) or {}
        eng = model_list(self.engine_url, None) or {}
        s["gateway_models"], s["engine_models"] = gw_models, eng
        self.check("gateway_models_follow", ADDED in gw_models and REMOVED not in gw_models
                   and gw_models.get(ADDED) == NAME, gw_models)  # fmt: skip
        self.check("engine_models_follow", eng.get(ADDED) == NAME and REMOVED not in eng, eng)
        s["added_request"] = completion(self.gw_url, ADDED, self.gw.key)
        s["removed_request"] = completion(self.gw_url, REMOVED, self.gw.key)
        add, rem = s["added_request"], s["removed_request"]
        self.check("added_adapter_answers", add["status"] == 200 and add.get("model") == ADDED, add)
        self.check("removed_adapter_404_json", rem["status"] == 404 and rem.get("json") is True, rem)
        s["adapter_state"] = self.adapter_state()
        now = (s["adapter_state"] or {}).get("loaded", [])
        self.check("adapter_state_file_follows", ADDED in now and REMOVED not in now, s["adapter_state"])
        rc2, doc2, _ = cli_json("adapters", "sync", NAME, "--config-dir", str(lay.etc), "--json")
        s["sync_again"] = doc2
        self.check(
            "second_sync_changes_nothing",
            rc2 == 0 and isinstance(doc2, dict) and doc2.get("changed") is False,
            doc2,
        )
        self.res["sync"] = s
        self.save()

    # -- 6. the exporter and the engine's LoRA series

    def exporter(self) -> None:
        self.step("6. exporter")
        lay = self.lay
        r = vf_cli("exporter", "--once", "--no-nvml", "--state-dir", str(lay.state_dir),
                   "--config-dir", str(lay.etc / "instances"), "--worker-config-dir", "", "--access-log", "",
                   "--drain-state", "", "--manifest", "", timeout=120)  # fmt: skip
        lines = sorted(
            ln for ln in r.stdout.splitlines() if ln.startswith("vllm_fleet_instance_adapter_loaded{")
        )
        want = sorted(
            f'vllm_fleet_instance_adapter_loaded{{adapter="{x}",instance="{NAME}",model="{NAME}"}} 1.0'
            for x in carried(self.spec2)
        )
        info = lora_info_lines(metrics_text(lay.engine_port))
        self.res["exporter"] = {
            "rc": r.returncode,
            "stderr": r.stderr[-1500:],
            "adapter_loaded": lines,
            "engine_lora_requests_info": info[-20:],
            "engine_lora_requests_info_series": len(info),
        }
        for ln in lines:
            print("  ", ln, flush=True)
        self.check("exporter_reports_the_carried_adapters_loaded", r.returncode == 0 and lines == want,
                   {"got": lines, "want": want})  # fmt: skip
        self.check("engine_exports_lora_requests_info", bool(info), info)
        self.save()

    # -- 7. the stop

    def stop(self) -> None:
        self.step("7. stop")
        if self.lp is None:
            return
        self.res["nvidia_smi_before_stop"] = nvidia_smi()
        n_before = len(self.lis.messages) if self.lis else 0
        pid = self.engine_pid()
        # streams in flight when SIGTERM comes (through the gateway, the base and a00): the drain finishes them
        key = self.gw.key if self.gw else None
        busy = Steady("127.0.0.1", self.lay.gw_port, key, lambda i, k: (STEADY_MODELS[i % 2], True), 4,
                      4 * self.a.tokens) if key else None  # fmt: skip
        time.sleep(max(1.0, self.a.steady_s / 2))
        t_term = time.monotonic()
        if busy is not None:
            busy.ev.set()  # no new request from now on: the ones in flight meet the drain
        rc, took = stop_launcher(self.lp, 90)
        if busy is not None:
            records, cut = busy.stop()
            # streaming at the SIGTERM: the first bytes came before it, the answer ended after it
            inflight = [r for r in records if r.get("first_byte_at", t_term) < t_term < r["at"]]
            after = [r for r in records if r["start"] > t_term]
            self.res["drain"] = {
                "in_flight_at_sigterm": len(inflight),
                "in_flight_outcomes": dict(Counter(r["kind"] for r in inflight)),
                "started_after_sigterm": dict(Counter(f"{r['status']} {r['kind']}" for r in after)),
                "cut": cut,
            }
            self.check("drain_finished_the_streams_in_flight",
                       bool(inflight) and all(r["kind"] == "complete" for r in inflight), self.res["drain"])  # fmt: skip
        msgs = [f for _, f in self.lis.messages[n_before:]] if self.lis else []
        stopping = [
            round(t - self.t0, 2)
            for t, f in (self.lis.messages[n_before:] if self.lis else [])
            if f.get("STOPPING") == "1"
        ]
        self.res["stop"] = {"rc": rc, "seconds": took, "stopping_at_s": stopping,
                            "statuses": [str(f["STATUS"])[:160] for f in msgs if "STATUS" in f][:10],
                            "adapter_state_after": self.adapter_state()}  # fmt: skip
        deadline = time.monotonic() + 15  # the engine core's CUDA context goes a moment after the launcher
        while (smi := nvidia_smi()).get("apps") and time.monotonic() < deadline:
            time.sleep(1)
        self.res["nvidia_smi_after_stop"] = smi
        gone = pid is not None and not Path(f"/proc/{pid}").exists()
        print(
            f"   launcher rc {rc} after {took} s; STOPPING=1 at {stopping}; drain {self.res.get('drain')}",
            flush=True,
        )
        self.check("stop_exit_0_with_drain", rc == 0 and bool(stopping), self.res["stop"])
        self.check("engine_exited", gone, pid)
        if not self.lay.local:
            apps = self.res["nvidia_smi_after_stop"].get("apps")
            self.check("gpu_memory_freed_after_stop", not apps, self.res["nvidia_smi_after_stop"])
        self.check("adapter_state_empty_after_stop", (self.res["stop"]["adapter_state_after"] or {}).get("loaded") == [],
                   self.res["stop"]["adapter_state_after"])  # fmt: skip
        self.lp = None

    def close(self) -> None:
        if self.lp is not None:
            with contextlib.suppress(Exception):
                stop_launcher(self.lp, 20)  # a `timeout` cut: little time left in the call
        if self.gw is not None:
            with contextlib.suppress(Exception):
                self.gw.stop()
        if self.lis is not None:
            self.save()
            self.lis.close()
        keep_logs(
            self.lay.log, self.out, ["launcher-lora.log", "admission-lora.log", "nginx-error.log"], 300, 400
        )
        for tag, p in getattr(self, "spec_paths", {}).items():
            shutil.copy(p, self.out / f"spec-{tag}.yml")

    def steps(self) -> None:
        if self.start() and self.gateway():
            self.burst()
            self.sync()
            self.exporter()

    def summary(self) -> None:
        summary(self.res)


def keep_logs(src: Path, out: Path, names: list[str], head: int, tail: int) -> None:
    """Copy the logs ``names`` of ``src`` that exist to ``out``, a long one cut to its first ``head`` and last
    ``tail`` lines (what the results keep of a run)."""
    for f in names:
        p = src / f
        if p.exists():
            lines = p.read_text(errors="replace").splitlines()
            keep = lines if len(lines) <= head + tail else [*lines[:head], "...", *lines[-tail:]]
            (out / f).write_text("\n".join(keep) + "\n")


def summary(res: dict[str, Any]) -> None:
    print("=== lora-fleet summary", flush=True)
    print(f"{res['mode']}; wall {res.get('wall_s')} s; READY after {res.get('ready_s')} s; plan: "
          f"{(res.get('plan') or {}).get('lora_line')}; KV {res.get('kv_parsed')}")  # fmt: skip
    b = res.get("burst")
    if b:
        g = b["groups"]
        print(f"burst {b['lanes']} lanes × {b['hold_s']:g} s: {b['requests']} requests {b['by_kind']} {b['by_status']}; "
              f"TTFT base p50/p90 {g['base']['ttft_p50_s']}/{g['base']['ttft_p90_s']} s, adapters "
              f"{g['adapter']['ttft_p50_s']}/{g['adapter']['ttft_p90_s']} s; longest ping gap "
              f"{b['watchdog']['max_ping_gap_s']} s; engine peak running {b['engine']['peak_running']} waiting "
              f"{b['engine']['peak_waiting']}, adapters in a batch ≤ {b['engine']['most_adapters_running']}, "
              f"lora_requests_info series {b['engine']['lora_info_series_last']}")  # fmt: skip
    s = res.get("sync")
    if s:
        r = s["sync"]["result"] if isinstance(s["sync"]["result"], dict) else {}
        print(f"sync {s['sync']['seconds']} s: loaded {r.get('loaded')} unloaded {r.get('unloaded')}; steady "
              f"{s['steady']['requests']} requests {s['steady']['by_kind']}; gateway follows after "
              f"{s.get('gateway_follows_after_s')} s")  # fmt: skip
    print(f"stop {res.get('stop', {}).get('rc')} in {res.get('stop', {}).get('seconds')} s; "
          f"checks {len(res['checks']) - len(res.get('failed_checks', []))}/{len(res['checks'])} passed; "
          f"failed: {res.get('failed_checks')}", flush=True)  # fmt: skip


def parse(argv: list[str]) -> argparse.Namespace:
    local = "--local" in argv
    env = os.environ.get
    ap = argparse.ArgumentParser(prog="lora_fleet.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("out", type=Path)
    ap.add_argument("--local", action="store_true", help="the sim engine and this machine's nginx (no GPU)")
    ap.add_argument(
        "--token-delay", type=float, default=0.01, help="--local: the sim engine's seconds per step"
    )
    ap.add_argument("--max-num-seqs", type=int, default=int(env("VF_MAX_NUM_SEQS", "8" if local else "64")))
    ap.add_argument("--lanes-per-seq", type=int, default=int(env("VF_LANES_PER_SEQ", "6")),
                    help="burst lanes per max_num_seqs")  # fmt: skip
    ap.add_argument("--burst-s", type=float, default=float(env("VF_BURST_S", "8" if local else "40")))
    ap.add_argument("--drain-s", type=float, default=float(env("VF_DRAIN_S", "30")),
                    help="after the burst, what still runs this long is cut")  # fmt: skip
    ap.add_argument("--tokens", type=int, default=int(env("VF_TOKENS", "16" if local else "128")))
    ap.add_argument("--steady-s", type=float, default=float(env("VF_STEADY_S", "2" if local else "5")),
                    help="steady traffic before and after the change")  # fmt: skip
    ap.add_argument(
        "--ready-timeout", type=float, default=float(env("VF_READY_TIMEOUT", "60" if local else "420"))
    )
    return ap.parse_args(argv)


def layout(a: argparse.Namespace) -> Layout:
    if not a.local:
        return Layout(VF, local=False)
    # a short folder: the admission service's unix sockets live under it (at most 107 bytes a path)
    root = Path(tempfile.mkdtemp(prefix="vf-lora-", dir="/tmp"))
    return Layout(root, local=True, engine_port=free_port(), gw_port=free_port(), stub_port=free_port(),
                  admission_metrics_port=free_port(), nginx_root=Path("/"))  # fmt: skip


if __name__ == "__main__":
    # SIGTERM (`timeout` at the end of the call): the finally blocks stop the launcher and write the results
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args = parse(sys.argv[1:])
    lay = layout(args)
    try:
        rc = Run(args.out, args, lay).main()
    finally:
        if lay.local:
            shutil.rmtree(lay.root, ignore_errors=True)
    sys.exit(rc)
