"""GPU benchmark: decode tokens/s vs transformers, HBM roofline, speculative speedup, KV bytes per rank.

    python3 bench/gpu_bench.py [--out bench.json] [--backends pytorch,compiled+triton-gemm+triton-attention,...]
                               [--models qwen3-0.6b-shape,8b-shape,toy] [--batches 1,8] [--no-spec] [--no-hf]
                               [--prompt-tokens N] [--max-model-len N] [--kernels] [--steps-per-launch 1,4]
                               [--stream 64 --stream-batch 8 --prefill-ahead 0,8] [--peer] [--repeats N]

Backends are the runtime's: pytorch, or parts joined by "+" (qual/runtime/backends: PARTS, and what each serves).

Models: qwen3-0.6b-shape and 8b-shape (a Qwen3 layout with Llama-3-8B's dimensions: hidden 4096, 32 layers, 32
query heads x 128, 8 KV heads, FFN 14,336, vocabulary 128,256, untied LM head), random bf16 weights written once
per call; toy, the shipped pair. One engine per model and backend serves every batch size.

--stream N: N HumanEval requests of the toy pair, at most --stream-batch in flight (a finished request's place
goes to the next waiting one at once), speculative and plain, each against its bound (tokens a decode step
committed / the --stream-batch graph's step time, replayed from the inputs of the middle launch of a generate:
mid_run_inputs). --prefill-ahead: each value a pair of stream rows
(EngineConfig.prefill_ahead; rows of n > 0 are named ~p<n>).

Every engine row also reports where the device's time went in one more generate (device_split): prefill steps,
decode launches, and idle between steps, which is what separates a row's e2e from its bound.

Bandwidth shares are printed against two measurements made in the same process: the copy bandwidth (a 1 GiB
device-to-device copy, read + write) and the read bandwidth (a kernel that only streams 4 GiB in: what a decode
step's weight stream does). --peer: beside each shaped model's decode rows, bench/compiled_peer.py's gpt-fast-style
decoder (torch.compile reduce-overhead) on the same weights at the same batches, in the same process (rows ~peer).
--repeats N: each row's timed generate N times, the median counting (a batch-1 speculative generate of the toy
pair is about 4 ms, so a single sample moves with any hiccup of the host's).

Run on the device machine (CUDA). Prints a table last; writes every number to --out.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

from qual.checkpoints.qwen3 import Qwen3Config, layer_weight_shapes, write_qwen3
from qual.files import write_text  # whole or not at all: a call killed mid-write keeps the rows before
from qual.paths import DATA_DIR
from qual.runtime.backends import PYTORCH, parse_backend
from qual.runtime.config import CacheConfig, EngineConfig, ParallelConfig, SamplingParams
from qual.runtime.engine import GenerationRequest, LLMEngine

QWEN3_0_6B = Qwen3Config(vocab_size=151936, hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                         num_key_value_heads=8, head_dim=128, intermediate_size=3072, tie_word_embeddings=True,
                         eos_token_id=151645)
SHAPE_8B = Qwen3Config(vocab_size=128256, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=128, intermediate_size=14336, tie_word_embeddings=False,
                       rope_theta=500000.0, max_position_embeddings=8192, eos_token_id=128001)
SHAPES = {"qwen3-0.6b-shape": QWEN3_0_6B, "8b-shape": SHAPE_8B}
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


@triton.jit
def _read_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """Each program sums its BLOCK x ITERS int32 slice of x: a stream of reads and nothing else."""
    base = tl.program_id(0).to(tl.int64) * BLOCK * ITERS
    acc = tl.zeros((BLOCK,), tl.int32)
    for i in range(ITERS):
        acc += tl.load(x_ptr + base + i * BLOCK + tl.arange(0, BLOCK))
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc))


def read_bandwidth() -> float:
    """Bytes a second _read_kernel streams from 4 GiB of HBM (median of 20)."""
    n, block, iters = 1 << 30, 4096, 16
    a = torch.ones(n, dtype=torch.int32, device="cuda")
    out = torch.empty(n // (block * iters), dtype=torch.int32, device="cuda")
    times = []
    for _ in range(22):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        _read_kernel[(out.numel(),)](a, out, BLOCK=block, ITERS=iters, num_warps=8)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    assert int(out.sum()) == n  # every element read once
    return 4 * n / sorted(times[2:])[len(times[2:]) // 2]


def restoring_replay(graph, saved: list[torch.Tensor] | None = None):
    """A function that replays a captured decode graph from the inputs it holds now, or from `saved` (its inputs
    as mid_run_inputs kept them). Each replay advances the graph's own inputs (async decode), so they are put back
    before every replay (a copy of a few hundred bytes): otherwise the positions would run past the cache's width."""
    live = [t for t in (graph.flat, graph.feats) if t is not None]
    kept = list(zip(live, saved if saved is not None else [t.clone() for t in live]))

    def replay():
        for t, value in kept:
            t.copy_(value)
        graph.replay(1)

    return replay


