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
- how an attention call takes an additive bias on its logits (for size-weighted keys), if it takes one.

Everything is found by class names and attributes, never by importing a family's code, so the engine still
imports none of them, and a third family later is one more entry in ``FAMILIES``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import nn

# (position, keyword) of an argument; position None: keyword only.
Slot = tuple["int | None", str]


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
            boolean, and the webui's attention kernels drop it): the engine then computes that call itself.
    """

    is_transformer: Callable[[nn.Module], bool]
    stages: Callable[[nn.Module], "list[tuple[nn.Module, int]] | None"]
    tokens_keyword: str
    kv_slots: tuple[Slot, ...]
    timestep_slot: Slot
    attends_to_image: Callable[[nn.Module], bool]
    bias_keyword: str | None = None

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
