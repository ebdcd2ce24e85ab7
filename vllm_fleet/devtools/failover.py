"""The failover test's measurement driver (docs/design/ha.md, "The failover test"): steady client traffic
against the gateways' virtual address, a cut (the holder powered off), and what the clients saw.

    python -m vllm_fleet.devtools.failover run http://10.77.0.9:8000 --key-file KEY --model tiny-qwen3 \\
        --lanes 8 --duration 180 --cut-after 90 --cut-cmd 'ip link set vb-h1 down; machinectl poweroff h1' \\
        --engine-metrics http://10.77.0.73:8101/metrics,http://10.77.0.73:8102/metrics --out failover.json

- ``FailoverLoad``: N lanes (threads), even lanes plain, odd lanes streaming chat completions; each prompt is
  one of a few long shared system prefixes and a short varying question (deterministic per seed), so the
  gateway's cache-aware routing and the engines' prefix caches matter. A new connection per request by
  default (after a failover the old connections are dead anyway); a connect timeout, a read timeout and a
  total bound per request, so requests to a dead address fail fast. Every request is recorded (``Record``).
  A holder that dies silently resets nothing: its in-flight requests hang until the read timeout, and a lane
  that waits on one starts nothing meanwhile — the gap is measured by the lanes that were idle at the cut,
  so the command pauses ``--pause`` s between a lane's requests (``first_start_after_cut_s`` in the report
  says how soon a request started after the cut: the gap's resolution).
- ``FailoverReport``: from the records and the cut time — failures by outcome, those in flight at the cut vs
  started after it, the gap until a request started after the cut succeeds, the rates before and after.
- ``scrape_prefix_cache`` / ``prefix_hit_rate``: the fleet's prefix-cache hit rate between two snapshots of
  the engines' ``vllm:prefix_cache_hits_total`` / ``vllm:prefix_cache_queries_total`` (vLLM's V1 counters,
  in tokens; the sim engine exports the same).
- ``run_failover``: load, snapshot, cut, snapshot, stop; the command above writes its result as JSON.

Outcomes: ``ok``; ``http_<status>``; ``connect_error`` (refused, unreachable or the connect timeout; the detail
says which); ``timeout`` (connected, then the read timeout or the total bound passed); ``reset`` (the
connection dropped before a complete answer); ``stream_cut`` (a 200 stream ended without ``data: [DONE]``);
``error_event`` (a stream carried an error event); ``error`` (anything else: an unreadable answer).
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from prometheus_client.parser import text_string_to_metric_families

from vllm_fleet.devtools.gateway_testing import chat_body

PREFIX_HITS = "vllm:prefix_cache_hits_total"
PREFIX_QUERIES = "vllm:prefix_cache_queries_total"

_WORDS = (
    "request", "engine", "gateway", "address", "token", "cache", "prefix", "block", "route", "answer", "model",
    "stream", "client", "server", "health", "check", "queue", "batch", "memory", "latency", "failover", "host",
    "network", "bridge", "packet", "timer", "priority", "holder", "backup", "restart", "metric", "counter",
    "window", "budget", "limit", "policy", "service", "unit", "state", "log",
)  # fmt: skip
_RESET = (ConnectionError, http.client.IncompleteRead, http.client.RemoteDisconnected)


def shared_prefixes(n: int = 8, words: int = 300, seed: int = 0) -> list[str]:
    """``n`` long system prompts, different from their first word on (the gateway's cache-aware key is the
    prompt's first characters)."""
    rng = random.Random(f"failover-prefixes-{seed}")
    return [
        f"Profile {k} of {n}. You answer briefly. " + " ".join(rng.choice(_WORDS) for _ in range(words))
        for k in range(n)
    ]


@dataclass(frozen=True)
class Record:
    """One request; times in seconds since the load started."""

    lane: int
    stream: bool
    start: float
    end: float
    outcome: str
    status: int | None = None
    detail: str = ""


def _is_error_event(line: bytes) -> bool:
    """An SSE line that reports an error: vLLM's ``data: {"error": ...}``, Anthropic's ``event: error``."""
    if line == b"event: error":
        return True
    if not (line.startswith(b"data: {") and b'"error"' in line):
        return False
    try:
        return "error" in json.loads(line[6:])
    except ValueError:
        return False


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:200]


