"""Model architecture facts for the planner: parameter count, layers, KV heads, head size.

Read from a local ``config.json`` (and ``model.safetensors.index.json`` / ``*.safetensors`` headers when
present: the weights' real bytes, so AWQ/GPTQ/FP8 checkpoints count at their size on disk), else from the
spec's ``shape`` block. A local copy is looked up under each ``--models-dir`` as ``DIR/NAME``,
``DIR/ORG--REPO`` or the Hugging Face cache layout ``DIR/models--ORG--REPO/snapshots/REV/`` (also under
``DIR/hub/``), REV the pinned commit or the commit ``refs/REV`` names.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from vllm_fleet.files import safetensors_bytes

# the spec's types in annotations only: the facts and the LoRA widths load without pydantic (devtools.tinymodel
# on a GPU box, tools/gpu-validate/lora.py)
if TYPE_CHECKING:
    from vllm_fleet.fleet.spec import ModelInstance

DTYPE_BYTES = {
    "float32": 4.0,
    "float": 4.0,
    "bfloat16": 2.0,
    "float16": 2.0,
    "half": 2.0,
    "fp8": 1.0,
    "int8": 1.0,
    "int4": 0.5,
}
QUANT_WEIGHT_BYTES = {
    "fp8": 1.0,
    "awq": 0.5,
    "awq_marlin": 0.5,
    "gptq": 0.5,
    "gptq_marlin": 0.5,
    "bitsandbytes": 0.5,
    "compressed-tensors": 1.0,
}


@dataclass
class ModelFacts:
    params: int | None = None
    weight_bytes_on_disk: int | None = None
    num_layers: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    max_position_embeddings: int | None = None
    torch_dtype: str | None = None
    quant_method: str | None = None  # config.json quantization_config.quant_method (fp8, awq, gptq, ...)
    source: str = "spec"  # where the facts came from
    # the projections' widths, for the LoRA slots' size (config.json only; ``shape`` has none of them)
    hidden_size: int | None = None
    intermediate_size: int | None = None
    num_attention_heads: int | None = None
    vocab_size: int | None = None

    def missing(self) -> list[str]:
        need = {
            "params": self.params,
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
        }
        return [k for k, v in need.items() if v is None]


def params_from_config(cfg: dict) -> int | None:
    """Estimate the parameter count of a decoder-only transformer from its config.json."""
    try:
        h = int(cfg["hidden_size"])
        n_layers = int(cfg["num_hidden_layers"])
        vocab = int(cfg["vocab_size"])
        inter = int(cfg.get("intermediate_size") or 4 * h)
        n_heads = int(cfg["num_attention_heads"])
        n_kv = int(cfg.get("num_key_value_heads") or n_heads)
        head_dim = int(cfg.get("head_dim") or h // n_heads)
    except (KeyError, TypeError, ValueError):
        return None
    attn = h * n_heads * head_dim + 2 * h * n_kv * head_dim + n_heads * head_dim * h
    if cfg.get("attention_bias"):
        attn += n_heads * head_dim + 2 * n_kv * head_dim
    n_experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    if n_experts:
        moe_inter = int(cfg.get("moe_intermediate_size") or inter)
        mlp = n_experts * 3 * h * moe_inter + h * n_experts
    else:
        mlp = 3 * h * inter
    norms = 2 * h + (2 * head_dim if cfg.get("model_type", "").startswith("qwen3") else 0)
    per_layer = attn + mlp + norms
    embed = vocab * h
    lm_head = 0 if cfg.get("tie_word_embeddings") else vocab * h
    return n_layers * per_layer + embed + lm_head + h


def read_model_dir(model_dir: Path) -> ModelFacts | None:
    cfg_path = model_dir / "config.json"
    if not cfg_path.is_file():
        return None
    return facts_from_config(json.loads(cfg_path.read_text()), safetensors_bytes(model_dir), str(cfg_path))


def facts_from_config(cfg: dict, weight_bytes_on_disk: int | None, source: str) -> ModelFacts:
    """Facts of a model from its config.json (``cfg``) and the bytes of its weights on disk."""
    text_cfg = cfg.get("text_config", cfg)
    n_heads = text_cfg.get("num_attention_heads")
    head_dim = text_cfg.get("head_dim") or (
        text_cfg["hidden_size"] // n_heads if n_heads and "hidden_size" in text_cfg else None
    )
    return ModelFacts(
        params=params_from_config(text_cfg),
        weight_bytes_on_disk=weight_bytes_on_disk,
        num_layers=text_cfg.get("num_hidden_layers"),
        num_kv_heads=text_cfg.get("num_key_value_heads") or n_heads,
        head_dim=head_dim,
        max_position_embeddings=text_cfg.get("max_position_embeddings"),
        torch_dtype=text_cfg.get("torch_dtype") or text_cfg.get("dtype") or cfg.get("torch_dtype"),
        quant_method=_quant_method(cfg),
        source=source,
        hidden_size=text_cfg.get("hidden_size"),
        intermediate_size=text_cfg.get("intermediate_size"),
        num_attention_heads=n_heads,
        vocab_size=text_cfg.get("vocab_size"),
    )


def _quant_method(cfg: dict) -> str | None:
    q = cfg.get("quantization_config") or cfg.get("text_config", {}).get("quantization_config")
    method = q.get("quant_method") if isinstance(q, dict) else None
    return str(method).lower() if method else None


def hf_cache_dirs(base: Path, repo: str, revision: str) -> list[Path]:
    """Snapshot folders of ``repo`` at ``revision`` in a Hugging Face cache rooted at ``base`` (or ``base/hub``)."""
    if not repo:
        return []
    out: list[Path] = []
    for root in (base, base / "hub"):
        cache = root / ("models--" + repo.replace("/", "--"))
        if not cache.is_dir():
            continue
        ref = cache / "refs" / revision
        commit = ref.read_text().strip() if revision and ref.is_file() else revision
        if commit:
            out.append(cache / "snapshots" / commit)
    return out


def facts_for(model: ModelInstance, search_dirs: list[Path], found: ModelFacts | None = None) -> ModelFacts:
    """Facts from a local copy of the model when one is found (or ``found``: read where it was fetched),
    completed by the spec's ``shape``."""
    candidates: list[Path] = []
    if model.source.path:
        candidates.append(Path(model.source.path))
    for d in search_dirs:
        candidates.append(d / model.name)
        if model.source.repo:
            candidates.append(d / model.source.repo.replace("/", "--"))
            candidates += hf_cache_dirs(d, model.source.repo, model.source.revision)
    facts = found
    for c in candidates if facts is None else []:
        facts = read_model_dir(c)
        if facts:
            break
    facts = facts or ModelFacts()
    s = model.shape
    if s.params_b is not None:
        facts.params = int(s.params_b * 1e9)
    facts.num_layers = s.num_layers or facts.num_layers
    facts.num_kv_heads = s.num_kv_heads or facts.num_kv_heads
    facts.head_dim = s.head_dim or facts.head_dim
    facts.max_position_embeddings = s.max_position_embeddings or facts.max_position_embeddings
    return facts


