"""What the benchmark runs on, loaded and checked: the device, and the trained models (a checkpoint, a
diffusers folder, the shipped proxies or ``--proxy`` files), each checked against the sizes asked for before
anything is timed. Every file that cannot be used is refused in one line (``UsageError``, ``CheckpointError``).
"""

from __future__ import annotations

import argparse
import os

import torch

from tome_core.patch import transformer_levels

from . import checkpoint, diffusers_folder
from .arguments import UsageError
from .jobs import STRIDE
from .metrics import WINDOW
from .pipeline import Pipeline


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
    """The first line of ``error``'s message, or its type's name when it has none: what a refusal quotes."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


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


def trained_groups(args: argparse.Namespace, device: torch.device, dtype: torch.dtype
                   ) -> list[list[tuple[str, Pipeline]]] | None:
    """The trained models to measure (``load_trained``), grouped by layout (``layout_groups``), each checked
    against the sizes it is run at (``--sizes``, else its group's own); None when this build has no proxy.
    Raises ``CheckpointError`` or ``UsageError`` (one line) for a model that cannot be used."""
    pipes = load_trained(args, device, dtype)
    if pipes is None:
        return None
    # Proxies of several layouts (the shipped SD 1.5 and SDXL ones) are raced a layout at a time, each at its
    # own evaluation size unless --sizes says otherwise.
    groups = list(layout_groups(pipes).values())
    for group in groups:
        for _, pipe in group:
            check_pipeline_sizes(pipe, args.sizes or default_sizes(group[0][1]), args.max_downsample, args.fidelity)
    return groups


def load_trained(args: argparse.Namespace, device: torch.device, dtype: torch.dtype
                 ) -> list[tuple[str, Pipeline]] | None:
    """The models to measure, each with what the tables call it: the checkpoint's pipeline, or the proxies
    (``--proxy``'s, else the shipped ones); None when this build has no proxy. Raises ``CheckpointError`` or
    ``UsageError`` (one line) for a file that cannot be used."""
    if args.checkpoint is not None:
        if diffusers_folder.is_diffusers_folder(args.checkpoint):
            pipe = diffusers_folder.load_pipeline(args.checkpoint, device, dtype, prediction=args.prediction)
        else:
            pipe = checkpoint.load_pipeline(args.checkpoint, device, dtype, prediction=args.prediction)
        return [(pipe.label, pipe)]
    return load_proxies(device, dtype, args.proxy, tuple(getattr(args, "layouts", None) or ("sd15", "sdxl")),
                        prompted=not getattr(args, "unprompted", False))


def load_proxies(device: torch.device, dtype: torch.dtype, paths: list[str] | None = None,
                 layouts: tuple[str, ...] = ("sd15", "sdxl"), prompted: bool = True) -> list[tuple[str, Pipeline]] | None:
    """Each proxy of ``paths`` (default: every shipped one of ``layouts``, the prompted ones unless ``prompted``
    is False) with its label ("seed 1"); None when this build has no proxy; ``UsageError`` (one line) for weights
    that are missing or do not fit."""
    try:  # at call time: a build may leave the proxy out, and tests put a stand-in in its place
        from . import proxy
    except ImportError:
        return None
    missing: list[str] = []
    if paths is None:
        finder = getattr(proxy, "shipped_weights", None)
        paths, missing = finder(layouts, prompted=prompted) if finder is not None else ([None], [])
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
    try:  # at call time: a build may leave the proxy out, and tests put a stand-in in its place
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
    """Whether ``path`` is one of ``proxy``'s shipped weight files: the proxy's own ``is_shipped``, or for a
    stand-in the files it names (it may name none)."""
    if hasattr(proxy, "is_shipped"):
        return proxy.is_shipped(path)
    return os.path.abspath(path) in {os.path.abspath(p) for p in getattr(proxy, "SHIPPED_WEIGHTS", ())}


def layout_groups(pipes: list[tuple[str, Pipeline]]) -> dict[str, list[tuple[str, Pipeline]]]:
    """``pipes`` grouped by what they are (the pipeline's label and evaluation size), in the order given."""
    groups: dict[str, list[tuple[str, Pipeline]]] = {}
    for label, pipe in pipes:
        groups.setdefault(f"{pipe.label} {getattr(pipe, 'size', None)}", []).append((label, pipe))
    return groups


def at_size(pipe: Pipeline, size: int) -> Pipeline:
    """``pipe`` conditioned for ``size`` × ``size`` px where its conditioning says a size (SDXL's vector
    conditioning, as the webui sets it per generation), through ``checkpoint.at_size``."""
    return pipe if pipe.y is None else checkpoint.at_size(pipe, size, size)
