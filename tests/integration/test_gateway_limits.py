"""Per-key limits through the real gateway: nginx (the rendered config) asks the admission service
(``vllm-fleet admission``, started on the rendered file) before a request reaches a sim engine.

The engine ``e`` runs 2 requests and holds 4 in flight (``--max-num-seqs 2 --max-num-queued-reqs 4``), and
the spec says so: the model's capacity is 4, so the gateway, not the engine, holds what does not fit. The
subject is the gateway's admission (what waits, what is refused and how, who gets a freed slot), so the
engines are sim engines (tests/integration/test_engine_contract.py checks them against real vLLM).
"""

from __future__ import annotations

import http.client
import json
import socket
import statistics
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from vllm_fleet.devtools.gateway_testing import Gateway, gateway_spec, wait_for
from vllm_fleet.devtools.testing import EngineProcess
from vllm_fleet.host.exporter import AccessLogTail

KEYS = {
    "greedy": "sk-greedy-" + "g" * 32,
    "polite": "sk-polite-" + "p" * 32,
    "rpm": "sk-rpm-" + "r" * 32,
    "tpm": "sk-tpm-" + "t" * 32,
    "usage": "sk-usage-" + "u" * 32,
    "stream": "sk-stream-" + "s" * 32,
}
CLIENTS = {
    "rpm": {"per_key": {"requests_per_minute": 2}},
    "tpm": {"per_key": {"tokens_per_minute": 300}},
    "usage": {"per_key": {"tokens_per_minute": 1000}},
    "stream": {"per_key": {"tokens_per_minute": 100000}},
}


@pytest.fixture(scope="module")
def e(sim_engine_factory: Any) -> EngineProcess:
    return sim_engine_factory(extra=["--max-num-seqs", "2", "--max-num-queued-reqs", "4"], token_delay=0.005)  # type: ignore[no-any-return]


def start(tmp: Path, e: EngineProcess, admission: bool = True, **limits: Any) -> Gateway:
    tmp.mkdir(parents=True, exist_ok=True)
    keys = tmp / "keys"
    keys.write_text("".join(f'"{k}" {client};\n' for client, k in KEYS.items()))
    spec = gateway_spec(
        [{"name": "e", "port": e.port, "max_num_seqs": 2, "max_num_queued_reqs": 4}],
        tmp,
        api_keys_file=str(keys),
        rate_limit={"per_ip_rps": 10000, "per_ip_burst": 10000},
        limits={"queue_wait_seconds": 20, "default_key": {"max_in_flight": 8}, **limits},
        clients=CLIENTS,
    )
    return Gateway(spec, tmp, admission=admission).start()


