#!/usr/bin/env python3
"""Per-key limits through a real local gateway: bursts, fair sharing between keys, request classes.

The subject is the gateway's admission (docs/gateway.md "Per-key limits", "Request classes"): the rendered
nginx (``vllm-fleet render``) asking the admission service (``vllm-fleet admission``) before a request reaches
an engine. The engine is ONE SIM ENGINE (vllm_fleet.devtools.sim_engine: vLLM's HTTP API, a continuous-batching
loop of ``--token-delay`` seconds per step, no model), run with ``--max-num-seqs C --max-num-queued-reqs C``:
the model's capacity is C (8) in flight, every admitted request runs at once, and what does not fit waits in
the gateway. The engines' own priority scheduling (what a class's priority does inside vLLM) is NOT measured
here: the sim engine ignores the priority the gateway sends; only the gateway's queue order is.

Two gateways rendered from the same spec but for ``gateway.classes`` run side by side in front of the engine
(only one is loaded at a time): ``classes`` ({interactive: {priority: 0}, batch: {priority: 10}}) and
``plain`` (none). Every request is a streamed completion of --tokens tokens (ignore_eos) on a new connection,
no client retries; TTFT is the time from opening the connection to the first SSE ``data:`` event; a request
succeeds when it ends with ``data: [DONE]``.

1. burst: one key, --burst requests at once on an idle fleet (plain completions), --burst-rounds times:
   how many were served, client latency p50/p90/max, and the gateway's admission wait (the service's
   ``vllm_fleet_gateway_key_queue_wait_seconds`` histogram: exact mean, p50/p90 interpolated in its buckets).
2. fairness: a polite key with 4 lanes alone, then beside a greedy key with 200 lanes (each lane sends its
   next request when the last one ends), --phase-seconds each, alternating for --rounds rounds: the polite
   key's success rate and TTFT p50/p90 in both phases, the greedy key's success rate and refusals (429s with
   the service's reasons).
3. classes: an interactive lane group (4, ``X-Request-Class: interactive``) beside a batch group (200,
   ``batch``), on the gateway with classes and on the one without, (a) each group with its own key (fair
   sharing by key already protects the interactive key; the class only breaks ties) and (b) both groups on
   the SAME key (only the class priority orders one key's queue), interleaved for --rounds rounds.

A phase counts the requests that started after --warmup seconds (the greedy lanes have filled the queue) and
before its end; it then lets every started request finish and waits until the service holds nothing.

    PYTHONPATH=$PWD .venv/bin/python tools/fairness_bench.py --phase-seconds 12 --rounds 2 --json /tmp/fair.json
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vllm_fleet.devtools.gateway_testing import Gateway, gateway_spec, wait_for
from vllm_fleet.devtools.testing import SimEngineProcess

KEYS = {
    "burst": "sk-burst-" + "b" * 32,
    "polite": "sk-polite-" + "p" * 32,
    "greedy": "sk-greedy-" + "g" * 32,
    "chat": "sk-chat-" + "c" * 32,
    "jobs": "sk-jobs-" + "j" * 32,
    "mixed": "sk-mixed-" + "m" * 32,
}
CLASSES = {"interactive": {"priority": 0}, "batch": {"priority": 10}}
# the documented defaults, written out so that the output says what was measured
LIMITS = {"queue_wait_seconds": 20, "max_queued_per_key": 256, "default_key": {"max_in_flight": 64}}


def key_id(client: str) -> str:
    return f"{client}/{hashlib.sha256(KEYS[client].encode()).hexdigest()[:8]}"


@dataclass
class Result:
    start: float  # seconds since the phase began
    status: int | str  # the HTTP status, or the exception's text
    ttft: float | None  # to the first SSE data event (streams)
    seconds: float  # to the end of the answer
    ok: bool  # 200 and complete ([DONE] / choices)
    message: str = ""  # an error body's message


MESSAGE = re.compile(rb'"message"\s*:\s*"((?:[^"\\]|\\.)*)"')


MODEL = "tiny-qwen3"  # the sim engine's served name


async def request(
    host: str, port: int, key: str, cls: str, tokens: int, stream: bool, t_phase: float, model: str = MODEL
) -> Result:
    """One completion on a new connection (Connection: close; the answer is read to EOF)."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    body = {"model": model, "prompt": "once upon a time", "max_tokens": tokens, "ignore_eos": True}
    if stream:
        body["stream"] = True
    raw = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {key}\r\nContent-Length: {len(raw)}\r\nConnection: close\r\n"
        + (f"X-Request-Class: {cls}\r\n" if cls else "")
        + "\r\n"
    )
    ttft: float | None = None
    status: int | str = 0
    data = b""
    writer = None
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 10)
        writer.write(head.encode() + raw)
        line = await reader.readline()
        status = int(line.split()[1])
        while (await reader.readline()) not in (b"\r\n", b""):
            pass
        while chunk := await reader.read(65536):
            data += chunk
            if ttft is None and b"data: " in data:
                ttft = loop.time() - t0
    except Exception as exc:  # a dropped connection is a failed request, counted as such
        status = f"{type(exc).__name__}: {exc}"
    finally:
        if writer is not None:
            writer.close()
    ok = status == 200 and (b"data: [DONE]" in data if stream else b'"choices"' in data)
    m = MESSAGE.search(data) if status != 200 else None
    msg = m.group(1).decode("utf-8", "replace") if m else ""
    return Result(round(t0 - t_phase, 4), status, ttft, loop.time() - t0, ok, msg)


