"""The text encoders of SD 1.x, 2.x and SDXL checkpoints, read off the file's tensors, for the empty prompt only.

An empty prompt needs no tokenizer: it is the start token, the end token and padding. So the conditioning a
checkpoint's own text encoder gives an empty prompt can be computed from the file alone, with nothing
downloaded and neither ``transformers`` nor ``open_clip`` installed.

Both layouts are the same architecture (GPT-2 style pre-norm transformer with causal self-attention, token plus
learned position embeddings, a final LayerNorm); they differ in key names, in the MLP's activation (OpenAI's
CLIP ViT-L/14 uses quick-GELU, OpenCLIP's ViT-H and ViT-bigG use exact GELU), in the padding token, and in which
hidden state the diffusion model was trained on:

    SD 1.x   CLIP ViT-L/14, Hugging Face layout     last layer, then the final LayerNorm (webui default, no skip)
    SD 2.x   OpenCLIP ViT-H/14, OpenCLIP layout      penultimate layer, then the final LayerNorm
    SDXL     CLIP ViT-L/14 (HF layout)               penultimate layer, no final LayerNorm
             + OpenCLIP ViT-bigG/14                  penultimate layer, no final LayerNorm; pooled: the last
                                                     layer's end-token state, final LayerNorm, text projection
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping

import torch
import torch.nn.functional as F
from torch import nn

START_TOKEN = 49406  # "<|startoftext|>" in the CLIP BPE vocabulary (OpenAI's and OpenCLIP's are the same)
END_TOKEN = 49407  # "<|endoftext|>"
CONTEXT_LENGTH = 77
HEAD_CHANNELS = 64  # every SD text encoder has 64-channel heads (ViT-L 12×64, ViT-H 16×64, ViT-bigG 20×64)


class TextEncoderError(ValueError):
    """A text encoder's tensors are there but incomplete or of an unknown shape."""


def empty_prompt_tokens(pad: int, length: int = CONTEXT_LENGTH) -> torch.Tensor:
    """(1, length) int64 ids of the empty prompt: start, end, then ``pad`` (the end token for OpenAI's CLIP as
    the webui pads it, 0 for OpenCLIP)."""
    return torch.tensor([[START_TOKEN, END_TOKEN] + [pad] * (length - 2)], dtype=torch.long)


