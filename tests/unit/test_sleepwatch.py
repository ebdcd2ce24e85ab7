"""The gateway's sleep watch (issue 33, vllm_fleet/host/sleepwatch.py): each guard's state over HTTP on loopback
ports (stub engines playing the guard's public reading), the set of instances not awake, written only when it
changes, an unreachable or strange guard counted awake, the file gone when the watch stops; its config's checks;
the command run as the unit runs it."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from vllm_fleet.contracts import (
    SLEEP_STATE_PATH,
    SLEEPWATCH_SCHEMA,
    ContractError,
    SleepwatchConfig,
    SleepwatchInstance,
)
from vllm_fleet.devtools.gateway_testing import StubEngine, stub_engines, wait_for
from vllm_fleet.devtools.testing import free_port
from vllm_fleet.host.sleepwatch import SleepWatch, guard_state, sleep_sets


def config(
    out: Path, ports: dict[str, int], interval: float = 0.05, timeout: float = 0.5
) -> SleepwatchConfig:
    return SleepwatchConfig(
        schema=SLEEPWATCH_SCHEMA,
        fleet="t",
        output=str(out),
        interval_seconds=interval,
        timeout_seconds=timeout,
        instances=[SleepwatchInstance(n, "127.0.0.1", p) for n, p in ports.items()],
    )


@pytest.fixture
def guards() -> Iterator[dict[str, StubEngine]]:
    with stub_engines("a", "b", "c") as stubs:
        for s in stubs.values():
            s.sleep_state = "awake"
        yield stubs


class SlowServer(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False


class Slow(BaseHTTPRequestHandler):
    """A guard that answers after 30 s (an event loop too busy to answer in time)."""

    def do_GET(self) -> None:
        time.sleep(30)
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b'{"state": "asleep"}')

    def log_message(self, *a: Any) -> None:
        pass


def test_guard_state_reads_the_public_state_and_anything_else_is_unknown(
    guards: dict[str, StubEngine],
) -> None:
    a = guards["a"]
    for state in ("awake", "sleeping", "asleep", "waking"):
        a.sleep_state = state
        assert guard_state("127.0.0.1", a.port, 1) == state
    assert a.hits == 0  # the reading is no request of the engine's
    a.sleep_state = "dozing"  # not a state the guard has
    assert guard_state("127.0.0.1", a.port, 1) is None
    a.sleep_state = None  # no guard: the stub answers its usual JSON (no "state")
    assert guard_state("127.0.0.1", a.port, 1) is None
    a.status = 404
    assert guard_state("127.0.0.1", a.port, 1) is None
    assert guard_state("127.0.0.1", free_port(), 1) is None  # nothing listens
    slow = SlowServer(("127.0.0.1", 0), Slow)
    threading.Thread(target=slow.serve_forever, daemon=True).start()
    try:
        t0 = time.monotonic()
        assert guard_state("127.0.0.1", slow.server_address[1], 0.3) is None
        assert time.monotonic() - t0 < 10  # the 0.3 s timeout, not the server's 30 s
    finally:
        slow.shutdown()
        slow.server_close()


def test_sleep_sets_name_what_is_not_awake_and_unknown_is_awake() -> None:
    states = {"d": "asleep", "a": "awake", "c": "waking", "b": "sleeping", "e": None}
    assert sleep_sets(states) == (["b", "c", "d"], ["c"])
    assert sleep_sets({"a": "awake", "e": None}) == ([], [])


def test_the_file_is_written_at_start_then_only_when_the_set_changes(
    guards: dict[str, StubEngine], tmp_path: Path
) -> None:
    out = tmp_path / "asleep.json"
    clock = iter(range(100, 200))
    logged: list[str] = []
    w = SleepWatch(
        config(out, {n: s.port for n, s in guards.items()}), clock=lambda: next(clock), log=logged.append
    )
    assert w.step() is True  # the first round writes, even with nothing asleep
    assert json.loads(out.read_text()) == {"asleep": [], "updated": 100, "waking": []}
    assert logged == []
    mtime = out.stat().st_mtime_ns
    assert w.step() is False and out.stat().st_mtime_ns == mtime
    guards["b"].sleep_state = "asleep"
    guards["c"].sleep_state = "sleeping"
    assert w.step() is True
    assert json.loads(out.read_text()) == {"asleep": ["b", "c"], "updated": 101, "waking": []}
    assert w.step() is False
    guards["b"].sleep_state = "waking"
    assert w.step() is True
    assert json.loads(out.read_text()) == {"asleep": ["b", "c"], "updated": 102, "waking": ["b"]}
    # a guard that stops answering is never hidden: c counts awake again
    guards["c"].close()
    guards["b"].sleep_state = "awake"
    assert w.step() is True
    assert json.loads(out.read_text()) == {"asleep": [], "updated": 103, "waking": []}
    assert logged == ["asleep: [b, c] waking: []", "asleep: [b, c] waking: [b]", "asleep: [] waking: []"]
    assert out.stat().st_mode & 0o777 == 0o644  # nginx's workers read it
    assert [p.name for p in tmp_path.iterdir()] == ["asleep.json"]  # no temp file left


def test_the_guards_are_asked_at_once(tmp_path: Path) -> None:
    """Ten guards that each take 0.3 s: one round takes about 0.3 s, not 3; an asker that fails is unknown."""
    asked: list[int] = []

    def ask(address: str, port: int, timeout: float) -> str | None:
        time.sleep(1)
        asked.append(port)
        if port == 9:
            raise RuntimeError("broken")
        return "asleep"

    w = SleepWatch(config(tmp_path / "z.json", {f"i{k}": k for k in range(1, 11)}), ask=ask)
    t0 = time.monotonic()
    w.step()
    assert time.monotonic() - t0 < 5  # side by side: one after another would take 10 s
    assert sorted(asked) == list(range(1, 11))
    assert json.loads((tmp_path / "z.json").read_text())["asleep"] == sorted(
        f"i{k}" for k in range(1, 11) if k != 9
    )


def test_run_polls_until_stopped_then_removes_the_file(guards: dict[str, StubEngine], tmp_path: Path) -> None:
    out = tmp_path / "asleep.json"
    w = SleepWatch(config(out, {n: s.port for n, s in guards.items()}), log=lambda _: None)
    stop = threading.Event()
    t = threading.Thread(target=w.run, args=(stop,), daemon=True)
    t.start()
    try:
        assert wait_for(out.exists, 5, 0.02)
        guards["a"].sleep_state = "asleep"
        assert wait_for(lambda: json.loads(out.read_text())["asleep"] == ["a"], 5, 0.02)
    finally:
        stop.set()
        t.join(5)
    assert not t.is_alive() and not out.exists()


def test_an_unwritable_output_is_said_once_and_retried(guards: dict[str, StubEngine], tmp_path: Path) -> None:
    out = tmp_path / "missing" / "asleep.json"
    logged: list[str] = []
    w = SleepWatch(config(out, {"a": guards["a"].port}), log=logged.append)
    stop = threading.Event()
    t = threading.Thread(target=w.run, args=(stop,), daemon=True)
    t.start()
    try:
        assert wait_for(lambda: len(logged) == 1, 5, 0.02)
        time.sleep(0.3)  # several rounds fail meanwhile
        assert len(logged) == 1 and "cannot write" in logged[0] and w.status() == logged[0]
        out.parent.mkdir()
        assert wait_for(out.exists, 5, 0.02)  # written at the next round
        assert wait_for(lambda: w.status() == "1 watched, 0 not awake", 5, 0.02)
    finally:
        stop.set()
        t.join(5)


def _doc(**over: Any) -> dict[str, Any]:
    d: dict[str, Any] = {
        "schema": SLEEPWATCH_SCHEMA,
        "fleet": "t",
        "output": "/run/x/asleep.json",
        "interval_seconds": 1.0,
        "timeout_seconds": 0.5,
        "instances": [{"instance": "a", "address": "10.0.0.1", "port": 8001}],
    }
    d.update(over)
    return d


@pytest.mark.parametrize(
    ("over", "field"),
    [
        ({"schema": 99}, "schema"),
        ({"output": "asleep.json"}, "output"),
        ({"interval_seconds": 0}, "interval_seconds"),
        ({"timeout_seconds": -1}, "timeout_seconds"),
        ({"instances": [{"instance": "a", "address": "x", "port": 0}]}, "instances[0].port"),
        ({"instances": [{"instance": "a", "address": "x", "port": "80"}]}, "instances[0].port"),
        ({"instances": [{"instance": "a", "port": 80}]}, "instances[0].address"),
        ({"extra": 1}, "extra"),
    ],
)
def test_a_bad_config_names_the_field(over: dict[str, Any], field: str) -> None:
    with pytest.raises(ContractError, match=re.escape(f"cfg.json: {field}")):
        SleepwatchConfig.from_dict(_doc(**over), "cfg.json")
    assert SleepwatchConfig.from_dict(_doc(), "cfg.json").instances[0].port == 8001


def test_the_command_writes_then_removes_on_sigterm(guards: dict[str, StubEngine], tmp_path: Path) -> None:
    """``vllm-fleet sleepwatch --config`` as the unit runs it: the file at its start, a change within a round
    or two, READY=1 told to systemd, the file removed when it is stopped; a bad config exits 2 naming it."""
    from vllm_fleet.host.notify import NotifyListener

    out = tmp_path / "asleep.json"
    cfg = tmp_path / "sleepwatch.json"
    # a guard's answer may take seconds on a loaded machine: 5 s per read (a read that times out counts awake);
    # the waits below are caps on state, not timings
    ports = {"a": guards["a"].port, "b": guards["b"].port}
    cfg.write_text(json.dumps(config(out, ports, 0.2, timeout=5).to_dict()))
    listener = NotifyListener(str(tmp_path / "notify.sock"))
    env = {**os.environ, "NOTIFY_SOCKET": str(tmp_path / "notify.sock")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm_fleet.cli", "sleepwatch", "--config", str(cfg)],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    seen: list[str] = []
    try:
        seen.append(f"file written: {wait_for(out.exists, 60, 0.05)}")
        seen.append(f"first: {json.loads(out.read_text())['asleep']}")
        try:
            seen.append(f"READY=1 at {listener.wait_for('READY', '1', timeout=60) >= 0}")
        except TimeoutError as exc:
            seen.append(str(exc))
        guards["b"].sleep_state = "asleep"
        seen.append(
            f"b asleep seen: {wait_for(lambda: json.loads(out.read_text())['asleep'] == ['b'], 60, 0.05)}"
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        listener.close()
    assert seen == ["file written: True", "first: []", "READY=1 at True", "b asleep seen: True"], (seen, err)
    assert proc.returncode == 0, err
    assert not out.exists()
    assert "asleep: [b] waking: []" in err
    cfg.write_text(json.dumps(_doc(interval_seconds=0)))
    r = subprocess.run(
        [sys.executable, "-m", "vllm_fleet.cli", "sleepwatch", "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 2 and f"{cfg}: interval_seconds" in r.stderr
    assert SLEEP_STATE_PATH == "/vllm-fleet/sleep"  # the reading the stubs play
