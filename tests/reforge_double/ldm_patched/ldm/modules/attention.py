"""``ldm_patched.ldm.modules.attention``: Forge's block and attention behaviour (the Forge double's) with what
reForge does differently: self-attention called without ``transformer_options`` and the residual added out
of place. ``FORGE_CLASSIC`` switches to Forge Classic's call, which passes ``transformer_options`` again."""

from __future__ import annotations

from backend.nn import unet as forge

FORGE_CLASSIC = False


class CrossAttention(forge.CrossAttention):
    pass


class BasicTransformerBlock(forge.BasicTransformerBlock):
    attention_class = CrossAttention
    in_place_residual = False

    @property
    def attention_gets_options(self) -> bool:
        return FORGE_CLASSIC


class SpatialTransformer(forge.SpatialTransformer):
    block_class = BasicTransformerBlock
