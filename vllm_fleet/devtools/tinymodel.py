"""Build a tiny random Qwen3 model and a byte-level BPE tokenizer, offline; and tiny LoRA adapters of it.

Used by tests and the demo: nothing can be downloaded here, and a real engine needs a real model folder.
≈ 230 k parameters (hidden 64, 2 layers, 4 heads, 2 KV heads, head_dim 32 — vLLM's CPU attention needs a head
size of at least 32), ChatML chat template, safetensors weights. Deterministic for a given seed.
An adapter (``build_tiny_adapter``, ``vllm-fleet tiny-adapter``) is a PEFT LoRA folder of rank r over the
model's q, k, v, o, gate, up and down projections, random and small (it changes the output, not much else).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import sysconfig
from pathlib import Path
from typing import Any

VOCAB_SIZE = 2048
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}{%- if part['type'] == 'text' %}{{- part['text'] }}"
    "{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
MARKER = "vllm-fleet-tiny.json"
ADAPTER_MARKER = "vllm-fleet-tiny-adapter.json"
# the projections a tiny adapter adapts (every one vLLM gives a LoRA slot in a Qwen3 layer: the planner's
# vllm_fleet.fleet.modelinfo.LORA_MODULES), by their path in the layer
ADAPTER_MODULES = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
QWEN3_8B_CONFIG_FILE = Path(__file__).parent.parent / "data" / "qwen3-8b-config.json"


def qwen3_8b_config() -> dict[str, object]:
    """Qwen3-8B's ``config.json`` (its shape only, no weights): a fresh copy each call."""
    cfg: dict[str, object] = json.loads(QWEN3_8B_CONFIG_FILE.read_text())
    return cfg


def _training_texts(limit_bytes: int = 3_000_000) -> list[str]:
    """Text that ships with Python itself: the standard library's sources."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts: list[str] = []
    total = 0
    for f in sorted(stdlib.glob("*.py")):
        try:
            t = f.read_text(encoding="utf-8", errors="ignore")
        except OSError:
            continue
        texts.append(t)
        total += len(t)
        if total > limit_bytes:
            break
    return texts


def build_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_texts(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        model_max_length=2048,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))


def build_tiny_model(out: Path, seed: int = 0) -> Path:
    """Write the model folder to ``out`` (skipped when an identical build is already there)."""
    out = Path(out)
    marker = out / MARKER
    want = {"seed": seed, "vocab": VOCAB_SIZE, "version": 2}
    if marker.exists() and json.loads(marker.read_text()) == want and (out / "model.safetensors").exists():
        return out
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out)
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(str(out)))
    torch.manual_seed(seed)
    eos_id = int(AutoTokenizer.from_pretrained(str(out)).convert_tokens_to_ids("<|im_end|>"))  # type: ignore[arg-type]
    cfg = Qwen3Config(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        eos_token_id=eos_id,
        bos_token_id=eos_id,
        dtype="bfloat16",
    )
    model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)  # type: ignore[arg-type]
    model.save_pretrained(str(out), safe_serialization=True)
    for f in out.iterdir():  # readable by the engine's service user
        f.chmod(0o644)
    gen = {"eos_token_id": eos_id, "max_new_tokens": 64, "do_sample": True, "temperature": 1.0}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    marker.write_text(json.dumps(want))
    return out


def adapter_widths(cfg: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(in, out) of each of ``ADAPTER_MODULES`` for a model of config ``cfg`` (its config.json): the widths the
    planner sizes vLLM's LoRA slots with (``vllm_fleet.fleet.modelinfo.lora_widths``)."""
    from vllm_fleet.fleet.modelinfo import LORA_MODULES, facts_from_config, lora_widths

    assert tuple(m.rpartition(".")[2] for m in ADAPTER_MODULES) == LORA_MODULES
    widths = lora_widths(facts_from_config(cfg, None, "config.json"))
    if widths is None:
        raise ValueError("config.json lacks hidden_size, intermediate_size or the attention heads")
    return dict(zip(ADAPTER_MODULES, widths, strict=True))


def write_lora_adapter(
    cfg: dict[str, Any],
    out: Path,
    rank: int,
    seed: int,
    base_name: str,
    scale: float = 0.02,
    device: str = "cpu",
) -> None:
    """Write a random PEFT LoRA adapter of rank ``rank`` for a model of config ``cfg`` to ``out``:
    adapter_model.safetensors (A and B of each of ``ADAPTER_MODULES`` in every layer, normal × ``scale``, bf16,
    drawn from a generator on ``device`` seeded ``seed``) and adapter_config.json (``base_name``: its
    base_model_name_or_path). The tiny adapter and the GPU validation's (tools/gpu-validate/lora.py: on the
    GPU, for a Qwen3-8B-shaped base) are both written here. Imports torch (only when called)."""
    import torch
    from safetensors.torch import save_file

    widths = adapter_widths(cfg)
    gen = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for mod, (n_in, n_out) in widths.items():
            key = f"base_model.model.model.layers.{layer}.{mod}"
            a = torch.randn(rank, n_in, generator=gen, device=device) * scale
            b = torch.randn(n_out, rank, generator=gen, device=device) * scale
            tensors[key + ".lora_A.weight"] = a.to(torch.bfloat16).cpu().contiguous()
            tensors[key + ".lora_B.weight"] = b.to(torch.bfloat16).cpu().contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_name,
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "target_modules": sorted({m.split(".")[1] for m in ADAPTER_MODULES}),
        "modules_to_save": None,
    }
    (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))


