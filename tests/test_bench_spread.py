"""Fidelity figures that say how sure they are: per-image PSNR and SSIM against scikit-image, medians and
ranges against numpy, the one-step measure against a perturbation whose effect is known exactly, and what
holds on every proxy against hand-made figures."""

import math

import numpy as np
import pytest
import torch

from tome_core.bench import archs
from tome_core.bench.contenders import Contender, roster
from tome_core.bench.fidelity import sample_pictures
from tome_core.bench.metrics import psnr_each, ssim_each
from tome_core.bench.replicate import across, closer_everywhere, grouped, orderings, per_model_table
from tome_core.bench.report import Entry, Fidelity, figure_cell
from tome_core.bench.spread import Figure
from tome_core.bench.stepwise import reference_trajectory, relative_error, step_errors
from bench_stand_ins import stand_in_pipeline

pytestmark = pytest.mark.filterwarnings("ignore")
SIZE = 16


@pytest.fixture(autouse=True)
def webui_unet(monkeypatch):
    from ldm.modules.attention import CrossAttention
    from ldm.modules.diffusionmodules import openaimodel

    monkeypatch.setattr(CrossAttention, "forward", CrossAttention.forward)
    monkeypatch.setattr(openaimodel, "th", openaimodel.th)
    archs.use_webui_unet()


# -- a figure over images ----------------------------------------------------------------------------------------

def test_per_image_psnr_and_ssim_and_their_median_and_range_agree_with_scikit_image_and_numpy():
    metrics = pytest.importorskip("skimage.metrics")
    gen = torch.Generator().manual_seed(3)
    ref = torch.nn.functional.interpolate(torch.rand(5, 3, 4, 4, generator=gen), size=(24, 24), mode="bilinear")
    # Each image moved by its own amount: the spread is real.
    amounts = torch.tensor([0.01, 0.03, 0.002, 0.05, 0.02]).view(5, 1, 1, 1)
    img = (ref + amounts * torch.randn(ref.shape, generator=gen)).clamp(0, 1)
    a, b = img.double().numpy(), ref.double().numpy()
    expected_psnr = [metrics.peak_signal_noise_ratio(b[i], a[i], data_range=1.0) for i in range(5)]
    expected_ssim = [metrics.structural_similarity(a[i], b[i], channel_axis=0, data_range=1.0,
                                                   gaussian_weights=True, sigma=1.5, use_sample_covariance=False)
                     for i in range(5)]
    assert psnr_each(img, ref) == pytest.approx(expected_psnr, abs=1e-9)
    assert ssim_each(img, ref) == pytest.approx(expected_ssim, abs=1e-9)
    figure = Figure.of(psnr_each(img, ref))
    assert figure.median == pytest.approx(float(np.median(expected_psnr)), abs=1e-9)
    assert (figure.low, figure.high) == pytest.approx((min(expected_psnr), max(expected_psnr)), abs=1e-9)
    assert figure.high - figure.low > 10  # 0.002 against 0.05: about 28 dB apart


def test_a_figure_of_even_count_and_identical_pictures():
    assert Figure.of([4.0, 1.0, 3.0, 2.0]).median == 2.5
    assert Figure.of([math.inf, math.inf]).median == math.inf
    assert Figure.of([30.0, math.inf, math.inf]).median == math.inf and Figure.of([30.0, math.inf]).low == 30
    with pytest.raises(ValueError):
        Figure.of([])
    with pytest.raises(ValueError):
        Figure.of([1.0, math.nan])


@pytest.mark.parametrize("value, spread, digits, cell", [
    (45.63, (43.14, 48.02), 1, "45.6 (43.1–48.0)"),
    (45.63, (45.61, 45.64), 1, "45.6"),  # a range that rounds to one number is not shown
    (math.inf, (math.inf, math.inf), 1, "∞"),
    (math.inf, (51.2, math.inf), 1, "∞ (51.2–∞)"),
    (0.99712, (0.9951, 0.9990), 3, "0.997 (0.995–0.999)"),
    (None, None, 1, "–"),
])
def test_figure_cells(value, spread, digits, cell):
    assert figure_cell(value, spread, digits) == cell


def test_pictures_report_the_median_and_range_over_their_images():
    pipe = stand_in_pipeline()
    racers = roster([0.5], [], with_tomesd=False, with_ideal=False, with_local=False)
    pictures = sample_pictures(pipe, racers, SIZE, steps=2, images=3)
    fid = pictures.fidelity()["ToMe 0.50"]
    each = psnr_each(pictures.images["ToMe 0.50"], pictures.images["none"])
    assert len(each) == 3 and fid.draws == 3
    assert fid.psnr == pytest.approx(float(np.median(each))) and fid.psnr_range == (min(each), max(each))


