"""The benchmark's arguments: the parser (``python -m tome_core.bench --help``), their validation and the
defaults that depend on the kind of run, and the one-line refusal of a bad one (``UsageError``, exit status 2).

Checked here is what the arguments alone decide; what depends on the model (the sizes a trained model takes) is
checked once it is loaded (``loading``).
"""

from __future__ import annotations

import argparse
import math
import os

from tome_core.options import MAX_CACHE_INTERVAL, MAX_RATIO, MAX_TODO_FACTOR

from . import archs
from .archs import top_grid
from .diffusers_folder import INDEX, is_diffusers_folder
from .jobs import CHEAP_ROUNDS, STRIDE
from .sampling import DEFAULT_CFG, SAMPLERS

PROG = "python -m tome_core.bench"
DESCRIPTION = "What token merging gains on this machine, and what it costs the picture."
METHOD_NAMES = ("ToMe", "ToDo", "Local", "Stack", "tomesd")
DEFAULT_SHEET = "tome-fidelity.png"
# Images per proxy in the default run: three proxies, two passes of 20 guided steps per contender (3, not 4 as
# before the prompted proxies, whose guidance doubles each call's batch: the main job stays within 20 minutes).
PROXY_IMAGES = 3


class UsageError(Exception):
    """A bad argument: reported as one line, exit status 2."""


class OneLineParser(argparse.ArgumentParser):
    """argparse, but its errors are one line (no usage block) with exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The parsed command line (``sys.argv[1:]`` when None); exits, as argparse does, on --help or a malformed
    argument (one line, status 2)."""
    return build_parser().parse_args(argv)


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's parser: every option, with its help and its default."""
    ap = OneLineParser(prog=PROG, description=DESCRIPTION)
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
    ap.add_argument("--unprompted", action="store_true",
                    help="race the shipped photograph-trained proxies instead of the prompted ones: no prompt, no "
                         "guidance, and deeper levels they barely use (docs/proxy.md)")
    ap.add_argument("--layouts", "--layout", dest="layouts", nargs="+", default=["sd15"], choices=["sd15", "sdxl"],
                    help="the shipped prompted proxies to race, by layout (default sd15: the three SD 1.5-layout ones; "
                         "'sd15 sdxl' adds the three SDXL-layout ones, each layout raced apart, which more than "
                         "triples the run's time; --layout is the same option, as the samplers room and the proxy "
                         "trainer spell it)")
    ap.add_argument("--sdxl-figure", action=argparse.BooleanOptionalAction, default=True,
                    help="end a run on the shipped SD 1.5-layout proxies with SDXL's settings (Cache, ToDo f=2 "
                         "levels 4) on the seed-0 SDXL-layout proxy: closeness, its levels skipped, multiply-adds "
                         "(default: on; a few minutes)")
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
    ap.add_argument("--steps", type=int, default=20, help="sampler steps of the fidelity run (default 20)")
    ap.add_argument("--sampler", default="euler", choices=list(SAMPLERS),
                    help="the fidelity run's sampler: euler, euler_a (ancestral: fresh noise at every step) or "
                         "dpmpp_2m (default euler; the one-step figure is measured with euler only)")
    ap.add_argument("--cfg", type=float, default=DEFAULT_CFG,
                    help=f"classifier-free guidance scale of the fidelity run on a prompted proxy, whose images are "
                         f"asked for by the benchmark's prompts (default {DEFAULT_CFG:g}); a model without prompts "
                         f"samples with its empty prompt, unguided")
    ap.add_argument("--apart", action="store_true",
                    help="guided runs evaluate cond and uncond in two U-Net calls a step, as a low-memory host "
                         "does (default: in one batch, as the webui does)")
    ap.add_argument("--cache-intervals", nargs="+", type=int, default=None, metavar="N",
                    help="also race Cache with full steps at most N steps apart (its other settings at their "
                         "defaults); its speed over a whole run: python -m tome_core.bench.runtime")
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
    ap.add_argument("--no-tomesd", action="store_true",
                    help="leave tomesd out even when installed (with --models; on a trained model it is left out "
                         "unless --tomesd)")
    ap.add_argument("--tomesd", action="store_true",
                    help="on a trained model, also race the tomesd package when installed: an oracle whose pictures "
                         "the ToMe rows (the paper's, size-weighted keys off) give too, so the main job leaves it "
                         "out, saving a fifth of its time")
    ap.add_argument("--no-ideal", action="store_true", help="leave the ideal out")
    ap.add_argument("--plot", default=None,
                    help="write a PNG chart here: speed-up against PSNR per method and setting (speed-ups alone "
                         "with --models)")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    ap.add_argument("--_peak-child", nargs=6, help=argparse.SUPPRESS)
    return ap


def check_output(flag: str, path: str, what: str, needs: str, pip: str) -> None:
    """``UsageError`` unless ``path`` (given with ``flag``) can be written and ``needs``, the module that writes
    ``what``, imports; ``pip`` is what the refusal says to install."""
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
    for interval in args.cache_intervals or ():
        if not 1 <= interval <= MAX_CACHE_INTERVAL:
            raise UsageError(f"--cache-intervals {interval}: each must be 1 to {MAX_CACHE_INTERVAL}")
    if args.tomesd and args.no_tomesd:
        raise UsageError("--tomesd and --no-tomesd: give one (--tomesd races the tomesd package, --no-tomesd "
                         "leaves it out)")
    if trained and not args.tomesd:
        args.no_tomesd = True
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
        check_output("--plot", args.plot, "the chart", "matplotlib", "matplotlib")
    if not (trained and args.fidelity):
        args.sheet = ""  # no pictures to show
    if args.sheet:
        check_output("--sheet", args.sheet, "the side-by-side image", "PIL", "pillow")
    if args.checkpoint is not None:
        if os.path.isdir(args.checkpoint):
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
    """``UsageError`` when ``size`` px leaves ``model``'s attention at ``level`` less than one stride cell."""
    grid = top_grid(size, level)
    if grid < STRIDE:
        smallest = next(s for s in range(8, 1024, 8) if top_grid(s, level) >= STRIDE)
        raise UsageError(f"--sizes {size}: too small for {model}: its highest-resolution attention sees a "
                         f"{grid}×{grid} token grid, smaller than one {STRIDE}×{STRIDE} stride cell (at least "
                         f"{smallest} px)")
