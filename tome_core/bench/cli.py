"""What token merging gains on this machine, and what it costs the picture.

By default it runs the three shipped proxies (small SD-layout U-Nets trained on photographs from three seeds,
pixel space) at their evaluation size; ``--proxy FILE ...`` runs other proxies, ``--checkpoint FILE`` a real SD
1.x/2.x/SDXL checkpoint. For each model, the same short Euler sampling run from the same noise is made with no
merging and with each method at each setting (ToMe and Local at each ratio, ToDo at each factor, tomesd when
installed), the final images compared image by image with the unmerged ones by PSNR and SSIM, and each step's
prediction compared along the unmerged run's own trajectory, each step weighed by how far it moves the sample
(the "step dB"). The contenders are timed on a
U-Net call of the first model in interleaved rounds. ``--models sd15 sdxl ...`` times the webui's
architectures with random weights instead: speed only, since random weights make no picture.

Prints markdown tables with speed and fidelity side by side (with several proxies: each proxy's figures, their
median, and the orderings that hold on every proxy), writes the images side by side (``--sheet``) and a chart
of speed-up against fidelity (``--plot``), and warns when the machine was too busy for the figures. Every bad
argument or input is refused with one line and exit status 2 before anything is built or timed.
"""

from __future__ import annotations

import sys

import torch

from tome_core.options import ratio_cap

from . import archs
from .arguments import PROG, UsageError, check_args, parse_args
from .jobs import STRIDE
from .loading import pick_device, trained_groups
from .probes import peak_memory_child
from .runs import run_architectures, run_groups
from .sdxl_figure import sdxl_figure
from .tensorfile import CheckpointError


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark on ``argv`` (default: the command line's); the exit status: 0, or 2 for a bad argument
    or input, refused in one line before anything is built or timed."""
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
        return _refused(error)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.float32 if device.type == "cpu" else torch.float16)
    archs.use_webui_unet()
    command = f"# command: {PROG} {' '.join(argv if argv is not None else sys.argv[1:])}"
    groups = None
    if args.models is None:
        try:
            groups = trained_groups(args, device, dtype)
        except (CheckpointError, UsageError) as error:
            return _refused(error)
        if groups is None:  # no proxy in this build: the architecture speed run it replaced
            args.models, args.sheet = ["sd15"], ""
            args.ratios = None if "ratios" in args.defaulted else args.ratios
            args.todo_factors = None if "todo_factors" in args.defaulted else args.todo_factors
            try:
                check_args(args)
            except UsageError as error:
                return _refused(error)
            print("# the shipped proxy model is not in this build: timing the sd15 architecture with random "
                  "weights instead (speed only)")
    cap = ratio_cap(STRIDE, STRIDE)
    if groups is not None:
        status = run_groups(args, groups, device, dtype, command, cap)
        if wants_sdxl_figure(args):
            print("\n" + "\n".join(sdxl_figure(args.steps, args.sampler, args.images, args.seed, args.cfg,
                                               not args.apart, prompted=not args.unprompted)))
        return status
    return run_architectures(args, device, dtype, command, cap)


def wants_sdxl_figure(args) -> bool:
    """Whether the run ends with ``sdxl_figure``: a fidelity run on the shipped SD 1.5-layout proxies alone (the
    main job), where SDXL would otherwise go unmeasured."""
    return (args.sdxl_figure and args.fidelity and args.checkpoint is None and args.proxy is None
            and "sdxl" not in args.layouts)


def _refused(error: Exception) -> int:
    print(f"{PROG}: error: {error}", file=sys.stderr)
    return 2
