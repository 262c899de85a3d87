"""A real SD 1.x / 2.x / SDXL checkpoint, read off its own tensors: its U-Net for the speed benchmark
(``build_from_checkpoint``), the whole model as a sampling ``Pipeline`` for fidelity runs (``load_pipeline``).

The architecture comes from the checkpoint's tensors (channel widths, levels with attention, depth per level,
context width, linear or conv projections), so fine-tunes and small test checkpoints load too. Used by
``python -m tome_core.bench --checkpoint FILE``.
"""

from __future__ import annotations

import dataclasses
import os
import re

import torch
from torch import nn

from . import textenc, vae
from .archs import context_as_list, head_channels, in_run_dtype, trim_depths
from .pipeline import Pipeline, sd_alphas_cumprod
from .tensorfile import CheckpointError, TensorFile

PREFIX = "model.diffusion_model."


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
    weights = {k[len(PREFIX):]: v for k, v in tensors.read(PREFIX, dtype, device).items()}
    return _build_unet(path, weights, cfg, device, dtype, False), cfg["family"], cfg["context_dim"]


# Where each family keeps its text encoder(s).
CLIP_L = "cond_stage_model.transformer.text_model."  # SD 1.x: OpenAI CLIP ViT-L/14, Hugging Face layout
CLIP_L_OLD = "cond_stage_model.transformer."  # the same from transformers < 4.x (no "text_model."; webui renames)
OPEN_CLIP_H = "cond_stage_model.model."  # SD 2.x: OpenCLIP ViT-H/14
SDXL_CLIP_L = "conditioner.embedders.0.transformer.text_model."
SDXL_OPEN_CLIP_G = "conditioner.embedders.1.model."
SDXL_REFINER_G = "conditioner.embedders.0.model."
TEXT_PREFIXES = ("cond_stage_model.", "conditioner.")
SDXL_DEFAULT_SIZE = 1024  # the size SDXL's vector conditioning says until ``at_size`` sets the sampled one
FAMILY_NAMES = {"sd1": "SD 1.x", "sd2": "SD 2.x", "sdxl": "SDXL"}


def _other_kind(keys: list[str]) -> str:
    """What a file without an ldm U-Net seems to hold, for the one-line refusal."""
    def has(*parts: str) -> bool:
        return any(part in k for k in keys for part in parts)

    if not keys:
        return "no tensors at all"
    if has("lora_down", "lora_up", "lora_A", "lora_B", "lora_unet_", "hada_w1", "lokr_w1"):
        return "a LoRA/LyCORIS file (load it on top of a checkpoint in the webui; benchmark the checkpoint)"
    if has("joint_blocks.", "x_embedder."):
        return "an SD3-style transformer (MMDiT), not a U-Net"
    if has("double_blocks.", "single_blocks."):
        return "a Flux-style transformer, not a U-Net"
    # A VAE alone before the diffusers U-Net: a diffusers VAE has down_blocks too, inside its encoder.
    if all(k.startswith(("encoder.", "decoder.", "quant_conv.", "post_quant_conv.", "first_stage_model."))
           for k in keys):
        return "a VAE alone"
    if has("down_blocks.", "time_embedding.linear_1."):
        return "a U-Net in diffusers layout (convert it to a single-file checkpoint)"
    if all(k.startswith(TEXT_PREFIXES + ("text_model.", "transformer.")) for k in keys):
        return "a text encoder alone"
    return f"none of the SD 1.x/2.x/SDXL parts (first key: {sorted(keys)[0]!r})"


