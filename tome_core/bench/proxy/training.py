"""How the shipped proxies were made: ``python -m tome_core.bench.proxy train --seed 0 --out FILE``.

Epsilon prediction on SD's own discrete schedule, random crops at several scales of the photographs
scikit-image and scikit-learn ship, mostly at small sizes (attention cost), finishing at the layout's
evaluation size (64 px; the SDXL layout's 128 px). ``--data scenes`` trains a prompted proxy instead: scenes
a prompt describes (``scenes``) drawn on crops of the same photographs, its prompt's words embedded by a learned
table (``PromptEncoder``) and dropped to the empty prompt a tenth of the time, as classifier-free guidance
needs. Everything random (initial weights, crops, flips, timesteps,
noise) comes from generators seeded by the run's seed, so a run is repeatable bit for bit on the same machine
and thread count. The images in ``HELD_OUT`` are never used in training.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..archs import use_webui_unet
from ..levels import attention_levels, skipped
from ..pipeline import sd_alphas_cumprod
from . import (CONTEXT_DIM, CONTEXT_TOKENS, EVAL_SIZE, LAYOUTS, PromptEncoder, arch_with_widths, build_proxy_unet,
               scenes)

# Photographs (scikit-image's ``skimage.data`` names; "china" and "flower" are scikit-learn's sample images).
# Grayscale ones are used as three equal channels.
TRAIN_IMAGES = ("astronaut", "coffee", "rocket", "motorcycle_left", "hubble_deep_field", "retina",
                "immunohistochemistry", "china", "grass", "gravel", "brick", "coins", "moon", "clock", "cell",
                "page", "text")
# Never seen in training: where tests measure what merging does to the model's prediction on unseen pictures.
HELD_OUT = ("chelsea", "flower", "camera")


@dataclass
class TrainConfig:
    """One training run. ``stages`` are (crop side px, steps, batch) run in order."""

    seed: int = 0
    stages: tuple[tuple[int, int, int], ...] = LAYOUTS["sd15"].stages
    layout: str = "sd15"
    lr: float = 1e-3
    warmup: int = 100
    ema: float = 0.99
    threads: int = 1  # one thread: on a CPU shared with other work, two spin against each other (5× slower)
    data: str = "photographs"  # or "scenes": prompted scenes (``scenes``) on the photographs' textures
    drop_prompt: float = 0.1  # scenes: how often a prompt is replaced by the empty one (for guidance)
    save_every_stage: str | None = None  # a path pattern with {stage}: the EMA weights after each stage
    # The cosine's end as a share of ``lr`` (0: to nothing). Tried at 0.1 so that a prompted recipe's last stage,
    # at the evaluation size, still learns (docs/proxy.md#prompted-proxies).
    lr_floor: float = 0.0
    # The levels' widths (one factor a level; None: the layout's): a prompted proxy widens its coarse levels so
    # that they, not the levels above, take on the picture's layout (docs/proxy.md#prompted-proxies).
    channel_mult: tuple[int, ...] | None = None
    # At the evaluation size, timesteps drawn toward the noisy end (``shifted_timesteps``; 1: uniform). What a
    # picture's layout is gets decided at high noise, and the small stages taught it at their sizes only; the
    # low-noise steps' work is local and carries over from them.
    eval_shift: float = 1.0
    # A curriculum: the first ``deep_first`` stages train with every attention level's transformers but the
    # deepest's returning their input, so the deep level learns the picture's layout (where and what, from the
    # prompt) before the levels above can; they join at the next stage, starting as the identity (their output
    # projections are zero), and learn what is left. In SDXL the deep level is where the layout is decided;
    # trained all at once, a proxy's 4,096-token level took it on, more or less by seed
    # (docs/proxy.md#prompted-proxies).
    deep_first: int = 0
    # Which levels those stages train (``FIRST_LEVELS``): "deepest", or "ends": the deepest and the highest-
    # resolution one, the levels between joining later. Trained deepest-first, SD 1.5's 4,096-token level joined
    # a stage late and did too little (27 to 33 dB skipped); trained beside the deepest from the start, both
    # matter (12 to 16 dB) and the levels between stay near the bar (docs/proxy.md#prompted-proxies).
    first_levels: str = "deepest"


# What ``TrainConfig.first_levels`` may say.
FIRST_LEVELS = ("deepest", "ends")


def held_levels(levels: list[int], first_levels: str) -> frozenset[int]:
    """Of the sorted attention ``levels``, those a curriculum's first stages hold back (their transformers
    return their input): every one but the deepest, and with "ends" but the highest-resolution one too."""
    trained = {levels[-1]} | ({levels[0]} if first_levels == "ends" else set())
    return frozenset(levels) - trained


def load_photographs(names: tuple[str, ...]) -> list[torch.Tensor]:
    """The named photographs as float32 tensors (3, H, W) in [-1, 1]. Needs scikit-image (and scikit-learn for
    "china" and "flower"), which ship them offline."""
    import numpy as np

    out = []
    for name in names:
        if name in ("china", "flower"):
            from sklearn.datasets import load_sample_image

            array = load_sample_image(f"{name}.jpg")
        else:
            import skimage.data

            array = skimage.data.stereo_motorcycle()[0] if name == "motorcycle_left" else getattr(skimage.data, name)()
        array = np.asarray(array)
        if array.ndim == 2:
            array = np.repeat(array[:, :, None], 3, axis=2)
        image = torch.from_numpy(np.array(array[:, :, :3], copy=True)).permute(2, 0, 1).float() / 127.5 - 1.0
        out.append(image)
    return out


def pyramid(image: torch.Tensor, smallest: int = 16) -> list[torch.Tensor]:
    """``image`` (3, H, W) and its successive halvings (antialiased) while the shorter side stays at least
    ``smallest``: crops are resized from the level closest above their target size, so a 16 px view of a
    1411 px photograph costs a small resize, not a pass over the whole photograph."""
    levels = [image]
    while min(levels[-1].shape[1:]) // 2 >= smallest:
        h, w = levels[-1].shape[1:]
        levels.append(F.interpolate(levels[-1][None], size=(h // 2, w // 2), mode="bilinear", antialias=True,
                                    align_corners=False)[0])
    return levels


def random_crops(pyramids: list[list[torch.Tensor]], count: int, size: int, gen: torch.Generator,
                 min_side: int | None = None) -> torch.Tensor:
    """``count`` square crops (count, 3, size, size) in [-1, 1] from images given as ``pyramid``s: an image
    chosen in proportion to the square root of its area, a side between ``min_side`` (default ``size``) and the
    image's shorter side on a log scale (so fine texture and whole-object views are both common), a random
    place, resized to ``size`` with antialiasing, and a horizontal flip half the time."""
    # sqrt(area): larger photographs give more distinct views, but by area alone the 1411 px retina would be a
    # third of all crops.
    weights = torch.tensor([float(p[0].shape[1] * p[0].shape[2]) ** 0.5 for p in pyramids])
    picks = torch.multinomial(weights, count, replacement=True, generator=gen)
    u = torch.rand(count, 4, generator=gen, dtype=torch.float64)
    crops = []
    for i in range(count):
        levels = pyramids[int(picks[i])]
        h, w = levels[0].shape[1:]
        low, high = math.log(min_side or size), math.log(min(h, w))
        side = min(min(h, w), int(round(math.exp(low + (high - low) * float(u[i, 0])))))
        top = int(float(u[i, 1]) * (h - side + 1))
        left = int(float(u[i, 2]) * (w - side + 1))
        # The smallest level on which the crop still has at least ``size`` pixels per side.
        k = min(len(levels) - 1, max(0, int(math.floor(math.log2(side / size)))))
        scale = levels[k].shape[1] / h
        t, l, s = int(top * scale), int(left * scale), max(size, int(side * scale))
        t, l = max(0, min(t, levels[k].shape[1] - s)), max(0, min(l, levels[k].shape[2] - s))
        crop = levels[k][None, :, t:t + s, l:l + s]
        if s != size:
            crop = F.interpolate(crop, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
        if float(u[i, 3]) < 0.5:
            crop = crop.flip(-1)
        crops.append(crop)
    return torch.cat(crops).clamp(-1.0, 1.0)


def held_out_crops(count: int = 8, size: int = EVAL_SIZE, seed: int = 1234) -> torch.Tensor:
    """``count`` crops (count, 3, size, size) of the held-out photographs, at several scales."""
    pyramids = [pyramid(image) for image in load_photographs(HELD_OUT)]
    return random_crops(pyramids, count, size, torch.Generator().manual_seed(seed))


def noised(x0: torch.Tensor, t: torch.Tensor, noise: torch.Tensor, alphas_cumprod: torch.Tensor) -> torch.Tensor:
    """x0 (B, C, h, w) noised to timesteps t (B,) with ``noise`` (B, C, h, w), as the U-Net sees it (SD's
    variance-preserving input: sqrt(ᾱ)·x0 + sqrt(1 − ᾱ)·ε)."""
    a = alphas_cumprod.to(x0.device)[t].to(x0.dtype)[:, None, None, None]
    return a.sqrt() * x0 + (1 - a).sqrt() * noise


def shifted_timesteps(count: int, shift: float, steps: int, gen: torch.Generator) -> torch.Tensor:
    """``count`` training timesteps (count,) int64 in [0, steps): u uniform in [0, 1) mapped by
    shift·u / (1 + (shift − 1)·u), the resolution shift of rectified-flow training (Esser et al. 2024), so that
    shift > 1 draws the noisy end more often (a share ``shift / (1 + shift)`` of them above the middle)."""
    u = torch.rand(count, generator=gen, dtype=torch.float64)
    return (shift * u / (1 + (shift - 1) * u) * steps).long().clamp(max=steps - 1)


def train(config: TrainConfig, images: list[torch.Tensor] | None = None, log=print) -> dict[str, torch.Tensor]:
    """Train a proxy from ``config.seed``; returns its EMA weights (float32) with the learned context under
    ``"context"``.

    ``images`` defaults to the ``TRAIN_IMAGES`` photographs. One generator drives crops, timesteps and noise;
    the initial weights come from the same seed. The learning rate warms up linearly, then follows a cosine to 0
    over all stages, so the last (largest) stage ends on small steps.
    """
    torch.set_num_threads(config.threads)
    use_webui_unet()  # SDP attention: what the model runs with when loaded, and much cheaper to train
    if images is None:
        images = load_photographs(TRAIN_IMAGES)
    pyramids = [pyramid(image) for image in images]
    unet = build_proxy_unet(config.seed, config.layout, config.channel_mult).train()
    gen = torch.Generator().manual_seed(config.seed)
    prompted = config.data == "scenes"
    if prompted:
        # The backgrounds are named after the photographs (given ``images`` take the first names in turn), so
        # every prompted proxy has the same words.
        backgrounds = TRAIN_IMAGES[:len(images)]
        encoder = PromptEncoder(scenes.vocabulary(TRAIN_IMAGES))
        with torch.no_grad():
            encoder.words.normal_(generator=gen)
            encoder.slots.normal_(generator=gen)
        extra = {"prompt.words": encoder.words, "prompt.slots": encoder.slots}
    else:
        extra = {"context": nn.Parameter(torch.randn(1, CONTEXT_TOKENS, CONTEXT_DIM, generator=gen))}
    params = list(unet.parameters()) + list(extra.values())
    opt = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0)
    ema = [p.detach().clone() for p in params]
    alphas = sd_alphas_cumprod().float()
    total = sum(steps for _, steps, _ in config.stages)
    step, start, recent = 0, time.time(), []
    held = held_levels(attention_levels(unet), config.first_levels)
    for stage, (size, steps, batch) in enumerate(config.stages):
        # The held levels' transformers still run with their output dropped: no gradient reaches them, and
        # AdamW without weight decay leaves a parameter that has none where it is. Skipping no level hooks nothing.
        with skipped(unet, held if stage < config.deep_first else frozenset()):
            for _ in range(steps):
                warm = min(1.0, (step + 1) / config.warmup)
                if config.lr_floor:
                    cosine = 0.5 * (1 + math.cos(math.pi * step / total))
                    lr = config.lr * warm * (config.lr_floor + (1 - config.lr_floor) * cosine)
                else:  # the photographs' proxies' own expression, so they train again bit for bit
                    lr = config.lr * warm * 0.5 * (1 + math.cos(math.pi * step / total))
                for group in opt.param_groups:
                    group["lr"] = lr
                if prompted:
                    x0, said = scenes.scene_batch(pyramids, backgrounds, batch, size, gen, random_crops)
                    dropped = scenes.drop_prompts(batch, config.drop_prompt, gen)
                    words = torch.stack([scenes.tokens(scenes.EMPTY if drop else scene, encoder.vocab)
                                         for scene, drop in zip(said, dropped)])
                    context = encoder(words)
                else:
                    x0 = random_crops(pyramids, batch, size, gen)
                    context = extra["context"].expand(batch, -1, -1)
                if config.eval_shift != 1.0 and size == LAYOUTS[config.layout].eval_size:
                    t = shifted_timesteps(batch, config.eval_shift, len(alphas), gen)
                else:
                    t = torch.randint(0, len(alphas), (batch,), generator=gen)
                noise = torch.randn(x0.shape, generator=gen)
                pred = unet(noised(x0, t, noise, alphas), t, context=context)
                loss = F.mse_loss(pred, noise)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
                with torch.no_grad():
                    # EMA from the start would drag in the random init for ~1/(1-decay) steps; ramp the decay up.
                    decay = min(config.ema, (1 + step) / (10 + step))
                    for e, p in zip(ema, params):
                        e.mul_(decay).add_(p.detach(), alpha=1 - decay)
                recent.append(loss.item())
                step += 1
                if step % 100 == 0 or step == total:
                    log(f"step {step}/{total} size {size} loss(last 100) {sum(recent) / len(recent):.4f} "
                        f"lr {lr:.2e} {time.time() - start:.0f}s")
                    recent = []
        if config.save_every_stage:
            save_weights(_named(unet, extra, ema), config.save_every_stage.format(stage=f"{size}px"),
                         training_metadata(config), config.layout)
    return _named(unet, extra, ema)


def _named(unet: nn.Module, extra: dict[str, nn.Parameter], ema: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The EMA weights by name: the U-Net's, then the context's or the prompt encoder's."""
    names = [n for n, _ in unet.named_parameters()] + list(extra)
    return {name: e.clone() for name, e in zip(names, ema)}


