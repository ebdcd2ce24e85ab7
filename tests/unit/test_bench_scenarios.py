"""Scenario helpers with real commands: the failover health command is retried until it succeeds."""

from __future__ import annotations

import asyncio
from pathlib import Path

from vllm_fleet.bench.scenarios import run_cmd, wait_for_cmd


def test_run_cmd_reports_status_and_output() -> None:
    r = asyncio.run(run_cmd("echo out; exit 3", 10))
    assert (r["rc"], r["timed_out"], r["output"].strip()) == (3, False, "out")
    r = asyncio.run(run_cmd("sleep 5", 0.3))
    assert r["timed_out"] is True and r["rc"] is None


def test_wait_for_cmd_sees_down_then_up(tmp_path: Path) -> None:
    flag = tmp_path / "up"

    async def scenario() -> dict[str, object]:
        async def bring_up() -> None:
            await asyncio.sleep(1.0)
            flag.touch()

        task = asyncio.create_task(bring_up())
        h = await wait_for_cmd(f"test -f {flag}", timeout=20, cmd_timeout=5, interval=0.1)
        await task
        return h

    h = asyncio.run(scenario())
    assert h["recovered"] is True and h["down_seen_at_s"] is not None
    assert isinstance(h["up_after_s"], float) and h["up_after_s"] >= 0.9


def test_wait_for_cmd_gives_up(tmp_path: Path) -> None:
    h = asyncio.run(wait_for_cmd("false", timeout=0.5, cmd_timeout=5, interval=0.1))
    assert h == {"down_seen_at_s": h["down_seen_at_s"], "up_after_s": None, "recovered": False}
    assert h["down_seen_at_s"] is not None


def test_failures_between_leaves_out_warm_up_requests() -> None:
    from vllm_fleet.bench.scenarios import failures_between

    report = {
        "failures": [
            {"start": 0.0, "stream": False, "warmup": True},  # e.g. a 429 while the bench sized its prompts
            {"start": 5.0, "stream": True, "warmup": False},
            {"start": 9.0, "stream": False, "warmup": False},
            {"start": 30.0, "stream": False, "warmup": False},
        ]
    }
    assert failures_between(report, 0.0, None) == {"total": 3, "streaming": 1, "non_streaming": 2}
    assert failures_between(report, 4.0, 10.0) == {"total": 2, "streaming": 1, "non_streaming": 1}


def test_ctrl_c_stops_the_load_and_still_writes_the_report(tmp_path: Path) -> None:
    """The real CLI in a subprocess against a port nobody listens on (every request fails at once): the first
    SIGINT ends the run gracefully and the JSON report says it was interrupted."""
    import json
    import signal
    import socket
    import subprocess
    import sys
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    main = "import sys; from vllm_fleet.cli import main; sys.exit(main(sys.argv[1:]))"
    cmd = [sys.executable, "-c", main, "bench", f"http://127.0.0.1:{port}", "--profile", "tiny",
           "--model", "m", "--duration", "600", "--no-tokenize", "--no-metrics",
           "--out", str(tmp_path), "--name", "run"]  # fmt: skip
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stderr is not None
    # the first progress line (after 5 s of load) says the load, and its signal handling, is running
    lines: list[str] = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not any("tiny@A" in ln for ln in lines):
        lines.append(p.stderr.readline())
    p.send_signal(signal.SIGINT)
    out, rest = p.communicate(timeout=60)
    err = "".join(lines) + rest
    rep = json.loads((tmp_path / "run.json").read_text())
    assert rep["interrupted"] is True, (out, err)
    assert "stopping" in err
