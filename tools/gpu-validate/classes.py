"""Device side: request classes on a real engine (issue 31: "an interactive request's TTFT while batch saturates
the fleet, with and without classes"; docs/gpu-validation.md "Request classes on the H200").

tools/fairness_bench.py measures the classes against a sim engine, which ignores the priority the gateway sends:
only the gateway's queue order is measured there. Here the engine is the real vLLM on the H200, so what a class's
priority does inside the engine (``--scheduling-policy priority`` + the middleware
vllm_fleet.host.request_priority, which writes the gateway's ``X-VF-Priority`` into the body) is measured.

  classes.py OUT      h200-burst.yml's instance with max_num_seqs N (32) and an unbounded engine queue, rendered
                      twice: ``classes`` (gateway.classes {interactive: 0, batch: 10}: the engine runs with
                      --scheduling-policy priority and the middleware, checked in the rendered command, in the
                      engine's own command line and in its "non-default args" log line) and ``plain`` (no classes:
                      the gateway sends no priority, every request is equal in the engine: FCFS). ONE engine
                      (the launcher, the classes render's instance, under a NOTIFY_SOCKET we own) serves both;
                      the two rendered gateways (key file, admission service, nginx) take turns in front of it,
                      one at a time, interleaved for R rounds (ABBA).
  classes.py OUT --local [--token-delay S]
                      the same phases and results against a local SIM engine (no priority: both gateways should
                      look alike) and two gateways rendered by vllm_fleet.devtools.gateway_testing; the device
                      specs are still rendered (to a temporary folder) and checked. Proves the script end to end.

A phase: the batch group (200 lanes, ``X-Request-Class: batch``, max_tokens 256) and the interactive group (4
lanes, ``interactive``, max_tokens 32), both on the SAME key, streamed completions (ignore_eos), a new connection
per request (tools/fairness_bench.py's lanes: TTFT = connection opened → first SSE data event; success = 200
ending in [DONE]). Requests started in [warmup, warmup + P) count; lanes then stop and every started request is
awaited (what still runs --drain s later is cut). Per phase: interactive TTFT p50/p90 and success, batch
tokens/s (its complete requests × max_tokens / P) and success, the engine's generation tokens/s and peak
running/waiting (its /metrics every 0.5 s, over the window). OUT/classes-results.json (written after every
phase) + a summary with the ratios.

What binds: the engine's max_num_seqs. The key is unlimited (max_in_flight 0, no rpm/tpm, the per-IP limit lifted)
and the model has no gateway capacity: vLLM 0.21.0 has no --max-num-queued-reqs, so the plan gives the model no
queue bound (max_num_queued_reqs 0 says so on purpose), the engine's queue is unbounded and the admission service
holds nothing back; its queue order plays no part. Only the engine's scheduler orders the waiting requests.

Every knob is a flag whose default an environment variable sets (run-device.sh classes OUT passes none):
VF_MAX_NUM_SEQS (32), VF_BATCH_LANES (200), VF_INTERACTIVE_LANES (4), VF_BATCH_TOKENS (256),
VF_INTERACTIVE_TOKENS (32), VF_PHASE_S (30), VF_WARMUP_S (10), VF_ROUNDS (2), VF_DRAIN_S (45).
Run after run-device.sh stash/install; no bare engine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for p in (REPO, HERE, REPO / "tools"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))
# tools/fairness_bench.py: the lanes, one request and its TTFT, a group's summary
from fairness_bench import Group, request, run_phase, summary  # noqa: E402

CLASSES = {"interactive": {"priority": 0}, "batch": {"priority": 10}}
NAME = "qwen3-8b"
ENGINE_PORT, GW_PORT = 8002, 8000
PRIORITY_FLAGS = ("--scheduling-policy", "priority")
PRIORITY_MIDDLEWARE = "vllm_fleet.host.request_priority.RequestPriority"
KEY = "lab"  # the name the lanes give their key (run_phase's ``keys``)
CONFIGS = ("classes", "plain")


# ---- the specs (both modes render them)


def spec_data(base: dict[str, Any], max_num_seqs: int, classes: bool) -> dict[str, Any]:
    """h200-burst.yml's data for this run: its one instance at ``max_num_seqs``, its queue unbounded on purpose
    (``max_num_queued_reqs: 0``: no gateway capacity), the key unlimited, and ``gateway.classes`` or none."""
    d = json.loads(json.dumps(base))
    d["name"] = "gpuclasses" if classes else "gpuplain"
    m = d["models"][0]
    m["max_num_seqs"] = max_num_seqs
    m["max_num_queued_reqs"] = 0
    gw = d["gateway"]
    gw["limits"] = {**gw.get("limits", {}), "default_key": {"max_in_flight": 0}}
    gw.pop("classes", None)
    if classes:
        gw["classes"] = json.loads(json.dumps(CLASSES))
    return dict(d)


def write_specs(folder: Path, max_num_seqs: int) -> dict[str, Path]:
    """Both specs (``classes``, ``plain``) as YAML files in ``folder``."""
    import yaml
    from burst import SPEC

    base = yaml.safe_load(SPEC.read_text())
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for name in CONFIGS:
        p = folder / f"{name}.yml"
        p.write_text(yaml.safe_dump(spec_data(base, max_num_seqs, name == "classes")))
        out[name] = p
    return out


def has_priority(argv: list[str]) -> bool:
    """The engine's command line schedules by priority and loads the priority middleware."""
    pairs = list(itertools.pairwise(argv))
    return PRIORITY_FLAGS in pairs and ("--middleware", PRIORITY_MIDDLEWARE) in pairs


