"""One request, OpenAI chat/completions or Anthropic messages shape, streamed or not, timed.

TTFT is the arrival of the first SSE chunk that carries a choice (OpenAI) or a content-block delta
(Anthropic); vLLM sends it with the first generated token — the same definition as ``vllm bench serve``.
ITL is the gap between consecutive such chunks; E2E ends at the last one (or at the full body when not
streaming). Token counts come from ``usage`` when the server sends it, otherwise from the chunk count.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from . import errors
from .stats import RequestRecord, intervals
from .workload import RequestClass

PATHS = {
    "openai-chat": "/v1/chat/completions",
    "openai-completions": "/v1/completions",
    "anthropic": "/v1/messages",
}


@dataclass
class Target:
    name: str
    base_url: str
    model: str
    headers: dict[str, str] = field(default_factory=dict)

    def url(self, api: str) -> str:
        return self.base_url.rstrip("/") + PATHS[api]


def build_payload(
    c: RequestClass, model: str, prompt: str | list[dict[str, str]], stream: bool | None = None
) -> dict[str, Any]:
    """The JSON body for class ``c`` (its API shape, thinking, JSON output, exact output length). ``prompt``:
    the user message, or the messages (a shared-prefix class: system prompt first)."""
    do_stream = c.stream if stream is None else stream
    body: dict[str, Any] = {"model": model, "max_tokens": c.output_tokens, "stream": do_stream}
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if c.api == "openai-completions":
        body["prompt"] = "".join(m["content"] for m in messages)
    elif c.api == "anthropic" and messages[0]["role"] == "system":
        body["system"] = messages[0]["content"]
        body["messages"] = messages[1:]
    else:
        body["messages"] = messages
    if c.api != "anthropic" and do_stream:
        body["stream_options"] = {"include_usage": True}
    if c.ignore_eos:
        body["ignore_eos"] = True
    if c.temperature is not None:
        body["temperature"] = c.temperature
    if c.thinking is not None and c.api != "openai-completions":
        body["chat_template_kwargs"] = {"enable_thinking": c.thinking}
    if c.json_output:
        body["response_format"] = {"type": "json_object"}
    body.update(c.extra_body)
    return body


def request_headers(c: RequestClass, extra: dict[str, str]) -> dict[str, str]:
    h = {"Content-Type": "application/json"}
    if c.api == "anthropic":
        h["anthropic-version"] = "2023-06-01"
    h.update(extra)
    return h


class _StreamState:
    """Accumulates the chunks of one SSE stream."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.times: list[float] = []
        self.usage_prompt: int | None = None
        self.usage_output: int | None = None
        self.finish_reason: str | None = None
        self.error: str | None = None

    def openai(self, data: dict[str, Any], now: float) -> None:
        if data.get("error") or data.get("object") == "error":
            self.error = json.dumps(data.get("error", data))[:300]
            return
        if choices := data.get("choices"):
            self.times.append(now)
            self.finish_reason = choices[0].get("finish_reason") or self.finish_reason
        if usage := data.get("usage"):
            self.usage_prompt = usage.get("prompt_tokens", self.usage_prompt)
            self.usage_output = usage.get("completion_tokens", self.usage_output)

    def anthropic(self, data: dict[str, Any], now: float) -> None:
        kind = data.get("type")
        if kind == "error":
            self.error = json.dumps(data.get("error", data))[:300]
        elif kind == "content_block_delta":
            self.times.append(now)
        elif kind == "message_start":
            usage = data.get("message", {}).get("usage", {})
            self.usage_prompt = usage.get("input_tokens", self.usage_prompt)
        elif kind == "message_delta":
            usage = data.get("usage", {})
            self.usage_output = usage.get("output_tokens", self.usage_output)
            self.finish_reason = data.get("delta", {}).get("stop_reason") or self.finish_reason


