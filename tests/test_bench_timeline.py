"""bench/gpu_bench.py's activity_summary: a generate's device activities against the decode graph replayed alone."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
gpu_bench = pytest.importorskip("gpu_bench")


def test_the_span_is_kernels_copies_and_gaps_and_each_decode_kernel_is_held_against_its_lone_replay():
    us = 1000  # ns
    acts = [(0, 10 * us, "attn"), (5 * us, 12 * us, "gemm"),  # overlapping: no gap between them
            (30 * us, 31 * us, "Memcpy HtoD (Pinned -> Device)"),  # 18 us idle before it
            (33 * us, 43 * us, "attn"), (43 * us, 50 * us, "gemm"), (55 * us, 60 * us, "prefill_kernel")]
    s = gpu_bench.activity_summary(acts, {"attn": 8.0, "gemm": 7.0}, decode_steps=2)
    assert s["span_us"] == 60
    assert s["gap_us"] == 18 + 2 + 5 and s["gaps"] == 3
    assert s["gaps_over_10us"] == 1 and s["gap_us_over_10us"] == 18
    assert s["copy_us"] == 1
    assert s["decode_kernel_us"] == 10 + 7 + 10 + 7 and s["alone_kernel_us"] == 2 * 15
    assert s["other_kernel_us"] == 5
    excess = {k["kernel"]: k["us"] for k in s["excess_us_per_step"]}
    assert excess == {"attn": 10 - 8, "gemm": 7 - 7}
    assert s["excess_us_per_step"][0]["kernel"] == "attn"  # the largest difference first


def test_no_activity_is_an_empty_summary():
    assert gpu_bench.activity_summary([], {"attn": 1.0}, 3) == {}


class FakeGraph:
    """A captured decode graph's inputs and replay, as cuda_graphs._Graph has them: each replay reads the inputs
    (recorded here) and advances them, as async decode does."""

    def __init__(self):
        import torch

        self.flat, self.feats = torch.zeros(3, dtype=torch.long), torch.zeros(2)
        self.read = []

    def replay(self, steps: int = 1):
        self.read.append((self.flat.tolist(), self.feats.tolist()))
        self.flat += steps
        self.feats += 0.5 * steps


def test_the_bound_replays_from_the_inputs_of_the_middle_launch_each_time():
    g = FakeGraph()

    def generate():  # five launches of two steps
        for _ in range(5):
            g.replay(2)

    saved = gpu_bench.mid_run_inputs(g, generate, at=2)
    assert [t.tolist() for t in saved] == [[4, 4, 4], [2.0, 2.0]]  # before the third launch
    assert "replay" not in vars(g)  # the graph's own method again
    replay = gpu_bench.restoring_replay(g, saved)
    g.read.clear()
    replay()
    replay()
    assert g.read == [([4, 4, 4], [2.0, 2.0])] * 2
    assert gpu_bench.mid_run_inputs(g, generate, at=5) is None  # a generate of fewer launches: no inputs kept


def test_without_saved_inputs_the_replay_restores_the_inputs_it_held():
    g = FakeGraph()
    g.replay(3)
    replay = gpu_bench.restoring_replay(g)
    g.read.clear()
    replay()
    replay()
    assert g.read == [([3, 3, 3], [1.5, 1.5])] * 2


def test_the_kernel_breakdown_groups_each_kernel_once_by_what_launched_it():
    """--kernels' by-group row: qual's Triton kernels, inductor's and the rest, each kernel counted in one group,
    the groups' sums the table's."""
    time_us = {"_fused_product_kernel": 40.0, "_fused_kernel": 20.0, "_paged_attention_kernel": 8.0,
               "_combine_kernel": 1.0,
               "triton_poi_fused_add_0": 2.5, "nvjet_tst_64x8_64x16": 30.0, "_partials_kernel": 5.0}
    launches = dict.fromkeys(time_us, 2.0)
    groups = gpu_bench.kernel_groups(time_us, launches)
    assert [g["group"] for g in groups] == ["fused-layer products", "gluon-layer products", "split-K products",
                                            "paged attention", "compiled (inductor)", "other"]  # no fused decode ran
    assert groups[3] == {"group": "paged attention", "us": 9.0, "launches": 4.0}
    table = gpu_bench.kernel_table(time_us, launches)
    assert table["groups"] == groups and sum(g["us"] for g in groups) == table["kernel_us_per_step"]
