"""What token merging gains on this machine, and what it costs the picture.

By default it runs the three shipped proxies (small SD-layout U-Nets trained on photographs from three seeds,
pixel space) at their evaluation size; ``--proxy FILE ...`` runs other proxies, ``--checkpoint FILE`` a real SD
1.x/2.x/SDXL checkpoint. For each model, the same short Euler sampling run from the same noise is made with no
merging and with each method at each setting (ToMe and Local at each ratio, ToDo at each factor, tomesd when
installed), the final images compared image by image with the unmerged ones by PSNR and SSIM, and each step's
prediction compared along the unmerged run's own trajectory (the "step dB"). The contenders are timed on a
U-Net call of the first model in interleaved rounds. ``--models sd15 sdxl ...`` times the webui's
architectures with random weights instead: speed only, since random weights make no picture.

Prints markdown tables with speed and fidelity side by side (with several proxies: each proxy's figures, their
median, and the orderings that hold on every proxy), writes the images side by side (``--sheet``) and a chart
of speed-up against fidelity (``--plot``), and warns when the machine was too busy for the figures. Every bad
argument or input is refused with one line and exit status 2 before anything is built or timed.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

from tome_core.options import MAX_RATIO, MAX_TODO_FACTOR, ratio_cap

from . import archs, jobs
from .archs import top_grid
from .tensorfile import CheckpointError
from .jobs import CHEAP_ROUNDS, STRIDE, Setup, dtype_name, hardware
from .pipeline import Pipeline
from .probes import merge_overhead, peak_memory, peak_memory_child
from .report import Case, Load, case_timings, find_busy, ms_cell, table
from .tensorfile import CheckpointError
from .timing import CpuWatch, progress_bar

PROG = "python -m tome_core.bench"
METHOD_NAMES = ("ToMe", "ToDo", "Local", "Stack", "tomesd")
DEFAULT_SHEET = "tome-fidelity.png"
PROXY_IMAGES = 4  # images per proxy in the default run: three proxies, two passes of 20 steps per contender


class UsageError(Exception):
    """A bad argument: reported as one line, exit status 2."""


class OneLineParser(argparse.ArgumentParser):
    """argparse, but its errors are one line (no usage block) with exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def build_parser() -> argparse.ArgumentParser:
    ap = OneLineParser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default=None, help="cpu, cuda, cuda:1, mps (default: cuda or mps when found, else cpu)")
    ap.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"],
                    help="default: float16 on cuda/mps, float32 on cpu")
    ap.add_argument("--models", nargs="+", default=None, choices=sorted(archs.ARCHS),
                    help="time these architectures with random weights (speed only) instead of the proxy")
    ap.add_argument("--checkpoint", default=None,
                    help="a .safetensors/.ckpt SD 1.x/2.x/SDXL checkpoint with its VAE and text encoder, or a "
                         "diffusers model folder (model_index.json; needs diffusers and transformers): speed "
                         "and fidelity on it (default: the shipped proxy model)")
    ap.add_argument("--proxy", nargs="+", default=None, metavar="WEIGHTS",
                    help="proxy models' weights made by 'python -m tome_core.bench.proxy train' (other seeds or "
                         "stages), measured instead of the three shipped ones")
    ap.add_argument("--prediction", default="auto", choices=["auto", "eps", "v"],
                    help="what the checkpoint's U-Net predicts (default: read off the file)")
    ap.add_argument("--sizes", nargs="+", type=int, default=None,
                    help="image sizes in px (default: the proxy's evaluation size; 512 for SD 1.x/2.x and 1024 "
                         "for SDXL checkpoints; 512 768 1024 on a GPU and 512 768 on the CPU for --models)")
    ap.add_argument("--ratios", nargs="+", type=float, default=None,
                    help="ToMe, Local (and tomesd) ratios in [0, 1) (default: 0.25 0.5 0.75 on a trained model, "
                         "0.5 with --models)")
    ap.add_argument("--todo-factors", nargs="+", type=int, default=None,
                    help="ToDo downsampling factors per side, 2 to 8; f keeps 1/f² of the keys and values "
                         "(default: 2 3 4 on a trained model, 2 with --models)")
    ap.add_argument("--steps", type=int, default=20, help="Euler steps of the fidelity run (default 20)")
    ap.add_argument("--images", type=int, default=None,
                    help=f"images per model, each compared on its own: the tables give the median and the range "
                         f"(default: {PROXY_IMAGES} on each proxy; 1 on a checkpoint)")
    ap.add_argument("--seed", type=int, default=0, help="noise and partition seed (default 0)")
    ap.add_argument("--fidelity", action=argparse.BooleanOptionalAction, default=True,
                    help="sample and compare pictures on a trained model (default: on; --no-fidelity times only)")
    ap.add_argument("--sheet", default=DEFAULT_SHEET,
                    help=f"where to write the first model's images side by side, with their amplified "
                         f"differences (default: {DEFAULT_SHEET} in the current folder; '' for none)")
    ap.add_argument("--batch", type=int, default=2, help="U-Net batch (2 = one image with cond and uncond)")
    ap.add_argument("--max-downsample", type=int, default=None, choices=[1, 2, 4, 8],
                    help="default: the model's highest-resolution attention level")
    ap.add_argument("--stack-max-downsample", type=int, default=None, choices=[1, 2, 4, 8],
                    help="Stack's levels alone (default: those of --max-downsample); 4 on SDXL, whose deep second "
                         "level holds most of its work")
    ap.add_argument("--no-rand", action="store_true", help="fixed partition (use_rand=False)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="interleaved rounds per U-Net case: each round calls every contender once (default 3; "
                         f"the single-block and overhead probes run at least {CHEAP_ROUNDS})")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice)")
    ap.add_argument("--width", type=float, default=1.0, help="scale every channel count (for quick runs)")
    ap.add_argument("--skip", nargs="*", default=[], choices=["unet", "block", "overhead", "memory"],
                    help="with --models, leave out these measurements: the whole U-Net step, the single top "
                         "transformer, the merge overhead probe, the peak-memory probe")
    ap.add_argument("--memory-size", type=int, default=2048,
                    help="px for the peak-memory probe of one top block (0: skip it)")
    ap.add_argument("--merge-mlp", action="store_true",
                    help="also race ToMe with its MLP merged too (\"ToMe +mlp\", tomesd's merge_mlp)")
    ap.add_argument("--size-weighted", action="store_true",
                    help="also race ToMe and Local with size-weighted keys (\"ToMe +sw\", \"Local +sw\": a key "
                         "that stands for k tokens adds log k to its attention logit) at each ratio")
    ap.add_argument("--methods", nargs="+", default=None, choices=list(METHOD_NAMES),
                    help="race only these methods (and their ideals) beside no merging (default: all)")
    ap.add_argument("--no-tomesd", action="store_true", help="leave tomesd out even when installed")
    ap.add_argument("--no-ideal", action="store_true", help="leave the ideal out")
    ap.add_argument("--plot", default=None,
                    help="write a PNG chart here: speed-up against PSNR per method and setting (speed-ups alone "
                         "with --models)")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    ap.add_argument("--_peak-child", nargs=6, help=argparse.SUPPRESS)
    return ap


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


