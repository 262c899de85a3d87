"""Small real ldm U-Nets for tests, in the layouts the webui runs (weights random, nothing zero)."""

from __future__ import annotations

import torch
from torch import nn

LAYOUTS = {
    # SD 1.x: attention at downsample 1, 2 and 4, conv 1×1 projections.
    "sd1": dict(attention_resolutions=[4, 2, 1], channel_mult=[1, 2, 4, 4], num_heads=2,
                use_linear_in_transformer=False),
    # SD 2.x: linear projections and a fixed head width.
    "sd2": dict(attention_resolutions=[4, 2, 1], channel_mult=[1, 2, 4, 4], num_head_channels=16,
                use_linear_in_transformer=True),
    # SDXL's level structure (no attention at full resolution, three levels) with ldm's classes.
    "sdxl": dict(attention_resolutions=[4, 2], channel_mult=[1, 2, 4], num_head_channels=16,
                 use_linear_in_transformer=True),
}
CONTEXT_DIM = 24


def randomize_zero_layers(model: nn.Module, std: float = 0.2) -> nn.Module:
    """ldm zero-initialises every proj_out and the output conv; with those at zero every transformer block
    contributes nothing and all outputs are zero, so any comparison would pass. Give them random values."""
    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".proj_out." in name or name.startswith("out."):
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    return model


def tiny_unet(layout: str = "sd1", channels: int = 32, seed: int = 0, **overrides) -> nn.Module:
    from ldm.modules.diffusionmodules.openaimodel import UNetModel

    torch.manual_seed(seed)
    kw = dict(LAYOUTS[layout], **overrides)
    if "num_heads" not in kw:
        kw["num_heads"] = -1
    model = UNetModel(image_size=32, in_channels=4, out_channels=4, model_channels=channels, num_res_blocks=1,
                      use_spatial_transformer=True, transformer_depth=1, context_dim=CONTEXT_DIM,
                      legacy=False, **kw)
    return randomize_zero_layers(model).eval()


class LatentModel(nn.Module):
    """Stands in for the webui's ``shared.sd_model``: the U-Net sits at ``.model.diffusion_model``."""

    def __init__(self, unet: nn.Module) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.diffusion_model = unet


def inputs(batch: int = 2, h: int = 32, w: int = 32, seed: int = 0, tokens: int = 7):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 4, h, w, generator=gen)
    t = torch.full((batch,), 749.25)
    context = torch.randn(batch, tokens, CONTEXT_DIM, generator=gen)
    return x, t, context


def run(unet: nn.Module, x: torch.Tensor, t: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return unet(x, t, context=context)


def hook_counts(model: nn.Module) -> dict:
    """Every hook dict of every module, by name, to check that a patch leaves nothing behind."""
    out = {}
    for name, m in model.named_modules():
        n = sum(len(getattr(m, a)) for a in ("_forward_pre_hooks", "_forward_hooks",
                                             "_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs")
                if hasattr(m, a))
        if n:
            out[name] = n
    return out
