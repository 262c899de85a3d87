"""Local merging: self-attention's keys and values from the tokens that stand for the groups merged inside 2×2
windows, by one plan per level and U-Net call (``tome_core.local``); queries whole."""

from __future__ import annotations

import torch

from ..local import LocalPlan, plan_local
from .base import BlockPlanMethod, BlockRecord, Method, default_index_dtype, kv_reducer
from .levels import LevelPlans


class LocalPatch(BlockPlanMethod):
    def __init__(self, patch) -> None:
        super().__init__(patch)
        self.levels = LevelPlans(patch, self._fresh_plan)

    def _fresh_plan(self, x: torch.Tensor, h: int, w: int) -> LocalPlan | None:
        o = self.patch.options
        return plan_local(x, h, w, o.ratio, o.index_dtype or default_index_dtype(x.device), self.patch.weighs_keys)

    def begin_call(self, args: tuple, kwargs: dict) -> None:
        self.levels.begin_call()

    def uninstall(self) -> None:
        self.levels.clear()

    def plan_for(self, rec: BlockRecord, x: torch.Tensor) -> LocalPlan | None:
        return self.levels.plan(rec, x) if rec.self_attention else None

    def hook_block(self, rec: BlockRecord) -> None:
        self.patch.hook(rec.module.attn1.register_forward_pre_hook(kv_reducer(self.patch, rec), with_kwargs=True))


METHOD = Method("local", "Local", ("local_replan", "size_weighted_keys"), LocalPatch, windowed=True)
"""Size-weighted keys off by "Auto": further per step at 0.25 on all three proxies, no change at 0.5 and 0.75,
where its groups are equal."""