def mean_seconds(fn, n: int = 50, warmups: int = 3) -> float:
    """Seconds a call of fn keeps the device busy: the mean of n back-to-back calls after `warmups` (CUDA events)."""
    for _ in range(warmups):
        fn()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(n):
        fn()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) / 1e3 / n


def replay_seconds(graph, saved: list[torch.Tensor] | None = None, n: int = 50) -> float:
    """Seconds per replay of a captured decode graph: the mean of n back-to-back replays after 3 warm-ups, the
    restore of its inputs timed with each (restoring_replay)."""
    return mean_seconds(restoring_replay(graph, saved), n)


def mid_run_inputs(graph, run, at: int) -> list[torch.Tensor] | None:
    """The inputs a captured decode graph held just before its replay number `at` (from 0) while run() ran (one
    more generate): copies of its numbers and draft context, taken on the device in order with the launches. The
    bound's replay starts from them: after a generate the graph holds its last launch's inputs, whose finished rows
    are padding (block tables all -1, their keys one clamped slot), a cheaper step than one with every row live.
    None if run() replayed the graph fewer times."""
    kept, count, replay = None, 0, graph.replay

    def counted(steps: int = 1):
        nonlocal kept, count
        if count == at:
            kept = [t.clone() for t in (graph.flat, graph.feats) if t is not None]
        count += 1
        return replay(steps)

    graph.replay = counted
    try:
        run()
    finally:
        del graph.replay  # the class's method again
    return kept


def cuda_kernels(fn, runs: int, skip: tuple[str, ...] = ()) -> tuple[dict[str, float], dict[str, float]]:
    """What a call of fn runs on the device (CUPTI through torch.profiler, over `runs` calls): microseconds and
    launches a call, by kernel name (cut to 100 characters), leaving out names that start with one of `skip`."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            fn()
        torch.cuda.synchronize()
    time_us, launches = {}, {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and not ev.name.startswith(skip):
            name = ev.name[:100]
            time_us[name] = time_us.get(name, 0.0) + ev.device_time_total / runs
            launches[name] = launches.get(name, 0) + 1 / runs
    return time_us, launches


# What launched each kernel, by its name's start: qual's own Triton kernels, then inductor's (a compiled step's
# small kernels: norms, partial sums, RoPE, the KV write, SwiGLU); the rest (cuBLAS, PyTorch's) is "other"
KERNEL_GROUPS = (
    ("fused-layer products", ("_fused_product_kernel",)),
    ("gluon-layer products", ("_fused_kernel",)),
    ("split-K products", ("_partials_kernel",)),
    ("paged attention", ("_paged_attention_kernel", "_combine_kernel")),
    ("fused decode", ("_decode_layers_kernel",)),
    ("compiled (inductor)", ("triton_",)),
)


def kernel_groups(time_us: dict[str, float], launches: dict[str, float]) -> list[dict]:
    """Kernel time and launches a step by KERNEL_GROUPS (then "other"), in that order, groups with no kernel left
    out: a row's breakdown, comparable across backends whose kernels fuse differently."""
    rows = {name: [0.0, 0.0] for name, _ in KERNEL_GROUPS}
    rows["other"] = [0.0, 0.0]
    for kernel, us in time_us.items():
        group = next((name for name, starts in KERNEL_GROUPS if kernel.startswith(starts)), "other")
        rows[group][0] += us
        rows[group][1] += launches.get(kernel, 0.0)
    return [{"group": g, "us": round(us, 1), "launches": round(n, 1)} for g, (us, n) in rows.items() if n]


def kernel_table(time_us: dict[str, float], launches: dict[str, float], top: int = 12) -> dict:
    """What one replay of a captured decode graph runs on the device, from cuda_kernels of restoring_replay (the
    restoring copies left out): kernels a step, kernel time a step, and the `top` kernels by time, each with its
    microseconds and launches a step. Compiled steps' fusion varies between compiles, so a step time alone does
    not say which kernels moved."""
    ranked = sorted(time_us, key=time_us.get, reverse=True)[:top]
    return {"kernels_per_step": round(sum(launches.values())), "kernel_us_per_step": round(sum(time_us.values()), 1),
            "top": [{"kernel": k, "us": round(time_us[k], 1), "launches": round(launches[k], 1)} for k in ranked],
            "groups": kernel_groups(time_us, launches)}


