"""The merge's own cost, outside any model: time and peak memory of finding a merge, merging and unmerging.

This is where a method's share of the ideal's gain goes: the ideal skips exactly these steps.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from typing import Callable

import torch

import tome_core
from tome_core.partition import fixed_partition

from .contenders import tomesd_available
from .timing import Spread, interleaved_rounds, spreads, time_call


def merge_overhead(device: torch.device, dtype: torch.dtype, rounds: int, tokens_side: int = 64,
                   channels: int = 320, ratio: float = 0.5, batch: int = 2,
                   with_tomesd: bool = True, on_call: Callable[[str], None] | None = None) -> dict[str, Spread]:
    """Milliseconds of finding the merge, merging and unmerging one (B, N, C) tensor, N = tokens_side²: ours
    and (when installed) tomesd, in interleaved rounds; in float32 their outputs are checked equal first (in
    half precision the two round the similarities differently, so near-ties may merge differently)."""
    h = w = tokens_side
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, h * w, channels, generator=gen).to(device, dtype)
    r = int(h * w * ratio)

    def ours() -> torch.Tensor:
        src, dst = fixed_partition(h, w, 2, 2, x.device, torch.int64)
        plan = tome_core.plan_merge(x, src, dst, r)
        return plan.unmerge(plan.merge(x))

    calls = {"ours": ours}
    if with_tomesd and tomesd_available():
        import tomesd.merge

        def theirs() -> torch.Tensor:
            m, u = tomesd.merge.bipartite_soft_matching_random2d(x, w, h, 2, 2, r, no_rand=True)
            return u(m(x))

        if dtype == torch.float32:
            with torch.no_grad():
                torch.testing.assert_close(ours(), theirs(), rtol=1e-4, atol=1e-4)
        calls["tomesd"] = theirs

    def time_one(name: str) -> float:
        with torch.no_grad():
            return time_call(calls[name], device)

    return spreads(interleaved_rounds(list(calls), time_one, rounds, on_call=on_call))


def _status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak_rss() -> int:
    """Current resident bytes, after resetting the kernel's peak counter (Linux) so that import-time peaks
    do not hide what the measured code needs."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return (_status_kb("VmRSS") or 0) * 1024


def _peak_rss() -> int:
    hwm = _status_kb("VmHWM")
    return hwm * 1024 if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peak_memory_child(which: str, side: int, channels: int, batch: int, dtype: str, device: str) -> None:
    """Run one find + merge + unmerge of (batch, side², channels) and print, as JSON, the peak memory it needed
    above its inputs (bytes). Runs in a fresh process so that nothing before it counts."""
    dev = torch.device(device)
    dt = getattr(torch, dtype)
    x = torch.randn(batch, side * side, channels, device=dev, dtype=dt)
    r = side * side // 2
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
    else:
        start = _reset_peak_rss()
    with torch.no_grad():
        if which == "ours":
            src, dst = fixed_partition(side, side, 2, 2, dev, torch.int64)
            plan = tome_core.plan_merge(x, src, dst, r)
            y = plan.unmerge(plan.merge(x))
        else:
            import tomesd.merge

            m, u = tomesd.merge.bipartite_soft_matching_random2d(x, side, side, 2, 2, r, no_rand=True)
            y = u(m(x))
    if dev.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - start
    else:
        peak = _peak_rss() - start
    del y
    print(json.dumps({"peak": peak}))


def peak_memory(which: str, size_px: int, channels: int, batch: int, dtype: torch.dtype,
                device: torch.device) -> int | None:
    """Bytes ``peak_memory_child`` reports for one top block of a ``size_px`` image; None if it failed."""
    side = size_px // 8
    cmd = [sys.executable, "-m", "tome_core.bench", "--_peak-child", which, str(side), str(channels), str(batch),
           str(dtype).replace("torch.", ""), str(device)]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])["peak"]
