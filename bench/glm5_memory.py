"""Bytes per rank of GLM-5.3-Flash (transformers' Glm5NextTextConfig defaults) at TP / DCP, by weight part and by
cache group, counted by the runtime's sizing code (qual/runtime/models/glm5/sizing.py); docs/glm5.md quotes it.

    python bench/glm5_memory.py [--tp 4 --dcp 4 --context 32768 --sequences 32 --block-size 16 --k 15]
"""

from __future__ import annotations

import argparse

import torch

from qual.runtime.models.glm5.config import parse_glm5_config
from qual.runtime.models.glm5.sizing import cache_bytes, weight_bytes

FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--dcp", type=int, default=4)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--sequences", type=int, default=32)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--k", type=int, default=15, help="speculative tokens a step (the profile's)")
    a = ap.parse_args()
    fp8 = parse_glm5_config({"model_type": "glm5_next_text", "quantization_config": FP8}, "defaults + FP8")
    bf16 = parse_glm5_config({"model_type": "glm5_next_text"}, "defaults")
    w8, w16 = weight_bytes(fp8, a.tp, torch.bfloat16), weight_bytes(bf16, a.tp, torch.bfloat16)
    gib = lambda b: f"{b / 2**30:,.2f}"  # noqa: E731
    print(f"## Weights per rank, TP {a.tp}, bfloat16 (GiB)\n\n| part | FP8 experts | bfloat16 experts |\n|---|---:|---:|")
    for part in w8:
        print(f"| {part} | {gib(w8[part])} | {gib(w16[part])} |")
    print(f"\n## Caches per rank, TP {a.tp} / DCP {a.dcp}, {a.sequences} sequences x {a.context} tokens, K = {a.k}, "
          f"blocks of {a.block_size} (GiB)\n\n| group | GiB |\n|---|---:|")
    for dcp in sorted({1, a.dcp}):
        c = cache_bytes(fp8, a.tp, dcp, torch.bfloat16, a.k, a.context, a.sequences, a.block_size)
        for group, b in c.items():
            print(f"| {group} (DCP {dcp}) | {gib(b)} |")
    c = cache_bytes(fp8, a.tp, a.dcp, torch.bfloat16, a.k, a.context, a.sequences, a.block_size)
    print(f"\nFP8 weights + caches at DCP {a.dcp}: {gib(w8['total'] + c['total'])} GiB a rank")


if __name__ == "__main__":
    main()