# -- one step's prediction along the unmerged trajectory -------------------------------------------------------------

def test_relative_error_by_hand():
    # Two steps, two images of 2 values; x̂0 = x − σ·ε, so ε = (x − x̂0) / σ.
    sigmas = [2.0, 0.5]
    inputs = torch.zeros(2, 2, 1, 2, dtype=torch.float64)
    eps_ref = torch.tensor([[[[1.0, 0.0]], [[3.0, 4.0]]], [[[0.0, 2.0]], [[1.0, 1.0]]]], dtype=torch.float64)
    eps_other = eps_ref + torch.tensor([[[[0.1, 0.0]], [[0.0, 0.0]]], [[[0.0, 0.2]], [[0.5, 0.5]]]],
                                       dtype=torch.float64)
    sig = torch.tensor(sigmas, dtype=torch.float64).view(2, 1, 1, 1)
    rel = relative_error(inputs - sig * eps_ref, inputs - sig * eps_other, inputs, sigmas)
    # Image 0: step 0 0.01/1, step 1 0.04/4 -> mean 0.01. Image 1: step 0 0/25, step 1 0.5/2 -> mean 0.125.
    assert rel.tolist() == pytest.approx([0.01, 0.125])


class ScaledOutput:
    """A contender whose U-Net output is (1 + delta) times the plain one: its predicted noise is off by exactly
    delta relative to the plain prediction at the same input, whatever the input."""

    def __init__(self, delta: float) -> None:
        self.delta, self.handle = delta, None

    def contender(self) -> Contender:
        return Contender(f"scaled {self.delta}", self.apply, self.remove, "scaled", f"{self.delta}")

    def apply(self, model) -> None:
        unet = model.model.diffusion_model
        self.handle = unet.register_forward_hook(lambda m, a, out: out * (1 + self.delta))

    def remove(self, model) -> None:
        self.handle.remove()


def test_the_step_measure_gives_both_models_the_unmerged_input():
    """On its own trajectory the scaled model's picture drifts; given the unmerged input at every step its
    prediction is off by exactly delta, so the step figure is -20·log10(delta) dB on every image."""
    pipe = stand_in_pipeline()
    noise = torch.randn(2, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(1))
    trajectory, final = reference_trajectory(pipe, noise, steps=3)
    scaled = ScaledOutput(0.01)
    got = step_errors(pipe, [roster([], [], with_tomesd=False, with_ideal=False)[0], scaled.contender()], trajectory)
    assert got["none"] == [math.inf, math.inf]
    assert got["scaled 0.01"] == pytest.approx([40.0, 40.0], abs=1e-4)  # float32 U-Net: 1e-7 relative
    # The recorded trajectory is the plain sampling run's: it ends where euler_sample ends.
    from tome_core.bench.sampling import euler_sample

    assert torch.equal(final, euler_sample(pipe, noise, steps=3))
    assert trajectory.inputs.shape == (3, 2, 3, SIZE, SIZE) and trajectory.timesteps[0] == 999


class LastStepScaled(ScaledOutput):
    """A contender whose U-Net output is (1 + delta) times the plain one at the last of ``steps`` calls only."""

    def __init__(self, delta: float, steps: int) -> None:
        super().__init__(delta)
        self.steps, self.calls = steps, 0

    def apply(self, model) -> None:
        def hook(module, args, out):
            self.calls += 1
            return out * (1 + self.delta) if self.calls == self.steps else out
        self.calls = 0
        self.handle = model.model.diffusion_model.register_forward_hook(hook)


def test_the_step_figure_weighs_each_step_by_how_far_it_moves_the_sample():
    """An error at the last step alone: Euler moves the sample by (σ_{i+1} − σ_i)·ε at step i, so the figure is
    the last step's error weighed by (σ_last − 0)² over every step's ε power weighed by (σ_i − σ_{i+1})², both
    computed here from the trajectory itself; every step alike it would be (error / power at the last step) / 3."""
    pipe = stand_in_pipeline()
    noise = torch.randn(2, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(1))
    trajectory, _ = reference_trajectory(pipe, noise, steps=3)
    delta = 0.1
    got = step_errors(pipe, [LastStepScaled(delta, 3).contender()], trajectory)[f"scaled {delta}"]
    sig = torch.tensor(trajectory.sigmas, dtype=torch.float64).view(-1, 1, 1, 1, 1)
    eps = (trajectory.inputs.double() - trajectory.denoised.double()) / sig  # (steps, B, C, h, w)
    power = eps.pow(2).flatten(2).sum(-1)  # (steps, B)
    ends = trajectory.sigmas + [0.0]
    w = torch.tensor([(ends[i] - ends[i + 1]) ** 2 for i in range(3)], dtype=torch.float64).view(-1, 1)
    expected = -10 * torch.log10(w[-1] * delta ** 2 * power[-1] / (w * power).sum(0))
    alike = -10 * torch.log10(delta ** 2 * power[-1] / power[-1] / 3)
    assert got == pytest.approx(expected.tolist(), abs=1e-3)
    assert all(g > a + 3 for g, a in zip(got, alike.tolist()))  # the last step moves the sample least


