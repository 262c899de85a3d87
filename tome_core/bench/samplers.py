"""Final-picture fidelity with each sampler users run, on every shipped proxy of a layout: the median PSNR (and
range over the images) against the unmerged pictures, one line per proxy and sampler.

    python -m tome_core.bench.samplers --layout sdxl --samplers euler euler_a dpmpp_2m

The same noise for every contender, the same fresh noise for Euler a (its own seed), progress told to the patch
at every step as the webui tells it. ``--step-figures`` adds, per proxy, three one-step figures along the
unmerged Euler run (``stepwise``), to set beside the final pictures: every step alike (the benchmark's until
2026-12-05), weighted by how far each step moves the sample (the benchmark's step dB since), and the moves'
errors summed before squaring; and how many pairs of contenders each puts in the final pictures' order.
"""

from __future__ import annotations

import argparse
import sys

import torch

import tome_core
from tome_core.methods import cache as cache_method

from .contenders import Wrapped
from .fidelity import noise_for
from .loading import load_proxies
from .metrics import psnr_each
from .levels import level_name, skipped
from .sampling import DEFAULT_CFG, SAMPLER_LABELS, SAMPLERS, Guidance, guidance_for, sample
from .stepwise import (Trajectory, predictions_along, reference_trajectory, relative_error, summed_relative_error,
                       to_db, weighted_relative_error)

CONTENDERS = {
    "todo": ("ToDo f=2 levels 4", dict(method="todo", max_downsample=4)),
    "stack": ("Stack 0.50 levels 4", dict(method="stack", ratio=0.5, max_downsample=4)),
    "cache": ("Cache (defaults)", dict(method="cache")),
    "cache-levels4": ("Cache levels 4", dict(method="cache", max_downsample=4)),
    **{f"cache{n}": (f"Cache longest gap {n}", dict(method="cache", cache_interval=n)) for n in range(2, 11)},
    # The main benchmark's settings at their "auto" levels, to rank them as each figure does.
    **{f"tome{int(r * 100)}": (f"ToMe {r}", dict(method="tome", ratio=r)) for r in (0.25, 0.5, 0.75)},
    # The extension's ToMe: its "Size-weighted keys: Auto" turns them on for ToMe; the engine's default is the paper's.
    **{f"tome{int(r * 100)}-sw": (f"ToMe {r} size-weighted", dict(method="tome", ratio=r, size_weighted_keys=True))
       for r in (0.25, 0.5, 0.75)},
    **{f"local{int(r * 100)}": (f"Local {r}", dict(method="local", ratio=r)) for r in (0.25, 0.5, 0.75)},
    **{f"todo-f{f}": (f"ToDo f={f}", dict(method="todo", todo_factor=f)) for f in (2, 3, 4)},
}


def pairs_in_order(final: list[float], figure: list[float]) -> tuple[int, int]:
    """Of the pairs of contenders whose final pictures differ (by their medians), how many a figure puts in
    the same order, and how many there are."""
    same = total = 0
    for i in range(len(final)):
        for j in range(i + 1, len(final)):
            if final[i] == final[j]:
                continue
            total += 1
            same += (figure[i] - figure[j]) * (final[i] - final[j]) > 0
    return same, total


def final_pictures(pipe, noise: torch.Tensor, steps: int, sampler: str, noise_seed: int,
                   options: dict | None, guidance: Guidance | None = None) -> torch.Tensor:
    """The decoded pictures of one run, patched with ``options`` (None: unmerged), guided by ``guidance``."""
    wrapped = Wrapped(pipe.unet)
    if options is not None:
        tome_core.apply_patch(wrapped, **options)
    try:
        x = sample(pipe, noise, steps, sampler, noise_seed,
                   before_step=lambda i, n: tome_core.set_progress(wrapped, (i + 0.5) / n), guidance=guidance)
    finally:
        tome_core.remove_patch(wrapped)
    return pipe.decode(x).float().cpu()


def acted_levels(pipe, options: dict) -> frozenset[int]:
    """The levels whose blocks ``options`` act on in ``pipe``'s U-Net (``tome_core.check_patch``)."""
    return frozenset(block.level for block in tome_core.check_patch(Wrapped(pipe.unet), **options))


