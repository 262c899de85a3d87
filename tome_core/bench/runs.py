"""The benchmark's two kinds of run and the lines that close them: on trained models (``run_groups``,
``run_trained``: speed and fidelity, the tables across several proxies, the sheet and the chart) and on the
webui's architectures with random weights (``run_architectures``: speed only); then ``finish``, the load line
and, when the figures may be off, the warning.
"""

from __future__ import annotations

import argparse
import os

import torch

from . import jobs
from .chart import write_speed_chart, write_tradeoff_chart
from .jobs import CHEAP_ROUNDS, STRIDE, Setup, dtype_name, hardware
from .loading import at_size, default_sizes
from .pipeline import Pipeline
from .probes import merge_overhead, peak_memory
from .replicate import TITLES, across, orderings, orderings_lines, per_model_table
from .report import Case, Load, case_timings, find_busy, ms_cell, table
from .sampling import DEFAULT_CFG, SAMPLER_LABELS, guidance_for
from .sheet import write_case_sheet
from .timing import CpuWatch, progress_bar

def sampler_label(args: argparse.Namespace) -> str:
    """The fidelity run's sampler as the webui names it ("Euler", "Euler a", "DPM++ 2M")."""
    return SAMPLER_LABELS[getattr(args, "sampler", "euler")]


RANDOM_NOTE = ("Random weights: no fidelity figure (a random U-Net's pictures carry no image's redundancy and "
               "rank nothing); run without --models (the shipped proxy) or with --checkpoint for PSNR and SSIM.")


def run_groups(args: argparse.Namespace, groups: list[list[tuple[str, Pipeline]]], device: torch.device,
               dtype: torch.dtype, command: str, cap: float) -> int:
    """``run_trained`` on each group of trained models (one per layout), each at ``--sizes`` or its own
    evaluation size; the first group's sheet and chart at the paths given, the others' with their layout's
    name added ("tome-fidelity-sdxl-layout.png")."""
    status = 0
    sheet, plot, sizes_given = args.sheet, args.plot, args.sizes
    for k, group in enumerate(groups):
        if k:
            print()
        args.sizes = sizes_given or default_sizes(group[0][1])
        suffix = "" if k == 0 else "-" + group[0][1].label.split()[0].lower()
        args.sheet, args.plot = suffixed(sheet, suffix), suffixed(plot, suffix)
        status = run_trained(args, group, device, dtype, command, cap) or status
    args.sheet, args.plot = sheet, plot
    return status


def run_trained(args: argparse.Namespace, pipes: list[tuple[str, Pipeline]], device: torch.device,
                dtype: torch.dtype, command: str, cap: float) -> int:
    """Fidelity on each trained model and speed on the first, at each size; with several models, each one's
    figures, their median and the orderings that hold on every one."""
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
    cap_lines(args, cap)
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
    title = f"{pipe.label}: speed and fidelity, one U-Net call and {args.steps} {sampler_label(args)} steps"
    print("\n" + table(cases, title,
                       fidelity_note(on_tensors, args, len(pipes), pipe)))
    if len(pipes) > 1 and args.fidelity:
        for case, per_model in zip(cases, per_size):
            print("\n" + "\n".join(replicated_lines(case, labels, per_model)))
    busy = finish(args, case_timings(cases, "U-Net"), setup.load(), True)
    if args.sheet and pictures[0] is not None:
        for case, pics, per_model in zip(cases, pictures, per_size):
            path = sized_path(args.sheet, case.size, len(cases))
            what = "sampled tensors (no decoder)" if pics.on_tensors else "images"
            model = f"{pipe.label} {labels[0]}" if len(pipes) > 1 else pipe.label
            write_case_sheet(path, case, pics, f"{model}, {case.size} px, {args.steps} {sampler_label(args)} steps, "
                             f"seed {args.seed}: {what} (the first); caption: setting, speed-up; PSNR, SSIM; step dB "
                             f"(medians over its {args.images} image{'s' if args.images > 1 else ''})",
                             fidelity=per_model[0])
            print(f"side-by-side images written to {os.path.abspath(path)}")
    if args.plot:
        over = f"median of {len(pipes)} proxies, bars: their range" if len(pipes) > 1 else \
            f"median of {args.images} images, bars: their range"
        title = (f"{pipe.label}: speed-up of one U-Net call (batch {args.batch}, {dtype_name(dtype)}) against "
                 f"fidelity after {args.steps} {sampler_label(args)} steps from seed {args.seed} ({over})\n"
                 f"{hardware(device)}")
        if on_tensors is None:
            write_speed_chart(cases, args.plot, title, busy)
        else:
            write_tradeoff_chart(cases, args.plot, title, busy)
        print(f"chart written to {os.path.abspath(args.plot)}")
    return 0


