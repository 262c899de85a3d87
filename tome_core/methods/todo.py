"""ToDo (token downsampling, arXiv 2402.13573): self-attention keeps every query and takes its keys and values
from the token grid downsampled by a factor per side (nearest or average pooling); nothing to undo after."""

from __future__ import annotations

import torch

from ..merge import downsample_tokens
from .base import BlockPlanMethod, BlockRecord, Method, kv_reducer


class DownsamplePlan:
    """A block call's ToDo plan: its input's h×w grid downsampled by ``factor`` (``merge``), for inputs of
    ``tokens`` tokens."""

    __slots__ = ("h", "w", "factor", "pool")

    def __init__(self, h: int, w: int, factor: int, pool: str) -> None:
        self.h, self.w, self.factor, self.pool = h, w, factor, pool

    def fits(self, x: torch.Tensor) -> bool:
        return x.dim() == 3 and x.shape[1] == self.h * self.w

    def merge(self, x: torch.Tensor) -> torch.Tensor:
        """(B, h·w, C) -> (B, ceil(h/f)·ceil(w/f), C)."""
        return downsample_tokens(x, self.h, self.w, self.factor, self.pool)


class TodoPatch(BlockPlanMethod):
    def plan_for(self, rec: BlockRecord, x: torch.Tensor) -> DownsamplePlan | None:
        o = self.patch.options
        if o.todo_factor <= 1 or not rec.self_attention:
            return None
        return DownsamplePlan(*rec.grid, o.todo_factor, o.todo_pool)

    def hook_block(self, rec: BlockRecord) -> None:
        self.patch.hook(rec.module.attn1.register_forward_pre_hook(kv_reducer(self.patch, rec), with_kwargs=True))


METHOD = Method("todo", "ToDo", ("todo_factor", "todo_pool"), TodoPatch)
