"""The test stand-in for an engine: ``close`` plays a killed engine, keepalive connections included."""

from __future__ import annotations

import http.client
import json

import pytest

from vllm_fleet.devtools.gateway_testing import StubEngine


def test_close_ends_the_keepalive_connections_already_open() -> None:
    stub = StubEngine("a")
    conn = http.client.HTTPConnection("127.0.0.1", stub.port, timeout=5)
    conn.request("POST", "/v1/chat/completions", body=b"{}")
    resp = conn.getresponse()
    assert json.loads(resp.read())["served_by"] == "a"
    stub.close()
    # the same connection (as nginx's upstream keepalive pool would reuse it) is no longer served
    with pytest.raises((ConnectionError, http.client.HTTPException, OSError)):
        conn.request("POST", "/v1/chat/completions", body=b"{}")
        conn.getresponse().read()
    assert stub.hits == 1
    # and a new one is refused
    with pytest.raises(ConnectionRefusedError):
        http.client.HTTPConnection("127.0.0.1", stub.port, timeout=5).connect()
