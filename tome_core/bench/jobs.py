"""The measurements themselves: a whole U-Net step, one top transformer alone, a trained model's pictures and
speed; each case raced in interleaved rounds while a watch counts the cores other processes take, every
method at every setting together."""

from __future__ import annotations

import argparse
import gc
import math
import os
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from tome_core.options import effective_ratio

from tome_core.patch import transformer_levels

from . import archs
from .contenders import SAME_LEVELS, SIZE_WEIGHTED, Contender, Wrapped, roster, tomesd_available
from .fidelity import Pictures, sample_pictures
from .opcount import Cost, OpCount, added_cost, count_ops
from .pipeline import Pipeline
from .report import Case, Entry, Fidelity, Load, worst_load
from .sampling import DEFAULT_CFG, guidance_for
from .stepwise import step_errors
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
    threads = torch.get_num_threads()
    return (f"{device.type}, {os.cpu_count()} cores, torch {torch.__version__}, {threads} "
            f"thread{'' if threads == 1 else 's'}")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def contender_names(with_tomesd: bool = True, with_ideal: bool = True, with_size_weighted: bool = False,
                    methods: list[str] | None = None) -> list[str]:
    """The methods a run will race, in their order (``methods``: only those, as ``--methods`` names them)."""
    weighted = [f"ToMe {SIZE_WEIGHTED}", f"Local {SIZE_WEIGHTED}"] if with_size_weighted else []
    names = (["ToMe", "ToDo", "Local", "Stack"] + weighted
             + (["tomesd"] if with_tomesd and tomesd_available() else []))
    if methods:
        names = [n for n in names if n.split()[0] in methods]
    return ["none"] + names + (["ideal"] if with_ideal else [])


def roster_size(ratios: int, todo_factors: int, with_tomesd: bool = True, with_ideal: bool = True,
                with_size_weighted: bool = False) -> int:
    """How many contenders a roster of ``ratios`` ratios and ``todo_factors`` factors holds."""
    names = contender_names(with_tomesd, with_ideal)
    # Per ratio: ToMe, Local and Stack (and ToMe and Local size-weighted), tomesd, and the three ideals.
    return 1 + ratios * (3 + 2 * with_size_weighted + ("tomesd" in names) + ideals_per_ratio("ideal" in names)) \
        + todo_factors


def ideals_per_ratio(with_ideal: bool) -> int:
    """The ideal contenders of one ratio: the ideal merge, the keys-and-values ideal and the whole-stack ideal
    (never sampled)."""
    return 3 if with_ideal else 0


def inputs(batch: int, channels: int, side: int, ctx_dim: int, depth: int, device: torch.device,
           dtype: torch.dtype) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Fixed random x (B, channels, side, side) and ``depth`` copies of one context (B, 77, ctx_dim)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, channels, side, side, generator=gen).to(device, dtype)
    ctx = [torch.randn(batch, 77, ctx_dim, generator=gen).to(device, dtype)] * depth
    return x, ctx


def race(label: str, model: nn.Module, call: Callable[[], object], racers: list[Contender], setup: Setup,
         rounds: int, budget_s: float | None = None, ops: dict[str, Cost] | None = None
         ) -> dict[str, Spread]:
    """Each contender's ms per ``call()`` over interleaved rounds; notes the cores others used meanwhile.

    With ``ops``, each contender's warm-up is two calls, the second under an op counter (neither is timed), and
    ``ops`` gets what a contender adds at every later call (dispatched operations per patched block and stack,
    multiply-adds against none's), by contender name.
    """
    setup.progress.set_postfix_str(label)
    watch = CpuWatch()
    timer = model_timer(model, call, racers, setup.device)
    counts: dict[str, OpCount] = {}
    by_name = {c.name: c for c in racers}

    def time_one(name: str) -> float:
        if ops is None or name in counts:
            return timer(name)
        racer = by_name[name]
        racer.apply(model)
        try:
            # A first call builds what a method keeps for every later call at this size (index tables,
            # cached partitions); the second call's operations are what each step costs.
            with torch.no_grad():
                call()
            counts[name] = count_ops(model, call)
        finally:
            racer.remove(model)
        return 0.0

    samples = interleaved_rounds([c.name for c in racers], time_one, rounds, budget_s=budget_s,
                                 on_call=lambda name: setup.progress.update())
    setup.loads.append((label, watch.others()))
    if ops is not None and "none" in counts:
        ops.update({name: added_cost(counts["none"], count) for name, count in counts.items()
                    if name != "none"})
    return spreads(samples)


