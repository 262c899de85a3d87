"""A whole sampling run's speed, for methods whose calls differ within a run (Cache: full and reused calls).

One U-Net call's time says what a method gains when every call is alike. Cache's calls are not: the first steps
and then steps ever further apart run the stacks whole, the others skip them. Here every call of a run of ``steps``
steps is counted by kind (the patch's own counters over a real run of a small U-Net with the same options: the
schedule does not depend on the model's size), each kind is timed on the webui's real architecture and width
(random weights: speed only), and the run's time is their sum; multiply-adds likewise. ToDo and Stack, whose
calls are all alike, are beside it at their own call's time times the steps.

    python -m tome_core.bench.runtime --models sdxl --sizes 1024 --steps 20 30
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

import tome_core

from . import archs
from .contenders import Wrapped
from .jobs import inputs
from .macs import MultiplyAddCounter
from .timing import time_call

OTHERS = {"ToDo f=2 levels 4": dict(method="todo", max_downsample=4),
          "Stack 0.50": dict(method="stack", ratio=0.5)}


def call_counts(steps: int, options: dict) -> tuple[int, int]:
    """(full, reused) U-Net calls of a ``steps``-step run with one call a step, progress told as the webui tells
    it, as the schedule of the patch of a small SD 1.x-layout U-Net patched with ``options`` counts them (one
    size all run long: every call the schedule reuses on finds its kept changes)."""
    from ldm.modules.diffusionmodules.openaimodel import UNetModel

    torch.manual_seed(0)
    unet = UNetModel(image_size=8, in_channels=4, out_channels=4, model_channels=32, num_res_blocks=1,
                     attention_resolutions=[1], channel_mult=[1], num_heads=1, use_spatial_transformer=True,
                     transformer_depth=1, context_dim=8, legacy=False).eval()
    tome_core.apply_patch(unet, **options)
    x, context = torch.randn(1, 4, 8, 8), torch.randn(1, 2, 8)
    with torch.no_grad():
        for i in range(steps):
            tome_core.set_progress(unet, (i + 0.5) / steps)
            unet(x, torch.full((1,), 999.0 - 999.0 * i / steps), context=context)
    kept = tome_core.get_patch(unet).method_patch
    tome_core.remove_patch(unet)
    return kept.scheduled_full, kept.scheduled_reuses


def _macs(call) -> int:
    counter = MultiplyAddCounter()
    with counter, torch.no_grad():
        call()
    return counter.total


def measure(arch: str, size: int, batch: int, rounds: int, width: float = 1.0, cache: dict | None = None,
            device: torch.device = torch.device("cpu"), dtype: torch.dtype = torch.float32, others: bool = True
            ) -> dict[str, tuple[list[float], int]]:
    """Seconds (one a round, in round order) and multiply-adds of one call of each kind: "none", Cache's "full" and
    "reused" calls (``cache``: its options beyond the method), and (with ``others``) each of ``OTHERS``. The
    kinds are timed in interleaved rounds (each round times every kind once, after a round that warms them
    up), so a machine that slows down or speeds up during the run moves every kind alike."""
    cache = {"method": "cache", **(cache or {})}
    unet, ctx_dim = archs.build_unet(arch, device, dtype, width)
    wrapped = Wrapped(unet)
    x, context = inputs(batch, 4, size // 8, ctx_dim, archs.unet_depth(unet), device, dtype)
    t = torch.full((batch,), 500.0, device=device)

    def call():
        return unet(x, t, context=context)

    # The kinds of call do not depend on the schedule: Cache is timed with every other step full (0, 2, 4 ...),
    # its reused step right after a full one, as in a run. Steps 0 (full) and 1 (reused) run untimed first, so
    # that the timed full call (step 2) fits the gain, as every full call after a run's first does, and the
    # timed reused call (step 3) applies a fitted one.
    every_other = {**cache, "cache_warmup": 0, "cache_interval": 2}
    patches = {"none": None, "Cache": every_other, **(OTHERS if others else {})}
    timed: dict[str, list[float]] = {}
    macs: dict[str, int] = {}

    def each_kind():
        """Yields each kind of call, the U-Net patched for it (and, for Cache, at the step of its kind)."""
        for name, options in patches.items():
            if options is not None:
                tome_core.apply_patch(wrapped, **options)
            kinds = ("Cache full", "Cache reused") if name == "Cache" else (name,)
            if name == "Cache":
                for step in (0, 1):
                    tome_core.set_progress(wrapped, (step + 0.5) / 100)
                    with torch.no_grad():
                        call()
            for i, kind in enumerate(kinds):
                if name == "Cache":
                    tome_core.set_progress(wrapped, (i + 2.5) / 100)  # step 2: full, fits the gain; 3: reused
                yield kind
            tome_core.remove_patch(wrapped)

    for round_ in range(rounds + 1):  # round 0 warms up: the first call of each kind pays for allocations
        for kind in each_kind():
            with torch.no_grad():
                seconds = time_call(call, device) / 1000
            if round_:
                timed.setdefault(kind, []).append(seconds)
    for kind in each_kind():  # multiply-adds: what each kind computes, not timed
        macs[kind] = _macs(call)
    return {kind: (samples, macs[kind]) for kind, samples in timed.items()}


def _speedups(none_runs: list[float], runs: list[float]) -> str:
    """"1.83x (1.80–1.86)": the median of the rounds' speed-ups and, over several rounds, their range. Each
    round times every kind once, so a round's run times are compared with each other."""
    ups = sorted(n / r for n, r in zip(none_runs, runs))
    median = statistics.median(ups)
    return f"{median:.2f}x" if len(ups) == 1 else f"{median:.2f}x ({ups[0]:.2f}–{ups[-1]:.2f})"


