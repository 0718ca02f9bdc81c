"""Which torch.distributed NCCL collectives survive CUDA-graph capture here? (issue 6: the 2-GPU hang)

    python3 bench/nccl_graph_probe.py [--timeout 60]

Each case runs in two fresh processes (one per GPU): eager warm-up of the collective,
capture of a graph holding it, five replays with new inputs, and a check of the values.
A rank that passes its deadline prints every thread's stack and exits, so a hang names
its place instead of eating the call. Prints one line per case and a JSON summary.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import multiprocessing as mp
import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

CASES = ("all_reduce", "broadcast", "all_gather_list", "all_gather_into_tensor", "all_to_all_single",
         "reduce_scatter_tensor")


def _collective(case: str, x: torch.Tensor, world: int) -> torch.Tensor:
    if case == "all_reduce":
        y = x.clone()
        dist.all_reduce(y)
        return y
    if case == "broadcast":
        y = x.clone()
        dist.broadcast(y, src=0)
        return y
    if case == "all_gather_list":
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x)
        return torch.stack(parts)
    if case == "all_gather_into_tensor":
        out = x.new_empty((world, *x.shape))
        dist.all_gather_into_tensor(out, x)
        return out
    if case == "all_to_all_single":
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x)
        return out
    out = x.new_empty((x.shape[0] // world, *x.shape[1:]))
    dist.reduce_scatter_tensor(out, x)
    return out


def _expected(case: str, inputs: list[torch.Tensor], rank: int) -> torch.Tensor:
    world = len(inputs)
    if case == "all_reduce":
        return sum(inputs)
    if case == "broadcast":
        return inputs[0]
    if case in ("all_gather_list", "all_gather_into_tensor"):
        return torch.stack(inputs)
    n = inputs[0].shape[0] // world
    if case == "all_to_all_single":
        return torch.cat([inp[rank * n:(rank + 1) * n] for inp in inputs])
    return sum(inputs)[rank * n:(rank + 1) * n]


def _rank(rank: int, world: int, port: int, case: str, mode: str, timeout: float, q) -> None:
    faulthandler.dump_traceback_later(timeout, exit=True)
    stage = "init"
    try:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout), device_id=torch.device("cuda", rank))

        def value(it: int, r: int) -> torch.Tensor:
            return torch.arange(8 * world, dtype=torch.float32, device="cuda").view(2 * world, 4) * (r + 1) + it

        static = value(0, rank)
        stage = "eager warm-up"
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            _collective(case, static, world)
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        dist.barrier(device_ids=[rank])
        torch.cuda.synchronize()
        stage = f"capture ({mode})"
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, capture_error_mode=mode):
            out = _collective(case, static, world)
        torch.cuda.synchronize()
        stage = "replay"
        for it in range(1, 6):
            static.copy_(value(it, rank))
            g.replay()
            torch.cuda.synchronize()
            want = _expected(case, [value(it, r) for r in range(world)], rank)
            if not torch.equal(out, want):
                raise AssertionError(f"replay {it}: wrong values")
        dist.barrier(device_ids=[rank])
        stage = "destroy_process_group"
        # A live graph holding NCCL kernels makes destroy_process_group hang (seen on 2 x H200,
        # torch 2.11, NCCL 2.28): release the graph first.
        g.reset()
        torch.cuda.synchronize()
        dist.destroy_process_group()
        q.put((rank, "ok", ""))
    except Exception as exc:
        traceback.print_exc()
        q.put((rank, "error", f"{stage}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"))


def run_case(case: str, mode: str, timeout: float) -> dict:
    from qual.runtime.parallel import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, case, mode, timeout, q)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout + 30)
        if p.is_alive():
            p.kill()
    results = {}
    while not q.empty():
        r, status, detail = q.get()
        results[r] = (status, detail)
    status = "ok" if all(results.get(r, ("",))[0] == "ok" for r in range(2)) else "FAILED"
    detail = {r: results.get(r, ("hung or died", f"exit code {procs[r].exitcode}")) for r in range(2)}
    return {"case": case, "mode": mode, "status": status, "ranks": {r: " ".join(v).strip() for r, v in detail.items()}}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--modes", default="thread_local,global")
    args = ap.parse_args()
    if torch.cuda.device_count() < 2:
        print("needs 2 GPUs", file=sys.stderr)
        return 2
    print(f"torch {torch.__version__}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}", flush=True)
    rows = []
    for mode in args.modes.split(","):
        for case in CASES:
            row = run_case(case, mode, args.timeout)
            rows.append(row)
            print(f"{mode:12s} {case:24s} {row['status']:7s} {row['ranks'] if row['status'] != 'ok' else ''}", flush=True)
    print(json.dumps(rows))
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
    sys.exit(main())
