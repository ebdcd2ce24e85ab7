#!/usr/bin/env python3
"""The gateway burst of issue 31 ("overload users can trust") against the two-host sandbox fleet that
    make demo DEMO_SPEC=examples/tiny-cpu-2hosts.yml KEEP=1
leaves running (demo-h1: gateway + tiny-a + tiny-b, demo-h2: tiny-backup): optionally drain one instance, then
N lanes, each sending streamed chat completions one after another (a new connection per request, or one kept
per lane with --keepalive) through the gateway for D seconds; every request is classified:

- ``complete``: HTTP 200 event stream with at least one content event, ending in ``data: [DONE]`` (TTFT kept);
- ``error_200``: HTTP 200 whose events carry an ``"error"`` (the defect: must be 0);
- ``refused``: 429/503, with whether ``Retry-After`` came and the JSON error's code and reason (the admission
  service's reason is the last ``(word)`` of the message: ``wait_timeout``, ``in_flight``, ...);
- ``empty_200``: a 200 stream that ended with ``[DONE]`` and no content at all;
- ``other_status``: any other status;
- ``dropped``: the connection reset, closed or timed out before a complete answer (must be 0).

After the run: the gateway's access log (JSON lines) of the run's window — how many requests spilled (an
upstream 503 followed by another try, or answered by a ``__spill`` / ``__fallback`` pool) — and the admission
service's per-key counters (before/after deltas: admitted, refused by reason). The demo key has the default
budget (64 in flight, ``queue_wait_seconds`` 20), so most of 200 lanes of one key wait in the gateway, then get
429 ``wait_timeout`` with ``Retry-After``: expected, and reported as such. Exit 0 when error_200 = 0,
dropped = 0 and every refusal is a 429/503 with Retry-After; else 1.

    sudo .venv/bin/python tools/sandbox_burst.py --drain tiny-b --lanes 200 --duration 90 --out /tmp/burst.json

Root because the sandbox's SSH key and the demo's key file are root's. Everything that touches the sandbox is
a shell command that can be replaced (--url, --key, --access-log-cmd, --metrics-url/--metrics-cmd,
--drain-cmd/--undrain-cmd), so the same tool runs against a local gateway.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import http.client
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import threading
import time
import urllib.parse
from collections import Counter
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import Any

REMOTE_VF = "/opt/vllm-fleet/venv/bin/vllm-fleet"
ACCESS_LOG = "/var/log/nginx/vllm-fleet.access.log"
ADMISSION_JSON = "/etc/vllm-fleet/gateway/admission.json"
# tools/demo.sh: WORK=$(mktemp -d /tmp/vllm-fleet-demo.XXXXXX); KEY_FILE=$WORK/inventory/vllm-fleet-secrets/...
DEMO_KEY_GLOB = "/tmp/vllm-fleet-demo.*/inventory/vllm-fleet-secrets/gateway-api-key"
KINDS = ("complete", "error_200", "refused", "empty_200", "other_status", "dropped")
REASON_RE = re.compile(r"\(([a-z_]+)\)")


# ---- pure helpers (tests/unit/test_sandbox_burst.py) ----


def sse_payloads(text: str) -> list[str]:
    """The ``data:`` payloads of an event stream, in order (``[DONE]`` included)."""
    out = []
    for line in text.splitlines():
        if line.startswith("data:"):
            out.append(line[5:].strip())
    return out


def event_has_content(payload: str) -> bool:
    """A chunk that carries text: a chat completion's delta (content, or a reasoning model's reasoning), or a
    text completion's (``/v1/completions``) ``text``."""
    try:
        ev = json.loads(payload)
    except ValueError:
        return False
    if not isinstance(ev, dict):
        return False
    for choice in ev.get("choices") or []:
        if not isinstance(choice, dict):
            continue
        if choice.get("text"):
            return True
        delta = choice.get("delta") or {}
        if any(delta.get(k) for k in ("content", "reasoning_content", "reasoning")):
            return True
    return False


