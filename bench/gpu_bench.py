"""GPU benchmark: decode tokens/s vs transformers, HBM roofline, speculative speedup, KV bytes per rank.

    python3 bench/gpu_bench.py [--out bench.json] [--backends pytorch,compiled+triton-gemm+triton-attention,...]
                               [--models qwen3-0.6b-shape,toy] [--batches 1,8] [--no-spec] [--prompt-tokens N]
                               [--max-model-len N] [--kernels] [--steps-per-launch 1,4]

Backends are the runtime's (qual/runtime/backends): pytorch, or parts joined by "+" (compiled,
compiled-autotune, triton-gemm, triton-attention, fused).

Run on the device machine (CUDA). Prints a table last; writes every number to --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from qual.checkpoints.qwen3 import Qwen3Config, random_target_weights, write_qwen3
from qual.paths import DATA_DIR
from qual.runtime.backends import PYTORCH, parse_backend
from qual.runtime.config import CacheConfig, EngineConfig, ParallelConfig, SamplingParams
from qual.runtime.engine import GenerationRequest, LLMEngine

QWEN3_0_6B = Qwen3Config(vocab_size=151936, hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                         num_key_value_heads=8, head_dim=128, intermediate_size=3072, tie_word_embeddings=True,
                         eos_token_id=151645)
TOY = DATA_DIR / "models" / "toy"


def humaneval_requests(n: int, new_tokens: int = 64) -> list[GenerationRequest]:
    """The first n HumanEval prompts in the toy pair's tokens, new_tokens each."""
    from qual.corpus import load_corpus
    from qual.tokenize import PromptTokenizer

    tok = PromptTokenizer(str(TOY / "target"))
    return [GenerationRequest(r.id, tuple(tok.encode(r.prompt)), new_tokens) for r in load_corpus("humaneval").requests[:n]]


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (median of 20)."""
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    b = torch.empty_like(a)
    times = []
    for _ in range(22):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return 2 * n / sorted(times[2:])[len(times[2:]) // 2]


def restoring_replay(graph):
    """A function that replays a captured decode graph from the inputs it holds now. Each replay advances the
    graph's own inputs (async decode), so they are put back before every replay (a copy of a few hundred bytes):
    otherwise the positions would run past the cache's width."""
    kept = [(t, t.clone()) for t in (graph.flat, graph.feats) if t is not None]

    def replay():
        for t, saved in kept:
            t.copy_(saved)
        graph.replay(1)

    return replay


def replay_seconds(graph, n: int = 50) -> float:
    """Seconds per replay of a captured decode graph: the mean of n back-to-back replays after 3 warm-ups, the
    restore of its inputs timed with each (restoring_replay)."""
    replay = restoring_replay(graph)
    for _ in range(3):
        replay()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(n):
        replay()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) / 1e3 / n


