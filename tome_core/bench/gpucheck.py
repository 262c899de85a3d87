"""One-call GPU check: ``python -m tome_core.gpucheck`` (about a minute on an H200; the timing is bounded by
``--budget``).

fp16 with SDP attention: SD 1.5 at 512, 1024 and 2048 px and SDXL at 1024 and 2048 px (batch 2, and SDXL at
1024 px at batch 8 too), whole U-Net step, no merging, ToMe, ToDo (factor 2), Local, Stack, tomesd (when
installed) and the ideals in interleaved rounds at ratio 0.5, with each one's defaults except that tomesd is
given the SDXL level ours picks and Stack runs at levels 4 on SDXL (with its ideal); on CUDA, each one's GPU
busy time per call beside its wall time; then the int32 index path against the int64 path on the same device, a
check that a patched U-Net call makes no host-device sync, and speed with fidelity (PSNR, SSIM after
``--steps`` Euler steps) of every method on the shipped proxy. Prints markdown. Each case gets an equal share
of ``--budget`` seconds of timing: it runs at least 3 rounds, and no new round once its share is spent, so the
whole check stays bounded.

``--device cpu --width 0.1 --scale 0.125`` runs the same script small (still fp16), to check it works without a
GPU.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
import warnings

import torch

import tome_core

from . import archs, runtime
from .archs import top_grid
from .arguments import OneLineParser, UsageError
from .contenders import Wrapped, roster
from .jobs import Setup, bench_pipeline, contender_names, dtype_name, entries, hardware, race, roster_size
from .loading import default_sizes, load_proxy_pipeline, pick_device
from .report import Case, case_lines, case_timings, find_busy, table, table_head
from .runs import RANDOM_NOTE, fidelity_note, load_line
from .timing import Spread, device_busy_ms, progress_bar

PROG = "python -m tome_core.gpucheck"
BATCH = 2  # a prompt and its negative, as a webui's CFG step
# (model, px, batch). A fast GPU at batch 2 can wait on the host that queues its kernels; SDXL 1024 px at a
# larger batch shows what it gains once there is enough work per kernel.
CASES = (("sd15", 512, BATCH), ("sd15", 1024, BATCH), ("sd15", 2048, BATCH), ("sdxl", 1024, BATCH),
         ("sdxl", 1024, 8), ("sdxl", 2048, BATCH))
# Stack's levels per model: SDXL's first attention level holds 17% of its work, the second 63%.
STACK_LEVELS = {"sdxl": 4}
RATIO = 0.5
TODO_FACTOR = 2
# The fidelity section on the shipped proxy: ToMe and tomesd at these ratios, ToDo at these factors.
PROXY_RATIOS = (0.25, 0.5, 0.75)
PROXY_TODO_FACTORS = (2, 3, 4)


def same_plans(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the int32 and int64 paths build exactly the same merge plan for one random 64×64 grid."""
    from tome_core.partition import cell_choices, host_key, partition, timestep_words

    x = torch.randn(2, 64 * 64, 320, generator=torch.Generator().manual_seed(0)).to(device, dtype)
    choice = cell_choices(host_key(1, 0), timestep_words(torch.tensor([749.25]), device), 32 * 32, 4)
    plans = {}
    for idt in (torch.int64, torch.int32):
        src, dst = partition(64, 64, 2, 2, choice, idt)
        plans[idt] = tome_core.plan_merge(x, src, dst, 2048)
    a, b = plans[torch.int64], plans[torch.int32]
    return torch.equal(a.slot_index, b.slot_index.long()) and torch.equal(a.counts, b.counts)


def count_syncs(unet, x, t, ctx) -> int:
    """Host-device syncs in one U-Net call (after a warm-up), counted through CUDA's sync debug mode.

    Counted rather than raised on: ldm itself syncs (its timestep embedding copies a host tensor to the
    device), and the first sync would hide any later one.
    """
    with torch.no_grad():
        unet(x, t, context=ctx)  # warm-up: grid layouts are built and cached on first use
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                unet(x, t, context=ctx)
            finally:
                torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message) for w in caught)