def _check_output(flag: str, path: str, what: str, needs: str, pip: str) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UsageError(f"{flag} {path}: no folder {folder} to write it in")
    if not os.access(folder, os.W_OK):
        raise UsageError(f"{flag} {path}: the folder {folder} is not writable")
    try:
        __import__(needs)
    except ImportError:
        raise UsageError(f"{flag} {path}: {what} needs {pip}, which this Python lacks (pip install {pip}, or "
                         f"leave {flag} out)") from None


def check_args(args: argparse.Namespace) -> None:
    """Raise ``UsageError`` for the first bad argument; fill in the defaults that depend on the kind of run."""
    trained = args.models is None  # the proxy or a checkpoint: a model that makes pictures
    if args.models is not None and args.checkpoint is not None:
        raise UsageError("--models and --checkpoint: give one (--models times random-weight architectures, "
                         "--checkpoint a trained model)")
    if args.proxy is not None and (args.models is not None or args.checkpoint is not None):
        raise UsageError("--proxy with --models or --checkpoint: give one model to measure")
    for path in args.proxy or []:
        if not os.path.isfile(path):
            raise UsageError(f"--proxy {path}: no such file")
    args.defaulted = {name for name in ("ratios", "todo_factors") if getattr(args, name) is None}
    if args.ratios is None:
        args.ratios = [0.25, 0.5, 0.75] if trained else [0.5]
    if args.todo_factors is None:
        args.todo_factors = [2, 3, 4] if trained else [2]
    for ratio in args.ratios:
        if not 0.0 <= ratio <= MAX_RATIO:  # also refuses nan
            raise UsageError(f"--ratios {ratio:g}: a merge ratio must lie in [0, {MAX_RATIO:g}]")
    for factor in args.todo_factors:
        if not 2 <= factor <= MAX_TODO_FACTOR:
            raise UsageError(f"--todo-factors {factor}: a ToDo factor must be a whole number from 2 to "
                             f"{MAX_TODO_FACTOR}")
    args.todo_factors = list(dict.fromkeys(args.todo_factors))
    if args.repeats < 1:
        raise UsageError(f"--repeats {args.repeats}: at least 1 round is needed")
    if args.steps < 1:
        raise UsageError(f"--steps {args.steps}: at least 1 step is needed")
    if args.images is None:
        args.images = PROXY_IMAGES if args.checkpoint is None else 1
    if args.images < 1:
        raise UsageError(f"--images {args.images}: at least 1 is needed")
    if args.batch < 1:
        raise UsageError(f"--batch {args.batch}: at least 1 is needed")
    if not (args.width > 0 and math.isfinite(args.width)):
        raise UsageError(f"--width {args.width:g}: a channel scale must be a positive number")
    if args.threads is not None and args.threads < 1:
        raise UsageError(f"--threads {args.threads}: at least 1 is needed")
    if args.memory_size and (args.memory_size < 16 or args.memory_size % 8):
        raise UsageError(f"--memory-size {args.memory_size}: must be 0 (skip) or a multiple of 8 px, at least 16")
    for size in args.sizes or []:
        if size <= 0 or (not trained and size % 8):
            raise UsageError(f"--sizes {size}: image sizes must be positive multiples of 8 px")
    if args.plot is not None:
        _check_output("--plot", args.plot, "the chart", "matplotlib", "matplotlib")
    if not (trained and args.fidelity):
        args.sheet = ""  # no pictures to show
    if args.sheet:
        _check_output("--sheet", args.sheet, "the side-by-side image", "PIL", "pillow")
    if args.checkpoint is not None:
        if os.path.isdir(args.checkpoint):
            from .diffusers_folder import INDEX, is_diffusers_folder

            if not is_diffusers_folder(args.checkpoint):
                raise UsageError(f"--checkpoint {args.checkpoint}: a folder without {INDEX} (give a diffusers "
                                 f"model folder, or a .safetensors/.ckpt file)")
        elif not os.path.isfile(args.checkpoint):
            raise UsageError(f"--checkpoint {args.checkpoint}: no such file")
        return  # its architecture, and so what sizes it can take, is known once it is read
    for arch in args.models or []:
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