def table(arch: str, size: int, batch: int, per_call: dict[str, tuple[list[float], int]], steps: list[int],
          cache: dict | None = None) -> str:
    """Markdown: for each run length, each method's run time (median of the rounds), its speed-up over no
    merging (median and range of the rounds'), its multiply-adds against none's, and (Cache) its calls by kind."""
    cache = {"method": "cache", **(cache or {})}
    none_s, none_macs = per_call["none"]
    lines = [f"{arch}, {size} px, batch {batch}: a whole run, every U-Net call counted", "",
             "| steps | method | calls (full + reused) | run s | speed-up (range) | MACs vs none |",
             "|--:|---|---|--:|--:|--:|"]
    for n in steps:
        none_runs = [n * s for s in none_s]
        lines.append(f"| {n} | none | {n} | {statistics.median(none_runs):.1f} | 1.00x | 1.00 |")
        full, reused = call_counts(n, cache)
        runs = [full * f + reused * r for f, r in zip(per_call["Cache full"][0], per_call["Cache reused"][0])]
        run_macs = full * per_call["Cache full"][1] + reused * per_call["Cache reused"][1]
        lines.append(f"| {n} | Cache | {full} + {reused} | {statistics.median(runs):.1f} | "
                     f"{_speedups(none_runs, runs)} | {run_macs / (n * none_macs):.2f} |")
        for name in [n for n in OTHERS if n in per_call]:
            seconds, macs = per_call[name]
            runs = [n * s for s in seconds]
            lines.append(f"| {n} | {name} | {n} | {statistics.median(runs):.1f} | {_speedups(none_runs, runs)} | "
                         f"{macs / none_macs:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tome_core.bench.runtime", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["sdxl"], choices=sorted(archs.ARCHS))
    ap.add_argument("--sizes", nargs="+", type=int, default=[1024])
    ap.add_argument("--steps", nargs="+", type=int, default=[20, 30])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--width", type=float, default=1.0, help="channel width scale (1: the real model)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--others", action=argparse.BooleanOptionalAction, default=True,
                    help=f"also time {' and '.join(OTHERS)} (default: on)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    archs.use_webui_unet()  # the webui's SDP attention, as every other timing here runs
    print(f"# {' '.join(['python -m tome_core.bench.runtime'] + (argv if argv is not None else sys.argv[1:]))}")
    print(f"# CPU, {torch.get_num_threads()} threads, float32, SDP attention, random weights (speed only), "
          f"{args.rounds} interleaved rounds (run s: median; speed-up: median and range of the rounds'); "
          "Cache at its defaults")
    for arch in args.models:
        for size in args.sizes:
            per_call = measure(arch, size, args.batch, args.rounds, args.width, others=args.others)
            print()
            print(table(arch, size, args.batch, per_call, args.steps))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
