"""The U-Net code families the engine patches, and what differs between them, one entry per family.

Two families reach the engine: **ldm/sgm** (the A1111 webui; Forge, reForge and Forge Classic run copies of it
under other module paths with the same class names) and **diffusers** (``UNet2DConditionModel``, every
diffusers pipeline, SD.Next). Both hold transformer modules on a token grid (``SpatialTransformer`` /
``Transformer2DModel``), each with blocks that have ``attn1``, ``attn2``, ``ff`` and ``norm1..3``; what differs
is structural and lives here:

- which module is a transformer, and where the U-Net steps a resolution level down or up;
- the name of the first argument (the tokens) of a transformer, a block, an attention or an MLP call, by which a
  caller may pass it as a keyword;
- where a self-attention call takes an explicit key/value source;
- where the U-Net call's timestep is;
- whether a block's ``attn1`` attends to the image tokens;
- how an attention call takes an additive bias on its logits (for size-weighted keys), or, where it takes
  none (ldm), the attention forward the engine runs instead;
- where a webui model, a wrapper or a diffusers pipeline holds its U-Net (``resolve_unet``), and why a model
  has nothing to patch.

Everything is found by class names and attributes, never by importing a family's code, so the engine still
imports none of them, and a third family later is one more entry in ``FAMILIES``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

# (position, keyword) of an argument; position None: keyword only.
Slot = tuple["int | None", str]


def first_arg(args: tuple | list, kwargs: dict, keyword: str) -> Any:
    """A call's first argument, passed by position or as ``keyword``."""
    return args[0] if args else kwargs.get(keyword)


def slot_value(args: tuple | list, kwargs: dict, index: int | None, keyword: str) -> Any:
    """The argument at ``(index, keyword)`` (a ``Slot``) of a call, or None when the caller passed none."""
    return args[index] if index is not None and len(args) > index else kwargs.get(keyword)


def set_slot(args: list, kwargs: dict, index: int | None, keyword: str, value: Any) -> None:
    """Pass ``value`` where the caller passed that argument (by position or keyword), else by keyword."""
    if index is not None and len(args) > index:
        args[index] = value
    else:
        kwargs[keyword] = value


@dataclass(frozen=True)
class Family:
    """One family of U-Net code.

    Attributes:
        is_transformer: whether a module is one of the family's transformers on a token grid.
        stages: the U-Net's stages in call order, each with the level change after it (+1 for a downsampling
            stage, -1 for an upsampling one), or None when the module is not one of the family's U-Nets.
        tokens_keyword: the keyword of the first argument of transformers, blocks, attention and MLP calls.
        kv_slots: where a self-attention call can take explicit key/value sources (the first is where keys and
            values come from when only one source is passed).
        timestep_slot: where the U-Net's forward takes the timestep.
        attends_to_image: whether a block's attn1 is self-attention on the image tokens.
        bias_keyword: the keyword by which an attention call takes an additive bias on its logits, broadcast
            over queries ((B, 1, keys)), or None when the family's attention has none (ldm's ``mask`` is
            boolean, and the webui's attention kernels drop it): the engine then runs ``biased_attention``.
        biased_attention: where ``bias_keyword`` is None, the forward the engine sets on a self-attention
            module for size-weighted keys: ``biased_attention(module, take_bias)`` (see ``BiasedAttention``).
    """

    is_transformer: Callable[[nn.Module], bool]
    stages: Callable[[nn.Module], "list[tuple[nn.Module, int]] | None"]
    tokens_keyword: str
    kv_slots: tuple[Slot, ...]
    timestep_slot: Slot
    attends_to_image: Callable[[nn.Module], bool]
    bias_keyword: str | None = None
    biased_attention: "Callable[[nn.Module, Callable[[], torch.Tensor | None]], BiasedAttention] | None" = None

    def is_unet(self, root: nn.Module) -> bool:
        return self.stages(root) is not None

    def transformer_levels(self, root: nn.Module) -> list[tuple[str, nn.Module, int]]:
        """Every transformer under ``root`` with its downsampling level (0 = latent resolution), in call order.

        Levels come from the U-Net's structure (a stage that downsamples or upsamples changes the level after
        it), not from token counts, so they hold for any latent size. A module tree that is not one of the
        family's U-Nets has all its transformers at level 0.
        """
        names = {id(m): n for n, m in root.named_modules()}
        stages = self.stages(root)
        if stages is None:
            stages = [(root, 0)]
        found: list[tuple[str, nn.Module, int]] = []
        level = 0
        for stage, step in stages:
            for m in stage.modules():
                if self.is_transformer(m):
                    found.append((names.get(id(m), ""), m, level))
            level += step
        return found


def _has_class(module: nn.Module, name: str) -> bool:
    return any(type(m).__name__ == name for m in module.modules())


