"""What token merging gains on this machine: ``python -m tome_core.bench --help``.

Builds the ldm U-Net architectures the webui runs (random weights; or a real checkpoint's U-Net with
``--checkpoint``) with PyTorch's scaled-dot-product attention, as the webui's ``--opt-sdp-attention`` runs
them, and times no ToMe, ours, tomesd (when installed, with the same options) and the ideal in interleaved
rounds. Prints markdown tables with medians, spreads and shares of the ideal's gain, and warns when the machine
was too busy for the figures to hold.

Every bad argument is refused with one line and exit status 2 before anything is built or timed.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys
from dataclasses import dataclass

import torch

from tome_core.options import effective_ratio, ratio_cap

from . import archs
from .checkpoint import CheckpointError, build_from_checkpoint, relative_l2
from .contenders import Contender, Wrapped, contenders, tomesd_available
from .probes import merge_overhead, peak_memory, peak_memory_child
from .report import Row, busy_warning, find_busy, ms_cell, row_timings, speed_table, write_chart
from .timing import Spread, interleaved_rounds, model_timer, progress_bar, spreads

PROG = "python -m tome_core.bench"
STRIDE = 2  # sx = sy = 2, the default of ours and tomesd
CHEAP_ROUNDS = 9  # the single-block and overhead probes cost little: more rounds, steadier medians


class UsageError(Exception):
    """A bad argument: reported as one line, exit status 2."""


class OneLineParser(argparse.ArgumentParser):
    """argparse, but its errors are one line (no usage block) with exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = OneLineParser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default=None, help="cpu, cuda, cuda:1, mps (default: cuda or mps when found, else cpu)")
    ap.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"],
                    help="default: float16 on cuda/mps, float32 on cpu")
    ap.add_argument("--models", nargs="+", default=["sd15"], choices=sorted(archs.ARCHS))
    ap.add_argument("--sizes", nargs="+", type=int, default=None,
                    help="image sizes in px, multiples of 8 (default: 512 768 1024 on a GPU, 512 768 on the CPU)")
    ap.add_argument("--ratios", nargs="+", type=float, default=[0.5], help="merge ratios in [0, 1)")
    ap.add_argument("--batch", type=int, default=2, help="U-Net batch (2 = one image with cond and uncond)")
    ap.add_argument("--max-downsample", type=int, default=None, choices=[1, 2, 4, 8],
                    help="default: the model's highest-resolution attention level")
    ap.add_argument("--no-rand", action="store_true", help="fixed partition (use_rand=False)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="interleaved rounds per U-Net case: each round calls every contender once (default 3; "
                         f"the single-block and overhead probes run at least {CHEAP_ROUNDS})")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice)")
    ap.add_argument("--width", type=float, default=1.0, help="scale every channel count (for quick runs)")
    ap.add_argument("--skip", nargs="*", default=[], choices=["unet", "block", "overhead", "memory"])
    ap.add_argument("--memory-size", type=int, default=2048,
                    help="px for the peak-memory probe of one top block (0: skip it)")
    ap.add_argument("--no-tomesd", action="store_true", help="leave tomesd out even when installed")
    ap.add_argument("--no-ideal", action="store_true", help="leave the ideal out")
    ap.add_argument("--plot", default=None, help="write a PNG chart of the speed-ups here")
    ap.add_argument("--checkpoint", default=None,
                    help="a .safetensors/.ckpt SD 1.x/2.x/SDXL checkpoint: time its U-Net and report how far "
                         "ToMe moves its prediction (relative L2) per ratio")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    ap.add_argument("--_peak-child", nargs=6, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def pick_device(name: str | None) -> torch.device:
    """The device ``name`` stands for, checked usable; the best available one when None."""
    if name is None:
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError) as error:
        raise UsageError(f"--device {name}: not a device name torch knows ({_first_line(error)})") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        why = "has no CUDA support" if torch.version.cuda is None else "finds no usable CUDA device"
        raise UsageError(f"--device {name}: this torch {torch.__version__} {why}; use --device cpu")
    if device.type == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise UsageError(f"--device {name}: MPS is not available in this torch {torch.__version__} on this "
                         f"machine; use --device cpu")
    try:
        torch.zeros(1, device=device)
    except Exception as error:  # device index out of range, backend not built in, ...
        raise UsageError(f"--device {name}: torch cannot use it here ({_first_line(error)})") from None
    return device


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def top_grid(size_px: int, level: int) -> int:
    """Token grid side at ``level`` of a square ``size_px`` image: latent side size/8, then halved (rounded
    up, as ldm's stride-2 convolutions do) once per level."""
    side = size_px // 8
    for _ in range(level):
        side = math.ceil(side / 2)
    return side


