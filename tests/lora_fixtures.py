"""LoRA fixtures: tiny peft adapters for the tiny model (``vllm_fleet.devtools.tinymodel.build_tiny_adapter``), an
instance's adapters file, and the environment an engine needs for vllm-fleet's LoRA resolver (its
``vllm.general_plugins`` entry point)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from vllm_fleet.contracts import ADAPTERS_FILE_ENV, RUNTIME_LORA_ENV
from vllm_fleet.devtools.testing import resolver_pythonpath
from vllm_fleet.devtools.tinymodel import build_tiny_adapter


@pytest.fixture(scope="session")
def tiny_adapters(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Adapters of the tiny model: ``ad-a``, ``ad-b``, ``ad-c`` (rank 8, each its own weights) and ``ad-big``
    (rank 16: above a ``--max-lora-rank 8``)."""
    root = tmp_path_factory.mktemp("adapters")
    ranks = {"ad-a": 8, "ad-b": 8, "ad-c": 8, "ad-big": 16}
    return {
        n: build_tiny_adapter(tiny_model, root / n, r, seed) for seed, (n, r) in enumerate(ranks.items(), 1)
    }


def write_adapters_file(
    path: Path, instance: str, model: str, adapters: dict[str, tuple[Path, bool]]
) -> Path:
    """An instance's adapters file (``vllm_fleet.contracts.AdaptersFile``) as the render writes it: name →
    (folder, carried); the rank is read from each adapter's config."""
    rows = [
        {
            "name": n,
            "path": str(p),
            "rank": json.loads((p / "adapter_config.json").read_text())["r"],
            "carry": c,
        }
        for n, (p, c) in adapters.items()
    ]
    path.write_text(json.dumps({"schema": 1, "instance": instance, "model": model, "adapters": rows}))
    return path


def lora_engine_env(adapters_file: Path, workdir: Path) -> dict[str, str]:
    """What a LoRA instance's engine gets (the render's environment) plus, when this Python's installed
    vllm-fleet does not declare the resolver's entry point yet (an editable install older than it), a
    distribution of its own on ``PYTHONPATH`` that declares it, so vLLM finds vllm-fleet's resolver."""
    env = {RUNTIME_LORA_ENV: "1", ADAPTERS_FILE_ENV: str(adapters_file)}
    shim, _ = resolver_pythonpath(workdir)
    if shim is not None:
        extra = os.environ.get("PYTHONPATH", "")
        env["PYTHONPATH"] = shim + (os.pathsep + extra if extra else "")
    return env