def render_facts(render_dir: Path, instance: dict[str, Any]) -> dict[str, Any]:
    """What a render decided: the engine command (priority or not), the admission config's capacity and key
    limits, and whether the gateway conf sends X-VF-Priority."""
    conf = (render_dir / "h200/etc/nginx/conf.d/vllm-fleet.conf").read_text()
    adm_path = next(render_dir.glob("h200/**/etc/gateway/admission.json"), None)
    adm = json.loads(adm_path.read_text()) if adm_path else {}
    return {
        "engine_command": instance["command"],
        "engine_priority": has_priority(instance["command"]),
        "gateway_sends_priority": "proxy_set_header X-VF-Priority $vf_priority" in conf,
        "admission_capacity": adm.get("capacity"),
        "admission_default_key": adm.get("default_key"),
        "queue_wait_seconds": adm.get("queue_wait_seconds"),
    }


def render_specs(specs: dict[str, Path], out: Callable[[str], Path], install: str | None) -> dict[str, Any]:
    """Render both specs (``out(name)``: the folder); ``install``: the config whose instance file the launcher
    reads. Facts per config, and ``ok`` when classes (only) has the priority engine and header."""
    from measure import render_instance

    facts: dict[str, Any] = {}
    for name, spec in specs.items():
        inst = render_instance(spec, out(name), install=name == install)
        facts[name] = render_facts(out(name), inst)
    c, p = facts["classes"], facts["plain"]
    facts["ok"] = c["engine_priority"] and c["gateway_sends_priority"] and not p["gateway_sends_priority"]
    return facts


# ---- the figures (pure: tests/unit/test_gpu_classes.py)


