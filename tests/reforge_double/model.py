"""Tiny real U-Nets in reForge's model object: an ldm ``LatentDiffusion`` shell carrying ``forge_objects``."""

from __future__ import annotations

from typing import Any

from torch import nn


def reforge_unet(ldm_unet: nn.Module) -> nn.Module:
    """reForge's U-Net class around ``ldm_unet``'s modules (shared: the same parameters)."""
    from ldm_patched.ldm.modules.diffusionmodules.openaimodel import UNetModel

    return UNetModel(ldm_unet).eval()


def tiny_reforge_model(unet: nn.Module | None = None) -> Any:
    """``shared.sd_model`` in reForge around a tiny U-Net: ``model.diffusion_model`` and
    ``forge_objects.unet.model.diffusion_model`` are the same module."""
    from forge_double.model import tiny_forge_model
    from webui_double.model import DiffusionWrapper, tiny_unet

    model = tiny_forge_model(unet if unet is not None else reforge_unet(tiny_unet()))
    model.model = DiffusionWrapper(model.unet)
    return model
