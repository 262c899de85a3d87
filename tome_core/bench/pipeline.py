"""What a fidelity run needs of a model, whatever it came from (a user's checkpoint, the shipped proxy).

A ``Pipeline`` is the U-Net with everything needed to sample from it without a prompt's tokenizer: the empty
prompt's conditioning computed once, the noise schedule, how the U-Net's output is to be read (noise or
velocity), and how a sampled tensor becomes a picture (the checkpoint's own VAE decoder, the identity for a
pixel-space model, or None when no decoder is to be had and tensors are compared as they are).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

SD_TIMESTEPS = 1000


def sd_alphas_cumprod(beta_start: float = 0.00085, beta_end: float = 0.012,
                      timesteps: int = SD_TIMESTEPS) -> torch.Tensor:
    """SD 1.x/2.x/SDXL's discrete schedule ("scaled linear" betas): (timesteps,) float64 cumulative alphas."""
    betas = torch.linspace(beta_start ** 0.5, beta_end ** 0.5, timesteps, dtype=torch.float64) ** 2
    return torch.cumprod(1.0 - betas, dim=0)


@dataclass
class Pipeline:
    """A U-Net ready to sample with, and how to look at what it samples.

    unet: called as ``unet(x, timesteps, context=context, y=y)`` (ldm/sgm ``UNetModel``); x (B, channels, h, w).
    context: (1, T, C) the empty prompt's cross-attention conditioning, expanded to the batch when sampling.
    y: (1, A) vector conditioning (SDXL's pooled text and size embedding), or None.
    prediction: "eps" (the U-Net predicts the noise) or "v" (velocity, SD 2.x 768-v models).
    channels: channels of the sampled tensor (4 for SD latents, 3 for a pixel-space model).
    downscale: image pixels per sampled cell along a side (8 for SD latents, 1 in pixel space).
    decode: sampled tensor (B, channels, h, w) -> image (B, 3, h·downscale, w·downscale) in [0, 1]; None when
        the file has no decoder (fidelity is then measured on the sampled tensors).
    alphas_cumprod: (1000,) float64 cumulative alphas of the discrete schedule.
    size: the image side in px the model is meant to be evaluated at (the proxy's 64), or None for SD's own
        (512 px for SD 1.x/2.x, 1024 for SDXL).
    encode_prompt, prompts: see the fields; ``prompt_contexts`` gives a run's conditioning from them.
    """

    name: str
    unet: nn.Module
    context: torch.Tensor
    y: torch.Tensor | None = None
    prediction: str = "eps"
    channels: int = 4
    downscale: int = 8
    decode: Callable[[torch.Tensor], torch.Tensor] | None = None
    alphas_cumprod: torch.Tensor = field(default_factory=sd_alphas_cumprod)
    notes: list[str] = field(default_factory=list)  # one line each, for the report (e.g. "no VAE: latents")
    size: int | None = None
    # A prompted model's text encoder: prompt -> context (1, T, C) as ``context`` is; None where the model takes
    # no prompt (a checkpoint's text encoder is not run here: its context is the empty prompt's).
    encode_prompt: Callable[[str], torch.Tensor] | None = None
    prompts: tuple[str, ...] = ()  # what a fidelity run's images are asked for, in turn (none: the empty prompt)

    @property
    def label(self) -> str:
        """The name up to its first bracket ("proxy (pixel-space ...)" -> "proxy"), for tables and charts."""
        return self.name.split(" (")[0].strip() or self.name


def prompt_contexts(pipe: Pipeline, images: int, shift: int = 0) -> torch.Tensor | None:
    """(images, T, C): the conditioning of a run's ``images`` pictures, ``pipe.prompts`` in turn from the
    ``shift``-th (another shift: each picture asked for something else); None where the pipeline has no prompts
    (its pictures are all asked for by the empty prompt, ``pipe.context``)."""
    if pipe.encode_prompt is None or not pipe.prompts:
        return None
    return torch.cat([pipe.encode_prompt(pipe.prompts[(i + shift) % len(pipe.prompts)]) for i in range(images)])
