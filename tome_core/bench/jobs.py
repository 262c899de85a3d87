"""The measurements themselves: a whole U-Net step, one top transformer alone, a real checkpoint's U-Net; each
case raced in interleaved rounds while a watch counts the cores other processes take."""

from __future__ import annotations

import argparse
import gc
import math
import os
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

import tome_core
from tome_core.options import effective_ratio

from . import archs
from .checkpoint import relative_l2
from .contenders import Contender, Wrapped, contenders, tomesd_available
from .report import Load, Row, worst_load
from .timing import CpuWatch, Spread, interleaved_rounds, model_timer, spreads

STRIDE = 2  # sx = sy = 2, the default of ours and tomesd
CHEAP_ROUNDS = 9  # the single-block and overhead probes cost little: more rounds, steadier medians


@dataclass
class Setup:
    """What every measurement of one run shares, and what it learns about the machine's load."""

    device: torch.device
    dtype: torch.dtype
    progress: object  # a tqdm bar, or a stand-in that shows nothing
    loads: list[tuple[str, float | None]] = field(default_factory=list)

    def load(self) -> Load | None:
        """Where other processes used the most cores while this run timed."""
        threads = torch.get_num_threads() if self.device.type == "cpu" else 1
        return worst_load(self.loads, os.cpu_count() or 1, threads)


def hardware(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, CUDA {torch.version.cuda}"
    return f"{device.type}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def contender_names(with_tomesd: bool = True, with_ideal: bool = True) -> list[str]:
    """The contenders a run will race, in their order."""
    return (["none", "ours"] + (["tomesd"] if with_tomesd and tomesd_available() else [])
            + (["ideal"] if with_ideal else []))


def inputs(batch: int, channels: int, side: int, ctx_dim: int, depth: int, device: torch.device,
           dtype: torch.dtype) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Fixed random x (B, channels, side, side) and ``depth`` copies of one context (B, 77, ctx_dim)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, channels, side, side, generator=gen).to(device, dtype)
    ctx = [torch.randn(batch, 77, ctx_dim, generator=gen).to(device, dtype)] * depth
    return x, ctx


def race(label: str, model: nn.Module, call: Callable[[], object], racers: list[Contender], setup: Setup,
         rounds: int, budget_s: float | None = None) -> dict[str, Spread]:
    """Each contender's ms per ``call()`` over interleaved rounds; notes the cores others used meanwhile."""
    setup.progress.set_postfix_str(label)
    watch = CpuWatch()
    timer = model_timer(model, call, racers, setup.device)
    samples = interleaved_rounds([c.name for c in racers], timer, rounds, budget_s=budget_s,
                                 on_call=lambda name: setup.progress.update())
    setup.loads.append((label, watch.others()))
    return spreads(samples)


