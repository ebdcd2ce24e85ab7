"""The gateway's requests by model and HTTP status, upstream retries, failed upstream tries, request time, the
requests admitted without the admission service (fail open) and each model's requests by track (canary or
stable, rollouts), from its JSON access log (the nginx exporter has no status codes): tailed incrementally at
each scrape, counters kept for the exporter's lifetime."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from vllm_fleet.host.exporter.common import PREFIX

# gateway request duration buckets (seconds): interactive up to long generations
DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)

# nginx lists each try in $upstream_addr / $upstream_status: ", " between the servers of one upstream, " : "
# between upstreams (an internal redirect: spill-over, fallback, the drain walk)
_TRIES = re.compile(r", | : ")
# the status nginx records for a try that got no answer: 502 for a connection refused, reset or closed before the
# response header (a reused keep-alive connection the engine had closed is one), 504 for a timeout
_FAILED_TRY = {"502": "error", "504": "timeout"}


# the (kind, retried) label pairs of gateway_upstream_failed_tries_total, each exported from the start
FAILED_TRY_KEYS = (("error", False), ("error", True), ("timeout", False), ("timeout", True))


def failed_tries(addrs: str, statuses: str) -> list[tuple[str, bool]]:
    """The tries of one request that failed before any response: (kind, retried) each, ``retried`` when the
    request was sent again after it (to the same server on a fresh connection, another server, the fallback),
    not when it was the last try (the client got the gateway's error). A name that is not an address (nginx's
    "no live upstreams": the upstream's name) is no try."""
    a = _TRIES.split(addrs) if addrs else []
    st = _TRIES.split(statuses) if statuses else []
    if len(a) != len(st):
        a = ["?:"] * len(st)
    out = []
    for i, (addr, status) in enumerate(zip(a, st, strict=True)):
        kind = _FAILED_TRY.get(status.strip())
        if kind and (":" in addr):
            out.append((kind, i < len(st) - 1))
    return out


# gateway_track_requests_total's tracks and outcomes, each exported from the start for a model seen with a track
TRACKS = ("canary", "stable")
OUTCOMES = ("ok", "error", "shed")


def track_outcome(track: str, status: int, statuses: str) -> str:
    """The outcome of a request on its track (``$vf_track``): "shed" when it was turned away full (a canary
    request: the canary's try answered 503, whatever the model's normal path then answered; a stable one: the
    gateway's 503), "error" for a 5xx (a canary request: also when the canary's try failed before the first
    byte — 502/504 — and the normal path then served it: the canary failed it), else "ok": the engine answered
    (2xx, and 4xx: the request's own fault, the same on either track; 499: the client gave up). The canary's
    try is the first upstream of ``$upstream_status`` (before the first " : "), its answer the last status
    there (a reused keep-alive connection that failed is retried on the same server first)."""
    if track == "canary" and statuses:
        first = statuses.split(" : ", 1)[0].split(", ")[-1].strip()
        if first == "503":
            return "shed"
        if first.startswith("5"):
            return "error"
    if status == 503 and track == "stable":
        return "shed"
    return "error" if status >= 500 else "ok"


@dataclass
class _ModelStats:
    codes: dict[str, int] = field(default_factory=dict)
    retried: int = 0
    # (kind, retried) → failed upstream tries (failed_tries)
    failed: dict[tuple[str, bool], int] = field(default_factory=dict)
    buckets: list[int] = field(default_factory=lambda: [0] * len(DURATION_BUCKETS))
    count: int = 0
    total_seconds: float = 0.0
    # (track, outcome) → requests (track_outcome); only lines with a track (older lines have none)
    tracks: dict[tuple[str, str], int] = field(default_factory=dict)


class AccessLogTail(Collector):
    """Follows the gateway's JSON access log (one object per line: status, model, upstream_addr,
    request_time — nginx/vllm-fleet.conf.j2's ``vf_json``). Counts what is written after it was created, survives
    rotation (new inode or truncation), keeps counters for the exporter's lifetime."""

    def __init__(self, path: Path, from_start: bool = False) -> None:
        self.path = path
        self._buf = b""
        self.stats: dict[str, _ModelStats] = {}
        self.bad_lines = 0
        # gateway.limits: requests nginx admitted unlimited because the admission service did not answer
        # ("admission": "open", nginx/vllm-fleet.conf.j2's @vf_admit_open)
        self.fail_open = 0
        self._lock = threading.Lock()
        # lines written from now on count; a file that appears later is read from its start
        try:
            st = path.stat()
            self._inode, self._pos = st.st_ino, 0 if from_start else st.st_size
        except OSError:
            self._inode, self._pos = -1, 0

    def poll(self) -> None:
        with self._lock:
            try:
                st = self.path.stat()
            except OSError:
                return
            if st.st_ino != self._inode or st.st_size < self._pos:
                self._inode, self._pos, self._buf = st.st_ino, 0, b""
            if st.st_size == self._pos:
                return
            with self.path.open("rb") as f:
                f.seek(self._pos)
                data = f.read(st.st_size - self._pos)
            self._pos += len(data)
            lines = (self._buf + data).split(b"\n")
            self._buf = lines.pop()
            for line in lines:
                if line.strip():
                    self._count(line)

    def _count(self, line: bytes) -> None:
        try:
            rec = json.loads(line)
            code = str(int(rec["status"]))
        except (ValueError, KeyError, TypeError):
            self.bad_lines += 1
            return
        model = str(rec.get("model") or "") or "none"
        s = self.stats.setdefault(model, _ModelStats())
        s.codes[code] = s.codes.get(code, 0) + 1
        if "," in str(rec.get("upstream_addr") or ""):
            s.retried += 1
        for key in failed_tries(str(rec.get("upstream_addr") or ""), str(rec.get("upstream_status") or "")):
            s.failed[key] = s.failed.get(key, 0) + 1
        track = rec.get("track")
        if track in TRACKS:
            tk = (str(track), track_outcome(str(track), int(code), str(rec.get("upstream_status") or "")))
            s.tracks[tk] = s.tracks.get(tk, 0) + 1
        try:
            seconds = float(rec.get("request_time", 0.0))
        except (TypeError, ValueError):
            seconds = 0.0
        s.count += 1
        s.total_seconds += seconds
        if rec.get("admission") == "open":
            self.fail_open += 1
        for n, bound in enumerate(DURATION_BUCKETS):
            if seconds <= bound:
                s.buckets[n] += 1

    def metrics(self) -> Iterator[Metric]:
        self.poll()
        req = CounterMetricFamily(
            PREFIX + "gateway_requests",
            "Gateway requests by model and HTTP status (access log)",
            labels=["model", "code"],
        )
        retried = CounterMetricFamily(
            PREFIX + "gateway_upstream_retries",
            "Gateway requests that tried more than one upstream server (failover before the first byte)",
            labels=["model"],
        )
        failed = CounterMetricFamily(
            PREFIX + "gateway_upstream_failed_tries",
            "Gateway upstream tries that got no answer (kind error: connection refused, reset or closed before"
            " the response, e.g. a reused keep-alive connection the engine had closed; timeout), by whether the"
            " request was sent again (retried true) or the client got the gateway's 502/504 (false)",
            labels=["model", "kind", "retried"],
        )
        tracks = CounterMetricFamily(
            PREFIX + "gateway_track_requests",
            "Gateway requests of a model by track (canary: sent to the model's canary first, rollouts; stable)"
            " and outcome (ok; error: 5xx, or the canary's try failed before the first byte; shed: turned away"
            " full, the canary's try answered 503)",
            labels=["model", "track", "outcome"],
        )
        dur = HistogramMetricFamily(
            PREFIX + "gateway_request_duration_seconds", "Gateway request time (access log)", labels=["model"]
        )
        with self._lock:
            for model, s in sorted(self.stats.items()):
                for code, n in sorted(s.codes.items()):
                    req.add_metric([model, code], n)
                retried.add_metric([model], s.retried)
                if s.tracks:  # every track and outcome at 0 too, for a model logged with tracks
                    for track in TRACKS:
                        for outcome in OUTCOMES:
                            tracks.add_metric([model, track, outcome], s.tracks.get((track, outcome), 0))
                # every kind at 0 too: the failover panel has series on a fleet that never failed a try
                for kind, again in FAILED_TRY_KEYS:
                    failed.add_metric(
                        [model, kind, "true" if again else "false"], s.failed.get((kind, again), 0)
                    )
                cum = [(str(b), float(c)) for b, c in zip(DURATION_BUCKETS, s.buckets, strict=True)] + [
                    ("+Inf", float(s.count))
                ]
                dur.add_metric([model], cum, s.total_seconds)
            bad, fail_open = self.bad_lines, self.fail_open
        yield req
        yield retried
        yield failed
        yield tracks
        yield dur
        yield CounterMetricFamily(
            PREFIX + "gateway_log_bad_lines", "Access log lines that were not JSON", value=bad
        )
        yield CounterMetricFamily(
            PREFIX + "gateway_admission_fail_open",
            "Gateway requests admitted without per-key limits because the admission service did not answer "
            "(gateway.limits.on_failure: open; access log)",
            value=fail_open,
        )

    def collect(self) -> Iterator[Metric]:
        return self.metrics()
