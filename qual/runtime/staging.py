"""Host <-> device transfers of a step: its host-built inputs in one copy, its results in one readback.

A decode step's metadata is a few dozen small integer and bool tensors built on the host. Sent one by one, each is
a synchronous pageable copy; packed at fixed offsets of one flat byte buffer (a `Layout`), they cross in one
non-blocking copy from page-locked memory, and the device reads views of the flat buffer it lands in. A CUDA graph
keeps such a buffer as its static inputs: a replay only refills it.

Tensors already on the device (the pending draft context) are not packed: they are copied device to device.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, is_dataclass, replace
from typing import Iterator

import torch

from qual.runtime.paged import KeyView

# Every packed tensor starts at a multiple of this many bytes, so each byte slice can be viewed as its dtype.
ALIGN = 16


def leaves(tree) -> list[torch.Tensor]:
    """The tensors of a step's inputs the device reads, in a fixed order.

    A KeyView's global positions are left out: only the host reads them (the masks are built from them there).
    """
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, KeyView):
        return [tree.slots, tree.valid, tree.lengths]
    if isinstance(tree, dict):
        return [t for k in sorted(tree) for t in leaves(tree[k])]
    if isinstance(tree, (tuple, list)):
        return [t for x in tree for t in leaves(x)]
    if is_dataclass(tree):
        return [t for f in fields(tree) for t in leaves(getattr(tree, f.name))]
    return []


def with_leaves(tree, new: Iterator[torch.Tensor]):
    """The same tree with its leaves() replaced, in order, by `new`'s tensors."""
    if isinstance(tree, torch.Tensor):
        return next(new)
    if isinstance(tree, KeyView):
        return KeyView(next(new), tree.positions, next(new), next(new))
    if isinstance(tree, dict):
        out = {k: with_leaves(tree[k], new) for k in sorted(tree)}
        return {k: out[k] for k in tree}  # the caller's key order
    if isinstance(tree, (tuple, list)):
        return type(tree)(with_leaves(x, new) for x in tree)
    if is_dataclass(tree):
        return replace(tree, **{f.name: with_leaves(getattr(tree, f.name), new) for f in fields(tree)})
    return tree


def _signature(tensors: list[torch.Tensor]) -> tuple:
    return tuple((t.dtype, tuple(t.shape)) for t in tensors)