def _encode_empty_prompt(tensors: TensorFile, family: str, context_dim: int, device: torch.device,
                         notes: list[str]) -> textenc.EmptyPrompt:
    """The empty prompt's conditioning from the file's own text encoder(s), each freed after use; zeros with a
    note when the file has no text encoder at all."""
    keys = tensors.keys
    try:
        def part(prefix: str) -> dict[str, torch.Tensor]:  # text encoders run once, in float32
            return tensors.read(prefix, torch.float32, device)

        if family == "sdxl" and any(k.startswith(SDXL_CLIP_L) or k.startswith(SDXL_OPEN_CLIP_G) for k in keys):
            clip_l = textenc.from_hf_clip(part(SDXL_CLIP_L), SDXL_CLIP_L, device)
            open_clip_g = textenc.from_open_clip(part(SDXL_OPEN_CLIP_G), SDXL_OPEN_CLIP_G, device, projection=True)
            prompt = textenc.encode_sdxl(clip_l, open_clip_g)
            del clip_l, open_clip_g
        elif family == "sd2" and any(k.startswith(OPEN_CLIP_H) for k in keys):
            prompt = textenc.encode_sd2(textenc.from_open_clip(part(OPEN_CLIP_H), OPEN_CLIP_H, device))
        elif family == "sd1" and any(k.startswith(CLIP_L) for k in keys):
            prompt = textenc.encode_sd1(textenc.from_hf_clip(part(CLIP_L), CLIP_L, device))
        elif family == "sd1" and any(k.startswith(CLIP_L_OLD + "embeddings.") for k in keys):
            prompt = textenc.encode_sd1(textenc.from_hf_clip(part(CLIP_L_OLD), CLIP_L_OLD, device))
        elif any(k.startswith(TEXT_PREFIXES) for k in keys):
            found = sorted({".".join(k.split(".")[:3]) for k in keys if k.startswith(TEXT_PREFIXES)})[:3]
            raise CheckpointError(f"--checkpoint {tensors.path}: a {FAMILY_NAMES[family]} U-Net, but its text "
                                  f"encoder is not the one {FAMILY_NAMES[family]} uses (found {', '.join(found)})")
        else:
            notes.append(f"no text encoder in {tensors.path}: the U-Net is conditioned on zeros, not on the empty "
                         f"prompt")
            pooled = None
            if family == "sdxl":  # as wide as the U-Net's vector input leaves after the six size numbers
                adm = tensors.shapes(PREFIX + "label_emb.0.0.weight")[PREFIX + "label_emb.0.0.weight"].shape[1]
                pooled = torch.zeros(1, adm - 6 * textenc.SIZE_CHANNELS, device=device)
            return textenc.EmptyPrompt(torch.zeros(1, textenc.CONTEXT_LENGTH, context_dim, device=device), pooled)
    except textenc.TextEncoderError as error:
        raise CheckpointError(f"--checkpoint {tensors.path}: broken text encoder: {error}") from None
    if prompt.context.shape[-1] != context_dim:
        raise CheckpointError(f"--checkpoint {tensors.path}: its text encoder gives {prompt.context.shape[-1]} "
                              f"channels, its U-Net takes {context_dim}")
    return prompt


@torch.no_grad()
def predicts_velocity(unet: nn.Module, context_dim: int) -> bool:
    """Whether an SD 2.x U-Net predicts velocity (768-v models) rather than noise, decided as the webui's
    ``is_using_v_parameterization_for_sd2`` does: at the last timestep on a constant latent (1, 4, 8, 8) of 0.5
    and a constant context of 0.5, a velocity model's output averages far below the latent (below -1)."""
    dtype = next(unet.parameters()).dtype
    device = next(unet.parameters()).device
    x = torch.full((1, 4, 8, 8), 0.5, device=device, dtype=dtype)
    context = torch.full((1, 2, context_dim), 0.5, device=device, dtype=dtype)
    out = unet(x, torch.tensor([999], device=device), context=context)
    return (out.float() - x.float()).mean().item() < -1


def _schedule(tensors: TensorFile, notes: list[str]) -> torch.Tensor:
    """(1000,) float64 cumulative alphas: SD's default unless the file holds another schedule.

    Half-precision files store the default rounded to float16; that rounding is not a schedule of its own, so
    a stored schedule within float16 rounding of the default gives the default at full precision.
    """
    default = sd_alphas_cumprod()
    raw = tensors.get("alphas_cumprod")
    if raw is None:
        return default
    stored = raw.double().flatten()
    if stored.shape != default.shape or not torch.isfinite(stored).all() or not (stored > 0).all():
        notes.append(f"the schedule in {tensors.path} is not 1000 positive values: SD's default is used")
        return default
    rounding = {torch.float16: 1e-3, torch.bfloat16: 8e-3}.get(raw.dtype, 1e-6)  # relative, per value
    if ((stored - default).abs() <= rounding * default).all():
        return default
    notes.append(f"{tensors.path} holds its own noise schedule: it is used")
    return stored


