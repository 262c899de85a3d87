"""``python -m tome_core.bench.proxy train|samples``: train a proxy from a seed and write its weights, or write
a grid of a proxy's samples (docs/proxy.md)."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

from ..pipeline import Pipeline
from ..sampling import DEFAULT_CFG, Guidance, euler_sample
from . import EVAL_SIZE, LAYOUTS, PROMPTED_CURRICULUM, PROMPTED_STAGES, PROMPTED_WIDTHS, WEIGHTS_FILE, load_proxy
from . import __doc__ as MODEL_DOC
from .training import FIRST_LEVELS, TrainConfig, save_weights, train, training_metadata


def sample_grid(pipe: Pipeline, rows: int = 4, cols: int = 4, size: int = EVAL_SIZE, steps: int = 25,
                seed: int = 0, zoom: int = 3) -> torch.Tensor:
    """rows×cols samples of ``pipe`` from seeded noise, tiled with a 2 px white border and enlarged ``zoom``
    times by nearest neighbour: (3, H, W) in [0, 1]."""
    noise = torch.randn(rows * cols, pipe.channels, size, size, generator=torch.Generator().manual_seed(seed))
    images = pipe.decode(euler_sample(pipe, noise.to(pipe.context.device), steps)).cpu()
    pad = 2
    grid = torch.ones(3, rows * (size + pad) + pad, cols * (size + pad) + pad)
    for i, image in enumerate(images):
        r, c = divmod(i, cols)
        grid[:, pad + r * (size + pad):pad + r * (size + pad) + size,
             pad + c * (size + pad):pad + c * (size + pad) + size] = image
    return grid.repeat_interleave(zoom, 1).repeat_interleave(zoom, 2)


def prompted_grid(pipe: Pipeline, cols: int = 4, steps: int = 25, seed: int = 0, zoom: int = 2,
                  cfg: float = DEFAULT_CFG) -> "Image.Image":
    """A prompted proxy's samples: a row per prompt of ``pipe.prompts`` (the benchmark's), ``cols`` noises from
    ``seed`` (the same noise in every row, so a column shows what the prompt alone changes), Euler with guidance
    ``cfg``; each row's prompt written on its left. An RGB PIL image."""
    from PIL import Image, ImageDraw

    size, pad, caption = pipe.size, 2, 170
    noise = torch.randn(cols, pipe.channels, size, size, generator=torch.Generator().manual_seed(seed))
    rows = []
    for prompt in pipe.prompts:
        cond = pipe.encode_prompt(prompt).expand(cols, -1, -1)
        rows.append(pipe.decode(euler_sample(pipe, noise, steps, guidance=Guidance(cond, cfg))).cpu())
    side = size * zoom
    sheet = Image.new("RGB", (caption + cols * (side + pad) + pad, len(rows) * (side + pad) + pad), "white")
    draw = ImageDraw.Draw(sheet)
    for r, (prompt, images) in enumerate(zip(pipe.prompts, rows)):
        top = pad + r * (side + pad)
        words = prompt.replace(", on", ",\non").replace(" and ", " and\n")
        draw.multiline_text((8, top + side // 2 - 24), words, fill="black", spacing=4)
        for c, image in enumerate(images):
            tile = to_pil(image.repeat_interleave(zoom, 1).repeat_interleave(zoom, 2))
            sheet.paste(tile, (caption + pad + c * (side + pad), top))
    return sheet


def to_pil(image: torch.Tensor) -> "Image.Image":
    """image (3, H, W) in [0, 1] -> an 8-bit RGB PIL image."""
    from PIL import Image

    array = (image.clamp(0, 1) * 255).round().byte().permute(1, 2, 0).contiguous().numpy()
    return Image.fromarray(array)


def save_png(image: torch.Tensor, path: str) -> None:
    """image (3, H, W) in [0, 1] -> an 8-bit PNG."""
    to_pil(image).save(path)


def _integers(text: str, separator: str, count: int) -> tuple[int, ...]:
    """``count`` positive integers written with ``separator`` between them ("32:600:16", "1,1,3"); ValueError
    (one line) for anything else."""
    try:
        values = tuple(int(v) for v in text.split(separator))
    except ValueError:
        values = ()
    if len(values) != count or min(values) < 1:
        raise ValueError(f"{text!r}: expected {count} positive integers joined by {separator!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    """``train`` a proxy from a seed and write its weights, or write a grid of ``samples`` of one."""
    parser = argparse.ArgumentParser(prog="python -m tome_core.bench.proxy", description=MODEL_DOC.split("\n")[0])
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
    p_train.add_argument("--data", default="photographs", choices=["photographs", "scenes"],
                         help="photographs (the unprompted proxies) or scenes: prompted scenes of shapes on the "
                              "photographs' textures, with its own default stages")
    p_train.add_argument("--lr-floor", type=float, default=0.0,
                         help="where the learning rate's cosine ends, as a share of its peak (default 0)")
    p_train.add_argument("--channel-mult", default=None, metavar="M,M,...",
                         help="the levels' widths, a factor of the base width each (default: the layout's; a "
                              "prompted proxy's own with --data scenes)")
    p_train.add_argument("--eval-shift", type=float, default=1.0, metavar="S",
                         help="at the evaluation size, draw timesteps toward the noisy end by S (default 1: "
                              "uniform; 3 puts three in four above the middle)")
    p_train.add_argument("--deep-first", type=int, default=None, metavar="N",
                         help="train the first N stages with only the deepest attention level's transformers "
                              "(and the highest's, with --first-levels ends; the others return their input), so "
                              "that level learns the layout (default 0; a "
                              "prompted proxy's own with --data scenes: 1)")
    p_train.add_argument("--first-levels", default=None, choices=FIRST_LEVELS,
                         help="which attention levels the --deep-first stages train: deepest or ends, the deepest "
                              "and the highest-resolution one, the levels between joining after (default deepest; "
                              "a prompted SD 1.5 proxy's own with --data scenes: ends)")
    p_train.add_argument("--save-every-stage", default=None, metavar="PATTERN",
                         help="also write the weights after each stage, to PATTERN with {stage} in it")
    p_samples = sub.add_parser("samples", help="write a grid of samples of the shipped (or a given) model")
    p_samples.add_argument("--weights", default=None)
    p_samples.add_argument("--out", required=True)
    p_samples.add_argument("--steps", type=int, default=25)
    p_samples.add_argument("--seed", type=int, default=0)
    p_samples.add_argument("--threads", type=int, default=TrainConfig.threads)
    p_samples.add_argument("--cfg", type=float, default=DEFAULT_CFG,
                           help=f"a prompted proxy's guidance scale (default {DEFAULT_CFG:g}): a row per benchmark "
                                f"prompt, the same noises in every row")
    args = parser.parse_args(argv)

    if args.command == "train":
        stages = PROMPTED_STAGES[args.layout] if args.data == "scenes" else LAYOUTS[args.layout].stages
        widths = PROMPTED_WIDTHS[args.layout] if args.data == "scenes" else None
        try:
            if args.stages:
                stages = tuple(_integers(s, ":", 3) for s in args.stages.split(","))
            if args.channel_mult:
                widths = _integers(args.channel_mult, ",", len(LAYOUTS[args.layout].arch["channel_mult"]))
        except ValueError as error:
            parser.error(str(error))
        if not (args.eval_shift > 0 and math.isfinite(args.eval_shift)):
            parser.error(f"--eval-shift {args.eval_shift:g}: expected a positive number")
        deep_first, first_levels = PROMPTED_CURRICULUM[args.layout] if args.data == "scenes" else (0, "deepest")
        deep_first = min(deep_first, len(stages) - 1)  # a recipe of one stage has none to train the rest in
        if args.deep_first is not None:
            if not 0 <= args.deep_first < len(stages):
                parser.error(f"--deep-first {args.deep_first}: expected 0 to {len(stages) - 1}, fewer than the "
                             f"{len(stages)} stages, so the other levels train at all")
            deep_first = args.deep_first
        if args.first_levels is not None:
            if args.first_levels != "deepest" and not deep_first:
                parser.error(f"--first-levels {args.first_levels}: says which levels the --deep-first stages "
                             f"train; give --deep-first N too")
            first_levels = args.first_levels
        elif not deep_first:
            first_levels = "deepest"  # the layout's curriculum said which levels go first; none do now
        config = TrainConfig(seed=args.seed, threads=args.threads, layout=args.layout, stages=stages,
                             data=args.data, save_every_stage=args.save_every_stage, lr_floor=args.lr_floor,
                             channel_mult=widths, eval_shift=args.eval_shift, deep_first=deep_first,
                             first_levels=first_levels)
        start = time.time()
        losses = []

        def log(line: str) -> None:
            losses.append(line)
            print(line, flush=True)

        state = train(config, log=log)
        seconds = time.time() - start
        save_weights(state, args.out, {**training_metadata(config), "train_seconds": f"{seconds:.0f}",
                                       "last_log": losses[-1] if losses else ""}, args.layout)
        print(f"wrote {args.out} ({os.path.getsize(args.out) / 1e6:.1f} MB) in {seconds:.0f}s")
    else:
        torch.set_num_threads(args.threads)
        pipe = load_proxy(path=args.weights)
        if pipe.prompts:
            prompted_grid(pipe, steps=args.steps, seed=args.seed, cfg=args.cfg).save(args.out)
        else:
            save_png(sample_grid(pipe, steps=args.steps, seed=args.seed), args.out)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