def kernel_table(graph, replays: int = 10, top: int = 12) -> dict:
    """What one replay of a captured decode graph runs on the device (CUPTI through torch.profiler, over `replays`
    replays, inputs restored before each: restoring_replay): kernels a step, kernel time a step, and the `top` kernels by
    time, each with its microseconds and launches a step. Compiled steps' fusion varies between compiles, so a step
    time alone does not say which kernels moved."""
    from torch.profiler import ProfilerActivity, profile

    replay = restoring_replay(graph)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            replay()
        torch.cuda.synchronize()
    time_us, launches = {}, {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and not ev.name.startswith("Memcpy"):  # not the restores
            name = ev.name[:100]
            time_us[name] = time_us.get(name, 0.0) + ev.device_time_total / replays
            launches[name] = launches.get(name, 0) + 1 / replays
    ranked = sorted(time_us, key=time_us.get, reverse=True)[:top]
    return {"kernels_per_step": round(sum(launches.values())), "kernel_us_per_step": round(sum(time_us.values()), 1),
            "top": [{"kernel": k, "us": round(time_us[k], 1), "launches": round(launches[k], 1)} for k in ranked]}


def random_qwen3(path: Path, cfg: Qwen3Config) -> Path:
    """A random-init Qwen3 checkpoint of the given shape (bf16, small weights), HF format."""
    w = random_target_weights(cfg, seed=0, scale=0.02)
    w["model.embed_tokens.weight"] *= 0.02
    return write_qwen3(path, cfg, w, dtype=torch.bfloat16)


def weight_bytes_read(target, rows: int) -> int:
    """Weight bytes one decode step of `rows` tokens reads: every layer, the final norm and the LM head in
    full, but only `rows` rows of the embedding table (counting the whole table, tied to the
    LM head, a second time would overstate the 0.6B shape's roofline by ~26%)."""
    t = target
    n = t.lm_head.numel() + t.norm.numel() + rows * t.embed.shape[1]
    for layer in t.layers:
        a, m = layer.attn, layer.mlp
        n += sum(x.numel() for x in (a.qkv, a.o, a.qk_norm, m.gate_up, m.down, layer.input_norm, layer.post_norm))
    return n * t.embed.element_size()


def ours(target: Path, draft: Path | None, batch: int, prompt_len: int, new_tokens: int, sizes=(1, 8), prompts=None,
         max_model_len: int | None = None, kernels: bool = False,
         **engine_kw):
    # 16 GiB of KV: 8 rows of 4k tokens of the 0.6B shape take 3.7 GB
    cfg = EngineConfig(str(target), str(draft) if draft else None, ParallelConfig(1, 1, 1),
                       CacheConfig(block_size=16, memory_bytes=16 << 30), dtype="bfloat16", device="cuda",
                       cuda_graph_sizes=sizes, max_model_len=max_model_len or prompt_len + new_tokens + 32,
                       phase_times=True, **engine_kw)
    t_init = time.perf_counter()
    g = torch.Generator().manual_seed(1)
    with LLMEngine(cfg) as engine:
        init_s = time.perf_counter() - t_init  # includes compilation and graph capture
        vocab = engine.target_cfg.vocab_size
        reqs = prompts or [GenerationRequest(f"r{i}", tuple(torch.randint(0, vocab - 2, (prompt_len,), generator=g).tolist()), new_tokens)
                           for i in range(batch)]
        sp = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
        engine.generate(reqs, sp)  # warm-up
        ahead = engine.steps_ahead
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = engine.generate(reqs, sp)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
        phases = engine.phase_times()
        phases["steps_ahead"] = engine.steps_ahead - ahead  # async decode: launched before the last step was read
        phases["launches"] = engine.decode_record()["launches"]  # over both generates
        rec = engine.graph_capture()
        graphs = engine.runner.graphs
        step_s = replay_seconds(graphs.graphs[batch]) if graphs and batch in graphs.graphs else None
        table = kernel_table(graphs.graphs[batch]) if kernels and step_s else None
        wbytes = weight_bytes_read(engine.runner.target, batch)
        # Keys of the longest context in this run: not the graphs' static key width (max_model_len), whose padding a
        # kernel may read but need not; reading it costs time and earns no roofline credit
        kv_keys = min(engine.runner.caches.key_width["target"], prompt_len + new_tokens)
        tc = engine.target_cfg
        kv_bytes = batch * kv_keys * tc.num_hidden_layers * 2 * tc.num_key_value_heads * tc.head_dim * 2
    tokens = sum(len(r.output_token_ids) for r in out)
    acc = sum(r.accepted_tokens for r in out) / max(1, sum(r.draft_tokens for r in out)) if draft else None
    # The bound: tokens a decode step commits (over the whole run, prefill's first tokens excluded) per graph step
    per_step = (tokens - len(out)) / max(1, phases["decode_steps"])
    bound = per_step / step_s if step_s else None
    return {"tokens_per_s": tokens / wall, "bound_tokens_per_s": bound, "tokens_per_decode_step": per_step,
            "phase_times": phases, "wall_s": wall, "init_s": init_s, "graph_step_s": step_s, "weight_bytes_read": wbytes,
            "kv_bytes_read_per_step": kv_bytes, "graph": {k: rec.get(k) for k in ("status", "sizes", "seconds", "bytes", "prefill")},
            "acceptance_rate": acc, "kernel_table": table}


def hf(target: Path, batch: int, prompt_len: int, new_tokens: int):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.bfloat16).cuda().eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size - 2, (batch, prompt_len), generator=g).cuda()
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, attention_mask=torch.ones_like(ids), pad_token_id=0)
    with torch.no_grad():
        model.generate(ids, **kw)
        torch.cuda.synchronize()
        t = time.perf_counter()
        model.generate(ids, **kw)
        torch.cuda.synchronize()
    wall = time.perf_counter() - t
    del model
    torch.cuda.empty_cache()
    return {"tokens_per_s": batch * new_tokens / wall, "wall_s": wall}


