"""Stack merging: each selected transformer's tokens merged once at its first block by the level's plan, every
block run on them, and every token restored at its last block's exit (``tome_core.stack``)."""

from __future__ import annotations

import torch

from ..families import first_arg, set_slot
from ..stack import StackPlan, plan_stack
from .base import Method, MethodPatch, default_index_dtype, where_the_work_is
from .levels import LevelPlans


class StackPatch(MethodPatch):
    def __init__(self, patch) -> None:
        super().__init__(patch)
        self.levels = LevelPlans(patch, self._fresh_plan)
        # Per stack, its calls under way: (plan, offsets, merged shape), or None where it runs unmerged.
        self._under_way: list[list] = []

    def _fresh_plan(self, x: torch.Tensor, h: int, w: int) -> StackPlan | None:
        o = self.patch.options
        return plan_stack(x, h, w, o.ratio, o.index_dtype or default_index_dtype(x.device))

    def install(self) -> None:
        patch = self.patch
        for _, recs in patch.transformers:
            under_way: list = []
            self._under_way.append(under_way)
            patch.hook(recs[0].module.register_forward_pre_hook(self._entry(recs[0], under_way), with_kwargs=True))
            patch.hook(recs[-1].module.register_forward_hook(self._exit(under_way)))

    def begin_call(self, args: tuple, kwargs: dict) -> None:
        self.levels.begin_call()
        for under_way in self._under_way:  # a stack left under way by a call that raised
            under_way.clear()

    def uninstall(self) -> None:
        self.levels.clear()
        for under_way in self._under_way:
            under_way.clear()

    def _entry(self, rec, under_way: list):
        """The first block of a stack: its tokens merged by the level's plan, so that every block runs on them."""
        keyword = self.patch.family.tokens_keyword

        def hook(module, args, kwargs):
            x = first_arg(args, kwargs, keyword)
            plan = self.levels.plan(rec, x)
            if plan is None:
                under_way.append(None)
                return None
            merged = plan.merge(x)
            under_way.append((plan, plan.offsets(x, merged), merged.shape))
            args, kwargs = list(args), dict(kwargs)
            set_slot(args, kwargs, 0, keyword, merged)
            return tuple(args), kwargs
        return hook

    def _exit(self, under_way: list):
        """The last block of a stack: its output on the merged tokens back to every token (``StackPlan.restore``)."""
        patch = self.patch

        def hook(module, args, output):
            entry = under_way.pop() if under_way else None
            if entry is None:
                return None
            plan, offsets, merged_shape = entry
            if not (isinstance(output, torch.Tensor) and output.shape == merged_shape):
                # Another extension gave the stack's tokens back itself (or changed them): its output stands.
                patch.unmerged_calls += 1
                return None
            return plan.restore(offsets, output)
        return hook


METHOD = Method("stack", "Stack", ("local_replan",), StackPatch, windowed=True, auto_levels=where_the_work_is)
"""Whole stacks on the merged tokens: nothing to place, nothing to weigh (each group enters every block as one
token). "Auto" levels reach SDXL's deep level, which holds 63% of its work (its first attention level: 17%)."""
