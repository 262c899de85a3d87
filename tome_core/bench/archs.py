"""The webui's U-Net architectures, built from ldm's classes with random weights, run as the webui runs them.

"As the webui runs them" means two of its patches to ldm: PyTorch's scaled-dot-product attention (what
``--opt-sdp-attention`` installs) and a ``torch.cat`` that resizes a skip connection whose size differs after
a stride-2 downsampling, which is what lets the webui make images whose sides are multiples of 8 rather than
of 64.
"""

from __future__ import annotations

import math
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

from tome_core.patch import transformer_levels

# ldm UNetModel arguments. SDXL's per-level depths (2 at downsample 2, 10 at 4) are made by building depth 10
# and trimming the shallower level; its pooled-text embedding is left out.
ARCHS = {
    "sd15": dict(model_channels=320, channel_mult=[1, 2, 4, 4], attention_resolutions=[4, 2, 1], num_heads=8,
                 context_dim=768, use_linear_in_transformer=False, depths={0: 1, 1: 1, 2: 1, 3: 1}),
    "sd2": dict(model_channels=320, channel_mult=[1, 2, 4, 4], attention_resolutions=[4, 2, 1],
                num_head_channels=64, context_dim=1024, use_linear_in_transformer=True,
                depths={0: 1, 1: 1, 2: 1, 3: 1}),
    "sdxl": dict(model_channels=320, channel_mult=[1, 2, 4], attention_resolutions=[4, 2], num_head_channels=64,
                 context_dim=2048, use_linear_in_transformer=True, depths={1: 2, 2: 10}),
    # SD 1.5 as diffusers builds it (UNet2DConditionModel, its own SDPA processor): the same layout as sd15,
    # so the two side by side show what each family's hooks cost.
    "sd15-diffusers": dict(model_channels=320, channel_mult=[1, 2, 4, 4], attention_resolutions=[4, 2, 1],
                           num_heads=8, context_dim=768, use_linear_in_transformer=False,
                           depths={0: 1, 1: 1, 2: 1, 3: 1}, diffusers=True),
}
GROUPNORM_GROUPS = 32


def top_attention_level(arch: str) -> int:
    """The level (log2 of the downsampling) of ``arch``'s highest-resolution attention: 0 for SD 1.x/2.x, 1 for
    SDXL. What levels "auto" patches."""
    return int(math.log2(min(ARCHS[arch]["attention_resolutions"])))


def top_grid(size_px: int, level: int) -> int:
    """Token grid side at ``level`` of a square ``size_px`` image: latent side size/8, then halved (rounded
    up, as ldm's stride-2 convolutions do) once per level."""
    side = size_px // 8
    for _ in range(level):
        side = math.ceil(side / 2)
    return side


