"""The shipped proxy model: a small SD 1.x-layout U-Net trained here on real photographs, in pixel space.

Why it exists: a fidelity figure (the same sampling run with and without a merging method, final pictures
compared) needs a model whose tokens carry an image's redundancy. Random weights do not (ToMe moved their
output as much on photographs as on Gaussian noise), and a user's checkpoint is not always at hand. This model
is a proxy that ranks methods, not an FID: its pictures are 64×64 px textures in photographs' colours, not SD's
images, and merging moves it far less than it moves SD (PSNR in the 40s of dB at ratio 0.5), so its fidelity
figures order methods and ratios; they do not predict what a user will see.

Layout: ldm's ``UNetModel`` as SD 1.x builds it (SpatialTransformers with one BasicTransformerBlock at
downsampling 1, 2 and 4, none in the lowest level's input/output blocks, one in the middle block; conv 1×1
projections; fixed head count), at small widths, taking and predicting 3-channel pixels in [-1, 1]. At 64×64 px
its top level holds 4,096 tokens, as SD 1.5's does at 512×512 px. Its "empty prompt" is a learned (1, 4, 32)
context stored with the weights, so cross-attention sees a fixed conditioning as in SD's unconditional pass.

Training: ``python -m tome_core.bench.proxy train --seed 0 --out FILE``: epsilon prediction on SD's own discrete
schedule, random crops at several scales of the photographs scikit-image and scikit-learn ship, mostly at
32 px (attention cost), finishing at the evaluation size of 64 px. Everything random (initial weights, crops,
flips, timesteps, noise) comes from generators seeded by ``--seed``, so a run is repeatable bit for bit on the
same machine and thread count. The images in ``HELD_OUT`` are never used in training.

Loading (``load_proxy``) needs only torch, ldm and safetensors: the photograph packages are for training and
tests.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .pipeline import Pipeline, sd_alphas_cumprod

HERE = os.path.dirname(os.path.abspath(__file__))
WEIGHTS_FILE = os.path.join(HERE, "proxy_weights.safetensors")  # seed 0, the first of the shipped proxies
# Every shipped proxy, each trained by ``train`` with the default stages from its own seed: the default run
# measures fidelity on each, since one proxy's figures do not all replicate on another.
SHIPPED_WEIGHTS = (WEIGHTS_FILE, os.path.join(HERE, "proxy_weights_seed1.safetensors"),
                   os.path.join(HERE, "proxy_weights_seed2.safetensors"))
# The SDXL-layout proxies (``--layout sdxl``), seeds 0, 1 and 2: the default run races them after the others.
SHIPPED_SDXL_WEIGHTS = tuple(os.path.join(HERE, f"proxy_weights_sdxl_seed{k}.safetensors") for k in range(3))


def shipped_weights(layouts: tuple[str, ...] = ("sd15", "sdxl")) -> tuple[list[str], list[str]]:
    """The shipped proxies' weight files of ``layouts`` that are here, and those that are not (each missing one
    is made by ``train_command``)."""
    files = (SHIPPED_WEIGHTS if "sd15" in layouts else ()) + (SHIPPED_SDXL_WEIGHTS if "sdxl" in layouts else ())
    here = [p for p in files if os.path.isfile(p)]
    return here, [p for p in files if p not in here]


def train_command(path: str) -> str:
    """The command that makes the shipped proxy file ``path`` again (its seed is its place in
    ``SHIPPED_WEIGHTS`` or ``SHIPPED_SDXL_WEIGHTS``)."""
    if path in SHIPPED_SDXL_WEIGHTS:
        return (f"python -m tome_core.bench.proxy train --layout sdxl --seed {SHIPPED_SDXL_WEIGHTS.index(path)} "
                f"--out {path}")
    seed = SHIPPED_WEIGHTS.index(path) if path in SHIPPED_WEIGHTS else 0
    return f"python -m tome_core.bench.proxy train --seed {seed} --out {path}"
EVAL_SIZE = 64  # px per side at which fidelity runs and tests use the model: 4,096 tokens at the top level
CONTEXT_TOKENS, CONTEXT_DIM = 4, 32

# ldm UNetModel arguments: SD 1.x's layout (four levels, attention at downsampling 1, 2 and 4 and in the middle
# block, none in the lowest level's input/output blocks, conv projections, a fixed number of heads) at 1/10 of
# its width and one residual block per level instead of two: 3.8 M parameters (7.6 MB in float16), and a
# training step cheap enough for a 30-minute CPU budget.
PROXY_ARCH = dict(image_size=EVAL_SIZE, in_channels=3, out_channels=3, model_channels=32, channel_mult=[1, 2, 2, 4],
                  num_res_blocks=1, attention_resolutions=[4, 2, 1], num_heads=2, use_spatial_transformer=True,
                  transformer_depth=1, context_dim=CONTEXT_DIM, use_linear_in_transformer=False, legacy=False)

# SDXL's layout at small widths, for methods that act at SDXL's levels: no attention at full resolution, two
# blocks a transformer at downsampling 2 and a deep stack (ten, as SDXL's) at 4, linear projections, a fixed head
# width; one residual block per level. At 128×128 px its attention levels hold 4,096 and 1,024 tokens, as
# SDXL's do at 1024 px. Built at depth 10 and trimmed (``SDXL_PROXY_DEPTHS``), as the benchmark builds SDXL.
SDXL_EVAL_SIZE = 128
SDXL_PROXY_ARCH = dict(image_size=SDXL_EVAL_SIZE, in_channels=3, out_channels=3, model_channels=32,
                       channel_mult=[1, 1, 2], num_res_blocks=1, attention_resolutions=[4, 2], num_head_channels=16,
                       use_spatial_transformer=True, transformer_depth=10, context_dim=[CONTEXT_DIM] * 10,
                       use_linear_in_transformer=True, legacy=False)
SDXL_PROXY_DEPTHS = {1: 2, 2: 10}


@dataclass(frozen=True)
class ProxyLayout:
    """One proxy architecture: ldm ``UNetModel`` arguments, per-level transformer depths (None: as built), the
    evaluation size in px and the default training stages ((crop side px, steps, batch), run in order)."""

    name: str
    arch: dict
    depths: dict | None
    eval_size: int
    stages: tuple[tuple[int, int, int], ...]


LAYOUTS = {
    # Most steps at 16 px (attention cost grows with the square of the tokens), then 32 px, then the evaluation
    # size, so the top level's attention has seen 4,096 tokens: about an hour on one CPU thread. Half these
    # steps (a quarter at 64 px) trained proxies that ordered the methods alike but whose figures lay nearly
    # twice as far apart between seeds.
    "sd15": ProxyLayout("sd15", PROXY_ARCH, None, EVAL_SIZE, ((16, 1600, 32), (32, 400, 16), (64, 160, 4))),
    # SD 1.5's recipe one size up at every stage would take four hours; most steps stay small here and the
    # last stage, at the evaluation size where the attention levels see 4,096 and 1,024 tokens, is short:
    # about 26 minutes on one CPU thread.
    "sdxl": ProxyLayout("sdxl", SDXL_PROXY_ARCH, SDXL_PROXY_DEPTHS, SDXL_EVAL_SIZE,
                        ((32, 1200, 16), (64, 400, 4), (128, 80, 2))),
}


def layout_of(metadata: dict[str, str]) -> ProxyLayout:
    """The layout a weight file's metadata names ("layout"; files from before SDXL's layout: SD 1.5's)."""
    name = metadata.get("layout", "sd15")
    if name not in LAYOUTS:
        raise ValueError(f"unknown proxy layout {name!r}; known: {', '.join(LAYOUTS)}")
    return LAYOUTS[name]