def check_args(args: argparse.Namespace) -> None:
    """Raise ``UsageError`` for the first bad argument; fill in the size default."""
    for ratio in args.ratios:
        if not 0.0 <= ratio < 1.0:  # also refuses nan
            raise UsageError(f"--ratios {ratio:g}: a merge ratio must lie in [0, 1)")
    if args.repeats < 1:
        raise UsageError(f"--repeats {args.repeats}: at least 1 round is needed")
    if args.batch < 1:
        raise UsageError(f"--batch {args.batch}: at least 1 is needed")
    if not (args.width > 0 and math.isfinite(args.width)):
        raise UsageError(f"--width {args.width:g}: a channel scale must be a positive number")
    if args.threads is not None and args.threads < 1:
        raise UsageError(f"--threads {args.threads}: at least 1 is needed")
    if args.memory_size and (args.memory_size < 16 or args.memory_size % 8):
        raise UsageError(f"--memory-size {args.memory_size}: must be 0 (skip) or a multiple of 8 px, at least 16")
    for size in args.sizes or []:
        if size <= 0 or size % 8:
            raise UsageError(f"--sizes {size}: image sizes must be positive multiples of 8 px")
    if args.checkpoint is not None:
        if not os.path.isfile(args.checkpoint):
            raise UsageError(f"--checkpoint {args.checkpoint}: no such file")
        return  # its architecture, and so what sizes it can take, is known once it is read
    for arch in args.models:
        level = archs.top_attention_level(arch)
        if args.max_downsample is not None and 2 ** level > args.max_downsample:
            raise UsageError(f"--max-downsample {args.max_downsample} selects no attention level of {arch}: its "
                             f"highest-resolution attention is at downsample {2 ** level}")
        for size in args.sizes or []:
            check_size_fits(size, arch, level)
            # The first ResBlock past a downsampling normalises the previous level's channels; at 32 channels
            # (one per GroupNorm group) on a 1×1 grid with batch 1 that is one value per group, which torch refuses.
            if args.batch == 1 and archs.scaled_channels(320, args.width) == 32 and top_grid(size, 1) == 1:
                raise UsageError(f"--sizes {size} with --batch 1 at --width {args.width:g}: ldm's GroupNorm would "
                                 f"see one value per group; use --batch 2, a larger size or a larger width")


def check_size_fits(size: int, model: str, level: int) -> None:
    grid = top_grid(size, level)
    if grid < STRIDE:
        smallest = next(s for s in range(8, 1024, 8) if top_grid(s, level) >= STRIDE)
        raise UsageError(f"--sizes {size}: too small for {model}: its highest-resolution attention sees a "
                         f"{grid}×{grid} token grid, smaller than one {STRIDE}×{STRIDE} stride cell (at least "
                         f"{smallest} px)")


@dataclass
class Setup:
    """What every measurement of one run shares."""

    device: torch.device
    dtype: torch.dtype
    progress: object  # a tqdm bar, or a stand-in that shows nothing


