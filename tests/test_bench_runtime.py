"""The whole-run speed room (``tome_core.bench.runtime``): Cache's calls counted by kind from a real run, and each
kind timed and counted on a small U-Net."""

from __future__ import annotations

import pytest

from tome_core.bench import runtime
from tome_core.methods import cache as cache_method


# Full steps by the schedule's rule: the warm-up (the first step at least), then gaps of 2, 4, 6 ... steps, at most
# the longest gap.
@pytest.mark.parametrize("steps, warmup, interval, full", [(20, 2, 8, [0, 1, 3, 7, 13]),
                                                           (30, 2, 8, [0, 1, 3, 7, 13, 21, 29]),
                                                           (20, 0, 4, [0, 2, 6, 10, 14, 18]),
                                                           (7, 3, 2, [0, 1, 2, 4, 6])])
def test_calls_are_counted_by_kind_as_the_schedule_says(steps, warmup, interval, full):
    got = runtime.call_counts(steps, {"method": "cache", "cache_warmup": warmup, "cache_interval": interval})
    assert got == (len(full), steps - len(full))

pytestmark = pytest.mark.usefixtures("webui_unet_for_this_test_only")


def test_each_kind_of_call_is_timed_and_a_reused_call_does_less_work(monkeypatch):
    fits = []
    fit = cache_method.fitted_gain
    monkeypatch.setattr(cache_method, "fitted_gain", lambda *a: fits.append(1) or fit(*a))
    per_call = runtime.measure("sd15", 128, 1, 2, width=0.1)
    # The timed full call is one that fits the gain (a run's full calls after its first do): in each of the
    # warm-up, 2 timed and multiply-add rounds, once per selected stack (SD 1.x "auto": the 11 stacks at
    # downsampling 2 and 4 and the middle block).
    assert len(fits) == 4 * 11
    assert set(per_call) == {"none", "Cache full", "Cache reused", *runtime.OTHERS}
    assert all(len(seconds) == 2 and min(seconds) > 0 and macs > 0 for seconds, macs in per_call.values())
    assert per_call["Cache reused"][1] < 0.9 * per_call["Cache full"][1]
    assert per_call["Cache full"][1] == per_call["none"][1]  # a full call computes what no patch does
    lines = runtime.table("sd15", 128, 1, per_call, [20]).splitlines()
    cache = next(line for line in lines if "| Cache |" in line)
    assert "| 5 + 15 |" in cache


def test_the_speed_up_is_the_median_of_each_rounds_and_says_their_range():
    """Made-up call times of three rounds (one slow round for every kind, as a busy machine gives): each round's
    runs are compared with each other, so the slow round's speed-up is like the others'."""
    per_call = {"none": ([1.0, 2.0, 1.0], 100), "Cache full": ([1.0, 2.0, 1.0], 100),
                "Cache reused": ([0.2, 0.4, 0.25], 40)}
    lines = runtime.table("sd15", 128, 1, per_call, [20]).splitlines()
    cache = next(line for line in lines if "| Cache |" in line)
    # 5 full + 15 reused: runs 5+3=8, 10+6=16, 5+3.75=8.75 s (median 8.75); speed-ups 20/8=2.50, 40/16=2.50, 20/8.75=2.29
    assert cache == "| 20 | Cache | 5 + 15 | 8.8 | 2.50x (2.29–2.50) | 0.55 |"
    assert "| 20 | none | 20 | 20.0 | 1.00x | 1.00 |" in lines