# Photographs (scikit-image's ``skimage.data`` names; "china" and "flower" are scikit-learn's sample images).
# Grayscale ones are used as three equal channels.
TRAIN_IMAGES = ("astronaut", "coffee", "rocket", "motorcycle_left", "hubble_deep_field", "retina",
                "immunohistochemistry", "china", "grass", "gravel", "brick", "coins", "moon", "clock", "cell",
                "page", "text")
# Never seen in training: where tests measure what merging does to the model's prediction on unseen pictures.
HELD_OUT = ("chelsea", "flower", "camera")


# -- architecture -------------------------------------------------------------------------------------------------

def build_proxy_unet(seed: int = 0, layout: str = "sd15") -> nn.Module:
    """A freshly initialised proxy U-Net of ``layout`` (float32, CPU), its weights drawn from ``seed``.

    Takes x (B, 3, h, w) with h, w multiples of 8 (SDXL's layout: 4), timesteps (B,) and context (B, T, 32);
    returns (B, 3, h, w).
    """
    from .archs import context_as_list, require_ldm, trim_depths

    require_ldm()
    from ldm.modules.diffusionmodules.openaimodel import UNetModel

    spec = LAYOUTS[layout]
    # ldm's layers draw their initial weights from the global generator: seed it, leaving the caller's state
    # as it was.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        unet = UNetModel(**spec.arch)
    if spec.depths is not None:
        trim_depths(unet, spec.depths)
        # ldm's SpatialTransformer takes one context per block: a deep stack needs them as a list.
        unet.register_forward_pre_hook(context_as_list(max(spec.depths.values())), with_kwargs=True)
    return unet


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


