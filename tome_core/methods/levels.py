"""One plan per U-Net level and call, kept for a few sampling evaluations: what the local and stack methods share.

A level's plan is made from the first selected block (or stack) of the level that a U-Net call reaches, on its
input, and every other block of the level in that call uses it (down and up path). With ``local_replan`` k > 1
the plan of an evaluation is also kept for the next k − 1 evaluations, by call slot (the order of the call
within its evaluation: cond and uncond apart, a second-order step's two evaluations), as the patch's
``CallClock`` places each call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch

from .base import BlockRecord

if TYPE_CHECKING:
    from ..patch import TokenMergePatch


class LevelPlans:
    """The level plans of one patch: this call's by level, and those kept for reuse by (level, call slot, grid).

    ``make(x, h, w)`` makes a fresh plan from a level's input ``x`` (B, h·w, C), or returns None when nothing
    merges; a plan has ``fits(x)``.
    """

    def __init__(self, patch: TokenMergePatch, make: Callable[[torch.Tensor, int, int], Any]) -> None:
        self.patch = patch
        self.make = make
        self._this_call: dict[int, Any] = {}
        self._kept: dict[tuple, Any] = {}
        self._slot: int | None = None
        self._fresh = True

    def begin_call(self) -> None:
        """A new U-Net call: forget its plans, and say whether it plans afresh or reuses its slot's. Without
        progress, or with ``local_replan`` 1, every call plans afresh."""
        self._this_call.clear()
        every = self.patch.options.local_replan
        clock = self.patch.clock
        if clock.slot is None or every <= 1:
            self._slot, self._fresh = None, True
            self._kept.clear()
            return
        if clock.new_run:
            self._kept.clear()
        self._slot = clock.slot
        self._fresh = clock.evaluation % every == 0

    def plan(self, rec: BlockRecord, x: torch.Tensor) -> Any:
        """The plan of ``rec``'s level for this call (see the module), or None: outside the step window, at
        ratio 0, or when ``x`` is not the level's h×w tokens."""
        patch = self.patch
        if patch.options.ratio <= 0 or not patch.acts_on(rec, x):
            return None
        h, w = rec.grid
        if not patch.has_call_hook:  # a lone transformer: no call boundary to share a plan within
            return self.make(x, h, w)
        if rec.level in self._this_call:
            plan = self._this_call[rec.level]
            return plan if plan is not None and plan.fits(x) else None
        key = (rec.level, self._slot, h, w)
        plan = None
        if self._slot is not None and not self._fresh:
            kept = self._kept.get(key)
            plan = kept if kept is not None and kept.fits(x) else None
        if plan is None:
            plan = self.make(x, h, w)
            if self._slot is not None:
                self._kept[key] = plan
        self._this_call[rec.level] = plan
        return plan

    def clear(self) -> None:
        self._this_call.clear()
        self._kept.clear()
