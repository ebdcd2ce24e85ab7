"""vllm-fleet manifest: content from the spec + fetch checksums; rewritten only when something changed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_fleet.fleet.host_contract import host_contract
from vllm_fleet.fleet.spec import parse_spec, spec_hash
from vllm_fleet.host import manifest
from vllm_fleet.host.fetch import fetch_all
from vllm_fleet.host.manifest import build_manifest, write_manifest


def test_manifest_content_and_idempotent_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # torch's own answer is read in a subprocess on real hosts (testinfra checks it there); here: metadata only
    monkeypatch.setattr(manifest, "_py_json", lambda code, timeout=0: (None, "skipped"))
    model = tmp_path / "tiny"
    model.mkdir()
    (model / "config.json").write_text("{}")
    spec = parse_spec(
        {
            "name": "t",
            "stack": {"profile": "cpu", "vllm_version": "0.32.0"},
            "hosts": [{"name": "h1", "address": "127.0.0.1"}],
            "models": [
                {"name": "a", "host": "h1", "port": 8101, "source": {"path": str(model)}, "max_num_seqs": 4}
            ],
        }
    )
    contract = host_contract(spec, "h1")
    fetch_all(contract.models)
    data = build_manifest(contract)
    assert (
        data["profile"] == "cpu" and data["pinned_vllm"] == "0.32.0" and data["spec_hash"] == spec_hash(spec)
    )
    assert (data["fleet"], data["host"]) == ("t", "h1")
    assert data["stack"]["vllm"] == "0.32.0" and data["stack"]["torch"].startswith("2.13.0")
    assert data["stack"]["cpu"]["flags"]["avx2"] == ("avx2" in Path("/proc/cpuinfo").read_text())
    inst = data["instances"][0]
    assert inst["unit"] == "vllm@a.service" and "--max-num-seqs" in inst["args"]
    assert list(inst["model"]["checksums"]) == ["config.json"]
    out = tmp_path / "m" / "manifest.json"
    assert write_manifest(data, out)
    first = json.loads(out.read_text())
    assert "generated_at" in first
    assert not write_manifest(data, out)  # only the time would change
    data["instances"][0]["port"] = 9999
    assert write_manifest(data, out)
