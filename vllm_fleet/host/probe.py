"""Health, 1-token generation and progress probes against a vLLM OpenAI-compatible server.

``/health`` stays 200 while a decoder is deadlocked, so readiness needs a real decode: a ``/v1/completions``
request with ``max_tokens: 1``. Liveness (``liveness``) must also tell busy from hung: under a burst a decode
probe queues behind hundreds of requests, so while requests are running or waiting the engine's own work
counters (``/metrics``) are the evidence, and the decode probe is for an idle engine. All requests go through
``http.client`` with a hard timeout.
"""

from __future__ import annotations

import http.client
import json
import re
import time
from dataclasses import dataclass

from vllm_fleet.contracts import PROBE_USER_AGENT

_INFLIGHT_RE = re.compile(r"^vllm:num_requests_(running|waiting)[{ ]")
# counters that advance while the engine works: tokens prefilled and generated, engine steps, finished requests
_PROGRESS_RE = re.compile(
    r"^vllm:(num_requests_running|num_requests_waiting|generation_tokens_total|prompt_tokens_total"
    r"|iteration_tokens_total_count|request_success_total)[{ ]"
)
# vLLM's admission control (--max-num-queued-reqs / --max-num-queued-tokens) answers 503 with these words
_ADMISSION_RE = re.compile(r"currently busy and cannot accept new requests|prefill token backlog limit")


@dataclass
class ProbeResult:
    ok: bool
    latency: float
    error: str = ""
    stage: str = ""  # where it failed ("health", "decode", "metrics", "stalled"), or how it passed ("progress", "full")
    timed_out: bool = False  # failed for want of an answer in time (not an error answer)


@dataclass(frozen=True)
class Progress:
    """One reading of the engine's own work counters (summed over their labels)."""

    running: float
    waiting: float
    work: float  # prompt + generation tokens + engine steps + finished requests: grows while the engine works
    at: float  # time.monotonic() of the reading

    @property
    def busy(self) -> bool:
        return self.running + self.waiting > 0


def _request(
    host: str, port: int, method: str, path: str, body: bytes | None, timeout: float
) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        headers = {"Content-Type": "application/json", "User-Agent": PROBE_USER_AGENT}
        conn.request(method, path, body=body, headers=headers)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


@dataclass(frozen=True)
class Answer:
    """What one request to the engine showed."""

    ok: bool
    error: str = ""  # why not, or "full" for an admission 503 (ok: alive and full)
    timed_out: bool = False  # no answer within the timeout (slow or hung: the caller may ask the kernel)


def _failed(path: str, exc: Exception) -> Answer:
    return Answer(False, f"{path}: {type(exc).__name__}: {exc}", isinstance(exc, TimeoutError))


def health(host: str, port: int, timeout: float = 5.0) -> Answer:
    try:
        status, _ = _request(host, port, "GET", "/health", None, timeout)
    except (OSError, http.client.HTTPException) as exc:
        return _failed("/health", exc)
    return Answer(True) if status == 200 else Answer(False, f"/health: HTTP {status}")


def decode(host: str, port: int, model: str, timeout: float) -> Answer:
    body = json.dumps(
        {"model": model, "prompt": "ping", "max_tokens": 1, "temperature": 0, "stream": False}
    ).encode()
    try:
        status, raw = _request(host, port, "POST", "/v1/completions", body, timeout)
    except (OSError, http.client.HTTPException) as exc:
        return _failed("/v1/completions", exc)
    if status == 503 and _ADMISSION_RE.search(raw.decode(errors="replace")):
        return Answer(True, "full")  # admission control turned it away: alive, and full
    if status != 200:
        return Answer(False, f"/v1/completions: HTTP {status}: {raw[:200].decode(errors='replace')}")
    try:
        data = json.loads(raw)
        choices = data["choices"]
        if not choices:
            return Answer(False, "/v1/completions: no choices")
    except (ValueError, KeyError, TypeError) as exc:
        return Answer(False, f"/v1/completions: bad answer: {exc}")
    return Answer(True)


def probe(host: str, port: int, model: str, timeout: float, health_timeout: float = 5.0) -> ProbeResult:
    """Health, then a 1-token decode. Latency covers both."""
    t0 = time.monotonic()
    h = health(host, port, min(health_timeout, timeout))
    if not h.ok:
        return ProbeResult(False, time.monotonic() - t0, h.error, "health", h.timed_out)
    remaining = max(0.5, timeout - (time.monotonic() - t0))
    d = decode(host, port, model, remaining)
    if d.ok:  # error is "full" for an admission 503
        return ProbeResult(True, time.monotonic() - t0, "", d.error or "decode")
    return ProbeResult(False, time.monotonic() - t0, d.error, "decode", d.timed_out)


