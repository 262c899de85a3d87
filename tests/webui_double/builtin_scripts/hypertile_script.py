"""The webui's built-in Hypertile (``extensions-builtin/hypertile``), as it meets another extension.

At ``process`` (and ``before_hr`` for the hires pass) it wraps the ``forward`` of the U-Net's self-attention
layers once, keeping each layer's settings in an attribute ``__webui_hypertile_params`` with ``enabled``, and
sets ``enabled`` afresh from the settings for every job and pass. The wrapper reads the token grid off the
length of the sequence it is handed and the image's aspect ratio, cuts the sequence into nh×nw tiles of
that grid, attends within each tile ((B, h·w, C) -> (B·nh·nw, h·w / (nh·nw), C)) and puts them back. It
writes "Hypertile U-Net: True" into the infotext when on.

The double covers depth 0 only (the layers at full latent resolution, found here by their width, the
U-Net's base width) and tiles 2×2 where the grid's sides are even.
"""

from __future__ import annotations

import math

from modules import scripts, shared

PARAMS = "__webui_hypertile_params"


class HypertileParams:
    def __init__(self, forward) -> None:
        self.forward = forward
        self.enabled = False
        self.aspect_ratio = 1.0


def grid_of(tokens: int, aspect_ratio: float) -> tuple[int, int]:
    """(h, w) with h·w = tokens and w / h as close to the aspect ratio as the divisors allow."""
    h = max(1, round(math.sqrt(tokens / aspect_ratio)))
    while tokens % h:
        h -= 1
    return h, tokens // h


def tiled_forward(params: HypertileParams):
    def forward(x, *args, **kwargs):
        if not params.enabled:
            return params.forward(x, *args, **kwargs)
        b, n, c = x.shape
        h, w = grid_of(n, params.aspect_ratio)
        nh, nw = (2 if h % 2 == 0 else 1), (2 if w % 2 == 0 else 1)
        th, tw = h // nh, w // nw
        tiles = x.reshape(b, nh, th, nw, tw, c).permute(0, 1, 3, 2, 4, 5).reshape(b * nh * nw, th * tw, c)
        out = params.forward(tiles, *args, **kwargs)
        return out.reshape(b, nh, nw, th, tw, c).permute(0, 1, 3, 2, 4, 5).reshape(b, n, c)
    return forward


def hook_model(unet, width: int, height: int, enable: bool) -> None:
    """Wrap the layers the first time Hypertile is on (never before), then set ``enabled`` for this pass."""
    if unet is None or not (enable or getattr(unet, "__webui_hypertile_layers", False)):
        return
    unet.__webui_hypertile_layers = True
    base_width = getattr(unet, "model_channels", None)
    for name, module in unet.named_modules():
        if not name.endswith("attn1") or getattr(getattr(module, "to_q", None), "in_features", None) != base_width:
            continue
        params = getattr(module, PARAMS, None)
        if params is None:
            params = HypertileParams(module.forward)
            setattr(module, PARAMS, params)
            module.forward = tiled_forward(params)
        params.enabled = enable
        params.aspect_ratio = width / height


def unet_of(model):
    """The ldm U-Net Hypertile hooks (``sd_model.model``'s); None where the model has none there (Forge)."""
    return getattr(getattr(model, "model", None), "diffusion_model", None)


def unhook_model(unet) -> None:
    """Undo ``hook_model`` (the real one never does; tests need the U-Net back as it was)."""
    for module in unet.modules():
        if PARAMS in vars(module):
            delattr(module, PARAMS)
            del module.forward
    vars(unet).pop("__webui_hypertile_layers", None)


class ScriptHypertile(scripts.Script):
    def title(self) -> str:
        return "Hypertile"

    def show(self, is_img2img: bool):
        return scripts.AlwaysVisible

    def process(self, p, *args) -> None:
        enable = shared.opts.hypertile_enable_unet
        hook_model(unet_of(shared.sd_model), p.width, p.height, enable)
        if enable:
            p.extra_generation_params["Hypertile U-Net"] = True

    def before_hr(self, p, *args) -> None:
        enable = shared.opts.hypertile_enable_unet_secondpass or shared.opts.hypertile_enable_unet
        hook_model(unet_of(shared.sd_model), p.hr_upscale_to_x, p.hr_upscale_to_y, enable)