def _error_fields(body: Any) -> tuple[str | None, str | None, str | None]:
    """(code, reason, message) of an OpenAI or Anthropic JSON error body; reason: the admission service's
    ``(reason)`` in the message, else None."""
    if not isinstance(body, dict) or not isinstance(body.get("error"), dict):
        return None, None, None
    err = body["error"]
    message = str(err.get("message") or "")
    code = err.get("code")
    code = str(code) if code is not None else (str(err["type"]) if err.get("type") else None)
    found = REASON_RE.findall(message)
    return code, (found[-1] if found else None), message or None


def classify(
    status: int | None,
    body: str,
    *,
    content_type: str = "",
    retry_after: str | None = None,
    error: str | None = None,
) -> dict[str, Any]:
    """One request's outcome: ``status`` (None: no response at all), the body read (the stream's text for a
    200 event stream, as far as it came), the response's Content-Type and Retry-After, and ``error``: what
    broke the read (an exception's text), if anything."""
    out: dict[str, Any] = {"status": status}
    if status is None:
        return {**out, "kind": "dropped", "detail": error or "no response"}
    if status == 200:
        payloads = sse_payloads(body)
        errors = []
        for p in payloads:
            try:
                ev = json.loads(p)
            except ValueError:
                continue
            if isinstance(ev, dict) and "error" in ev:
                errors.append(ev)
        if errors:
            code, _, message = _error_fields(errors[0])
            return {
                **out,
                "kind": "error_200",
                "code": code,
                "detail": message or json.dumps(errors[0])[:300],
            }
        if not content_type.startswith("text/event-stream"):
            try:
                parsed = json.loads(body)
            except ValueError:
                parsed = None
            if isinstance(parsed, dict) and "error" in parsed:
                code, _, message = _error_fields(parsed)
                return {**out, "kind": "error_200", "code": code, "detail": message}
            return {**out, "kind": "other_status", "detail": f"200 {content_type or 'no content type'}"}
        done = "[DONE]" in payloads
        content = sum(1 for p in payloads if event_has_content(p))
        out["content_events"] = content
        if not done:
            return {**out, "kind": "dropped", "detail": error or "stream ended without data: [DONE]"}
        if content == 0:
            return {**out, "kind": "empty_200"}
        return {**out, "kind": "complete"}
    try:
        parsed = json.loads(body)
    except ValueError:
        parsed = None
    code, reason, message = _error_fields(parsed)
    out.update(code=code, reason=reason, retry_after=retry_after)
    if message:
        out["detail"] = message[:300]
    if error:  # the error body itself was cut short
        out["read_error"] = error
    out["kind"] = "refused" if status in (429, 503) else "other_status"
    return out


def _iso(t: str) -> float | None:
    try:
        return datetime.fromisoformat(t).timestamp()
    except (TypeError, ValueError):
        return None


def run_entries(
    lines: Iterable[str], t0: float, t1: float, uri_prefix: str = "/v1/chat/completions"
) -> list[dict[str, Any]]:
    """The access-log entries (JSON lines) of the run: logged between ``t0`` and ``t1`` (epoch seconds) for
    ``uri_prefix``; other lines are skipped."""
    out = []
    for line in lines:
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            e = json.loads(line)
        except ValueError:
            continue
        ts = _iso(e.get("time", ""))
        if ts is None or not t0 <= ts <= t1 or not str(e.get("uri", "")).startswith(uri_prefix):
            continue
        out.append(e)
    return out


def spill_kind(entry: dict[str, Any]) -> str | None:
    """How an access-log entry left its first choice: ``fallback`` (answered from the fallback pool),
    ``spill`` (the spill-over pool: the other instances), ``retry_503`` (an upstream 503 followed by another
    try in the same pool); None when it did not."""
    upstream = str(entry.get("upstream") or "")
    if upstream.endswith("__fallback"):
        return "fallback"
    if upstream.endswith("__spill"):
        return "spill"
    # $upstream_status: "503, 200" (next upstream), "503 : 200" (an internal redirect)
    statuses = [s for s in re.split(r"[\s,:]+", str(entry.get("upstream_status") or "")) if s]
    if "503" in statuses[:-1]:
        return "retry_503"
    return None