def scaled_channels(channels: int, width: float) -> int:
    """``channels`` scaled by ``width``, kept a positive multiple of 32 (ldm's GroupNorm has 32 groups)."""
    return max(GROUPNORM_GROUPS, int(channels * width) // GROUPNORM_GROUPS * GROUPNORM_GROUPS)


def head_channels(model_channels: int, wanted: int = 64) -> int:
    """Channels per attention head that divide every level's width: ``wanted`` when it divides
    ``model_channels``, else their greatest common divisor.

    ldm makes ``channels // head_channels`` heads of ``head_channels`` each; a head width that does not divide
    the channels leaves the attention narrower than the block around it (at 160 channels, 2 heads of 64 give
    128) and the first U-Net call fails on a matrix product.
    """
    return math.gcd(wanted, model_channels)


def _import_unet_classes() -> None:
    """Import ldm's U-Net module. ``ldm.util`` imports Pillow for a caption-drawing helper the U-Net never
    calls; where Pillow is missing (a bare torch environment), empty stand-ins serve that import alone and are
    taken out of ``sys.modules`` again, so any later ``import PIL`` fails as it would have."""
    try:
        import PIL.Image  # noqa: F401
        import PIL.ImageDraw  # noqa: F401
        import PIL.ImageFont  # noqa: F401
        stand_ins = {}
    except ImportError:
        import types

        stand_ins = {name: types.ModuleType(name) for name in ("PIL", "PIL.Image", "PIL.ImageDraw", "PIL.ImageFont")}
        for name in ("Image", "ImageDraw", "ImageFont"):
            setattr(stand_ins["PIL"], name, stand_ins[f"PIL.{name}"])
    saved = {name: sys.modules.get(name) for name in stand_ins}
    sys.modules.update(stand_ins)
    try:
        import ldm.modules.diffusionmodules.openaimodel  # noqa: F401
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def require_ldm() -> None:
    """Make ``ldm`` importable: installed, or the webui's own copy when this extension sits in a webui's
    ``extensions/`` folder (the webui adds it to the path only while it runs)."""
    try:
        _import_unet_classes()
        return
    except ImportError:
        pass
    extension = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    # <webui>/extensions/<this extension>: from this file, or from the folder it is run in (PWD keeps the
    # path as typed when the extension folder is a link).
    starts = (extension, os.getcwd(), os.environ.get("PWD", os.getcwd()))
    for webui in [os.path.join(start, "..", "..") for start in starts]:
        candidate = os.path.normpath(os.path.join(webui, "repositories", "stable-diffusion-stability-ai"))
        if os.path.isdir(os.path.join(candidate, "ldm")) and candidate not in sys.path:
            sys.path.insert(0, candidate)
    try:
        _import_unet_classes()
    except ImportError as error:
        raise SystemExit(f"the benchmark needs the ldm U-Net classes ({error}). Run it with the webui's Python "
                         f"from this extension's folder inside the webui, or install them: pip install "
                         f"--no-deps stable-diffusion-sdkit==2.1.5 einops omegaconf") from None


def sdp_attention_forward(self, x: torch.Tensor, context: torch.Tensor | None = None, mask=None, **kwargs):
    """ldm CrossAttention with PyTorch SDP attention: x (B, N, C), context (B, M, D) or None -> (B, N, C)."""
    h = self.heads
    context = x if context is None else context
    q, k, v = self.to_q(x), self.to_k(context), self.to_v(context)
    b, n, inner = q.shape
    q, k, v = (t.reshape(b, t.shape[1], h, inner // h).transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v)
    return self.to_out(out.transpose(1, 2).reshape(b, n, inner))


class TorchWithResizingCat:
    """``torch`` for ldm's U-Net module, except that ``cat`` of an upsampled tensor and a skip connection of
    another size first resizes the former (nearest), as the webui's own U-Net hijack does."""

    def __getattr__(self, name: str):
        return getattr(torch, name)

    @staticmethod
    def cat(tensors, *args, **kwargs) -> torch.Tensor:
        if len(tensors) == 2 and tensors[0].shape[-2:] != tensors[1].shape[-2:]:
            tensors = (F.interpolate(tensors[0], tensors[1].shape[-2:], mode="nearest"), tensors[1])
        return torch.cat(tensors, *args, **kwargs)


def use_webui_unet() -> None:
    """Patch ldm (process-wide) to run its U-Net as the webui does: SDP attention, any multiple of 8 px."""
    require_ldm()
    from ldm.modules import attention
    from ldm.modules.diffusionmodules import openaimodel

    attention.CrossAttention.forward = sdp_attention_forward
    openaimodel.th = TorchWithResizingCat()


def build_unet(arch: str, device: torch.device, dtype: torch.dtype, width: float = 1.0) -> tuple[nn.Module, int]:
    """A random-weight ldm U-Net of ``arch`` with every channel count scaled by ``width``, on ``device`` in
    ``dtype``, in eval mode; and its context width (the text encoder's, unscaled).

    It takes latents (B, 4, H/8, W/8), timesteps (B,) and a context (B, 77, context width) per transformer depth.
    """
    cfg = dict(ARCHS[arch])
    if cfg.pop("diffusers", False):
        return build_diffusers_unet(cfg, device, dtype, width)
    from ldm.modules.diffusionmodules.openaimodel import UNetModel

    depths = cfg.pop("depths")
    cfg["model_channels"] = scaled_channels(cfg["model_channels"], width)
    if "num_head_channels" in cfg:
        cfg["num_head_channels"] = head_channels(cfg["model_channels"], cfg["num_head_channels"])
    depth = max(depths.values())
    context_dim = cfg.pop("context_dim")
    torch.manual_seed(0)
    with torch.device(device):  # initialising SDXL's 2.6 B parameters on the host alone takes most of a minute
        unet = UNetModel(image_size=32, in_channels=4, out_channels=4, num_res_blocks=2, use_spatial_transformer=True,
                         transformer_depth=depth, context_dim=[context_dim] * depth, legacy=False, **cfg)
    trim_depths(unet, depths)
    with torch.no_grad():  # ldm zero-initialises these: random values make every block count
        for name, p in unet.named_parameters():
            if ".proj_out." in name or name.startswith("out."):
                p.normal_(0, 0.02)
    return in_run_dtype(unet, device, dtype), context_dim


def build_diffusers_unet(cfg: dict, device: torch.device, dtype: torch.dtype, width: float = 1.0
                         ) -> tuple[nn.Module, int]:
    """``cfg`` (an ``ARCHS`` entry of ldm's arguments) built as a random-weight diffusers
    ``UNet2DConditionModel``, behind the adapter that calls it as ldm's U-Net is called; and its context width."""
    try:
        from diffusers import UNet2DConditionModel
    except ImportError:
        raise SystemExit("the -diffusers architectures need diffusers: pip install diffusers") from None
    channels = scaled_channels(cfg["model_channels"], width)
    widths = [channels * m for m in cfg["channel_mult"]]
    attention = [2 ** i in cfg["attention_resolutions"] for i in range(len(widths))]
    down = [("CrossAttnDownBlock2D" if a else "DownBlock2D") for a in attention]
    torch.manual_seed(0)
    with torch.device(device):
        unet = UNet2DConditionModel(block_out_channels=widths, down_block_types=down,
                                    up_block_types=[b.replace("Down", "Up") for b in reversed(down)],
                                    layers_per_block=2, attention_head_dim=cfg["num_heads"],
                                    cross_attention_dim=cfg["context_dim"],
                                    use_linear_projection=cfg["use_linear_in_transformer"])
    return DiffusersCall(unet.to(device=device, dtype=dtype).eval()), cfg["context_dim"]


class DiffusersCall(nn.Module):
    """A diffusers ``UNet2DConditionModel`` called as the benchmark calls ldm's U-Net:
    ``(x (B, 4, h, w), timesteps (B,), context=(B, T, C)) -> (B, 4, h, w)``.

    It holds the U-Net as ``diffusion_model``, where ``tome_core.resolve_unet`` (and so every contender) finds
    it. SDXL's added conditioning is its pooled empty prompt and the size being sampled (original and target
    size the image's, no crop), as diffusers' pipeline sets it by default.
    """

    def __init__(self, unet: nn.Module, pooled: torch.Tensor | None = None, downscale: int = 8) -> None:
        super().__init__()
        self.diffusion_model = unet
        self.pooled = pooled  # (1, P) for SDXL, else None
        self.downscale = downscale  # image pixels per latent cell

    def forward(self, x: torch.Tensor, timesteps: torch.Tensor, context: torch.Tensor | None = None,
                y: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(context, (list, tuple)):  # ldm's per-depth contexts: diffusers takes one for all blocks
            context = context[0]
        kwargs = {}
        if self.pooled is not None:
            b, h, w = x.shape[0], x.shape[-2] * self.downscale, x.shape[-1] * self.downscale
            ids = torch.tensor([[h, w, 0, 0, h, w]], device=x.device, dtype=x.dtype).expand(b, 6)
            kwargs["added_cond_kwargs"] = {"text_embeds": self.pooled.to(x.device, x.dtype).expand(b, -1),
                                           "time_ids": ids}
        return self.diffusion_model(x, timesteps, encoder_hidden_states=context, **kwargs).sample


def in_run_dtype(unet: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """Move an ldm U-Net to ``device`` and ``dtype`` for inference, with ldm's float32 corners made consistent.

    ldm casts the latent to ``unet.dtype`` (float32 unless built with ``use_fp16``), feeds ``time_embed`` a
    float32 timestep embedding and computes GroupNorm32 in float32 from float32 parameters; the webui covers
    these with autocast on CUDA. Setting them explicitly runs the same way on every device.
    """
    unet = unet.to(device=device, dtype=dtype).eval()
    if dtype != torch.float32:
        unet.dtype = dtype
        unet.time_embed.register_forward_pre_hook(lambda module, args: (args[0].to(dtype),))
        for module in unet.modules():
            if type(module).__name__ == "GroupNorm32":
                module.float()
    return unet


def trim_depths(unet: nn.Module, depths: dict[int, int]) -> None:
    """Keep only ``depths[level]`` transformer blocks in each SpatialTransformer of that level."""
    for _, transformer, level in transformer_levels(unet):
        keep = depths.get(level, len(transformer.transformer_blocks))
        transformer.transformer_blocks = transformer.transformer_blocks[:keep]


def context_as_list(depth: int):
    """A forward pre-hook giving ldm's U-Net a context per transformer depth when it is called with one tensor:
    ldm's SpatialTransformer indexes a list of contexts by block, and SDXL has up to 10 blocks per level."""

    def hook(module, args, kwargs):
        if isinstance(kwargs.get("context"), torch.Tensor):
            kwargs = dict(kwargs, context=[kwargs["context"]] * depth)
        elif len(args) > 2 and isinstance(args[2], torch.Tensor):  # unet(x, timesteps, context)
            args = (*args[:2], [args[2]] * depth, *args[3:])
        return args, kwargs

    return hook


def unet_depth(unet: nn.Module) -> int:
    """The deepest SpatialTransformer's block count: how many contexts ldm's U-Net call takes."""
    return max(len(t.transformer_blocks) for _, t, _ in transformer_levels(unet))


def top_transformer(unet: nn.Module) -> tuple[nn.Module, int]:
    """The first SpatialTransformer of the highest-resolution attention level, and that level's downsampling
    factor."""
    levels = transformer_levels(unet)
    top = min(level for _, _, level in levels)
    transformer = next(t for _, t, level in levels if level == top)
    return transformer, 2 ** top


def transformer_channels(transformer: nn.Module) -> int:
    """The channel count C of the (B, C, h, w) input a SpatialTransformer takes."""
    proj_in = transformer.proj_in
    return proj_in.in_channels if hasattr(proj_in, "in_channels") else proj_in.in_features
