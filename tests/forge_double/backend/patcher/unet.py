"""Forge's ``UnetPatcher``: the U-Net behind per-clone options, with the patch points extensions use.

``clone()`` shares the model (and so its modules) and deep-copies ``model_options``, so patches set on a clone
never reach the original: Forge hands every sampling pass a fresh clone and drops it afterwards.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

from torch import nn


class KModel(nn.Module):
    """``backend.modules.k_model.KModel``: holds ``diffusion_model`` and turns a sampler's call into a U-Net
    call with the patcher's ``transformer_options``."""

    def __init__(self, diffusion_model: nn.Module) -> None:
        super().__init__()
        self.diffusion_model = diffusion_model

    def apply_model(self, x, t, c_crossattn=None, transformer_options=None, **extra_conds):
        return self.diffusion_model(x, t, context=c_crossattn, transformer_options=transformer_options or {},
                                    **extra_conds)


class UnetPatcher:
    def __init__(self, model: KModel, model_options: dict | None = None) -> None:
        self.model = model
        self.model_options: dict[str, Any] = model_options if model_options is not None else {
            "transformer_options": {}}

    def clone(self) -> "UnetPatcher":
        return UnetPatcher(self.model, copy.deepcopy(self.model_options))

    def set_model_patch(self, patch: Callable, name: str) -> None:
        options = self.model_options["transformer_options"]
        patches = options.setdefault("patches", {})
        patches[name] = patches.get(name, []) + [patch]

    def set_model_patch_replace(self, patch: Callable, name: str, block_name: str, number: int,
                                transformer_index: int | None = None) -> None:
        options = self.model_options["transformer_options"]
        table = options.setdefault("patches_replace", {}).setdefault(name, {})
        key = (block_name, number) if transformer_index is None else (block_name, number, transformer_index)
        table[key] = patch

    def set_model_attn1_patch(self, patch: Callable) -> None:
        self.set_model_patch(patch, "attn1_patch")

    def set_model_attn2_patch(self, patch: Callable) -> None:
        self.set_model_patch(patch, "attn2_patch")

    def set_model_attn1_output_patch(self, patch: Callable) -> None:
        self.set_model_patch(patch, "attn1_output_patch")

    def set_model_attn2_output_patch(self, patch: Callable) -> None:
        self.set_model_patch(patch, "attn2_output_patch")

    def set_model_attn1_replace(self, patch: Callable, block_name: str, number: int,
                                transformer_index: int | None = None) -> None:
        self.set_model_patch_replace(patch, "attn1", block_name, number, transformer_index)

    def set_model_input_block_patch(self, patch: Callable) -> None:
        self.set_model_patch(patch, "input_block_patch")

    def set_model_output_block_patch(self, patch: Callable) -> None:
        self.set_model_patch(patch, "output_block_patch")

    def apply(self, x, t, context, **transformer_extras):
        """A sampler's model call: this patcher's options, copied per call as Forge's sampling function does,
        plus the per-call entries (``cond_or_uncond``, ``sigmas``)."""
        options = dict(self.model_options["transformer_options"])
        options.update(transformer_extras)
        return self.model.apply_model(x, t, c_crossattn=context, transformer_options=options)