def kv_per_rank(target: Path, prompt_len: int = 1536) -> dict:
    """Target KV bytes per rank for one long prompt at DCP1 vs DCP2 (TP2 both), from the cache's own accounting."""
    if torch.cuda.device_count() < 2:
        return {"skipped": "needs 2 GPUs"}
    out = {}
    for dcp in (1, 2):
        cfg = EngineConfig(str(target), None, ParallelConfig(2, dcp, 1), CacheConfig(block_size=16, memory_bytes=1 << 30),
                           dtype="bfloat16", device="cuda", max_model_len=prompt_len + 64)
        with LLMEngine(cfg) as engine:
            engine.generate([GenerationRequest("long", tuple(range(5, 5 + prompt_len)), 8)], SamplingParams(max_tokens=8, ignore_eos=True))
            out[f"dcp{dcp}"] = engine.memory()["target"]["peak_bytes"]
    out["ratio"] = out["dcp2"] / out["dcp1"]
    return out


def sizes_for(batch: int, backend: str) -> tuple[int, ...]:
    # a compiled engine captures only the size it runs: each captured size is a compilation
    return (batch,) if "compiled" in backend else tuple(sorted({1, 8, batch}))


def end_to_end_rows(res: dict):
    """(row, mode, batch, run record) for every engine run in res: the decode rows and both halves of a spec row."""
    for key, r in res.items():
        if not isinstance(r, dict) or "error" in r:
            continue
        name, _, batch = key.rpartition("/b")
        if "ours" in r:
            yield name, "plain", int(batch), r["ours"]
        for mode in ("plain", "spec"):
            if mode in r:
                yield name, mode, int(batch), r[mode]


def print_end_to_end(res: dict) -> None:
    """End to end against the graph-replay bound, and the host's time per decode step by phase."""
    print(f"{'model':32s} {'mode':>5s} {'batch':>5s} {'e2e tok/s':>10s} {'step ms':>8s} {'tok/step':>8s} "
          f"{'bound':>8s} {'e2e/bound':>9s} {'ahead':>6s}  host ms per decode step by phase")
    for name, mode, batch, o in end_to_end_rows(res):
        st, bound = o["graph_step_s"], o["bound_tokens_per_s"]
        ms = o["phase_times"]["ms_per_step"]
        phases = " ".join(f"{p} {v:.3f}" for p, v in ms.items() if v >= 0.0005)
        print(f"{name:32s} {mode:>5s} {batch:5d} {o['tokens_per_s']:10.0f} {1e3 * st if st else float('nan'):8.3f} "
              f"{o['tokens_per_decode_step']:8.2f} {bound or float('nan'):8.0f} "
              f"{100 * o['tokens_per_s'] / bound if bound else float('nan'):8.1f}% "
              f"{o['phase_times']['steps_ahead'] / max(1, o['phase_times']['decode_steps']):6.0%}  {phases}")


