"""Measure sandbox host timings and footprint (for docs/perf/sandbox.md). Run as root from the repo root:

    .venv/bin/python tools/sandbox/measure.py [--hosts 3] [--engine]

Images must be built already (`vllm-fleet sandbox image --engine`); their build times are read from the
image stamps. Boots hosts named sandbox-perf-N one after another, then takes them down; prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time
from pathlib import Path

from vllm_fleet.devtools.sandbox import SandboxHost, down, up
from vllm_fleet.devtools.sandbox_image import base_image, engine_image, read_stamp, wheelhouse_dir


def host_rss_mib(h: SandboxHost) -> float:
    """Sum of VmRSS of every process in the host's pid namespace."""
    ns = os.readlink(f"/proc/{h.pid1}/ns/pid")
    total = 0
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            if os.readlink(p / "ns/pid") != ns:
                continue
            for line in (p / "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total / 1024


def du_mib(path: Path) -> float:
    out = subprocess.run(["du", "-sk", str(path)], capture_output=True, text=True).stdout.split()
    return int(out[0]) / 1024 if out else 0.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hosts", type=int, default=3)
    ap.add_argument("--engine", action="store_true", help="also boot one engine host")
    a = ap.parse_args()
    rows = []
    load = os.getloadavg()[0]
    kinds = [False] * a.hosts + ([True] if a.engine else [])
    for i, engine in enumerate(kinds):
        name = f"sandbox-perf-{i}"
        h = up(name, engine=engine)
        time.sleep(2)  # let the boot settle before measuring memory
        rss = host_rss_mib(h)
        upper = du_mib(h.dir / "upper") if h.clone == "overlay" else du_mib(Path(h.root))
        t = time.monotonic()
        down(name)
        rows.append((name, "engine" if engine else "base", h.up_seconds, h.boot_seconds, time.monotonic() - t,
                     rss, upper))  # fmt: skip
    print(f"load average at start: {load:.1f} ({os.cpu_count()} cores)\n")
    print("| host | image | up (s) | boot to running (s) | down (s) | RSS (MiB) | own disk (MiB) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]:.1f} | {r[3]:.1f} | {r[4]:.1f} | {r[5]:.0f} | {r[6]:.1f} |")
    base = [r for r in rows if r[1] == "base"]
    if base:
        print(f"\nbase hosts: median up {statistics.median(r[2] for r in base):.1f} s, "
              f"median boot {statistics.median(r[3] for r in base):.1f} s, "
              f"median down {statistics.median(r[4] for r in base):.1f} s")  # fmt: skip
    print("\n| cache item | size (MiB) | built in (s) |")
    print("|---|---|---|")
    for label, path in (("base image", base_image()), ("engine image", engine_image())):
        stamp = read_stamp(path) or {}
        print(f"| {label} | {du_mib(path):.0f} | {stamp.get('build_seconds', '?')} |")
    print(f"| wheelhouse | {du_mib(wheelhouse_dir()):.0f} | see logs/wheelhouse.log |")


if __name__ == "__main__":
    main()
