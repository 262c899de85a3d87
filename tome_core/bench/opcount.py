"""What a method costs the host: tensor operations dispatched from Python per patched transformer block.

On a fast GPU a 512 px step waits on the host, so each torch call a merge adds costs time even when its kernel
is tiny. The count is every torch function and tensor method called from Python in one U-Net call (through
``torch.overrides.TorchFunctionMode``: what reaches torch's Python dispatch, metadata calls such as ``dim()``
included), patched minus unpatched, divided by the blocks whose own count changed. Operations a method makes
once per U-Net call (outside any block, or at its first block for all of them) are shared out over its
blocks, which is what they cost per block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode


class _Counter(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.total += 1
        return func(*args, **(kwargs or {}))


@dataclass(frozen=True)
class OpCount:
    """Torch calls of one U-Net call: in total, and inside each transformer block (by its place in the model)."""

    total: int
    per_block: tuple[int, ...]


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """Every ldm/sgm ``BasicTransformerBlock`` (or look-alike: attn1, attn2, ff) under ``model``, in order."""
    return [m for m in model.modules() if all(hasattr(m, a) for a in ("attn1", "attn2", "ff", "norm1"))]


def count_ops(model: nn.Module, call: Callable[[], object]) -> OpCount:
    """Torch calls made by ``call()`` (one U-Net or block call on ``model``), in total and per block."""
    blocks = transformer_blocks(model)
    counter = _Counter()
    inside = [0] * len(blocks)
    starts: dict[int, int] = {}
    handles = []
    for i, blk in enumerate(blocks):
        # Registered now, so they run outside any method's own block hooks: a method's pre-hook work counts
        # as the block's.
        handles.append(blk.register_forward_pre_hook(lambda m, a, i=i: starts.__setitem__(i, counter.total),
                                                     prepend=True))
        handles.append(blk.register_forward_hook(
            lambda m, a, o, i=i: inside.__setitem__(i, inside[i] + counter.total - starts.pop(i))))
    try:
        with torch.no_grad(), counter:
            call()
    finally:
        for handle in handles:
            handle.remove()
    return OpCount(counter.total, tuple(inside))


def ops_per_block(plain: OpCount, patched: OpCount) -> float | None:
    """Torch calls a patched block adds: (patched − plain) in total over the blocks whose count changed; None
    when no block changed (nothing patched at this size)."""
    changed = sum(p != q for p, q in zip(plain.per_block, patched.per_block))
    if changed == 0:
        return None
    return (patched.total - plain.total) / changed
