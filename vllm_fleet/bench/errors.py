"""Error classification: one short type per failed request, so reports can count errors by type."""

from __future__ import annotations

import asyncio

import aiohttp

# Types: http_4xx codes as "http_404" etc., and these:
CONNECT = "connect"  # could not connect (refused, reset before the request was sent, DNS)
TIMEOUT = "timeout"  # no answer or the stream stalled past the per-request timeout
DISCONNECTED = "disconnected"  # the connection closed mid-response
STREAM_ERROR = "stream_error"  # an error event inside a 200 stream
ABORTED = "aborted"  # finish_reason "abort" (the engine aborted the request, e.g. on SIGTERM)
INCOMPLETE = "incomplete"  # a stream that ended without a finish reason (cut short, cleanly closed)
NO_TOKENS = "no_tokens"  # a 200 answer with no generated output
BAD_RESPONSE = "bad_response"  # a body that is not the expected JSON/SSE
OTHER = "other"


def classify_status(status: int) -> str:
    return f"http_{status}"


def classify_exception(exc: BaseException) -> str:
    """Map a client exception to an error type."""
    if isinstance(exc, asyncio.TimeoutError | TimeoutError):
        return TIMEOUT
    if isinstance(exc, aiohttp.ServerTimeoutError):
        return TIMEOUT
    if isinstance(exc, aiohttp.ClientConnectorError | ConnectionRefusedError):
        return CONNECT
    if isinstance(
        exc,
        aiohttp.ServerDisconnectedError
        | aiohttp.ClientPayloadError
        | aiohttp.ClientOSError
        | ConnectionResetError
        | aiohttp.ClientConnectionError,
    ):
        return DISCONNECTED
    if isinstance(exc, ValueError | KeyError | TypeError):
        return BAD_RESPONSE
    return OTHER


def classify_finish_reason(reason: str | None) -> str | None:
    """An error type for a finish reason that means the request did not complete normally."""
    if reason == "abort":
        return ABORTED
    if reason == "error":
        return STREAM_ERROR
    return None
