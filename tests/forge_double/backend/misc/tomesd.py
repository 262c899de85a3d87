"""Forge's built-in token merging (Settings -> "Token merging ratio"), as it behaves: on a clone of the
patcher, an ``attn1_patch`` merges only self-attention's queries (keys and values stay whole) at full latent
resolution, and an ``attn1_output_patch`` unmerges. The matching is tomesd's, with a random partition."""

from __future__ import annotations

import torch
import tomesd.merge

from backend.patcher.unet import UnetPatcher


class TomePatcher:
    def patch(self, model: UnetPatcher, ratio: float) -> UnetPatcher:
        unmerges = {}

        def merge_queries(q, k, v, extra_options):
            original = extra_options["original_shape"]
            tokens = q.shape[1]
            if tokens != original[2] * original[3]:  # only at full latent resolution
                return q, k, v
            w = original[3]
            h = tokens // w
            generator = torch.Generator(device=q.device).manual_seed(0)
            m, u = tomesd.merge.bipartite_soft_matching_random2d(q, w, h, 2, 2, int(tokens * ratio),
                                                                 no_rand=False, generator=generator)
            unmerges["u"] = u
            return m(q), k, v

        def unmerge_output(n, extra_options):
            u = unmerges.pop("u", None)
            return n if u is None else u(n)

        clone = model.clone()
        clone.set_model_attn1_patch(merge_queries)
        clone.set_model_attn1_output_patch(unmerge_output)
        return clone