# -- photographs ------------------------------------------------------------------------------------------------

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
    chosen in proportion to the square root of its area, a side between ``min_side`` (default ``size``) and the image's shorter side
    on a log scale (so fine texture and whole-object views are both common), a random place, resized to ``size``
    with antialiasing, and a horizontal flip half the time."""
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


# -- training ---------------------------------------------------------------------------------------------------

def noised(x0: torch.Tensor, t: torch.Tensor, noise: torch.Tensor, alphas_cumprod: torch.Tensor) -> torch.Tensor:
    """x0 (B, C, h, w) noised to timesteps t (B,) with ``noise`` (B, C, h, w), as the U-Net sees it (SD's
    variance-preserving input: sqrt(ᾱ)·x0 + sqrt(1 − ᾱ)·ε)."""
    a = alphas_cumprod.to(x0.device)[t].to(x0.dtype)[:, None, None, None]
    return a.sqrt() * x0 + (1 - a).sqrt() * noise


def train(config: TrainConfig, images: list[torch.Tensor] | None = None, log=print) -> dict[str, torch.Tensor]:
    """Train a proxy from ``config.seed``; returns its EMA weights (float32) with the learned context under
    ``"context"``.

    ``images`` defaults to the ``TRAIN_IMAGES`` photographs. One generator drives crops, timesteps and noise;
    the initial weights come from the same seed. The learning rate warms up linearly, then follows a cosine to 0
    over all stages, so the last (largest) stage ends on small steps.
    """
    from .archs import use_webui_unet

    torch.set_num_threads(config.threads)
    use_webui_unet()  # SDP attention: what the model runs with when loaded, and much cheaper to train
    if images is None:
        images = load_photographs(TRAIN_IMAGES)
    pyramids = [pyramid(image) for image in images]
    unet = build_proxy_unet(config.seed, config.layout).train()
    gen = torch.Generator().manual_seed(config.seed)
    context = nn.Parameter(torch.randn(1, CONTEXT_TOKENS, CONTEXT_DIM, generator=gen))
    params = list(unet.parameters()) + [context]
    opt = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0)
    ema = [p.detach().clone() for p in params]
    alphas = sd_alphas_cumprod().float()
    total = sum(steps for _, steps, _ in config.stages)
    step, start, recent = 0, time.time(), []
    for size, steps, batch in config.stages:
        for _ in range(steps):
            lr = config.lr * min(1.0, (step + 1) / config.warmup) * 0.5 * (1 + math.cos(math.pi * step / total))
            for group in opt.param_groups:
                group["lr"] = lr
            x0 = random_crops(pyramids, batch, size, gen)
            t = torch.randint(0, len(alphas), (batch,), generator=gen)
            noise = torch.randn(x0.shape, generator=gen)
            pred = unet(noised(x0, t, noise, alphas), t, context=context.expand(batch, -1, -1))
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
    names = [n for n, _ in unet.named_parameters()] + ["context"]
    return {name: e.clone() for name, e in zip(names, ema)}


def save_weights(state: dict[str, torch.Tensor], path: str, metadata: dict[str, str] | None = None,
                 layout: str = "sd15") -> None:
    """Write ``state`` as float16 safetensors (the shipped file must stay small; float16 loses nothing that
    ranking methods needs), with its architecture (and, for SDXL's layout, the layout's name) in the metadata."""
    from safetensors.torch import save_file

    spec = LAYOUTS[layout]
    named = {} if layout == "sd15" else {"layout": layout, "depths": json.dumps(spec.depths)}
    save_file({k: v.detach().to(torch.float16).contiguous() for k, v in state.items()}, path,
              metadata={"arch": json.dumps(spec.arch), **named, **(metadata or {})})


# -- loading ----------------------------------------------------------------------------------------------------

def load_proxy(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
               path: str | None = None) -> Pipeline:
    """The shipped proxy as a ``Pipeline``: pixel space (channels 3, downscale 1), epsilon prediction, SD's
    schedule, its learned empty-prompt context (1, 4, 32), and ``decode`` mapping (B, 3, h, w) in [-1, 1] to
    [0, 1]. The U-Net runs as the webui runs ldm (SDP attention), in eval mode and without gradients, on
    ``device`` in ``dtype``.

    Reads ``path`` (default: ``proxy_weights.safetensors`` beside this module); raises FileNotFoundError with
    the command that makes it when the file is missing.
    """
    path = path or WEIGHTS_FILE
    if not os.path.isfile(path):
        raise FileNotFoundError(f"the proxy model's weights are missing: {path}. They ship with this extension; "
                                f"restore the file (git checkout -- {os.path.basename(path)}) or train it again: "
                                f"{train_command(path)}")
    from safetensors.torch import load_file

    from .archs import in_run_dtype, use_webui_unet

    metadata = read_metadata(path)
    check_arch(path, metadata)
    spec = layout_of(metadata)
    use_webui_unet()
    state = {k: v.float() for k, v in load_file(path).items()}
    context = state.pop("context")
    unet = build_proxy_unet(0, spec.name)
    unet.load_state_dict(state)
    unet = in_run_dtype(unet, torch.device(device), dtype).requires_grad_(False)
    # The SD 1.5-layout proxy is "proxy" in the tables, as it was before the SDXL layout existed.
    name = ("proxy (pixel-space SD 1.x-layout U-Net trained on photographs)" if spec.name == "sd15" else
            "SDXL-layout proxy (pixel-space U-Net with SDXL's levels, trained on photographs)")
    return Pipeline(name=name, unet=unet,
                    context=context.to(device, dtype), prediction="eps", channels=3, downscale=1,
                    decode=lambda x: ((x.float() + 1) / 2).clamp(0, 1),
                    notes=["shipped proxy model: ranks methods, not an FID"], size=spec.eval_size)


MAKE_ONE = "make one with: python -m tome_core.bench.proxy train --seed N --out proxy-seedN.safetensors"


def read_metadata(path: str) -> dict[str, str]:
    """The safetensors header's metadata of ``path``; ValueError (one line) when the file is not a safetensors
    file at all."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as f:
            return dict(f.metadata() or {})
    except Exception as error:  # safetensors' own SafetensorError (HeaderTooLarge, ...), or an OSError
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(f"{path}: not a safetensors file ({reason}); a proxy's weights are a .safetensors file "
                         f"that {MAKE_ONE}") from None


