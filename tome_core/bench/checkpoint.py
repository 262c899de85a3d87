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


class TensorFile:
    """A checkpoint's tensors, read a part at a time: a ``.safetensors`` file is read tensor by tensor, a
    ``.ckpt``/``.pt`` pickle is memory-mapped where its format allows (else loaded whole). So building one part
    never holds the others in memory, and no part is read twice.

    ``keys``: every tensor name. ``shapes(prefix)``: the tensors under ``prefix`` as meta tensors (shapes only,
    nothing read). ``read(prefix)``: the tensors under ``prefix`` (keys kept whole).
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._safetensors = None
        self._tensors: dict[str, torch.Tensor] | None = None
        if not os.path.isfile(path):
            raise CheckpointError(f"--checkpoint {path}: no such file")
        try:
            if path.endswith(".safetensors"):
                from safetensors import safe_open

                self._safetensors = safe_open(path, framework="pt", device="cpu")
                self.keys = list(self._safetensors.keys())
                return
            data = _load_pickle(path)
        except Exception as error:  # safetensors, pickle and zip each raise their own kinds
            first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise CheckpointError(f"--checkpoint {path}: not a readable .safetensors or .ckpt file ({first_line})") \
                from None
        if isinstance(data, dict) and isinstance(data.get("state_dict"), dict):
            data = data["state_dict"]
        if not isinstance(data, dict):
            raise CheckpointError(f"--checkpoint {path}: holds a {type(data).__name__}, not a dictionary of tensors")
        self._tensors = {k: v for k, v in data.items() if isinstance(v, torch.Tensor)}
        self.keys = list(self._tensors)

    def shapes(self, prefix: str = "") -> dict[str, torch.Tensor]:
        if self._tensors is not None:
            return {k: torch.empty(v.shape, device="meta") for k, v in self._tensors.items() if k.startswith(prefix)}
        return {k: torch.empty(self._safetensors.get_slice(k).get_shape(), device="meta")
                for k in self.keys if k.startswith(prefix)}

    def read(self, prefix: str = "") -> dict[str, torch.Tensor]:
        if self._tensors is not None:
            return {k: v for k, v in self._tensors.items() if k.startswith(prefix)}
        return {k: self._safetensors.get_tensor(k) for k in self.keys if k.startswith(prefix)}

    def get(self, key: str) -> torch.Tensor | None:
        """The tensor ``key``, or None when the file has none of that name."""
        return self.read(key).get(key) if key in self.keys else None


def _load_pickle(path: str):
    """A ``.ckpt``/``.pt`` file's contents, tensors memory-mapped when it is in PyTorch's zip format (since 1.6);
    older files have no layout to map and are read whole."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as error:
        if "mmap" not in str(error):
            raise
    return torch.load(path, map_location="cpu", weights_only=True)


def load_state_dict(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of a ``.safetensors`` file or a ``.ckpt``/``.pt`` pickle (loaded with ``weights_only``)."""
    return TensorFile(path).read()


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


def _build_unet(path: str, weights: dict[str, torch.Tensor], cfg: dict, device: torch.device,
                dtype: torch.dtype, vector_conditioning: bool) -> nn.Module:
    """The ldm U-Net of ``cfg`` (``unet_config``'s answer) holding ``weights`` (keys without the prefix).

    Built on the meta device and given the file's tensors as its parameters, so no random initialisation is
    computed and, where the file's dtype is the run's, no second copy is made. With ``vector_conditioning``
    an SDXL U-Net keeps its ``label_emb`` (pooled text and sizes, ``y``), which ldm's own class cannot build.
    """
    from ldm.modules.diffusionmodules.openaimodel import UNetModel

    cfg = dict(cfg)
    family, depths = cfg.pop("family"), cfg.pop("depths")
    depth = max(depths.values())
    context_dim = cfg.pop("context_dim")
    with torch.device("meta"):
        unet = UNetModel(image_size=32, use_spatial_transformer=True, transformer_depth=depth,
                         context_dim=[context_dim] * depth, legacy=False, **cfg)
        if vector_conditioning and "label_emb.0.0.weight" in weights:
            adm_channels, time_channels = weights["label_emb.0.0.weight"].shape[1], unet.model_channels * 4
            unet.label_emb = nn.Sequential(nn.Sequential(nn.Linear(adm_channels, time_channels), nn.SiLU(),
                                                         nn.Linear(time_channels, time_channels)))
            unet.num_classes = "sequential"  # ldm's forward then requires y and adds label_emb(y)
    trim_depths(unet, depths)
    if not vector_conditioning:
        # SDXL's pooled-text embedding (label_emb) has no place in the conditioning-free speed probe.
        weights = {k: v for k, v in weights.items() if not k.startswith("label_emb.")}
    try:
        missing, unexpected = unet.load_state_dict(weights, strict=False, assign=True)
    except RuntimeError as error:  # a tensor of the wrong shape
        raise CheckpointError(f"--checkpoint {path}: does not match the inferred {family} U-Net "
                              f"({str(error).strip().splitlines()[-1].strip()})") from None
    if missing or unexpected:
        raise CheckpointError(f"--checkpoint {path}: does not match the inferred {family} U-Net: missing "
                              f"{missing[:3]}, unexpected {unexpected[:3]}")
    return in_run_dtype(unet, device, dtype)


def build_from_checkpoint(path: str, device: torch.device, dtype: torch.dtype) -> tuple[nn.Module, str, int]:
    """(U-Net, family, context width) with the checkpoint's weights loaded; ``CheckpointError`` when the file
    is missing, unreadable or holds no U-Net of the ldm layout. Called as ``unet(x, t, context=[c] * depth)``."""
    tensors = TensorFile(path)
    cfg = unet_config(tensors.shapes(PREFIX))
    weights = {k[len(PREFIX):]: v for k, v in tensors.read(PREFIX).items()}
    return _build_unet(path, weights, cfg, device, dtype, False), cfg["family"], cfg["context_dim"]


def relative_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a − b|| / ||b|| over all elements, in float32."""
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()
