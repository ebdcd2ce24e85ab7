"""The gateway's admission service (issue 31; docs/design/per-key-limits.md): one asyncio process that nginx's
``auth_request`` asks before a request goes upstream, around the pure core ``vllm_fleet.host.admission``.

Three endpoints (``vllm-fleet admission --config PATH``, the config is ``contracts.AdmissionConfig``):

- ``socket`` (unix stream, HTTP/1.1 kept alive; nginx holds a pool of these connections): ``GET /admit`` with
  ``X-VF-Key`` (the key id; empty: admitted at once, nothing counted), ``X-VF-Client``, ``X-VF-Model`` (the
  route), ``X-VF-Cost`` (tokens reserved, default 0), ``X-VF-Priority`` (default 0), ``X-Request-Id``.
  Admitted, at once or after waiting: ``204`` with ``X-VF-Admitted: 1`` and ``X-VF-Waited: SECONDS``.
  Refused: ``403`` with ``X-VF-Refusal: 429``, ``X-VF-Reason`` (the core's reason) and ``Retry-After`` (absent
  when waiting cannot help). A request that waits holds its connection's answer until the core decides (a
  tick every 100 ms, a release); a connection that closes meanwhile withdraws it. Idempotent by request id:
  every connection that asks for the same waiting id gets the same answer. ``GET /health``: ``200 ok``.
- ``log_socket`` (unix datagram): nginx's ``access_log syslog:server=unix:PATH,nohostname,tag=vfadmit`` lines
  ``<PRI>Mmm dd hh:mm:ss vfadmit: REQUEST_ID|STATUS|UPSTREAM_STATUS|USAGE`` release admitted requests.
- ``metrics_address`` (TCP): Prometheus ``/metrics``.

At scale (docs/perf/gateway-limits.md, "Admission at 2,000 waiting requests"): every request waiting holds a
connection, opened in bursts, so the stream socket listens with the config's ``listen_backlog`` (a connect()
that finds the backlog full fails at once and nginx admits unlimited) and the open-file limit is raised to its
hard limit; nginx's release datagrams are sent non-blocking and a full receive queue
(``net.unix.max_dgram_qlen``, 10 by default) loses them, so a thread of its own drains the datagram socket in
batches whatever the event loop is busy with. The kernel limits that still apply are said at start.

Standard library plus prometheus_client (for the exposition format).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import grp
import os
import resource
import select
import signal
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from vllm_fleet.contracts import ADMISSION_SYSLOG_TAG, AdmissionBudget, AdmissionConfig, ContractError
from vllm_fleet.host.admission import REFUSAL_REASONS, Admission, Budget, Decision, Request, Settings
from vllm_fleet.host.notify import Notifier

TICK_SECONDS = 0.1
LOG_TAG = ADMISSION_SYSLOG_TAG
SOCKET_MODE = 0o660
MAX_HEADER_BYTES = 16384
# the longest release datagram read (nginx's syslog lines of vf_admit are ~100 bytes)
LOG_DATAGRAM_BYTES = 4096
WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60)

_HEALTH = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n\r\nok"
_NOT_FOUND = b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n"
_BAD = b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
_ADMIT_NO_KEY = (
    b"HTTP/1.1 204 No Content\r\nX-VF-Admitted: 1\r\nX-VF-Waited: 0.000\r\nContent-Length: 0\r\n\r\n"
)


def budget(b: AdmissionBudget) -> Budget:
    return Budget(b.max_in_flight, b.requests_per_minute, b.tokens_per_minute, b.weight)


def settings_from_config(cfg: AdmissionConfig) -> Settings:
    return Settings(
        queue_wait_seconds=cfg.queue_wait_seconds,
        max_queued_per_key=cfg.max_queued_per_key,
        max_queued=cfg.max_queued,
        lease_seconds=cfg.lease_seconds,
        default_key=budget(cfg.default_key),
        keys={k: budget(b) for k, b in cfg.keys.items()},
        default_client=budget(cfg.default_client),
        clients={k: budget(b) for k, b in cfg.clients.items()},
        per_key={k: budget(b) for k, b in cfg.per_key.items()},
        capacity=dict(cfg.capacity),
    )


def response(d: Decision) -> bytes:
    """The HTTP answer to an /admit decided ``admit`` or ``refuse``."""
    if d.verdict == "admit":
        return (
            b"HTTP/1.1 204 No Content\r\nX-VF-Admitted: 1\r\nX-VF-Waited: %.3f\r\nContent-Length: 0\r\n\r\n"
            % d.waited
        )
    retry = b"" if d.retry_after is None else b"Retry-After: %d\r\n" % d.retry_after
    return b"HTTP/1.1 403 Forbidden\r\nX-VF-Refusal: 429\r\nX-VF-Reason: %s\r\n%sX-VF-Waited: %.3f\r\n" % (
        d.reason.encode(),
        retry,
        d.waited,
    ) + (b"Content-Length: 0\r\n\r\n")


# ------------------------------------------------------------------------- the release log line


def parse_release(datagram: bytes) -> tuple[str, int | None] | None:
    """A release from one of nginx's syslog datagrams: (request id, tokens used: the USAGE field when it is an
    integer — router.js usage(): the answer's usage, else a stream's events plus the prompt estimate; it
    replaces the reservation in the key's and client's minute —, else None = the reservation when the last
    upstream status is 200, else 0 = the engine did no work). None when the datagram is not one of ours."""
    text = datagram.decode("utf-8", "replace")
    _, sep, message = text.partition(f"{LOG_TAG}: ")
    if not sep:
        return None
    fields = message.strip().split("|")
    if len(fields) < 4 or not fields[0] or fields[0] == "-":
        return None
    request_id, _status, upstream, usage = fields[:4]
    usage = usage.strip()
    if usage.isascii() and usage.isdigit():  # not str.isdigit alone: it takes "²", which int() refuses
        return request_id, int(usage)
    # $upstream_status: "200", "502, 200" (tried another server), "503 : 200" (an internal redirect), "-"
    last = upstream.replace(":", ",").rsplit(",", 1)[-1].strip()
    return request_id, None if last == "200" else 0


class _LogReader:
    """Drains the release datagram socket in a thread of its own and hands the datagrams to the event loop in
    batches. The kernel queues at most ``net.unix.max_dgram_qlen`` datagrams unread (10 by default) before
    nginx's non-blocking send fails and the release is lost; an event loop busy with a burst of connections
    reads one datagram per turn, a thread blocked in recv() reads the whole queue each time it wakes (within
    the interpreter's switch interval, 5 ms, however busy the loop is)."""

    def __init__(self, sock: socket.socket, loop: asyncio.AbstractEventLoop, handle: Callable[[bytes], None]):
        self.sock = sock
        self.loop = loop
        self.handle = handle
        self.batch: list[bytes] = []
        self.lock = threading.Lock()
        self.stopping = False
        sock.setblocking(False)
        self._wake_r, self._wake_w = os.pipe()  # stop() wakes the thread
        self.thread = threading.Thread(target=self._run, name="vf-admission-log", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        sock = self.sock
        poll = select.poll()
        poll.register(sock, select.POLLIN)
        poll.register(self._wake_r, select.POLLIN)
        while not self.stopping:
            poll.poll()  # the GIL is free meanwhile
            got = []
            while True:  # the whole queue
                try:
                    got.append(sock.recv(LOG_DATAGRAM_BYTES))
                except OSError:  # BlockingIOError: the queue is empty
                    break
            if not got:
                continue
            with self.lock:
                first = not self.batch
                self.batch += got
            if first:
                with contextlib.suppress(RuntimeError):  # the loop closed meanwhile (stopping)
                    self.loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self.lock:
            batch, self.batch = self.batch, []
        for data in batch:
            try:
                self.handle(data)
            except Exception as exc:  # a bug must not drop the rest of the batch: say it and go on
                print(f"vllm-fleet admission: release failed: {exc!r}", file=sys.stderr, flush=True)

    def stop(self) -> None:
        self.stopping = True
        os.write(self._wake_w, b"x")
        self.thread.join(5)
        self.sock.close()
        os.close(self._wake_r)
        os.close(self._wake_w)
        self._deliver()


# ------------------------------------------------------------------------- the /admit protocol


class _Pending:
    """One request's answer on its connection: ready bytes, or the request id it still waits for."""

    __slots__ = ("data", "request_id")

    def __init__(self, data: bytes | None, request_id: str = "") -> None:
        self.data = data
        self.request_id = request_id


class _AdmitProtocol(asyncio.Protocol):
    """One nginx connection: requests parsed as they come, answered in their order (a waiting request holds
    back the answers behind it on the same connection; nginx sends one at a time anyway)."""

    def __init__(self, service: AdmissionService) -> None:
        self.service = service
        self.transport: asyncio.Transport | None = None
        self.buf = b""
        self.pending: deque[_Pending] = deque()
        self.close_after = False  # Connection: close / HTTP/1.0 without keep-alive: close once answered
        self.skip = 0  # body bytes still to drop (requests carry none; tolerated)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.service.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.service.connections.discard(self)
        waiting = [p.request_id for p in self.pending if p.data is None]
        self.pending.clear()
        self.transport = None
        for rid in waiting:
            self.service.forget(rid, self)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while self.transport is not None and not self.close_after:
            if self.skip:
                n = min(self.skip, len(self.buf))
                self.buf, self.skip = self.buf[n:], self.skip - n
                if self.skip:
                    return
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buf) > MAX_HEADER_BYTES:
                    self._send_and_close(_BAD)
                return
            head, self.buf = self.buf[:end], self.buf[end + 4 :]
            self._request(head)

    def _send_and_close(self, data: bytes) -> None:
        self.close_after = True
        self.pending.append(_Pending(data))
        self.flush()

    def _request(self, head: bytes) -> None:
        lines = head.split(b"\r\n")
        parts = lines[0].split(b" ")
        if len(parts) != 3:
            self._send_and_close(_BAD)
            return
        method, target, version = parts
        headers: dict[bytes, bytes] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep:
                self._send_and_close(_BAD)
                return
            headers[name.strip().lower()] = value.strip()
        conn = headers.get(b"connection", b"").lower()
        if conn == b"close" or (version == b"HTTP/1.0" and conn != b"keep-alive"):
            self.close_after = True
        if b"transfer-encoding" in headers:
            self._send_and_close(_BAD)
            return
        length = headers.get(b"content-length", b"0")
        if not length.isdigit():
            self._send_and_close(_BAD)
            return
        # a GET has no body: an auth_request subrequest may carry the client's Content-Length without its body
        # (unless nginx sets `proxy_set_header Content-Length ""`); skipping it would eat the next request
        self.skip = int(length) if method != b"GET" else 0
        path = target.split(b"?", 1)[0]
        if path == b"/admit" and method == b"GET":
            self.pending.append(self.service.admit(headers, self))
        elif path == b"/health":
            self.pending.append(_Pending(_HEALTH))
        else:
            self.pending.append(_Pending(_NOT_FOUND))
        self.flush()

    def answer(self, request_id: str, data: bytes) -> None:
        for p in self.pending:
            if p.data is None and p.request_id == request_id:
                p.data = data
                break
        self.flush()

    def flush(self) -> None:
        t = self.transport
        if t is None:
            return
        while self.pending and self.pending[0].data is not None:
            t.write(self.pending.popleft().data)  # type: ignore[arg-type]
        if self.close_after and not self.pending:
            t.close()


# ------------------------------------------------------------------------- metrics


class _Collector(Collector):
    """The core's counters and gauges, read at scrape time (in the event loop, which owns the core)."""

    def __init__(self, service: AdmissionService) -> None:
        self.service = service

    def collect(self) -> Iterator[Any]:
        svc, core = self.service, self.service.core
        now = time.monotonic()
        p = "vllm_fleet_gateway_"
        admitted = CounterMetricFamily(
            p + "key_admitted", "Requests admitted, per key", labels=["client", "key"]
        )
        refused = CounterMetricFamily(
            p + "key_refused",
            "Requests refused (429), per key and reason",
            labels=["client", "key", "reason"],
        )
        withdrawn = CounterMetricFamily(
            p + "key_withdrawn",
            "Waiting requests withdrawn because nginx closed their connection, per key",
            labels=["client", "key"],
        )
        tokens = CounterMetricFamily(
            p + "key_tokens",
            "Tokens reserved at admission and settled on release, per key",
            labels=["client", "key", "kind"],
        )
        in_flight = GaugeMetricFamily(
            p + "key_in_flight", "Requests admitted and running", labels=["client", "key"]
        )
        queued = GaugeMetricFamily(
            p + "key_queued", "Requests waiting for admission", labels=["client", "key"]
        )
        used = GaugeMetricFamily(
            p + "key_budget_used_ratio",
            "Share of each budget the key uses now (set budgets only; rpm/tpm: the sliding minute)",
            labels=["client", "key", "budget"],
        )
        for key, st in core.stats.items():
            client = svc.client_of(key)
            admitted.add_metric([client, key], st.admitted)
            # every reason from the key's first request on, at 0 until it counts: an alert or panel on a reason
            # has series on a fleet where no key was ever refused
            for reason in REFUSAL_REASONS:
                refused.add_metric([client, key, reason], st.refused.get(reason, 0))
            withdrawn.add_metric([client, key], st.withdrawn)
            tokens.add_metric([client, key, "reserved"], st.tokens_reserved)
            tokens.add_metric([client, key, "settled"], st.tokens_settled)
            in_flight.add_metric([client, key], core.in_flight(key))
            queued.add_metric([client, key], st.queued)
            for name, ratio in core.budget_used(key, now).items():
                used.add_metric([client, key, name], ratio)
        yield from (admitted, refused, withdrawn, tokens, in_flight, queued, used)
        expired = CounterMetricFamily(
            p + "admission_leases_expired",
            "Admissions never released (a lost log datagram) whose lease expired; should stay 0",
        )
        expired.add_metric([], core.leases_expired)
        yield expired
        capacity = GaugeMetricFamily(
            p + "route_capacity", "Requests in flight the route's engines hold", labels=["model"]
        )
        for model, n in sorted(core.settings.capacity.items()):
            capacity.add_metric([model], n)
        yield capacity
        route = GaugeMetricFamily(p + "route_in_flight", "Requests admitted per route", labels=["model"])
        routes = core.route_in_flight()
        for model in sorted(set(routes) | set(core.settings.capacity)):
            route.add_metric([model], routes.get(model, 0))
        yield route
        up = GaugeMetricFamily(p + "admission_up", "The admission service answers")
        up.add_metric([], 1)
        yield up


async def _metrics_connection(
    registry: CollectorRegistry, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    try:
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
                return
            line = head.split(b"\r\n", 1)[0].split(b" ")
            path = line[1].split(b"?", 1)[0] if len(line) == 3 else b""
            if path == b"/metrics":
                body = generate_latest(registry)
                ctype = b"text/plain; version=0.0.4; charset=utf-8"
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n" % (ctype, len(body))
                    + body
                )
            else:
                writer.write(_NOT_FOUND)
            await writer.drain()
            if b"connection: close" in head.lower() or line[-1] == b"HTTP/1.0":
                return
    finally:
        writer.close()


# ------------------------------------------------------------------------- the service


def _int_header(headers: dict[bytes, bytes], name: bytes) -> int:
    v = headers.get(name, b"")
    return int(v) if v else 0


def _bind_unix(path: str, kind: socket.SocketKind, gid: int) -> socket.socket:
    """A unix socket bound at ``path`` (a stale file there is removed), mode 0660, group ``gid`` (-1: left)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    sock = socket.socket(socket.AF_UNIX, kind | socket.SOCK_CLOEXEC)
    try:
        sock.bind(path)
        os.chmod(path, SOCKET_MODE)
        if gid >= 0:
            os.chown(path, -1, gid)
    except BaseException:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


class AdmissionService:
    """The event-loop side: owns the core (only the loop touches it), the connections and the waiters."""

    def __init__(self, cfg: AdmissionConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.clock = clock
        self.core = Admission(settings_from_config(cfg))
        self.connections: set[_AdmitProtocol] = set()
        # request id -> the connections waiting for its answer (several when nginx asks again for the id)
        self.waiters: dict[str, list[_AdmitProtocol]] = {}
        self._clients: dict[str, str] = {}  # key -> its client (the X-VF-Client it came with)
        self.registry = CollectorRegistry()
        self.registry.register(_Collector(self))
        self.waited = Histogram(
            "vllm_fleet_gateway_key_queue_wait_seconds",
            "Seconds an admitted request waited for admission, per key",
            ["client", "key"],
            buckets=WAIT_BUCKETS,
            registry=self.registry,
        )
        self._servers: list[asyncio.AbstractServer] = []
        self._metrics: asyncio.Server | None = None
        self._log_reader: _LogReader | None = None
        self.nofile = 0  # the open-file limit (start)
        self._tick_task: asyncio.Task[None] | None = None
        self._paths: list[str] = []

    def client_of(self, key: str) -> str:
        return self._clients.get(key, "")

    # ---------------------------------------------------------------- decisions → answers

    def admit(self, headers: dict[bytes, bytes], conn: _AdmitProtocol) -> _Pending:
        key = headers.get(b"x-vf-key", b"").decode("utf-8", "replace")
        if not key:
            return _Pending(_ADMIT_NO_KEY)
        rid = headers.get(b"x-request-id", b"").decode("utf-8", "replace")
        try:
            cost = _int_header(headers, b"x-vf-cost")
            priority = _int_header(headers, b"x-vf-priority")
        except ValueError:
            conn.close_after = True
            return _Pending(_BAD)
        if not rid or cost < 0:
            conn.close_after = True
            return _Pending(_BAD)
        client = headers.get(b"x-vf-client", b"").decode("utf-8", "replace")
        if key not in self._clients:
            self._clients[key] = client
        route = headers.get(b"x-vf-model", b"").decode("utf-8", "replace")
        d = self.core.submit(Request(rid, key, route, cost, client, priority), self.clock())
        if d.verdict == "queue":
            self.waiters.setdefault(rid, []).append(conn)
            return _Pending(None, rid)
        if d.verdict == "admit" and not d.again:
            self.waited.labels(client, key).observe(d.waited)
        return _Pending(response(d))

    def deliver(self, decisions: Iterable[Decision]) -> None:
        """Answer the connections waiting for these decisions."""
        for d in decisions:
            conns = self.waiters.pop(d.request_id, None)
            if d.verdict == "admit":
                if not conns:  # nobody waits for it any more (cannot happen: a gone waiter withdraws)
                    self.deliver(self.core.release(d.request_id, self.clock(), 0))
                    continue
                key = self.core.key_of(d.request_id)
                self.waited.labels(self.client_of(key), key).observe(d.waited)
            data = response(d)
            for conn in conns or ():
                conn.answer(d.request_id, data)

    def forget(self, request_id: str, conn: _AdmitProtocol) -> None:
        """``conn`` closed while waiting for ``request_id``: the last connection to go withdraws it."""
        conns = self.waiters.get(request_id)
        if conns is None:
            return
        with contextlib.suppress(ValueError):
            conns.remove(conn)
        if not conns:
            del self.waiters[request_id]
            self.deliver(self.core.withdraw(request_id, self.clock()))

    def release_datagram(self, data: bytes) -> None:
        """One of nginx's syslog datagrams: a release, or nothing of ours."""
        release = parse_release(data)
        if release is not None:
            self.release(*release)

    def release(self, request_id: str, used_tokens: int | None) -> None:
        """nginx logged the end of ``request_id``. ``used_tokens`` None: the reservation."""
        now = self.clock()
        if self.core.is_waiting(request_id):  # nginx finished it while it waited: nobody will take the answer
            conns = self.waiters.pop(request_id, [])
            decisions = self.core.withdraw(request_id, now)
            for conn in conns:
                conn.answer(request_id, response(Decision(request_id, "refuse", "wait_timeout", 1)))
            self.deliver(decisions)
            return
        self.deliver(self.core.release(request_id, now, used_tokens))

    def tick(self) -> None:
        self.deliver(self.core.tick(self.clock()))

    async def _ticker(self) -> None:
        while True:
            await asyncio.sleep(TICK_SECONDS)
            try:
                self.tick()
            except Exception as exc:  # a bug must not stop the deadlines: say it and go on
                print(f"vllm-fleet admission: tick failed: {exc!r}", file=sys.stderr, flush=True)

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        cfg = self.cfg
        gid = grp.getgrnam(cfg.socket_group).gr_gid if cfg.socket_group else -1
        self.nofile = raise_open_files()
        stream = _bind_unix(cfg.socket, socket.SOCK_STREAM, gid)
        self._paths.append(cfg.socket)
        # asyncio listen()s again with create_server's backlog (100 unless given): the config's number it is
        self._servers.append(
            await loop.create_server(lambda: _AdmitProtocol(self), sock=stream, backlog=cfg.listen_backlog)
        )
        dgram = _bind_unix(cfg.log_socket, socket.SOCK_DGRAM, gid)
        self._paths.append(cfg.log_socket)
        self._log_reader = _LogReader(dgram, loop, self.release_datagram)
        self._log_reader.start()
        host, _, port = cfg.metrics_address.rpartition(":")
        self._metrics = await asyncio.start_server(
            lambda r, w: _metrics_connection(self.registry, r, w), host.strip("[]"), int(port)
        )
        self._servers.append(self._metrics)
        self._tick_task = asyncio.create_task(self._ticker())

    @property
    def metrics_port(self) -> int:
        """The metrics server's port (the config's, or the one the system chose for port 0 in tests)."""
        assert self._metrics is not None
        return int(self._metrics.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self._tick_task is not None:
            self._tick_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._tick_task
        for server in self._servers:
            server.close()
        for conn in list(self.connections):
            if conn.transport is not None:
                conn.transport.close()
        for server in self._servers:
            await server.wait_closed()
        if self._log_reader is not None:
            self._log_reader.stop()
        for path in self._paths:
            with contextlib.suppress(OSError):
                os.unlink(path)

    def describe(self) -> str:
        c = self.cfg
        return (
            f"vllm-fleet admission ({c.fleet}): socket {c.socket}, log {c.log_socket}, metrics "
            f"http://{c.metrics_address}/metrics; queue_wait {c.queue_wait_seconds:g}s, max_queued "
            f"{c.max_queued} ({c.max_queued_per_key}/key), lease {c.lease_seconds:g}s, default_key {c.default_key}, "
            f"{len(c.keys)} key(s), {len(c.per_key)} per-key client budget(s), {len(c.clients)} client(s), "
            f"capacity {c.capacity or 'unlimited'}; listen backlog {c.listen_backlog}, open files {self.nofile}"
            + "".join(f"\nvllm-fleet admission: warning: {w}" for w in self.limit_warnings())
        )

    def limit_warnings(self) -> list[str]:
        """The kernel limits below what the config asks (the gateway role raises them: docs/gateway.md)."""
        c, out = self.cfg, []
        somaxconn = read_sysctl("net/core/somaxconn")
        if somaxconn is not None and somaxconn < c.listen_backlog:
            out.append(
                f"net.core.somaxconn {somaxconn} caps the listen backlog {c.listen_backlog}: a burst of nginx's "
                "connections beyond it fails and is admitted unlimited (on_failure open)"
            )
        qlen = read_sysctl("net/unix/max_dgram_qlen")
        if qlen is not None and qlen < c.listen_backlog:
            out.append(
                f"net.unix.max_dgram_qlen {qlen}: more release datagrams than that queued unread are lost "
                "(their slots held until the lease expires: leases_expired)"
            )
        if self.nofile < 2 * c.listen_backlog:
            out.append(f"open files limited to {self.nofile}: raise the unit's LimitNOFILE")
        return out


def read_sysctl(name: str) -> int | None:
    """/proc/sys/NAME as an integer (None: not readable)."""
    try:
        return int(Path("/proc/sys", name).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def raise_open_files() -> int:
    """Raise the soft open-file limit to the hard one (systemd gives a unit 1024 soft, 524288 hard on Debian 12:
    each waiting request holds a connection); the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return soft if soft != resource.RLIM_INFINITY else 1 << 30


async def serve(cfg: AdmissionConfig, ready: Callable[[AdmissionService], None] | None = None) -> None:
    """Run until SIGTERM / SIGINT (or cancelled)."""
    service = AdmissionService(cfg)
    await service.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, stop.set)
    print(service.describe(), file=sys.stderr, flush=True)
    notifier = Notifier()
    notifier.send("READY=1", "STATUS=admitting")
    if ready is not None:
        ready(service)
    try:
        await stop.wait()
    finally:
        notifier.send("STOPPING=1")
        notifier.close()
        await service.stop()


def _run(a: argparse.Namespace) -> int:
    try:
        cfg = AdmissionConfig.load(a.config)
    except (OSError, ContractError) as exc:
        print(f"vllm-fleet admission: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(serve(cfg))
    except (OSError, KeyError) as exc:  # a socket that cannot be bound, a group that does not exist
        print(f"vllm-fleet admission: {exc}", file=sys.stderr)
        return 1
    return 0


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, metavar="PATH", help="the admission config (JSON)")
    p.set_defaults(handler=_run)
