"""Tiny real U-Nets in Forge's model objects: ldm's modules behind Forge's classes and call signatures."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn


def forge_unet(ldm_unet: nn.Module) -> nn.Module:
    """Forge's U-Net class around ``ldm_unet``'s modules (shared: the same parameters)."""
    from backend.nn.unet import IntegratedUNet2DConditionModel

    return IntegratedUNet2DConditionModel(ldm_unet).eval()


class TinyForgeModel:
    """``shared.sd_model`` in Forge: an engine with ``forge_objects`` and no ``.model``. ``observers`` are
    called before every U-Net call, as in the A1111 double's model."""

    def __init__(self, unet: nn.Module | None = None, engine: str = "StableDiffusion") -> None:
        from backend import diffusion_engine
        from backend.patcher.unet import KModel, UnetPatcher
        from webui_double.model import tiny_unet

        unet = unet if unet is not None else forge_unet(tiny_unet())
        self.engine = getattr(diffusion_engine, engine)(UnetPatcher(KModel(unet)))
        self.observers: list[Callable[..., None]] = []