def check_arch(path: str, metadata: dict[str, str]) -> None:
    """ValueError (one line) unless ``metadata`` names this code's proxy architecture: which settings differ,
    not the whole architecture."""
    try:
        arch = json.loads(metadata.get("arch", "null"))
    except ValueError:
        arch = None
    expected = layout_of(metadata).arch
    if arch == expected:
        return
    if not isinstance(arch, dict):
        raise ValueError(f"{path}: a safetensors file, but not a proxy model's weights (no proxy architecture "
                         f"in its metadata); {MAKE_ONE}")
    differ = [f"{k} {arch.get(k, '(none)')} where this code builds {expected[k]}" for k in expected
              if arch.get(k) != expected[k]] + [f"{k} (unknown here)" for k in arch if k not in expected]
    shown = "; ".join(differ[:2]) + (f"; and {len(differ) - 2} more" if len(differ) > 2 else "")
    raise ValueError(f"{path}: a proxy of another architecture ({shown}); {MAKE_ONE}")


def describe(path: str | None) -> str:
    """What the tables call a proxy: "seed N" from its metadata (made by ``train``), else its file name."""
    path = path or WEIGHTS_FILE
    try:
        seed = read_metadata(path).get("seed")
    except ValueError:
        seed = None
    name = f"seed {seed}" if seed is not None else os.path.basename(path)
    shipped = os.path.abspath(path) in {os.path.abspath(p) for p in SHIPPED_WEIGHTS + SHIPPED_SDXL_WEIGHTS}
    return name if shipped or seed is None else f"{name} ({os.path.basename(path)})"