def qwen3_weight_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The tensors of a Qwen3 causal LM of config ``cfg`` (its config.json) by the names vLLM's Qwen3 loader reads
    (Hugging Face's ``Qwen3ForCausalLM`` state dict): embeddings, per layer the q/k/v/o projections (biases when
    ``attention_bias``), the q and k norms, the gate/up/down projections and the two layer norms, the final norm
    and ``lm_head`` (none when ``tie_word_embeddings``). Shapes as stored: (out, in) for a projection."""
    h, inter, layers = int(cfg["hidden_size"]), int(cfg["intermediate_size"]), int(cfg["num_hidden_layers"])
    heads, kv = int(cfg["num_attention_heads"]), int(cfg["num_key_value_heads"])
    hd = int(cfg.get("head_dim") or h // heads)
    vocab = int(cfg["vocab_size"])
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h)}
    for i in range(layers):
        p = f"model.layers.{i}."
        attn = {"q_proj": (heads * hd, h), "k_proj": (kv * hd, h), "v_proj": (kv * hd, h)}
        for name, shape in attn.items():
            out[p + f"self_attn.{name}.weight"] = shape
            if cfg.get("attention_bias"):
                out[p + f"self_attn.{name}.bias"] = (shape[0],)
        out[p + "self_attn.o_proj.weight"] = (h, heads * hd)
        out[p + "self_attn.q_norm.weight"] = (hd,)
        out[p + "self_attn.k_norm.weight"] = (hd,)
        out[p + "mlp.gate_proj.weight"] = (inter, h)
        out[p + "mlp.up_proj.weight"] = (inter, h)
        out[p + "mlp.down_proj.weight"] = (h, inter)
        out[p + "input_layernorm.weight"] = (h,)
        out[p + "post_attention_layernorm.weight"] = (h,)
    out["model.norm.weight"] = (h,)
    if not cfg.get("tie_word_embeddings"):
        out["lm_head.weight"] = (vocab, h)
    return out


def weight_shards(shapes: dict[str, tuple[int, ...]], max_bytes: int, itemsize: int = 2) -> list[list[str]]:
    """The tensors of ``shapes`` in order, cut into shards of at most ``max_bytes`` each (a tensor larger than
    that alone in its shard), as ``save_pretrained`` shards a checkpoint."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        n = itemsize * math.prod(shape)
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def write_random_weights(
    cfg: dict[str, Any], out: Path, seed: int = 0, std: float = 0.02, device: str = "cpu",
    max_shard_bytes: int = 4 << 30,
) -> dict[str, Any]:  # fmt: skip
    """Write random bf16 weights of the Qwen3 model of config ``cfg`` to ``out`` as a sharded safetensors
    checkpoint (``model-0000K-of-0000N.safetensors`` + ``model.safetensors.index.json``), the names of
    ``qwen3_weight_shapes``: the norms 1, every other tensor normal × ``std`` (the config's initializer range),
    drawn from a generator on ``device`` seeded ``seed``. Real weights on disk, for what ``--load-format dummy``
    cannot do (a level-2 sleep's wake reloads the weights from the model's files; the GPU validation writes a
    Qwen3-8B-shaped checkpoint on the GPU: tools/gpu-validate/sleep_fleet.py). Imports torch (only when
    called). Returns {"files", "bytes", "tensors"}."""
    import torch
    from safetensors.torch import save_file

    shapes = qwen3_weight_shapes(cfg)
    shards = weight_shards(shapes, max_shard_bytes)
    gen = torch.Generator(device=device).manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    total = 0
    for k, names in enumerate(shards, 1):
        fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name in names:
            if name.endswith("norm.weight"):
                t = torch.ones(shapes[name], dtype=torch.bfloat16)
            else:
                t = torch.randn(shapes[name], generator=gen, device=device, dtype=torch.bfloat16).mul_(std)
            tensors[name] = t.cpu().contiguous()
            weight_map[name] = fname
            total += t.numel() * t.element_size()
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return {"files": len(shards), "bytes": total, "tensors": len(weight_map)}


def build_tiny_adapter(
    base_dir: Path, out: Path, rank: int = 8, seed: int = 1, base_name: str = "tiny-qwen3"
) -> Path:
    """Write a PEFT LoRA adapter of rank ``rank`` for the model in ``base_dir`` to ``out`` (skipped when an
    identical build is already there): ``write_lora_adapter``'s files, readable by the engine's service user.
    ``base_name``: its base_model_name_or_path."""
    base_dir, out = Path(base_dir), Path(out)
    cfg = json.loads((base_dir / "config.json").read_text())
    marker = out / ADAPTER_MARKER
    want = {"rank": rank, "seed": seed, "base": base_name, "widths": sorted(adapter_widths(cfg).items())}
    want = json.loads(json.dumps(want))  # tuples as the marker's JSON holds them
    if (
        marker.exists()
        and json.loads(marker.read_text()) == want
        and (out / "adapter_model.safetensors").exists()
    ):
        return out
    write_lora_adapter(cfg, out, rank, seed, base_name)
    marker.write_text(json.dumps(want))
    for f in out.iterdir():  # readable by the engine's service user
        f.chmod(0o644)
    return out


def add_adapter_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base", required=True, help="the tiny model's folder (vllm-fleet tiny-model --out)")
    p.add_argument("--out", required=True)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--base-name", default="tiny-qwen3", help="its base_model_name_or_path")
    p.set_defaults(handler=_run_adapter)


def _run_adapter(a: argparse.Namespace) -> int:
    print(build_tiny_adapter(Path(a.base), Path(a.out), rank=a.rank, seed=a.seed, base_name=a.base_name))
    return 0


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(handler=_run)


def _run(a: argparse.Namespace) -> int:
    print(build_tiny_model(Path(a.out), seed=a.seed))
    return 0


if __name__ == "__main__":
    print(build_tiny_model(Path(sys.argv[1] if len(sys.argv) > 1 else "tiny-qwen3")))