def levels_named(pipe, found: frozenset[int]) -> str:
    """The levels ``found`` by their token counts at the proxy's size ("4,096 tokens, 1,024 tokens"), or "none"."""
    return ", ".join(level_name(pipe, level, pipe.size) for level in sorted(found)) or "none"


def one_step_figures(pipe, trajectory: Trajectory, options: dict) -> tuple[list[float], ...]:
    """Per image, dB: the one-step figure along the unmerged run ``trajectory`` (``reference_trajectory``)
    patched with ``options``, every step alike (``relative_error``), weighted by each step's move of the sample
    (``weighted_relative_error``, the benchmark's step dB) and the moves' errors summed before squaring
    (``summed_relative_error``)."""
    wrapped = Wrapped(pipe.unet)
    tome_core.apply_patch(wrapped, **options)
    try:
        estimates = predictions_along(pipe, wrapped, trajectory)
    finally:
        tome_core.remove_patch(wrapped)
    args = (trajectory.denoised, estimates, trajectory.inputs, trajectory.sigmas)
    return tuple([to_db(float(v)) for v in figure(*args)]
                 for figure in (relative_error, weighted_relative_error, summed_relative_error))


STEP_FIGURES = ("one step, every step alike", "one step, weighted by the sample's move",
                "one step, summed as the sample's moves")


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def median_cell(values: list[float]) -> str:
    """Per-image figures as a table cell: "median [lowest–highest]"."""
    return f"{_median(values):.1f} [{min(values):.1f}–{max(values):.1f}]"


def add_run_arguments(ap: argparse.ArgumentParser) -> None:
    """The options of a run over the proxies and samplers, shared by this room and ``levels``: which proxies,
    samplers, steps, images, seeds, guidance and threads."""
    ap.add_argument("--layout", "--layouts", dest="layout", choices=["sd15", "sdxl"], default="sdxl",
                    help="whose shipped prompted proxies to measure, one layout a run (default sdxl); --layouts is "
                         "the same option, as the main race spells it")
    ap.add_argument("--samplers", nargs="+", choices=list(SAMPLERS), default=list(SAMPLERS))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--images", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0, help="the starting noise's seed (default 0)")
    ap.add_argument("--noise-seed", type=int, default=7, help="Euler a's fresh noise's seed (default 7)")
    ap.add_argument("--cfg", type=float, default=DEFAULT_CFG,
                    help=f"classifier-free guidance scale for a prompted proxy (default {DEFAULT_CFG:g}); a proxy "
                         f"without prompts samples without guidance")
    ap.add_argument("--apart", action="store_true",
                    help="cond and uncond in two U-Net calls a step, as a low-memory host runs them (default: "
                         "one batch, as the webui runs them)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--proxy", nargs="+", metavar="WEIGHTS", default=None,
                    help="proxy weights files (default: every shipped prompted proxy of the layout), e.g. one "
                         "trained from another seed with python -m tome_core.bench.proxy train")
    ap.add_argument("--unprompted", action="store_true",
                    help="the shipped photograph-trained proxies instead: no prompt, no guidance, and deeper "
                         "levels they barely use (docs/proxy.md)")