def finite(x: Any) -> Any:
    """``x`` with every NaN float (fairness_bench's "no sample") as None, for a strict JSON file."""
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {k: finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [finite(v) for v in x]
    return x


def engine_window(rows: list[dict[str, Any]], t_from: float, t_to: float) -> dict[str, Any]:
    """The engine's /metrics samples (burst.Sampler rows) over [t_from, t_to]: peak running and waiting, and
    generated tokens/s (the counter's rise between the first and the last sample in the window)."""
    inside = [r for r in rows if t_from <= r["t"] <= t_to]
    gen = [(r["t"], r["generation_tokens_total"]) for r in inside if "generation_tokens_total" in r]
    rate = None
    if len(gen) > 1 and gen[-1][0] > gen[0][0]:
        rate = round((gen[-1][1] - gen[0][1]) / (gen[-1][0] - gen[0][0]), 1)
    return {
        "samples": sum(1 for r in inside if "num_requests_running" in r),
        "peak_running": max((r.get("num_requests_running", 0) for r in inside), default=None),
        "peak_waiting": max((r.get("num_requests_waiting", 0) for r in inside), default=None),
        "generation_tokens_per_s": rate,
    }


def class_counts(access_log: str) -> dict[str, int]:
    """Requests per ``class`` field in the gateway's JSON access log lines (``""``: none, or no such field: a
    gateway without classes logs none); lines that are not JSON objects are skipped."""
    out: dict[str, int] = {}
    for ln in access_log.splitlines():
        with contextlib.suppress(ValueError):
            e = json.loads(ln)
            if isinstance(e, dict):
                c = str(e.get("class", ""))
                out[c] = out.get(c, 0) + 1
    return out


def log_size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


def log_since(path: Path, offset: int) -> str:
    if not path.exists():
        return ""
    with path.open("rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace")


def median_of(xs: list[Any]) -> float | None:
    """The median of the numbers among ``xs`` (None and NaN left out); None when there are none."""
    v = [float(x) for x in xs if isinstance(x, int | float) and not math.isnan(x)]
    return statistics.median(v) if v else None


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a is not None and b else None


def compare(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per config, the medians over its rounds (the engine peaks: the highest), and the ratios: interactive TTFT
    without classes over with (how much the classes spare it), batch tokens/s with over without (what batch
    pays)."""
    per: dict[str, dict[str, Any]] = {}
    for name, phases in runs.items():
        it = [p["interactive"] for p in phases]
        bt = [p["batch"] for p in phases]
        en = [p["engine"] for p in phases]
        per[name] = {
            "rounds": len(phases),
            "interactive_ttft_p50_s": median_of([x["ttft_p50"] for x in it]),
            "interactive_ttft_p90_s": median_of([x["ttft_p90"] for x in it]),
            "interactive_success": median_of([x["success"] for x in it]),
            "interactive_requests": sum(x["requests"] for x in it),
            "batch_tokens_per_s": median_of([x["tokens_per_s"] for x in bt]),
            "batch_success": median_of([x["success"] for x in bt]),
            "batch_requests": sum(x["requests"] for x in bt),
            "engine_generation_tokens_per_s": median_of([x["generation_tokens_per_s"] for x in en]),
            "engine_peak_running": max(
                (x["peak_running"] for x in en if x["peak_running"] is not None), default=None
            ),
            "engine_peak_waiting": max(
                (x["peak_waiting"] for x in en if x["peak_waiting"] is not None), default=None
            ),
        }
    c, p = per.get("classes", {}), per.get("plain", {})
    return {
        **per,
        "ratios": {
            "interactive_ttft_p50_plain_over_classes": ratio(
                p.get("interactive_ttft_p50_s"), c.get("interactive_ttft_p50_s")
            ),
            "interactive_ttft_p90_plain_over_classes": ratio(
                p.get("interactive_ttft_p90_s"), c.get("interactive_ttft_p90_s")
            ),
            "batch_tokens_per_s_classes_over_plain": ratio(
                c.get("batch_tokens_per_s"), p.get("batch_tokens_per_s")
            ),
        },
    }


def secs(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 1000:.0f} ms" if x < 10 else f"{x:.1f} s"


def print_summary(res: dict[str, Any]) -> None:
    k = res["knobs"]
    print("=== classes summary", flush=True)
    print(f"engine: {res.get('engine_kind')}; max_num_seqs {k['max_num_seqs']}; READY after {res.get('ready_s')} s; "
          f"priority in the rendered command {res.get('render', {}).get('classes', {}).get('engine_priority')}, "
          f"in the running engine {res.get('engine_evidence', {}).get('cmdline_priority')}")  # fmt: skip
    print(f"batch {k['batch_lanes']} lanes × {k['batch_tokens']} tokens, interactive {k['interactive_lanes']} lanes "
          f"× {k['interactive_tokens']} tokens, one key; {k['rounds']} rounds × {k['phase_seconds']:g} s "
          f"after {k['warmup']:g} s warm-up")  # fmt: skip
    for name in CONFIGS:
        for ph in res.get("runs", {}).get(name, []):
            i, b, e = ph["interactive"], ph["batch"], ph["engine"]
            print(f"  [{name} r{ph['round']}] interactive {i['ok']}/{i['requests']} ok, TTFT p50 "
                  f"{secs(i['ttft_p50'])} p90 {secs(i['ttft_p90'])}; batch {b['ok']}/{b['requests']} ok, "
                  f"{b['tokens_per_s']} tok/s; engine {e['generation_tokens_per_s']} tok/s, peak running "
                  f"{e['peak_running']} waiting {e['peak_waiting']}; failed {i['failed'] or ''} "
                  f"{b['failed'] or ''}")  # fmt: skip
    cmp = res.get("comparison")
    if not cmp:
        return
    for name in CONFIGS:
        c = cmp.get(name)
        if c:
            print(f"  {name:<8} interactive TTFT p50 {secs(c['interactive_ttft_p50_s'])}, p90 "
                  f"{secs(c['interactive_ttft_p90_s'])}, success {c['interactive_success']}; batch "
                  f"{c['batch_tokens_per_s']} tok/s, success {c['batch_success']}; engine peak running "
                  f"{c['engine_peak_running']} waiting {c['engine_peak_waiting']}")  # fmt: skip
    r = cmp["ratios"]
    print(f"  ratios: interactive TTFT p50 without/with classes {r['interactive_ttft_p50_plain_over_classes']}, "
          f"p90 {r['interactive_ttft_p90_plain_over_classes']}; batch tok/s with/without "
          f"{r['batch_tokens_per_s_classes_over_plain']}", flush=True)  # fmt: skip


# ---- the labs: an engine and the two gateways, one in front of it at a time


class DeviceLab:
    """The launcher's engine (port 8002) and the rendered gateways as the gateway host runs them (measure.LabGateway:
    its key file with a new key, the admission service, nginx on port 8000), started for one phase each."""

    engine_port = ENGINE_PORT
    model = NAME

    def __init__(self, render_dirs: dict[str, Path]) -> None:
        self.render_dirs = render_dirs

    def access_log(self, name: str) -> Path:
        """The rendered gateway's JSON access log (``access_log PATH vf_json;``)."""
        conf = (self.render_dirs[name] / "h200/etc/nginx/conf.d/vllm-fleet.conf").read_text()
        for ln in conf.splitlines():
            parts = ln.split()
            if len(parts) >= 3 and parts[0] == "access_log" and parts[2].rstrip(";") == "vf_json":
                return Path(parts[1])
        return Path("/dev/null")

    @contextlib.contextmanager
    def gateway(self, name: str) -> Iterator[tuple[str, str, dict[str, Any]]]:
        from measure import LOG, VF, LabGateway

        gw = LabGateway(
            self.render_dirs[name] / "h200", VF / f"nginx-prefix-{name}", LOG / f"admission-{name}.log"
        )
        try:
            gw.start(GW_PORT)
            yield f"http://127.0.0.1:{GW_PORT}", gw.key, gw.info
        finally:
            gw.stop()


class LocalLab:
    """A sim engine (no priority scheduling) and two gateways rendered by vllm_fleet.devtools.gateway_testing from
    the same limits and classes, started for one phase each."""

    model = "tiny-qwen3"

    def __init__(self, a: argparse.Namespace) -> None:
        from vllm_fleet.devtools.gateway_testing import Gateway, gateway_spec
        from vllm_fleet.devtools.testing import SimEngineProcess

        self.dir = Path(tempfile.mkdtemp(prefix="vf-classes-"))
        model = self.dir / "model"
        model.mkdir()
        (model / "config.json").write_text(
            '{"architectures": ["Qwen3ForCausalLM"], "max_position_embeddings": 2048}\n'
        )
        self.engine = SimEngineProcess(model, workdir=self.dir, extra=["--max-num-seqs", str(a.max_num_seqs)],
                                       token_delay=a.token_delay)  # fmt: skip
        self.engine.start().wait_ready(60)
        self.engine_port = self.engine.port
        self.key = "sk-lab-" + "l" * 32
        keys = self.dir / "keys"
        keys.write_text(f'"{self.key}" lab;\n')
        limits: dict[str, Any] = {"queue_wait_seconds": 5, "default_key": {"max_in_flight": 0}}
        self.gateways = {}
        for name in CONFIGS:
            wd = self.dir / name
            wd.mkdir()
            spec = gateway_spec(
                [{"name": "e", "port": self.engine.port, "max_num_seqs": a.max_num_seqs,
                  "max_num_queued_reqs": 0}],
                wd,
                api_keys_file=str(keys),
                rate_limit={"per_ip_rps": 100000, "per_ip_burst": 100000},
                limits=limits,
                classes=CLASSES if name == "classes" else {},
            )  # fmt: skip
            self.gateways[name] = Gateway(spec, wd)

    @contextlib.contextmanager
    def gateway(self, name: str) -> Iterator[tuple[str, str, dict[str, Any]]]:
        g = self.gateways[name]
        try:
            g.start()
            yield g.url, self.key, {"admission_config": str(g.admission_config)}
        finally:
            g.stop()

    def access_log(self, name: str) -> Path:
        return Path(self.gateways[name].access_log)

    def close(self) -> None:
        import shutil

        self.engine.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


# ---- a phase


def check_request(url: str, key: str, model: str) -> dict[str, Any]:
    """One interactive request through the gateway: the key, the class header and the routing work."""
    host, port = url.removeprefix("http://").split(":")

    async def one() -> Any:
        return await request(host, int(port), key, "interactive", 8, True, time.monotonic(), model)

    r = asyncio.run(asyncio.wait_for(one(), 120))
    return {
        "status": r.status,
        "ok": r.ok,
        "ttft_s": r.ttft,
        "seconds": round(r.seconds, 3),
        "message": r.message,
    }


def phase(lab: Any, name: str, rnd: int, a: argparse.Namespace, first: bool) -> dict[str, Any]:
    from burst import Sampler
    from churn import wait_idle

    out: dict[str, Any] = {"gateway": name, "round": rnd}
    out["idle_before_s"] = wait_idle(60, lab.engine_port)
    groups = [
        Group("interactive", KEY, a.interactive_lanes, "interactive", a.interactive_tokens),
        Group("batch", KEY, a.batch_lanes, "batch", a.batch_tokens),
    ]
    alog = lab.access_log(name)
    at = log_size(alog)
    with lab.gateway(name) as (url, key, info):
        if first:
            out["gateway_setup"] = info
            out["check"] = check_request(url, key, lab.model)
            print(f"[{name}] check: {out['check']}", flush=True)
        sampler = Sampler(lab.engine_port)
        t0 = time.monotonic()
        res = asyncio.run(run_phase(url, groups, a.phase_seconds, a.warmup, 0, keys={KEY: key}, model=lab.model,
                                    drain=a.drain))  # fmt: skip
        out["wall_s"] = round(time.monotonic() - t0, 1)
        rows = sampler.done()
    out["idle_after_s"] = wait_idle(60, lab.engine_port)
    # the gateway's own word: the class it gave each request (none without gateway.classes)
    out["access_log_classes"] = class_counts(log_since(alog, at))
    out["interactive"] = finite(summary(res["interactive"]))
    b = finite(summary(res["batch"]))
    b["tokens_per_s"] = round(b["ok"] * a.batch_tokens / a.phase_seconds, 1)
    out["batch"] = b
    out["engine"] = engine_window(rows, t0 + a.warmup, t0 + a.warmup + a.phase_seconds)
    return out


def rounds(lab: Any, a: argparse.Namespace, res: dict[str, Any], save: Callable[[], None]) -> None:
    """R rounds, ABBA: classes, plain, plain, classes, …; the results are saved after every phase."""
    res["runs"] = {n: [] for n in CONFIGS}
    for i in range(a.rounds):
        for name in CONFIGS if i % 2 == 0 else CONFIGS[::-1]:
            ph = phase(lab, name, i + 1, a, first=not res["runs"][name])
            res["runs"][name].append(ph)
            res["comparison"] = compare({n: r for n, r in res["runs"].items() if r})
            i_, b_ = ph["interactive"], ph["batch"]
            print(f"[{name} r{i + 1}] interactive TTFT p50 {secs(i_['ttft_p50'])} p90 {secs(i_['ttft_p90'])} "
                  f"({i_['ok']}/{i_['requests']} ok); batch {b_['tokens_per_s']} tok/s ({b_['ok']}/{b_['requests']} "
                  f"ok); engine {ph['engine']}; access log classes {ph['access_log_classes']}", flush=True)  # fmt: skip
            save()


# ---- the two modes


def binds(a: argparse.Namespace) -> str:
    return (f"the engine's max_num_seqs {a.max_num_seqs}: the key is unlimited and the model has no gateway capacity "
            "(an unbounded engine queue), so the gateway holds nothing back")  # fmt: skip


def engine_evidence(log: Path) -> dict[str, Any]:
    """The running engine's own word: its command line (/proc, the launcher's state file) and vLLM's
    "non-default args" log line."""
    from burst import state

    out: dict[str, Any] = {}
    deadline = time.monotonic() + 10  # the launcher writes its state file just after READY=1
    while not (pid := state().get("engine_pid")) and time.monotonic() < deadline:
        time.sleep(0.25)
    out["engine_pid"] = pid
    if pid:
        with contextlib.suppress(OSError):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
            out["cmdline_priority"] = has_priority(argv)
    lines = (
        [ln for ln in log.read_text(errors="replace").splitlines() if "non-default args" in ln]
        if log.exists()
        else []
    )
    if lines:
        out["non_default_args"] = lines[0][-1500:]
        out["log_says_priority"] = "'scheduling_policy': 'priority'" in lines[0]
    return out


def device(out: Path, a: argparse.Namespace) -> int:
    from measure import LOG, VF, keep_logs, raise_nofile, start_launcher, stop_launcher, wait_ready

    res: dict[str, Any] = {"engine_kind": "vLLM under the launcher (H200)", "knobs": vars(a), "classes": CLASSES,
                           "binds": binds(a), "nofile": raise_nofile()}  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        (out / "classes-results.json").write_text(json.dumps(finite(res), indent=2, default=str))

    specs = write_specs(VF / "classes-specs", a.max_num_seqs)
    render_dirs = {n: VF / f"render-{n}" for n in CONFIGS}
    res["render"] = render_specs(specs, render_dirs.__getitem__, install="classes")
    print("render:", json.dumps({n: {k: v for k, v in f.items() if k != "engine_command"} if isinstance(f, dict)
                                 else f for n, f in res["render"].items()}), flush=True)  # fmt: skip
    if not res["render"]["ok"]:
        print(
            "the classes render lacks the priority engine or header (or plain has it): stopping", flush=True
        )
        save()
        return 1
    lp, lis, t0 = start_launcher("classes", 20.0)
    try:
        res["ready_s"] = wait_ready(lis, t0, "classes")
        if res["ready_s"] is None:
            return 1
        print(f"READY=1 after {res['ready_s']}s", flush=True)
        res["engine_evidence"] = engine_evidence(LOG / "launcher-classes.log")
        print("engine:", res["engine_evidence"], flush=True)
        save()
        rounds(DeviceLab(render_dirs), a, res, save)
    finally:
        rc, took = stop_launcher(lp, 60)
        res["stop"] = {"rc": rc, "seconds": took}
        res["notify"] = [{"t": round(t - t0, 2), **f} for t, f in lis.messages][-200:]
        lis.close()
        save()
        keep_logs(
            ("launcher-classes.log", "admission-classes.log", "admission-plain.log", "nginx-error.log"), out
        )
        print_summary(res)
    return 0


def local(out: Path, a: argparse.Namespace) -> int:
    from measure import raise_nofile

    res: dict[str, Any] = {
        "engine_kind": f"SIM ENGINE (no priority scheduling), token delay {a.token_delay} s",
        "knobs": vars(a),
        "classes": CLASSES,
        "binds": binds(a),
        "nofile": raise_nofile(),
    }
    out.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        (out / "classes-results.json").write_text(json.dumps(finite(res), indent=2, default=str))

    with tempfile.TemporaryDirectory(prefix="vf-classes-render-") as tmp:
        # the device's specs, rendered and checked as on the device (the instance file is not installed)
        specs = write_specs(Path(tmp), a.max_num_seqs)
        res["render"] = render_specs(specs, lambda n: Path(tmp) / f"render-{n}", install=None)
    print("render ok:", res["render"]["ok"], flush=True)
    t0 = time.monotonic()
    lab = LocalLab(a)
    try:
        rounds(lab, a, res, save)
    finally:
        lab.close()
        res["wall_s"] = round(time.monotonic() - t0, 1)
        save()
        print_summary(res)
    return 0 if res["render"]["ok"] else 1


def parse(argv: list[str]) -> argparse.Namespace:
    env = os.environ.get
    ap = argparse.ArgumentParser(prog="classes.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("out", type=Path)
    ap.add_argument("--local", action="store_true", help="a local sim engine instead of the launcher's vLLM")
    ap.add_argument(
        "--token-delay", type=float, default=0.01, help="--local: the sim engine's seconds per step"
    )
    ap.add_argument("--max-num-seqs", type=int, default=int(env("VF_MAX_NUM_SEQS", "32")))
    ap.add_argument("--batch-lanes", type=int, default=int(env("VF_BATCH_LANES", "200")))
    ap.add_argument("--interactive-lanes", type=int, default=int(env("VF_INTERACTIVE_LANES", "4")))
    ap.add_argument("--batch-tokens", type=int, default=int(env("VF_BATCH_TOKENS", "256")))
    ap.add_argument("--interactive-tokens", type=int, default=int(env("VF_INTERACTIVE_TOKENS", "32")))
    ap.add_argument("--phase-seconds", type=float, default=float(env("VF_PHASE_S", "30")))
    ap.add_argument("--warmup", type=float, default=float(env("VF_WARMUP_S", "10")))
    ap.add_argument("--rounds", type=int, default=int(env("VF_ROUNDS", "2")))
    ap.add_argument("--drain", type=float, default=float(env("VF_DRAIN_S", "45")),
                    help="after a phase, what still runs this long is cut")  # fmt: skip
    return ap.parse_args(argv)


if __name__ == "__main__":
    # SIGTERM (`timeout` at the end of the call): the finally blocks stop the launcher and write the results
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args = parse(sys.argv[1:])
    sys.exit(local(args.out, args) if args.local else device(args.out, args))
