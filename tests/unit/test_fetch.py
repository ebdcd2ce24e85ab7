"""vllm-fleet fetch: local-path source, copy from a folder, sha256 verification, checksum manifest, reruns."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from vllm_fleet.contracts import HostModel
from vllm_fleet.fleet.host_contract import fleet_models, host_contract
from vllm_fleet.fleet.spec import FleetSpec, parse_spec
from vllm_fleet.host.fetch import MANIFEST, FetchError, fetch_all


def _spec(model_dir: Path, checksums: dict[str, str] | None = None, name: str = "m") -> FleetSpec:
    return parse_spec(
        {
            "stack": {"profile": "cpu"},
            "hosts": [{"name": "h1", "address": "127.0.0.1"}],
            "models": [
                {
                    "name": name,
                    "host": "h1",
                    "port": 8101,
                    "source": {"path": str(model_dir), "checksums": checksums or {}},
                },
                {"name": f"{name}2", "host": "h1", "port": 8102, "source": {"path": str(model_dir)}},
            ],
        }
    )


def _models(spec: FleetSpec, host: str | None = None) -> list[HostModel]:
    """What fetch gets: a host's contract's models, or (controller, no host) every model of the spec."""
    return host_contract(spec, host).models if host else fleet_models(spec)


def _model(d: Path) -> dict[str, str]:
    d.mkdir(parents=True)
    files = {"config.json": b'{"a": 1}', "sub/weights.safetensors": b"\x00" * 1000}
    for rel, data in files.items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_bytes(data)
    return {rel: hashlib.sha256(data).hexdigest() for rel, data in files.items()}


def test_verify_write_manifest_then_unchanged(tmp_path: Path) -> None:
    sums = _model(tmp_path / "tiny")
    spec = _spec(tmp_path / "tiny", sums)
    first = fetch_all(_models(spec, "h1"))
    assert first[0].changed and first[0].files == sums
    assert not first[1].changed and first[1].path == first[0].path  # shared folder: fetched once
    manifest = json.loads((tmp_path / "tiny" / MANIFEST).read_text())
    assert manifest["source"] == {"kind": "path", "repo": str(tmp_path / "tiny"), "revision": "local"}
    assert {k: v["sha256"] for k, v in manifest["files"].items()} == sums
    again = fetch_all(_models(spec, "h1"))
    assert not again[0].changed


def test_checksum_mismatch_names_the_file(tmp_path: Path) -> None:
    sums = _model(tmp_path / "tiny")
    sums["config.json"] = "0" * 64
    with pytest.raises(FetchError, match=r"config.json: sha256 .* != expected 0{64}"):
        fetch_all(_models(_spec(tmp_path / "tiny", sums)))


def test_tampered_file_is_detected_on_rerun(tmp_path: Path) -> None:
    sums = _model(tmp_path / "tiny")
    spec = _spec(tmp_path / "tiny", sums)
    fetch_all(_models(spec))
    (tmp_path / "tiny" / "config.json").write_bytes(b'{"a": 2}')
    with pytest.raises(FetchError, match=r"config\.json"):
        fetch_all(_models(spec))


def test_missing_expected_file(tmp_path: Path) -> None:
    sums = _model(tmp_path / "tiny")
    sums["tokenizer.json"] = "1" * 64
    with pytest.raises(FetchError, match=r"tokenizer\.json: missing"):
        fetch_all(_models(_spec(tmp_path / "tiny", sums)))


def test_missing_path_and_copy_from(tmp_path: Path) -> None:
    sums = _model(tmp_path / "src" / "tiny")
    spec = _spec(tmp_path / "dest" / "tiny", sums)
    with pytest.raises(FetchError, match="does not exist"):
        fetch_all(_models(spec))
    res = fetch_all(_models(spec), copy_from=tmp_path / "src")
    assert res[0].changed and (tmp_path / "dest" / "tiny" / "sub" / "weights.safetensors").is_file()


def test_a_skipped_instance_keeps_its_folder_as_it_is(tmp_path: Path) -> None:
    """--skip NAME (a running instance whose change is held for `vllm-fleet rollout`): nothing of its folder
    is read or written; the others are fetched as usual."""
    sums = _model(tmp_path / "tiny")
    models = _models(_spec(tmp_path / "tiny", sums), "h1")
    got = fetch_all(models, skip=["m"])
    assert [r.instance for r in got] == ["m2"]
    assert fetch_all(models, skip=["m", "m2"]) == []