def training_metadata(config: TrainConfig) -> dict[str, str]:
    """What a weights file says of its training: the seed, the stages and, for a prompted proxy, its data and
    the words its prompts are made of (what loading builds its encoder from)."""
    out = {"seed": str(config.seed), "stages": json.dumps(config.stages),
           "arch": json.dumps(arch_with_widths(config.layout, config.channel_mult))}
    if config.data == "scenes":
        out.update(data="scenes", vocabulary=json.dumps(scenes.vocabulary(TRAIN_IMAGES)),
                   drop_prompt=str(config.drop_prompt), lr_floor=str(config.lr_floor))
    if config.eval_shift != 1.0:
        out["eval_shift"] = str(config.eval_shift)
    if config.deep_first:
        out["deep_first"] = str(config.deep_first)
        if config.first_levels != "deepest":
            out["first_levels"] = config.first_levels
    return out


def save_weights(state: dict[str, torch.Tensor], path: str, metadata: dict[str, str] | None = None,
                 layout: str = "sd15") -> None:
    """Write ``state`` as float16 safetensors (the shipped file must stay small; float16 loses nothing that
    ranking methods needs), with its architecture (and, for SDXL's layout, the layout's name) in the metadata."""
    from safetensors.torch import save_file

    spec = LAYOUTS[layout]
    named = {} if layout == "sd15" else {"layout": layout, "depths": json.dumps(spec.depths)}
    # ``metadata`` (``training_metadata``) names the architecture trained, widths included; the layout's own
    # where it does not.
    save_file({k: v.detach().to(torch.float16).contiguous() for k, v in state.items()}, path,
              metadata={"arch": json.dumps(spec.arch), **named, **(metadata or {})})