def _sse_payloads(buffer: bytes) -> tuple[list[str], bytes]:
    """Complete ``data:`` payloads in ``buffer`` and the incomplete rest."""
    out = []
    *events, rest = buffer.replace(b"\r\n", b"\n").split(b"\n\n")
    for ev in events:
        for line in ev.split(b"\n"):
            if line.startswith(b"data:"):
                out.append(line[5:].strip().decode())
    return out, rest


async def send(
    session: aiohttp.ClientSession,
    target: Target,
    c: RequestClass,
    prompt: str | list[dict[str, str]],
    t0: float,
    timeout: float,
    stream: bool | None = None,
) -> RequestRecord:
    """Send one request; never raises for request failures (they become the record's error type)."""
    body = build_payload(c, target.model, prompt, stream)
    start = time.perf_counter()
    rec = RequestRecord(cls=c.name, start=start - t0, stream=bool(body["stream"]), target=target.name)
    st = _StreamState(start)
    try:
        async with session.post(
            target.url(c.api),
            json=body,
            headers=request_headers(c, target.headers),
            timeout=aiohttp.ClientTimeout(total=timeout),
        ) as resp:
            rec.status = resp.status
            if resp.status != 200:
                rec.error = errors.classify_status(resp.status)
                rec.detail = (await resp.text())[:300]
                return rec
            if body["stream"]:
                await _read_stream(resp, c, st)
            else:
                data = await resp.json(content_type=None)
                st.times.append(time.perf_counter())
                _read_body(data, c, st)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # every failure becomes the record's error type
        rec.error = errors.classify_exception(exc)
        rec.detail = f"{type(exc).__name__}: {exc}"[:300]
        _fill(rec, st)
        return rec
    _fill(rec, st)
    if st.error:
        rec.error, rec.detail = errors.STREAM_ERROR, st.error
    elif (err := errors.classify_finish_reason(st.finish_reason)) is not None:
        rec.error, rec.detail = err, f"finish_reason {st.finish_reason}"
    elif not st.times:
        rec.error = errors.NO_TOKENS
    elif rec.stream and st.finish_reason is None:
        rec.error, rec.detail = errors.INCOMPLETE, "the stream ended without a finish reason"
    else:
        rec.ok = True
    return rec


async def _read_stream(resp: aiohttp.ClientResponse, c: RequestClass, st: _StreamState) -> None:
    """Each SSE message is timestamped as it is parsed, like ``vllm bench serve``: several messages that
    arrive in one socket read get their own (close) timestamps, not one shared one, so inter-token gaps are
    never zero because of how the bytes happened to be batched."""
    buf = b""
    async for chunk in resp.content.iter_any():
        buf += chunk
        payloads, buf = _sse_payloads(buf)
        for p in payloads:
            if p == "[DONE]" or not p:
                continue
            data = json.loads(p)
            now = time.perf_counter()
            if c.api == "anthropic":
                st.anthropic(data, now)
            else:
                st.openai(data, now)


def _read_body(data: dict[str, Any], c: RequestClass, st: _StreamState) -> None:
    if c.api == "anthropic":
        usage = data.get("usage", {})
        st.usage_prompt = usage.get("input_tokens")
        st.usage_output = usage.get("output_tokens")
        st.finish_reason = data.get("stop_reason")
        if data.get("type") == "error":
            st.error = json.dumps(data)[:300]
        return
    if "choices" not in data:
        st.error = json.dumps(data)[:300]
        return
    st.finish_reason = data["choices"][0].get("finish_reason") if data["choices"] else None
    usage = data.get("usage") or {}
    st.usage_prompt = usage.get("prompt_tokens")
    st.usage_output = usage.get("completion_tokens")


def _fill(rec: RequestRecord, st: _StreamState) -> None:
    if st.times:
        rec.ttft = st.times[0] - st.start
        rec.e2e = st.times[-1] - st.start
        rec.itl = intervals(st.times) if rec.stream else []
    else:
        rec.e2e = time.perf_counter() - st.start
    rec.prompt_tokens = st.usage_prompt or 0
    rec.output_tokens = st.usage_output if st.usage_output is not None else len(st.times) if rec.stream else 0
