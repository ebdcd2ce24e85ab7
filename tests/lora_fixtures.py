"""LoRA fixtures: tiny peft adapters for the tiny model, and the environment an engine needs for vllm-fleet's LoRA
resolver (its ``vllm.general_plugins`` entry point).

``build_tiny_adapter`` is a private copy of the builder the spec side adds to vllm_fleet/devtools/tinymodel.py
(same logic: random A/B of rank r for q, k, v, o, gate, up and down of every layer, peft format); use that one
once it is there.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
from pathlib import Path

import pytest

from vllm_fleet.contracts import ADAPTERS_FILE_ENV

RESOLVER_ENTRY = "vllm_fleet.host.lora_resolver:register"


def build_tiny_adapter(
    base: Path, out: Path, rank: int = 8, seed: int = 1, base_name: str = "tiny-qwen3"
) -> Path:
    """A peft LoRA adapter of rank ``rank`` for the tiny model at ``base`` (its config.json gives the shapes)."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((base / "config.json").read_text())
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    dims = {"self_attn.q_proj": (h, q), "self_attn.k_proj": (h, kv), "self_attn.v_proj": (h, kv),
            "self_attn.o_proj": (q, h), "mlp.gate_proj": (h, inter), "mlp.up_proj": (h, inter),
            "mlp.down_proj": (inter, h)}  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    t = {}
    for layer in range(cfg["num_hidden_layers"]):
        for mod, (i, o) in dims.items():
            p = f"base_model.model.model.layers.{layer}.{mod}"
            t[p + ".lora_A.weight"] = (
                (torch.randn(rank, i, generator=g) * 0.02).to(torch.bfloat16).contiguous()
            )
            t[p + ".lora_B.weight"] = (
                (torch.randn(o, rank, generator=g) * 0.02).to(torch.bfloat16).contiguous()
            )
    out.mkdir(parents=True, exist_ok=True)
    save_file(t, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_name, "r": rank,
        "lora_alpha": 2 * rank, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
        "target_modules": sorted({m.split(".")[1] for m in dims}), "modules_to_save": None}, indent=2))  # fmt: skip
    return out


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
    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1", ADAPTERS_FILE_ENV: str(adapters_file)}
    found = importlib.metadata.entry_points(group="vllm.general_plugins")
    if any(e.value == RESOLVER_ENTRY for e in found):
        return env
    dist = workdir / "entry-points" / "vllm_fleet_lora_resolver_shim-0.0.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: vllm-fleet-lora-resolver-shim\nVersion: 0.0\n"
    )
    (dist / "entry_points.txt").write_text(
        f"[vllm.general_plugins]\nvllm_fleet_adapters = {RESOLVER_ENTRY}\n"
    )
    extra = os.environ.get("PYTHONPATH", "")
    env["PYTHONPATH"] = str(dist.parent) + (os.pathsep + extra if extra else "")
    return env
