"""A transformer-only denoiser in Forge's ``backend.nn.flux`` (Flux, Chroma): no U-Net blocks to merge."""

from __future__ import annotations

from torch import nn


class IntegratedFluxTransformer2DModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Conv2d(4, 4, 1)

    def forward(self, x, timesteps=None, context=None, transformer_options={}, **kwargs):
        return self.proj(x)
