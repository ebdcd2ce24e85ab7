"""``vllm-fleet canary-guard NAME``: the canary host's half of a rollout's dead-man rule (docs/rollouts.md).

`vllm-fleet rollout` starts this as a transient unit (``systemd-run --unit vllm-fleet-canary-guard-NAME``) on
the canary's host once the canary serves, and renews a lease file (``LEASE_DIR/NAME.json``:
``{"until": EPOCH_SECONDS}``) every few seconds. When the lease runs out (the controller died or lost the host)
the guard stops ``vllm@NAME`` (its launcher drains what still runs) and exits; when the controller removes the
file (the rollout ended its own way) it exits at once. The gateways hold the other half: each one's canary
entry carries the same kind of lease, and a gateway sends an expired canary nothing.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

LEASE_DIR = "/run/vllm-fleet-rollout"
EXIT_CLEARED, EXIT_EXPIRED, EXIT_ERROR = 0, 0, 1


def lease_file(name: str, folder: str = LEASE_DIR) -> Path:
    return Path(folder) / f"{name}.json"


def read_until(path: Path) -> float | None:
    """The lease's end, or None when the file is gone (cleared). An unreadable file counts as expired."""
    try:
        return float(json.loads(path.read_text())["until"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        return 0.0


def guard(name: str, path: Path, stop: list[str], now: float | None = None, poll: float = 1.0) -> int:
    """Wait until the lease at ``path`` is cleared (exit) or runs out (run ``stop``, exit)."""
    while True:
        until = read_until(path)
        t = time.time() if now is None else now
        if until is None:
            print(f"canary {name}: lease cleared by the rollout; guard ends", flush=True)
            return EXIT_CLEARED
        if t >= until:
            print(
                f"canary {name}: lease ran out {t - until:.0f} s ago (the rollout's controller stopped renewing "
                f"it): stopping it — {' '.join(stop)}",
                flush=True,
            )
            cp = subprocess.run(stop, capture_output=True, text=True, check=False)
            if cp.returncode != 0:
                print(f"canary {name}: {' '.join(stop)} failed: {cp.stderr.strip()}", file=sys.stderr)
                return EXIT_ERROR
            path.unlink(missing_ok=True)
            return EXIT_EXPIRED
        if now is not None:  # one look (tests)
            return -1
        time.sleep(min(poll, max(0.05, until - t)))


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", help="the canary instance (vllm@NAME)")
    p.add_argument("--lease-dir", default=LEASE_DIR)
    p.set_defaults(handler=_run)


def _run(a: argparse.Namespace) -> int:
    return guard(a.name, lease_file(a.name, a.lease_dir), ["systemctl", "stop", f"vllm@{a.name}.service"])