def hardware(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, CUDA {torch.version.cuda}"
    return f"{device.type}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _names(args: argparse.Namespace) -> list[str]:
    names = ["none", "ours"]
    if tomesd_available() and not args.no_tomesd:
        names.append("tomesd")
    if not args.no_ideal:
        names.append("ideal")
    return names


def _inputs(batch: int, channels: int, side: int, ctx_dim: int, depth: int, device: torch.device,
            dtype: torch.dtype) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Fixed random x (B, channels, side, side) and ``depth`` copies of one context (B, 77, ctx_dim)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, channels, side, side, generator=gen).to(device, dtype)
    ctx = [torch.randn(batch, 77, ctx_dim, generator=gen).to(device, dtype)] * depth
    return x, ctx


def _race(model: torch.nn.Module, call, racers: list[Contender], setup: Setup, rounds: int,
          budget_s: float | None = None) -> dict[str, Spread]:
    names = [c.name for c in racers]
    timer = model_timer(model, call, racers, setup.device)
    samples = interleaved_rounds(names, timer, rounds, budget_s=budget_s,
                                 on_call=lambda name: setup.progress.update())
    return spreads(samples)


def bench_unet(args: argparse.Namespace, setup: Setup, budget_s: float | None = None) -> list[Row]:
    """One Row per (model, size, ratio): a whole U-Net step (B latents, one timestep, a context)."""
    rows = []
    for arch in args.models:
        unet, ctx_dim = archs.build_unet(arch, setup.device, setup.dtype, args.width)
        wrapped = Wrapped(unet)
        for size in args.sizes:
            x, ctx = _inputs(args.batch, 4, size // 8, ctx_dim, archs.unet_depth(unet), setup.device, setup.dtype)
            t = torch.full((args.batch,), 500.0, device=setup.device)
            for ratio in args.ratios:
                # On SDXL, give tomesd the level ours picks automatically, so the race is fair.
                tomesd_md = args.max_downsample or 2 ** archs.top_attention_level(arch)
                racers = contenders(ratio, not args.no_rand, args.max_downsample, tomesd_md,
                                    with_tomesd=not args.no_tomesd, with_ideal=not args.no_ideal)
                setup.progress.set_postfix_str(f"U-Net {arch} {size} px r={ratio}")
                ms = _race(wrapped, lambda: unet(x, t, context=ctx), racers, setup, args.repeats, budget_s)
                rows.append(Row(arch, size, effective_ratio(ratio, STRIDE, STRIDE), ms))
        del unet, wrapped
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
            grid = top_grid(size, int(math.log2(down)))
            x, ctx = _inputs(args.batch, archs.transformer_channels(transformer), grid, ctx_dim, depth,
                             setup.device, setup.dtype)
            for ratio in args.ratios:
                def tell_tomesd_the_grid(model, grid=grid):
                    # tomesd learns the latent size from a U-Net pre-hook, which a lone block does not have.
                    transformer._tome_info["size"] = (grid, grid)

                racers = contenders(ratio, not args.no_rand, None, 8, with_tomesd=not args.no_tomesd,
                                    with_ideal=not args.no_ideal, tomesd_setup=tell_tomesd_the_grid)
                setup.progress.set_postfix_str(f"block {arch} {size} px r={ratio}")
                ms = _race(wrapped, lambda: transformer(x, context=ctx), racers, setup,
                           max(args.repeats, CHEAP_ROUNDS))
                rows.append(Row(arch, size, effective_ratio(ratio, STRIDE, STRIDE), ms))
    return rows


def checkpoint_job(args: argparse.Namespace, setup: Setup, unet: torch.nn.Module, family: str,
                   context_dim: int) -> list[dict]:
    """Print, per ratio, ms per U-Net call (interleaved rounds with no ToMe) and the relative L2 distance of the
    patched prediction from the unpatched one on fixed noise at a few timesteps. Returns the rows."""
    import tome_core

    size = args.sizes[0]
    x, ctx = _inputs(args.batch, unet.in_channels, size // 8, context_dim, archs.unet_depth(unet), setup.device,
                     setup.dtype)
    timesteps = (999.0, 749.0, 499.0, 249.0)
    at = {t: torch.full((args.batch,), t, device=setup.device) for t in timesteps}
    errors = {}
    with torch.no_grad():
        reference = {t: unet(x, at[t], context=ctx) for t in timesteps}
        for ratio in args.ratios:
            tome_core.apply_patch(unet, ratio=ratio, max_downsample=args.max_downsample, use_rand=not args.no_rand)
            try:
                errors[ratio] = [relative_l2(unet(x, at[t], context=ctx), reference[t]) for t in timesteps]
            finally:
                tome_core.remove_patch(unet)

    def ours_at(ratio: float) -> Contender:
        return Contender(f"ratio {ratio:g}", lambda m: tome_core.apply_patch(
            m, ratio=ratio, max_downsample=args.max_downsample, use_rand=not args.no_rand), tome_core.remove_patch)

    racers = [Contender("none", lambda m: None, lambda m: None)] + [ours_at(r) for r in args.ratios]
    ms = _race(unet, lambda: unet(x, at[499.0], context=ctx), racers, setup, args.repeats)
    setup.progress.close()
    base = ms["none"]
    print(f"\n## {args.checkpoint}: {family} U-Net at {size} px, batch {args.batch}\n")
    print(f"Median ms per call over {base.rounds} interleaved rounds, (spread) = interquartile range / median; "
          f"rel. L2 = how far the prediction moves from the unmerged one.\n")
    print("| ratio | ms | speed-up | " + " | ".join(f"rel. L2 t={int(t)}" for t in timesteps) + " |")
    print("|------:|---:|------:|" + "------:|" * len(timesteps))
    print(f"| 0.00 | {ms_cell(base)} | 1.00x | " + " | ".join("0" for _ in timesteps) + " |")
    rows = []
    for ratio in args.ratios:
        spread = ms[f"ratio {ratio:g}"]
        row = dict(ratio=effective_ratio(ratio, STRIDE, STRIDE), ms=spread.median,
                   speedup=base.median / spread.median, errors=errors[ratio])
        rows.append(row)
        print(f"| {row['ratio']:.2f} | {ms_cell(spread)} | {row['speedup']:.2f}x | "
              + " | ".join(f"{e:.4f}" for e in row["errors"]) + " |")
    warning = busy_warning([(name, s) for name, s in ms.items()], steadier_hint(args))
    if warning:
        print("\n" + warning)
    return rows


def steadier_hint(args: argparse.Namespace) -> str:
    more = max(args.repeats * 2, 5)
    return (f"more rounds (--repeats {more}), fewer threads (--threads 1, or close other programs), or a quiet "
            f"machine")


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except SystemExit as done:  # --help, or a malformed argument already reported in one line
        return int(done.code or 0)
    if args._peak_child:
        which, side, channels, batch, dtype, device = args._peak_child
        peak_memory_child(which, int(side), int(channels), int(batch), dtype, device)
        return 0
    try:
        check_args(args)
        device = pick_device(args.device)
    except UsageError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.float32 if device.type == "cpu" else torch.float16)
    if args.sizes is None:
        args.sizes = [512, 768] if device.type == "cpu" else [512, 768, 1024]
    archs.use_webui_unet()
    loaded = None
    if args.checkpoint:
        try:
            loaded = build_from_checkpoint(args.checkpoint, device, dtype)
            family = loaded[1]
            level = 1 if family == "sdxl" else 0
            for size in args.sizes:
                check_size_fits(size, family, level)
        except (CheckpointError, UsageError) as error:
            print(f"{PROG}: error: {error}", file=sys.stderr)
            return 2
    names = _names(args)
    print(f"# ToMe benchmark: {hardware(device)}, {dtype_name(dtype)}, batch {args.batch}, SDP attention, "
          f"width {args.width:g}, use_rand={not args.no_rand}, levels {args.max_downsample or 'auto'}, "
          f"contenders: {', '.join(names)}")
    print(f"# command: {PROG} {' '.join(argv if argv is not None else sys.argv[1:])}")
    cap = ratio_cap(STRIDE, STRIDE)
    for ratio in args.ratios:
        if ratio > cap:
            print(f"# ratio {ratio:g} is above the {STRIDE}×{STRIDE} stride's cap: every source token merges, "
                  f"so {cap:.2f} is used (the tables show the ratio used)")
    if loaded is not None:
        setup = Setup(device, dtype,
                      progress_bar((len(args.ratios) + 1) * (args.repeats + 1), not args.quiet, "timing"))
        checkpoint_job(args, setup, *loaded)
        return 0
    per_case = len(args.models) * len(args.sizes) * len(args.ratios) * len(names)
    total = per_case * ((args.repeats + 1) * ("unet" not in args.skip)
                        + (max(args.repeats, CHEAP_ROUNDS) + 1) * ("block" not in args.skip))
    total += (CHEAP_ROUNDS + 1) * (1 + ("tomesd" in names)) * ("overhead" not in args.skip)
    setup = Setup(device, dtype, progress_bar(total, not args.quiet, "timing"))
    block_rows = bench_block(args, setup) if "block" not in args.skip else []
    unet_rows = bench_unet(args, setup) if "unet" not in args.skip else []
    overhead = None
    if "overhead" not in args.skip:
        setup.progress.set_postfix_str("merge overhead")
        overhead = merge_overhead(device, dtype, CHEAP_ROUNDS, with_tomesd="tomesd" in names,
                                  on_call=lambda name: setup.progress.update())
    setup.progress.close()
    timings = []
    if block_rows:
        print("\n" + speed_table(block_rows, "One highest-resolution transformer"))
        timings += row_timings(block_rows, "block")
    if unet_rows:
        print("\n" + speed_table(unet_rows, "Whole U-Net step"))
        timings += row_timings(unet_rows, "U-Net")
    if overhead is not None:
        print("\n## Merge overhead: find + merge + unmerge of (2, 4096, 320), ratio 0.5\n")
        print("What the ideal skips, and so where a method's share of the ideal's gain goes: median ms over "
              f"{overhead['ours'].rounds} interleaved rounds (spread).\n")
        print("| ours ms | tomesd ms | ours / tomesd |\n|--:|--:|--:|")
        theirs = overhead.get("tomesd")
        quotient = f"{overhead['ours'].median / theirs.median:.2f}" if theirs else "–"
        print(f"| {ms_cell(overhead['ours'])} | {ms_cell(theirs)} | {quotient} |")
        timings += [(f"overhead {name}", s) for name, s in overhead.items()]
    if "memory" not in args.skip and args.memory_size:
        print(f"\n## Peak extra memory of find + merge + unmerge, one top block at {args.memory_size} px "
              f"(2, {(args.memory_size // 8) ** 2}, 320)\n")
        print("| ours MB | tomesd MB |\n|--:|--:|")
        ours = peak_memory("ours", args.memory_size, 320, 2, dtype, device)
        theirs = peak_memory("tomesd", args.memory_size, 320, 2, dtype, device) if "tomesd" in names else None
        fmt = lambda v: f"{v / 2 ** 20:,.0f}" if v is not None else "–"  # noqa: E731
        print(f"| {fmt(ours)} | {fmt(theirs)} |")
    busy = find_busy(timings)
    if busy:
        print("\n" + busy.line(steadier_hint(args)))
    elif args.repeats < 3 and unet_rows:
        print(f"\nNOTE: {args.repeats} round(s) per U-Net case measure no spread, so nothing here says whether the "
              f"machine was quiet; use --repeats 3 or more for figures that can be judged.")
    chart_rows = unet_rows or block_rows
    if args.plot and chart_rows:
        what = "U-Net step" if unet_rows else "one top transformer"
        ratios = "/".join(f"{r:.2f}" for r in sorted({row.ratio for row in chart_rows}))
        title = (f"{what} speed-up over no ToMe: {dtype_name(dtype)}, SDP attention, batch {args.batch}, "
                 f"width {args.width:g}, ratio {ratios}\n{hardware(device)}; bars: median, whiskers: spread")
        write_chart(chart_rows, args.plot, title, f"{what} speed-up over no ToMe", busy)
        print(f"\nchart written to {args.plot}")
    return 0