def size_step(pipe: Pipeline) -> int:
    """Image sizes ``pipe`` can take are multiples of this: its downscale times the U-Net's total downsampling,
    so every skip connection meets a tensor of its own size, as the model was trained."""
    downsamplings = sum(type(m).__name__ in ("Downsample", "Downsample2D") for m in pipe.unet.modules())
    return pipe.downscale * 2 ** downsamplings


def default_sizes(pipe: Pipeline) -> list[int]:
    """The pipeline's own evaluation size when it names one; else SD's: 1024 px for SDXL (it has vector
    conditioning), 512 px otherwise."""
    size = getattr(pipe, "size", None)
    if size:
        return [int(size)]
    return [1024 if pipe.y is not None else 512]


def check_pipeline_sizes(pipe: Pipeline, sizes: list[int], max_downsample: int | None,
                         fidelity: bool = True) -> None:
    """``UsageError`` for the first size ``pipe`` cannot take, that leaves no stride cell to merge, or (with
    ``fidelity``) whose compared pictures are smaller than SSIM's window."""
    from .metrics import WINDOW

    from tome_core.patch import transformer_levels

    step = size_step(pipe)
    levels = [lv for _, _, lv in transformer_levels(pipe.unet)]
    if not levels:
        raise UsageError(f"{pipe.label}: its U-Net has no transformer blocks to merge in")
    top = min(levels)
    if max_downsample is not None and 2 ** top > max_downsample:
        raise UsageError(f"--max-downsample {max_downsample} selects no attention level of {pipe.label}: its "
                         f"highest-resolution attention is at downsample {2 ** top}")
    for size in sizes:
        if size <= 0 or size % step:
            raise UsageError(f"--sizes {size}: {pipe.label} takes sizes that are multiples of {step} px "
                             f"({pipe.downscale} px per sampled cell, {step // pipe.downscale}× downsampling "
                             f"in its U-Net)")
        grid = size // pipe.downscale // 2 ** top
        if grid < STRIDE:
            raise UsageError(f"--sizes {size}: too small for {pipe.label}: its highest-resolution attention sees "
                             f"a {grid}×{grid} token grid, smaller than one {STRIDE}×{STRIDE} stride cell")
        compared = size if pipe.decode is not None else size // pipe.downscale
        if fidelity and compared < WINDOW:
            what = "images" if pipe.decode is not None else "sampled tensors (no decoder)"
            raise UsageError(f"--sizes {size}: the compared {what} would be {compared}×{compared}, smaller than "
                             f"SSIM's {WINDOW}×{WINDOW} window (use a larger size, or --no-fidelity)")