@dataclass
class Group:
    """``lanes`` clients of one key, each sending its next request when the last one ended."""

    name: str
    key: str  # a name of KEYS (or of run_phase's ``keys``)
    lanes: int
    cls: str = ""  # X-Request-Class ("" : none)
    tokens: int = 0  # max_tokens of its requests (0: the phase's)


async def run_phase(
    url: str,
    groups: list[Group],
    seconds: float,
    warmup: float,
    tokens: int,
    *,
    keys: dict[str, str] | None = None,
    model: str = MODEL,
    drain: float | None = None,
) -> dict[str, list[Result]]:
    """The groups' lanes for warmup + seconds; the requests started in [warmup, warmup + seconds) per group.
    Lanes stop sending at the end and every started request is awaited; with ``drain``, what still runs
    ``drain`` s after the end is cut (a failed Result of status ``cut``)."""
    host, port = url.removeprefix("http://").split(":")
    loop = asyncio.get_running_loop()
    t_phase = loop.time()
    end = t_phase + warmup + seconds
    out: dict[str, list[Result]] = {g.name: [] for g in groups}
    keys = KEYS if keys is None else keys

    async def lane(g: Group) -> None:
        while loop.time() < end:
            t = loop.time()
            try:
                r = await request(
                    host, int(port), keys[g.key], g.cls, g.tokens or tokens, True, t_phase, model
                )
            except asyncio.CancelledError:
                out[g.name].append(Result(round(t - t_phase, 4), "cut", None, loop.time() - t, False))
                raise
            out[g.name].append(r)
            if not r.ok and r.seconds < 0.05:
                await asyncio.sleep(0.05)  # a refusal at once: do not spin (a real client would back off)

    tasks = [asyncio.create_task(lane(g)) for g in groups for _ in range(g.lanes)]
    done, pending = await asyncio.wait(tasks, timeout=None if drain is None else warmup + seconds + drain)
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    for t in done:
        t.result()  # a lane's own error (not a failed request: those are Results) is raised
    return {name: [r for r in rs if r.start >= warmup] for name, rs in out.items()}


# ---------------------------------------------------------------- the admission service's metrics


def metrics(g: Gateway) -> dict[str, float]:
    with urllib.request.urlopen(g.admission_metrics_url, timeout=5) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def sample(m: dict[str, float], name: str, **labels: str) -> float:
    total = 0.0
    for k, v in m.items():
        base, _, rest = k.partition("{")
        if base == name and all(f'{lk}="{lv}"' in rest for lk, lv in labels.items()):
            total += v
    return total


def idle(g: Gateway, timeout: float = 60) -> bool:
    """The service holds nothing: no key in flight or waiting."""

    def check() -> bool:
        m = metrics(g)
        return (
            sample(m, "vllm_fleet_gateway_key_in_flight") == 0
            and sample(m, "vllm_fleet_gateway_key_queued") == 0
        )

    return wait_for(check, timeout, 0.2)


def refusals(before: dict[str, float], after: dict[str, float], key: str) -> dict[str, int]:
    """Refusals of ``key`` between two scrapes, by the service's reason."""
    out: dict[str, int] = {}
    for k, v in after.items():
        base, _, rest = k.partition("{")
        if base == "vllm_fleet_gateway_key_refused_total" and f'key="{key}"' in rest:
            n = int(v - before.get(k, 0.0))
            if n:
                out[re.search(r'reason="([^"]*)"', rest).group(1)] = n  # type: ignore[union-attr]
    return out


