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
import math
import os
import sys

import torch

from tome_core.options import ratio_cap

from . import archs, jobs
from .archs import top_grid
from .checkpoint import CheckpointError, build_from_checkpoint
from .jobs import CHEAP_ROUNDS, STRIDE, TIMESTEPS, Setup, dtype_name, hardware
from .probes import merge_overhead, peak_memory, peak_memory_child
from .report import Load, find_busy, ms_cell, row_timings, speed_table, write_chart
from .timing import CpuWatch, progress_bar

PROG = "python -m tome_core.bench"


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
    if args.plot is not None:
        folder = os.path.dirname(os.path.abspath(args.plot))
        if not os.path.isdir(folder):
            raise UsageError(f"--plot {args.plot}: no folder {folder} to write it in")
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError(f"--plot {args.plot}: the chart needs matplotlib, which this Python lacks "
                             f"(pip install matplotlib, or leave --plot out)") from None
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


def steadier_hint(args: argparse.Namespace) -> str:
    more = max(args.repeats * 2, 5)
    return (f"more rounds (--repeats {more}), fewer threads than free cores (--threads 1), or a quiet machine "
            f"(close other programs)")


def load_line(load: Load | None) -> str | None:
    if load is None:
        return None
    return (f"# load: other processes kept at most {load.others:.2f} of the {load.cores} cores busy while a case "
            f"was timed (during {load.label}); this run computed with {load.threads} thread"
            f"{'s' if load.threads > 1 else ''}")


def print_checkpoint(args: argparse.Namespace, family: str, base, rows: list[jobs.CheckpointRow]) -> None:
    print(f"\n## {args.checkpoint}: {family} U-Net at {args.sizes[0]} px, batch {args.batch}\n")
    print(f"Median ms per call over {base.rounds} interleaved rounds, (spread) = interquartile range / median; "
          f"rel. L2 = how far the prediction moves from the unmerged one.\n")
    print("| ratio | ms | speed-up | " + " | ".join(f"rel. L2 t={int(t)}" for t in TIMESTEPS) + " |")
    print("|------:|---:|------:|" + "------:|" * len(TIMESTEPS))
    print(f"| 0.00 | {ms_cell(base)} | 1.00x | " + " | ".join("0" for _ in TIMESTEPS) + " |")
    for row in rows:
        print(f"| {row.ratio:.2f} | {ms_cell(row.ms)} | {row.speedup:.2f}x | "
              + " | ".join(f"{e:.4f}" for e in row.errors) + " |")


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
            for size in args.sizes:
                check_size_fits(size, loaded[1], 1 if loaded[1] == "sdxl" else 0)
        except (CheckpointError, UsageError) as error:
            print(f"{PROG}: error: {error}", file=sys.stderr)
            return 2
    names = jobs.contender_names(not args.no_tomesd, not args.no_ideal)
    print(f"# ToMe benchmark: {hardware(device)}, {dtype_name(dtype)}, batch {args.batch}, SDP attention, "
          f"width {args.width:g}, use_rand={not args.no_rand}, levels {args.max_downsample or 'auto'}, "
          f"contenders: {', '.join(names) if loaded is None else 'none and ours per ratio'}")
    print(f"# command: {PROG} {' '.join(argv if argv is not None else sys.argv[1:])}")
    cap = ratio_cap(STRIDE, STRIDE)
    for ratio in args.ratios:
        if ratio > cap:
            print(f"# ratio {ratio:g} is above the {STRIDE}×{STRIDE} stride's cap: every source token merges, "
                  f"so {cap:.2f} is used (the tables show the ratio used)")
    if loaded is not None:
        unet, family, context_dim = loaded
        setup = Setup(device, dtype, progress_bar((len(args.ratios) + 1) * (args.repeats + 1), not args.quiet))
        base, rows = jobs.bench_checkpoint(args, setup, unet, context_dim)
        setup.progress.close()
        print_checkpoint(args, family, base, rows)
        timings = [("no ToMe", base)] + [(f"ratio {row.ratio:.2f}", row.ms) for row in rows]
        finish(args, timings, setup.load(), bool(rows))
        return 0

    per_case = len(args.models) * len(args.sizes) * len(args.ratios) * len(names)
    total = per_case * ((args.repeats + 1) * ("unet" not in args.skip)
                        + (max(args.repeats, CHEAP_ROUNDS) + 1) * ("block" not in args.skip))
    total += (CHEAP_ROUNDS + 1) * (1 + ("tomesd" in names)) * ("overhead" not in args.skip)
    setup = Setup(device, dtype, progress_bar(total, not args.quiet))
    block_rows = jobs.bench_block(args, setup) if "block" not in args.skip else []
    unet_rows = jobs.bench_unet(args, setup) if "unet" not in args.skip else []
    overhead = None
    if "overhead" not in args.skip:
        setup.progress.set_postfix_str("merge overhead")
        watch = CpuWatch()
        overhead = merge_overhead(device, dtype, CHEAP_ROUNDS, with_tomesd="tomesd" in names,
                                  on_call=lambda name: setup.progress.update())
        setup.loads.append(("merge overhead", watch.others()))
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
    busy = finish(args, timings, setup.load(), bool(unet_rows))
    chart_rows = unet_rows or block_rows
    if args.plot and chart_rows:
        what = "U-Net step" if unet_rows else "one top transformer"
        ratios = "/".join(f"{r:.2f}" for r in sorted({row.ratio for row in chart_rows}))
        title = (f"{what} speed-up over no ToMe: {dtype_name(dtype)}, SDP attention, batch {args.batch}, "
                 f"width {args.width:g}, ratio {ratios}\n{hardware(device)}; bars: median, whiskers: spread")
        write_chart(chart_rows, args.plot, title, f"{what} speed-up over no ToMe", busy)
        print(f"\nchart written to {args.plot}")
    return 0


def finish(args: argparse.Namespace, timings: list, load: Load | None, judged_by_rounds: bool):
    """Print the load line and, when the figures may be off, the one warning line; return the ``Busy``."""
    line = load_line(load)
    if line:
        print("\n" + line)
    busy = find_busy(timings, load)
    if busy:
        print("\n" + busy.line(steadier_hint(args)))
    elif args.repeats < 3 and judged_by_rounds:
        print(f"\nNOTE: {args.repeats} round(s) per U-Net case measure no spread, so nothing here says whether the "
              f"machine was quiet; use --repeats 3 or more for figures that can be judged.")
    return busy
