"""Decode step time of a toy pair with each DCP merge path, and how far each DCP size's logits are from DCP 1's:
what the invariant merge (dcp_comm invariant) costs and what it buys.

    python3 bench/dcp_invariant.py [--model toy] [--layouts 1x1,4x1,4x4] [--comms a2a,invariant] [--requests 16]
                                   [--batch 8] [--generates 3] [--device cpu] [--threads 1]

--model: a shipped pair (qual/data/models/<name>: toy, glm-toy). Each layout is TPxDCP. The first --requests
HumanEval prompts, 64 new tokens each, at most --batch in flight, greedy, float32, speculative (the pair's drafter
with its profile's K); on CUDA, decode replayed from CUDA graphs (each rank on its own GPU). A decode step's time is the generate's wall time less its
prefill steps, over its decode steps (rank 0's phase times); its CPU time is rank 0's process time over the whole
generate (prefill included), over the same steps: on a shared machine the steadier of the two, and at TP 1 all of
the engine's work. Each is the best of --generates generates on one engine. "vs a2a": the row's cost over a2a's at
the same layout. "max |logit - DCP 1|": the largest difference of the prompts' last-position logits from those of
DCP 1 at the same TP and merge path (where the layouts hold that row).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from qual.corpus import load_corpus
from qual.paths import DATA_DIR
from qual.profiles import load_profile
from qual.runtime.config import DEFAULT_SIZES, CacheConfig, EngineConfig, ParallelConfig, SamplingParams
from qual.runtime.engine import GenerationRequest, LLMEngine
from qual.tokenize import PromptTokenizer


def humaneval_requests(pair: Path, n: int) -> list[GenerationRequest]:
    """The first n HumanEval prompts in the pair's tokens, 64 new tokens each."""
    tok = PromptTokenizer(str(pair / "target"))
    return [GenerationRequest(r.id, tuple(tok.encode(r.prompt)), 64) for r in load_corpus("humaneval").requests[:n]]


def measure(tp: int, dcp: int, comm: str, reqs, args) -> dict:
    """One engine: best ms and rank-0 CPU ms per decode step, decode steps, tokens, prompt logits."""
    longest = max(len(r.prompt_token_ids) for r in reqs)
    pair = DATA_DIR / "models" / args.model
    cfg = EngineConfig(str(pair / "target"), str(pair / "draft"), ParallelConfig(tp, dcp, 1, comm),
                       CacheConfig(block_size=16, memory_bytes=1 << 28), dtype="float32", device=args.device,
                       max_model_len=longest + 64 + 32, phase_times=True, max_num_seqs=args.batch,
                       threads_per_rank=args.threads or None,
                       num_speculative_tokens=load_profile(args.model).num_speculative_tokens,
                       cuda_graph_sizes=DEFAULT_SIZES if args.device.startswith("cuda") else None)
    best, best_cpu = float("inf"), float("inf")
    with LLMEngine(cfg) as engine:
        for _ in range(args.generates):
            cpu = time.process_time()
            out = engine.generate(reqs, SamplingParams(max_tokens=64))
            cpu = time.process_time() - cpu
            times = engine.phase_times()
            steps = times["decode_steps"]
            best = min(best, 1e3 * (times["wall_s"] - times["seconds"]["prefill"]) / steps)
            best_cpu = min(best_cpu, 1e3 * cpu / steps)
        logits = engine.prompt_logits([list(r.prompt_token_ids) for r in reqs]).double()
    return {"ms": best, "cpu": best_cpu, "steps": steps, "tokens": [r.output_token_ids for r in out],
            "logits": logits}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="toy", help="a shipped pair: toy or glm-toy")
    ap.add_argument("--layouts", default="1x1,4x1,4x4", help="TPxDCP, comma-separated")
    ap.add_argument("--comms", default="a2a,invariant")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--generates", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank (0: the cores over the ranks)")
    args = ap.parse_args()
    reqs = humaneval_requests(DATA_DIR / "models" / args.model, args.requests)
    print("| TP | DCP | dcp_comm | ms per decode step | vs a2a | rank 0 CPU ms per step | vs a2a | decode steps "
          "| same tokens as a2a | max \\|logit - DCP 1\\| |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    rows = {}
    for layout in args.layouts.split(","):
        tp, dcp = (int(x) for x in layout.split("x"))
        for comm in args.comms.split(","):
            rows[tp, dcp, comm] = row = measure(tp, dcp, comm, reqs, args)
            base, one = rows.get((tp, dcp, "a2a")), rows.get((tp, 1, comm))
            vs = lambda key: f"{100 * (row[key] / base[key] - 1):+.1f}%" if base else "n/a"  # noqa: E731
            same = "n/a" if base is None else ("yes" if row["tokens"] == base["tokens"] else "no")
            gap = "n/a" if one is None else f"{float((row['logits'] - one['logits']).abs().max()):.2e}"
            print(f"| {tp} | {dcp} | {comm} | {row['ms']:.1f} | {vs('ms')} | {row['cpu']:.1f} | {vs('cpu')} "
                  f"| {row['steps']} | {same} | {gap} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