def steadier_hint(args: argparse.Namespace) -> str:
    """What to try for steadier timings; fewer threads only where the run did not already use one."""
    more = max(args.repeats * 2, 5)
    threads = "" if args.threads == 1 else ", fewer threads than free cores (--threads 1)"
    return f"more rounds (--repeats {more}){threads}, or a quiet machine (close other programs)"


def load_line(load: Load | None) -> str | None:
    if load is None:
        return None
    return (f"# load: other processes kept at most {load.others:.2f} of the {load.cores} cores busy while a case "
            f"was timed (during {load.label}); this run computed with {load.threads} thread"
            f"{'s' if load.threads > 1 else ''}")


RANDOM_NOTE = ("Random weights: no fidelity figure (a random U-Net's pictures carry no image's redundancy and "
               "rank nothing); run without --models (the shipped proxy) or with --checkpoint for PSNR and SSIM.")


def load_trained(args: argparse.Namespace, device: torch.device, dtype: torch.dtype
                 ) -> list[tuple[str, Pipeline]] | None:
    """The models to measure, each with what the tables call it: the checkpoint's pipeline, or the proxies
    (``--proxy``'s, else the shipped ones); None when this build has no proxy. Raises ``CheckpointError`` or
    ``UsageError`` (one line) for a file that cannot be used."""
    if args.checkpoint is not None:
        from . import checkpoint, diffusers_folder

        loader = getattr(checkpoint, "load_pipeline", None)
        if diffusers_folder.is_diffusers_folder(args.checkpoint):
            pipe = diffusers_folder.load_pipeline(args.checkpoint, device, dtype, prediction=args.prediction)
        elif loader is None:  # a build without full-checkpoint loading: its U-Net alone, latents compared
            pipe = _unet_only_pipeline(args.checkpoint, device, dtype)
        else:
            pipe = loader(args.checkpoint, device, dtype, prediction=args.prediction)
        return [(pipe.label, pipe)]
    return load_proxies(device, dtype, args.proxy)


