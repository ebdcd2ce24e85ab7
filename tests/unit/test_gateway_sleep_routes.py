"""The gateway side of sleep mode (issue 33, docs/sleep.md "Gateway"): routes.json marks a model whose instances
may sleep (``sleeps``, per server too) and names the sleep watch's file; the sleep watch's config lists every
sleep-capable instance the gateway routes to, where nginx reaches it; its unit and config are rendered only when
a routed model sleeps, and the gateway role starts or stops the watch accordingly."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from vllm_fleet.contracts import (
    SLEEP_ASLEEP_FILE,
    SLEEPWATCH_CONFIG_FILE,
    SLEEPWATCH_INTERVAL_SECONDS,
    SleepwatchConfig,
)
from vllm_fleet.devtools.gateway_nginx import HAVE_NGINX, NginxGateway
from vllm_fleet.devtools.gateway_testing import gateway_spec, route_upstream
from vllm_fleet.fleet import sleepwatch_plan as sleepwatch_plan_module
from vllm_fleet.fleet.context import build_context
from vllm_fleet.fleet.render import render_fleet, render_host
from vllm_fleet.fleet.routes import SUMMARY_KEYS, gateway_routes, route_index
from vllm_fleet.fleet.sleepwatch_plan import sleepwatch_plan, split_address
from vllm_fleet.fleet.spec import FleetSpec

REPO = Path(__file__).resolve().parents[2]
needs_nginx = pytest.mark.skipif(not HAVE_NGINX, reason="nginx + libnginx-mod-http-js not installed")
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


def test_a_model_with_one_server_has_nothing_to_choose() -> None:
    """One sleeping instance (and a CPU fallback, an upstream of its own): nothing for the router to prefer, no
    file read, no watch."""
    (rt,) = gateway_routes(
        [sleepy(route_upstream([("a", "primary", "default"), ("f", "fallback", "cpu")]), "a")], {}
    )
    assert rt["sleeps"] is False and rt["upstreams"][0]["servers"][0]["sleeps"] is True
    assert sleepwatch_plan("f", [rt]) is None
    # a sleeping backup beside an awake primary: a choice
    (rt,) = gateway_routes(
        [sleepy(route_upstream([("a", "primary", "default"), ("c", "backup", "default")]), "c")], {}
    )
    assert rt["sleeps"] is True


def test_a_sleeping_canary_alone_does_not_mark_the_model() -> None:
    """The router walks the model's upstreams, never the canary's one-server upstream: a canary that sleeps
    costs the model's requests no file read."""
    up = sleepy(route_upstream([*SERVERS, ("can", "canary", "default")]), "can")
    (rt,) = gateway_routes([up], {})
    assert rt["sleeps"] is False and rt["canary"]["instance"] == "can"