def sync_check(unet, x, t, ctx) -> str:
    """Syncs of one unpatched and one patched U-Net call: the patch should add none."""
    unpatched = count_syncs(unet, x, t, ctx)
    tome_core.apply_patch(unet, ratio=0.5, seed=1)
    try:
        patched = count_syncs(unet, x, t, ctx)
    finally:
        tome_core.remove_patch(unet)
    added = patched - unpatched
    return f"{unpatched} unpatched (ldm's own), {patched} patched: {'none' if added <= 0 else added} added by the patch"


def busy_table_head() -> list[str]:
    return ["## GPU busy time", "",
            "Per U-Net call: the wall time (the table above's median) beside the GPU's busy time, the summed "
            "durations of the kernels and copies it ran (torch.profiler, 3 calls after a warm-up); busy = busy / "
            "wall. Well under 100%, the GPU waits on the host that queues its work: there a method gains by "
            "dispatching fewer operations, and less by removing multiply-adds.", "",
            "| model | px | method | setting | wall ms | GPU busy ms | busy |", "|---|--:|---|--:|--:|--:|--:|"]


def busy_table_lines(case: Case, racers: list, model, call, device: torch.device) -> list[str]:
    """One line per contender of ``case``: its wall ms beside the GPU's busy ms per call (``device_busy_ms``),
    each patched as in the race. A profiler that fails is one line saying so, not the end of the check."""
    lines = []
    for racer in racers:
        wall: Spread | None = case.ms.get(racer.name)
        racer.apply(model)
        try:
            busy = device_busy_ms(call, device)
        except Exception as error:  # noqa: BLE001 (a profiler fault must not cost the rest of the check)
            return lines + [f"| {case.model} | {case.size} | {racer.method} | {racer.setting} | – | not measured: "
                            f"{type(error).__name__}: {error} | – |"]
        finally:
            racer.remove(model)
        wall_cell = "–" if wall is None else f"{wall.median:.1f}"
        busy_cell = "–" if busy is None else f"{busy:.1f}"
        share = "–" if busy is None or wall is None else f"{busy / wall.median:.0%}"
        lines.append(f"| {case.model} | {case.size} | {racer.method} | {racer.setting} | {wall_cell} | {busy_cell} "
                     f"| {share} |")
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The GPU check's command line parsed; exits on --help or a malformed argument (one line, status 2)."""
    ap = OneLineParser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="default cuda; cpu runs the check small, for testing")
    ap.add_argument("--width", type=float, default=1.0, help="scale every channel count (for small runs)")
    # A fast GPU's step takes 20-50 ms and waits on the host, so its rounds vary; many rounds are cheap there.
    ap.add_argument("--repeats", type=int, default=40, help="most interleaved rounds per case (default 40)")
    ap.add_argument("--budget", type=float, default=240.0,
                    help="seconds of timing for all cases together, shared equally (default 240); each case "
                         "still runs at least 3 rounds")
    ap.add_argument("--scale", type=float, default=1.0, help="scale every image size (for small runs)")
    ap.add_argument("--steps", type=int, default=20,
                    help="Euler steps of the fidelity run on the shipped proxy (default 20; 0 skips it)")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    return ap.parse_args(argv)