def load_proxies(device: torch.device, dtype: torch.dtype, paths: list[str] | None = None
                 ) -> list[tuple[str, Pipeline]] | None:
    """Each proxy of ``paths`` (default: every shipped one) with its label ("seed 1"); None when this build
    has no proxy; ``UsageError`` (one line) for weights that are missing or do not fit."""
    try:
        from . import proxy
    except ImportError:
        return None
    missing: list[str] = []
    if paths is None:
        finder = getattr(proxy, "shipped_weights", None)
        paths, missing = finder() if finder is not None else ([None], [])
        paths = paths or [None]  # none here: the first one's own refusal says how to make it
    describe = getattr(proxy, "describe", None)
    out = []
    for path in paths:
        pipe = load_proxy_pipeline(device, dtype, path)
        label = describe(path) if describe is not None else (os.path.basename(path) if path else pipe.label)
        out.append((label, pipe))
    for path in missing:  # a checkout without one of them still runs, on the others, and says so
        out[0][1].notes.append(f"shipped proxy {os.path.basename(path)} is missing, so not measured: "
                               f"{proxy.train_command(path)}")
    return out


def load_proxy_pipeline(device: torch.device, dtype: torch.dtype, path: str | None = None) -> Pipeline | None:
    """The shipped proxy (or the proxy weights at ``path``) at its evaluation size; None when this build has
    none; ``UsageError`` (one line) when its weights are missing or do not fit."""
    try:
        from . import proxy
    except ImportError:
        return None
    try:
        pipe = proxy.load_proxy(device=device, dtype=dtype, path=path)
    except (OSError, ValueError) as error:  # weights missing, unreadable or of another architecture
        given = path is not None and not _shipped(proxy, path)
        raise UsageError(("--proxy " if given else "") + _first_line(error)) from None
    if getattr(pipe, "size", None) is None:
        pipe.size = getattr(proxy, "EVAL_SIZE", 64)
    if path is not None and not _shipped(proxy, path):
        pipe.notes = list(pipe.notes) + [f"proxy weights: {path}"]
    return pipe


def _shipped(proxy, path: str) -> bool:
    shipped = getattr(proxy, "SHIPPED_WEIGHTS", ()) + getattr(proxy, "SHIPPED_SDXL_WEIGHTS", ())
    return os.path.abspath(path) in {os.path.abspath(p) for p in shipped}


def _unet_only_pipeline(path: str, device: torch.device, dtype: torch.dtype) -> Pipeline:
    from .checkpoint import build_from_checkpoint

    unet, family, context_dim = build_from_checkpoint(path, device, dtype)
    return Pipeline(family, unet, torch.zeros(1, 77, context_dim),
                    notes=["this build reads the U-Net only: zero conditioning, sampled latents compared"])


def fidelity_note(pictures_on_tensors: bool | None, args: argparse.Namespace, models: int = 1) -> str:
    if pictures_on_tensors is None:
        return "Fidelity not measured (--no-fidelity)." if args.models is None else RANDOM_NOTE
    what = ("the sampled tensors (no decoder), mapped to [0, 1] by the unmerged one's range"
            if pictures_on_tensors else "the decoded images")
    images = f"{args.images} image{'s' if args.images > 1 else ''}"
    over = (f"the median over {images} (their range)" if models == 1 else
            f"on each of {models} proxies the median over its {images}; here the median of the proxies' "
            f"medians (their range)")
    return (f"PSNR, SSIM: {what} after {args.steps} Euler steps from the same noise (seed {args.seed}), "
            f"against no merging's, each image on its own; step dB: each step's prediction along the unmerged "
            f"run's own trajectory (the same input for both), −10·log10 of the noise estimate's squared error "
            f"relative to its power, averaged over the steps; {over}. ∞ and 1.000 = identical.")


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
    archs.use_webui_unet()
    command = f"# command: {PROG} {' '.join(argv if argv is not None else sys.argv[1:])}"
    pipes = None
    groups: list[list[tuple[str, Pipeline]]] = []
    if args.models is None:
        try:
            pipes = load_trained(args, device, dtype)
            if pipes is not None:
                # Proxies of several layouts (the shipped SD 1.5 and SDXL ones) are raced a layout at a time,
                # each at its own evaluation size unless --sizes says otherwise.
                groups = list(layout_groups(pipes).values())
                sizes_given = args.sizes
                for group in groups:
                    for _, pipe in group:
                        check_pipeline_sizes(pipe, sizes_given or default_sizes(group[0][1]), args.max_downsample,
                                             args.fidelity)
        except (CheckpointError, UsageError) as error:
            print(f"{PROG}: error: {error}", file=sys.stderr)
            return 2
        if pipes is None:  # no proxy in this build: the architecture speed run it replaced
            args.models, args.sheet = ["sd15"], ""
            args.ratios = None if "ratios" in args.defaulted else args.ratios
            args.todo_factors = None if "todo_factors" in args.defaulted else args.todo_factors
            try:
                check_args(args)
            except UsageError as error:
                print(f"{PROG}: error: {error}", file=sys.stderr)
                return 2
            print("# the shipped proxy model is not in this build: timing the sd15 architecture with random "
                  "weights instead (speed only)")
    cap = ratio_cap(STRIDE, STRIDE)
    if pipes is not None:
        status = 0
        sheet, plot, sizes_given = args.sheet, args.plot, args.sizes
        for k, group in enumerate(groups):
            if k:
                print()
            args.sizes = sizes_given or default_sizes(group[0][1])
            suffix = "" if k == 0 else "-" + group[0][1].label.split()[0].lower()
            args.sheet, args.plot = _suffixed(sheet, suffix), _suffixed(plot, suffix)
            status = run_trained(args, group, device, dtype, command, cap) or status
        args.sheet, args.plot = sheet, plot
        return status
    return run_architectures(args, device, dtype, command, cap)