def progress(host: str, port: int, timeout: float = 3.0) -> tuple[Progress | None, Answer]:
    """The engine's work counters from ``/metrics`` (answered by the API server), or None and why."""
    t0 = time.monotonic()
    try:
        status, raw = _request(host, port, "GET", "/metrics", None, timeout)
    except (OSError, http.client.HTTPException) as exc:
        return None, _failed("/metrics", exc)
    if status != 200:
        return None, Answer(False, f"/metrics: HTTP {status}")
    vals = {"num_requests_running": 0.0, "num_requests_waiting": 0.0}
    work = 0.0
    for line in raw.decode(errors="replace").splitlines():
        m = _PROGRESS_RE.match(line)
        if not m:
            continue
        try:
            v = float(line.rsplit(" ", 1)[1])
        except (ValueError, IndexError):
            continue
        if m.group(1) in vals:
            vals[m.group(1)] += v
        else:
            work += v
    return Progress(vals["num_requests_running"], vals["num_requests_waiting"], work, t0), Answer(True)


def sample(host: str, port: int, model: str, timeout: float) -> tuple[Progress | None, ProbeResult | None]:
    """What one liveness check reads: the engine's work counters and, when it is idle, a 1-token decode (an
    admission 503 counts as alive and full). Returns the reading (None when ``/metrics`` did not answer) and
    the decode's result, or the ``/metrics`` failure; None while the engine is busy: then its counters are the
    evidence (``judge``), and a decode probe would only queue behind its requests."""
    t0 = time.monotonic()
    now, got = progress(host, port, min(timeout, 5.0))
    if now is None:
        return None, ProbeResult(False, time.monotonic() - t0, got.error, "metrics", got.timed_out)
    if now.busy:
        return now, None
    res = probe(host, port, model, max(0.5, timeout - (time.monotonic() - t0)))
    return now, ProbeResult(res.ok, time.monotonic() - t0, res.error, res.stage, res.timed_out)


def judge(
    prev: Progress | None, now: Progress | None, answer: ProbeResult | None, latency: float
) -> tuple[ProbeResult, Progress | None]:
    """The verdict on one ``sample`` (no I/O). Busy is not hung: while requests run or wait, the engine is
    alive when its work counters advanced since ``prev``; otherwise ``answer`` (the idle engine's decode, or
    the ``/metrics`` failure) is the verdict. Returns it and the reading to pass as ``prev`` next time (a stall
    is measured from the last reading that showed progress)."""
    if now is None or not now.busy or answer is not None:
        if answer is None:
            answer = ProbeResult(False, latency, "/metrics: no reading", "metrics")
        return answer, prev if now is None else now
    if prev is not None and now.work > prev.work:
        return ProbeResult(True, latency, "", "progress"), now
    if prev is None:  # nothing to compare with yet: judge at the next reading
        return ProbeResult(True, latency, "", "baseline"), now
    still = f"{now.running:g} running, {now.waiting:g} waiting, no token or step for {now.at - prev.at:.0f}s"
    return ProbeResult(False, latency, f"stalled: {still}", "stalled"), prev


def liveness(
    host: str, port: int, model: str, timeout: float, prev: Progress | None
) -> tuple[ProbeResult, Progress | None]:
    """Is the engine alive? ``sample`` then ``judge``. Returns the verdict and the reading to pass as ``prev``
    next time."""
    t0 = time.monotonic()
    now, answer = sample(host, port, model, timeout)
    return judge(prev, now, answer, time.monotonic() - t0)


def inflight(host: str, port: int, timeout: float = 3.0) -> int | None:
    """Requests the engine is running or queueing (``vllm:num_requests_running`` + ``_waiting`` summed over
    labels, from ``/metrics``), or None when the engine does not answer."""
    try:
        status, raw = _request(host, port, "GET", "/metrics", None, timeout)
    except (OSError, http.client.HTTPException):
        return None
    if status != 200:
        return None
    total = 0.0
    for line in raw.decode(errors="replace").splitlines():
        if _INFLIGHT_RE.match(line):
            try:
                total += float(line.rsplit(" ", 1)[1])
            except (ValueError, IndexError):
                continue
    return int(total)