def check_args(args: argparse.Namespace) -> list[tuple[str, int, int]]:
    """The cases (model, px, batch) at ``--scale``; ``UsageError`` for the first bad argument."""
    if args.repeats < 1:
        raise UsageError(f"--repeats {args.repeats}: at least 1 round is needed")
    if not args.budget > 0:
        raise UsageError(f"--budget {args.budget:g}: must be a positive number of seconds")
    if not args.width > 0:
        raise UsageError(f"--width {args.width:g}: a channel scale must be a positive number")
    if not args.scale > 0:
        raise UsageError(f"--scale {args.scale:g}: must be a positive number")
    if args.steps < 0:
        raise UsageError(f"--steps {args.steps}: must be 0 (skip the fidelity run) or more")
    cases = [(arch, int(size * args.scale) // 8 * 8, batch) for arch, size, batch in CASES]
    for arch, size, _ in cases:
        if top_grid(size, archs.top_attention_level(arch)) < 2:
            raise UsageError(f"--scale {args.scale:g}: {arch} at {size} px is too small for one 2×2 stride cell")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        why = "has no CUDA support" if torch.version.cuda is None else "finds no usable CUDA device"
        raise UsageError(f"the GPU check needs CUDA, and this torch {torch.__version__} {why} (--device cpu "
                         f"--width 0.1 --scale 0.125 runs it small on the CPU, for testing)")
    return cases


def main(argv: list[str] | None = None) -> int:
    """Run the GPU check on ``argv`` (default: the command line's); the exit status: 0, or 2 for a bad argument."""
    try:
        args = parse_args(argv)
    except SystemExit as done:
        return int(done.code or 0)
    try:
        cases = check_args(args)
        device = pick_device(args.device)
    except UsageError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    dtype = torch.float16  # also on the CPU, so the small run there takes the same half-precision path
    archs.use_webui_unet()
    t0 = time.time()
    names = contender_names()
    print(f"# GPU check: {hardware(device)}, {dtype_name(dtype)}, SDP attention, batch {BATCH} (SDXL also at 8), "
          f"width {args.width:g}, ToMe ratio {RATIO}, ToDo factor {TODO_FACTOR}, methods: {', '.join(names)}\n")
    racer_count = roster_size(1, 1, "tomesd" in names, "ideal" in names)
    setup = Setup(device, dtype, progress_bar(len(cases) * racer_count * (args.repeats + 1), not args.quiet))
    print(table_head("Whole U-Net step, random weights",
                     f"3 to {args.repeats}" if args.repeats > 3 else str(args.repeats), RANDOM_NOTE))
    rows = []
    budget = args.budget / len(cases)
    busy_lines: list[str] = []
    for arch in dict.fromkeys(arch for arch, _, _ in cases):
        unet, ctx_dim = archs.build_unet(arch, device, dtype, args.width)
        wrapped = Wrapped(unet)
        depth = archs.unet_depth(unet)
        for size, batch in [(s, b) for a, s, b in cases if a == arch]:
            gen = torch.Generator().manual_seed(0)
            x = torch.randn(batch, 4, size // 8, size // 8, generator=gen).to(device, dtype)
            ctx = [torch.randn(batch, 77, ctx_dim, generator=gen).to(device, dtype)] * depth
            t = torch.full((batch,), 500.0, device=device)
            label = arch if batch == BATCH else f"{arch} ×{batch}"
            racers = roster([RATIO], [TODO_FACTOR], tomesd_max_downsample=2 ** archs.top_attention_level(arch),
                            stack_max_downsample=STACK_LEVELS.get(arch))
            ops: dict = {}

            def call(unet=unet, x=x, t=t, ctx=ctx):  # the same call is timed and profiled
                return unet(x, t, context=ctx)

            ms = race(f"{label} {size} px", wrapped, call, racers, setup, args.repeats, budget, ops)
            rows.append(Case(label, size, entries(racers), ms, None, ops))
            print("\n".join(case_lines(rows[-1])), flush=True)
            if device.type == "cuda":
                busy_lines += busy_table_lines(rows[-1], racers, wrapped, call, device)
        unet = wrapped = None  # free this model before the next one is built
        gc.collect()
    setup.progress.close()
    line = load_line(setup.load())
    if line:
        print("\n" + line)
    if busy_lines:
        print("\n" + "\n".join(busy_table_head() + busy_lines))
    busy = find_busy(case_timings(rows, "U-Net"), setup.load())
    if busy:
        print("\n" + busy.line(f"more rounds and a longer budget (--repeats {2 * args.repeats} --budget "
                               f"{2 * args.budget:g}), or a GPU no other process is using"))

    whole_run(args, device, dtype)

    unet, ctx_dim = archs.build_unet("sd15", device, dtype, args.width)
    gen = torch.Generator().manual_seed(0)
    lat = int(1024 * args.scale) // 8
    x = torch.randn(2, 4, lat, lat, generator=gen).to(device, dtype)
    ctx = [torch.randn(2, 77, ctx_dim, generator=gen).to(device, dtype)]
    t = torch.full((2,), 749.25, device=device)
    outs = {}
    with torch.no_grad():
        for idt in (torch.int64, torch.int32):
            tome_core.apply_patch(unet, ratio=0.5, seed=1, index_dtype=idt)
            outs[idt] = unet(x, t, context=ctx).float()
            tome_core.remove_patch(unet)
    diff = (outs[torch.int64] - outs[torch.int32]).abs().max().item()
    relative = diff / outs[torch.int64].abs().max().clamp_min(1e-12).item()
    if diff == 0:
        verdict = "bitwise equal"
    elif relative < 1e-2:
        verdict = ("equal up to half-precision rounding: index_add_ rounds differently with int32 and int64 "
                   "indices on this device")
    else:
        verdict = "DIFFERENT beyond rounding"
    plans_equal = same_plans(device, dtype)
    print(f"\nint32 vs int64 index path: merge plans (partition, matching, slot maps) "
          f"{'identical' if plans_equal else 'DIFFERENT'}; SD 1.5 U-Net output at {lat * 8} px: max |difference| "
          f"= {diff:.3g}, {relative:.2g} of the largest output ({verdict})")
    if device.type == "cuda":
        print(f"\nhost-device syncs in one U-Net call: {sync_check(unet, x, t, ctx)}")
    unet = None
    gc.collect()
    if args.steps:
        proxy_fidelity(args, device, dtype)
    print(f"\n_total {time.time() - t0:.0f} s_")
    return 0


def whole_run(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> None:
    """Cache over whole 20- and 30-step runs on SDXL at 1024 px (batch 2): its full and reused calls counted and
    timed (``runtime``), beside ToDo and Stack."""
    size = int(1024 * args.scale) // 8 * 8
    try:
        per_call = runtime.measure("sdxl", size, BATCH, 5, args.width, device=device, dtype=dtype)
    except Exception as error:  # one table line, not the end of the check
        print(f"\nCache over a whole run: not measured ({type(error).__name__}: {error})")
        return
    print("\n" + runtime.table("sdxl", size, BATCH, per_call, [20, 30]))


def proxy_fidelity(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> None:
    """Speed and fidelity of every method on the shipped proxy at its evaluation size: the trained model's
    counterpart of the random-weight table above (a few seconds on a GPU)."""
    try:
        pipe = load_proxy_pipeline(device, dtype)
    except UsageError as error:
        print(f"\nfidelity: no figure, the proxy did not load: {error}")
        return
    if pipe is None:
        print("\nfidelity: the shipped proxy model is not in this build, so no fidelity figure")
        return
    size = default_sizes(pipe)[0]
    run = argparse.Namespace(ratios=list(PROXY_RATIOS), todo_factors=list(PROXY_TODO_FACTORS), no_rand=False,
                             seed=0, max_downsample=None, no_tomesd=False, no_ideal=False, fidelity=True,
                             steps=args.steps, images=4 if device.type == "cuda" else 1, batch=2,
                             repeats=min(args.repeats, 10))  # the small CPU run checks the script, with 1 image
    names = contender_names()
    racers = roster_size(len(PROXY_RATIOS), len(PROXY_TODO_FACTORS), "tomesd" in names, "ideal" in names)
    setup = Setup(device, dtype, progress_bar(racers * (run.repeats + 2), not args.quiet))
    case, pictures = bench_pipeline(run, setup, pipe, size)
    setup.progress.close()
    print("\n" + table([case], f"{pipe.label}: speed and fidelity at {size} px", fidelity_note(pictures.on_tensors,
                                                                                               run)))
    busy = find_busy(case_timings([case], "U-Net"), setup.load())
    if busy:
        print("\n" + busy.line("more rounds (--repeats), or a GPU no other process is using"))