def layout_groups(pipes: list[tuple[str, Pipeline]]) -> dict[str, list[tuple[str, Pipeline]]]:
    """``pipes`` grouped by what they are (the pipeline's label and evaluation size), in the order given."""
    groups: dict[str, list[tuple[str, Pipeline]]] = {}
    for label, pipe in pipes:
        groups.setdefault(f"{pipe.label} {getattr(pipe, 'size', None)}", []).append((label, pipe))
    return groups


def _suffixed(path: str | None, suffix: str) -> str | None:
    """``path`` with ``suffix`` before its extension ("tome-fidelity.png" -> "tome-fidelity-sdxl.png")."""
    if not path or not suffix:
        return path
    root, ext = os.path.splitext(path)
    return f"{root}{suffix}{ext}"


def _cap_lines(args: argparse.Namespace, cap: float) -> None:
    for ratio in args.ratios:
        if ratio > cap:
            print(f"# ratio {ratio:g} is above the {STRIDE}×{STRIDE} stride's cap: every source token merges, "
                  f"so {cap:.2f} is used (the tables show the ratio used)")


def run_trained(args: argparse.Namespace, pipes: list[tuple[str, Pipeline]], device: torch.device,
                dtype: torch.dtype, command: str, cap: float) -> int:
    """Fidelity on each trained model and speed on the first, at each size; with several models, each one's
    figures, their median and the orderings that hold on every one."""
    from .replicate import across

    labels = [label for label, _ in pipes]
    pipe = pipes[0][1]
    names = jobs.contender_names(not args.no_tomesd, not args.no_ideal, args.size_weighted, args.methods)
    roster = jobs.racers_for(args, 1)  # what this run races (its count for the progress bar)
    racers = len(roster)
    print(f"# ToMe benchmark: {pipe.name}, {hardware(device)}, {dtype_name(dtype)}, batch {args.batch}, SDP "
          f"attention, use_rand={not args.no_rand}, levels {args.max_downsample or 'auto'}, methods: "
          f"{', '.join(names)}")
    print(command)
    if len(pipes) > 1:
        print(f"# models: {len(pipes)} proxies ({', '.join(labels)}), the same architecture: fidelity measured "
              f"on each, speed timed on the first")
    for note in dict.fromkeys(note for _, p in pipes for note in p.notes):
        print(f"# note: {note}")
    if "tomesd" in names and args.fidelity:
        print("# tomesd draws its random partition from a generator forked off torch's global RNG at its first "
              f"call; the global RNG is seeded ({args.seed}) before each sampling run, so its pictures repeat")
    if args.sheet:
        print(f"# writes {os.path.abspath(args.sheet)}: the pictures side by side (--sheet '' for none)")
    _cap_lines(args, cap)
    sampled = sum(1 for c in roster if c.method != "ideal")  # the ideals are timed, never sampled
    total = len(args.sizes) * ((args.repeats + 1) * racers + 2 * sampled * len(pipes) * args.fidelity)
    setup = Setup(device, dtype, progress_bar(total, not args.quiet))
    cases, pictures, per_size = [], [], []
    for size in args.sizes:
        others = [jobs.measure_fidelity(args, setup, at_size(p, size), size)[0] for _, p in pipes[1:]
                  if args.fidelity]
        case, pics = jobs.bench_pipeline(args, setup, at_size(pipe, size), size)
        per_model = [case.fidelity] + others if case.fidelity is not None else []
        if len(per_model) > 1:
            case.fidelity = across(per_model)
        cases.append(case)
        pictures.append(pics)
        per_size.append(per_model)
    setup.progress.close()
    on_tensors = pictures[0].on_tensors if pictures[0] is not None else None
    print("\n" + table(cases, f"{pipe.label}: speed and fidelity, one U-Net call and {args.steps} Euler steps",
                       fidelity_note(on_tensors, args, len(pipes))))
    if len(pipes) > 1 and args.fidelity:
        for case, per_model in zip(cases, per_size):
            print("\n" + "\n".join(replicated_lines(case, labels, per_model)))
    busy = finish(args, case_timings(cases, "U-Net"), setup.load(), True)
    if args.sheet and pictures[0] is not None:
        from .sheet import write_case_sheet

        for case, pics, per_model in zip(cases, pictures, per_size):
            path = _per_size(args.sheet, case.size, len(cases))
            what = "sampled tensors (no decoder)" if pics.on_tensors else "images"
            model = f"{pipe.label} {labels[0]}" if len(pipes) > 1 else pipe.label
            write_case_sheet(path, case, pics, f"{model}, {case.size} px, {args.steps} Euler steps, seed "
                             f"{args.seed}: {what} (the first); caption: setting, speed-up; PSNR, SSIM; step dB "
                             f"(medians over its {args.images} image{'s' if args.images > 1 else ''})",
                             fidelity=per_model[0])
            print(f"side-by-side images written to {os.path.abspath(path)}")
    if args.plot:
        from .chart import write_speed_chart, write_tradeoff_chart

        over = f"median of {len(pipes)} proxies, bars: their range" if len(pipes) > 1 else \
            f"median of {args.images} images, bars: their range"
        title = (f"{pipe.label}: speed-up of one U-Net call (batch {args.batch}, {dtype_name(dtype)}) against "
                 f"fidelity after {args.steps} Euler steps from seed {args.seed} ({over})\n{hardware(device)}")
        if on_tensors is None:
            write_speed_chart(cases, args.plot, title, busy)
        else:
            write_tradeoff_chart(cases, args.plot, title, busy)
        print(f"chart written to {os.path.abspath(args.plot)}")
    return 0