def load_pipeline(path: str, device: torch.device, dtype: torch.dtype, prediction: str = "auto") -> Pipeline:
    """A user's SD 1.x / 2.x / SDXL checkpoint (``.safetensors`` or ``.ckpt``) as a ``Pipeline``: the U-Net on
    ``device`` in ``dtype``; the empty prompt's conditioning from the file's own text encoder(s) (computed once
    in float32, the encoders then freed); the file's VAE decoder in ``dtype`` as ``decode``; the file's noise
    schedule when it holds one, else SD's.

    prediction: "auto" (for SD 2.x the webui's test; noise for SD 1.x and SDXL unless the file has a ``v_pred``
    key or says ``modelspec.prediction_type`` "v" in its metadata), "eps" or "v" to force it.
    Parts missing from the file, each with a line in ``notes``: no VAE gives ``decode=None`` (sampled latents
    are compared); no text encoder at all gives a zero context (and zero pooled text for SDXL).
    Raises ``CheckpointError`` (one line) for a missing or unreadable file, a file of another kind (no U-Net,
    SD3/Flux, a LoRA, a VAE or a text encoder alone, an SDXL refiner, an inpainting or other non-text-to-image
    U-Net), and a part that is there but broken or does not fit the U-Net.
    SDXL's ``y`` says 1024×1024 px; ``at_size`` sets the size actually sampled.
    """
    if prediction not in ("auto", "eps", "v"):
        raise CheckpointError(f"prediction must be 'auto', 'eps' or 'v', got {prediction!r}")
    tensors = TensorFile(path)
    if not any(k.startswith(PREFIX) for k in tensors.keys):
        raise CheckpointError(f"--checkpoint {path}: no U-Net in this checkpoint; it holds "
                              f"{_other_kind(tensors.keys)}")
    cfg = unet_config(tensors.shapes(PREFIX))
    family, context_dim = cfg["family"], cfg["context_dim"]
    if any(k.startswith(SDXL_REFINER_G) for k in tensors.keys):
        raise CheckpointError(f"--checkpoint {path}: an SDXL refiner, which refines a base model's latents; "
                              f"benchmark the base model")
    if cfg["in_channels"] != 4 or cfg["out_channels"] != 4:
        raise CheckpointError(f"--checkpoint {path}: a U-Net taking {cfg['in_channels']} channels (inpainting, "
                              f"depth or instruct models take an image besides the latent); only text-to-image "
                              f"models (4 channels) sample from noise alone")
    notes: list[str] = []
    # One part at a time, smallest first: the text encoders are gone before the U-Net is read.
    prompt = _encode_empty_prompt(tensors, family, context_dim, device, notes)
    weights = {k[len(PREFIX):]: v for k, v in tensors.read(PREFIX, dtype, device).items()}
    unet = _build_unet(path, weights, cfg, device, dtype, vector_conditioning=True)
    del weights
    depth = max(cfg["depths"].values())
    if depth > 1:
        unet.register_forward_pre_hook(context_as_list(depth), with_kwargs=True)
    y = None
    if family == "sdxl":
        y = textenc.size_embedding(prompt.pooled, SDXL_DEFAULT_SIZE, SDXL_DEFAULT_SIZE)
        expected = unet.label_emb[0][0].in_features
        if y.shape[1] != expected:
            raise CheckpointError(f"--checkpoint {path}: its U-Net takes {expected} channels of vector "
                                  f"conditioning, its text encoder and sizes give {y.shape[1]}")
    if prediction == "auto":
        if family == "sd2":
            prediction = "v" if predicts_velocity(unet, context_dim) else "eps"
        else:
            # Velocity fine-tunes of SD 1.x/SDXL mark themselves: a "v_pred" tensor, or the model spec's metadata.
            stated = str(tensors.metadata.get("modelspec.prediction_type", "")).lower()
            prediction = "v" if "v_pred" in tensors.keys or stated.startswith("v") else "eps"
    decode = None
    if vae.has_decoder(tensors.keys):
        try:
            decoder = vae.build_decoder(tensors.read(vae.VAE_PREFIX + "decoder.", dtype, device)
                                        | tensors.read(vae.VAE_PREFIX + "post_quant_conv.", dtype, device),
                                        family, device, dtype)
        except vae.VaeError as error:
            raise CheckpointError(f"--checkpoint {path}: {error}") from None
        decode = vae.safe_decode(decoder)
    else:
        notes.append(f"no VAE in {path}: latents are compared")
    name = os.path.splitext(os.path.basename(path))[0]
    return Pipeline(name=name, unet=unet, context=prompt.context.float().cpu(),
                    y=None if y is None else y.cpu(), prediction=prediction, decode=decode,
                    alphas_cumprod=_schedule(tensors, notes), notes=notes)


def at_size(pipe: Pipeline, height: int, width: int) -> Pipeline:
    """``pipe`` for images of ``height`` × ``width`` px: SDXL's vector conditioning says that size (the webui
    conditions on the size it generates at); other models are unchanged. ``CheckpointError`` for a size that
    is not a positive multiple of ``pipe.downscale`` px, which the U-Net cannot take."""
    for side in (height, width):
        if side < pipe.downscale or side % pipe.downscale:
            raise CheckpointError(f"size {height}x{width}: each side must be a positive multiple of "
                                  f"{pipe.downscale} px")
    if pipe.y is None:
        return pipe
    pooled = pipe.y[:, :-6 * textenc.SIZE_CHANNELS]
    return dataclasses.replace(pipe, y=textenc.size_embedding(pooled, height, width))