def weight_bytes(model: ModelInstance, facts: ModelFacts) -> int:
    """The weights' bytes in GPU memory: the checkpoint's size on disk when known (a quantised checkpoint is
    stored at its real width), else parameters × the width of the dtype / quantisation."""
    if facts.weight_bytes_on_disk and not (model.quantization and not facts.quant_method):
        return facts.weight_bytes_on_disk
    assert facts.params is not None
    return int(facts.params * weight_dtype_bytes(model, facts))


def weight_dtype_bytes(model: ModelInstance, facts: ModelFacts) -> float:
    if model.quantization:
        return QUANT_WEIGHT_BYTES[model.quantization]
    if facts.quant_method in QUANT_WEIGHT_BYTES:
        return QUANT_WEIGHT_BYTES[facts.quant_method]
    dtype: str = model.dtype
    if dtype == "auto":
        dtype = facts.torch_dtype or "bfloat16"
    return DTYPE_BYTES.get(dtype, 2.0)


def kv_dtype_bytes(model: ModelInstance, facts: ModelFacts) -> float:
    if model.kv_cache_dtype.startswith("fp8"):
        return 1.0
    dtype: str = model.dtype
    if dtype == "auto":
        dtype = facts.torch_dtype or "bfloat16"
    b = DTYPE_BYTES.get(dtype, 2.0)
    return 2.0 if b < 2 else b


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: float) -> int:
    """K and V for every layer: 2 × layers × KV heads × head_dim × bytes."""
    return int(2 * num_layers * num_kv_heads * head_dim * dtype_bytes)


# the modules a LoRA adapter of a decoder layer adapts, each (input width, output width) by the model's shape:
# what vLLM allocates a slot for in every layer (q, k, v, o of the attention; gate, up, down of the MLP)
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_widths(facts: ModelFacts) -> list[tuple[int, int]] | None:
    """(in, out) of each of ``LORA_MODULES`` in one layer; None when the shape is not known (no config.json)."""
    h, inter, heads = facts.hidden_size, facts.intermediate_size, facts.num_attention_heads
    if not (h and inter and heads and facts.num_kv_heads and facts.head_dim):
        return None
    q, kv = heads * facts.head_dim, facts.num_kv_heads * facts.head_dim
    return [(h, q), (h, kv), (h, kv), (q, h), (h, inter), (h, inter), (inter, h)]


def lora_dtype_bytes(model: ModelInstance, facts: ModelFacts) -> float:
    """The width of a LoRA slot's numbers: the model's dtype (vLLM's --lora-dtype auto), 16 bits for a
    quantised checkpoint (its activations' dtype)."""
    dtype: str = model.dtype
    if dtype == "auto":
        dtype = facts.torch_dtype or "bfloat16"
    b = DTYPE_BYTES.get(dtype, 2.0)
    return 2.0 if b < 2 else b


def lora_bytes(model: ModelInstance, facts: ModelFacts, max_loras: int, max_lora_rank: int) -> int | None:
    """The memory vLLM allocates for LoRA: ``max_loras`` slots of ``max_lora_rank`` in every layer, A (rank ×
    in) and B (out × rank) of each adapted module, and in the token embedding and the LM head (vocab + hidden
    each), in the LoRA dtype; None when the shape is not known. Dense projections only (a mixture-of-experts
    model's experts are not counted). On the H200 (vLLM 0.21.0, Qwen3-8B's shape) the weights vLLM reported
    grew by 0.73 GiB for 8 slots of rank 16 and 2.90 GiB for 32 (this: 0.72, 2.90); LoRA's second set of
    CUDA graphs (~0.17 GiB there) is not counted (docs/perf/lora.md)."""
    widths = lora_widths(facts)
    if widths is None or not facts.num_layers:
        return None
    per_layer = sum(i + o for i, o in widths)
    vocab = 2 * (facts.vocab_size + (facts.hidden_size or 0)) if facts.vocab_size else 0
    per_rank = facts.num_layers * per_layer + vocab
    return int(max_loras * max_lora_rank * per_rank * lora_dtype_bytes(model, facts))
