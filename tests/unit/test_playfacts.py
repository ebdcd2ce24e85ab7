"""What the play decides from the hosts' answers (vllm_fleet/fleet/playfacts.py, the roles' vllm_fleet filters)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_fleet.fleet import playfacts as pf

REPO = Path(__file__).resolve().parents[2]

INSTANCES = [
    {"name": "a", "unit": "vllm@a.service", "model_path": "/m/a"},
    {"name": "b", "unit": "vllm@b.service", "model_path": "/m/b"},
    {"name": "c", "unit": "vllm@c.service", "model_path": "/m/a"},
]


def test_a_layer_verdict_from_the_module_and_from_the_command() -> None:
    layers = [
        {"name": "driver", "status": "ok", "detail": "580.1", "fix": "", "facts": {"nvidia_smi": "0, H200"}},
        {"name": "gpus", "status": "fail", "detail": "1 GPU, 2 needed", "fix": "hosts[0].gpus"},
    ]
    v = pf.layer_verdict({"layers": layers}, "driver", "h1")
    assert v["msg"] == "h1 driver: OK 580.1" and not v["failed"] and v["facts"]["nvidia_smi"] == "0, H200"
    cmd = {"rc": 1, "stdout": "  " + json.dumps(layers), "stderr": ""}
    v = pf.layer_verdict(cmd, "gpus", "h1")
    assert v["failed"] and v["msg"] == "h1 gpus: FAIL 1 GPU, 2 needed - fix: hosts[0].gpus"


def test_a_doctor_that_gave_no_verdict_fails_with_how_it_ended() -> None:
    v = pf.layer_verdict(
        {"rc": 139, "stdout": "", "stderr": "Traceback\nSegmentation fault\n"}, "vllm-import", "h2"
    )
    assert v["failed"] and v["status"] == "fail"
    assert "the doctor did not answer (exit 139: Segmentation fault)" in v["msg"]
    assert v["msg"].endswith("- fix: run vllm-fleet doctor on the host by hand to see why (docs/ansible.md)")
    # the module failed as a whole: its msg is what it said
    assert "(exit ?: no python3)" in pf.layer_verdict({"msg": "no python3"}, "gpus", "h2")["msg"]
    # a layer the doctor did not run is no pass either
    assert pf.layer_verdict({"layers": [{"name": "driver", "status": "ok"}]}, "gpus", "h")["failed"]


def test_the_packages_of_each_profile_and_those_dpkg_lacks() -> None:
    by = {"cpu": ["python3-venv", "libnuma1"], "gpu": ["python3-venv"]}
    assert pf.engine_packages(by, ["gpu", "cpu"]) == ["python3-venv", "libnuma1"]
    assert pf.engine_packages(by, ["gpu"]) == ["python3-venv"]
    dpkg = ["python3-venv installed", "libnuma1 not-installed"]
    assert pf.missing_packages(["python3-venv", "libnuma1"], dpkg) == ["libnuma1"]
    assert pf.missing_packages(["python3-venv", "libnuma1"], []) == ["python3-venv", "libnuma1"]


def test_listeners_on_planned_ports_that_are_not_ours() -> None:
    listeners = {
        "8000": {"comm": "nginx", "pid": 10, "unit": "nginx.service"},
        "8101": {"comm": "python3", "pid": 11, "unit": "vllm@tiny.service"},
        "9090": {"comm": "node", "pid": 12, "unit": "grafana-thing.service"},
        "9100": {"comm": "nc", "pid": 13, "unit": ""},
    }
    owners = {
        "8000": "gateway.port",
        "9090": "monitoring.prometheus_port",
        "9100": "monitoring.node_exporter_port",
    }
    assert pf.foreign_listeners(listeners, owners) == [
        "9090 (monitoring.prometheus_port) by node pid 12 unit grafana-thing.service",
        "9100 (monitoring.node_exporter_port) by nc pid 13 unit -",
    ]


def test_unit_actions() -> None:
    units = {
        "vllm@a.service": {"SubState": "running", "UnitFileState": "enabled"},
        "vllm@b.service": {"SubState": "dead", "UnitFileState": "disabled"},
        "vllm@old.service": {"SubState": "running", "UnitFileState": "enabled"},
        "vllm-fleet.target": {"SubState": "active", "UnitFileState": "enabled"},
    }
    links = ["/etc/systemd/system/vllm-fleet.target.wants/vllm@gone.service"]
    planned = ["vllm@a.service", "vllm@b.service", "vllm-worker@w.service"]
    got = pf.unit_actions(planned, units, links)
    assert got["running"] == ["vllm@a.service"]
    assert got["to_enable"] == ["vllm@b.service", "vllm-worker@w.service"]
    assert got["stale"] == ["vllm@old.service", "vllm@gone.service"]
    assert got["enable_target"] is False
    # check mode on a fresh host: the template units are not there yet, so nothing can be enabled
    new = ["/etc/systemd/system/vllm@.service", "/etc/systemd/system/vllm-fleet.target"]
    fresh = pf.unit_actions(planned, {}, [], new, check_mode=True)
    assert fresh["to_enable"] == ["vllm-worker@w.service"] and fresh["enable_target"] is False
    assert pf.unit_actions(planned, {}, [], new, check_mode=False)["enable_target"] is True


def test_which_instances_restart() -> None:
    changed = [{"dest": "/etc/vllm-fleet/instances/b.json", "instance_name": "b"}]
    assert pf.restarts(INSTANCES, changed, [], False) == ["b"]
    assert pf.restarts(INSTANCES, [], ["/m/a"], False) == ["a", "c"]
    assert pf.restarts(INSTANCES, changed, ["/m/a"], False, ["/var/lib/vllm-fleet/restart-pending/x"]) == [
        "b",
        "a",
        "c",
        "x",
    ]
    shared = [{"dest": "/etc/systemd/system/vllm@.service", "instance_name": None}]
    assert pf.restarts(INSTANCES, shared, [], False) == ["a", "b", "c"]
    assert pf.restarts(INSTANCES, [], [], True) == ["a", "b", "c"]
    # a changed drop-in of one instance is not the shared unit
    own = [{"dest": "/etc/systemd/system/vllm@b.service.d/x.conf", "instance_name": "b"}]
    assert pf.restarts(INSTANCES, own, [], False) == ["b"]
    assert pf.rolling_restarts(INSTANCES, ["c", "a", "x"], ["vllm@a.service", "vllm@b.service"]) == ["a"]


def test_the_roles_filters_are_these_functions(tmp_path: Path) -> None:
    """The filter plugin maps each vllm_fleet_* filter to its function (loaded as Ansible loads it, without
    importing ansible-core here: its stubs are enough for the plugin's one import)."""
    code = (
        "import sys, types; m = types.ModuleType('ansible.errors'); m.AnsibleFilterError = Exception;"
        "sys.modules['ansible'] = types.ModuleType('ansible'); sys.modules['ansible.errors'] = m;"
        "import importlib.util as u; s = u.spec_from_file_location('f', sys.argv[1]); f = u.module_from_spec(s);"
        "s.loader.exec_module(f); fs = f.FilterModule().filters();"
        "print(sorted(fs)); print(fs['vllm_fleet_missing_packages'](['a', 'b'], ['a installed']))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(REPO / "ansible/plugins/filter/vllm_fleet.py")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert out[1] == "['b']"
    assert out[0] == str(
        sorted(
            f"vllm_fleet_{n}"
            for n in (
                "layer_verdict",
                "engine_packages",
                "missing_packages",
                "foreign_listeners",
                "unit_actions",
                "restarts",
                "rolling_restarts",
            )
        )
    )


@pytest.mark.parametrize("role", ["engine", "preflight"])
def test_no_role_parses_the_doctors_output_in_jinja(role: str) -> None:
    text = (REPO / "ansible/roles" / role / "vars/main.yml").read_text()
    assert "from_json" not in text and "vllm_fleet_layer_verdict" not in text
