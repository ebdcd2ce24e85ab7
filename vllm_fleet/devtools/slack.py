"""A Slack-compatible incoming-webhook endpoint for tests: what Alertmanager posts, recorded with arrival times
(the live observability test on this machine; the HA fleet's page count, bound to the sandbox bridge)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from vllm_fleet.devtools.testing import free_port


class SlackReceiver:
    """A Slack-compatible incoming-webhook endpoint: records every POSTed JSON with its arrival time."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self.port = free_port()
        self.posts: list[tuple[float, dict[str, Any]]] = []
        received = self.posts

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                received.append((time.time(), json.loads(body)))
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer((self.host, self.port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/services/T000/B000/slack"

    def find(self, alertname: str, status: str) -> list[tuple[float, dict[str, Any]]]:
        return [
            (t, p)
            for t, p in list(self.posts)
            for a in p.get("attachments", [])
            if alertname in a.get("title", "") and a.get("title", "").startswith(f"[{status}")
        ]

    def close(self) -> None:
        self.server.shutdown()