def generate_timeline(engine, reqs, sp, alone_us: dict[str, float], decode_steps: int) -> dict:
    """One more generate of reqs under CUPTI, summed against the decode graph replayed alone (activity_summary)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.generate(reqs, sp)
        torch.cuda.synchronize()
    acts = [(e.start_ns(), e.end_ns(), e.name()[:100]) for e in prof.profiler.kineto_results.events()
            if e.device_type() == torch.autograd.DeviceType.CUDA]
    return activity_summary(acts, alone_us, decode_steps)


def activity_summary(acts: list[tuple[int, int, str]], alone_us: dict[str, float], decode_steps: int,
                     top: int = 8) -> dict:
    """Where a generate's device time went, from its activities (start ns, end ns, name), against the decode graph
    replayed alone (alone_us: its microseconds a step by kernel name). The span (first start to last end) is the
    kernels, the copies (Memcpy/Memset) and the gaps where nothing ran (the host late, or launch latency); each
    kernel name's microseconds a decode step here minus alone say whether the decode kernels ran slower inside the
    generate than replayed back to back (the largest differences listed). Names the lone replay does not run (the
    prefill's) are summed apart."""
    acts = sorted(acts)
    if not acts:
        return {}
    busy_until, gaps, by_name, copies = acts[0][0], [], {}, 0.0
    for start, end, name in acts:
        if start > busy_until:
            gaps.append((start - busy_until) / 1e3)
        busy_until = max(busy_until, end)
        if name.startswith(("Memcpy", "Memset")):
            copies += (end - start) / 1e3
        else:
            by_name[name] = by_name.get(name, 0.0) + (end - start) / 1e3
    steps = max(1, decode_steps)
    excess = {k: by_name.get(k, 0.0) / steps - v for k, v in alone_us.items()}
    ranked = sorted(excess, key=lambda k: abs(excess[k]), reverse=True)[:top]
    return {"span_us": (busy_until - acts[0][0]) / 1e3, "decode_steps": decode_steps,
            "decode_kernel_us": sum(by_name.get(k, 0.0) for k in alone_us),
            "alone_kernel_us": steps * sum(alone_us.values()),
            "other_kernel_us": sum(v for k, v in by_name.items() if k not in alone_us), "copy_us": copies,
            "gap_us": sum(gaps), "gaps": len(gaps), "gaps_over_10us": sum(1 for g in gaps if g > 10),
            "gap_us_over_10us": sum(g for g in gaps if g > 10),
            "excess_us_per_step": [{"kernel": k, "us": round(excess[k], 2), "alone_us": round(alone_us[k], 2)}
                                   for k in ranked]}


def device_split(engine, reqs, sp) -> dict:
    """One more generate of reqs, with a CUDA event recorded before and after each engine step: the device's
    milliseconds in prefill steps, in decode launches (their input copies and readbacks included; also any wait
    for the host inside a launch) and idle between steps, and the generate's wall time. Not the timed generate: the
    events cost the host a few microseconds a step."""
    from qual.runtime.steps import PrefillStep

    marks, step = [], engine._step

    def marked(s):
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record()
        out = step(s)
        after.record()
        marks.append(("prefill" if isinstance(s, PrefillStep) else "decode", before, after))
        return out

    engine._step = marked
    try:
        torch.cuda.synchronize()
        t = time.perf_counter()
        engine.generate(reqs, sp)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    finally:
        del engine._step  # the class's method again
    split = {"prefill_ms": 0.0, "decode_ms": 0.0, "idle_ms": 0.0, "wall_ms": 1e3 * wall}
    for i, (kind, before, after) in enumerate(marks):
        split[f"{kind}_ms"] += before.elapsed_time(after)
        if i + 1 < len(marks):  # the device waited for the host's next step
            split["idle_ms"] += max(0.0, after.elapsed_time(marks[i + 1][1]))
    return split


def random_qwen3(path: Path, cfg: Qwen3Config) -> Path:
    """A random Qwen3 checkpoint of the given shape in bf16, HF format: matrices N(0, 0.02^2), the embedding
    N(0, 0.0004^2), norms near 1; drawn on the GPU (an 8B shape's 15 GB in seconds)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size), "model.norm.weight": (cfg.hidden_size,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
    for i in range(cfg.num_hidden_layers):
        shapes.update(layer_weight_shapes(cfg, f"model.layers.{i}."))
    w = {}
    for name, shape in shapes.items():
        t = torch.randn(shape, device="cuda", generator=g)
        scale = 0.02 * 0.02 if name == "model.embed_tokens.weight" else 0.02
        w[name] = (1.0 + 0.1 * t if len(shape) == 1 else t * scale).to(torch.bfloat16).cpu()
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


def ours(target: Path, draft: Path | None, batches: list[int], prompt_len: int, new_tokens: int, sizes=(1, 8),
         prompts=None, max_model_len: int | None = None, kernels: bool = False, repeats: int = 1,
         **engine_kw) -> dict[int, dict]:
    """One engine, then for each batch size a warm-up generate and `repeats` timed ones: {batch: record}. prompts:
    the requests of a single batch entry (the batch size is then the engine's max_num_seqs at most)."""
    # 16 GiB of KV: 8 rows of 4k tokens of the 0.6B shape take 3.7 GB
    cfg = EngineConfig(str(target), str(draft) if draft else None, ParallelConfig(1, 1, 1),
                       CacheConfig(block_size=16, memory_bytes=16 << 30), dtype="bfloat16", device="cuda",
                       cuda_graph_sizes=sizes, max_model_len=max_model_len or prompt_len + new_tokens + 32,
                       phase_times=True, **engine_kw)
    t_init = time.perf_counter()
    g = torch.Generator().manual_seed(1)
    res = {}
    with LLMEngine(cfg) as engine:
        init_s = time.perf_counter() - t_init  # includes compilation and graph capture
        vocab = engine.target_cfg.vocab_size
        for batch in batches:
            reqs = prompts or [GenerationRequest(f"r{i}", tuple(torch.randint(0, vocab - 2, (prompt_len,), generator=g).tolist()),
                                                 new_tokens) for i in range(batch)]
            res[batch] = _timed(engine, reqs, batch, prompt_len, new_tokens, draft is not None, kernels, repeats)
            res[batch]["init_s"] = init_s
    return res


def _timed(engine, reqs, batch: int, prompt_len: int, new_tokens: int, spec: bool, kernels: bool,
           repeats: int = 1) -> dict:
    """A warm-up generate of reqs, then `repeats` timed ones (the median wall time counts; the phases and launches
    are the last one's); the graph of `batch` rows replayed alone for the bound."""
    sp = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    engine.generate(reqs, sp)  # warm-up
    walls = []
    for _ in range(repeats):
        ahead, launches = engine.steps_ahead, dict(engine.launches)
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = engine.generate(reqs, sp)
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - t)
    wall = sorted(walls)[len(walls) // 2]
    phases = engine.phase_times()
    phases["steps_ahead"] = engine.steps_ahead - ahead  # async decode: launched before the last step was read
    phases["launches"] = {k: v - launches.get(k, 0) for k, v in engine.launches.items()}  # of the timed generate
    graphs = engine.runner.graphs
    graph = graphs.graphs.get(batch) if graphs else None
    # One more generate gives the device split and the bound's inputs: the graph is replayed from those of its middle
    # launch, when a kept-full stream has every row live (from the last launch's inputs a finished stream's padding
    # rows read almost nothing)
    split = {}
    split_generate = lambda: split.update(device_split(engine, reqs, sp))  # noqa: E731
    launched = sum(phases["launches"].values())
    saved = mid_run_inputs(graph, split_generate, launched // 2) if graph else split_generate()
    rec = engine.graph_capture()
    step_s = replay_seconds(graph, saved) if graph else None
    table = timeline = None
    if kernels and step_s:
        alone = cuda_kernels(restoring_replay(graph, saved), 10, skip=("Memcpy",))
        table = kernel_table(*alone)
        timeline = generate_timeline(engine, reqs, sp, alone[0], phases["decode_steps"])
    wbytes = weight_bytes_read(engine.runner.target, batch)
    # Keys of the replayed step's context: the middle launch's (about half the new tokens in), or the last one's; not
    # the graphs' static key width (max_model_len), whose padding a kernel may read but need not: reading it costs
    # time and earns no roofline credit
    kv_keys = min(engine.runner.caches.key_width["target"],
                  prompt_len + (new_tokens // 2 if saved is not None else new_tokens))
    tc = engine.target_cfg
    kv_bytes = batch * kv_keys * tc.num_hidden_layers * 2 * tc.num_key_value_heads * tc.head_dim * 2
    tokens = sum(len(r.output_token_ids) for r in out)
    acc = sum(r.accepted_tokens for r in out) / max(1, sum(r.draft_tokens for r in out)) if spec else None
    # The bound: tokens a decode step commits (over the whole run, prefill's first tokens excluded) per graph step
    per_step = (tokens - len(out)) / max(1, phases["decode_steps"])
    bound = per_step / step_s if step_s else None
    return {"tokens_per_s": tokens / wall, "bound_tokens_per_s": bound, "tokens_per_decode_step": per_step,
            "requests": len(out), "tokens": tokens, "phase_times": phases, "wall_s": wall, "wall_s_each": walls,
            "graph_step_s": step_s,
            "graph_share": phases["decode_steps"] * step_s / wall if step_s else None,
            "graph_step_inputs": "middle launch" if saved is not None else "last launch",
            "weight_bytes_read": wbytes, "kv_bytes_read_per_step": kv_bytes,
            "graph": {k: rec.get(k) for k in ("status", "sizes", "seconds", "bytes", "prefill")},
            "acceptance_rate": acc, "kernel_table": table, "timeline": timeline, "device_split": split}


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


def sizes_for(batches: list[int], backend: str) -> tuple[int, ...]:
    # a compiled decode step captures only the sizes it runs: each captured size is a compilation
    return tuple(sorted(set(batches))) if parse_backend(backend).compile_mode else tuple(sorted({1, 8, *batches}))


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


def e2e_range(o: dict) -> str:
    """A row's e2e / bound at its slowest, median and fastest timed generate."""
    if not o.get("bound_tokens_per_s"):
        return "n/a"
    shares = sorted(o["tokens"] / w / o["bound_tokens_per_s"] for w in o["wall_s_each"])
    return f"{100 * shares[0]:.1f}% / {100 * shares[len(shares) // 2]:.1f}% / {100 * shares[-1]:.1f}%"


def print_end_to_end(res: dict) -> None:
    """End to end against the graph-replay bound, and the host's time per decode step by phase."""
    print(f"{'model':32s} {'mode':>5s} {'batch':>5s} {'e2e tok/s':>10s} {'step ms':>8s} {'tok/step':>8s} "
          f"{'bound':>8s} {'e2e/bound':>9s} {'ahead':>6s}  host ms per decode step by phase | device ms (another "
          f"generate): prefill, decode, idle")
    for name, mode, batch, o in end_to_end_rows(res):
        st, bound = o["graph_step_s"], o["bound_tokens_per_s"]
        ms = o["phase_times"]["ms_per_step"]
        phases = " ".join(f"{p} {v:.3f}" for p, v in ms.items() if v >= 0.0005)
        print(f"{name:32s} {mode:>5s} {batch:5d} {o['tokens_per_s']:10.0f} {1e3 * st if st else float('nan'):8.3f} "
              f"{o['tokens_per_decode_step']:8.2f} {bound or float('nan'):8.0f} "
              f"{100 * o['tokens_per_s'] / bound if bound else float('nan'):8.1f}% "
              f"{o['phase_times']['steps_ahead'] / max(1, o['phase_times']['decode_steps']):6.0%}  {phases} | "
              + ", ".join(f"{o['device_split'][k]:.1f}" for k in ("prefill_ms", "decode_ms", "idle_ms")))


def print_kernels(res: dict) -> None:
    """Each row's kernel table (--kernels)."""
    for name, mode, batch, o in end_to_end_rows(res):
        t = o.get("kernel_table")
        if not t:
            continue
        print(f"{name} {mode} batch {batch}: {t['kernels_per_step']} kernels, {t['kernel_us_per_step']:.1f} us of kernels a step")
        print("  by group: " + "; ".join(f"{g['group']} {g['us']:.1f} us x{g['launches']:.0f}" for g in t["groups"]))
        for k in t["top"]:
            print(f"  {k['us']:8.1f} us  x{k['launches']:5.1f}  {k['kernel']}")
        tl = o.get("timeline")
        if tl:
            print(f"  another generate under CUPTI: {tl['span_us']:.0f} us on the device = decode kernels "
                  f"{tl['decode_kernel_us']:.0f} (replayed alone: {tl['alone_kernel_us']:.0f} for its "
                  f"{tl['decode_steps']} steps) + other kernels {tl['other_kernel_us']:.0f} + copies {tl['copy_us']:.0f} "
                  f"+ {tl['gaps']} gaps {tl['gap_us']:.0f} ({tl['gaps_over_10us']} over 10 us: {tl['gap_us_over_10us']:.0f}) "
                  f"(kernels overlap when the sum passes the span)")
            for k in tl["excess_us_per_step"]:
                print(f"    {k['us']:+8.2f} us a step against {k['alone_us']:8.2f} alone  {k['kernel']}")


def decode_row(name: str, batch: int, o: dict, h: dict | None, bw: float, read_bw: float) -> dict:
    """A plain decode row: ours against transformers, the roofline, and the weight bandwidth end to end (weight bytes
    a step x steps a second of the timed generate, prefill included) over the copy and the read bandwidth."""
    step = o["graph_step_s"]
    roof = (o["weight_bytes_read"] + o["kv_bytes_read_per_step"]) / step / bw if step else None
    e2e_bw = o["weight_bytes_read"] * o["tokens_per_s"] / batch
    row = {"ours": o, "roofline": roof, "e2e_weight_bw_over_copy_bw": e2e_bw / bw,
           "e2e_weight_bw_over_read_bw": e2e_bw / read_bw}
    if h:
        row.update(hf=h, speedup_vs_hf=o["tokens_per_s"] / h["tokens_per_s"])
    print(f"{name} b{batch}: {o['tokens_per_s']:.0f} tok/s, step {1e3 * step if step else float('nan'):.3f} ms, "
          f"e2e weight bw / copy bw {100 * e2e_bw / bw:.1f}%, / read bw {100 * e2e_bw / read_bw:.1f}%, "
          f"graph share {100 * (o['graph_share'] or 0):.1f}%", flush=True)
    return row


def shape_weight_bytes(cfg: Qwen3Config, rows: int) -> int:
    """Weight bytes (bf16) a decode step of `rows` tokens reads from a checkpoint of this shape: every layer, the
    final norm, the LM head, `rows` rows of the embedding (weight_bytes_read's count, from the shapes alone)."""
    layer = sum(torch.Size(s).numel() for s in layer_weight_shapes(cfg, "").values())
    return 2 * (cfg.num_hidden_layers * layer + (cfg.vocab_size + rows) * cfg.hidden_size + cfg.hidden_size)


def peer_row(name: str, batch: int, p: dict, cfg: Qwen3Config, bw: float, read_bw: float) -> dict:
    """The compiled peer's decode row: its weight bandwidth end to end over the copy and the read bandwidth."""
    e2e_bw = shape_weight_bytes(cfg, batch) * p["tokens_per_s"] / batch
    print(f"{name}~peer b{batch}: {p['tokens_per_s']:.0f} tok/s, e2e weight bw / copy bw {100 * e2e_bw / bw:.1f}%, "
          f"/ read bw {100 * e2e_bw / read_bw:.1f}% (first generate, compiling: {p['first_generate_s']:.0f} s)",
          flush=True)
    return {"peer": p, "e2e_weight_bw_over_copy_bw": e2e_bw / bw, "e2e_weight_bw_over_read_bw": e2e_bw / read_bw}


def print_decode_rows(res: dict, bw: float, read_bw: float, args) -> None:
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s (read+write), read bandwidth {read_bw / 1e12:.2f} TB/s; decode rows: "
          f"{args.prompt_tokens}-token prompts, {args.new_tokens} new tokens")
    print(f"{'model':44s} {'batch':>5s} {'ours tok/s':>11s} {'hf tok/s':>9s} {'x hf':>6s} {'step ms':>8s} "
          f"{'roofline':>8s} {'e2e W bw/copy':>13s} {'/read':>7s} {'graph share':>11s}")
    for key, r in res.items():
        if not (isinstance(r, dict) and "e2e_weight_bw_over_copy_bw" in r):
            continue
        name, _, b = key.rpartition("/b")
        o, hf_s = r.get("ours") or r["peer"], r.get("hf", {}).get("tokens_per_s")
        st, roof = o.get("graph_step_s"), r.get("roofline")
        print(f"{name:44s} {int(b):5d} {o['tokens_per_s']:11.0f} {hf_s or float('nan'):9.0f} "
              f"{o['tokens_per_s'] / hf_s if hf_s else float('nan'):6.1f} {1e3 * st if st else float('nan'):8.3f} "
              f"{100 * roof if roof else float('nan'):7.1f}% {100 * r['e2e_weight_bw_over_copy_bw']:12.1f}% "
              f"{100 * r['e2e_weight_bw_over_read_bw']:6.1f}% {100 * (o.get('graph_share') or float('nan')):10.1f}%")


def stream_row(spec: dict, plain: dict) -> dict:
    """Speculative against plain on a kept-full stream: the speedup, the bounds' ratio and their ratio."""
    speedup = spec["tokens_per_s"] / plain["tokens_per_s"]
    bounds = spec["bound_tokens_per_s"] / plain["bound_tokens_per_s"]
    return {"spec": spec, "plain": plain, "speedup": speedup, "bounds_ratio": bounds,
            "speedup_over_bounds_ratio": speedup / bounds}


def print_stream_rows(res: dict) -> None:
    for key in [k for k in res if k.startswith("toy-stream") and "error" not in res[k]]:
        r = res[key]
        for mode in ("spec", "plain"):
            o = r[mode]
            print(f"{key} {mode:5s}: {o['tokens_per_s']:.0f} tok/s, {o['tokens_per_decode_step']:.2f} tokens a step, "
                  f"step {1e3 * o['graph_step_s']:.3f} ms, bound {o['bound_tokens_per_s']:.0f} tok/s, "
                  f"e2e/bound {100 * o['tokens_per_s'] / o['bound_tokens_per_s']:.1f}%, "
                  f"graph share {100 * o['graph_share']:.1f}%")
            d = o["device_split"]
            print(f"    device, another generate: prefill {d['prefill_ms']:.1f} ms, decode {d['decode_ms']:.1f} ms, "
                  f"idle {d['idle_ms']:.1f} ms of {d['wall_ms']:.1f} ms")
        print(f"{key}: speedup {r['speedup']:.2f}x, bounds' ratio {r['bounds_ratio']:.2f}x, speedup / bounds' ratio "
              f"{100 * r['speedup_over_bounds_ratio']:.1f}% (acceptance {100 * r['spec']['acceptance_rate']:.1f}%)")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench.json")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=32, help="random prompt length of the decode rows: long "
                    "prompts make the step read more KV than weights (the 0.6B shape allows up to 4,096 positions)")
    ap.add_argument("--backends", default=PYTORCH, help="comma list of runtime backends (qual/runtime/backends)")
    ap.add_argument("--models", default="qwen3-0.6b-shape,toy", help="comma list of qwen3-0.6b-shape, 8b-shape, toy")
    ap.add_argument("--batches", default="1,8", help="comma list of batch sizes of every row")
    ap.add_argument("--kernels", action="store_true", help="also profile each row's graph replay: its kernels, printed "
                    "and in --out (kernel_table), and one more generate against it (timeline)")
    ap.add_argument("--no-spec", action="store_true", help="skip the speculative speedup rows")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers' generate beside the decode rows")
    ap.add_argument("--stream", type=int, default=0, help="also the stream rows: this many HumanEval requests")
    ap.add_argument("--stream-batch", type=int, default=8, help="requests in flight in the stream rows")
    ap.add_argument("--prefill-ahead", default="0", help="comma list: the stream rows once per value "
                    "(EngineConfig.prefill_ahead: waiting requests prefilled with a freed row's and held ready)")
    ap.add_argument("--steps-per-launch", default="1", help="comma list: every row once per value "
                    "(EngineConfig.steps_per_launch; rows of n > 1 are named ~s<n>)")
    ap.add_argument("--max-model-len", type=int, help="of the decode rows (default: prompt + new tokens + 32); the "
                    "graphs' static key width follows it")
    ap.add_argument("--repeats", type=int, default=1, help="timed generates a row (the median counts; every wall time "
                    "is in --out, and the spec rows print their e2e / bound range)")
    ap.add_argument("--peer", action="store_true", help="also bench/compiled_peer.py's gpt-fast-style decoder on each "
                    "shaped model's weights (rows ~peer)")
    args = ap.parse_args()
    res = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens}
    bw, read_bw = copy_bandwidth(), read_bandwidth()
    res["copy_bandwidth_Bps"], res["read_bandwidth_Bps"] = bw, read_bw
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s (read+write), read bandwidth {read_bw / 1e12:.2f} TB/s", flush=True)
    save = lambda: write_text(args.out, json.dumps(res, indent=2, default=str))  # noqa: E731  (after each row)
    toy_t, toy_d = TOY / "target", TOY / "draft"
    wanted = [m for m in args.models.split(",") if m]
    batches = [int(b) for b in args.batches.split(",")]
    runs = {f"+{b}" if parse_backend(b).parts else "": b for b in args.backends.split(",")}
    runs = {f"{suffix}~s{n}" if n > 1 else suffix: (backend, n) for suffix, backend in runs.items()
            for n in map(int, args.steps_per_launch.split(","))}

    def attempt(key: str, fn):
        try:
            return fn()
        except Exception as exc:  # one failing variant must not lose the others' numbers
            res[key] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"{key}: {res[key]['error']}", file=sys.stderr, flush=True)
        # A closed engine goes with its last reference (ModelRunner.close); a failed one may be held in cycles with
        # its traceback's frames: collected here, so that the next row (16 GiB of KV) starts on a free device
        gc.collect()
        return None

    with tempfile.TemporaryDirectory() as tmp:
        models = {"toy": toy_t}
        for name in wanted:
            if name in SHAPES:
                t = time.perf_counter()
                models[name] = random_qwen3(Path(tmp) / name, SHAPES[name])
                print(f"{name}: random weights written in {time.perf_counter() - t:.1f} s", flush=True)
        for name in wanted:
            hfs = {} if args.no_hf else {b: hf(models[name], b, args.prompt_tokens, args.new_tokens) for b in batches}
            for suffix, (backend, steps) in runs.items():
                outs = attempt(f"{name}{suffix}/b{batches[0]}", lambda: ours(
                    models[name], None, batches, args.prompt_tokens, args.new_tokens, sizes_for(batches, backend),
                    max_model_len=args.max_model_len, backend=backend, kernels=args.kernels, steps_per_launch=steps,
                    repeats=args.repeats))
                for batch, o in (outs or {}).items():
                    res[f"{name}{suffix}/b{batch}"] = decode_row(f"{name}{suffix}", batch, o, hfs.get(batch), bw,
                                                                 read_bw)
                save()
            if args.peer and name in SHAPES:
                from compiled_peer import peer_decode

                for batch in batches:
                    p = attempt(f"{name}~peer/b{batch}", lambda: peer_decode(
                        models[name], SHAPES[name], batch, args.prompt_tokens, args.new_tokens))
                    if p:
                        res[f"{name}~peer/b{batch}"] = peer_row(name, batch, p, SHAPES[name], bw, read_bw)
                    save()
        if not args.no_spec:
            first = humaneval_requests(max(batches))
            for batch in batches:
                reqs = first[:batch]
                plen = max(len(r.prompt_token_ids) for r in reqs)
                for suffix, (backend, steps) in runs.items():
                    key = f"toy-spec{suffix}/b{batch}"
                    kw = dict(prompts=reqs, backend=backend, kernels=args.kernels, steps_per_launch=steps,
                              repeats=args.repeats)
                    pair = attempt(key, lambda: [ours(toy_t, d, [batch], plen, 64, sizes_for([batch], backend), **kw)[batch]
                                                 for d in (toy_d, None)])
                    if pair:
                        res[key] = {"spec": pair[0], "plain": pair[1], "speedup": pair[0]["tokens_per_s"] / pair[1]["tokens_per_s"]}
                    save()
        if args.stream:
            reqs, n = humaneval_requests(args.stream), args.stream_batch
            plen = max(len(r.prompt_token_ids) for r in reqs)
            for (suffix, (backend, steps)), held in [(r, int(p)) for r in runs.items() for p in args.prefill_ahead.split(",")]:
                key = f"toy-stream{suffix}{f'~p{held}' if held else ''}/b{n}"
                kw = dict(prompts=reqs, backend=backend, kernels=args.kernels, steps_per_launch=steps, max_num_seqs=n,
                          prefill_ahead=held, repeats=args.repeats)
                pair = attempt(key, lambda: [ours(toy_t, d, [n], plen, 64, sizes_for([n], backend), **kw)[n]
                                             for d in (toy_d, None)])
                if pair:
                    res[key] = stream_row(*pair)
                    print_stream_rows({key: res[key]})
                save()
        big = models.get("qwen3-0.6b-shape")
        res["kv_per_rank"] = kv_per_rank(big) if big else {"skipped": "the 0.6B shape was not benchmarked"}
    save()
    print_decode_rows(res, bw, read_bw, args)
    for k in [k for k in res if k.startswith("toy-spec") and "error" not in res[k]]:
        r = res[k]
        print(f"{k} spec vs plain: {r['spec']['tokens_per_s']:.0f} vs {r['plain']['tokens_per_s']:.0f} tok/s = "
              f"{r['speedup']:.2f}x (acceptance {100 * r['spec']['acceptance_rate']:.1f}%)")
        for mode in ("spec", "plain"):
            print(f"    {mode}: e2e / bound {e2e_range(r[mode])} over {len(r[mode]['wall_s_each'])} timed generates")
    print_stream_rows(res)
    print_end_to_end(res)
    print_kernels(res)
    print("target KV bytes per rank (1536-token prompt, TP2):", res["kv_per_rank"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