def spill_summary(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """Spills among the run's access-log entries, by kind, and the final statuses of those that spilled."""
    kinds: Counter[str] = Counter()
    final: Counter[str] = Counter()
    for e in entries:
        k = spill_kind(e)
        if k:
            kinds[k] += 1
            final[str(e.get("status"))] += 1
    return {
        "entries": len(entries),
        "spilled": sum(kinds.values()),
        "by_kind": dict(kinds),
        "spilled_final_status": dict(final),
        "status": dict(Counter(str(e.get("status")) for e in entries)),
        "upstream": dict(Counter(str(e.get("upstream") or "-") for e in entries)),
        "limit_req_rejected": sum(1 for e in entries if e.get("limit_req") == "REJECTED"),
    }


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text → ``{'name{labels}': value}``."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                continue
    return out


def key_id_suffix(key: str) -> str:
    """The tail of the gateway's key id (``CLIENT/`` + the first 8 hex digits of the key's sha256)."""
    return "/" + hashlib.sha256(key.encode()).hexdigest()[:8]


def _labels(rest: str) -> dict[str, str]:
    return dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', rest))


def key_counters(metrics: dict[str, float], key: str) -> dict[str, Any]:
    """The admission service's counters for ``key`` (matched by key id): admitted, withdrawn, refused by
    reason, and the key id itself."""
    suffix = key_id_suffix(key)
    out: dict[str, Any] = {"key_id": None, "admitted": 0.0, "withdrawn": 0.0, "refused": {}}
    p = "vllm_fleet_gateway_key_"
    for sample, value in metrics.items():
        name, _, rest = sample.partition("{")
        labels = _labels(rest)
        if not labels.get("key", "").endswith(suffix):
            continue
        out["key_id"] = labels["key"]
        if name in (p + "admitted", p + "admitted_total"):
            out["admitted"] += value
        elif name in (p + "withdrawn", p + "withdrawn_total"):
            out["withdrawn"] += value
        elif name in (p + "refused", p + "refused_total"):
            r = labels.get("reason", "?")
            out["refused"][r] = out["refused"].get(r, 0.0) + value
    return out


def counters_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    reasons = set(before.get("refused", {})) | set(after.get("refused", {}))
    return {
        "key_id": after.get("key_id") or before.get("key_id"),
        "admitted": after.get("admitted", 0) - before.get("admitted", 0),
        "withdrawn": after.get("withdrawn", 0) - before.get("withdrawn", 0),
        "refused": {
            r: after.get("refused", {}).get(r, 0) - before.get("refused", {}).get(r, 0)
            for r in sorted(reasons)
            if after.get("refused", {}).get(r, 0) - before.get("refused", {}).get(r, 0)
        },
    }


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    kinds = Counter(r["kind"] for r in records)
    refusals: Counter[str] = Counter()
    for r in records:
        if r["kind"] == "refused":
            ra = "Retry-After" if r.get("retry_after") else "NO Retry-After"
            refusals[f"{r['status']} {r.get('code')} ({r.get('reason') or '-'}) {ra}"] += 1
    ttft = sorted(r["ttft"] for r in records if r["kind"] == "complete" and r.get("ttft") is not None)

    def pct(q: float) -> float | None:
        return round(ttft[min(len(ttft) - 1, int(q * len(ttft)))], 3) if ttft else None

    refused = [r for r in records if r["kind"] == "refused"]
    return {
        "requests": len(records),
        "by_kind": {k: kinds.get(k, 0) for k in KINDS},
        "refusals": dict(refusals.most_common()),
        "refused_without_retry_after": sum(1 for r in refused if not r.get("retry_after")),
        "ttft_s": {
            "n": len(ttft),
            "p50": pct(0.5),
            "p95": pct(0.95),
            "max": round(ttft[-1], 3) if ttft else None,
            "mean": round(statistics.fmean(ttft), 3) if ttft else None,
        },
        "details": {
            k: dict(Counter(str(r.get("detail")) for r in records if r["kind"] == k).most_common(5))
            for k in ("error_200", "dropped", "other_status", "empty_200")
            if kinds.get(k)
        },
    }


def verdict(summary: dict[str, Any]) -> dict[str, bool]:
    k = summary["by_kind"]
    return {
        "no_error_200": k["error_200"] == 0,
        "no_dropped": k["dropped"] == 0,
        "refusals_429_503_with_retry_after": summary["refused_without_retry_after"] == 0,
        "no_other_status": k["other_status"] == 0,
    }


# ---- the load ----


class Lane:
    """One client: requests one after another until the deadline."""

    def __init__(
        self, i: int, a: argparse.Namespace, body: bytes, deadline: float, records: list[Any]
    ) -> None:
        self.i, self.a, self.body, self.deadline, self.records = i, a, body, deadline, records
        u = urllib.parse.urlsplit(a.url)
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 80
        self.conn: http.client.HTTPConnection | None = None
        self.stale_retries = 0

    def _connection(self) -> tuple[http.client.HTTPConnection, bool]:
        if self.a.keepalive and self.conn is not None:
            return self.conn, True
        self.conn = http.client.HTTPConnection(self.host, self.port, timeout=self.a.timeout)
        return self.conn, False

    def _close(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self.conn = None

    def one(self) -> dict[str, Any]:
        headers = {
            "Content-Type": "application/json",
            "Authorization": f"Bearer {self.a.key}",
            "Accept": "text/event-stream",
        }
        if not self.a.keepalive:
            headers["Connection"] = "close"
        start = time.monotonic()
        wall = time.time()
        for attempt in (0, 1):
            conn, reused = self._connection()
            try:
                conn.request("POST", "/v1/chat/completions", self.body, headers)
                resp = conn.getresponse()
                break
            except (OSError, http.client.HTTPException) as exc:
                self._close()
                # a kept-alive connection the gateway closed between two requests (keepalive_timeout): the
                # request never left; once on a fresh connection, counted apart
                if (
                    reused
                    and attempt == 0
                    and isinstance(exc, ConnectionError | http.client.RemoteDisconnected)
                ):
                    self.stale_retries += 1
                    continue
                rec = classify(None, "", error=f"{type(exc).__name__}: {exc}")
                return {
                    **rec,
                    "lane": self.i,
                    "t": round(wall, 3),
                    "seconds": round(time.monotonic() - start, 3),
                }
        ctype = resp.getheader("Content-Type", "") or ""
        retry_after = resp.getheader("Retry-After")
        request_id = resp.getheader("X-Request-Id")
        chunks: list[str] = []
        ttft = None
        error = None
        try:
            if resp.status == 200 and ctype.startswith("text/event-stream"):
                while True:
                    line = resp.readline()
                    if not line:
                        break
                    s = line.decode("utf-8", "replace")
                    chunks.append(s)
                    if ttft is None and s.startswith("data:") and event_has_content(s[5:].strip()):
                        ttft = time.monotonic() - start
            else:
                chunks.append(resp.read().decode("utf-8", "replace"))
        except (OSError, http.client.HTTPException) as exc:
            error = f"{type(exc).__name__}: {exc}"
        if error or not self.a.keepalive or resp.will_close:
            self._close()
        rec = classify(resp.status, "".join(chunks), content_type=ctype, retry_after=retry_after, error=error)
        rec.update(
            lane=self.i, t=round(wall, 3), seconds=round(time.monotonic() - start, 3), request_id=request_id
        )
        if ttft is not None:
            rec["ttft"] = round(ttft, 4)
        return rec

    def run(self, go: threading.Event) -> None:
        go.wait()
        while time.monotonic() < self.deadline:
            rec = self.one()
            self.records.append(rec)
            pause = 0.0
            if rec["kind"] == "refused" and self.a.honor_retry_after:
                try:
                    pause = float(rec.get("retry_after") or 0)
                except ValueError:
                    pause = 0.0
            elif rec["kind"] not in ("complete", "refused"):
                pause = 0.05  # no hot loop on a failing gateway
            pause = min(pause, max(0.0, self.deadline - time.monotonic()))
            if pause:
                time.sleep(pause)
        self._close()


def http_get_json(url: str, key: str, timeout: float = 10) -> Any:
    u = urllib.parse.urlsplit(url)
    c = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port or 80, timeout=timeout)
    try:
        c.request("GET", u.path, headers={"Authorization": f"Bearer {key}"})
        r = c.getresponse()
        data = r.read()
    except OSError as exc:
        raise SystemExit(f"GET {url}: {exc}") from None
    else:
        if r.status != 200:
            raise SystemExit(f"GET {url}: HTTP {r.status}: {data[:300]!r}")
        return json.loads(data)
    finally:
        c.close()


# ---- the sandbox (every piece a replaceable shell command) ----


def vf_cli() -> str:
    local = Path(sys.executable).with_name("vllm-fleet")
    return str(local) if local.exists() else "vllm-fleet"


def sandbox_ssh(host: str, remote: str) -> str:
    """A shell command running ``remote`` (a shell string) on sandbox host ``host`` as root."""
    return f"{shlex.quote(vf_cli())} sandbox ssh {shlex.quote(host)} -- {shlex.quote(remote)}"


def sh(cmd: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=timeout)


def gateway_url(prefix: str, host: str, port: int) -> str:
    cp = sh(f"{shlex.quote(vf_cli())} sandbox list --json", 60)
    if cp.returncode != 0:
        raise SystemExit(
            f"vllm-fleet sandbox list failed ({cp.returncode}): {cp.stderr.strip()} (run as root?)"
        )
    for h in json.loads(cp.stdout):
        if h["name"] == host:
            if not h.get("alive", True):
                raise SystemExit(f"{host} is not running")
            return f"http://{h['address']}:{port}"
    raise SystemExit(f"no sandbox host {host} (make demo DEMO_SPEC=examples/tiny-cpu-2hosts.yml KEEP=1)")


def read_key(path: str | None) -> str:
    if path is None:
        found = sorted(glob.glob(DEMO_KEY_GLOB), key=os.path.getmtime)
        if not found:
            raise SystemExit(
                f"no demo key file ({DEMO_KEY_GLOB}; root-only: run as root, or give --key-file)"
            )
        path = found[-1]
    return Path(path).read_text().split()[0]


def metrics_text(a: argparse.Namespace) -> str | None:
    if a.metrics_url:
        u = urllib.parse.urlsplit(a.metrics_url)
        c = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port or 80, timeout=10)
        try:
            c.request("GET", u.path or "/metrics")
            return c.getresponse().read().decode()
        except OSError as exc:
            print(f"metrics: {exc}", file=sys.stderr)
            return None
        finally:
            c.close()
    if not a.metrics_cmd:
        return None
    cp = sh(a.metrics_cmd, 60)
    if cp.returncode != 0:
        print(f"metrics command failed ({cp.returncode}): {cp.stderr.strip()[-300:]}", file=sys.stderr)
        return None
    return cp.stdout


