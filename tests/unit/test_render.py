"""render: every artifact for every host, from the template folders; refuses a refused plan."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

from vllm_fleet.fleet.context import build_context
from vllm_fleet.fleet.render import load_artifact_defs, render_fleet, render_host
from vllm_fleet.fleet.spec import load_spec, parse_spec

REPO = Path(__file__).resolve().parents[2]


def test_every_manifest_entry_is_valid() -> None:
    defs = load_artifact_defs(REPO)
    assert any(d.template == "instance.json.j2" for d in defs)
    for d in defs:
        if d.template:
            assert (REPO / d.folder / d.template).is_file(), d


def test_instance_config_rendered_per_instance(tmp_path: Path) -> None:
    spec = load_spec(REPO / "examples/seed-004-4xa100.yml")
    render_fleet(spec, tmp_path)
    cfg = json.loads((tmp_path / "gpu-a/etc/vllm-fleet/instances/qwen3-8b.json").read_text())
    assert cfg["environment"]["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert cfg["environment"]["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    argv = cfg["command"]
    assert argv[:2] == ["/opt/vllm-fleet/venv/bin/vllm", "serve"]
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
    assert argv[argv.index("--shutdown-timeout") + 1] == "60"
    assert argv[argv.index("--host") + 1] == "127.0.0.1"  # gateway + monitoring on the same host
    assert "--enable-prefix-caching" in argv and "--enable-chunked-prefill" in argv
    assert argv[argv.index("--reasoning-parser") + 1] == "qwen3"


def test_cpu_profile_uses_vllm_cpu_entry() -> None:
    spec = load_spec(REPO / "examples/tiny-cpu.yml")
    (r,) = [x for x in render_host(spec, "h1") if x.src == "units/instance.json.j2"]
    cfg = json.loads(r.content)
    assert cfg["command"][1:4] == ["-m", "vllm_fleet.host.vllm_cpu_entry", "serve"]
    assert "--kv-cache-memory-bytes" in cfg["command"]
    assert "--tensor-parallel-size" not in cfg["command"]


def test_remote_gateway_makes_engines_listen_on_private_address() -> None:
    d = yaml.safe_load((REPO / "examples/tiny-cpu.yml").read_text())
    d["hosts"].append({"name": "h2", "address": "10.9.0.3", "private_address": "192.168.9.3"})
    d["models"].append(dict(d["models"][0], name="tiny-b", host="h2", role="backup"))
    spec = parse_spec(d)
    ctx = build_context(spec, "h2")
    (inst,) = ctx["vf"]["instances"]
    assert inst["listen_address"] == "192.168.9.3"
    (up,) = ctx["vf"]["upstreams"]
    assert [s["address"] for s in up["servers"]] == ["127.0.0.1:8101", "192.168.9.3:8101"]


def test_render_cli_refuses_bad_plan_and_writes_nothing(tmp_path: Path) -> None:
    d = yaml.safe_load((REPO / "examples/seed-004-4xa100.yml").read_text())
    d["models"][1]["gpus"] = [0, 1]
    bad = tmp_path / "bad.yml"
    bad.write_text(yaml.safe_dump(d))
    out = tmp_path / "out"
    r = subprocess.run(
        [sys.executable, "-m", "vllm_fleet.cli", "render", str(bad), "--out", str(out)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 1
    assert "models[1].gpus: GPU 0 on gpu-a is already used by models[0]" in r.stderr
    assert not out.exists()
