"""Write a Qwen3-8B-shaped model folder for ``vllm serve --load-format dummy`` (no weights), offline.

config.json has Qwen3-8B's shape (hidden 4096, 36 layers, 32 heads, 8 KV heads, head_dim 128, intermediate
12288, vocab 151936, 40960 positions, bf16). The tokenizer is vllm-fleet's tiny byte-level BPE (trained on
Python's own sources), its vocabulary padded with filler tokens up to the model's 151936 entries: a dummy-weight
model samples any id, and every id must detokenize. Fillers are made of byte-level alphabet letters, reachable
only by id (no merge produces them), so encoding is unchanged.

Usage: python tools/gpu-validate/make_model.py OUT_DIR
"""

from __future__ import annotations

import itertools
import json
import string
import sys
from pathlib import Path


def params(cfg: dict[str, object]) -> int:
    """Parameter count of the shape (what --load-format dummy allocates)."""
    h, i, n = int(cfg["hidden_size"]), int(cfg["intermediate_size"]), int(cfg["num_hidden_layers"])  # type: ignore[call-overload]
    heads, kv, hd = int(cfg["num_attention_heads"]), int(cfg["num_key_value_heads"]), int(cfg["head_dim"])  # type: ignore[call-overload]
    v = int(cfg["vocab_size"])  # type: ignore[call-overload]
    attn = h * heads * hd + 2 * h * kv * hd + heads * hd * h + 2 * hd  # q, k, v, o, q/k norms
    mlp = 3 * h * i
    per_layer = attn + mlp + 2 * h
    return n * per_layer + 2 * v * h + h  # + embed, lm_head, final norm


def _fillers(existing: set[str], count: int) -> list[str]:
    out: list[str] = []
    for length in itertools.count(3):
        for combo in itertools.product(string.ascii_lowercase, repeat=length):
            tok = "Ġ" + "".join(combo)
            if tok not in existing:
                out.append(tok)
                if len(out) == count:
                    return out
    return out  # pragma: no cover


def pad_tokenizer(folder: Path, vocab_size: int) -> int:
    tj = folder / "tokenizer.json"
    data = json.loads(tj.read_text())
    vocab: dict[str, int] = data["model"]["vocab"]
    added = {t["content"]: t["id"] for t in data.get("added_tokens", [])}
    used = set(vocab) | set(added)
    next_id = max(list(vocab.values()) + list(added.values())) + 1
    need = vocab_size - next_id
    for k, tok in enumerate(_fillers(used, need)):
        vocab[tok] = next_id + k
    tj.write_text(json.dumps(data, ensure_ascii=False))
    return next_id + max(need, 0)


def make(out: Path) -> Path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from vllm_fleet.devtools.tinymodel import build_tokenizer, qwen3_8b_config

    qwen3_8b = qwen3_8b_config()
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out)
    size = pad_tokenizer(out, int(qwen3_8b["vocab_size"]))  # type: ignore[call-overload]
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    vocab = json.loads((out / "tokenizer.json").read_text())
    ids = {t["content"]: t["id"] for t in vocab["added_tokens"]}
    cfg = dict(qwen3_8b, bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"])
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    gen = {"eos_token_id": ids["<|im_end|>"], "do_sample": True, "temperature": 1.0}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    n = params(cfg)
    (out / "vllm-fleet-gpu-validate.json").write_text(
        json.dumps(
            {
                "params": n,
                "weight_bytes_bf16": 2 * n,
                "tokenizer_size": size,
                "tokenizer_class": tok_cfg.get("tokenizer_class"),
            },
            indent=2,
        )
    )
    return out


if __name__ == "__main__":
    d = make(Path(sys.argv[1] if len(sys.argv) > 1 else "qwen3-8b-shape"))
    print(d, (d / "vllm-fleet-gpu-validate.json").read_text())
