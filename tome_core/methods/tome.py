"""ToMe (the paper's token merging): in each selected block, a bipartite matching of its input merges the most
similar sources into destinations before self-attention (and, as asked, cross-attention and the MLP) and copies
the result back after (``tome_core.merge``).

The random partition of a block call is a pure function of (seed, the call's timestep, the block): the U-Net
call's timestep is recorded at its start, and the partitions of every selected block are laid out at once at
the call's first block that needs them (``partition_rows``).
"""

from __future__ import annotations

import torch
from torch import nn

from ..families import first_arg, set_slot, slot_value
from ..merge import SplitRows, plan_split, split_rows
from ..partition import cell_choices, fixed_partition, host_key, partition, timestep_words
from .base import (BlockPlanMethod, BlockRecord, Method, add_key_bias, default_index_dtype, map_kv_sources)

DEFAULT_SEED = 0


def default_score_chunk(device: torch.device) -> int:
    """Similarity scores held at once while finding a merge: 4 Mi on the CPU, where smaller chunks stay fast,
    and 64 Mi on accelerators, where many small matmuls would cost launches (128 MiB in fp16)."""
    return 1 << 22 if device.type == "cpu" else 1 << 26


class TomePatch(BlockPlanMethod):
    def __init__(self, patch) -> None:
        super().__init__(patch)
        o = patch.options
        seed = DEFAULT_SEED if o.seed is None else o.seed
        self.keys = [host_key(seed, rec.index) for rec in patch.selected]  # by selected row
        self.timestep: torch.Tensor | float | None = None
        self._tbits: torch.Tensor | None = None
        # This U-Net call's random partitions, one per selected block, by (grid, batch, device, dtype); and the
        # fixed partition's, kept while patched.
        self._random: dict[tuple, list[SplitRows]] = {}
        self._fixed: dict[tuple, list[SplitRows]] = {}
        self._device_keys: dict[torch.device, torch.Tensor] = {}

    def begin_call(self, args: tuple, kwargs: dict) -> None:
        self.timestep = slot_value(args, kwargs, *self.patch.family.timestep_slot)
        self._tbits = None
        self._random.clear()

    def uninstall(self) -> None:
        self._random.clear()
        self._fixed.clear()

    def timestep_bits(self, device: torch.device) -> torch.Tensor:
        if self._tbits is None or self._tbits.device != device:
            self._tbits = timestep_words(self.timestep, device)
        return self._tbits

    def partition_rows(self, h: int, w: int, batch: int, device: torch.device, idt: torch.dtype) -> list[SplitRows]:
        """The partitions of an h×w grid laid out for ``batch`` rows: with the random partition one per
        selected block (item k for selected block k), for this U-Net call only, made at the first block that
        needs them in one pass of tensor ops for all blocks (on a GPU, per-block tensor ops would cost host
        time that the step waits on); with the fixed one a single item, kept while patched."""
        o = self.patch.options
        cache = self._random if o.use_rand else self._fixed
        cache_key = (h, w, batch, device, idt)
        found = cache.get(cache_key)
        if found is None:
            if o.use_rand:
                keys = self._device_keys.get(device)
                if keys is None:
                    keys = self._device_keys[device] = torch.tensor(self.keys, dtype=torch.int32, device=device)
                choice = cell_choices(keys, self.timestep_bits(device), (h // o.sy) * (w // o.sx), o.sx * o.sy)
                src, dst = partition(h, w, o.sx, o.sy, choice, idt)
            else:
                src, dst = fixed_partition(h, w, o.sx, o.sy, device, idt)
            found = cache[cache_key] = split_rows(src, dst, batch, h * w)
        return found

    def plan_for(self, rec: BlockRecord, x: torch.Tensor):
        o = self.patch.options
        h, w = rec.grid
        r = int(x.shape[1] * o.ratio)
        if r <= 0 or (h // o.sy) * (w // o.sx) == 0:
            return None
        idt = o.index_dtype or default_index_dtype(x.device)
        rows = self.partition_rows(h, w, x.shape[0], x.device, idt)
        return plan_split(x, rows[rec.row] if o.use_rand else rows[0], r,
                          o.score_chunk_elements or default_score_chunk(x.device))

    def hook_block(self, rec: BlockRecord) -> None:
        o, blk = self.patch.options, rec.module
        for wanted, sub, self_attention in ((o.merge_attn, blk.attn1, rec.self_attention),
                                            (o.merge_crossattn, blk.attn2, False), (o.merge_mlp, blk.ff, False)):
            if wanted and isinstance(sub, nn.Module):  # diffusers blocks without text have attn2 None
                merged_calls: list[bool] = []  # this module's calls under way: merged or not
                self.patch.hook(sub.register_forward_pre_hook(self._merger(rec, self_attention, merged_calls),
                                                              with_kwargs=True))
                self.patch.hook(sub.register_forward_hook(_unmerger(rec, merged_calls)))

    def _merger(self, rec: BlockRecord, self_attention: bool, merged_calls: list[bool]):
        patch = self.patch
        family = patch.family

        def hook(module, args, kwargs):
            plan = rec.plan
            if plan is None:
                merged_calls.append(False)
                return None
            x = first_arg(args, kwargs, family.tokens_keyword)
            if not (isinstance(x, torch.Tensor) and plan.fits(x)):
                # Called on rows or tokens the plan was not made for (ControlNet's reference mode attends with
                # the unconditional rows alone, HyperTile tiles the tokens): exact attention on that input.
                patch.unmerged_calls += 1
                merged_calls.append(False)
                return None
            rec.used = True
            merged_calls.append(True)
            done = {id(x): plan.merge(x)}
            args, kwargs = list(args), dict(kwargs)
            set_slot(args, kwargs, 0, family.tokens_keyword, done[id(x)])
            if self_attention:  # with x, self-attention's explicit key/value sources
                map_kv_sources(args, kwargs, x, plan.merge, done, family.kv_slots)
                if patch.weighs_keys:
                    add_key_bias(family, rec, kwargs, plan.key_log_sizes(x.dtype))
            return tuple(args), kwargs
        return hook


def _unmerger(rec: BlockRecord, merged_calls: list[bool]):
    def hook(module, args, output):
        # The call that ends now is the innermost one under way (a module's calls nest, never interleave).
        merged = merged_calls.pop() if merged_calls else False
        if not merged or rec.plan is None:
            return None
        return rec.plan.unmerge(output)
    return hook


METHOD = Method("tome", "ToMe", ("sx", "sy", "use_rand", "merge_crossattn", "merge_mlp", "size_weighted_keys"),
                TomePatch, size_weighted_default=True)
"""Size-weighted keys on by "Auto": they correct ToMe's uneven groups (closer per step on all three proxies at
0.25 and 0.5, 0.1 to 0.3 dB further at 0.75; README, "Size-weighted keys")."""
