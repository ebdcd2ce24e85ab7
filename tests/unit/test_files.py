"""vllm_fleet/files.py: the atomic JSON writer every host state file goes through."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from vllm_fleet.files import write_json_atomic


def test_write_json_atomic_replaces_the_file_readable_whatever_the_umask(tmp_path: Path) -> None:
    path = tmp_path / "st.json"
    path.write_text("old")
    old = os.umask(0o077)  # the units' UMask: the exporter (another user) must read the file all the same
    try:
        write_json_atomic(path, {"b": 1, "a": [2]})
    finally:
        os.umask(old)
    assert path.read_text() == '{"a": [2], "b": 1}\n'
    assert path.stat().st_mode & 0o777 == 0o644
    assert [p.name for p in tmp_path.iterdir()] == ["st.json"]  # no temp file left
    write_json_atomic(path, {"x": None}, mode=0o600)
    assert json.loads(path.read_text()) == {"x": None} and path.stat().st_mode & 0o777 == 0o600


def test_write_json_atomic_leaves_the_old_file_and_no_temp_file_when_it_fails(tmp_path: Path) -> None:
    path = tmp_path / "st.json"
    path.write_text('{"old": 1}\n')
    with pytest.raises(TypeError):
        write_json_atomic(path, {"not json": object()})
    with pytest.raises(OSError):
        write_json_atomic(tmp_path / "missing" / "st.json", {})  # the folder must exist
    assert path.read_text() == '{"old": 1}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["st.json"]
