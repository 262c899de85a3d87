"""A diffusers model folder (``model_index.json``: ``save_pretrained``'s layout) as a sampling ``Pipeline``.

Used by ``python -m tome_core.bench --checkpoint FOLDER``. The folder is read with diffusers' own
``DiffusionPipeline.from_pretrained`` (so diffusers and, for the text encoders, transformers must be
installed); the benchmark then samples, times and compares its U-Net exactly as it does a single-file
checkpoint's, with ours and tomesd patching the diffusers U-Net itself.
"""

from __future__ import annotations

import json
import os

import torch

from .archs import DiffusersCall
from .pipeline import Pipeline
from .tensorfile import CheckpointError

INDEX = "model_index.json"
TEXT_TO_IMAGE = ("StableDiffusionPipeline", "StableDiffusionXLPipeline")


def is_diffusers_folder(path: str) -> bool:
    """Whether ``path`` is a folder holding a diffusers ``model_index.json``."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, INDEX))


def load_pipeline(path: str, device: torch.device, dtype: torch.dtype, prediction: str = "auto") -> Pipeline:
    """The folder's SD 1.x / 2.x / SDXL text-to-image model as a ``Pipeline``: its U-Net on ``device`` in
    ``dtype``, the empty prompt encoded once by its own text encoder(s), its VAE as ``decode``, its scheduler's
    schedule and prediction type (``prediction`` "eps"/"v" overrides). ``CheckpointError`` (one line) when the
    folder cannot be read or holds another kind of model."""
    if prediction not in ("auto", "eps", "v"):
        raise CheckpointError(f"prediction must be 'auto', 'eps' or 'v', got {prediction!r}")
    try:
        with open(os.path.join(path, INDEX)) as f:
            kind = json.load(f).get("_class_name", "")
    except (OSError, ValueError) as error:
        raise CheckpointError(f"--checkpoint {path}: unreadable {INDEX} ({error})") from None
    if kind not in TEXT_TO_IMAGE:
        raise CheckpointError(f"--checkpoint {path}: a {kind or 'model of unknown kind'}; this benchmark samples "
                              f"{' and '.join(TEXT_TO_IMAGE)} folders")
    try:
        import diffusers
    except ImportError:
        raise CheckpointError(f"--checkpoint {path}: a diffusers folder, and diffusers is not installed "
                              f"(pip install diffusers transformers)") from None
    try:
        pipe = diffusers.DiffusionPipeline.from_pretrained(path, torch_dtype=torch.float32, local_files_only=True)
    except Exception as error:  # diffusers, transformers and safetensors each raise their own kinds
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise CheckpointError(f"--checkpoint {path}: diffusers could not load it ({first_line})") from None
    unet = pipe.unet
    if unet is None or unet.config.in_channels != 4:
        raise CheckpointError(f"--checkpoint {path}: its U-Net takes "
                              f"{getattr(getattr(unet, 'config', None), 'in_channels', '?')} channels; only "
                              f"text-to-image models (4) sample from noise alone")
    notes: list[str] = []
    pooled = None
    with torch.no_grad():
        if kind == "StableDiffusionXLPipeline":
            context, _, pooled, _ = pipe.encode_prompt("", device="cpu", num_images_per_prompt=1,
                                                       do_classifier_free_guidance=False)
        elif pipe.text_encoder is not None and pipe.tokenizer is not None:
            context, _ = pipe.encode_prompt("", "cpu", 1, False)
        else:
            context = torch.zeros(1, pipe.tokenizer.model_max_length if pipe.tokenizer else 77,
                                  unet.config.cross_attention_dim)
            notes.append(f"no text encoder in {path}: zero conditioning")
    unet = unet.to(device=device, dtype=dtype).eval()
    if prediction == "auto":
        prediction = "v" if pipe.scheduler.config.get("prediction_type") == "v_prediction" else "eps"
    decode, downscale = None, 8
    if getattr(pipe, "vae", None) is not None:
        downscale = 2 ** (len(pipe.vae.config.block_out_channels) - 1)
        decoder = pipe.vae.to(device=device, dtype=dtype).eval()
        scale = decoder.config.scaling_factor

        @torch.no_grad()
        def decode(latents: torch.Tensor) -> torch.Tensor:
            image = decoder.decode(latents.to(decoder.dtype) / scale).sample
            if not torch.isfinite(image).all() and decoder.dtype != torch.float32:
                decoder.float()  # SDXL's VAE overflows in float16
                image = decoder.decode(latents.float() / scale).sample
            return ((image.float() + 1) / 2).clamp(0, 1)
    else:
        notes.append(f"no VAE in {path}: latents are compared")
    alphas = getattr(pipe.scheduler, "alphas_cumprod", None)
    if not isinstance(alphas, torch.Tensor) or alphas.numel() != 1000:
        raise CheckpointError(f"--checkpoint {path}: its scheduler ({type(pipe.scheduler).__name__}) has no "
                              f"1000-step discrete schedule")
    name = os.path.basename(os.path.normpath(path))
    return Pipeline(name=f"{name} (diffusers)", unet=DiffusersCall(unet, pooled, downscale),
                    context=context.float().cpu(), prediction=prediction, downscale=downscale, decode=decode,
                    alphas_cumprod=alphas.double().cpu(), notes=notes,
                    size=1024 if pooled is not None and downscale == 8 else None)
