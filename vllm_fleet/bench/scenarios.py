"""Scenarios run beside the load through commands you pass (local, or ``ssh HOST …`` in the command):

- ``failover``: at time T run a command (e.g. ``kill -9`` of a primary engine), poll a health URL until it
  answers 200 again; report failed requests (streaming and not) and the time until the unit serves again.
- ``rolling-restart``: for every instance in turn: drain → restart → wait ready → undrain, under load;
  report failed requests per step.
Placeholders in commands and URLs: ``{name}`` and ``{host}`` (instances given as ``NAME`` or ``NAME@HOST``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from .runner import Load


async def run_cmd(cmd: str, timeout: float) -> dict[str, Any]:
    """Run a shell command; its exit status, duration and output tail (never raises)."""
    t = time.perf_counter()
    proc = await asyncio.create_subprocess_shell(
        cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, start_new_session=True
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout)
        rc: int | None = proc.returncode
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the whole session: a shell's children hold the pipe too
        out, _ = await proc.communicate()
        rc = None
    return {
        "cmd": cmd,
        "rc": rc,
        "timed_out": rc is None,
        "seconds": round(time.perf_counter() - t, 3),
        "output": out.decode(errors="replace")[-500:],
    }


async def http_ok(session: aiohttp.ClientSession, url: str) -> bool:
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=2)) as r:
            return r.status == 200
    except (aiohttp.ClientError, TimeoutError, OSError):
        return False


async def _poll(
    probe: Callable[[], Awaitable[bool]], timeout: float, interval: float, want_down_first: float
) -> dict[str, Any]:
    """Call ``probe`` until it succeeds after having failed once (or after ``want_down_first`` seconds): when
    it was first seen down, and when it succeeded again (seconds from the call)."""
    t0 = time.perf_counter()
    down_at: float | None = None
    while time.perf_counter() - t0 < timeout:
        ok = await probe()
        now = time.perf_counter() - t0
        if not ok and down_at is None:
            down_at = now
        if ok and (down_at is not None or now >= want_down_first):
            return {"down_seen_at_s": down_at, "up_after_s": round(now, 3), "recovered": True}
        await asyncio.sleep(interval)
    return {"down_seen_at_s": down_at, "up_after_s": None, "recovered": False}


async def wait_for_health(
    session: aiohttp.ClientSession,
    url: str,
    timeout: float,
    interval: float = 0.2,
    want_down_first: float = 0.0,
) -> dict[str, Any]:
    """Poll ``url`` until it answers 200 again (see ``_poll``)."""
    return await _poll(lambda: http_ok(session, url), timeout, interval, want_down_first)


async def wait_for_cmd(
    cmd: str, timeout: float, cmd_timeout: float, interval: float = 0.5, want_down_first: float = 0.0
) -> dict[str, Any]:
    """``wait_for_health`` with a command (exit 0 = healthy), e.g. ``ssh HOST curl -sf …/health`` for an
    engine that listens on its host's loopback only."""

    async def ok() -> bool:
        return (await run_cmd(cmd, cmd_timeout))["rc"] == 0

    return await _poll(ok, timeout, interval, want_down_first)


@dataclass
class Failover:
    during: str
    at: float
    health_url: str | None = None
    health_timeout: float = 900.0
    cmd_timeout: float = 60.0
    stop_after_recovery: float | None = None  # end the load this many seconds after recovery
    health_cmd: str | None = None  # instead of health_url: a command, exit 0 = serving

    async def __call__(self, load: Load, session: aiohttp.ClientSession) -> dict[str, Any]:
        facts: dict[str, Any] = {"name": "failover", "command": self.during, "at_s": self.at, "events": []}
        try:
            await asyncio.sleep(max(0.0, self.at - load.now()))
            t_cmd = load.now()
            facts["events"].append({"t": t_cmd, "label": "failover command"})
            facts["run"] = await run_cmd(self.during, self.cmd_timeout)
            facts["command_at_s"] = t_cmd
            h: dict[str, Any] | None = None
            if self.health_url:
                h = await wait_for_health(session, self.health_url, self.health_timeout, want_down_first=10.0)
                facts["health"] = {"url": self.health_url, **h}
            elif self.health_cmd:
                h = await wait_for_cmd(
                    self.health_cmd, self.health_timeout, self.cmd_timeout, want_down_first=10.0
                )
                facts["health"] = {"cmd": self.health_cmd, **h}
            if h is not None and h["recovered"]:
                facts["serving_again_after_s"] = round(load.now() - t_cmd, 3)
                facts["events"].append({"t": load.now(), "label": "healthy again"})
            if self.stop_after_recovery is not None:
                await asyncio.sleep(self.stop_after_recovery)
                load.stop()
        except asyncio.CancelledError:
            facts["cut_short_by_end_of_load"] = True
        return facts