@pytest.fixture(scope="module")
def gw(e: EngineProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    g = start(tmp_path_factory.mktemp("limits"), e)
    try:
        yield g
    finally:
        g.stop()


def post(
    url: str, key: str, tokens: int = 20, stream: bool = False, anthropic: bool = False
) -> dict[str, Any]:
    """One request on a new connection: status, Retry-After, the body (or the stream's text), seconds taken."""
    host, port = url.removeprefix("http://").split(":")
    if anthropic:
        path, body = "/v1/messages", {"model": "tiny-qwen3", "max_tokens": tokens,
                                      "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip
    else:
        path = "/v1/completions"
        body = {"model": "tiny-qwen3", "prompt": "once upon a time", "max_tokens": tokens, "ignore_eos": True}
    if stream:
        body["stream"] = True
    t0 = time.monotonic()
    c = http.client.HTTPConnection(host, int(port), timeout=120)
    try:
        c.request(
            "POST",
            path,
            json.dumps(body),
            {"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
        )
        r = c.getresponse()
        raw = r.read().decode()
        out: dict[str, Any] = {"status": r.status, "retry_after": r.getheader("Retry-After"), "text": raw}
        if r.getheader("Content-Type", "").startswith("application/json"):
            out["body"] = json.loads(raw)
    except Exception as exc:  # a dropped connection is a failure and must be counted
        out = {"status": f"{type(exc).__name__}: {exc}"}
    finally:
        c.close()
    out["seconds"] = time.monotonic() - t0
    return out


def burst(url: str, key: str, n: int, **kw: Any) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    lock = threading.Lock()
    go = threading.Event()

    def one() -> None:
        go.wait()
        res = post(url, key, **kw)
        with lock:
            out.append(res)

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    go.set()
    for t in threads:
        t.join(300)
    return out


def metrics(g: Gateway) -> dict[str, float]:
    """The admission service's samples: 'name{labels}' → value (labels as exposed)."""
    with urllib.request.urlopen(g.admission_metrics_url, timeout=5) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def sample(m: dict[str, float], name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    total = 0.0
    for k, v in m.items():
        base, _, rest = k.partition("{")
        if base == name and all(f'{lk}="{lv}"' in rest for lk, lv in labels.items()):
            total += v
    return total


def key_id(client: str) -> str:
    import hashlib

    return f"{client}/{hashlib.sha256(KEYS[client].encode()).hexdigest()[:8]}"


def test_one_key_bursting_on_an_idle_fleet_is_all_served_and_the_engine_never_refuses(gw: Gateway) -> None:
    """100 at once, one key (8 in flight at most), a model that holds 4: every request is served; those that did
    not fit waited in the gateway (not one of the engine's 503s), and every slot came back."""
    res = burst(gw.url, KEYS["greedy"], 100)
    assert [r["status"] for r in res] == [200] * 100, [r for r in res if r["status"] != 200][:3]
    assert wait_for(lambda: len(gw.log()) >= 100, 10)
    assert not [e for e in gw.log() if "503" in e["upstream_status"]]  # the engine was never over its bound
    kid = key_id("greedy")
    assert wait_for(lambda: sample(metrics(gw), "vllm_fleet_gateway_key_in_flight", key=kid) == 0, 10)
    m = metrics(gw)
    assert sample(m, "vllm_fleet_gateway_key_admitted_total", key=kid) == 100
    assert sample(m, "vllm_fleet_gateway_key_queue_wait_seconds_count", key=kid) == 100
    waited = sample(m, "vllm_fleet_gateway_key_queue_wait_seconds_sum", key=kid)
    assert waited > 1, waited  # 96 of them waited for a slot
    waits = sorted(r["seconds"] for r in res)
    print(f"one key, 100 at once on capacity 4: all served; client latency p50 {statistics.median(waits):.2f} s, "
          f"max {waits[-1]:.2f} s; gateway wait total {waited:.1f} s")  # fmt: skip


def test_a_key_over_its_requests_per_minute_gets_a_json_429_with_an_honest_retry_after(gw: Gateway) -> None:
    first = [post(gw.url, KEYS["rpm"], tokens=2) for _ in range(2)]
    assert [r["status"] for r in first] == [200, 200]
    t0 = time.monotonic()
    refused = post(gw.url, KEYS["rpm"], tokens=2)
    # its minute refills in ~60 s, beyond queue_wait_seconds (20): refused at once, not after waiting
    assert refused["status"] == 429 and time.monotonic() - t0 < 5, refused
    assert refused["body"]["error"]["code"] == "rate_limit_exceeded"
    assert "requests per minute" in refused["body"]["error"]["message"]
    assert 40 <= int(refused["retry_after"]) <= 60, refused["retry_after"]
    anthropic = post(gw.url, KEYS["rpm"], tokens=2, anthropic=True)
    assert anthropic["status"] == 429 and anthropic["body"]["type"] == "error"
    assert anthropic["body"]["error"]["type"] == "rate_limit_error" and anthropic["retry_after"]
    # another key is not affected
    assert post(gw.url, KEYS["polite"], tokens=2)["status"] == 200
    m = metrics(gw)
    assert sample(m, "vllm_fleet_gateway_key_refused_total", key=key_id("rpm"), reason="rpm") == 2


def test_a_request_that_can_never_fit_the_tokens_budget_is_refused_without_retry_after(gw: Gateway) -> None:
    ok = post(gw.url, KEYS["tpm"], tokens=50)
    assert ok["status"] == 200, ok
    never = post(gw.url, KEYS["tpm"], tokens=400)  # reserves > 300 tokens per minute
    assert never["status"] == 429 and never["retry_after"] is None, never
    assert "can never fit" in never["body"]["error"]["message"]


def test_a_stream_holds_its_slot_until_it_ends(gw: Gateway) -> None:
    kid = key_id("polite")
    done: list[dict[str, Any]] = []
    t = threading.Thread(target=lambda: done.append(post(gw.url, KEYS["polite"], tokens=400, stream=True)))
    t.start()
    assert wait_for(lambda: sample(metrics(gw), "vllm_fleet_gateway_key_in_flight", key=kid) == 1, 10)
    t.join(60)
    assert done[0]["status"] == 200 and "[DONE]" in done[0]["text"]
    assert wait_for(lambda: sample(metrics(gw), "vllm_fleet_gateway_key_in_flight", key=kid) == 0, 10)


def test_a_polite_key_is_not_starved_by_a_greedy_one(gw: Gateway) -> None:
    """The model (capacity 4) saturated by 24 requests of one key at a time; a second key's requests, 2 at a
    time, take a freed slot before the greedy key's waiting ones (it is below its share): their latency stays
    near one request's, the greedy key's is its queue."""
    stop = threading.Event()
    greedy: list[dict[str, Any]] = []
    lock = threading.Lock()

    def lane(key: str, out: list[dict[str, Any]]) -> None:
        while not stop.is_set():
            r = post(gw.url, key)
            with lock:
                out.append(r)

    lanes = [threading.Thread(target=lane, args=(KEYS["greedy"], greedy)) for _ in range(24)]
    for t in lanes:
        t.start()
    try:
        assert wait_for(lambda: len(greedy) >= 24, 30)
        polite = [r for _ in range(8) for r in burst(gw.url, KEYS["polite"], 2)]
    finally:
        stop.set()
        for t in lanes:
            t.join(60)
    assert all(r["status"] == 200 for r in polite + greedy), [
        r for r in polite + greedy if r["status"] != 200
    ][:3]
    p50 = statistics.median(r["seconds"] for r in polite)
    g50 = statistics.median(r["seconds"] for r in greedy[24:])
    print(f"fairness: polite p50 {p50:.2f} s vs greedy p50 {g50:.2f} s ({len(greedy)} greedy requests)")
    assert p50 < g50 / 2, (p50, g50)


# the sim engine has no end of sequence: these stop sequences end its answer after a token or a few (most of
# its vocabulary holds one of them), far below max_tokens
STOPS = [" ", "(", ")", ":"]


def ask(url: str, key: str, body: dict[str, Any], path: str = "/v1/chat/completions") -> tuple[int, str, str]:
    """POST ``body`` as sent (its bytes are what the gateway estimates the prompt from): status, the answer's
    text, the JSON sent."""
    host, port = url.removeprefix("http://").split(":")
    sent = json.dumps(body)
    c = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        c.request("POST", path, sent, {"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
        r = c.getresponse()
        return r.status, r.read().decode(), sent
    finally:
        c.close()


def settled(g: Gateway, client: str) -> float:
    kid = key_id(client)
    assert wait_for(lambda: sample(metrics(g), "vllm_fleet_gateway_key_in_flight", key=kid) == 0, 10)
    return sample(metrics(g), "vllm_fleet_gateway_key_tokens_total", key=kid, kind="settled")


def test_a_non_streamed_answer_settles_its_usage_not_max_tokens(gw: Gateway) -> None:
    """max_tokens 900 reserves ~940 of the key's 1000 tokens per minute; the answer used a few dozen
    (``usage.total_tokens``): that is what the key's minute holds once it ended, so a second such request fits
    at once (with the reservation kept it would wait ~60 s for the window: a 429)."""
    kid = key_id("usage")
    body = {"model": "tiny-qwen3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 900,
            "stop": STOPS}  # fmt: skip
    st, raw, sent = ask(gw.url, KEYS["usage"], body)
    assert st == 200, raw
    used = json.loads(raw)["usage"]
    assert used["total_tokens"] < 100 and len(sent) // 3 + 900 > 900, used
    assert settled(gw, "usage") == used["total_tokens"]
    m = metrics(gw)
    assert sample(m, "vllm_fleet_gateway_key_tokens_total", key=kid, kind="reserved") >= 900
    ratio = sample(m, "vllm_fleet_gateway_key_budget_used_ratio", key=kid, budget="tpm")
    assert ratio == pytest.approx(used["total_tokens"] / 1000), ratio
    again, raw, _ = ask(gw.url, KEYS["usage"], body)
    assert again == 200, raw
    # the Messages API's usage (input_tokens + output_tokens) too
    msg = {"model": "tiny-qwen3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 900,
           "stop_sequences": STOPS}  # fmt: skip
    before = settled(gw, "usage")
    st, raw, _ = ask(gw.url, KEYS["usage"], msg, "/v1/messages")
    assert st == 200, raw
    u = json.loads(raw)["usage"]
    assert settled(gw, "usage") - before == u["input_tokens"] + u["output_tokens"]


def test_a_stream_settles_its_usage_or_its_events_plus_the_prompt_estimate(gw: Gateway) -> None:
    """A stream with stream_options.include_usage settles its final usage chunk; one without settles the
    router's prompt estimate (the body's bytes / 3) plus its events (vLLM: one per token, plus the chat's first
    role event); an Anthropic stream its message_delta's usage. Each far below its reservation."""
    base = {"model": "tiny-qwen3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 900,
            "stop": STOPS, "stream": True}  # fmt: skip
    before = settled(gw, "stream")
    st, raw, _ = ask(gw.url, KEYS["stream"], {**base, "stream_options": {"include_usage": True}})
    assert st == 200 and raw.rstrip().endswith("data: [DONE]"), raw
    events = [json.loads(ln[6:]) for ln in raw.splitlines() if ln.startswith("data: {")]
    assert events[-1]["choices"] == [], events[-1]  # vLLM's usage chunk
    total = events[-1]["usage"]["total_tokens"]
    assert settled(gw, "stream") - before == total < 100

    before = settled(gw, "stream")
    st, raw, sent = ask(gw.url, KEYS["stream"], base)
    assert st == 200 and "usage" not in raw, raw
    n_events = sum(1 for ln in raw.splitlines() if ln.startswith("data: {"))
    assert settled(gw, "stream") - before == -(-len(sent) // 3) + n_events < 100

    msg = {"model": "tiny-qwen3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 900,
           "stop_sequences": STOPS, "stream": True}  # fmt: skip
    before = settled(gw, "stream")
    st, raw, _ = ask(gw.url, KEYS["stream"], msg, "/v1/messages")
    assert st == 200 and "message_stop" in raw, raw
    (delta,) = [
        json.loads(ln[6:]) for ln in raw.splitlines() if ln.startswith('data: {"type":"message_delta"')
    ]
    assert settled(gw, "stream") - before == delta["usage"]["input_tokens"] + delta["usage"]["output_tokens"]


def test_a_stream_the_client_leaves_settles_what_was_sent_not_its_reservation(gw: Gateway) -> None:
    """No last buffer reaches the filter when the client goes away; the log phase still reads what it saw:
    the prompt estimate plus the events sent so far, not the 900 tokens reserved."""
    host, port = gw.url.removeprefix("http://").split(":")
    sent = json.dumps(
        {"model": "tiny-qwen3", "prompt": "once upon a time", "max_tokens": 900, "stream": True}
    )
    before = settled(gw, "stream")
    c = http.client.HTTPConnection(host, int(port), timeout=60)
    c.request("POST", "/v1/completions", sent, {"Content-Type": "application/json",
                                                 "Authorization": f"Bearer {KEYS['stream']}"})  # fmt: skip
    r = c.getresponse()
    read = 0
    while read < 10:
        read += r.readline().startswith(b"data: {")
    c.sock.shutdown(socket.SHUT_RDWR)  # the client goes away mid-stream (900 tokens take ~5 s)
    c.close()
    kid = key_id("stream")
    assert wait_for(lambda: sample(metrics(gw), "vllm_fleet_gateway_key_in_flight", key=kid) == 0, 15)
    prompt = -(-len(sent) // 3)
    # nginx logs the status it sent (200); the stream ended long before its ~5 s
    (entry,) = gw.find(lambda e: e["client"] == "stream" and e["uri"] == "/v1/completions")
    assert entry["status"] == 200 and entry["request_time"] < 3, entry
    assert prompt + read <= settled(gw, "stream") - before < prompt + 300


def test_the_service_down_admits_and_on_failure_closed_refuses(e: EngineProcess, tmp_path: Path) -> None:
    g = start(tmp_path / "open", e, admission=False)
    try:
        tail = AccessLogTail(g.access_log, from_start=True)
        assert [r["status"] for r in burst(g.url, KEYS["greedy"], 3, tokens=2)] == [200] * 3
        # each one admitted unlimited: "admission": "open" in the access log, counted by the host exporter
        wait_for(lambda: len(g.log()) >= 3, timeout=10)
        assert [r.get("admission") for r in g.log()] == ["open"] * 3
        tail.poll()
        assert tail.fail_open == 3
        g.start_admission()
        assert post(g.url, KEYS["greedy"], tokens=2)["status"] == 200
        wait_for(lambda: len(g.log()) >= 4, timeout=10)
        assert g.log()[-1]["admission"] == "1"  # admitted by the service
        tail.poll()
        assert tail.fail_open == 3
    finally:
        g.stop()
    g = start(tmp_path / "closed", e, admission=False, on_failure="closed")
    try:
        r = post(g.url, KEYS["greedy"], tokens=2)
        assert r["status"] == 503 and r["retry_after"] == "1", r
        assert r["body"]["error"]["code"] == "admission_unavailable"
        g.start_admission()
        assert post(g.url, KEYS["greedy"], tokens=2)["status"] == 200
    finally:
        g.stop()


class Echo:
    """A stub engine that answers every POST with what reached it: its name, X-VF-Priority, the body."""

    def __init__(self, name: str) -> None:
        import http.server

        echo = self

        class H(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                out = json.dumps(
                    {
                        "engine": echo.name,
                        "priority": self.headers.get("X-VF-Priority"),
                        "body": json.loads(raw),
                    }
                ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *a: Any) -> None:
                pass

        self.name = name
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def test_request_classes_set_the_engine_priority_the_pool_and_the_permissions(tmp_path: Path) -> None:
    """gateway.classes through the rendered router: X-Request-Class (or the client's default_class) becomes the
    X-VF-Priority the engine's middleware writes into the body (a client's own header never passes), a class's
    pool routes the request, a class the key may not use is a JSON 403, an unknown one a 400."""
    a, long = Echo("a"), Echo("long")
    keys = tmp_path / "keys"
    chat, other = "sk-chat-" + "c" * 32, "sk-other-" + "o" * 32
    keys.write_text(f'"{chat}" chat;\n"{other}" other;\n')
    spec = gateway_spec(
        [{"name": "a", "port": a.port}, {"name": "b", "port": long.port, "pool": "long"}],
        tmp_path,
        api_keys_file=str(keys),
        classes={
            "interactive": {"priority": 0},
            "batch": {"priority": 10},
            "long_context": {"priority": 5, "pool": "long"},
        },
        clients={"chat": {"classes": ["interactive", "batch"], "default_class": "interactive"}},
    )
    g = Gateway(spec, tmp_path).start()

    def ask(key: str, **headers: str) -> tuple[int, Any]:
        from vllm_fleet.devtools.testing import http_json

        body = {"model": "tiny-qwen3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        return http_json("POST", g.url + "/v1/chat/completions", body,
                         headers={"Authorization": f"Bearer {key}", **headers})  # fmt: skip

    try:
        st, got = ask(chat)
        assert st == 200 and got["priority"] == "0" and got["engine"] == "a", got  # the default class
        st, got = ask(chat, **{"X-Request-Class": "batch", "X-VF-Priority": "-99"})
        assert st == 200 and got["priority"] == "10", got  # the client's own header is replaced
        st, got = ask(other, **{"X-Request-Class": "long_context"})
        assert st == 200 and got["priority"] == "5" and got["engine"] == "long", got  # the class's pool
        st, got = ask(other, **{"X-VF-Priority": "-99"})
        assert st == 200 and got["priority"] is None, got  # no class: no priority, none smuggled
        st, err = ask(chat, **{"X-Request-Class": "long_context"})
        assert st == 403 and err["error"]["type"] == "permission_error", err
        st, err = ask(chat, **{"X-Request-Class": "gold"})
        assert st == 400 and "gold" in err["error"]["message"], err
        assert {e["class"] for e in g.find(lambda e: e["status"] == 200)} == {
            "interactive",
            "batch",
            "long_context",
            "",
        }
    finally:
        g.stop()
        a.server.shutdown()
        long.server.shutdown()


class Scripted:
    """A stub engine that answers a POST with the script its body names (``"script": NAME``): a status, a
    Content-Type and the body's pieces, each sent as its own HTTP chunk (so nginx hands each to its filters as
    a buffer of its own)."""

    def __init__(self, scripts: dict[str, tuple[int, str, list[bytes]]]) -> None:
        import http.server

        class H(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                status, ctype, pieces = scripts[body["script"]]
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for p in pieces:
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(p), p))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")

            def log_message(self, *a: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def test_the_usage_filter_passes_every_byte_and_reads_only_what_it_can_trust(tmp_path: Path) -> None:
    """Through the rendered gateway, against answers made to be awkward: the client gets every byte as sent
    (a UTF-8 character and an event line split over buffers); events split over buffers count once, `data: {`
    and an escaped `"total_tokens"` inside model text count for nothing; a JSON answer without usage keeps the
    reservation, a 4xx settles nothing, and an answer past the filter's 256 KiB keeps the reservation (the
    filter stepped aside: it did not see the usage at its end)."""
    event = 'data: {"choices":[{"delta":{"content":"%s"}}]}\n\n'
    split = [b"da", b'ta: {"choices":[{"delta":{"content":"caf\xc3', b'\xa9"}}]}\n', b"\nd",
             (event % "data: {" + event % '\\"total_tokens\\": 7').encode()[1:], b"\n", b"data: [DONE]\n\n"]  # fmt: skip
    big = [(event % ("x" * 200)).encode()] * 6000 + [b'data: {"choices":[],"usage":{"total_tokens":11}}\n\n',
                                                     b"data: [DONE]\n\n"]  # fmt: skip
    no_usage = [b'{"id":"x","choices":[{"message":{"content":"\\"total_tokens\\": 3"}}]}']
    scripts = {
        "split": (200, "text/event-stream", split),
        "no_usage": (200, "application/json", no_usage),
        "bad": (400, "application/json", [b'{"error":{"message":"no","usage":{"total_tokens":5}}}']),
        "big": (200, "text/event-stream", big),
        # usage split over buffers, a space before its number
        "usage": (
            200,
            "application/json",
            [b'{"id":"x","usage":{"prompt_tokens":3,', b'"total_tokens":', b" 11}}"],
        ),
    }
    stub = Scripted(scripts)
    keys = tmp_path / "keys"
    keys.write_text(f'"{KEYS["usage"]}" usage;\n')
    spec = gateway_spec([{"name": "s", "port": stub.port}], tmp_path, api_keys_file=str(keys),
                        limits={"default_key": {"max_in_flight": 8}})  # fmt: skip
    g = Gateway(spec, tmp_path).start()
    kid = key_id("usage")

    def one(script: str) -> tuple[int, bytes, float, float]:
        """status, the bytes received, the tokens settled and reserved for it"""
        body = json.dumps({"model": "tiny-qwen3", "max_tokens": 500, "script": script, "stream": True})
        m0 = metrics(g)
        c = http.client.HTTPConnection("127.0.0.1", spec.gateway.port, timeout=60)
        try:
            c.request("POST", "/v1/chat/completions", body,
                      {"Content-Type": "application/json", "Authorization": f"Bearer {KEYS['usage']}"})  # fmt: skip
            r = c.getresponse()
            status, raw = r.status, r.read()
        finally:
            c.close()
        assert wait_for(lambda: sample(metrics(g), "vllm_fleet_gateway_key_in_flight", key=kid) == 0, 10)
        m1 = metrics(g)
        got = {
            k: sample(m1, "vllm_fleet_gateway_key_tokens_total", key=kid, kind=k)
            - sample(m0, "vllm_fleet_gateway_key_tokens_total", key=kid, kind=k)
            for k in ("settled", "reserved")
        }
        assert got["reserved"] == -(-len(body) // 3) + 500
        return status, raw, got["settled"], -(-len(body) // 3)

    try:
        status, raw, used, prompt = one("split")
        assert status == 200 and raw == b"".join(split)
        assert used == prompt + 3  # three events; neither text inside one counts
        status, raw, used, prompt = one("usage")
        assert (status, used) == (200, 11)
        status, raw, used, prompt = one("no_usage")
        assert status == 200 and raw == no_usage[0] and used == prompt + 500  # the reservation
        status, raw, used, prompt = one("bad")
        assert (status, used) == (400, 0)
        status, raw, used, prompt = one("big")
        assert status == 200 and raw == b"".join(big) and used == prompt + 500
    finally:
        g.stop()
        stub.server.shutdown()
