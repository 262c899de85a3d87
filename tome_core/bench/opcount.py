"""What a method costs the host: tensor operations dispatched per patched transformer block.

On a fast GPU a 512 px step waits on the host, so each operation a merge adds costs time even when its kernel
is tiny. The count is every operation that reaches PyTorch's dispatcher in one U-Net call (through
``torch.utils._python_dispatch.TorchDispatchMode``: each ATen operation, views and in-place updates included;
Python-side metadata such as ``.shape`` or ``dim()``, which launches nothing, is not), patched minus unpatched,
divided by the blocks the method acts in: those whose attention or feed-forward layers receive tensors of other
shapes than unpatched (fewer tokens, downsampled keys and values). A method that swaps every block's class but
merges only in some (tomesd) is so not credited with the blocks where it does nothing. Operations a method makes
once per U-Net call (outside any block, or at its first block for all of them) are shared out over its blocks,
which is what they cost per block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode


class _Counter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.total = 0
        self.paused = False  # while the counter's own hooks look at tensors

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            self.total += 1
        return func(*args, **(kwargs or {}))


@dataclass(frozen=True)
class OpCount:
    """Dispatched operations of one U-Net call: in total, and inside each transformer block (by its place in the
    model)."""

    total: int
    per_block: tuple[int, ...]
    # Per block: the shapes of the tensors its attn1, attn2 and ff were called with.
    shapes: tuple[tuple, ...] = ()
    # Per block: the number of the transformer stack holding it (stacks counted in the model's order).
    stack_of: tuple[int, ...] = ()
    multiply_adds: int = 0  # of the whole call (see ``tome_core.bench.macs``)


@dataclass(frozen=True)
class Cost:
    """What a method adds to one U-Net call against the same call unpatched: dispatched operations per block and
    per transformer stack it acts in (None: it acts in none at this size), and its multiply-adds as a fraction
    of the plain call's (None: not counted)."""

    per_block: float | None
    per_stack: float | None
    multiply_adds: float | None


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """Every ldm/sgm ``BasicTransformerBlock`` (or look-alike: attn1, attn2, ff) under ``model``, in order."""
    return [m for m in model.modules() if all(hasattr(m, a) for a in ("attn1", "attn2", "ff", "norm1"))]


def count_ops(model: nn.Module, call: Callable[[], object]) -> OpCount:
    """Operations dispatched by ``call()`` (one U-Net or block call on ``model``), in total and per block, and
    its multiply-adds."""
    from .macs import MultiplyAddCounter

    blocks = transformer_blocks(model)
    stack_number = {id(blk): k for k, stack in enumerate(m for m in model.modules() if hasattr(m, "transformer_blocks"))
                    for blk in stack.transformer_blocks}
    counter = _Counter()
    inside = [0] * len(blocks)
    shapes: list[list] = [[] for _ in blocks]
    starts: dict[int, int] = {}
    handles = []

    def shape_recorder(i: int):
        def hook(module, args, kwargs):
            counter.paused = True  # the recorder's own look at the tensors is not the method's
            shapes[i].append(tuple(tuple(v.shape) if isinstance(v, torch.Tensor) else None
                                   for v in list(args) + [kwargs[k] for k in sorted(kwargs)]))
            counter.paused = False
        return hook

    for i, blk in enumerate(blocks):
        for sub in (blk.attn1, blk.attn2, blk.ff):
            # Appended after any method's own pre-hooks: it sees what the layer is really called with.
            handles.append(sub.register_forward_pre_hook(shape_recorder(i), with_kwargs=True))
        # Registered now, so they run outside any method's own block hooks: a method's pre-hook work counts
        # as the block's.
        handles.append(blk.register_forward_pre_hook(lambda m, a, i=i: starts.__setitem__(i, counter.total),
                                                     prepend=True))
        handles.append(blk.register_forward_hook(
            lambda m, a, o, i=i: inside.__setitem__(i, inside[i] + counter.total - starts.pop(i))))
    macs = MultiplyAddCounter()
    try:
        # The multiply-add counter inside the op counter: it launches nothing of its own.
        with torch.no_grad(), counter, macs:
            call()
    finally:
        for handle in handles:
            handle.remove()
    return OpCount(counter.total, tuple(inside), tuple(tuple(s) for s in shapes),
                   tuple(stack_number.get(id(blk), -1) for blk in blocks), macs.total)


def ops_per_block(plain: OpCount, patched: OpCount) -> float | None:
    """Operations a patched block adds: (patched − plain) in total over the blocks the method acts in (see
    above; where no layer's input changed shape, the blocks whose own count changed); None when neither
    happened (nothing patched at this size)."""
    acting = sum(p != q for p, q in zip(plain.shapes, patched.shapes))
    if acting == 0:
        acting = sum(p != q for p, q in zip(plain.per_block, patched.per_block))
    if acting == 0:
        return None
    return (patched.total - plain.total) / acting


def _acting(plain: OpCount, patched: OpCount) -> list[bool]:
    """Per block, whether the method acts in it (see ``ops_per_block``)."""
    acting = [p != q for p, q in zip(plain.shapes, patched.shapes)]
    if not any(acting):
        acting = [p != q for p, q in zip(plain.per_block, patched.per_block)]
    return acting


def ops_per_stack(plain: OpCount, patched: OpCount) -> float | None:
    """Operations a patched transformer stack adds: (patched − plain) in total over the stacks holding a block
    the method acts in; None when it acts in none."""
    stacks = {k for k, acts in zip(patched.stack_of, _acting(plain, patched)) if acts}
    if not stacks:
        return None
    return (patched.total - plain.total) / len(stacks)


def added_cost(plain: OpCount, patched: OpCount) -> Cost:
    macs = patched.multiply_adds / plain.multiply_adds if plain.multiply_adds else None
    return Cost(ops_per_block(plain, patched), ops_per_stack(plain, patched), macs)
