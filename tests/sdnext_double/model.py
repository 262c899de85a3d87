"""A real, tiny SD 1.5-layout diffusers pipeline, as SD.Next holds it in ``shared.sd_model``.

Real diffusers classes (``UNet2DConditionModel``, ``AutoencoderKL``, ``EulerDiscreteScheduler``,
``StableDiffusionPipeline`` and, for img2img and the hires pass, ``StableDiffusionImg2ImgPipeline`` built from
the same components) at a tiny size: SD 1.5's block layout (CrossAttnDownBlock2D x3 + DownBlock2D, attention
at downsample 1, 2, 4 and in the mid block), narrow channels. SD.Next encodes prompts itself and hands the
pipeline ``prompt_embeds``; the double's prompt encoder is a fixed random embedding per prompt.
"""

from __future__ import annotations

import zlib

import torch

CONTEXT_DIM = 32
TOKENS = 8


def tiny_unet(seed: int = 0):
    from diffusers import UNet2DConditionModel

    torch.manual_seed(seed)
    unet = UNet2DConditionModel(
        sample_size=16, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=(32, 64, 64, 64), norm_num_groups=8, cross_attention_dim=CONTEXT_DIM,
        attention_head_dim=2,
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"))
    return unet.eval()


def tiny_vae(seed: int = 1):
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, layers_per_block=1,
                        block_out_channels=(8, 8, 16, 16), norm_num_groups=4,
                        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4)
    return vae.eval()


def tiny_pipeline():
    """A txt2img ``StableDiffusionPipeline`` (no text encoder: prompts come as embeddings, as in SD.Next)."""
    from diffusers import EulerDiscreteScheduler, StableDiffusionPipeline

    scheduler = EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                       num_train_timesteps=1000, steps_offset=1)
    pipe = StableDiffusionPipeline(vae=tiny_vae(), text_encoder=None, tokenizer=None, unet=tiny_unet(),
                                   scheduler=scheduler, safety_checker=None, feature_extractor=None,
                                   requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def encode_prompts(prompts: list[str]) -> torch.Tensor:
    """SD.Next's prompt encoding stand-in: a fixed (TOKENS, CONTEXT_DIM) embedding per prompt."""
    return torch.stack([torch.randn(TOKENS, CONTEXT_DIM, generator=torch.Generator().manual_seed(
        zlib.crc32(prompt.encode()))) for prompt in prompts])