def default_metrics_cmd(gw_host: str) -> str:
    prog = (
        "import json, urllib.request; "
        f'a = json.load(open("{ADMISSION_JSON}"))["metrics_address"]; '
        'print(urllib.request.urlopen("http://" + a + "/metrics", timeout=10).read().decode())'
    )
    return sandbox_ssh(gw_host, shlex.join(["python3", "-c", prog]))


def step(cmd: str, what: str) -> bool:
    print(f"{what}: {cmd}", file=sys.stderr)
    cp = sh(cmd, 300)
    out = (cp.stdout + cp.stderr).strip()
    if out:
        print("  " + out.replace("\n", "\n  "), file=sys.stderr)
    if cp.returncode != 0:
        print(f"{what} failed ({cp.returncode})", file=sys.stderr)
    return cp.returncode == 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefix", default=os.environ.get("DEMO_PREFIX", "demo-"), help="sandbox host prefix")
    p.add_argument("--gateway-host", help="sandbox host of the gateway (default PREFIX + h1)")
    p.add_argument("--port", type=int, default=8000, help="the gateway's port (the spec's gateway.port)")
    p.add_argument("--url", help="gateway base URL (default: the gateway host's address from sandbox list)")
    p.add_argument("--key", help="the API key itself (default: read --key-file)")
    p.add_argument("--key-file", help=f"the API key file (default: the newest {DEMO_KEY_GLOB})")
    p.add_argument("--drain", metavar="NAME", help="drain this instance before the burst, undrain it after")
    p.add_argument(
        "--drain-cmd", help="shell command template ({name}); default: vllm-fleet drain on the gateway host"
    )
    p.add_argument("--undrain-cmd", help="shell command template ({name}); default: vllm-fleet undrain there")
    p.add_argument("--lanes", type=int, default=200)
    p.add_argument("--duration", type=float, default=90, help="seconds during which lanes start requests")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--model", help="default: the first model of GET /v1/models")
    p.add_argument("--keepalive", action="store_true", help="one kept-alive connection per lane")
    p.add_argument("--timeout", type=float, default=120, help="socket timeout per request (s)")
    p.add_argument(
        "--ignore-retry-after",
        dest="honor_retry_after",
        action="store_false",
        help="retry a refusal at once (default: wait its Retry-After, as the SDKs do)",
    )
    p.add_argument("--access-log-cmd", help="shell command printing the gateway's JSON access log ('' skips)")
    p.add_argument("--access-log-lines", type=int, default=300000, help="lines the default command reads")
    p.add_argument("--metrics-url", help="the admission service's /metrics URL (else --metrics-cmd)")
    p.add_argument("--metrics-cmd", help="shell command printing the admission service's metrics ('' skips)")
    p.add_argument("--out", help="write the summary and every request's record here (JSON)")
    a = p.parse_args(argv)

    gw_host = a.gateway_host or f"{a.prefix}h1"
    sandbox = a.url is None
    a.url = (a.url or gateway_url(a.prefix, gw_host, a.port)).rstrip("/")
    a.key = a.key or read_key(a.key_file)
    if a.access_log_cmd is None:
        a.access_log_cmd = (
            sandbox_ssh(gw_host, f"tail -n {a.access_log_lines} {ACCESS_LOG}") if sandbox else ""
        )
    if a.metrics_cmd is None and not a.metrics_url:
        a.metrics_cmd = default_metrics_cmd(gw_host) if sandbox else ""
    drain_cmd = a.drain_cmd or sandbox_ssh(gw_host, f"{REMOTE_VF} drain {{name}} --wait 60")
    undrain_cmd = a.undrain_cmd or sandbox_ssh(gw_host, f"{REMOTE_VF} undrain {{name}}")

    model = a.model or http_get_json(a.url + "/v1/models", a.key)["data"][0]["id"]
    body = json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": "Tell the fleet a short story about overload."}],
            "max_tokens": a.max_tokens,
            "stream": True,
            "ignore_eos": True,
        }
    ).encode()
    print(f"gateway {a.url}, model {model}, {a.lanes} lanes x {a.duration:g} s, "
          f"{'kept-alive' if a.keepalive else 'new'} connections", file=sys.stderr)  # fmt: skip

    before_text = metrics_text(a)
    records: list[dict[str, Any]] = []
    lanes: list[Lane] = []
    drained = False
    t_start = t_end = time.time()
    try:
        if a.drain:
            drained = step(drain_cmd.format(name=shlex.quote(a.drain)), f"drain {a.drain}")
            if not drained:
                return 2
        go = threading.Event()
        deadline = time.monotonic() + a.duration
        lanes = [Lane(i, a, body, deadline, records) for i in range(a.lanes)]
        threads = [threading.Thread(target=lane.run, args=(go,), daemon=True) for lane in lanes]
        for t in threads:
            t.start()
        t_start = time.time()
        go.set()
        next_report = time.monotonic() + 10
        while any(t.is_alive() for t in threads):
            time.sleep(0.5)
            if time.monotonic() >= next_report:
                next_report += 10
                c = Counter(r["kind"] for r in list(records))
                print(f"  {time.time() - t_start:5.0f} s: " + ", ".join(f"{k} {c[k]}" for k in KINDS if c[k]),
                      file=sys.stderr)  # fmt: skip
        t_end = time.time()
    finally:
        if drained:
            step(undrain_cmd.format(name=shlex.quote(a.drain)), f"undrain {a.drain}")

    summary = summarize(records)
    summary["stale_keepalive_retries"] = sum(lane.stale_retries for lane in lanes)
    result: dict[str, Any] = {
        "url": a.url,
        "model": model,
        "lanes": a.lanes,
        "duration_s": a.duration,
        "keepalive": a.keepalive,
        "honor_retry_after": a.honor_retry_after,
        "drained": a.drain,
        "started": datetime.fromtimestamp(t_start).astimezone().isoformat(timespec="seconds"),
        "wall_s": round(t_end - t_start, 1),
        "summary": summary,
    }
    if a.access_log_cmd:
        time.sleep(1.0)  # nginx logs a request after its last byte
        cp = sh(a.access_log_cmd, 120)
        if cp.returncode != 0:
            print(f"access log command failed ({cp.returncode}): {cp.stderr.strip()[-300:]}", file=sys.stderr)
        else:
            entries = run_entries(cp.stdout.splitlines(), t_start - 1, t_end + 2)
            ours = {r.get("request_id") for r in records if r.get("request_id")}
            spills = spill_summary(entries)
            spills["matched_request_ids"] = sum(1 for e in entries if e.get("request_id") in ours)
            spills["client"] = dict(Counter(str(e.get("client")) for e in entries))
            result["access_log"] = spills
    after_text = metrics_text(a)
    if before_text is not None and after_text is not None:
        result["admission"] = counters_delta(
            key_counters(parse_metrics(before_text), a.key), key_counters(parse_metrics(after_text), a.key)
        )
    result["verdict"] = verdict(summary)
    print_summary(result)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({**result, "requests": records}, indent=1) + "\n")
        print(f"wrote {a.out}", file=sys.stderr)
    return 0 if all(v for k, v in result["verdict"].items() if k != "no_other_status") else 1