class _Block(nn.Module):
    """Pre-norm transformer layer: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, width: int, heads: int, activation: str) -> None:
        super().__init__()
        self.heads = heads
        self.activation = activation
        self.ln1 = nn.LayerNorm(width, eps=1e-5)
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width, eps=1e-5)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        # Causal: token i sees tokens 0..i only, so the padding after the end token never reaches it.
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(attended.transpose(1, 2).reshape(b, n, c))
        h = self.fc1(self.ln2(x))
        h = h * torch.sigmoid(1.702 * h) if self.activation == "quick_gelu" else F.gelu(h)
        return x + self.fc2(h)


class TextTransformer(nn.Module):
    """A CLIP text tower in either layout (see ``from_hf_clip`` and ``from_open_clip``).

    ``forward(ids (B, T))`` returns the hidden states: a list of N + 1 tensors (B, T, width), the embeddings
    first, then each layer's output; ``final_norm`` and ``projection`` are applied by the caller as its model
    was trained.
    """

    def __init__(self, vocab: int, width: int, layers: int, length: int, activation: str,
                 projection_dim: int | None = None) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(vocab, width)
        self.position_embedding = nn.Parameter(torch.empty(length, width))
        self.blocks = nn.ModuleList(_Block(width, width // HEAD_CHANNELS, activation) for _ in range(layers))
        self.final_norm = nn.LayerNorm(width, eps=1e-5)
        self.projection = None if projection_dim is None else nn.Parameter(torch.empty(width, projection_dim))

    def forward(self, ids: torch.Tensor) -> list[torch.Tensor]:
        x = self.token_embedding(ids) + self.position_embedding[: ids.shape[1]]
        hidden = [x]
        for block in self.blocks:
            x = block(x)
            hidden.append(x)
        return hidden


def _layer_count(keys, pattern: str) -> int:
    found = {int(m.group(1)) for k in keys if (m := re.match(pattern, k))}
    if not found:
        return 0
    if found != set(range(max(found) + 1)):
        raise TextEncoderError(f"layers {sorted(set(range(max(found) + 1)) - found)} are missing")
    return max(found) + 1


def _build(weights: dict[str, torch.Tensor], layers: int, activation: str, projection: bool,
           device: torch.device) -> TextTransformer:
    """A ``TextTransformer`` holding ``weights`` (already in its own key names), float32 on ``device``."""
    vocab, width = weights["token_embedding.weight"].shape
    length = weights["position_embedding"].shape[0]
    if width % HEAD_CHANNELS or vocab <= END_TOKEN or length < CONTEXT_LENGTH:
        raise TextEncoderError(f"width {width}, vocabulary {vocab}, {length} positions: not a CLIP text encoder")
    projection_dim = weights["projection"].shape[1] if projection else None
    with torch.device("meta"):  # no random initialisation of weights that are overwritten next
        model = TextTransformer(vocab, width, layers, length, activation, projection_dim)
    try:
        model.load_state_dict({k: v.to(device, torch.float32) for k, v in weights.items()}, strict=True,
                              assign=True)
    except RuntimeError as error:
        raise TextEncoderError(str(error).strip().splitlines()[-1].strip()) from None
    return model.eval()


def from_hf_clip(tensors: Mapping[str, torch.Tensor], prefix: str, device: torch.device) -> TextTransformer:
    """OpenAI's CLIP text model in Hugging Face ``CLIPTextModel`` layout, keys ``{prefix}embeddings.*``,
    ``{prefix}encoder.layers.N.*``, ``{prefix}final_layer_norm.*`` (``prefix`` ends in ``text_model.``)."""
    w = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
    layers = _layer_count(w, r"encoder\.layers\.(\d+)\.")
    try:
        mine = {"token_embedding.weight": w.pop("embeddings.token_embedding.weight"),
                "position_embedding": w.pop("embeddings.position_embedding.weight"),
                "final_norm.weight": w.pop("final_layer_norm.weight"),
                "final_norm.bias": w.pop("final_layer_norm.bias")}
        for i in range(layers):
            src, dst = f"encoder.layers.{i}.", f"blocks.{i}."
            for part in ("weight", "bias"):
                # Hugging Face keeps q, k and v apart; one (3·width, width) projection computes the same.
                mine[dst + "qkv." + part] = torch.cat([w.pop(f"{src}self_attn.{p}_proj.{part}") for p in "qkv"])
                for theirs, ours in (("self_attn.out_proj", "out"), ("layer_norm1", "ln1"), ("layer_norm2", "ln2"),
                                     ("mlp.fc1", "fc1"), ("mlp.fc2", "fc2")):
                    mine[f"{dst}{ours}.{part}"] = w.pop(f"{src}{theirs}.{part}")
    except KeyError as error:
        raise TextEncoderError(f"no {prefix}{error.args[0]}") from None
    return _build(mine, layers, "quick_gelu", False, device)


def from_open_clip(tensors: Mapping[str, torch.Tensor], prefix: str, device: torch.device,
                   projection: bool = False) -> TextTransformer:
    """OpenCLIP's text tower, keys ``{prefix}token_embedding.weight``, ``{prefix}positional_embedding``,
    ``{prefix}transformer.resblocks.N.*``, ``{prefix}ln_final.*`` and, with ``projection``,
    ``{prefix}text_projection`` (width, embed dim)."""
    w = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
    layers = _layer_count(w, r"transformer\.resblocks\.(\d+)\.")
    try:
        mine = {"token_embedding.weight": w.pop("token_embedding.weight"),
                "position_embedding": w.pop("positional_embedding"),
                "final_norm.weight": w.pop("ln_final.weight"), "final_norm.bias": w.pop("ln_final.bias")}
        if projection:
            # Some converters store it as a Linear weight (embed dim, width); OpenCLIP multiplies x @ projection.
            mine["projection"] = w["text_projection"] if "text_projection" in w else w["text_projection.weight"].T
        for i in range(layers):
            src, dst = f"transformer.resblocks.{i}.", f"blocks.{i}."
            mine[dst + "qkv.weight"] = w.pop(src + "attn.in_proj_weight")
            mine[dst + "qkv.bias"] = w.pop(src + "attn.in_proj_bias")
            for part in ("weight", "bias"):
                for theirs, ours in (("attn.out_proj", "out"), ("ln_1", "ln1"), ("ln_2", "ln2"), ("mlp.c_fc", "fc1"),
                                     ("mlp.c_proj", "fc2")):
                    mine[f"{dst}{ours}.{part}"] = w.pop(f"{src}{theirs}.{part}")
    except KeyError as error:
        raise TextEncoderError(f"no {prefix}{error.args[0]}") from None
    return _build(mine, layers, "gelu", projection, device)


@dataclass
class EmptyPrompt:
    """What a checkpoint's text encoder(s) make of the empty prompt.

    context: (1, 77, C) cross-attention conditioning. pooled: (1, P) SDXL's pooled text embedding, else None.
    """

    context: torch.Tensor
    pooled: torch.Tensor | None = None


@torch.no_grad()
def encode_sd1(clip_l: TextTransformer) -> EmptyPrompt:
    """SD 1.x: the last hidden state after the final LayerNorm (the webui with "CLIP skip" 1): (1, 77, 768)."""
    ids = empty_prompt_tokens(END_TOKEN).to(clip_l.token_embedding.weight.device)
    return EmptyPrompt(clip_l.final_norm(clip_l(ids)[-1]))


@torch.no_grad()
def encode_sd2(open_clip_h: TextTransformer) -> EmptyPrompt:
    """SD 2.x: the penultimate layer's output, then the final LayerNorm (ldm's FrozenOpenCLIPEmbedder with
    layer "penultimate"): (1, 77, 1024)."""
    ids = empty_prompt_tokens(0).to(open_clip_h.token_embedding.weight.device)
    return EmptyPrompt(open_clip_h.final_norm(open_clip_h(ids)[-2]))


@torch.no_grad()
def encode_sdxl(clip_l: TextTransformer, open_clip_g: TextTransformer) -> EmptyPrompt:
    """SDXL: both encoders' penultimate hidden states without the final LayerNorm, side by side: context
    (1, 77, 768 + 1280); pooled (1, 1280): the last layer's state at the end token, final LayerNorm, projection
    (sgm's FrozenOpenCLIPEmbedder2 with ``legacy=False``)."""
    device = clip_l.token_embedding.weight.device
    hidden_l = clip_l(empty_prompt_tokens(END_TOKEN).to(device))[-2]
    ids_g = empty_prompt_tokens(0).to(open_clip_g.token_embedding.weight.device)
    hidden_g = open_clip_g(ids_g)
    end = 1  # the end token's position in the empty prompt (OpenCLIP pools where the highest id is)
    pooled = open_clip_g.final_norm(hidden_g[-1][:, end]) @ open_clip_g.projection
    return EmptyPrompt(torch.cat([hidden_l, hidden_g[-2].to(device)], dim=-1), pooled.to(device))


SIZE_CHANNELS = 256  # channels per number in SDXL's size conditioning


def size_embedding(pooled: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """SDXL's vector conditioning ``y`` (1, P + 6·256): the pooled text (1, P), then sinusoidal embeddings (as the
    U-Net embeds timesteps: cosines then sines, periods up to 10000) of the original size (height, width), the
    crop's top-left corner (0, 0) and the target size (height, width), 256 channels per number (sgm's
    ConcatTimestepEmbedderND, in the order of SDXL's conditioner)."""
    numbers = torch.tensor([height, width, 0, 0, height, width], dtype=torch.float32, device=pooled.device)
    half = SIZE_CHANNELS // 2
    freqs = torch.exp(-torch.log(torch.tensor(10000.0)) * torch.arange(half, dtype=torch.float32) / half)
    angles = numbers[:, None] * freqs.to(pooled.device)[None]
    embedded = torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1).reshape(1, -1)
    return torch.cat([pooled.float(), embedded], dim=-1)