def effective_ratios(ratios: list[float]) -> list[float]:
    """The ratios used (the stride's cap above it), each once, in the order given."""
    return list(dict.fromkeys(effective_ratio(r, STRIDE, STRIDE) for r in ratios))


def entries(racers: list[Contender]) -> list[Entry]:
    return [Entry(c.name, c.method, c.setting, c.ideal) for c in racers]


def racers_for(args: argparse.Namespace, tomesd_max_downsample: int, tomesd_setup=None) -> list[Contender]:
    racers = _all_racers(args, tomesd_max_downsample, tomesd_setup)
    wanted = getattr(args, "methods", None)
    if not wanted:
        return racers
    kept = [c for c in racers if c.method == "none" or c.method.split()[0] in wanted]
    ideals = {c.ideal for c in kept}
    return kept + [c for c in racers if c.method == "ideal" and c.name in ideals]


def _all_racers(args: argparse.Namespace, tomesd_max_downsample: int, tomesd_setup=None) -> list[Contender]:
    return roster(effective_ratios(args.ratios), args.todo_factors, use_rand=not args.no_rand, seed=args.seed,
                  max_downsample=args.max_downsample, tomesd_max_downsample=tomesd_max_downsample,
                  with_tomesd=not args.no_tomesd, with_ideal=not args.no_ideal, tomesd_setup=tomesd_setup,
                  with_size_weighted=getattr(args, "size_weighted", False),
                  with_merge_mlp=getattr(args, "merge_mlp", False),
                  stack_max_downsample=getattr(args, "stack_max_downsample", None) or SAME_LEVELS,
                  cache_intervals=getattr(args, "cache_intervals", None) or ())


