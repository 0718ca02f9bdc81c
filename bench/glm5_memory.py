"""Bytes per rank of GLM-5.3-Flash (transformers' Glm5NextTextConfig defaults, FP8 128 x 128 blocks) at TP / DCP, by
weight part and by cache group: qual's runtime plan and vLLM 0.32's, as qual/runtime/models/glm5/memory.py counts
them; docs/glm5.md quotes it.

    python bench/glm5_memory.py [--as qual|vllm|both] [--tp 4 --dcp 4 --context 32768 --sequences 32 --block-size 16
                                --k 15 --numerics exact] [--gpu-gib 141]
"""

from __future__ import annotations

import argparse

import torch

from qual.options import DEFAULT_NUMERICS, NUMERICS
from qual.runtime.models.glm5.config import parse_glm5_config
from qual.runtime.models.glm5.memory import PLANS, Deployment, memory_plan

FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--as", dest="plans", choices=[*PLANS, "both"], default="both", help="whose allocation")
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--dcp", type=int, default=4)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--sequences", type=int, default=32)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--k", type=int, default=15, help="speculative tokens a step (the profile's)")
    ap.add_argument("--numerics", choices=NUMERICS, default=DEFAULT_NUMERICS, help="qual's plan: the run's numerics")
    ap.add_argument("--gpu-gib", type=float, help="also say whether a rank fits a GPU of this many GiB")
    a = ap.parse_args()
    cfg = parse_glm5_config({"model_type": "glm5_next_text", "quantization_config": FP8}, "defaults + FP8")
    d = Deployment(tp=a.tp, dcp=a.dcp, num_speculative_tokens=a.k, context=a.context, sequences=a.sequences,
                   dtype=torch.bfloat16, block_size=a.block_size, numerics=a.numerics)
    plans = [memory_plan(cfg, d, p) for p in (PLANS if a.plans == "both" else [a.plans])]
    gib = lambda b: f"{b / 2**30:,.2f}"  # noqa: E731
    head = " | ".join(p.plan for p in plans)
    print(f"## Per rank, TP {a.tp} / DCP {a.dcp}, bfloat16, K = {a.k}, {a.sequences} sequences x {a.context} tokens "
          f"(GiB)\n\n| part | {head} |\n|---|{'---:|' * len(plans)}")
    for part in plans[0].weights:
        print(f"| {part} | {' | '.join(gib(p.weights[part]) for p in plans)} |")
    print(f"| **weights** | {' | '.join(f'**{gib(p.weight_bytes)}**' for p in plans)} |")
    for group in plans[0].caches:
        print(f"| `{group}` cache | {' | '.join(gib(p.caches[group]) for p in plans)} |")
    print(f"| **caches** | {' | '.join(f'**{gib(p.cache_bytes)}**' for p in plans)} |")
    print(f"| **total** | {' | '.join(f'**{gib(p.total)}**' for p in plans)} |")
    for p in plans:
        for note in p.notes:
            print(f"\n{p.plan}: {note}")
        if a.gpu_gib:
            verdict = "fits" if p.fits(a.gpu_gib * 2**30) else "does not fit"
            print(f"{p.plan}: {gib(p.total)} GiB a rank {verdict} a {a.gpu_gib:g} GiB GPU (weights and caches; "
                  "activations and CUDA graphs not counted)")


if __name__ == "__main__":
    main()
