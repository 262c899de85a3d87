"""``ldm_patched.ldm.modules.diffusionmodules.openaimodel``: the U-Net reForge and Forge Classic sample with."""

from __future__ import annotations

from backend.nn.unet import IntegratedUNet2DConditionModel

from ..attention import SpatialTransformer


class UNetModel(IntegratedUNet2DConditionModel):
    """Built around an ldm ``UNetModel``'s modules (so one checkpoint loads into both)."""

    transformer_class = SpatialTransformer