class FailoverLoad:
    """Client traffic until ``stop()``: ``lanes`` threads, even lanes plain and odd lanes streaming, no client
    retries; ``pause`` seconds after an ok request, ``fail_pause`` after a failed one (a refused connect
    returns at once); ``read_timeout``: the longest wait for a byte once connected, ``timeout`` the total.

        with FailoverLoad("http://10.77.0.9:8000", "tiny-qwen3", api_key=KEY) as load:
            time.sleep(30); load.mark("cut"); ...
        FailoverReport.compute(load.records, load.marks["cut"], end=load.stopped_at)
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None = None,
        lanes: int = 8,
        max_tokens: int = 16,
        keep_alive: bool = False,
        connect_timeout: float = 1.0,
        timeout: float = 30.0,
        read_timeout: float = 5.0,
        pause: float = 0.0,
        fail_pause: float = 0.1,
        seed: int = 0,
        prefixes: int = 8,
        prefix_words: int = 300,
        insecure: bool = False,
    ) -> None:
        u = urlsplit(base_url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"not an http(s) base URL: {base_url!r}")
        self.https = u.scheme == "https"
        self.host, self.port = u.hostname, u.port or (443 if self.https else 80)
        self.path = u.path.rstrip("/").removesuffix("/v1") + "/v1/chat/completions"
        self.ssl_context: ssl.SSLContext | None = None
        if insecure:
            self.ssl_context = ssl.create_default_context()
            self.ssl_context.check_hostname = False
            self.ssl_context.verify_mode = ssl.CERT_NONE
        self.model, self.lanes, self.max_tokens = model, lanes, max_tokens
        self.keep_alive, self.connect_timeout, self.timeout = keep_alive, connect_timeout, timeout
        self.read_timeout, self.pause, self.fail_pause, self.seed = read_timeout, pause, fail_pause, seed
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.prefixes = shared_prefixes(prefixes, prefix_words, seed)
        self.t0 = 0.0
        self.started_wall = 0.0  # time.time() at the start: the records' times are offsets from it
        self.stopped_at: float | None = None
        self._records: list[Record] = []
        self._marks: list[tuple[str, float]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def now(self) -> float:
        return time.monotonic() - self.t0

    def start(self) -> FailoverLoad:
        self.t0, self.started_wall = time.monotonic(), time.time()
        self._threads = [
            threading.Thread(target=self._lane, args=(i,), daemon=True) for i in range(self.lanes)
        ]
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        """Stop the lanes (each ends its current request, at most ``timeout`` s more)."""
        if self.stopped_at is None:
            self.stopped_at = self.now()
        self._stop.set()
        for t in self._threads:
            t.join(self.timeout + 5)

    def __enter__(self) -> FailoverLoad:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def mark(self, label: str) -> float:
        """Note an event (e.g. "cut"); returns its time."""
        t = round(self.now(), 4)
        with self._lock:
            self._marks.append((label, t))
        return t

    @property
    def marks(self) -> dict[str, float]:
        """Label → time (the last one of a repeated label)."""
        with self._lock:
            return dict(self._marks)

    @property
    def records(self) -> list[Record]:
        with self._lock:
            return list(self._records)

    def body(self, rng: random.Random, lane: int, n: int, stream: bool) -> dict[str, Any]:
        prefix = rng.choice(self.prefixes)
        question = f"Question {lane}-{n}: " + " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 12)))
        messages = [{"role": "system", "content": prefix}, {"role": "user", "content": question}]
        return chat_body(self.model, self.max_tokens, messages=messages, stream=stream)

    def _connection(self) -> http.client.HTTPConnection:
        if self.https:
            return http.client.HTTPSConnection(
                self.host, self.port, timeout=self.connect_timeout, context=self.ssl_context
            )
        return http.client.HTTPConnection(self.host, self.port, timeout=self.connect_timeout)

    def _lane(self, lane: int) -> None:
        rng = random.Random(f"failover-{self.seed}-{lane}")
        stream = lane % 2 == 1
        conn: http.client.HTTPConnection | None = None
        n = 0
        while not self._stop.is_set():
            payload = json.dumps(self.body(rng, lane, n, stream)).encode()
            n += 1
            start = self.now()
            conn = conn or self._connection()
            try:
                outcome, status, detail = self._one(conn, payload, stream, time.monotonic() + self.timeout)
            except Exception as exc:  # a lane that died would count nothing more: count it as a failure
                outcome, status, detail = "error", None, _describe(exc)
            rec = Record(lane, stream, round(start, 4), round(self.now(), 4), outcome, status, detail)
            with self._lock:
                self._records.append(rec)
            if not (self.keep_alive and (outcome == "ok" or outcome.startswith("http_"))):
                conn.close()
                conn = None
            self._stop.wait(self.pause if outcome == "ok" else self.fail_pause)
        if conn is not None:
            conn.close()

    def _one(
        self, conn: http.client.HTTPConnection, payload: bytes, stream: bool, deadline: float
    ) -> tuple[str, int | None, str]:
        """(outcome, HTTP status, detail) of one request on ``conn``."""
        if conn.sock is None:
            try:
                conn.connect()
            except OSError as exc:
                return "connect_error", None, _describe(exc)
        sock = conn.sock

        def bound() -> None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the total bound passed")
            sock.settimeout(min(left, self.read_timeout))

        status: int | None = None
        done = error_event = False
        try:
            bound()
            conn.request("POST", self.path, payload, self.headers)
            r = conn.getresponse()
            status = r.status
            if status != 200 or not stream:
                data = b""
                while True:
                    bound()
                    chunk = r.read1(65536)
                    if not chunk:
                        break
                    data += chunk
                if r.length:  # the connection ended before the Content-Length (read1 says so by b"")
                    raise http.client.IncompleteRead(data, r.length)
                r.close()  # read to its end (read1 does not close it): the connection may take the next request
                if status != 200:
                    return f"http_{status}", status, data[:200].decode(errors="replace")
                try:
                    ok = bool(json.loads(data).get("choices"))
                except (ValueError, AttributeError):
                    ok = False
                return ("ok", status, "") if ok else ("error", status, f"no choices: {data[:200]!r}")
            while True:
                bound()
                line = r.readline()
                if not line:
                    break
                line = line.strip()
                if line == b"data: [DONE]":
                    done = True
                else:
                    error_event = error_event or _is_error_event(line)
            r.close()
        except TimeoutError as exc:
            return "timeout", status, _describe(exc)
        except (*_RESET, OSError) as exc:
            if status == 200 and stream:
                return ("error_event" if error_event else "stream_cut"), status, _describe(exc)
            return ("reset" if isinstance(exc, _RESET) else "error"), status, _describe(exc)
        except http.client.HTTPException as exc:
            return "error", status, _describe(exc)
        if error_event:
            return "error_event", status, ""
        return ("ok", status, "") if done else ("stream_cut", status, "the stream ended without [DONE]")


def _rate(n: int, seconds: float) -> float | None:
    return round(n / seconds, 3) if seconds > 0 else None


@dataclass
class FailoverReport:
    """What the clients saw around the cut; times in seconds since the load started unless ``_after`` /
    ``_before`` the cut. ``gap_s``: from the cut to the start of the first request that started after the cut
    and succeeded (None: none did); ``first_start_after_cut_s``: when any request started after the cut (a
    long one: every lane was waiting on a request, and the gap is no finer than that). ``ok_rps_before``: ok
    answers per second from the load's start to the cut; ``ok_rps_after``: from the recovery (cut + gap) to
    the end."""

    cut: float
    start: float
    end: float
    total: int
    ok: int
    failed: int
    failed_by_outcome: dict[str, int]
    failed_before_cut: int
    in_flight_at_cut: int
    failed_in_flight: dict[str, int]
    failed_started_after_cut: dict[str, int]
    failed_after_recovery: int
    gap_s: float | None
    first_start_after_cut_s: float | None
    last_ok_before_cut_s: float | None
    first_ok_after_cut_s: float | None
    ok_rps_before: float | None
    ok_rps_after: float | None
    marks: dict[str, float] = field(default_factory=dict)

    @classmethod
    def compute(
        cls,
        records: Iterable[Record],
        cut: float,
        start: float = 0.0,
        end: float | None = None,
        marks: dict[str, float] | None = None,
    ) -> FailoverReport:
        recs = sorted(records, key=lambda r: r.start)
        end = end if end is not None else max((r.end for r in recs), default=cut)
        oks = [r for r in recs if r.outcome == "ok"]
        failed = [r for r in recs if r.outcome != "ok"]
        in_flight = [r for r in recs if r.start < cut < r.end]
        recovered = next((r.start for r in oks if r.start >= cut), None)
        ok_before = [r.end for r in oks if start <= r.end <= cut]
        ok_after = [r.end for r in oks if r.end > cut]
        ok_recovered = sum(1 for t in ok_after if recovered is not None and recovered <= t <= end)
        return cls(
            cut=cut,
            start=start,
            end=end,
            total=len(recs),
            ok=len(oks),
            failed=len(failed),
            failed_by_outcome=dict(Counter(r.outcome for r in failed)),
            failed_before_cut=sum(1 for r in failed if r.end <= cut),
            in_flight_at_cut=len(in_flight),
            failed_in_flight=dict(Counter(r.outcome for r in in_flight if r.outcome != "ok")),
            failed_started_after_cut=dict(Counter(r.outcome for r in failed if r.start >= cut)),
            failed_after_recovery=sum(1 for r in failed if recovered is not None and r.start > recovered),
            gap_s=None if recovered is None else round(recovered - cut, 4),
            first_start_after_cut_s=next((round(r.start - cut, 4) for r in recs if r.start >= cut), None),
            last_ok_before_cut_s=round(cut - max(ok_before), 4) if ok_before else None,
            first_ok_after_cut_s=round(min(ok_after) - cut, 4) if ok_after else None,
            ok_rps_before=_rate(len(ok_before), cut - start),
            ok_rps_after=None if recovered is None else _rate(ok_recovered, end - recovered),
            marks=dict(marks or {}),
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        def outcomes(d: dict[str, int]) -> str:
            return ", ".join(f"{k} {v}" for k, v in sorted(d.items())) or "none"

        def s(v: float | None) -> str:
            return "-" if v is None else f"{v:.2f} s"

        gap = "never recovered" if self.gap_s is None else f"gap {s(self.gap_s)}"
        return (
            f"cut at {self.cut:.2f} s: {self.total} requests, {self.ok} ok, {self.failed} failed "
            f"(in flight at the cut: {outcomes(self.failed_in_flight)}; started after: "
            f"{outcomes(self.failed_started_after_cut)}; after recovery {self.failed_after_recovery}); {gap}; "
            f"last ok {s(self.last_ok_before_cut_s)} before, first ok completion {s(self.first_ok_after_cut_s)} "
            f"after; ok/s {self.ok_rps_before} before, {self.ok_rps_after} after"
        )


# ------------------------------------------------------------------------------------- prefix-cache hit rate


@dataclass(frozen=True)
class CacheSnapshot:
    """Each engine's (hits, queries) counters at ``t``; ``errors``: engines that did not answer."""

    t: float
    engines: dict[str, tuple[float, float]]
    errors: dict[str, str] = field(default_factory=dict)


