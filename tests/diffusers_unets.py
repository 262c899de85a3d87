"""Small real diffusers U-Nets for tests, in SD 1.x, SD 2.x and SDXL layouts, and ldm twins of them.

``twin_unets`` builds an ldm U-Net (``tests/unets.py``) and converts its weights into a diffusers
``UNet2DConditionModel`` with diffusers' own checkpoint conversion (``diffusers.loaders.single_file_utils``),
so the two hold the same weights and must compute the same function.
"""

from __future__ import annotations

import torch
from torch import nn

from unets import CONTEXT_DIM, LAYOUTS, tiny_unet

# Layouts built directly with diffusers' classes (channels small, structure as the real models).
CONFIGS = {
    # SD 1.x: three attention levels and a plain lowest one, conv projections, heads given as a count.
    "sd1": dict(down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D",
                                  "DownBlock2D"),
                up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
                block_out_channels=(32, 64, 64, 64), attention_head_dim=2, use_linear_projection=False),
    # SD 2.x: linear projections and per-level head counts.
    "sd2": dict(down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D",
                                  "DownBlock2D"),
                up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
                block_out_channels=(32, 64, 64, 64), attention_head_dim=(2, 4, 4, 4), use_linear_projection=True),
    # SDXL: no attention at full resolution, deeper transformers below, the text-and-time embedding.
    "sdxl": dict(down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
                 up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
                 block_out_channels=(32, 64, 64), attention_head_dim=(2, 4, 4), use_linear_projection=True,
                 transformer_layers_per_block=(1, 2, 2), addition_embed_type="text_time",
                 addition_time_embed_dim=8, projection_class_embeddings_input_dim=8 * 6 + 16),
    # The SDXL refiner: attention at the two middle levels only, four levels.
    "refiner": dict(down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D",
                                      "DownBlock2D"),
                    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
                    block_out_channels=(32, 64, 64, 64), attention_head_dim=(2, 4, 4, 4),
                    use_linear_projection=True, transformer_layers_per_block=2, addition_embed_type="text_time",
                    addition_time_embed_dim=8, projection_class_embeddings_input_dim=8 * 5 + 16),
}
POOLED_DIM = 16  # SDXL's pooled text embedding, at test size


def diffusers_unet(layout: str = "sd1", seed: int = 0, **overrides) -> nn.Module:
    from diffusers import UNet2DConditionModel

    torch.manual_seed(seed)
    config = dict(sample_size=16, in_channels=4, out_channels=4, layers_per_block=1, norm_num_groups=8,
                  cross_attention_dim=CONTEXT_DIM, **CONFIGS[layout])
    config.update(overrides)
    return UNet2DConditionModel(**config).eval()


def unet_kwargs(unet: nn.Module, batch: int, seed: int = 0) -> dict:
    """Extra inputs a layout needs (SDXL's pooled text and size conditioning), fixed by ``seed``."""
    if getattr(unet.config, "addition_embed_type", None) != "text_time":
        return {}
    gen = torch.Generator().manual_seed(seed + 7)
    n_ids = (unet.config.projection_class_embeddings_input_dim - POOLED_DIM) // unet.config.addition_time_embed_dim
    return {"added_cond_kwargs": {"text_embeds": torch.randn(batch, POOLED_DIM, generator=gen),
                                  "time_ids": torch.rand(batch, n_ids, generator=gen) * 512}}


def run_diffusers(unet: nn.Module, x: torch.Tensor, t: torch.Tensor, context: torch.Tensor, **extra) -> torch.Tensor:
    with torch.no_grad():
        return unet(x, t, encoder_hidden_states=context, **unet_kwargs(unet, x.shape[0]), **extra).sample


def _original_config(layout: str, channels: int) -> dict:
    """The ldm model config that ``tiny_unet(layout)`` is built from, as diffusers' converter reads it."""
    params = dict(LAYOUTS[layout], in_channels=4, out_channels=4, model_channels=channels, num_res_blocks=1,
                  transformer_depth=1, context_dim=CONTEXT_DIM)
    return {"model": {"params": {
        "unet_config": {"params": params},
        "first_stage_config": {"params": {"ddconfig": {"ch_mult": [1, 2, 4, 4]}}},
    }}}


def twin_unets(layout: str = "sd1", channels: int = 32, seed: int = 0) -> tuple[nn.Module, nn.Module]:
    """(ldm U-Net, diffusers U-Net) with the same weights, by diffusers' own ldm checkpoint conversion."""
    from diffusers import UNet2DConditionModel
    from diffusers.loaders.single_file_utils import (convert_ldm_unet_checkpoint,
                                                     create_unet_diffusers_config_from_ldm)

    ldm = tiny_unet(layout, channels=channels, seed=seed)
    checkpoint = {f"model.diffusion_model.{k}": v for k, v in ldm.state_dict().items()}
    config = create_unet_diffusers_config_from_ldm(_original_config(layout, channels), checkpoint)
    # tiny_unet's group norms have 32 groups, as ldm's always do.
    unet = UNet2DConditionModel(**{**config, "norm_num_groups": 32}).eval()
    converted = convert_ldm_unet_checkpoint(checkpoint, config)
    unet.load_state_dict(converted, strict=True)
    return ldm, unet
