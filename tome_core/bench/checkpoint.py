"""The U-Net of a real SD 1.x / 2.x / SDXL checkpoint, read off its own tensors.

The architecture comes from the checkpoint's tensors (channel widths, levels with attention, depth per level,
context width, linear or conv projections), so fine-tunes and small test checkpoints load too. Used by
``python -m tome_core.bench --checkpoint FILE``.
"""

from __future__ import annotations

import os
import re

import torch
from torch import nn

from .archs import head_channels, in_run_dtype, trim_depths

PREFIX = "model.diffusion_model."


class CheckpointError(ValueError):
    """The file is missing, unreadable, or holds no U-Net this benchmark can build."""


def load_state_dict(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of a ``.safetensors`` file or a ``.ckpt``/``.pt`` pickle (loaded with ``weights_only``)."""
    if not os.path.isfile(path):
        raise CheckpointError(f"--checkpoint {path}: no such file")
    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file

            return load_file(path)
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # safetensors, pickle and zip each raise their own kinds
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CheckpointError(f"--checkpoint {path}: not a readable .safetensors or .ckpt file ({first_line})") \
            from None
    if isinstance(data, dict) and isinstance(data.get("state_dict"), dict):
        data = data["state_dict"]
    if not isinstance(data, dict):
        raise CheckpointError(f"--checkpoint {path}: holds a {type(data).__name__}, not a dictionary of tensors")
    return data


def unet_config(sd: dict[str, torch.Tensor]) -> dict:
    """ldm UNetModel arguments (plus ``family`` and per-level ``depths``) read off a U-Net state dict whose
    keys start with ``model.diffusion_model.``."""
    w = {k[len(PREFIX):]: v for k, v in sd.items() if k.startswith(PREFIX)}
    if "input_blocks.0.0.weight" not in w:
        raise CheckpointError("no U-Net in this checkpoint (no 'model.diffusion_model.input_blocks.0.0.weight'); "
                              "SD3, Flux and other transformer-only models are not supported")
    try:
        return _read_config(w)
    except (KeyError, StopIteration, ValueError, IndexError) as error:
        raise CheckpointError(f"not an SD 1.x/2.x/SDXL U-Net: its tensors do not fit the ldm layout "
                              f"({type(error).__name__}: {error})") from None


def _read_config(w: dict[str, torch.Tensor]) -> dict:
    model_channels, in_channels = w["input_blocks.0.0.weight"].shape[:2]
    n_inputs = 1 + max(int(m.group(1)) for k in w if (m := re.match(r"input_blocks\.(\d+)\.", k)))
    level, res_per_level, depths, attention_levels = 0, {}, {}, set()
    for i in range(1, n_inputs):
        if f"input_blocks.{i}.0.op.weight" in w:  # a Downsample block
            level += 1
            continue
        res_per_level[level] = res_per_level.get(level, 0) + 1
        out_ch = w[f"input_blocks.{i}.0.out_layers.3.weight"].shape[0]
        res_per_level.setdefault(("ch", level), out_ch)
        blocks = {int(m.group(1)) for k in w
                  if (m := re.match(rf"input_blocks\.{i}\.1\.transformer_blocks\.(\d+)\.", k))}
        if blocks:
            attention_levels.add(level)
            depths[level] = max(depths.get(level, 0), len(blocks))
    num_levels = level + 1
    middle = {int(m.group(1)) for k in w if (m := re.match(r"middle_block\.1\.transformer_blocks\.(\d+)\.", k))}
    depths[num_levels - 1] = max(depths.get(num_levels - 1, 0), len(middle))
    to_k = next(v for k, v in w.items() if k.endswith("attn2.to_k.weight"))
    proj_in = next(v for k, v in w.items() if k.endswith(".proj_in.weight"))
    use_linear = proj_in.dim() == 2
    family = "sdxl" if "label_emb.0.0.weight" in w else ("sd2" if use_linear else "sd1")
    cfg = dict(in_channels=int(in_channels), out_channels=int(w["out.2.weight"].shape[0]),
               model_channels=int(model_channels), num_res_blocks=res_per_level[0],
               channel_mult=[res_per_level[("ch", lv)] // model_channels for lv in range(num_levels)],
               attention_resolutions=sorted(2 ** lv for lv in attention_levels),
               context_dim=int(to_k.shape[1]), use_linear_in_transformer=use_linear)
    # Heads cannot be read off weights: SD 1.x has 8, SD 2.x and SDXL heads of 64 channels.
    if family == "sd1":
        cfg["num_heads"] = 8
    else:
        cfg["num_head_channels"] = head_channels(int(model_channels))
    return dict(cfg, family=family, depths=depths)


def build_from_checkpoint(path: str, device: torch.device, dtype: torch.dtype) -> tuple[nn.Module, str, int]:
    """(U-Net, family, context width) with the checkpoint's weights loaded; ``CheckpointError`` when the file
    is missing, unreadable or holds no U-Net of the ldm layout."""
    from ldm.modules.diffusionmodules.openaimodel import UNetModel

    sd = load_state_dict(path)
    cfg = unet_config(sd)
    family, depths = cfg.pop("family"), cfg.pop("depths")
    depth = max(depths.values())
    context_dim = cfg.pop("context_dim")
    unet = UNetModel(image_size=32, use_spatial_transformer=True, transformer_depth=depth,
                     context_dim=[context_dim] * depth, legacy=False, **cfg)
    trim_depths(unet, depths)
    weights = {k[len(PREFIX):]: v for k, v in sd.items() if k.startswith(PREFIX)}
    # SDXL's pooled-text embedding (label_emb) has no place in this conditioning-free probe.
    weights = {k: v for k, v in weights.items() if not k.startswith("label_emb.")}
    try:
        missing, unexpected = unet.load_state_dict(weights, strict=False)
    except RuntimeError as error:  # a tensor of the wrong shape
        raise CheckpointError(f"--checkpoint {path}: does not match the inferred {family} U-Net "
                              f"({str(error).strip().splitlines()[-1].strip()})") from None
    if missing or unexpected:
        raise CheckpointError(f"--checkpoint {path}: does not match the inferred {family} U-Net: missing "
                              f"{missing[:3]}, unexpected {unexpected[:3]}")
    return in_run_dtype(unet, device, dtype), family, context_dim


def relative_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a − b|| / ||b|| over all elements, in float32."""
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()