def prefix_counters(text: str) -> tuple[float, float]:
    """(hits, queries) of one engine's /metrics text, summed over its label sets."""
    sums = {PREFIX_HITS: 0.0, PREFIX_QUERIES: 0.0}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in sums:
                sums[s.name] += float(s.value)
    return sums[PREFIX_HITS], sums[PREFIX_QUERIES]


def scrape_prefix_cache(urls: list[str], t: float, timeout: float = 5.0) -> CacheSnapshot:
    engines: dict[str, tuple[float, float]] = {}
    errors: dict[str, str] = {}
    for url in urls:
        try:
            with urllib.request.urlopen(url, timeout=timeout) as r:
                engines[url] = prefix_counters(r.read().decode())
        except (OSError, ValueError) as exc:
            errors[url] = _describe(exc)
    return CacheSnapshot(t, engines, errors)


def prefix_hit_rate(a: CacheSnapshot, b: CacheSnapshot) -> dict[str, Any]:
    """Δhits/Δqueries from ``a`` to ``b`` summed over the engines in both (a counter that went down — the
    engine restarted — counts from 0, as Prometheus's ``increase`` does); ``hit_rate`` None without queries."""
    per: dict[str, dict[str, float]] = {}
    for url in sorted(a.engines.keys() & b.engines.keys()):
        (h0, q0), (h1, q1) = a.engines[url], b.engines[url]
        per[url] = {"hits": h1 - h0 if h1 >= h0 else h1, "queries": q1 - q0 if q1 >= q0 else q1}
    hits = sum(e["hits"] for e in per.values())
    queries = sum(e["queries"] for e in per.values())
    return {
        "from": a.t,
        "to": b.t,
        "hits": hits,
        "queries": queries,
        "hit_rate": round(hits / queries, 4) if queries else None,
        "engines": per,
        "missing": sorted(
            (a.engines.keys() | b.engines.keys() | a.errors.keys() | b.errors.keys()) - per.keys()
        ),
    }


