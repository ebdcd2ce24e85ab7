"""Health and 1-token generation probes against a vLLM OpenAI-compatible server.

``/health`` stays 200 while a decoder is deadlocked, so liveness needs a real decode: a ``/v1/completions``
request with ``max_tokens: 1``. Both go through ``http.client`` with a hard timeout.
"""

from __future__ import annotations

import http.client
import json
import re
import time
from dataclasses import dataclass

_INFLIGHT_RE = re.compile(r"^vllm:num_requests_(running|waiting)[{ ]")


@dataclass
class ProbeResult:
    ok: bool
    latency: float
    error: str = ""
    stage: str = ""  # "health" or "decode": where it failed (or "" when ok)


def _request(
    host: str, port: int, method: str, path: str, body: bytes | None, timeout: float
) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        headers = {"Content-Type": "application/json", "User-Agent": "vllm-fleet-probe"}
        conn.request(method, path, body=body, headers=headers)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def health(host: str, port: int, timeout: float = 5.0) -> tuple[bool, str]:
    try:
        status, _ = _request(host, port, "GET", "/health", None, timeout)
    except (OSError, http.client.HTTPException) as exc:
        return False, f"/health: {type(exc).__name__}: {exc}"
    return status == 200, "" if status == 200 else f"/health: HTTP {status}"


def decode(host: str, port: int, model: str, timeout: float) -> tuple[bool, str]:
    body = json.dumps(
        {"model": model, "prompt": "ping", "max_tokens": 1, "temperature": 0, "stream": False}
    ).encode()
    try:
        status, raw = _request(host, port, "POST", "/v1/completions", body, timeout)
    except (OSError, http.client.HTTPException) as exc:
        return False, f"/v1/completions: {type(exc).__name__}: {exc}"
    if status != 200:
        return False, f"/v1/completions: HTTP {status}: {raw[:200].decode(errors='replace')}"
    try:
        data = json.loads(raw)
        choices = data["choices"]
        if not choices:
            return False, "/v1/completions: no choices"
    except (ValueError, KeyError, TypeError) as exc:
        return False, f"/v1/completions: bad answer: {exc}"
    return True, ""


def probe(host: str, port: int, model: str, timeout: float, health_timeout: float = 5.0) -> ProbeResult:
    """Health, then a 1-token decode. Latency covers both."""
    t0 = time.monotonic()
    ok, err = health(host, port, min(health_timeout, timeout))
    if not ok:
        return ProbeResult(False, time.monotonic() - t0, err, "health")
    remaining = max(0.5, timeout - (time.monotonic() - t0))
    ok, err = decode(host, port, model, remaining)
    return ProbeResult(ok, time.monotonic() - t0, err, "" if ok else "decode")


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