def hist_quantile(before: dict[str, float], after: dict[str, float], key: str, q: float) -> float:
    """``q`` of the key's queue-wait histogram between two scrapes, linear within a bucket (Prometheus's
    histogram_quantile)."""
    name = "vllm_fleet_gateway_key_queue_wait_seconds_bucket"
    buckets: list[tuple[float, float]] = []
    for k, v in after.items():
        base, _, rest = k.partition("{")
        if base == name and f'key="{key}"' in rest:
            le = re.search(r'le="([^"]*)"', rest).group(1)  # type: ignore[union-attr]
            buckets.append((math.inf if le == "+Inf" else float(le), v - before.get(k, 0.0)))
    buckets.sort()
    total = buckets[-1][1] if buckets else 0
    if not total:
        return math.nan
    rank, lo, below = q * total, 0.0, 0.0
    for le, n in buckets:
        if n >= rank:
            if math.isinf(le):
                return lo
            return lo + (le - lo) * (rank - below) / max(n - below, 1e-9)
        lo, below = le, n
    return lo


# ---------------------------------------------------------------- figures


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return math.nan
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(p / 100 * len(s)) - 1))]


def summary(rs: list[Result]) -> dict[str, Any]:
    ttft = [r.ttft for r in rs if r.ok and r.ttft is not None]
    codes: dict[str, int] = {}
    for r in rs:
        if not r.ok:
            why = str(r.status) + (f" {re.sub(r'[0-9.]+', 'N', r.message)[:80]}" if r.message else "")
            codes[why] = codes.get(why, 0) + 1
    return {
        "requests": len(rs),
        "ok": sum(r.ok for r in rs),
        "success": sum(r.ok for r in rs) / len(rs) if rs else math.nan,
        "ttft_p50": pct(ttft, 50),
        "ttft_p90": pct(ttft, 90),
        "ttft_max": max(ttft, default=math.nan),
        "failed": codes,
    }


def ms(x: float) -> str:
    return "   n/a" if math.isnan(x) else f"{x * 1000:6.0f}"


def line(label: str, s: dict[str, Any]) -> str:
    fails = ", ".join(f"{n} × {why}" for why, n in sorted(s["failed"].items())) or "none"
    return (
        f"  {label:<34} {s['ok']:>5}/{s['requests']:<5} ok ({s['success'] * 100:5.1f} %)  TTFT p50 "
        f"{ms(s['ttft_p50'])} ms  p90 {ms(s['ttft_p90'])} ms  max {ms(s['ttft_max'])} ms;  failed: {fails}"
    )


def spread(xs: list[float]) -> str:
    xs = [x for x in xs if not math.isnan(x)]
    if not xs:
        return "n/a"
    if len(xs) == 1:
        return f"{xs[0] * 1000:.0f} ms"
    return f"{statistics.median(xs) * 1000:.0f} ms ({', '.join(f'{x * 1000:.0f}' for x in xs)})"


# ---------------------------------------------------------------- the bench