def bench_unet(args: argparse.Namespace, setup: Setup, budget_s: float | None = None) -> list[Case]:
    """One Case per (model, size): a whole U-Net step (B latents, one timestep, a context), every method and
    setting raced together."""
    cases = []
    for arch in args.models:
        unet, ctx_dim = archs.build_unet(arch, setup.device, setup.dtype, args.width)
        wrapped = Wrapped(unet)
        for size in args.sizes:
            x, ctx = inputs(args.batch, 4, size // 8, ctx_dim, archs.unet_depth(unet), setup.device, setup.dtype)
            t = torch.full((args.batch,), 500.0, device=setup.device)
            # On SDXL, give tomesd the level ours picks automatically, so the race is fair.
            racers = racers_for(args, args.max_downsample or 2 ** archs.top_attention_level(arch))
            ops: dict[str, Cost] = {}
            ms = race(f"U-Net {arch} {size} px", wrapped, lambda: unet(x, t, context=ctx), racers, setup,
                      args.repeats, budget_s, ops)
            cases.append(Case(arch, size, entries(racers), ms, None, ops))
        unet = wrapped = None  # free this model before the next one is built
        gc.collect()
    return cases


def bench_block(args: argparse.Namespace, setup: Setup) -> list[Case]:
    """One Case per (model, size): the first transformer of the highest-resolution attention level alone."""
    cases = []
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

            def tell_tomesd_the_grid(model, grid=grid):
                # tomesd learns the latent size from a U-Net pre-hook, which a lone block does not have.
                transformer._tome_info["size"] = (grid, grid)

            racers = racers_for(args, 8, tell_tomesd_the_grid)
            ops: dict[str, Cost] = {}
            if hasattr(transformer, "is_input_continuous"):  # a diffusers Transformer2DModel
                text = ctx[0] if isinstance(ctx, list) else ctx  # one context for all its blocks, not one each
                call = lambda: transformer(x, encoder_hidden_states=text).sample  # noqa: E731
            else:
                call = lambda: transformer(x, context=ctx)  # noqa: E731
            ms = race(f"block {arch} {size} px", wrapped, call, racers, setup, max(args.repeats, CHEAP_ROUNDS),
                      ops=ops)
            cases.append(Case(arch, size, entries(racers), ms, None, ops))
    return cases


def bench_pipeline(args: argparse.Namespace, setup: Setup, pipe: Pipeline, size: int
                   ) -> tuple[Case, Pictures | None]:
    """A trained model at ``size`` px: with ``args.fidelity``, ``args.steps`` Euler steps from the same noise
    with no merging and each contender, compared by PSNR and SSIM; then a U-Net call at batch ``args.batch``
    with its empty-prompt conditioning raced as in ``bench_unet``."""
    unet = pipe.unet
    wrapped = Wrapped(unet)
    level = min((lv for _, _, lv in transformer_levels(unet)), default=0)
    racers = racers_for(args, args.max_downsample or 2 ** level)
    fidelity, pictures = measure_fidelity(args, setup, pipe, size, racers) if args.fidelity else (None, None)
    side = size // pipe.downscale
    gen = torch.Generator().manual_seed(args.seed + 1)
    x = torch.randn(args.batch, pipe.channels, side, side, generator=gen).to(setup.device, setup.dtype)
    t = torch.full((args.batch,), 500, device=setup.device, dtype=torch.long)
    kwargs = {"context": pipe.context.to(setup.device, setup.dtype).expand(args.batch, *pipe.context.shape[1:])}
    if pipe.y is not None:
        kwargs["y"] = pipe.y.to(setup.device, setup.dtype).expand(args.batch, *pipe.y.shape[1:])
    ops: dict[str, Cost] = {}
    ms = race(f"{pipe.label} {size} px", wrapped, lambda: unet(x, t, **kwargs), racers, setup, args.repeats,
              ops=ops)
    return Case(pipe.label, size, entries(racers), ms, fidelity, ops), pictures


def measure_fidelity(args: argparse.Namespace, setup: Setup, pipe: Pipeline, size: int,
                     racers: list[Contender] | None = None) -> tuple[dict[str, Fidelity], Pictures]:
    """Both fidelity figures of every contender on ``pipe`` at ``size`` px, image by image: the final pictures
    after ``args.steps`` Euler steps (``fidelity``) and one step's prediction along the unmerged trajectory
    (``stepwise``). Two U-Net passes of ``args.steps`` calls per contender."""
    if racers is None:
        level = min((lv for _, _, lv in transformer_levels(pipe.unet)), default=0)
        racers = racers_for(args, args.max_downsample or 2 ** level)
    setup.progress.set_postfix_str(f"{pipe.label}: sampling {size} px, {args.steps} steps")
    guidance = guidance_for(pipe, args.images, getattr(args, "cfg", DEFAULT_CFG), not getattr(args, "apart", False))
    pictures = sample_pictures(pipe, racers, size, args.steps, args.seed, args.images, setup.device,
                               on_done=lambda name: setup.progress.update(),
                               sampler=getattr(args, "sampler", "euler"), guidance=guidance)
    if pictures.trajectory is None:  # another sampler than Euler: the final pictures alone
        for _ in racers:
            setup.progress.update()
        return pictures.fidelity(), pictures
    setup.progress.set_postfix_str(f"{pipe.label}: each step's prediction, {size} px")
    steps = step_errors(pipe, racers, pictures.trajectory, args.seed, setup.device,
                        on_done=lambda name: setup.progress.update())
    return pictures.fidelity(steps=steps), pictures
