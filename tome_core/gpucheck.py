"""One-call GPU check: ``python -m tome_core.gpucheck`` (about 3 minutes on a datacenter GPU).

fp16 with SDP attention: SD 1.5 at 512, 1024 and 2048 px and SDXL at 1024 px, whole U-Net step, no ToMe vs
ours vs tomesd (when installed) at ratio 0.5 with each one's defaults except that tomesd is given the SDXL
level ours picks; then the int32 index path against the int64 path on the same device, and a check that a
patched U-Net call makes no host-device sync. Prints markdown.
``--device cpu --width 0.1 --scale 0.125`` runs the same script small (still fp16), to check it works without a
GPU.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings

import torch

import tome_core
from tome_core import bench

CASES = (("sd15", 512), ("sd15", 1024), ("sd15", 2048), ("sdxl", 1024))


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
    return f"{unpatched} unpatched (ldm's own), {patched} patched: {'none' if added == 0 else added} added by the patch"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tome_core.gpucheck")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--width", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--scale", type=float, default=1.0, help="scale every image size (for small runs)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.float16  # also on the CPU, so the small run there takes the same half-precision path
    bench.use_sdp_attention()
    t0 = time.time()
    print(f"# GPU check: {bench.hardware(device)}, {str(dtype).replace('torch.', '')}, SDP attention, batch 2, "
          f"ratio 0.5, tomesd {'yes' if bench.tomesd_available() else 'no'}\n")
    print(bench.TABLE_HEAD)
    for arch in ("sd15", "sdxl"):
        ns = argparse.Namespace(models=[arch], sizes=[int(s * args.scale) for a, s in CASES if a == arch],
                                ratios=[0.5], batch=2, max_downsample=None, no_rand=False, repeats=args.repeats,
                                width=args.width, no_tomesd=False)
        for row in bench.bench_unet(ns, device, dtype, bench.Progress(0, enabled=False)):
            print(row.line(), flush=True)
    unet, ctx_dim = bench.build_unet("sd15", device, dtype, args.width)
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
    print(f"\n_total {time.time() - t0:.0f} s_")
    return 0


if __name__ == "__main__":
    sys.exit(main())
