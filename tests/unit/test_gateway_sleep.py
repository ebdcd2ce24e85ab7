"""The gateway side of sleep mode (issue 33, docs/sleep.md "Gateway"): routes.json marks a model whose instances
may sleep (``sleeps``, per server too) and names the sleep watch's file; the sleep watch's config lists every
sleep-capable instance the gateway routes to, where nginx reaches it; its unit and config are rendered only when
a routed model sleeps, and the gateway role starts or stops the watch accordingly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from vllm_fleet.contracts import (
    SLEEP_ASLEEP_FILE,
    SLEEPWATCH_CONFIG_FILE,
    SLEEPWATCH_INTERVAL_SECONDS,
    SleepwatchConfig,
)
from vllm_fleet.devtools.gateway_testing import route_upstream
from vllm_fleet.fleet.routes import SUMMARY_KEYS, gateway_routes, route_index
from vllm_fleet.fleet.sleepwatch_plan import sleepwatch_plan, split_address

REPO = Path(__file__).resolve().parents[2]
SERVERS = [("a", "primary", "default"), ("b", "primary", "default"), ("c", "backup", "default")]


def sleepy(up: dict[str, Any], *names: str) -> dict[str, Any]:
    """``up`` with the servers ``names`` marked as context.upstreams marks an instance whose model sleeps."""
    for s in up["servers"]:
        s["sleeps"] = s["instance"] in names
    return up


def test_a_model_with_a_sleeping_instance_is_marked_in_its_summary() -> None:
    (rt,) = gateway_routes([sleepy(route_upstream(SERVERS), "b")], {})
    assert rt["sleeps"] is True
    assert {s["instance"]: s["sleeps"] for s in rt["upstreams"][0]["servers"]} == {
        "a": False,
        "b": True,
        "c": False,
    }
    (summary,) = route_index([rt])["models"]
    assert "sleeps" in SUMMARY_KEYS and summary["sleeps"] is True
    # none sleeps (or an upstream made before the field): false, and the router never reads the file for it
    (plain,) = gateway_routes([route_upstream(SERVERS)], {})
    assert plain["sleeps"] is False and not any(s["sleeps"] for s in plain["upstreams"][0]["servers"])


def test_a_sleeping_canary_alone_does_not_mark_the_model() -> None:
    """The router walks the model's upstreams, never the canary's one-server upstream: a canary that sleeps
    costs the model's requests no file read."""
    up = sleepy(route_upstream([*SERVERS, ("can", "canary", "default")]), "can")
    (rt,) = gateway_routes([up], {})
    assert rt["sleeps"] is False and rt["canary"]["instance"] == "can"


def test_the_watch_config_lists_each_sleeping_instance_once_where_nginx_reaches_it() -> None:
    one = sleepy(route_upstream(SERVERS), "b", "c")
    other = sleepy(route_upstream([("z", "primary", "default"), ("a2", "primary", "default")]), "z")
    other["model"], other["upstream"] = "n", "m_n"
    other["servers"][0]["address"] = "10.0.0.7:8200"
    twice = sleepy(route_upstream([("b", "primary", "default")]), "b")  # an instance in two upstreams: once
    twice["model"], twice["upstream"] = "o", "m_o"
    twice["servers"][0]["address"] = "127.0.0.1:8101"
    plan = sleepwatch_plan("f", [one, other, twice])
    assert plan is not None
    cfg = SleepwatchConfig.from_dict(plan["config"], "plan")  # what the host reads, checked
    assert [(i.instance, i.address, i.port) for i in cfg.instances] == [
        ("b", "127.0.0.1", 8101),
        ("c", "127.0.0.1", 8102),
        ("z", "10.0.0.7", 8200),
    ]
    assert cfg.output == SLEEP_ASLEEP_FILE and cfg.interval_seconds == SLEEPWATCH_INTERVAL_SECONDS
    assert cfg.fleet == "f"
    assert plan["config_file"] == SLEEPWATCH_CONFIG_FILE and plan["asleep_file"] == SLEEP_ASLEEP_FILE
    assert (
        plan["runtime_directory"] == "vllm-fleet-sleepwatch"
        and plan["asleep_dir"] == "/run/vllm-fleet-sleepwatch"
    )
    assert plan["user"] == "www-data"
    assert sleepwatch_plan("f", [route_upstream(SERVERS)]) is None


def test_split_address() -> None:
    assert split_address("10.0.0.1:8001") == ("10.0.0.1", 8001)
    assert split_address("[fd00::1]:8001") == ("fd00::1", 8001)


def _tasks(name: str) -> list[dict[str, Any]]:
    return yaml.safe_load((REPO / "ansible/roles/gateway/tasks" / name).read_text())


def test_the_role_starts_the_watch_only_when_a_routed_model_sleeps() -> None:
    """run.yml: the watch is started (and enabled) when on, stopped (and disabled) when off; its state is read
    in configure.yml, and a change of its files restarts it, never reloads nginx."""
    run = {t["name"]: t for t in _tasks("run.yml")}
    start = run["Enable and start the sleep watch"]
    stop = run["Stop the sleep watch (no routed model sleeps)"]
    assert start["ansible.builtin.systemd_service"]["state"] == "started"
    assert stop["ansible.builtin.systemd_service"]["state"] == "stopped"
    assert start["when"][0].startswith("vf.gateway_sleepwatch_on and")
    assert stop["when"][0].startswith("not vf.gateway_sleepwatch_on and")
    names = list(run)
    assert names.index("Enable and start the sleep watch") < names.index("Enable and start nginx")
    configure = {t["name"]: t for t in _tasks("configure.yml")}
    read = configure["Read nginx's and the admission service's state"]["vllm_fleet_host_state"]["units"]
    assert "vllm-fleet-sleepwatch.service" in read
    restart = configure["Restart the sleep watch when its configuration or unit changed"]
    assert restart["notify"] == "Restart vllm-fleet-sleepwatch"
    reload = configure["Reload nginx when its configuration changed"]["when"]
    assert "sleepwatch" in reload
    handlers = {
        h["name"] for h in yaml.safe_load((REPO / "ansible/roles/gateway/handlers/main.yml").read_text())
    }
    assert "Restart vllm-fleet-sleepwatch" in handlers