def replicated_lines(case: Case, labels: list[str], per_model: list) -> list[str]:
    """Each model's figures (medians over its images, with their range) and their median, for each measure,
    and the orderings that hold on every model."""
    from .replicate import TITLES, orderings, orderings_lines, per_model_table

    entries = [e for e in case.entries if e.name in per_model[0]]
    lines = []
    for measure in ("psnr", "step", "ssim"):
        lines += [f"## {case.model} at {case.size} px, {TITLES[measure]} on each proxy", "",
                  f"Median over each proxy's {per_model[0]['none'].draws} images (their range), and the median "
                  f"of the {len(labels)} proxies' medians.", ""]
        lines += per_model_table(labels, per_model, entries, measure) + [""]
    lines += [f"## {case.model} at {case.size} px: orderings that hold on every proxy ({', '.join(labels)})", "",
              "A is closer to the unmerged run than B on every proxy (strictly, by the proxy's median); every "
              "other pair is ordered differently on some proxy, or tied.", ""]
    names = [e.name for e in entries if e.method != "none"]
    by_name = {e.name: e for e in entries}
    for measure in ("psnr", "step"):
        lines += orderings_lines(orderings(per_model, names, measure), by_name, len(labels)) + [""]
    return lines[:-1]


def at_size(pipe: Pipeline, size: int) -> Pipeline:
    """``pipe`` conditioned for ``size`` × ``size`` px where its conditioning says a size (SDXL's vector
    conditioning, as the webui sets it per generation), through ``checkpoint.at_size`` where this build has it."""
    from . import checkpoint

    resize = getattr(checkpoint, "at_size", None)
    return pipe if resize is None or pipe.y is None else resize(pipe, size, size)


