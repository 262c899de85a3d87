"""Small random-weight models built with ComfyUI's own classes, in the two layouts its users run: SD 1.5's
(attention at the latent's resolution and below) and SDXL's (none at the first level, a deep second level,
the 2816-wide ADM input). Widths and depths are small; what ComfyUI's code does with them is not."""

from __future__ import annotations

import math

import torch

import comfy.model_management
import comfy.model_patcher
import comfy.supported_models

LAYOUTS = {
    "sd15": dict(model=comfy.supported_models.SD15, unet=dict(
        model_channels=32, channel_mult=[1, 2], num_res_blocks=[1, 1], transformer_depth=[1, 1],
        transformer_depth_output=[1, 1, 1, 1], transformer_depth_middle=1, context_dim=32, num_heads=4,
        num_head_channels=-1, use_linear_in_transformer=False, adm_in_channels=None)),
    "sdxl": dict(model=comfy.supported_models.SDXL, unet=dict(
        model_channels=32, channel_mult=[1, 2, 2], num_res_blocks=[1, 1, 1], transformer_depth=[0, 1, 2],
        transformer_depth_output=[0, 0, 1, 1, 2, 2], transformer_depth_middle=2, context_dim=48, num_heads=-1,
        num_head_channels=8, use_linear_in_transformer=True, adm_in_channels=2816, num_classes="sequential")),
}
CONTEXT = {name: layout["unet"]["context_dim"] for name, layout in LAYOUTS.items()}


def _randomise(module: torch.nn.Module, seed: int) -> None:
    """Every weight random (ComfyUI leaves its layers uninitialised, and zero output layers would make a
    transformer contribute nothing): scaled by fan-in, norms near 1."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() > 1:
                # the last conv and each transformer's output larger: a prediction near the noise's size, in which the
                # transformers have a large share
                scale = 16.0 if name.startswith("out.") else 2.0 if ".proj_out." in name else 1.0
                p.copy_(scale * torch.randn(p.shape, generator=gen) / math.sqrt(p[0].numel()))
            elif "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))


def tiny_model(layout: str = "sd15", seed: int = 0) -> comfy.model_patcher.ModelPatcher:
    """A ModelPatcher around a small random-weight U-Net of ``layout`` on the CPU, as ComfyUI loads one."""
    spec = LAYOUTS[layout]
    unet_config = dict(spec["model"].unet_config)
    unet_config.update(spec["unet"], in_channels=4, out_channels=4, use_spatial_transformer=True, legacy=False,
                       use_checkpoint=False, image_size=32, use_temporal_resblock=False,
                       use_temporal_attention=False)
    model_config = spec["model"](unet_config)
    model_config.set_inference_dtype(torch.float32, None)
    model = model_config.get_model({}, "")
    _randomise(model.diffusion_model, seed)
    device = torch.device("cpu")
    return comfy.model_patcher.ModelPatcher(model, load_device=device, offload_device=device)


def conditioning(layout: str, seed: int, tokens: int = 7) -> list:
    """A prompt's conditioning as CLIPTextEncode gives it: [[tokens (1, n, ctx), {"pooled_output": ...}]]."""
    gen = torch.Generator().manual_seed(seed)
    extra = {"pooled_output": torch.randn(1, 1280, generator=gen)} if layout == "sdxl" else {}
    return [[torch.randn(1, tokens, CONTEXT[layout], generator=gen), extra]]


def write_checkpoint(path: str, seed: int = 0) -> None:
    """A single-file SD 1.5-shaped checkpoint that ComfyUI's CheckpointLoaderSimple detects and loads: a small
    U-Net at the widths its detection pins (320 channels, 768-wide context, convolution projections), with
    CLIP-L and the SD VAE at their real sizes (ComfyUI builds those from fixed configs) and every weight random,
    in float16 (about 420 MB)."""
    import safetensors.torch

    import comfy.ldm.models.autoencoder
    import comfy.sd1_clip

    unet_config = dict(comfy.supported_models.SD15.unet_config)
    unet_config.update(comfy.supported_models.SD15.unet_extra_config, in_channels=4, out_channels=4,
                       channel_mult=[1, 2], num_res_blocks=[1, 1], transformer_depth=[1, 1],
                       transformer_depth_output=[1, 1, 1, 1], transformer_depth_middle=1,
                       use_spatial_transformer=True, legacy=False, use_checkpoint=False, image_size=32,
                       use_temporal_resblock=False)
    model_config = comfy.supported_models.SD15(unet_config)
    model_config.set_inference_dtype(torch.float32, None)
    model = model_config.get_model({}, "")
    _randomise(model.diffusion_model, seed)
    clip = comfy.sd1_clip.SD1ClipModel()
    _randomise(clip, seed + 1)
    ddconfig = {"double_z": True, "z_channels": 4, "resolution": 256, "in_channels": 3, "out_ch": 3, "ch": 128,
                "ch_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_resolutions": [], "dropout": 0.0}
    vae = comfy.ldm.models.autoencoder.AutoencoderKL(ddconfig=ddconfig, embed_dim=4)
    _randomise(vae, seed + 2)
    state = model.state_dict_for_saving(clip.state_dict(), vae.state_dict())
    safetensors.torch.save_file({k: v.detach().to(torch.float16).contiguous() for k, v in state.items()}, path)