def test_the_watch_config_lists_each_sleeping_instance_once_where_nginx_reaches_it() -> None:
    # pools: each of a model's instances is in its main upstream and its pools' (three here): listed once
    one = sleepy(
        route_upstream([("b", "primary", "default"), ("c", "primary", "high"), ("x", "backup", "default")]),
        "b",
        "c",
    )
    other = sleepy(route_upstream([("z", "primary", "default"), ("a2", "primary", "default")]), "z")
    other["model"], other["upstream"] = "n", "m_n"
    other["servers"][0]["address"] = "10.0.0.7:8200"
    routes = gateway_routes([one, other], {})
    assert len(routes[0]["upstreams"]) == 3
    plan = sleepwatch_plan("f", routes)
    assert plan is not None
    cfg = SleepwatchConfig.from_dict(plan["config"], "plan")  # what the host reads, checked
    assert [(i.instance, i.address, i.port) for i in cfg.instances] == [
        ("b", "127.0.0.1", 8100),
        ("c", "127.0.0.1", 8101),
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
    assert sleepwatch_plan("f", gateway_routes([route_upstream(SERVERS)], {})) is None


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
    # off: stopped and disabled (with its unit file), then its files removed and systemd told
    remove = run["Remove the sleep watch's config and unit (no routed model sleeps)"]
    assert remove["ansible.builtin.file"]["state"] == "absent"
    assert remove["loop"] == "{{ vf.gateway_sleepwatch_files }}"
    assert remove["when"].startswith("not vf.gateway_sleepwatch_on and")
    forget = run["Forget the removed units (systemctl daemon-reload)"]
    assert f"{remove['register']} is changed" in forget["when"]
    assert (
        names.index("Stop the sleep watch (no routed model sleeps)")
        < names.index("Remove the sleep watch's config and unit (no routed model sleeps)")
        < names.index("Forget the removed units (systemctl daemon-reload)")
    )
    configure = {t["name"]: t for t in _tasks("configure.yml")}
    read = configure["Read nginx's and the admission service's state"]["vllm_fleet_host_state"]["units"]
    assert "vllm-fleet-sleepwatch.service" in read
    restart = configure["Restart the sleep watch when its configuration or unit changed"]
    assert restart["notify"] == "Restart vllm-fleet-sleepwatch"
    reload = configure["Reload nginx when its configuration changed"]["when"]
    assert "reject('search', vllm_fleet_gateway_no_reload)" in reload
    no_reload = yaml.safe_load((REPO / "ansible/roles/gateway/vars/main.yml").read_text())[
        "vllm_fleet_gateway_no_reload"
    ]
    dests = [SLEEPWATCH_CONFIG_FILE, "/etc/systemd/system/vllm-fleet-sleepwatch.service"]
    assert all(re.search(no_reload, d) for d in dests)
    assert not re.search(no_reload, "/etc/nginx/vllm-fleet/routes.json")
    handlers = {
        h["name"] for h in yaml.safe_load((REPO / "ansible/roles/gateway/handlers/main.yml").read_text())
    }
    assert "Restart vllm-fleet-sleepwatch" in handlers


# ----------------------------------------------------------------------------- rendered from a spec


def _spec(tmp_path: Path, sleeps: bool) -> FleetSpec:
    return gateway_spec(
        [
            {"name": "a", "port": 9001, **({"sleep": {"level": 1}} if sleeps else {})},
            {"name": "b", "port": 9002},
            {"name": "q", "port": 9005, "served_model_name": "plain"},
        ],
        tmp_path,
    )


def _files(spec: FleetSpec) -> dict[str, str]:
    return {r.dest: r.content for r in render_host(spec, "h1")}


UNIT = "/etc/systemd/system/vllm-fleet-sleepwatch.service"


def test_a_sleeping_model_renders_the_watch_and_marks_routes(tmp_path: Path) -> None:
    spec = _spec(tmp_path, sleeps=True)
    files = _files(spec)
    cfg = SleepwatchConfig.from_dict(json.loads(files[SLEEPWATCH_CONFIG_FILE]), SLEEPWATCH_CONFIG_FILE)
    assert [(i.instance, i.address, i.port) for i in cfg.instances] == [("a", "127.0.0.1", 9001)]
    assert cfg.output == SLEEP_ASLEEP_FILE and cfg.fleet == spec.name
    routes = json.loads(files["/etc/nginx/vllm-fleet/routes.json"])
    assert routes["asleep_file"] == SLEEP_ASLEEP_FILE
    assert {m["model"]: m["sleeps"] for m in routes["models"]} == {"plain": False, "tiny-qwen3": True}
    unit = files[UNIT]
    for line in (
        f"ExecStart={spec.paths.venv}/bin/vllm-fleet sleepwatch --config {SLEEPWATCH_CONFIG_FILE}",
        "Type=notify",
        "Before=nginx.service",
        "User=www-data",
        "RuntimeDirectory=vllm-fleet-sleepwatch",
        "RuntimeDirectoryMode=0755",
        "RuntimeDirectoryPreserve=yes",
        "ProtectSystem=strict",
        "NoNewPrivileges=yes",
        "CapabilityBoundingSet=",
    ):
        assert f"\n{line}\n" in unit, line
    assert "ReadWritePaths" not in unit
    assert context_on(spec) is True
    assert set(build_context(spec, "h1")["vf"]["gateway_sleepwatch_files"]) <= set(files)


def test_without_a_sleeping_model_nothing_of_the_watch_is_rendered(tmp_path: Path) -> None:
    spec = _spec(tmp_path, sleeps=False)
    files = _files(spec)
    assert SLEEPWATCH_CONFIG_FILE not in files and UNIT not in files
    # what the role removes then: the files a sleeping model renders
    assert build_context(spec, "h1")["vf"]["gateway_sleepwatch_files"] == [SLEEPWATCH_CONFIG_FILE, UNIT]
    routes = json.loads(files["/etc/nginx/vllm-fleet/routes.json"])
    assert routes["asleep_file"] is None and not any(m["sleeps"] for m in routes["models"])
    assert context_on(spec) is False


def context_on(spec: FleetSpec) -> bool:
    """``vf.gateway_sleepwatch_on``, the role's conditional: a bool."""
    on = build_context(spec, "h1")["vf"]["gateway_sleepwatch_on"]
    assert isinstance(on, bool)
    return on


def test_an_asleep_file_elsewhere_is_written_through_read_write_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file outside /run (the gateway tests' folder): the unit may write its folder, systemd makes none."""
    monkeypatch.setattr(sleepwatch_plan_module, "ASLEEP_FILE", "/var/lib/vf-sleep/asleep.json")
    unit = _files(_spec(tmp_path, sleeps=True))[UNIT]
    assert "\nReadWritePaths=/var/lib/vf-sleep\n" in unit and "RuntimeDirectory" not in unit


@needs_nginx
def test_nginx_t_accepts_the_router_of_a_sleeping_model(tmp_path: Path) -> None:
    render_fleet(_spec(tmp_path, sleeps=True), tmp_path / "out")
    r = NginxGateway(tmp_path / "out" / "h1" / "etc" / "nginx", tmp_path / "prefix").check()
    assert r.returncode == 0, r.stderr


def test_the_router_reads_the_asleep_file_only_for_a_sleeping_model_and_lists_its_folder_first(
    tmp_path: Path,
) -> None:
    """A model without sleepers pays no file read; a missing file (or folder) costs no throw per request: njs
    0.7.9 walks every global to name a thrown error's backtrace."""
    js = _files(_spec(tmp_path, sleeps=True))["/etc/nginx/vllm-fleet/router.js"]
    body = js.split("function sleepers() {", 1)[1].split("\n}\n", 1)[0]
    assert body.index("fs.readdirSync(ASLEEP_DIR)") < body.index("fs.readFileSync(ASLEEP_FILE")
    assert "rt.sleeps === true ? sleepers() : null" in js
    code = [line for line in js.splitlines() if not line.lstrip().startswith("//")]
    assert sum("sleepers()" in line for line in code) == 2  # its definition and that one call
