"""Forge's U-Net (``backend.nn.unet``) as a patch meets it, built around the modules of an ldm U-Net.

What matters to a patch, and what this double keeps from Forge:
- the module tree and parameter names are ldm's (``input_blocks.1.1.transformer_blocks.0.attn1.to_q``), so
  one checkpoint loads into both; class names ``SpatialTransformer``, ``BasicTransformerBlock``,
  ``CrossAttention``, ``Downsample``/``Upsample`` as in Forge;
- every call below the U-Net carries ``transformer_options`` (``block``, ``block_index``,
  ``transformer_index``, ``original_shape``, the patcher's ``patches`` and ``patches_replace``);
- a transformer block is called ``block(x, context=..., transformer_options=...)`` and calls attention as
  ``attn(n, context=..., value=..., transformer_options=...)``. Once any ``attn1_patch`` is set, self-attention
  gets its key and value source explicitly (``context=n, value=n``) instead of ``None``;
- patch points run where Forge runs them: ``attn1_patch``/``attn2_patch`` on the normed tokens before
  attention, ``patches_replace`` instead of the attention call, ``attn1_output_patch``/``attn2_output_patch``
  on attention's output, ``middle_patch`` between the two attentions, ``input_block_patch``,
  ``input_block_patch_after_skip`` and ``output_block_patch`` around the U-Net's blocks;
- the residual additions are in place on the block's input (``x += n``);
- attention is PyTorch's scaled dot product attention, not ldm's kernel, so outputs differ from ldm's by
  rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def attention_function(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int,
                       mask: torch.Tensor | None = None) -> torch.Tensor:
    """(B, Nq, H·D), (B, Nk, H·D), (B, Nk, H·D) -> (B, Nq, H·D)."""
    b, _, inner = q.shape
    d = inner // heads
    q, k, v = (t.reshape(b, -1, heads, d).transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out.transpose(1, 2).reshape(b, -1, inner)


class CrossAttention(nn.Module):
    def __init__(self, ldm_attention: nn.Module) -> None:
        super().__init__()
        self.heads = ldm_attention.heads
        self.dim_head = ldm_attention.to_q.out_features // self.heads
        self.to_q, self.to_k = ldm_attention.to_q, ldm_attention.to_k
        self.to_v, self.to_out = ldm_attention.to_v, ldm_attention.to_out

    def forward(self, x, context=None, value=None, mask=None, transformer_options={}):
        source = x if context is None else context
        k = self.to_k(source)
        v = self.to_v(source if value is None else value)
        return self.to_out(attention_function(self.to_q(x), k, v, self.heads, mask))


def _block_key(transformer_options: dict):
    block = transformer_options.get("block")
    if block is None:
        return None, None
    return block, (block[0], block[1], transformer_options.get("block_index", 0))


def _replacement(replacements: dict, name: str, keys):
    table = replacements.get(name, {})
    for key in keys:
        if key is not None and key in table:
            return table[key]
    return None


class BasicTransformerBlock(nn.Module):
    attention_class = CrossAttention
    attention_gets_options = True  # attention is called with ``transformer_options=``
    in_place_residual = True       # ``x += n`` on the block's input

    def __init__(self, ldm_block: nn.Module) -> None:
        super().__init__()
        self.disable_self_attn = getattr(ldm_block, "disable_self_attn", False)
        self.attn1 = self.attention_class(ldm_block.attn1)
        self.attn2 = self.attention_class(ldm_block.attn2)
        self.norm1, self.norm2, self.norm3 = ldm_block.norm1, ldm_block.norm2, ldm_block.norm3
        self.ff = ldm_block.ff
        self.n_heads, self.d_head = self.attn1.heads, self.attn1.dim_head

    def forward(self, x, context=None, transformer_options={}):
        return self._forward(x, context, transformer_options)

    def _attention(self, attention, n, source, value, patches, replacements, name, extra, keys):
        """One attention with its patch points: ``<name>_patch`` functions, then a replacement or the call."""
        if f"{name}_patch" in patches:
            value = source
            for patch in patches[f"{name}_patch"]:
                n, source, value = patch(n, source, value, extra)
        replace = _replacement(replacements, name, keys)
        if replace is not None:
            source = n if source is None else source
            value = source if value is None else value
            out = replace(attention.to_q(n), attention.to_k(source), attention.to_v(value), extra)
            n = attention.to_out(out)
        elif self.attention_gets_options:
            n = attention(n, context=source, value=value, transformer_options=extra)
        else:
            n = attention(n, context=source, value=value)
        for patch in patches.get(f"{name}_output_patch", ()):
            n = patch(n, extra)
        return n

    def _add(self, x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        if self.in_place_residual:
            x += n
            return x
        return n + x

    def _forward(self, x, context=None, transformer_options={}):
        patches = transformer_options.get("patches", {})
        replacements = transformer_options.get("patches_replace", {})
        extra = {k: v for k, v in transformer_options.items() if k not in ("patches", "patches_replace")}
        extra["n_heads"], extra["dim_head"] = self.n_heads, self.d_head
        block, block_with_index = _block_key(transformer_options)
        keys = (block_with_index, block)

        n = self.norm1(x)
        source = context if self.disable_self_attn else None
        if "attn1_patch" in patches and source is None:
            source = n  # a patch sees (and may change) self-attention's key/value source explicitly
        x = self._add(x, self._attention(self.attn1, n, source, None, patches, replacements, "attn1", extra, keys))
        for patch in patches.get("middle_patch", ()):
            x = patch(x, extra)
        n = self.norm2(x)
        x = self._add(x, self._attention(self.attn2, n, context, None, patches, replacements, "attn2", extra, keys))
        x = self.ff(self.norm3(x)) + x
        return x


class SpatialTransformer(nn.Module):
    block_class = BasicTransformerBlock

    def __init__(self, ldm_transformer: nn.Module) -> None:
        super().__init__()
        self.norm, self.proj_in, self.proj_out = ldm_transformer.norm, ldm_transformer.proj_in, ldm_transformer.proj_out
        self.use_linear = ldm_transformer.use_linear
        self.transformer_blocks = nn.ModuleList(self.block_class(b) for b in ldm_transformer.transformer_blocks)

    def forward(self, x, context=None, transformer_options={}):
        if not isinstance(context, list):
            context = [context] * len(self.transformer_blocks)
        b, c, h, w = x.shape
        x_in = x
        x = self.norm(x)
        if not self.use_linear:
            x = self.proj_in(x)
        x = x.flatten(2).transpose(1, 2).contiguous()
        if self.use_linear:
            x = self.proj_in(x)
        for i, block in enumerate(self.transformer_blocks):
            transformer_options["block_index"] = i
            x = block(x, context=context[i], transformer_options=transformer_options)
        if self.use_linear:
            x = self.proj_out(x)
        x = x.transpose(1, 2).reshape(b, -1, h, w).contiguous()
        if not self.use_linear:
            x = self.proj_out(x)
        return x + x_in


class TimestepEmbedSequential(nn.Sequential):
    def forward(self, x, emb, context=None, transformer_options={}, output_shape=None):
        for layer in self:
            if isinstance(layer, SpatialTransformer):  # Forge's, or a subclass (the ldm_patched double's)
                x = layer(x, context, transformer_options)
                if "transformer_index" in transformer_options:
                    transformer_options["transformer_index"] += 1
            elif type(layer).__name__ == "ResBlock":
                x = layer(x, emb)
            else:
                x = layer(x)
        return x


def _convert(sequential: nn.Module, transformer_class: type) -> TimestepEmbedSequential:
    layers = [transformer_class(layer) if type(layer).__name__ == "SpatialTransformer" else layer
              for layer in sequential]
    return TimestepEmbedSequential(*layers)


class IntegratedUNet2DConditionModel(nn.Module):
    """Forge's U-Net class. ``from ldm`` takes over an ldm ``UNetModel``'s modules (and so its weights)."""

    transformer_class = SpatialTransformer

    def __init__(self, ldm_unet: nn.Module) -> None:
        super().__init__()
        self.model_channels = ldm_unet.model_channels
        self.num_classes = ldm_unet.num_classes
        self.time_embed = ldm_unet.time_embed
        if self.num_classes is not None:
            self.label_emb = ldm_unet.label_emb
        self.input_blocks = nn.ModuleList(_convert(b, self.transformer_class) for b in ldm_unet.input_blocks)
        self.middle_block = _convert(ldm_unet.middle_block, self.transformer_class)
        self.output_blocks = nn.ModuleList(_convert(b, self.transformer_class) for b in ldm_unet.output_blocks)
        self.out = ldm_unet.out

    def forward(self, x, timesteps=None, context=None, y=None, control=None, transformer_options={}, **kwargs):
        from ldm.modules.diffusionmodules.util import timestep_embedding

        transformer_options["original_shape"] = list(x.shape)
        transformer_options["transformer_index"] = 0
        patches = transformer_options.get("patches", {})
        emb = self.time_embed(timestep_embedding(timesteps, self.model_channels, repeat_only=False).to(x.dtype))
        if self.num_classes is not None:
            emb = emb + self.label_emb(y)
        skips = []
        h = x
        for index, module in enumerate(self.input_blocks):
            transformer_options["block"] = ("input", index)
            h = module(h, emb, context, transformer_options)
            for patch in patches.get("input_block_patch", ()):
                h = patch(h, transformer_options)
            skips.append(h)
            for patch in patches.get("input_block_patch_after_skip", ()):
                h = patch(h, transformer_options)
        transformer_options["block"] = ("middle", 0)
        h = self.middle_block(h, emb, context, transformer_options)
        for index, module in enumerate(self.output_blocks):
            transformer_options["block"] = ("output", index)
            skip = skips.pop()
            for patch in patches.get("output_block_patch", ()):
                h, skip = patch(h, skip, transformer_options)
            if h.shape[-2:] != skip.shape[-2:]:  # Forge upsamples to the skip's size (odd latent sizes)
                h = F.interpolate(h, size=skip.shape[-2:], mode="nearest")
            h = module(torch.cat([h, skip], dim=1), emb, context, transformer_options)
        transformer_options["block"] = ("last", 0)
        return self.out(h.type(x.dtype))