@dataclass
class Instance:
    name: str
    host: str = ""

    @classmethod
    def parse(cls, text: str) -> Instance:
        name, _, host = text.partition("@")
        return cls(name, host)

    def fill(self, template: str) -> str:
        return template.replace("{name}", self.name).replace("{host}", self.host)


@dataclass
class RollingRestart:
    instances: list[Instance]
    restart_cmd: str
    drain_cmd: str | None = None
    undrain_cmd: str | None = None
    ready_url: str | None = None
    ready_cmd: str | None = None
    start_after: float = 5.0
    drain_wait: float = 0.0
    settle: float = 3.0
    ready_timeout: float = 900.0
    cmd_timeout: float = 120.0
    steps: list[dict[str, Any]] = field(default_factory=list)

    async def _ready(self, session: aiohttp.ClientSession, inst: Instance) -> dict[str, Any]:
        t = time.perf_counter()
        if self.ready_url:
            h = await wait_for_health(session, inst.fill(self.ready_url), self.ready_timeout, interval=0.5)
            return {"how": inst.fill(self.ready_url), "ready": h["recovered"], "seconds": h["up_after_s"]}
        if self.ready_cmd:
            while time.perf_counter() - t < self.ready_timeout:
                r = await run_cmd(inst.fill(self.ready_cmd), self.cmd_timeout)
                if r["rc"] == 0:
                    return {"how": r["cmd"], "ready": True, "seconds": round(time.perf_counter() - t, 3)}
                await asyncio.sleep(0.5)
            return {"how": inst.fill(self.ready_cmd), "ready": False, "seconds": None}
        return {"how": "none", "ready": True, "seconds": 0.0}

    async def __call__(self, load: Load, session: aiohttp.ClientSession) -> dict[str, Any]:
        facts: dict[str, Any] = {
            "name": "rolling-restart",
            "steps": self.steps,
            "events": [],
            "completed": False,
        }
        try:
            await asyncio.sleep(max(0.0, self.start_after - load.now()))
            for inst in self.instances:
                step: dict[str, Any] = {"instance": inst.name, "host": inst.host, "start_s": load.now()}
                self.steps.append(step)
                facts["events"].append({"t": load.now(), "label": f"restart {inst.name}"})
                if self.drain_cmd:
                    step["drain"] = await run_cmd(inst.fill(self.drain_cmd), self.cmd_timeout)
                    await asyncio.sleep(self.drain_wait)
                step["restart"] = await run_cmd(inst.fill(self.restart_cmd), self.cmd_timeout)
                step["wait_ready"] = await self._ready(session, inst)
                if self.undrain_cmd:
                    step["undrain"] = await run_cmd(inst.fill(self.undrain_cmd), self.cmd_timeout)
                step["end_s"] = load.now()
                step["ok"] = all(
                    step[k]["rc"] == 0 for k in ("drain", "restart", "undrain") if k in step
                ) and bool(step["wait_ready"]["ready"])
                if not step["ok"]:
                    facts["aborted"] = f"step {inst.name} failed: not restarting the next instance"
                    break
                await asyncio.sleep(self.settle)
            facts["completed"] = "aborted" not in facts
            load.stop()
        except asyncio.CancelledError:
            facts["cut_short_by_end_of_load"] = True
        return facts


def failures_between(report: dict[str, Any], start: float, end: float | None) -> dict[str, int]:
    """Measured requests (not warm-up ones, like the overall figures) that failed and started in [start, end]
    (end None: to the end), by stream kind."""
    out = {"total": 0, "streaming": 0, "non_streaming": 0}
    for f in report.get("failures", []):
        if f.get("warmup"):
            continue
        if f["start"] >= start and (end is None or f["start"] <= end):
            out["total"] += 1
            out["streaming" if f["stream"] else "non_streaming"] += 1
    return out


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    """Add failed-request figures to the scenario facts of a finished report."""
    sc = report.get("scenario")
    if not isinstance(sc, dict):
        return {}
    o = report["overall"]
    sc["failed_requests"] = failures_between(report, 0.0, None)
    sc["failed_by_type"] = o["errors"]
    if sc.get("name") == "failover" and "command_at_s" in sc:
        t = sc["command_at_s"]
        sc["failed_after_command"] = failures_between(report, t - report["profile"]["timeout"], None)
    if sc.get("name") == "rolling-restart":
        for step in sc["steps"]:
            step["failed"] = failures_between(report, step["start_s"], step.get("end_s"))
    return sc