class Bench:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.dir = Path(tempfile.mkdtemp(prefix="vf-fairbench-"))
        model = self.dir / "model"
        model.mkdir()
        (model / "config.json").write_text(
            '{"architectures": ["Qwen3ForCausalLM"], "max_position_embeddings": 2048}\n'
        )
        c = str(a.capacity)
        self.engine = SimEngineProcess(
            model,
            workdir=self.dir,
            extra=["--max-num-seqs", c, "--max-num-queued-reqs", c],
            token_delay=a.token_delay,
        )
        self.gateways: dict[str, Gateway] = {}

    def start(self) -> None:
        self.engine.start().wait_ready(60)
        keys = self.dir / "keys"
        keys.write_text("".join(f'"{k}" {client};\n' for client, k in KEYS.items()))
        for name, classes in (("plain", {}), ("classes", CLASSES)):
            wd = self.dir / name
            wd.mkdir()
            spec = gateway_spec(
                [{"name": "e", "port": self.engine.port, "max_num_seqs": self.a.capacity,
                  "max_num_queued_reqs": self.a.capacity}],
                wd,
                api_keys_file=str(keys),
                rate_limit={"per_ip_rps": 100000, "per_ip_burst": 100000},
                limits=LIMITS,
                classes=classes,
            )  # fmt: skip
            self.gateways[name] = Gateway(spec, wd).start()

    def stop(self) -> None:
        for g in self.gateways.values():
            g.stop()
        self.engine.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def phase(self, gw: str, groups: list[Group]) -> dict[str, Any]:
        g = self.gateways[gw]
        assert idle(g), "the admission service still holds requests before the phase"
        before = metrics(g)
        res = asyncio.run(run_phase(g.url, groups, self.a.phase_seconds, self.a.warmup, self.a.tokens))
        if not idle(g):
            print("  (!) the admission service still holds requests 60 s after the phase", flush=True)
        after = metrics(g)
        out: dict[str, Any] = {}
        for grp in groups:
            s = summary(res[grp.name])
            s["refused_by_reason"] = refusals(before, after, key_id(grp.key))
            out[grp.name] = s
        return out

    # ------------------------------------------------------------ 1. burst

    def burst(self) -> dict[str, Any]:
        a, g = self.a, self.gateways["plain"]
        print(f"\n1. burst: one key, {a.burst} plain completions of {a.tokens} tokens at once on an idle fleet "
              f"(capacity {a.capacity}), {a.burst_rounds} rounds", flush=True)  # fmt: skip
        rounds = []
        kid = key_id("burst")
        for i in range(a.burst_rounds):
            assert idle(g)
            before = metrics(g)

            async def go() -> list[Result]:
                host, port = g.url.removeprefix("http://").split(":")
                t = asyncio.get_running_loop().time()
                return await asyncio.gather(
                    *(request(host, int(port), KEYS["burst"], "", a.tokens, False, t) for _ in range(a.burst))
                )

            res = asyncio.run(go())
            assert idle(g)
            after = metrics(g)
            lat = [r.seconds for r in res]
            n = sample(after, "vllm_fleet_gateway_key_queue_wait_seconds_count", key=kid) - sample(
                before, "vllm_fleet_gateway_key_queue_wait_seconds_count", key=kid
            )
            tot = sample(after, "vllm_fleet_gateway_key_queue_wait_seconds_sum", key=kid) - sample(
                before, "vllm_fleet_gateway_key_queue_wait_seconds_sum", key=kid
            )
            r = {
                "served": sum(x.ok for x in res),
                "requests": len(res),
                "failed": summary(res)["failed"],
                "latency_p50": pct(lat, 50),
                "latency_p90": pct(lat, 90),
                "latency_max": max(lat),
                "latency_min": min(lat),
                "admitted_by_service": n,
                "wait_mean": tot / n if n else math.nan,
                "wait_p50": hist_quantile(before, after, kid, 0.5),
                "wait_p90": hist_quantile(before, after, kid, 0.9),
                "refused_by_reason": refusals(before, after, kid),
            }
            rounds.append(r)
            print(f"  round {i + 1}: served {r['served']}/{r['requests']}; client latency p50 "
                  f"{r['latency_p50']:.2f} s, p90 {r['latency_p90']:.2f} s, max {r['latency_max']:.2f} s "
                  f"(min {r['latency_min']:.2f} s); gateway admission wait ({int(n)} admitted): mean "
                  f"{r['wait_mean']:.2f} s, p50 ≈ {r['wait_p50']:.2f} s, p90 ≈ {r['wait_p90']:.2f} s "
                  f"(histogram buckets); refused {r['refused_by_reason'] or 'none'}", flush=True)  # fmt: skip
        return {"rounds": rounds}

    # ------------------------------------------------------------ 2. fairness

    def fairness(self) -> dict[str, Any]:
        a = self.a
        print(f"\n2. fairness: polite key 4 lanes alone vs beside a greedy key with {a.greedy} lanes (streams, "
              f"{a.phase_seconds:g} s per phase after {a.warmup:g} s warm-up, {a.rounds} rounds)", flush=True)  # fmt: skip
        polite = Group("polite", "polite", 4)
        greedy = Group("greedy", "greedy", a.greedy)
        rounds = []
        for i in range(a.rounds):
            order = ["alone", "beside"] if i % 2 == 0 else ["beside", "alone"]
            r: dict[str, Any] = {}
            for which in order:
                r[which] = self.phase("plain", [polite] if which == "alone" else [polite, greedy])
                print(line(f"round {i + 1} polite {which}", r[which]["polite"]), flush=True)
                if which == "beside":
                    gs = r[which]["greedy"]
                    print(line(f"round {i + 1} greedy (beside)", gs) + f"; refused by reason: "
                          f"{gs['refused_by_reason'] or 'none'}", flush=True)  # fmt: skip
            rounds.append(r)
        print("  polite TTFT p50 alone:  " + spread([r["alone"]["polite"]["ttft_p50"] for r in rounds]))
        print("  polite TTFT p50 beside: " + spread([r["beside"]["polite"]["ttft_p50"] for r in rounds]))
        print("  polite TTFT p90 alone:  " + spread([r["alone"]["polite"]["ttft_p90"] for r in rounds]))
        print("  polite TTFT p90 beside: " + spread([r["beside"]["polite"]["ttft_p90"] for r in rounds]))
        print("  greedy TTFT p50 beside: " + spread([r["beside"]["greedy"]["ttft_p50"] for r in rounds]))
        return {"rounds": rounds}

    # ------------------------------------------------------------ 3. classes

    def classes(self) -> dict[str, Any]:
        a = self.a
        print(f"\n3. classes: interactive 4 lanes beside batch {a.greedy} lanes, gateway with classes "
              f"{json.dumps(CLASSES)} vs without ({a.rounds} rounds, interleaved)", flush=True)  # fmt: skip
        configs = {
            "two keys, classes": ("classes", "chat", "jobs"),
            "two keys, no classes": ("plain", "chat", "jobs"),
            "one key, classes": ("classes", "mixed", "mixed"),
            "one key, no classes": ("plain", "mixed", "mixed"),
        }
        names = list(configs)
        res: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
        for i in range(a.rounds):
            for name in names if i % 2 == 0 else names[::-1]:
                gw, ik, bk = configs[name]
                r = self.phase(
                    gw, [Group("interactive", ik, 4, "interactive"), Group("batch", bk, a.greedy, "batch")]
                )
                res[name].append(r)
                print(line(f"round {i + 1} {name}: interactive", r["interactive"]), flush=True)
                print(line(f"round {i + 1} {name}: batch", r["batch"]) + f"; refused by reason: "
                      f"{r['batch']['refused_by_reason'] or 'none'}", flush=True)  # fmt: skip
        for name in names:
            print(f"  {name:<22} interactive TTFT p50 {spread([r['interactive']['ttft_p50'] for r in res[name]])}"
                  f"; p90 {spread([r['interactive']['ttft_p90'] for r in res[name]])}; batch TTFT p50 "
                  f"{spread([r['batch']['ttft_p50'] for r in res[name]])}")  # fmt: skip
        return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--capacity", type=int, default=8, help="the sim engine's max-num-seqs and queue bound")
    ap.add_argument("--token-delay", type=float, default=0.006, help="the sim engine's seconds per step")
    ap.add_argument("--tokens", type=int, default=32, help="max_tokens of every request")
    ap.add_argument("--burst", type=int, default=100)
    ap.add_argument("--burst-rounds", type=int, default=3)
    ap.add_argument("--greedy", type=int, default=200, help="lanes of the greedy / batch key")
    ap.add_argument("--phase-seconds", type=float, default=12)
    ap.add_argument("--warmup", type=float, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--only", default="burst,fairness,classes", help="comma-separated parts to run")
    ap.add_argument("--json", help="write every figure to this file")
    a = ap.parse_args()

    b = Bench(a)
    t0 = time.monotonic()
    load0 = os.getloadavg()
    out: dict[str, Any] = {"args": vars(a), "limits": LIMITS, "classes": CLASSES}
    try:
        b.start()
        print(f"SIM ENGINE (vllm_fleet.devtools.sim_engine, not vLLM): --max-num-seqs {a.capacity} "
              f"--max-num-queued-reqs {a.capacity}, token delay {a.token_delay} s; model capacity {a.capacity} "
              f"in flight; gateway limits {json.dumps(LIMITS)}. The subject is the gateway's admission; the "
              f"engines' own priority scheduling is not measured.", flush=True)  # fmt: skip
        # one request alone: what a stream costs without waiting
        one = [Group("one", "polite", 1)]
        alone = asyncio.run(run_phase(b.gateways["plain"].url, one, 2, 0, a.tokens))["one"]
        out["single"] = summary(alone)
        full = [r.seconds for r in alone if r.ok]
        print(f"one stream alone: TTFT p50 {ms(out['single']['ttft_p50']).strip()} ms, whole stream p50 "
              f"{statistics.median(full) * 1000:.0f} ms ({len(full)} requests)", flush=True)  # fmt: skip
        parts = a.only.split(",")
        if "burst" in parts:
            out["burst"] = b.burst()
        if "fairness" in parts:
            out["fairness"] = b.fairness()
        if "classes" in parts:
            out["classes_runs"] = b.classes()
    finally:
        b.stop()
    out["wall_seconds"] = time.monotonic() - t0
    out["load_average"] = {"start": load0, "end": os.getloadavg()}
    print(f"\nwall time {out['wall_seconds']:.0f} s; load average (1, 5, 15 min) at the start "
          f"{' '.join(f'{x:.2f}' for x in load0)}, at the end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")  # fmt: skip
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1, default=lambda o: asdict(o)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
