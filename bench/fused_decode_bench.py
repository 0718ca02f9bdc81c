"""The one-kernel decode step (qual/runtime/kernels/decode_layers.py) alone, per tiling, in a CUDA graph.

    python3 bench/fused_decode_bench.py [--context 160] [--tilings 8x32xaxdxqm,...] [--out fused.json]

Random Qwen3-0.6B-shape layer weights (bf16), a paged KV store holding `context` earlier tokens.
Per tiling (see --tilings): microseconds per launch of all 28 layers, the layer weights'
GB/s and the fraction of the measured copy bandwidth, registers / spills per thread, and whether
any barrier timed out. Per --phase-tilings: microseconds per phase, and from each program's arrival stamps how
long barriers wait for the last program and then for it to be let through. Run on the device machine (CUDA).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from gpu_bench import QWEN3_0_6B, copy_bandwidth, replay_seconds  # noqa: E402
from qual.runtime.kernels.decode_layers import StackedWeights, Tiling, decode_layers  # noqa: E402


def random_weights(d: dict, dev) -> StackedWeights:
    g = torch.Generator(device=dev).manual_seed(0)
    L, H, I, NH, NKV, D = (d[k] for k in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                                          "num_key_value_heads", "head_dim"))
    r = lambda *s: (torch.randn(*s, generator=g, device=dev) * 0.02).to(torch.bfloat16)  # noqa: E731
    one = lambda *s: torch.ones(*s, device=dev, dtype=torch.bfloat16)  # noqa: E731
    return StackedWeights(one(L, H), one(L, H), r(L, (NH + 2 * NKV) * D, H), one(L, D), one(L, D), r(L, H, NH * D),
                          r(L, 2 * I, H), r(L, I, H), NH, NKV, D)


def phase_breakdown(run, layers: int) -> dict:
    """Mean microseconds per phase kind, from program 0's timestamps after each barrier: with all phases
    (work 7), none (0: the barriers and prefetches alone), q/k/v (1), attention (2) or the MLP (4) alone."""
    out = {}
    for work in (7, 0, 1, 2, 4):
        info = {"work": work}
        run(info)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run(info)
        total = replay_seconds(graph, 50)
        t = info["times"].cpu().double()
        d = (t[1:] - t[:-1]).view(layers, 4) / 1e3
        out[f"work{work}"] = {"total_us": total * 1e6, "qkv_us": d[:, 0].mean().item(), "attention_us": d[:, 1].mean().item(),
                              "merge_o_us": d[:, 2].mean().item(), "mlp_us": d[:, 3].mean().item(),
                              "regs": info.get("n_regs"), "spills": info.get("n_spills")}
        print(f"work {work}: {total * 1e6:7.1f} us a launch; per layer: qkv {d[:, 0].mean():5.2f}, attention "
              f"{d[:, 1].mean():5.2f}, merge+o {d[:, 2].mean():5.2f}, mlp {d[:, 3].mean():5.2f} us (each incl. its barrier)",
              flush=True)
        if work == 7:
            out["skew"] = arrival_skew(info["arrivals"].cpu().double(), t, layers)
    return out


def arrival_skew(arrivals, times, layers: int) -> dict:
    """Where a barrier's time goes, per phase kind (µs, the mean over layers): from the median program's arrival
    to the last one's (waiting for stragglers), and from the last arrival to program 0 leaving (the barrier's own
    latency); and which programs arrive last most often (the same SMs each time would mean uneven work)."""
    arrivals = arrivals.view(layers, 4, -1)
    last, who = arrivals.max(dim=2)
    straggle = (last - arrivals.median(dim=2).values) / 1e3
    release = (times[1:].view(layers, 4) - last) / 1e3
    kinds = ("qkv", "attention", "merge_o", "mlp")
    res = {k: {"median_to_last_us": straggle[:, i].mean().item(), "last_to_release_us": release[:, i].mean().item()}
           for i, k in enumerate(kinds)}
    counts = torch.bincount(who.flatten(), minlength=arrivals.shape[2])
    top = counts.argsort(descending=True)[:5]
    res["last_most_often"] = {int(p): int(counts[p]) for p in top}
    print("barriers (us, mean a layer): " + ", ".join(
        f"{k} median->last {res[k]['median_to_last_us']:.2f} last->release {res[k]['last_to_release_us']:.2f}" for k in kinds))
    print(f"programs arriving last most often (of {4 * layers} barriers): {res['last_most_often']}", flush=True)
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=160, help="earlier tokens in the KV store")
    ap.add_argument("--tilings", default="8x32xaxdxqm,8x32xaxdxq,8x32xaxdx,8x16xaxdx,8x16xaxdxq",
                    help="comma list of num_warps x MLP rows per step x barrier polls (a: acquire loads, v: volatile "
                         "loads + an acquire atomic) x attention (d: tl.dot, b: broadcast products) x weights requested "
                         "before the barrier (q: q/k/v, m: the MLP's)")
    ap.add_argument("--phase-tilings", default="8x32xaxdxqm", help="tilings to break down per phase")
    ap.add_argument("--layers", type=int, help="run this many layers instead of the model's 28: one layer's weights "
                    "(31.5 MB) stay in H200's L2 across graph replays, which shows what the kernel does when loads hit L2")
    ap.add_argument("--programs", type=int, help="programs (default: one per SM); 2 x SMs with 4-warp tilings puts two "
                    "programs on each SM, if their registers fit")
    ap.add_argument("--key-width", type=int, help="pad the key slots to this many (invisible past the context), as a "
                    "CUDA graph's static key width up to max_model_len does")
    ap.add_argument("--out", default="fused.json")
    args = ap.parse_args()
    dev = torch.device("cuda")
    d = dict(QWEN3_0_6B, num_hidden_layers=args.layers or QWEN3_0_6B["num_hidden_layers"])
    w = random_weights(d, dev)
    L, NKV, D = d["num_hidden_layers"], d["num_key_value_heads"], d["head_dim"]
    S = args.context + 1
    width = max(S, args.key_width or S)
    k = (torch.randn(L, width + 64, NKV, D, device=dev) * 0.5).to(torch.bfloat16)
    v = torch.randn_like(k)
    slots = torch.arange(width, device=dev)
    mask = torch.arange(width, device=dev) < S
    pos = torch.tensor([args.context], device=dev)
    wslot = torch.tensor([args.context], device=dev)
    x0 = (torch.randn(d["hidden_size"], device=dev) * 0.02).to(torch.bfloat16)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, D, 2, device=dev).float() / D))
    sms = args.programs or torch.cuda.get_device_properties(dev).multi_processor_count
    layer_bytes = sum(t.numel() * t.element_size() for t in (w.ln1, w.ln2, w.qkv, w.q_norm, w.k_norm, w.o, w.gate_up, w.down_t))
    kv_bytes = 2 * L * S * NKV * D * 2
    bw = copy_bandwidth()
    res = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "programs": sms, "copy_bandwidth_Bps": bw,
           "layer_weight_bytes": layer_bytes, "kv_bytes": kv_bytes, "context": args.context, "key_width": width, "layers": L,
           "tilings": {}}
    base = Tiling.for_shape(sms, d["hidden_size"], d["intermediate_size"], (d["num_attention_heads"] + 2 * NKV) * D, NKV, D)
    ref = None
    for spec in args.tilings.split(","):
        t = base.with_spec(spec)
        info: dict = {}
        run = lambda: decode_layers(x0, pos, wslot, slots, mask, w, k, v, inv_freq, 1e-6, D**-0.5, sms, t, info=info)  # noqa: E731
        try:
            out, flags = run()  # compiles
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out, flags = run()
            sec = replay_seconds(graph, 200)
        except Exception as exc:  # one failing tiling must not lose the others
            res["tilings"][spec] = {"error": f"{type(exc).__name__}: {exc}"}
            print(spec, res["tilings"][spec]["error"], flush=True)
            continue
        ref = out.clone() if ref is None else ref
        for key in ("times", "arrivals"):  # tensors: not for the JSON
            info.pop(key, None)
        row = {"us": sec * 1e6, "weights_TBps": layer_bytes / sec / 1e12, "of_copy_bw": (layer_bytes + kv_bytes) / sec / bw,
               "flags": flags.tolist(), "max_abs_diff_vs_first": (out - ref).abs().max().item(), **info}
        res["tilings"][spec] = row
        print(f"{spec:>9s}: {row['us']:8.1f} us  {row['weights_TBps']:.2f} TB/s  {100 * row['of_copy_bw']:5.1f}% of copy  "
              f"regs {info.get('n_regs')} spills {info.get('n_spills')} flags {row['flags']} "
              f"diff {row['max_abs_diff_vs_first']:.2e}", flush=True)
    res["phases"] = {}
    for spec in filter(None, args.phase_tilings.split(",")):
        t = base.with_spec(spec)
        print("phases of", spec, flush=True)
        try:
            res["phases"][spec] = phase_breakdown(lambda info: decode_layers(x0, pos, wslot, slots, mask, w, k, v, inv_freq,
                                                                              1e-6, D**-0.5, sms, t, info=info), L)
        except Exception as exc:
            res["phases"][spec] = {"error": f"{type(exc).__name__}: {exc}"}
            print("phases:", res["phases"][spec]["error"], flush=True)
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; layer weights {layer_bytes / 1e6:.1f} MB, KV {kv_bytes / 1e6:.1f} MB; "
          f"{sms} programs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