def replicated_lines(case: Case, labels: list[str], per_model: list) -> list[str]:
    """Each model's figures (medians over its images, with their range) and their median, for each measure,
    and the orderings that hold on every model."""
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
    cap_lines(args, cap)
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


def cap_lines(args: argparse.Namespace, cap: float) -> None:
    """A line for each ratio above the stride's cap ``cap``, saying the cap is used instead."""
    for ratio in args.ratios:
        if ratio > cap:
            print(f"# ratio {ratio:g} is above the {STRIDE}×{STRIDE} stride's cap: every source token merges, "
                  f"so {cap:.2f} is used (the tables show the ratio used)")


def sized_path(path: str, size: int, count: int) -> str:
    """``path`` for the picture of ``size`` px, one of ``count`` sizes ("sheet.png" -> "sheet-512px.png")."""
    if count == 1:
        return path
    root, ext = os.path.splitext(path)
    return f"{root}-{size}px{ext or '.png'}"


def suffixed(path: str | None, suffix: str) -> str | None:
    """``path`` with ``suffix`` before its extension ("tome-fidelity.png" -> "tome-fidelity-sdxl.png")."""
    if not path or not suffix:
        return path
    root, ext = os.path.splitext(path)
    return f"{root}{suffix}{ext}"


def fidelity_note(pictures_on_tensors: bool | None, args: argparse.Namespace, models: int = 1,
                  pipe: Pipeline | None = None) -> str:
    """What the tables' PSNR, SSIM and step dB columns compare, over how many images and ``models`` (and, for a
    prompted ``pipe``, with what guidance); or why they are empty (``pictures_on_tensors`` None: nothing was
    sampled)."""
    if pictures_on_tensors is None:
        return "Fidelity not measured (--no-fidelity)." if args.models is None else RANDOM_NOTE
    what = ("the sampled tensors (no decoder), mapped to [0, 1] by the unmerged one's range"
            if pictures_on_tensors else "the decoded images")
    images = f"{args.images} image{'s' if args.images > 1 else ''}"
    over = (f"the median over {images} (their range)" if models == 1 else
            f"on each of {models} proxies the median over its {images}; here the median of the proxies' "
            f"medians (their range)")
    guidance = None if pipe is None else guidance_for(pipe, 1, getattr(args, "cfg", DEFAULT_CFG),
                                                      not getattr(args, "apart", False))
    guided = (f"asked for by the benchmark's prompts in turn ({guidance.label}), " if guidance is not None else
              "unguided (the model's empty prompt), ")
    return (f"PSNR, SSIM: {what} after {args.steps} {sampler_label(args)} steps from the same noise "
            f"(seed {args.seed}), {guided}"
            f"against no merging's, each image on its own; step dB: each step's prediction along the unmerged "
            f"run's own trajectory (the same input for both), −10·log10 of the noise estimate's squared error "
            f"relative to its power, each step's weighed by how far that step moves the sample; {over}. "
            f"∞ and 1.000 = identical.")


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


def steadier_hint(args: argparse.Namespace) -> str:
    """What to try for steadier timings; fewer threads only where the run did not already use one."""
    more = max(args.repeats * 2, 5)
    threads = "" if args.threads == 1 else ", fewer threads than free cores (--threads 1)"
    return f"more rounds (--repeats {more}){threads}, or a quiet machine (close other programs)"


def load_line(load: Load | None) -> str | None:
    """The "# load:" line: how busy other processes kept the cores while this run timed; None unmeasured."""
    if load is None:
        return None
    return (f"# load: other processes kept at most {load.others:.2f} of the {load.cores} cores busy while a case "
            f"was timed (during {load.label}); this run computed with {load.threads} thread"
            f"{'s' if load.threads > 1 else ''}")