def _ldm_stages(root: nn.Module) -> list[tuple[nn.Module, int]] | None:
    if not all(hasattr(root, a) for a in ("input_blocks", "middle_block", "output_blocks")):
        return None
    return ([(block, int(_has_class(block, "Downsample"))) for block in root.input_blocks]
            + [(root.middle_block, 0)]
            + [(block, -int(_has_class(block, "Upsample"))) for block in root.output_blocks])


def _diffusers_stages(root: nn.Module) -> list[tuple[nn.Module, int]] | None:
    if not all(hasattr(root, a) for a in ("down_blocks", "mid_block", "up_blocks")):
        return None
    stages = [(block, int(bool(getattr(block, "downsamplers", None)))) for block in root.down_blocks]
    if isinstance(root.mid_block, nn.Module):
        stages.append((root.mid_block, 0))
    return stages + [(block, -int(bool(getattr(block, "upsamplers", None)))) for block in root.up_blocks]


class BiasedAttention:
    """ldm/sgm ``CrossAttention``'s forward for size-weighted keys (its ``mask`` is boolean, and the webui's
    attention optimisations replace its forward): with a bias pending for this call (``take_bias()``: (B, M),
    added to every query's logit for each key), the module's own projections around PyTorch's
    scaled-dot-product attention with that bias broadcast over queries; without one, the module's class
    forward as it is now (the webui's optimised one), untouched, or the forward another extension had set on
    the instance, which ``previous`` keeps for the engine to give back."""

    def __init__(self, module: nn.Module, take_bias: "Callable[[], torch.Tensor | None]") -> None:
        self.module, self.take_bias = module, take_bias
        self.previous = module.__dict__.get("forward")

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        bias = self.take_bias()
        m = self.module
        x = first_arg(args, kwargs, "x")
        keys = slot_value(args, kwargs, 1, "context")
        keys = x if keys is None else keys
        if (bias is None or slot_value(args, kwargs, 2, "mask") is not None or not isinstance(keys, torch.Tensor)
                or bias.shape != keys.shape[:2]):
            if self.previous is not None:
                return self.previous(*args, **kwargs)
            return type(m).forward(m, *args, **kwargs)
        values = kwargs.get("value")
        values = keys if values is None else values
        q, k, v = m.to_q(x), m.to_k(keys), m.to_v(values)
        b, n, inner = q.shape
        heads = m.heads
        q, k, v = (t.reshape(b, t.shape[1], heads, inner // heads).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias[:, None, None, :].to(q.dtype))
        return m.to_out(out.transpose(1, 2).reshape(b, n, inner))


LDM = Family(
    is_transformer=lambda m: type(m).__name__ == "SpatialTransformer" and hasattr(m, "transformer_blocks"),
    stages=_ldm_stages,
    tokens_keyword="x",
    # ldm and sgm call self-attention with context None (keys and values come from x); Forge passes
    # ``context=`` and ``value=`` explicitly as soon as any attn1 patch is set, usually the very tensor given
    # as x. ``value`` is keyword-only (Forge's).
    kv_slots=((1, "context"), (None, "value")),
    timestep_slot=(1, "timesteps"),
    # Blocks built with disable_self_attn give attn1 the text instead.
    attends_to_image=lambda block: not getattr(block, "disable_self_attn", False),
    biased_attention=BiasedAttention,
)

DIFFUSERS = Family(
    # A Transformer2DModel on continuous latents: the U-Net's. Patch-embedded ones (DiT, PixArt) are not.
    is_transformer=lambda m: (type(m).__name__ == "Transformer2DModel" and hasattr(m, "transformer_blocks")
                              and getattr(m, "is_input_continuous", False)),
    stages=_diffusers_stages,
    tokens_keyword="hidden_states",
    # BasicTransformerBlock passes encoder_hidden_states=None to a self-attending attn1.
    kv_slots=((1, "encoder_hidden_states"),),
    timestep_slot=(1, "timestep"),
    attends_to_image=lambda block: not getattr(block, "only_cross_attention", False),
    # Every diffusers processor adds a float attention_mask to the logits (prepare_attention_mask repeats it
    # per head; SDPA keeps its memory-efficient kernels for a bias broadcast over queries).
    bias_keyword="attention_mask",
)

FAMILIES = (LDM, DIFFUSERS)


def family_of(root: nn.Module) -> Family | None:
    """The family whose U-Net ``root`` is, else the first whose transformers it holds, else None."""
    for family in FAMILIES:
        if family.is_unet(root):
            return family
    for family in FAMILIES:
        if any(family.is_transformer(m) for m in root.modules()):
            return family
    return None


# Class names of diffusion transformers (DiTs): models with no U-Net, whose tokens are image patches with
# positional embeddings and, in most, no spatial grid a 2×2 cell could be taken from.
def diffusion_transformer_name(root: nn.Module) -> str | None:
    """The class name of the first diffusion transformer in ``root`` (PixArt, SD3, Flux, DiT, ...), or None."""
    for m in root.modules():
        name = type(m).__name__
        patched_2d = name == "Transformer2DModel" and getattr(m, "is_input_patches", False)
        if patched_2d or (name.endswith(("Transformer2DModel", "Transformer3DModel")) and name != "Transformer2DModel"):
            return name
        if name in ("MMDiT", "MMDiTX", "Flux", "IntegratedFluxTransformer2DModel", "DiT"):
            return name
    return None


_WHAT = ("a torch.nn.Module (an LDM/SGM model, its U-Net, a diffusers UNet2DConditionModel or a pipeline with "
         "a .unet)")


def resolve_unet(model: Any) -> nn.Module:
    """The module to patch: ``model.model.diffusion_model`` (the webui's ``shared.sd_model``) or
    ``model.diffusion_model`` when present; a diffusers pipeline's ``model.unet``; else ``model`` itself.
    Raises TypeError for what holds no module, ValueError for a pipeline without a U-Net."""
    if model is None:
        raise TypeError(f"model must be {_WHAT}, got None")
    # The webui's sd_model (model.model.diffusion_model) or its DiffusionWrapper (model.diffusion_model), and
    # a wrapper of those (a caller's adapter around a diffusers U-Net holds it as .diffusion_model too).
    for _ in range(4):
        inner = next((m for m in (getattr(getattr(model, "model", None), "diffusion_model", None),
                                  getattr(model, "diffusion_model", None)) if isinstance(m, nn.Module)), None)
        if inner is None or inner is model:
            break
        model = inner
    if isinstance(model, nn.Module):
        return model
    # A diffusers pipeline (not a module itself): its denoiser is .unet, or .transformer in DiT pipelines.
    unet = getattr(model, "unet", None)
    if isinstance(unet, nn.Module):
        return unet
    denoiser = getattr(model, "transformer", None)
    if isinstance(denoiser, nn.Module):
        raise ValueError(f"{type(model).__name__} has no U-Net: its denoiser is {type(denoiser).__name__}, a "
                         f"diffusion transformer; token merging patches U-Nets (SD 1.x, SD 2.x, SDXL) only")
    if hasattr(model, "unet") or hasattr(model, "components"):
        raise ValueError(f"{type(model).__name__} has no U-Net to patch (its .unet is "
                         f"{type(unet).__name__})")
    raise TypeError(f"model must be {_WHAT}, got {type(model).__name__}")


def nothing_to_patch(root: nn.Module) -> ValueError:
    """The error for a module tree in which no family has a transformer to merge."""
    dit = diffusion_transformer_name(root)
    if dit is not None:
        return ValueError(f"model {type(root).__name__} is a diffusion transformer ({dit}: DiT, PixArt, SD3, Flux "
                          f"and similar have no U-Net), so there is nothing to patch: token merging patches U-Nets "
                          f"(SD 1.x, SD 2.x, SDXL) only")
    return ValueError(f"model {type(root).__name__} has no transformer blocks to merge: the engine patches ldm/sgm "
                      f"U-Nets (SpatialTransformer) and diffusers U-Nets (Transformer2DModel) with "
                      f"BasicTransformerBlocks")


# -- model layouts and the settings recommended for each ----------------------------------------------------------

SD_LAYOUT, SDXL_LAYOUT = "sd", "sdxl"

RECOMMENDED: dict[str, dict[str, Any]] = {
    # ToDo factor 2: the README's choice for SD 1.x and 2.x at every size where merging gains (ToMe-at-0.75
    # speed, closer final pictures than the paper's ToMe at 0.25 and 0.5 on every SD 1.5-layout proxy).
    SD_LAYOUT: {"method": "todo", "todo_factor": 2},
    # Cache at its defaults: the README's choice for SDXL (1.8x to 2.0x over a 20- or 30-step run at 1024 px).
    SDXL_LAYOUT: {"method": "cache"},
}
"""The settings the README recommends per model layout, beyond the defaults: what a host's simple form
("Recommended") runs. A method other than these is the user's choice, made in the host's own form."""


def model_layout(model: Any) -> str:
    """``SDXL_LAYOUT`` when the U-Net's highest-resolution attention level lies below the latent's resolution
    (SDXL: no attention at its first level), else ``SD_LAYOUT`` (SD 1.x and 2.x). Raises as ``resolve_unet``
    does, and ValueError (``nothing_to_patch``) for a model with no transformer to merge."""
    root = resolve_unet(model)
    family = family_of(root)
    levels = sorted({level for _, _, level in family.transformer_levels(root)}) if family is not None else []
    if not levels:
        raise nothing_to_patch(root)
    return SDXL_LAYOUT if levels[0] > 0 else SD_LAYOUT
