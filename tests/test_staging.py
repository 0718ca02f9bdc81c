"""One packed host-to-device transfer per step and one readback: the round trips give back exactly what went in."""

import pytest
import torch

from qual.runtime.models.base import AttentionView, DraftMeta, TargetMeta
from qual.runtime.paged import KeyView
from qual.runtime.sampling import choose_tokens, pack_choices, top2_margins, unpack_choices
from qual.runtime.staging import ALIGN, Layout, Readback, Stager, leaves, with_leaves

CPU = torch.device("cpu")


def key_view(r=2, s=5):
    return KeyView(torch.arange(r * s).view(r, s), torch.arange(r * s).view(r, s) + 100,
                   torch.arange(r * s).view(r, s) % 3 == 0, torch.tensor([3, 5], dtype=torch.int32))


def step_tree():
    """A decode step's inputs as the runner builds them: several dtypes, an empty tensor, nested views."""
    view = AttentionView(torch.tensor([7, 8, 9]), key_view(), torch.rand(2, 3, 5) > 0.5, None)
    target = TargetMeta(torch.arange(6).view(2, 3), {"b": view, "a": AttentionView(torch.zeros(0, dtype=torch.long),
                                                                                  key_view(), torch.ones(2, 3, 5, dtype=torch.bool))},
                        dense=True)
    draft = DraftMeta(torch.arange(4), {"d": torch.tensor([1, 2, 3, 4])}, {"d": key_view()}, torch.arange(6).view(2, 3),
                      {"d": torch.rand(2, 3, 8) > 0.3})
    return (torch.tensor([5, 6]), target, draft, torch.randn(4, 3, dtype=torch.float64), torch.randn(3, 2).bfloat16())


def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_layout_round_trip_is_exact():
    tensors = leaves(step_tree())
    layout = Layout.of(tensors)
    buf = torch.empty(layout.nbytes, dtype=torch.uint8)
    layout.pack(tensors, buf)
    got = layout.views(buf)
    assert all(same(g, t) for g, t in zip(got, tensors, strict=True))
    assert all(g.data_ptr() % ALIGN == 0 for g in got if g.numel())  # every dtype view starts aligned
    assert all(g.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr() for g in got)  # views, not copies


def test_send_keeps_the_tree_and_host_only_positions():
    tree = step_tree()
    staged = Stager(CPU).send(tree)
    out = staged.tree
    assert all(same(a, b) for a, b in zip(leaves(out), leaves(tree), strict=True))
    assert out[1].views["b"].keys.positions is tree[1].views["b"].keys.positions  # only the host reads them
    assert list(out[1].views) == ["b", "a"] and out[1].dense is True  # key order and non-tensor fields kept
    buf = staged.buffer.untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == buf for t in leaves(out))  # one flat buffer holds them all


def test_send_into_refills_the_static_buffer_in_place():
    stager = Stager(CPU)
    staged = stager.send(step_tree())
    static = leaves(staged.tree)
    for _ in range(3):  # more steps than staging buffers
        new = step_tree()
        assert stager.send(new, into=staged) is staged
        assert all(same(s, t) for s, t in zip(static, leaves(new), strict=True))
    wider = step_tree()
    wider = (torch.tensor([5, 6, 7]), *wider[1:])
    with pytest.raises(ValueError, match="layout"):
        stager.send(wider, into=staged)


def test_with_leaves_replaces_in_leaves_order():
    tree = step_tree()
    marks = [torch.full((1,), i) for i in range(len(leaves(tree)))]
    out = with_leaves(tree, iter(marks))
    assert [int(t) for t in leaves(out)] == list(range(len(marks)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("drafts", [True, False])
def test_packed_choices_equal_the_separate_reads(dtype, drafts):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, 50, generator=g).to(dtype)
    logits[0, 1, :2] = 7.0  # an exact tie: margin 0, first index wins
    logits[1, 2, 5] = float("inf")
    proposals = torch.randint(0, 50, (3, 3), generator=g) if drafts else None
    tokens, margins, got = unpack_choices(Readback(CPU).fetch(pack_choices(logits, proposals)), logits.shape[1])
    assert tokens == logits.argmax(dim=-1).tolist()
    assert tokens == [choose_tokens(row, 0, 0, "r", 0) for row in logits]
    assert margins == top2_margins(logits)  # bit-identical float32 values
    assert got == (proposals.tolist() if drafts else None)