class Layout:
    """Where each of a list of tensors (by dtype and shape) lies in one flat byte buffer."""

    def __init__(self, signature: tuple):
        self.signature = signature
        self.offsets, end = [], 0
        for dtype, shape in signature:
            self.offsets.append(end)
            size = _numel(shape) * _itemsize(dtype)
            end += -(-size // ALIGN) * ALIGN
        self.nbytes = end

    @classmethod
    def of(cls, tensors: list[torch.Tensor]) -> "Layout":
        return cls(_signature(tensors))

    def matches(self, tensors: list[torch.Tensor]) -> bool:
        return _signature(tensors) == self.signature

    def views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """Each tensor's place in `buffer` (uint8, at least nbytes), as a tensor of its dtype and shape."""
        out = []
        for off, (dtype, shape) in zip(self.offsets, self.signature):
            size = _numel(shape) * _itemsize(dtype)
            out.append(buffer[off : off + size].view(dtype).view(shape))
        return out

    def pack(self, tensors: list[torch.Tensor], buffer: torch.Tensor) -> None:
        """Write the tensors into their places in buffer (plain copies: the values are bit-identical)."""
        copy_all(self.views(buffer), tensors)


def copy_all(dst: list[torch.Tensor], src: list[torch.Tensor], non_blocking: bool = False) -> None:
    """dst[i].copy_(src[i]) for every i, in one call where torch has one."""
    if dst:
        torch._foreach_copy_(dst, src, non_blocking=non_blocking)


def _numel(shape: tuple) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


@dataclass
class Staged:
    """A step's inputs on the device: `tree` reads `packed` (views of one flat `buffer`) and `device`."""

    tree: object
    layout: Layout
    buffer: torch.Tensor  # uint8 [layout.nbytes] on the device
    packed: list[torch.Tensor]  # the host-built leaves' places in buffer, in leaves() order among themselves
    device: list[torch.Tensor]  # the leaves that were already on the device, likewise


class _Slot:
    """One host staging buffer, and the event of the last copy out of it."""

    def __init__(self):
        self.buffer: torch.Tensor | None = None
        self.event = None
        self.views: dict[tuple, list[torch.Tensor]] = {}  # layout signature -> views of buffer


class Stager:
    """Sends a step's inputs to the device in one copy.

    On CUDA the host packs into page-locked memory and the copy does not block the host. Two staging buffers
    alternate, and each waits for the event of its own last copy before it is written again: the copy of one step
    may still be in flight while the host builds the next. On the CPU the host packs straight into the flat buffer
    the step reads (static shapes exercise the graphs' input path there); nothing is asynchronous.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self._slots = [_Slot(), _Slot()]
        self._next = 0
        self._layouts: dict[tuple, Layout] = {}

    def layout(self, tensors: list[torch.Tensor]) -> Layout:
        sig = _signature(tensors)
        if sig not in self._layouts:
            self._layouts[sig] = Layout(sig)
        return self._layouts[sig]

    def send(self, tree, into: Staged | None = None) -> Staged:
        """The tree's host tensors packed and copied to the device in one transfer.

        into: a Staged of the same layout (a CUDA graph's static inputs) refilled in place; else a new buffer.
        """
        all_leaves = leaves(tree)
        host = [t for t in all_leaves if t.device.type == "cpu"]
        on_device = [t for t in all_leaves if t.device.type != "cpu"]
        if into is not None:
            if not into.layout.matches(host) or len(on_device) != len(into.device):
                raise ValueError("step inputs do not match the static inputs' layout (shapes changed)")
            self._transfer(into, host)
            copy_all(into.device, on_device, non_blocking=True)
            return into
        layout = self.layout(host)
        buffer = torch.empty(layout.nbytes, dtype=torch.uint8, device=self.device)
        staged = Staged(None, layout, buffer, layout.views(buffer), on_device)
        self._transfer(staged, host)
        packed, rest = iter(staged.packed), iter(on_device)
        staged.tree = with_leaves(tree, (next(packed) if t.device.type == "cpu" else next(rest) for t in all_leaves))
        return staged

    def _transfer(self, staged: Staged, host: list[torch.Tensor]) -> None:
        """host into staged's buffer: packed into the next staging buffer, then one copy (CUDA); packed in place (CPU)."""
        if not self.cuda:
            copy_all(staged.packed, host)
            return
        layout = staged.layout
        slot = self._slots[self._next]
        self._next ^= 1
        if slot.event is not None:
            slot.event.synchronize()  # its last copy has left: safe to overwrite
        if slot.buffer is None or slot.buffer.numel() < layout.nbytes:
            size = max(layout.nbytes, 2 * (0 if slot.buffer is None else slot.buffer.numel()))
            slot.buffer = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            slot.views.clear()
        views = slot.views.get(layout.signature)
        if views is None:
            views = slot.views[layout.signature] = layout.views(slot.buffer)
        copy_all(views, host)
        staged.buffer.copy_(slot.buffer[: layout.nbytes], non_blocking=True)
        slot.event = slot.event or torch.cuda.Event()
        slot.event.record()


class Readback:
    """One device -> host copy of a step's results into page-locked memory, then one wait (CUDA); the CPU: as is."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._buffer: torch.Tensor | None = None
        self._event = torch.cuda.Event() if self.cuda else None

    def fetch(self, t: torch.Tensor) -> torch.Tensor:
        """t on the host. On CUDA the result is a view of a reused buffer: valid until the next fetch."""
        if not self.cuda:
            return t
        n = t.numel() * t.element_size()
        if self._buffer is None or self._buffer.numel() < n:
            self._buffer = torch.empty(max(n, 4096), dtype=torch.uint8, pin_memory=True)
        host = self._buffer[:n].view(t.dtype).view(t.shape)
        host.copy_(t, non_blocking=True)
        self._event.record()
        self._event.synchronize()
        return host
