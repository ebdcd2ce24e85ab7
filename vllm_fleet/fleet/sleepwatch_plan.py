"""What a gateway host needs for models that sleep (issue 33; docs/sleep.md "Gateway"): the sleep watch's config
(``contracts.SleepwatchConfig``, rendered to ``contracts.SLEEPWATCH_CONFIG_FILE`` by nginx/sleepwatch.json.j2)
and its unit's settings, or None when no route of the gateway sleeps (no model sleeps, or each that does has one
instance: nothing to choose); then nothing of it is rendered, and routes.json names no asleep file: the router
never reads one.

The gateway needs none of it to be correct (a request that meets a sleeping engine is held by its guard until
the engine is awake); it is what lets the router prefer an awake replica of a model over waking a sleeping one.
"""

from __future__ import annotations

from typing import Any

from vllm_fleet.contracts import (
    SLEEP_ASLEEP_FILE,
    SLEEPWATCH_CONFIG_FILE,
    SLEEPWATCH_INTERVAL_SECONDS,
    SLEEPWATCH_SCHEMA,
    SLEEPWATCH_TIMEOUT_SECONDS,
    SleepwatchConfig,
    SleepwatchInstance,
)
from vllm_fleet.fleet.admission_config import NGINX_GROUP, runtime_directory

# read when a plan is made, not when this module is imported: the gateway tests point it at their own folder
ASLEEP_FILE = SLEEP_ASLEEP_FILE
# the watch's unit (nginx/vllm-fleet-sleepwatch.service.j2)
UNIT_FILE = "/etc/systemd/system/vllm-fleet-sleepwatch.service"


def sleepwatch_files() -> list[str]:
    """``vf.gateway_sleepwatch_files``: the files rendered for the watch (its config, its unit), on every gateway
    host whether the watch runs or not: the gateway role removes them when no routed model sleeps any more."""
    return [SLEEPWATCH_CONFIG_FILE, UNIT_FILE]


def split_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` (an upstream server's address; ``[V6]:PORT`` too) → (host, port)."""
    host, _, port = address.rpartition(":")
    return host.removeprefix("[").removesuffix("]"), int(port)


def sleepwatch_plan(fleet: str, routes: list[dict[str, Any]]) -> dict[str, Any] | None:
    """``vf.gateway_sleepwatch`` from ``vf.gateway_routes`` (routes.py: a route ``sleeps`` when an upstream of
    two or more servers holds one that sleeps, each server's ``sleeps`` says its model has ``sleep``): the config
    (every sleep-capable instance of such a route, once, where nginx reaches it), where it is rendered, the file
    the watch writes and the router reads, the unit's RuntimeDirectory= and user; None when no route sleeps (no
    model sleeps, or each one that does has a single instance: the router has nothing to choose)."""
    seen: dict[str, SleepwatchInstance] = {}
    for rt in routes:
        if not rt["sleeps"]:
            continue
        for s in (s for u in rt["upstreams"] for s in u["servers"]):
            if s["sleeps"] and s["instance"] not in seen:
                host, port = split_address(str(s["address"]))
                seen[s["instance"]] = SleepwatchInstance(instance=s["instance"], address=host, port=port)
    if not seen:
        return None
    asleep_file = ASLEEP_FILE
    folder = asleep_file.rsplit("/", 1)[0] or "/"
    config = SleepwatchConfig(
        schema=SLEEPWATCH_SCHEMA,
        fleet=fleet,
        output=asleep_file,
        interval_seconds=SLEEPWATCH_INTERVAL_SECONDS,
        timeout_seconds=SLEEPWATCH_TIMEOUT_SECONDS,
        instances=[seen[n] for n in sorted(seen)],
    )
    return {
        "config_file": SLEEPWATCH_CONFIG_FILE,
        "unit_file": UNIT_FILE,
        "config": config.to_dict(),
        "asleep_file": asleep_file,
        # its folder: made by systemd for the unit under /run (RuntimeDirectory=, kept when it stops: the router
        # lists it), else the unit may write there
        "asleep_dir": folder,
        "runtime_directory": runtime_directory(folder),
        # nginx's user: a system user every gateway host has; the watch needs no other right than writing its
        # folder
        "user": NGINX_GROUP,
    }
