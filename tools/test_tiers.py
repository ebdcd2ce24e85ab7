#!/usr/bin/env python3
"""Every integration scenario with its tier and its time, as a markdown table for docs/testing.md.

    .venv/bin/python tools/test_tiers.py JUNIT.xml [JUNIT.xml ...] > /tmp/tiers.md

The stream is the one tools/run_tests.py runs the module in (fleet and local side by side, then alone). The
tier comes from the tests themselves (pytest's collection with the markers `make test` and `make test-all`
select on: `extended` → test-all only); the times from the junit XML files of runs
(`pytest --junitxml=FILE`; for a test in several files the last one given wins). A scenario no run measured shows "-".
"""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def collected(marker_expr: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", marker_expr,
         "tests/integration"],
        cwd=REPO, capture_output=True, text=True, check=False,
    ).stdout  # fmt: skip
    return [line.strip() for line in out.splitlines() if "::" in line]


def times(files: list[str]) -> dict[str, tuple[float, str]]:
    got: dict[str, tuple[float, str]] = {}
    for f in files:
        for case in ET.parse(f).getroot().iter("testcase"):
            path = case.get("classname", "").replace(".", "/")
            node = f"{path}.py::{case.get('name')}"
            outcome = "failed" if case.find("failure") is not None or case.find("error") is not None else (
                "skipped" if case.find("skipped") is not None else "passed")  # fmt: skip
            got[node] = (float(case.get("time", 0)), outcome)
    return got


def main(argv: list[str]) -> int:
    sys.path.insert(0, str(REPO / "tools"))
    from run_tests import streams  # the stream `make test` runs each module in (tools/run_tests.py)

    lanes, phase2 = streams(
        REPO
    )  # phase 1: lanes side by side, each a list of streams run one after the other
    stream_of = {
        Path(p).name: s.name for s in [*(s for lane in lanes for s in lane), *phase2] for p in s.paths
    }
    ci = set(collected("not extended"))
    every = collected("")
    measured = times(argv)
    print("| module | stream | scenario | tier | s |")
    print("|---|---|---|---|---:|")
    total = {"CI (make test)": 0.0, "test-all only": 0.0}
    for node in every:
        module, name = node.split("::", 1)
        tier = "CI (make test)" if node in ci else "test-all only"
        t = measured.get(node)
        if t:
            total[tier] += t[0]
        cell = "-" if t is None else f"{t[0]:.0f}" + ("" if t[1] == "passed" else f" ({t[1]})")
        where = stream_of.get(Path(module).name, "local")
        print(f"| {Path(module).stem} | {where} | `{name}` | {tier} | {cell} |")
    print()
    # the sum of the scenarios' own times; the streams of `make test` run side by side, so its wall time is less
    print(" · ".join(f"{k}: {v:.0f} s of scenario time measured" for k, v in total.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
