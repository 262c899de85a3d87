"""Tiny real U-Nets in Forge's model objects: ldm's modules behind Forge's classes and call signatures."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn


def forge_unet(ldm_unet: nn.Module) -> nn.Module:
    """Forge's U-Net class around ``ldm_unet``'s modules (shared: the same parameters)."""
    from backend.nn.unet import IntegratedUNet2DConditionModel

    return IntegratedUNet2DConditionModel(ldm_unet).eval()


class _TinyForgeEngine:
    """What the double's samplers and tests need of ``shared.sd_model`` on top of Forge's engine: conditioning,
    the model call through this pass's ``forge_objects.unet`` (with its patches), and ``observers`` called
    before every U-Net call, as in the A1111 double's model."""

    sd_checkpoint_info = None

    def _setup(self, unet: nn.Module) -> None:
        from backend.patcher.unet import KModel, UnetPatcher

        super().__init__(UnetPatcher(KModel(unet)))
        self.observers: list[Callable[..., None]] = []

    @property
    def unet(self) -> nn.Module:
        """The U-Net module tree every clone of the patcher shares."""
        return self.forge_objects_original.unet.model.diffusion_model

    def load_unet_weights(self, state_dict: dict) -> None:
        self.unet.load_state_dict(state_dict)

    def builtin_token_merging_on(self) -> bool:
        """Forge's built-in token merging is on this pass's patcher."""
        patches = self.forge_objects.unet.model_options["transformer_options"].get("patches", {})
        return any("merge_queries" in getattr(f, "__qualname__", "") for f in patches.get("attn1_patch", ()))

    def get_learned_conditioning(self, prompts: list[str]) -> torch.Tensor:
        from webui_double.model import text_conditioning

        return text_conditioning(prompts)

    def apply_model(self, x: torch.Tensor, t: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        for observer in list(self.observers):
            observer(self, x, t, cond)
        # Forge's sampling function: the pass's patcher, cond/uncond order and sigmas per call.
        return self.forge_objects.unet.apply(x, t, cond, cond_or_uncond=[0] * x.shape[0], sigmas=t)


def tiny_forge_model(unet: nn.Module | None = None, engine: str = "StableDiffusion") -> Any:
    """``shared.sd_model`` in Forge around a tiny U-Net (ldm's SD 1.x layout behind Forge's classes by
    default); ``engine`` is the ``backend.diffusion_engine`` class: "StableDiffusion", "StableDiffusionXL",
    "Flux" (whose denoiser is a transformer with no U-Net blocks)."""
    from backend import diffusion_engine
    from backend.nn.flux import IntegratedFluxTransformer2DModel
    from webui_double.model import tiny_unet

    if unet is None:
        unet = IntegratedFluxTransformer2DModel() if engine == "Flux" else forge_unet(tiny_unet())
    cls = type(f"Tiny{engine}", (_TinyForgeEngine, getattr(diffusion_engine, engine)), {})
    model = cls.__new__(cls)
    model._setup(unet)
    return model