def with_threads(threads: int, run) -> int:
    """``run()`` on ``threads`` threads; a caller's own setting (a test run) is left as it was."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return run()
    finally:
        torch.set_num_threads(before)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tome_core.bench.samplers", description=__doc__.split("\n\n")[0])
    add_run_arguments(ap)
    ap.add_argument("--contenders", nargs="+", choices=sorted(CONTENDERS), default=["todo", "cache"])
    ap.add_argument("--step-figures", action="store_true",
                    help="also the one-step figures along the unmerged Euler run (every step alike, weighted by "
                         "each step's move of the sample, and the moves' errors summed), without guidance")
    ap.add_argument("--drift-share", type=float, default=None, metavar="S",
                    help=f"the share of a stack's drift Cache's reused calls carry on, for this run only (default: "
                         f"the engine's, {cache_method.DRIFT_SHARE:g}; 0: none, as Cache before 2026-12-06)")
    args = ap.parse_args(argv)
    if args.drift_share is not None and not (0 <= args.drift_share <= 2):
        ap.error(f"--drift-share {args.drift_share:g}: expected 0 to 2")
    share = cache_method.DRIFT_SHARE
    if args.drift_share is not None:
        cache_method.DRIFT_SHARE = args.drift_share
    try:
        return with_threads(args.threads, lambda: _run(args, argv))
    finally:
        cache_method.DRIFT_SHARE = share


def proxies_of_the_run(args: argparse.Namespace, argv: list[str] | None, room: str) -> list:
    """The (label, pipeline) of every proxy the run measures (``add_run_arguments``' --proxy and --layout), after
    printing the command line that made the run (``room``: its module)."""
    pipes = load_proxies(torch.device("cpu"), torch.float32, args.proxy, layouts=(args.layout,),
                         prompted=not args.unprompted) or []
    print(f"# {' '.join([f'python -m {room}'] + (argv if argv is not None else sys.argv[1:]))}")
    return pipes


def _run(args: argparse.Namespace, argv: list[str] | None) -> int:
    pipes = proxies_of_the_run(args, argv, "tome_core.bench.samplers")
    print(f"# final PSNR dB against the unmerged pictures, median [range] over {args.images} images, "
          f"{args.steps} steps; each proxy at its evaluation size; beside each method, its levels skipped "
          f"(their transformers return their input): how far the pictures go without those levels' work")
    names = [CONTENDERS[c][0] for c in args.contenders]
    header = [cell for name in names for cell in (name, "its levels skipped")]
    print("\n| proxy | sampler | guidance | " + " | ".join(header) + " |\n|---|---|---|" + "--:|" * len(header))
    agreement = []  # per proxy: how each one-step figure orders the contenders against the Euler pictures
    for label, pipe in pipes:
        noise = noise_for(pipe, pipe.size, args.images, args.seed)
        guidance = guidance_for(pipe, args.images, args.cfg, not args.apart)
        acts_on = [acted_levels(pipe, CONTENDERS[key][1]) for key in args.contenders]
        euler_final = None
        for sampler in args.samplers:
            run = dict(steps=args.steps, sampler=sampler, noise_seed=args.noise_seed, guidance=guidance)
            reference = final_pictures(pipe, noise, options=None, **run)
            each = [psnr_each(final_pictures(pipe, noise, options=CONTENDERS[key][1], **run), reference)
                    for key in args.contenders]
            deleted: dict[frozenset[int], list[float]] = {}
            for found in acts_on:
                if found not in deleted:
                    with skipped(pipe.unet, found):
                        deleted[found] = psnr_each(final_pictures(pipe, noise, options=None, **run), reference)
            if sampler == "euler":
                euler_final = [_median(values) for values in each]
            cells = [cell for values, found in zip(each, acts_on)
                     for cell in (median_cell(values), f"{median_cell(deleted[found])} ({levels_named(pipe, found)})")]
            print(f"| {label} | {SAMPLER_LABELS[sampler]} | {guidance.label if guidance else 'none (no prompt)'} | "
                  + " | ".join(cells) + " |", flush=True)
        if args.step_figures:
            trajectory, _ = reference_trajectory(pipe, noise, args.steps)
            figures = [one_step_figures(pipe, trajectory, CONTENDERS[key][1]) for key in args.contenders]
            counts = []
            for name, figure in zip(STEP_FIGURES, zip(*figures)):
                cells = " | ".join(f"{median_cell(v)} | –" for v in figure)
                print(f"| {label} | {name} (Euler) | none | {cells} |", flush=True)
                if euler_final is not None:
                    counts.append(pairs_in_order(euler_final, [_median(v) for v in figure]))
            if counts:
                agreement.append(f"{label}: " + ", ".join(f"{name} {same} of {total}" for name, (same, total)
                                                          in zip(STEP_FIGURES, counts)))
    if agreement:
        print("\nPairs of contenders each one-step figure puts in the order of their final Euler pictures:")
        for line in agreement:
            print(f"- {line}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
