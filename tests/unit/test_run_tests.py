"""tools/run_tests.py: every test module runs in exactly one stream of `make test`."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))
import run_tests  # noqa: E402


def test_every_module_in_exactly_one_stream() -> None:
    lanes, phase2 = run_tests.streams(REPO)
    phase1 = [s for lane in lanes for s in lane]
    assert [[s.name for s in lane] for lane in lanes] == [["fleet"], ["engines"], ["unit", "local"]]
    assert [s.name for s in phase2] == ["alone"]
    # the unit tests yield the CPU to the fleet's deploy (the critical path); nothing else is niced
    assert [s.name for s in phase1 + phase2 if s.nice] == ["unit"]
    paths = [p for s in phase1 + phase2 for p in s.paths]
    assert len(paths) == len(set(paths))
    integration = {f"tests/integration/{p.name}" for p in (REPO / "tests/integration").glob("test_*.py")}
    assert set(paths) == integration | {"tests/unit"}
    # the e2e and the modules whose checks need the machine alone are where the docs say
    assert "tests/integration/test_ansible.py" in phase1[0].paths
    assert "tests/integration/test_sandbox.py" in phase2[0].paths
    # the modules that share the session's real engine run in one pytest
    shared = {f"tests/integration/test_{m}.py" for m in ("bench_engine", "engine", "engine_contract")}
    assert shared <= set(phase1[1].paths)


def test_a_stream_naming_a_missing_module_is_refused(tmp_path: Path) -> None:
    (tmp_path / "tests/integration").mkdir(parents=True)
    (tmp_path / "tests/integration/test_ansible.py").write_text("")
    with pytest.raises(SystemExit, match="do not exist"):
        run_tests.streams(tmp_path)


def test_test_paths_run_one_plain_pytest(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[list[str]] = []
    monkeypatch.setattr(run_tests.subprocess, "call", lambda argv, cwd: calls.append(argv) or 0)
    monkeypatch.setattr(run_tests, "run_phases", lambda args: pytest.fail("streams for a path"))
    assert run_tests.main(["-q", "tests/unit/test_spec.py"]) == 0
    assert calls and calls[0][-2:] == ["-q", "tests/unit/test_spec.py"]


def test_test_modules_have_unique_names() -> None:
    """pytest imports test modules by basename (the test folders are not packages): two of one name in one run
    stop the collection (a unit and an integration module once did: the CI's local stream collected nothing)."""
    from collections import Counter

    root = Path(__file__).resolve().parents[1]
    names = Counter(p.name for p in root.rglob("test_*.py"))
    assert [n for n, c in names.items() if c > 1] == []
