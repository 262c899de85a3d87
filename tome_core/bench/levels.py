"""What each attention level contributes to the final pictures, and how much a prompt decides them.

A method that acts on a level the model barely uses cannot be told apart from one that does nothing there, so
every fidelity figure is worth as much as the levels it touches matter. The measure: the same sampling run with
one level's transformers skipped (each returns its input, so that level's attention never runs), its final
pictures' PSNR against the whole model's. A level that matters moves the pictures far: 20 dB or less is the
bar the proxies are held to (docs/proxy.md). Beside it, from the same noise, how far another prompt moves the
pictures (prompted models only): what the guidance carries.

    python -m tome_core.bench.levels --layout sdxl --proxy FILE --samplers euler euler_a dpmpp_2m
"""

from __future__ import annotations

import argparse
from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from tome_core.patch import transformer_levels

from .pipeline import Pipeline

MATTERS_DB = 20.0  # a level whose skipping leaves the pictures closer than this is one the model barely uses


def attention_levels(unet: nn.Module) -> list[int]:
    """The levels (0 = the sampled tensor's resolution, +1 per downsampling) that hold transformers, in order."""
    return sorted({level for _, _, level in transformer_levels(unet)})


def tokens_at(pipe: Pipeline, level: int, size: int) -> int:
    """How many tokens a transformer at ``level`` sees in a square ``size`` px picture."""
    side = size // pipe.downscale
    for _ in range(level):
        side = -(-side // 2)
    return side * side


def level_name(pipe: Pipeline, level: int, size: int) -> str:
    """A level as a reader knows it: its token count at ``size`` ("1,024 tokens"; the middle block's too)."""
    return f"{tokens_at(pipe, level, size):,} tokens"


def _as_skipped(module: nn.Module, args: tuple, kwargs: dict, output):
    x = args[0] if args else kwargs.get("x", kwargs.get("hidden_states"))
    if hasattr(output, "sample"):  # diffusers' Transformer2DModelOutput
        return type(output)(sample=x)
    return (x,) if isinstance(output, tuple) else x


@contextmanager
def skipped(unet: nn.Module, levels: set[int] | frozenset[int]) -> Iterator[int]:
    """Within the block, every transformer of ``unet`` at ``levels`` returns its input: its levels' attention
    (self and cross) never runs. Yields how many transformers were skipped."""
    hooks = [module.register_forward_hook(_as_skipped, with_kwargs=True)
             for _, module, level in transformer_levels(unet) if level in levels]
    try:
        yield len(hooks)
    finally:
        for hook in hooks:
            hook.remove()


def main(argv: list[str] | None = None) -> int:
    from .samplers import add_run_arguments, with_threads

    ap = argparse.ArgumentParser(prog="python -m tome_core.bench.levels", description=__doc__.split("\n\n")[0])
    add_run_arguments(ap)
    ap.add_argument("--size", type=int, default=None,
                    help="picture side in px (default: each proxy's evaluation size, where the bar applies)")
    args = ap.parse_args(argv)
    return with_threads(args.threads, lambda: _run(args, argv))


def _run(args: argparse.Namespace, argv: list[str] | None) -> int:
    from .fidelity import noise_for
    from .metrics import psnr_each
    from .samplers import final_pictures, median_cell, proxies_of_the_run
    from .sampling import SAMPLER_LABELS, guidance_for

    pipes = proxies_of_the_run(args, argv, "tome_core.bench.levels")
    print(f"# final PSNR dB against the whole model's pictures, median [range] over {args.images} images, "
          f"{args.steps} steps; {f'{args.size} px' if args.size else 'each proxy at its evaluation size'}; a level "
          f"matters at {MATTERS_DB:g} dB or less")
    for label, pipe in pipes:
        size = args.size or pipe.size
        levels = attention_levels(pipe.unet)
        guidance = guidance_for(pipe, args.images, args.cfg, not args.apart)
        names = [f"{level_name(pipe, lv, size)} skipped" for lv in levels]
        extra = ["another prompt"] if guidance is not None else []
        print(f"\n{label}: {guidance.label if guidance else 'no prompt, no guidance'}\n")
        print("| sampler | " + " | ".join(names + extra) + " |\n|---|" + "--:|" * (len(names) + len(extra)))
        noise = noise_for(pipe, size, args.images, args.seed)
        for sampler in args.samplers:
            run = dict(steps=args.steps, sampler=sampler, noise_seed=args.noise_seed, guidance=guidance)
            whole = final_pictures(pipe, noise, options=None, **run)
            cells = []
            for level in levels:
                with skipped(pipe.unet, {level}):
                    cells.append(median_cell(psnr_each(final_pictures(pipe, noise, options=None, **run), whole)))
            if guidance is not None:
                other = guidance_for(pipe, args.images, args.cfg, not args.apart, shift=1)
                asked_otherwise = final_pictures(pipe, noise, options=None, **dict(run, guidance=other))
                cells.append(median_cell(psnr_each(asked_otherwise, whole)))
            print(f"| {SAMPLER_LABELS[sampler]} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
