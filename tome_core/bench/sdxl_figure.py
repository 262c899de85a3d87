"""The main job's SDXL figure: SDXL's own settings on an SDXL-layout proxy, since SDXL is where most users are.

``python -m tome_core.bench`` measures the SD 1.5-layout proxies; racing every method on the SDXL-layout ones
takes over an hour (``--layouts sd15 sdxl``). This room is the short part it ends with: on one SDXL-layout proxy
(the shipped prompted seed 0; the photograph-trained seed 0 in a run of the photograph-trained proxies, or
where the prompted one is missing) at its evaluation size, with guidance as users
sample where the proxy has prompts, the settings the README gives SDXL (Cache at its defaults; ToDo factor 2 at
Merge levels 4 where Cache cannot run), each sampled once and set beside the unmerged run:

- final PSNR against the unmerged pictures (median and range over the images);
- the same with the levels the setting acts on skipped (their transformers return their input): how far the
  pictures go without those levels' work, so the setting's figure reads as how much of it it keeps;
- the whole run's multiply-adds against the unmerged run's, every U-Net call counted (Cache's full and
  reused calls differ, so one call's count would not say it): a figure no busy machine moves, where one
  run's wall time beside another's would be mostly the machine's.

    python -m tome_core.bench.sdxl_figure                   # alone: the shipped prompted seed-0 SDXL-layout proxy
    python -m tome_core.bench.sdxl_figure --unprompted      # the photograph-trained seed-0 one, no guidance
    python -m tome_core.bench.sdxl_figure --proxy FILE      # another SDXL-layout proxy

The proxy's widths are not SDXL's, so its multiply-adds say what a method removes from this proxy's run;
SDXL's real layout at 1024 px is counted and timed by ``python -m tome_core.bench.runtime``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from tome_core.families import SDXL_LAYOUT, model_layout

from .arguments import UsageError
from .fidelity import noise_for
from .levels import skipped
from .loading import load_proxies
from .macs import MultiplyAddCounter
from .metrics import psnr_each
from .samplers import CONTENDERS, acted_levels, final_pictures, levels_named, median_cell
from .sampling import DEFAULT_CFG, SAMPLER_LABELS, SAMPLERS, guidance_for

# The README's settings for SDXL, in its order: Cache first, ToDo where Cache cannot run.
SDXL_SETTINGS = ("cache", "todo")


def counted_run(pipe, noise: torch.Tensor, options: dict | None, **run) -> tuple[torch.Tensor, int]:
    """``final_pictures`` of one run with ``options`` and the multiply-adds of every call in it."""
    counter = MultiplyAddCounter()
    with counter:
        pictures = final_pictures(pipe, noise, options=options, **run)
    return pictures, counter.total


def sdxl_table(label: str, pipe, steps: int = 20, sampler: str = "euler", images: int = 3, seed: int = 0,
               noise_seed: int = 7, cfg: float | None = DEFAULT_CFG, batched: bool = True) -> list[str]:
    """Markdown lines: the title, then a row per SDXL setting (``SDXL_SETTINGS``) on ``pipe``, an SDXL-layout
    proxy called ``label``: final PSNR dB, the same with its levels skipped, and the run's multiply-adds against
    the unmerged run's."""
    guidance = guidance_for(pipe, images, cfg, batched)
    noise = noise_for(pipe, pipe.size, images, seed)
    run = dict(steps=steps, sampler=sampler, noise_seed=noise_seed, guidance=guidance)
    reference, reference_macs = counted_run(pipe, noise, None, **run)
    lines = [f"{pipe.label} {label}, {pipe.size} px: SDXL's settings over a whole run of {steps} "
             f"{SAMPLER_LABELS[sampler]} steps, {guidance.label if guidance else 'no prompt, no guidance'}; final "
             f"PSNR dB against the unmerged pictures, median [range] over {images} images", "",
             "| setting | final PSNR dB | its levels skipped | multiply-adds vs none |",
             "|---|--:|--:|--:|"]
    for key in SDXL_SETTINGS:
        name, options = CONTENDERS[key]
        pictures, macs = counted_run(pipe, noise, options, **run)
        found = acted_levels(pipe, options)
        with skipped(pipe.unet, found):
            deleted = final_pictures(pipe, noise, options=None, **run)
        lines.append(f"| {name} | {median_cell(psnr_each(pictures, reference))} | "
                     f"{median_cell(psnr_each(deleted, reference))} ({levels_named(pipe, found)}) | "
                     f"{macs / reference_macs:.2f} |")
    return lines


def sdxl_figure(steps: int = 20, sampler: str = "euler", images: int = 3, seed: int = 0,
                cfg: float | None = DEFAULT_CFG, batched: bool = True, path: str | None = None,
                prompted: bool = True) -> list[str]:
    """``sdxl_table`` on the SDXL-layout proxy at ``path`` (default: the shipped prompted seed 0, else the
    photograph-trained seed 0; with ``prompted`` false, the photograph-trained seed 0 only, so that a run of the
    photograph-trained proxies ends on one of their kind), on the CPU in float32 as the proxies are measured; a
    one-line note instead where there is none to measure."""
    if path is None:
        try:  # at call time, as ``loading`` does: a build may leave the proxy out
            from . import proxy
        except ImportError:
            proxy = None
        # The prompted proxy first: users sample SDXL with a prompt and guidance, and its deep level matters.
        wanted = []
        if proxy is not None:
            first = proxy.SHIPPED_PROMPTED_SDXL_WEIGHTS[:1] if prompted else ()
            wanted = list(first) + list(proxy.SHIPPED_SDXL_WEIGHTS)
        shipped = [p for p in wanted if os.path.isfile(p)]
        if not shipped:
            how = f" ({proxy.train_command(wanted[0])} makes one)" if wanted else ""
            return [f"# note: no SDXL-layout figure: no SDXL-layout proxy here{how}"]
        path = shipped[0]
    try:
        label, pipe = load_proxies(torch.device("cpu"), torch.float32, [path])[0]
    except UsageError as error:  # weights unreadable or of no proxy's architecture: the SD part stands
        return [f"# note: no SDXL-layout figure: {error}"]
    if model_layout(pipe.unet) != SDXL_LAYOUT:
        return [f"# note: no SDXL-layout figure: {path} is a proxy of SD 1.5's layout"]
    return sdxl_table(label, pipe, steps, sampler, images, seed, cfg=cfg, batched=batched)


def main(argv: list[str] | None = None) -> int:
    from .samplers import with_threads

    ap = argparse.ArgumentParser(prog="python -m tome_core.bench.sdxl_figure", description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--sampler", choices=list(SAMPLERS), default="euler")
    ap.add_argument("--images", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cfg", type=float, default=DEFAULT_CFG)
    ap.add_argument("--apart", action="store_true", help="cond and uncond in two calls a step")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--proxy", metavar="WEIGHTS", default=None, help="an SDXL-layout proxy's weights")
    ap.add_argument("--unprompted", action="store_true",
                    help="the shipped photograph-trained seed-0 SDXL-layout proxy (no prompt, no guidance) instead "
                         "of the prompted one")
    args = ap.parse_args(argv)
    if args.proxy is not None and not os.path.isfile(args.proxy):
        ap.error(f"--proxy {args.proxy}: no such file")
    print(f"# {' '.join(['python -m tome_core.bench.sdxl_figure'] + (argv if argv is not None else sys.argv[1:]))}")
    lines = with_threads(args.threads, lambda: sdxl_figure(args.steps, args.sampler, args.images, args.seed,
                                                            args.cfg, not args.apart,
                                                            args.proxy, not args.unprompted))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
