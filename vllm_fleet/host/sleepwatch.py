"""The gateway's sleep watch (issue 33; docs/sleep.md "Gateway"): which instances of a model that sleeps are not
awake now, for the njs router, which sends a request to an awake replica of its model first and to a sleeping
one only as the last resort (the sleeping one's guard holds the request and has it woken).

``vllm-fleet sleepwatch --config PATH`` (vllm-fleet-sleepwatch.service on a gateway host; the config is
``contracts.SleepwatchConfig``, rendered on the controller): every ``interval_seconds`` it asks every instance's
sleep guard for its state (``GET contracts.SLEEP_STATE_PATH`` on the address nginx reaches the engine at), all at
once, each answer within ``timeout_seconds``, and writes ``contracts.AsleepFile`` to ``output`` (a temp file,
then a rename: the router never reads half of one) once at its start and then only when the set changes. An
instance whose guard does not answer, answers something else than a state, or is not reached at all counts as
awake: a read failure never hides an instance from the gateway (at worst a request meets a sleeping engine, whose
guard holds it and has it woken). It removes the file when it stops: without the watch nothing is asleep for the
router. ``READY=1`` after the first round (the unit runs before nginx).

Standard library only.
"""

from __future__ import annotations

import argparse
import http.client
import json
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from vllm_fleet.contracts import (
    SLEEP_STATE_PATH,
    SLEEP_STATES,
    AsleepFile,
    ContractError,
    SleepwatchConfig,
)
from vllm_fleet.files import write_json_atomic
from vllm_fleet.host.notify import Notifier
from vllm_fleet.host.waker import Stop

USER_AGENT = "vllm-fleet-sleepwatch"
# the guard's answer is a small JSON object; anything longer is not one
MAX_ANSWER_BYTES = 4096
# guards asked at once (a gateway routing to more sleep-capable instances asks them in batches of this many)
MAX_WORKERS = 32

Asker = Callable[[str, int, float], "str | None"]


def guard_state(address: str, port: int, timeout: float) -> str | None:
    """The sleep state the guard at ``address:port`` answers (one of ``SLEEP_STATES``), None when it does not
    answer in ``timeout`` seconds (each socket operation), answers other than 200, or not a known state."""
    conn = http.client.HTTPConnection(address, port, timeout=timeout)
    try:
        conn.request(
            "GET", SLEEP_STATE_PATH, headers={"User-Agent": USER_AGENT, "Accept": "application/json"}
        )
        r = conn.getresponse()
        body = r.read(MAX_ANSWER_BYTES + 1)
        if r.status != 200 or len(body) > MAX_ANSWER_BYTES:
            return None
        data: Any = json.loads(body)
    except (OSError, http.client.HTTPException, ValueError):
        return None
    finally:
        conn.close()
    state = data.get("state") if isinstance(data, dict) else None
    return state if isinstance(state, str) and state in SLEEP_STATES else None


def sleep_sets(states: dict[str, str | None]) -> tuple[list[str], list[str]]:
    """``(asleep, waking)`` from each instance's answered state (None: unknown): the instances not awake
    (sleeping, asleep or waking) and those of them waking, each sorted. Unknown is awake."""
    asleep = sorted(n for n, s in states.items() if s is not None and s != "awake")
    waking = sorted(n for n, s in states.items() if s == "waking")
    return asleep, waking


class SleepWatch:
    """One config's watch: ``step()`` asks every guard once and writes the file when the set changed (or was
    never written); ``run()`` repeats it until ``stop`` is set, then removes the file."""

    def __init__(
        self,
        cfg: SleepwatchConfig,
        ask: Asker = guard_state,
        clock: Callable[[], float] = time.time,
        log: Callable[[str], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.output = Path(cfg.output)
        self.ask = ask
        self.clock = clock
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.pool = ThreadPoolExecutor(max_workers=max(1, min(MAX_WORKERS, len(cfg.instances))))
        self.written: tuple[list[str], list[str]] | None = None
        self.last_error = ""

    def poll(self) -> dict[str, str | None]:
        """Every instance's state now (None: unknown), the guards asked at once."""
        t = self.cfg.timeout_seconds
        futures = {i.instance: self.pool.submit(self.ask, i.address, i.port, t) for i in self.cfg.instances}
        out: dict[str, str | None] = {}
        for name, f in futures.items():
            try:
                out[name] = f.result()
            except Exception:  # an asker that failed: unknown, as a guard that did not answer
                out[name] = None
        return out

    def step(self) -> bool:
        """Ask every guard; write the file when its sets differ from the ones written last. True when written;
        ``OSError`` when it cannot be written (the next step tries again)."""
        sets = sleep_sets(self.poll())
        if sets == self.written:
            return False
        doc: AsleepFile = {"asleep": sets[0], "waking": sets[1], "updated": round(self.clock(), 3)}
        write_json_atomic(self.output, doc)
        before, self.written = self.written, sets
        if before is not None or sets[0]:
            self.log(f"asleep: [{', '.join(sets[0])}] waking: [{', '.join(sets[1])}]")
        return True

    def run(self, stop: threading.Event | Stop, notifier: Notifier | None = None) -> None:
        """Steps every ``interval_seconds`` until ``stop`` is set; READY=1 after the first; removes the file on
        the way out."""
        ready = False
        try:
            while not stop.is_set():
                t0 = time.monotonic()
                try:
                    self.step()
                    self.last_error = ""
                except OSError as exc:
                    why = f"cannot write {self.output}: {exc}"
                    if why != self.last_error:  # said once, not every second
                        self.log(why)
                    self.last_error = why
                if notifier is not None:
                    if not ready:
                        notifier.send("READY=1")
                        ready = True
                    notifier.status(self.status())
                stop.wait(max(0.0, self.cfg.interval_seconds - (time.monotonic() - t0)))
        finally:
            self.pool.shutdown(wait=False, cancel_futures=True)
            self.output.unlink(missing_ok=True)

    def status(self) -> str:
        if self.last_error:
            return self.last_error
        asleep = self.written[0] if self.written else []
        return f"{len(self.cfg.instances)} watched, {len(asleep)} not awake" + (
            f": {', '.join(asleep)}" if asleep else ""
        )


def _run(a: argparse.Namespace) -> int:
    try:
        cfg = SleepwatchConfig.load(a.config)
    except (OSError, ContractError) as exc:
        print(f"vllm-fleet sleepwatch: {exc}", file=sys.stderr)
        return 2
    stop = Stop()  # not a threading.Event: its set in a signal handler can wait on the main thread (waker.py)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    notifier = Notifier()
    print(
        f"vllm-fleet sleepwatch: {len(cfg.instances)} instance(s) every {cfg.interval_seconds:g} s -> {cfg.output}",
        file=sys.stderr,
        flush=True,
    )
    SleepWatch(cfg).run(stop, notifier)
    notifier.close()
    return 0


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, metavar="PATH", help="the sleep watch config (JSON)")
    p.set_defaults(handler=_run)