def print_summary(r: dict[str, Any]) -> None:
    s = r["summary"]
    print(f"\nburst: {r['lanes']} lanes, {r['duration_s']:g} s ({r['wall_s']} s wall), drained: {r['drained'] or '-'}, "
          f"{'kept-alive' if r['keepalive'] else 'new'} connections; {s['requests']} requests")  # fmt: skip
    print("  " + ", ".join(f"{k} {v}" for k, v in s["by_kind"].items()))
    t = s["ttft_s"]
    if t["n"]:
        print(f"  TTFT of completes: p50 {t['p50']} s, p95 {t['p95']} s, max {t['max']} s")
    for what, n in s["refusals"].items():
        print(f"  refused: {n:6d}  {what}")
    for kind, d in s["details"].items():
        for detail, n in d.items():
            print(f"  {kind}: {n:6d}  {detail}")
    if s.get("stale_keepalive_retries"):
        print(
            f"  kept-alive connections closed by the gateway between requests (retried): {s['stale_keepalive_retries']}"
        )
    if "access_log" in r:
        al = r["access_log"]
        print(f"  access log: {al['entries']} entries in the window ({al['matched_request_ids']} by our request ids); "
              f"spilled {al['spilled']} {al['by_kind']}, their final status {al['spilled_final_status']}")  # fmt: skip
        print(
            f"    status {al['status']}; upstream {al['upstream']}; limit_req rejected {al['limit_req_rejected']}"
        )
    if "admission" in r:
        ad = r["admission"]
        print(f"  admission service, key {ad['key_id']}: admitted {ad['admitted']:g}, withdrawn {ad['withdrawn']:g}, "
              f"refused {ad['refused'] or 0}")  # fmt: skip
    print("  verdict: " + ", ".join(f"{k} {'OK' if v else 'FAIL'}" for k, v in r["verdict"].items()))


if __name__ == "__main__":
    sys.exit(main())