def _per_size(path: str, size: int, count: int) -> str:
    if count == 1:
        return path
    root, ext = os.path.splitext(path)
    return f"{root}-{size}px{ext or '.png'}"


def run_architectures(args: argparse.Namespace, device: torch.device, dtype: torch.dtype, command: str,
                      cap: float) -> int:
    """The webui's architectures with random weights: speed only."""
    if args.sizes is None:
        args.sizes = [512, 768] if device.type == "cpu" else [512, 768, 1024]
    names = jobs.contender_names(not args.no_tomesd, not args.no_ideal, args.size_weighted, args.methods)
    print(f"# ToMe benchmark: {hardware(device)}, {dtype_name(dtype)}, batch {args.batch}, SDP attention, "
          f"width {args.width:g}, use_rand={not args.no_rand}, levels {args.max_downsample or 'auto'}"
          f"{stack_levels_note(args)}, methods: {', '.join(names)}; random weights: speed only")
    print(command)
    _cap_lines(args, cap)
    roster = jobs.racers_for(args, 1)  # what this run races (its count for the progress bar)
    racers = len(roster)
    per_case = len(args.models) * len(args.sizes) * racers
    total = per_case * ((args.repeats + 1) * ("unet" not in args.skip)
                        + (max(args.repeats, CHEAP_ROUNDS) + 1) * ("block" not in args.skip))
    total += (CHEAP_ROUNDS + 1) * (1 + ("tomesd" in names)) * ("overhead" not in args.skip)
    setup = Setup(device, dtype, progress_bar(total, not args.quiet))
    block_cases = jobs.bench_block(args, setup) if "block" not in args.skip else []
    unet_cases = jobs.bench_unet(args, setup) if "unet" not in args.skip else []
    overhead = None
    if "overhead" not in args.skip:
        setup.progress.set_postfix_str("merge overhead")
        watch = CpuWatch()
        overhead = merge_overhead(device, dtype, CHEAP_ROUNDS, with_tomesd="tomesd" in names,
                                  on_call=lambda name: setup.progress.update())
        setup.loads.append(("merge overhead", watch.others()))
    setup.progress.close()
    timings = []
    if block_cases:
        print("\n" + table(block_cases, "One highest-resolution transformer", RANDOM_NOTE))
        timings += case_timings(block_cases, "block")
    if unet_cases:
        print("\n" + table(unet_cases, "Whole U-Net step", RANDOM_NOTE))
        timings += case_timings(unet_cases, "U-Net")
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
    busy = finish(args, timings, setup.load(), bool(unet_cases))
    chart_cases = unet_cases or block_cases
    if args.plot and chart_cases:
        from .chart import write_speed_chart

        what = "U-Net step" if unet_cases else "one top transformer"
        title = (f"{what} speed-up over no merging: {dtype_name(dtype)}, SDP attention, batch {args.batch}, "
                 f"width {args.width:g}; bars: median, whiskers: spread\n{hardware(device)}")
        write_speed_chart(chart_cases, args.plot, title, busy)
        print(f"\nchart written to {args.plot}")
    return 0


def stack_levels_note(args: argparse.Namespace) -> str:
    """" (Stack: levels 4)" when Stack runs at other levels than the other methods, else ""."""
    levels = getattr(args, "stack_max_downsample", None)
    return f" (Stack: levels {levels})" if levels else ""


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