# -- samples grid -----------------------------------------------------------------------------------------------

def sample_grid(pipe: Pipeline, rows: int = 4, cols: int = 4, size: int = EVAL_SIZE, steps: int = 25,
                seed: int = 0, zoom: int = 3) -> torch.Tensor:
    """rows×cols samples of ``pipe`` from seeded noise, tiled with a 2 px white border and enlarged ``zoom``
    times by nearest neighbour: (3, H, W) in [0, 1]."""
    from .sampling import euler_sample

    noise = torch.randn(rows * cols, pipe.channels, size, size, generator=torch.Generator().manual_seed(seed))
    images = pipe.decode(euler_sample(pipe, noise.to(pipe.context.device), steps)).cpu()
    pad = 2
    grid = torch.ones(3, rows * (size + pad) + pad, cols * (size + pad) + pad)
    for i, image in enumerate(images):
        r, c = divmod(i, cols)
        grid[:, pad + r * (size + pad):pad + r * (size + pad) + size,
             pad + c * (size + pad):pad + c * (size + pad) + size] = image
    return grid.repeat_interleave(zoom, 1).repeat_interleave(zoom, 2)


def save_png(image: torch.Tensor, path: str) -> None:
    """image (3, H, W) in [0, 1] -> an 8-bit PNG."""
    from PIL import Image

    array = (image.clamp(0, 1) * 255).round().byte().permute(1, 2, 0).contiguous().numpy()
    Image.fromarray(array).save(path)


# -- command line -----------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tome_core.bench.proxy", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_train = sub.add_parser("train", help="train the proxy from a seed and write its weights")
    p_train.add_argument("--seed", type=int, default=0)
    p_train.add_argument("--layout", default="sd15", choices=sorted(LAYOUTS),
                         help="sd15 (the default) or sdxl: SDXL's levels at small widths, evaluated at 128 px")
    p_train.add_argument("--out", default=WEIGHTS_FILE)
    p_train.add_argument("--threads", type=int, default=TrainConfig.threads)
    p_train.add_argument("--stages", default=None,
                         help="comma-separated SIZE:STEPS:BATCH stages (default: "
                              + ",".join(":".join(map(str, s)) for s in TrainConfig.stages) + ")")
    p_samples = sub.add_parser("samples", help="write a grid of samples of the shipped (or a given) model")
    p_samples.add_argument("--weights", default=None)
    p_samples.add_argument("--out", required=True)
    p_samples.add_argument("--steps", type=int, default=25)
    p_samples.add_argument("--seed", type=int, default=0)
    p_samples.add_argument("--threads", type=int, default=TrainConfig.threads)
    args = parser.parse_args(argv)

    if args.command == "train":
        config = TrainConfig(seed=args.seed, threads=args.threads, layout=args.layout,
                             stages=LAYOUTS[args.layout].stages)
        if args.stages:
            config.stages = tuple(tuple(int(v) for v in s.split(":")) for s in args.stages.split(","))
        start = time.time()
        losses = []

        def log(line: str) -> None:
            losses.append(line)
            print(line, flush=True)

        state = train(config, log=log)
        seconds = time.time() - start
        save_weights(state, args.out, {"seed": str(args.seed), "stages": json.dumps(config.stages),
                                       "train_seconds": f"{seconds:.0f}", "last_log": losses[-1] if losses else ""},
                     args.layout)
        print(f"wrote {args.out} ({os.path.getsize(args.out) / 1e6:.1f} MB) in {seconds:.0f}s")
    else:
        torch.set_num_threads(args.threads)
        pipe = load_proxy(path=args.weights)
        save_png(sample_grid(pipe, steps=args.steps, seed=args.seed), args.out)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