def print_kernels(res: dict) -> None:
    """Each row's kernel table (--kernels)."""
    for name, mode, batch, o in end_to_end_rows(res):
        t = o.get("kernel_table")
        if not t:
            continue
        print(f"{name} {mode} batch {batch}: {t['kernels_per_step']} kernels, {t['kernel_us_per_step']:.1f} us of kernels a step")
        for k in t["top"]:
            print(f"  {k['us']:8.1f} us  x{k['launches']:5.1f}  {k['kernel']}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench.json")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=32, help="random prompt length of the decode rows: long "
                    "prompts make the step read more KV than weights (the 0.6B shape allows up to 4,096 positions)")
    ap.add_argument("--backends", default=PYTORCH, help="comma list of runtime backends (qual/runtime/backends)")
    ap.add_argument("--models", default="qwen3-0.6b-shape,toy", help="comma list of qwen3-0.6b-shape, toy")
    ap.add_argument("--batches", default="1,8", help="comma list of batch sizes of every row")
    ap.add_argument("--kernels", action="store_true", help="also profile each row's graph replay: its kernels, printed "
                    "and in --out (kernel_table)")
    ap.add_argument("--no-spec", action="store_true", help="skip the speculative speedup rows")
    ap.add_argument("--steps-per-launch", default="1", help="comma list: every row once per value "
                    "(EngineConfig.steps_per_launch; rows of n > 1 are named ~s<n>)")
    ap.add_argument("--max-model-len", type=int, help="of the decode rows (default: prompt + new tokens + 32); the "
                    "graphs' static key width follows it")
    args = ap.parse_args()
    res = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens}
    bw = copy_bandwidth()
    res["copy_bandwidth_Bps"] = bw
    toy_t, toy_d = TOY / "target", TOY / "draft"
    wanted = args.models.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    runs = {f"+{b}" if parse_backend(b).parts else "": b for b in args.backends.split(",")}
    runs = {f"{suffix}~s{n}" if n > 1 else suffix: (backend, n) for suffix, backend in runs.items()
            for n in map(int, args.steps_per_launch.split(","))}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        big = random_qwen3(Path(tmp) / "qwen3-0.6b", QWEN3_0_6B) if "qwen3-0.6b-shape" in wanted else None
        models = {"qwen3-0.6b-shape": big, "toy": toy_t}
        for name in wanted:
            for batch in batches:
                h = hf(models[name], batch, args.prompt_tokens, args.new_tokens)
                for suffix, (backend, steps) in runs.items():
                    key = f"{name}{suffix}/b{batch}"
                    try:
                        o = ours(models[name], None, batch, args.prompt_tokens, args.new_tokens, sizes_for(batch, backend),
                                 max_model_len=args.max_model_len, backend=backend, kernels=args.kernels,
                                 steps_per_launch=steps)
                    except Exception as exc:  # one failing variant must not lose the others' numbers
                        res[key] = {"error": f"{type(exc).__name__}: {exc}"}
                        print(f"{key}: {res[key]['error']}", file=sys.stderr)
                        continue
                    roof = (o["weight_bytes_read"] + o["kv_bytes_read_per_step"]) / o["graph_step_s"] / bw if o["graph_step_s"] else None
                    res[key] = {"ours": o, "hf": h, "speedup_vs_hf": o["tokens_per_s"] / h["tokens_per_s"], "roofline": roof}
                    rows.append((name + suffix, batch, o["tokens_per_s"], h["tokens_per_s"], o["graph_step_s"], roof))
        if not args.no_spec:
            first = humaneval_requests(max(batches))
            for batch in batches:
                reqs = first[:batch]
                plen = max(len(r.prompt_token_ids) for r in reqs)
                for suffix, (backend, steps) in runs.items():
                    key = f"toy-spec{suffix}/b{batch}"
                    try:
                        spec = ours(toy_t, toy_d, batch, plen, 64, sizes_for(batch, backend), reqs, backend=backend,
                                    kernels=args.kernels, steps_per_launch=steps)
                        plain = ours(toy_t, None, batch, plen, 64, sizes_for(batch, backend), reqs, backend=backend,
                                     kernels=args.kernels, steps_per_launch=steps)
                    except Exception as exc:
                        res[key] = {"error": f"{type(exc).__name__}: {exc}"}
                        print(f"{key}: {res[key]['error']}", file=sys.stderr)
                        continue
                    res[key] = {"spec": spec, "plain": plain, "speedup": spec["tokens_per_s"] / plain["tokens_per_s"]}
        res["kv_per_rank"] = kv_per_rank(big) if big else {"skipped": "the 0.6B shape was not benchmarked"}
    Path(args.out).write_text(json.dumps(res, indent=2, default=str))
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s (read+write); decode rows: {args.prompt_tokens}-token prompts, "
          f"{args.new_tokens} new tokens")
    print(f"{'model':32s} {'batch':>5s} {'ours tok/s':>11s} {'hf tok/s':>9s} {'x hf':>6s} {'step ms':>8s} {'roofline':>8s}")
    for name, b, o, h, st, roof in rows:
        print(f"{name:32s} {b:5d} {o:11.0f} {h:9.0f} {o / h:6.1f} {1e3 * st if st else float('nan'):8.3f} "
              f"{100 * roof if roof else float('nan'):7.1f}%")
    for k in [k for k in res if k.startswith("toy-spec") and "error" not in res[k]]:
        r = res[k]
        print(f"{k} spec vs plain: {r['spec']['tokens_per_s']:.0f} vs {r['plain']['tokens_per_s']:.0f} tok/s = "
              f"{r['speedup']:.2f}x (acceptance {100 * r['spec']['acceptance_rate']:.1f}%)")
    print_end_to_end(res)
    print_kernels(res)
    print("target KV bytes per rank (1536-token prompt, TP2):", res["kv_per_rank"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