# ----------------------------------------------------------------------------------------------- the run


def shell_cut(cmd: str, timeout: float = 300) -> Callable[[], dict[str, Any]]:
    """A cut that runs ``cmd`` in a shell; its result: exit status and the output's end."""

    def cut() -> dict[str, Any]:
        try:
            p = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=timeout)
            return {"cmd": cmd, "rc": p.returncode, "output": (p.stdout + p.stderr)[-2000:]}
        except subprocess.TimeoutExpired as exc:
            return {"cmd": cmd, "rc": None, "output": f"timed out after {exc.timeout} s"}

    return cut


def run_failover(
    load: FailoverLoad,
    duration: float,
    cut_after: float,
    cut: Callable[[], dict[str, Any]] | None = None,
    engine_metrics: list[str] | None = None,
    window: float = 60.0,
) -> dict[str, Any]:
    """Run ``load`` for ``duration`` s; at ``cut_after`` mark "cut" and run ``cut`` (in a thread: the load and
    the snapshots go on meanwhile; its start is the cut, its end "cut_done"). The engines' prefix-cache
    counters are read at cut − window (or the start), just before the cut, and at cut + window (or the end)."""
    if not 0 < cut_after < duration:
        raise ValueError("the cut must fall inside the run (0 < cut_after < duration)")
    urls = engine_metrics or []
    snaps: list[CacheSnapshot] = []
    cut_result: dict[str, Any] = {}

    def at(t: float) -> None:
        time.sleep(max(0.0, t - load.now()))

    def run_cut() -> None:
        res = cut() if cut is not None else {}
        cut_result.update(res, end=load.mark("cut_done"))

    cutter = threading.Thread(target=run_cut, daemon=True)
    with load:
        if urls:
            at(max(0.0, cut_after - window))
            snaps.append(scrape_prefix_cache(urls, round(load.now(), 4)))
            at(cut_after)
            snaps.append(scrape_prefix_cache(urls, round(load.now(), 4)))
        at(cut_after)
        cut_at = load.mark("cut")
        cut_result["start"] = cut_at
        cutter.start()
        if urls:
            at(min(duration, cut_at + window))
            snaps.append(scrape_prefix_cache(urls, round(load.now(), 4)))
        at(duration)
    cutter.join(310)  # shell_cut's own bound is 300 s
    if "end" not in cut_result:
        cut_result["still_running"] = True
    report = FailoverReport.compute(load.records, cut_at, end=load.stopped_at, marks=load.marks)
    return {
        "summary": report.summary(),
        "report": report.as_dict(),
        "prefix_cache": {
            "before": prefix_hit_rate(snaps[0], snaps[1]),
            "after": prefix_hit_rate(snaps[1], snaps[2]),
            "errors": {f"{s.t}": s.errors for s in snaps if s.errors},
        }
        if urls
        else None,
        "cut": cut_result,
        "load": {
            "started_wall": load.started_wall,
            "lanes": load.lanes,
            "keep_alive": load.keep_alive,
            "max_tokens": load.max_tokens,
            "connect_timeout": load.connect_timeout,
            "read_timeout": load.read_timeout,
            "timeout": load.timeout,
            "pause": load.pause,
            "prefixes": len(load.prefixes),
            "seed": load.seed,
        },
        "records": [asdict(r) for r in load.records],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m vllm_fleet.devtools.failover", description=__doc__.split("\n")[0]
    )
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="load URL, cut at --cut-after, write the report")
    r.add_argument("url", help="the gateway's base URL, e.g. http://10.77.0.9:8000")
    r.add_argument("--key-file", type=Path, help="a file holding the API key (none: no Authorization header)")
    r.add_argument("--model", required=True)
    r.add_argument("--lanes", type=int, default=8)
    r.add_argument("--duration", type=float, default=180, help="seconds of load in all")
    r.add_argument("--cut-after", type=float, default=90, help="seconds of load before the cut")
    r.add_argument("--cut-cmd", help="shell command run at the cut (none: only the time is marked)")
    r.add_argument("--engine-metrics", default="", help="comma-separated engine /metrics URLs")
    r.add_argument("--window", type=float, default=60, help="hit-rate window before and after the cut (s)")
    r.add_argument("--max-tokens", type=int, default=16)
    r.add_argument(
        "--keep-alive", action="store_true", help="one connection per lane (default: one per request)"
    )
    r.add_argument("--connect-timeout", type=float, default=1.0)
    r.add_argument("--read-timeout", type=float, default=5.0, help="longest wait for a byte (s)")
    r.add_argument("--timeout", type=float, default=30.0, help="total bound per request (s)")
    r.add_argument(
        "--pause", type=float, default=0.5,
        help="seconds a lane waits after an ok request: idle lanes start requests right after the cut",
    )  # fmt: skip
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--insecure", action="store_true", help="https without checking the certificate")
    r.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    key = a.key_file.read_text().strip() if a.key_file else None
    load = FailoverLoad(
        a.url, a.model, key, lanes=a.lanes, max_tokens=a.max_tokens, keep_alive=a.keep_alive,
        connect_timeout=a.connect_timeout, read_timeout=a.read_timeout, timeout=a.timeout, pause=a.pause,
        seed=a.seed, insecure=a.insecure,
    )  # fmt: skip
    urls = [u for u in a.engine_metrics.split(",") if u]
    cut = shell_cut(a.cut_cmd) if a.cut_cmd else None
    result = run_failover(load, a.duration, a.cut_after, cut, urls, a.window)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    print(result["summary"])
    if result["prefix_cache"]:
        pc = result["prefix_cache"]
        print(f"prefix-cache hit rate: {pc['before']['hit_rate']} before, {pc['after']['hit_rate']} after")
    return 0


if __name__ == "__main__":
    sys.exit(main())