def bench_unet(args: argparse.Namespace, setup: Setup, budget_s: float | None = None) -> list[Row]:
    """One Row per (model, size, ratio): a whole U-Net step (B latents, one timestep, a context)."""
    rows = []
    for arch in args.models:
        unet, ctx_dim = archs.build_unet(arch, setup.device, setup.dtype, args.width)
        wrapped = Wrapped(unet)
        for size in args.sizes:
            x, ctx = inputs(args.batch, 4, size // 8, ctx_dim, archs.unet_depth(unet), setup.device, setup.dtype)
            t = torch.full((args.batch,), 500.0, device=setup.device)
            for ratio in args.ratios:
                # On SDXL, give tomesd the level ours picks automatically, so the race is fair.
                tomesd_md = args.max_downsample or 2 ** archs.top_attention_level(arch)
                racers = contenders(ratio, not args.no_rand, args.max_downsample, tomesd_md,
                                    with_tomesd=not args.no_tomesd, with_ideal=not args.no_ideal)
                ms = race(f"U-Net {arch} {size} px r={ratio:g}", wrapped, lambda: unet(x, t, context=ctx), racers,
                          setup, args.repeats, budget_s)
                rows.append(Row(arch, size, effective_ratio(ratio, STRIDE, STRIDE), ms))
        unet = wrapped = None  # free this model before the next one is built
        gc.collect()
    return rows


def bench_block(args: argparse.Namespace, setup: Setup) -> list[Row]:
    """One Row per (model, size, ratio): the first transformer of the highest-resolution attention level alone."""
    rows = []
    for arch in args.models:
        unet, ctx_dim = archs.build_unet(arch, setup.device, setup.dtype, args.width)
        transformer, down = archs.top_transformer(unet)
        del unet
        wrapped = Wrapped(transformer)
        depth = len(transformer.transformer_blocks)
        for size in args.sizes:
            grid = archs.top_grid(size, int(math.log2(down)))
            x, ctx = inputs(args.batch, archs.transformer_channels(transformer), grid, ctx_dim, depth,
                            setup.device, setup.dtype)
            for ratio in args.ratios:
                def tell_tomesd_the_grid(model, grid=grid):
                    # tomesd learns the latent size from a U-Net pre-hook, which a lone block does not have.
                    transformer._tome_info["size"] = (grid, grid)

                racers = contenders(ratio, not args.no_rand, None, 8, with_tomesd=not args.no_tomesd,
                                    with_ideal=not args.no_ideal, tomesd_setup=tell_tomesd_the_grid)
                ms = race(f"block {arch} {size} px r={ratio:g}", wrapped, lambda: transformer(x, context=ctx),
                          racers, setup, max(args.repeats, CHEAP_ROUNDS))
                rows.append(Row(arch, size, effective_ratio(ratio, STRIDE, STRIDE), ms))
    return rows


@dataclass
class CheckpointRow:
    ratio: float  # the ratio used
    ms: Spread
    speedup: float
    errors: list[float]  # relative L2 of the prediction per timestep


TIMESTEPS = (999.0, 749.0, 499.0, 249.0)


def bench_checkpoint(args: argparse.Namespace, setup: Setup, unet: nn.Module, context_dim: int
                     ) -> tuple[Spread, list[CheckpointRow]]:
    """No ToMe's ms per U-Net call, and per ratio: ms (raced in interleaved rounds with no ToMe and the other
    ratios) and the relative L2 distance of the patched prediction from the unpatched one on fixed noise at
    ``TIMESTEPS``."""
    size = args.sizes[0]
    x, ctx = inputs(args.batch, unet.in_channels, size // 8, context_dim, archs.unet_depth(unet), setup.device,
                    setup.dtype)
    at = {t: torch.full((args.batch,), t, device=setup.device) for t in TIMESTEPS}
    errors = {}
    with torch.no_grad():
        reference = {t: unet(x, at[t], context=ctx) for t in TIMESTEPS}
        for ratio in args.ratios:
            tome_core.apply_patch(unet, ratio=ratio, max_downsample=args.max_downsample, use_rand=not args.no_rand)
            try:
                errors[ratio] = [relative_l2(unet(x, at[t], context=ctx), reference[t]) for t in TIMESTEPS]
            finally:
                tome_core.remove_patch(unet)

    def ours_at(ratio: float) -> Contender:
        return Contender(f"ratio {ratio:g}", lambda m: tome_core.apply_patch(
            m, ratio=ratio, max_downsample=args.max_downsample, use_rand=not args.no_rand), tome_core.remove_patch)

    racers = [Contender("none", lambda m: None, lambda m: None)] + [ours_at(r) for r in args.ratios]
    ms = race(f"checkpoint {size} px", unet, lambda: unet(x, at[499.0], context=ctx), racers, setup, args.repeats)
    base = ms["none"]
    rows = [CheckpointRow(effective_ratio(r, STRIDE, STRIDE), ms[f"ratio {r:g}"],
                          base.median / ms[f"ratio {r:g}"].median, errors[r]) for r in args.ratios]
    return base, rows