def test_the_step_figure_tells_each_step_its_progress_as_sampling_does():
    """A step window no step of a 3-step run falls in ((i + 0.5) / 3 < 0.9 for every step): told the progress,
    the patch never acts and the figure is ∞; the same patch told nothing acts on every step."""
    import tome_core

    pipe = stand_in_pipeline()
    noise = torch.randn(2, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(1))
    trajectory, _ = reference_trajectory(pipe, noise, steps=3)
    late = Contender("ToMe late", lambda m: tome_core.apply_patch(m, ratio=0.5, step_start=0.9),
                     tome_core.remove_patch, "ToMe", "0.50")
    assert step_errors(pipe, [late], trajectory)["ToMe late"] == [math.inf, math.inf]
    untold = Contender("ToMe untold", lambda m: tome_core.apply_patch(m, ratio=0.5), tome_core.remove_patch, "ToMe")
    assert all(math.isfinite(v) for v in step_errors(pipe, [untold], trajectory)["ToMe untold"])


def test_a_real_merge_moves_the_step_figure_and_ratio_0_does_not():
    pipe = stand_in_pipeline()
    racers = roster([0.0, 0.5], [2], with_tomesd=False, with_ideal=True)
    pictures = sample_pictures(pipe, racers, SIZE, steps=2, images=2)
    got = step_errors(pipe, racers, pictures.trajectory)
    assert "ideal 0.50" not in got
    assert got["ToMe 0.00"] == [math.inf, math.inf]
    for name in ("ToMe 0.50", "ToDo f=2", "Local 0.50"):
        assert all(math.isfinite(v) and v > 0 for v in got[name]), name


# -- the same figures on several proxies ------------------------------------------------------------------------------

def _fid(psnr, step=None):
    return Fidelity(psnr, 1.0 - 1.0 / psnr, step, (psnr - 1, psnr + 1), None, None if step is None else (step, step))


def test_across_models_is_the_median_of_their_medians_with_their_range():
    per_model = [{"a": _fid(40.0, 30.0)}, {"a": _fid(20.0, 28.0)}, {"a": _fid(35.0, 31.0)}]
    got = across(per_model)["a"]
    assert (got.psnr, got.psnr_range) == (35.0, (20.0, 40.0))
    assert (got.step, got.step_range) == (30.0, (28.0, 31.0))
    assert got.ssim == pytest.approx(1 - 1 / 35) and got.draws == 3
    # A measure one model lacks is left out, not half-counted.
    assert across([{"a": _fid(40.0, 30.0)}, {"a": _fid(20.0)}])["a"].step is None


def test_orderings_that_hold_on_every_model():
    # a beats b everywhere; b and c flip between models; a and c tie on one model (a tie breaks the order).
    per_model = [{"a": _fid(50.0), "b": _fid(40.0), "c": _fid(30.0)},
                 {"a": _fid(45.0), "b": _fid(20.0), "c": _fid(25.0)},
                 {"a": _fid(30.0), "b": _fid(29.0), "c": _fid(30.0)}]
    got = closer_everywhere(per_model, ["a", "b", "c"], "psnr")
    assert got == {"a": ["b"], "b": [], "c": []}
    found = orderings(per_model, ["a", "b", "c"], "psnr")
    assert (found.held, found.pairs) == (1, 3)


def test_per_model_table_and_grouped_names():
    entries = [Entry("ToMe 0.25", "ToMe", "0.25"), Entry("ToMe 0.50", "ToMe", "0.50"), Entry("ToDo f=2", "ToDo", "f=2")]
    assert grouped(["ToMe 0.25", "ToDo f=2", "ToMe 0.50"], {e.name: e for e in entries}) == "ToMe 0.25/0.50, ToDo f=2"
    per_model = [{e.name: _fid(40.0 + i) for i, e in enumerate(entries)},
                 {e.name: _fid(30.0 + i) for i, e in enumerate(entries)}]
    lines = per_model_table(["seed 0", "seed 1"], per_model, entries, "psnr")
    assert lines[0] == "| method | setting | seed 0 | seed 1 | median |"
    assert lines[2] == "| ToMe | 0.25 | 40.0 (39.0–41.0) | 30.0 (29.0–31.0) | 35.0 |"
