"""Timing in interleaved rounds, so that a burst of load on a busy machine is seen, not blamed on one contender.

Each round calls every contender once, in an order that rotates from round to round; a contender's figure is
its median over the rounds and its spread the interquartile range. Timing each contender in one stretch
instead would let a burst of other work land on whichever ran then, and show as a clean, wrong speed-up.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn

from .contenders import Contender


@dataclass(frozen=True)
class Spread:
    """Milliseconds of one contender over the rounds: median, quartiles, extremes."""

    median: float
    q1: float
    q3: float
    low: float
    high: float
    rounds: int

    @classmethod
    def of(cls, samples: Sequence[float]) -> Spread:
        if not samples:
            raise ValueError("no samples")
        ordered = sorted(samples)
        if len(ordered) == 1:
            q1 = q3 = ordered[0]
        else:
            q1, _, q3 = statistics.quantiles(ordered, n=4, method="inclusive")
        return cls(statistics.median(ordered), q1, q3, ordered[0], ordered[-1], len(ordered))

    @property
    def relative(self) -> float:
        """Interquartile range as a fraction of the median."""
        return (self.q3 - self.q1) / self.median if self.median > 0 else 0.0


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so a wall-clock interval covers what it started."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def time_call(fn: Callable[[], object], device: torch.device, clock: Callable[[], float] = time.perf_counter) -> float:
    """Milliseconds of one ``fn()`` call, device work included."""
    synchronize(device)
    t0 = clock()
    fn()
    synchronize(device)
    return (clock() - t0) * 1000


def device_busy_ms(call: Callable[[], object], device: torch.device, calls: int = 3) -> float | None:
    """Milliseconds the GPU computes per ``call()``: the summed durations of the kernels and copies it ran,
    recorded by torch.profiler, without the gaps in which it waits for the host to queue more. None off CUDA,
    or when the profiler recorded no device work.

    Beside the wall time per call it says what bounds a step: a busy time well under the wall time means the
    GPU waits on the Python thread that feeds it, so fewer, larger operations (or a larger batch) gain there
    while fewer multiply-adds do not.
    """
    if device.type != "cuda":
        return None
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        call()  # outside the record: first-call allocations and caches
        synchronize(device)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as recorded:
            for _ in range(calls):
                call()
            synchronize(device)
    # Device events only: the CPU ops that launched them carry the same time again as their "device time".
    busy_us = sum(e.time_range.elapsed_us() for e in recorded.events() if e.device_type == DeviceType.CUDA)
    return busy_us / 1000 / calls if busy_us > 0 else None


def model_timer(model: nn.Module, call: Callable[[], object], contenders: Sequence[Contender],
                device: torch.device) -> Callable[[str], float]:
    """``time_one(name)``: patch ``model`` as contender ``name`` does, time one ``call()``, restore the model.
    Patching and restoring are not timed."""
    by_name = {c.name: c for c in contenders}

    def time_one(name: str) -> float:
        contender = by_name[name]
        contender.apply(model)
        try:
            with torch.no_grad():
                return time_call(call, device)
        finally:
            contender.remove(model)
    return time_one


def rotated(names: Sequence[str], round_index: int) -> list[str]:
    """The calling order of round ``round_index``: ``names`` rotated left by the round's index."""
    k = round_index % len(names)
    return list(names[k:]) + list(names[:k])


def interleaved_rounds(names: Sequence[str], time_one: Callable[[str], float], rounds: int, *, warmup: int = 1,
                       min_rounds: int = 3, budget_s: float | None = None,
                       on_call: Callable[[str], None] | None = None,
                       clock: Callable[[], float] = time.monotonic) -> dict[str, list[float]]:
    """Milliseconds per call of each contender, one call each per round, in rotating order.

    ``warmup`` untimed rounds come first (caches, allocator, lazy initialisation). With ``budget_s``, no new
    round starts once that many seconds have passed and ``min(rounds, min_rounds)`` rounds are done, which
    bounds the time a slow case takes. ``on_call(name)`` follows every call, warm-up included.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    start = clock()
    for _ in range(warmup):
        for name in names:
            time_one(name)
            if on_call:
                on_call(name)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for k in range(rounds):
        if budget_s is not None and k >= min(rounds, min_rounds) and clock() - start > budget_s:
            break
        for name in rotated(names, k):
            samples[name].append(time_one(name))
            if on_call:
                on_call(name)
    return samples


class CpuWatch:
    """How many cores other processes kept busy while a measurement ran, from the kernel's CPU counters.

    A steady load is invisible in the spread (every round is slowed alike) but still skews speed-ups: with
    fewer free cores than threads, torch's many small synchronised operations (finding a merge) slow down far
    more than its large matrix products. Linux only (``/proc/stat``); elsewhere ``others()`` is None.
    """

    def __init__(self) -> None:
        self._start = self._sample()

    @staticmethod
    def _sample() -> tuple[float, float, float] | None:
        """(busy CPU seconds of the whole machine, CPU seconds of this process, wall seconds), or None."""
        try:
            with open("/proc/stat") as stat:
                fields = [int(v) for v in stat.readline().split()[1:9]]
        except (OSError, ValueError):
            return None
        user, nice, system, _idle, _iowait, irq, softirq, steal = fields
        # steal: time the hypervisor gave this machine's CPUs to other guests, i.e. other work as well
        busy = (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
        own = os.times()
        return busy, own.user + own.system, time.monotonic()

    def others(self, shortest_s: float = 1.0) -> float | None:
        """Average cores used by other processes since this watch started; None if it has run for less than
        ``shortest_s`` (the counters tick in hundredths of a second)."""
        end = self._sample()
        if self._start is None or end is None or end[2] - self._start[2] < shortest_s:
            return None
        busy, own, wall = (e - s for e, s in zip(end, self._start))
        return max(0.0, (busy - own) / wall)


def spreads(samples: dict[str, list[float]]) -> dict[str, Spread]:
    return {name: Spread.of(ms) for name, ms in samples.items()}


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(total: int, enabled: bool = True, label: str = "timing"):
    """A tqdm bar on stderr counting calls; without tqdm installed (or when not ``enabled``), none."""
    if not enabled:
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, desc=label, unit="call", file=sys.stderr, dynamic_ncols=True, leave=False)
