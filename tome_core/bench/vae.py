"""A checkpoint's own VAE decoder (``first_stage_model.*``), its configuration read off its tensors.

ldm's ``AutoencoderKL.decode(z)`` is ``decoder(post_quant_conv(z))``; the webui divides a sampled latent by the
model's scale factor first and maps the decoder's [-1, 1] output to [0, 1]. Only the decoder half is built.
"""

from __future__ import annotations

import contextlib
import io
import math
import re
import types
from typing import Mapping

import torch
import torch.nn.functional as F
from torch import nn

VAE_PREFIX = "first_stage_model."
SCALE_FACTORS = {"sd1": 0.18215, "sd2": 0.18215, "sdxl": 0.13025}
_RESOLUTION = 256  # ldm's ddconfig value; it only locates attention levels, never limits the decoded size


class VaeError(ValueError):
    """The VAE's tensors are there but incomplete or of an unknown shape."""


def has_decoder(keys) -> bool:
    """Whether any of ``keys`` belongs to a VAE decoder (``first_stage_model.decoder.*``)."""
    return any(k.startswith(VAE_PREFIX + "decoder.") for k in keys)


def decoder_config(w: Mapping[str, torch.Tensor]) -> dict:
    """ldm ``Decoder`` arguments plus ``embed_dim`` read off the VAE's tensors (keys without ``first_stage_model.``).

    SD's VAE: ch 128, ch_mult (1, 2, 4, 4), 2 res blocks per level (3 in the decoder), z 4 channels, attention in
    the middle only.
    """
    try:
        z_channels = w["decoder.conv_in.weight"].shape[1]
        levels = 1 + max(int(m.group(1)) for k in w if (m := re.match(r"decoder\.up\.(\d+)\.", k)))
        blocks = 1 + max(int(m.group(1)) for k in w if (m := re.match(r"decoder\.up\.0\.block\.(\d+)\.", k)))
        widths = [w[f"decoder.up.{i}.block.0.conv2.weight"].shape[0] for i in range(levels)]
        ch = math.gcd(*widths)
        attn = [_RESOLUTION // 2 ** i for i in range(levels) if f"decoder.up.{i}.attn.0.q.weight" in w]
        return dict(ch=ch, ch_mult=[width // ch for width in widths], num_res_blocks=blocks - 1,
                    attn_resolutions=attn, z_channels=int(z_channels),
                    out_ch=int(w["decoder.conv_out.weight"].shape[0]),
                    in_channels=3, resolution=_RESOLUTION, double_z=True, dropout=0.0,
                    embed_dim=int(w["post_quant_conv.weight"].shape[1]))
    except (KeyError, ValueError) as error:  # a missing key, or max() of nothing
        raise VaeError(f"incomplete VAE decoder ({type(error).__name__}: {error})") from None


def _attention_block_forward(self, x: torch.Tensor) -> torch.Tensor:
    """ldm's VAE ``AttnBlock`` (single-head self-attention over all pixels, 1×1 conv projections) with PyTorch's
    scaled-dot-product attention: x (B, C, H, W) -> (B, C, H, W). ldm's own forms the (HW × HW) matrix whole,
    1 GB in float32 at SDXL's 1024 px; SDP attention computes it in pieces."""
    b, c, h, w = x.shape
    normed = self.norm(x)
    q, k, v = (proj(normed).reshape(b, 1, c, h * w).transpose(2, 3) for proj in (self.q, self.k, self.v))
    out = F.scaled_dot_product_attention(q, k, v).transpose(2, 3).reshape(b, c, h, w)
    return x + self.proj_out(out)


class VaeDecoder(nn.Module):
    """Latents (B, embed_dim, h, w) as sampled -> images (B, 3, 8h, 8w) float32 in [0, 1]."""

    def __init__(self, config: dict, scale_factor: float) -> None:
        super().__init__()
        from ldm.modules.diffusionmodules import model as ldm_model

        config = dict(config)
        embed_dim = config.pop("embed_dim")
        self.scale_factor = scale_factor
        self.post_quant_conv = nn.Conv2d(embed_dim, config["z_channels"], 1)
        # ldm swaps in xformers' attention block wherever xformers is installed, and xformers may lack a CPU
        # kernel; the plain block has the same weights and runs everywhere.
        xformers = getattr(ldm_model, "XFORMERS_IS_AVAILBLE", False)
        ldm_model.XFORMERS_IS_AVAILBLE = False
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # ldm prints the latent shape and each attention type
                self.decoder = ldm_model.Decoder(**config)
        finally:
            ldm_model.XFORMERS_IS_AVAILBLE = xformers
        for module in self.decoder.modules():
            if isinstance(module, ldm_model.AttnBlock):
                module.forward = types.MethodType(_attention_block_forward, module)

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        dtype = self.post_quant_conv.weight.dtype
        image = self.decoder(self.post_quant_conv(latents.to(dtype) / self.scale_factor))
        return ((image.float() + 1) / 2).clamp(0, 1)


def build_decoder(tensors: Mapping[str, torch.Tensor], family: str, device: torch.device,
                  dtype: torch.dtype) -> VaeDecoder:
    """The VAE decoder of ``tensors`` (a checkpoint's, keys with ``first_stage_model.``) on ``device`` in
    ``dtype``, in eval mode. ``VaeError`` when its tensors are incomplete or do not fit."""
    w = {k[len(VAE_PREFIX):]: v for k, v in tensors.items()
         if k.startswith(VAE_PREFIX + "decoder.") or k.startswith(VAE_PREFIX + "post_quant_conv.")}
    config = decoder_config(w)
    for k, v in list(w.items()):
        # Files converted from diffusers hold the middle attention's 1×1 convolutions as (C, C) matrices.
        if re.search(r"attn(_\d+|\.\d+)\.(q|k|v|proj_out)\.weight$", k) and v.dim() == 2:
            w[k] = v[:, :, None, None]
    with torch.device("meta"):
        vae = VaeDecoder(config, SCALE_FACTORS[family])
    try:
        vae.load_state_dict({k: v.to(device, dtype) for k, v in w.items()}, strict=True, assign=True)
    except RuntimeError as error:
        raise VaeError(f"VAE decoder does not fit its inferred configuration "
                       f"({str(error).strip().splitlines()[-1].strip()})") from None
    return vae.eval()


def safe_decode(vae: VaeDecoder):
    """A ``decode`` for a ``Pipeline``: ``vae`` under ``no_grad``, retried once in float32 when half precision
    gives non-finite pixels (SDXL's VAE overflows in float16; the webui retries the same way)."""

    @torch.no_grad()
    def decode(latents: torch.Tensor) -> torch.Tensor:
        image = vae(latents)
        if not torch.isfinite(image).all() and vae.post_quant_conv.weight.dtype != torch.float32:
            vae.float()
            image = vae(latents)
        return image

    return decode
