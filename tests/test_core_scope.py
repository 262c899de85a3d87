"""``SamplingRun`` (one sampling run's patch, for hosts that see runs begin and end), ``check_patch`` and the
settings recommended per model layout, on the real ldm U-Net classes. The evaluation sequences below are what
k-diffusion's samplers do: each step evaluates first at its own sigma and then reports the step; a second-order
step evaluates again before the next step begins (Heun at the next step's sigma, DPM2 between the two)."""

from __future__ import annotations

import pytest
import torch

import tome_core
from unets import hook_counts, inputs, run, tiny_unet

SIGMAS = [10.0, 6.0, 3.0, 1.5, 0.5, 0.0]  # 5 steps


def _drive(unet, evaluations, *, report=True, rows=(("cond",), ("uncond",))):
    """Drive a run through ``evaluations`` [(sigma, step)], each evaluation as one call per part in ``rows``
    (cond and uncond apart), reporting each step after its first evaluation; the progress each call was told."""
    told = []
    x, t, c = inputs(1, 16, 16)
    with tome_core.SamplingRun(unet, {"method": "todo"}, SIGMAS) as sampling:
        last = -1
        for sigma, step in evaluations:
            for part in rows:
                sampling.before_call(sigma, part)
                told.append(tome_core.get_patch(unet).progress)
                run(unet, x, t, c)
            if report and step > last:
                sampling.step_reported(step)
                last = step
    return told


def _progress(steps):
    return [(s + 0.5) / 5 for s in steps for _ in range(2)]


EULER = [(10.0, 0), (6.0, 1), (3.0, 2), (1.5, 3), (0.5, 4)]
DPM2 = [(10.0, 0), (7.7, 0), (6.0, 1), (4.2, 1), (3.0, 2), (2.1, 2), (1.5, 3), (0.87, 3), (0.5, 4)]
HEUN = [(10.0, 0), (6.0, 0), (6.0, 1), (3.0, 1), (3.0, 2), (1.5, 2), (1.5, 3), (0.5, 3), (0.5, 4)]


def test_each_evaluation_is_told_its_steps_progress():
    unet = tiny_unet("sd1")
    assert _drive(unet, EULER) == pytest.approx(_progress([s for _, s in EULER]))
    assert _drive(unet, DPM2) == pytest.approx(_progress([s for _, s in DPM2]))
    # Heun's first correction (at step 1's sigma, before two steps were reported) counts as step 1; from the
    # second report on, the run knows a step makes two evaluations.
    heun = [s for _, s in HEUN]
    assert _drive(unet, HEUN) == pytest.approx(_progress([heun[0], 1] + heun[2:]))
    # A sampler that reports nothing is placed by sigma alone.
    assert _drive(unet, EULER, report=False) == pytest.approx(_progress([s for _, s in EULER]))
    # cond and uncond in one call: the same steps.
    assert _drive(unet, DPM2, rows=(("cond", "uncond"),)) == pytest.approx(
        [(s + 0.5) / 5 for _, s in DPM2])


def test_a_corrector_taken_for_the_next_steps_drops_what_cache_kept():
    unet = tiny_unet("sd1")
    x, t, c = inputs(1, 16, 16)
    dropped = []
    with tome_core.SamplingRun(unet, {"method": "cache"}, SIGMAS) as sampling:
        patch = tome_core.get_patch(unet)
        original = patch.method_patch.start_afresh
        patch.method_patch.start_afresh = lambda: (dropped.append(True), original())
        last = -1
        for sigma, step in HEUN[:4]:
            sampling.before_call(sigma, ("cond",))
            run(unet, x, t, c)
            if step > last:
                sampling.step_reported(step)
                last = step
    assert dropped == [True]
    assert not tome_core.is_patched(unet)


def test_the_patch_lives_exactly_as_long_as_the_run_also_when_it_fails():
    unet = tiny_unet("sd1")
    hooks = hook_counts(unet)
    x, t, c = inputs(1, 16, 16)
    plain = run(unet, x, t, c)
    with pytest.raises(RuntimeError, match="stopped"):
        with tome_core.SamplingRun(unet, {"method": "tome", "ratio": 0.5}, SIGMAS) as sampling:
            sampling.before_call(10.0, ("cond",))
            assert not torch.equal(run(unet, x, t, c), plain)
            raise RuntimeError("stopped")
    assert hook_counts(unet) == hooks and not tome_core.is_patched(unet)
    assert torch.equal(run(unet, x, t, c), plain)
    with pytest.raises(ValueError, match="ratio"):
        tome_core.SamplingRun(unet, {"ratio": 2.0}, SIGMAS).__enter__()
    assert not tome_core.is_patched(unet)


def test_check_patch_says_what_apply_patch_would_do_and_touches_nothing():
    unet = tiny_unet("sdxl")
    hooks = hook_counts(unet)
    blocks = tome_core.check_patch(unet, method="cache")
    assert hook_counts(unet) == hooks and not tome_core.is_patched(unet)
    tome_core.apply_patch(unet, method="cache")
    assert [b.name for b in blocks] == [b.name for b in tome_core.patched_blocks(unet)]
    tome_core.remove_patch(unet)
    assert tome_core.check_patch(unet, max_downsample=1) == ()  # SDXL has no attention at the latent's level
    with pytest.raises(ValueError, match="ratio"):
        tome_core.check_patch(unet, ratio=2.0)
    with pytest.raises(TypeError, match="unknown option"):
        tome_core.check_patch(unet, strength=1)
    with pytest.raises(ValueError, match="no transformer blocks"):
        tome_core.check_patch(torch.nn.Linear(4, 4))


def test_the_recommended_settings_follow_the_layout():
    assert tome_core.model_layout(tiny_unet("sd1")) == "sd"
    assert tome_core.model_layout(tiny_unet("sdxl")) == "sdxl"
    assert tome_core.RECOMMENDED["sd"]["method"] == "todo" and tome_core.RECOMMENDED["sdxl"]["method"] == "cache"
    for options in tome_core.RECOMMENDED.values():
        tome_core.settings.TokenMergeSettings(enabled=True, **options)  # valid settings
    with pytest.raises(ValueError, match="no transformer blocks"):
        tome_core.model_layout(torch.nn.Linear(4, 4))
