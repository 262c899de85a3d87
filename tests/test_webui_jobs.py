"""The Script through whole webui jobs (the double's process_images): which pass is patched with what,
the step window, the built-in token merging, failures, unsupported models, and a clean U-Net after every job."""

from __future__ import annotations

import pytest
import torch

from tome_core import MergeOptions
from webui_double.testing import fresh, host, tome_keys  # noqa: F401  (fixtures)


def merge_options(ratio: float, seed: int, **changes) -> MergeOptions:
    """What the engine should be given for a pass, written out from the UI defaults."""
    return MergeOptions(**{"ratio": ratio, "max_downsample": None, "sx": 2, "sy": 2, "use_rand": True,
                           "merge_attn": True, "merge_crossattn": False, "merge_mlp": False, "seed": seed,
                           "method": "tome", "todo_factor": 2, "todo_pool": "nearest", "step_start": 0.0,
                           "step_end": 1.0, "size_weighted_keys": True, **changes})  # ToMe's "Auto"


def test_txt2img_with_hires_fix_and_batch_count_2(fresh):
    args = fresh.tome_args(enabled=True, ratio=0.4, hr_ratio=0.6)
    processed = fresh.txt2img(args, seed=100, n_iter=2, batch_size=2, steps=3, enable_hr=True, hr_scale=1.5,
                              hr_second_pass_steps=2, denoising_strength=0.7)
    calls = fresh.calls
    # Euler: 3 first-pass evaluations, then int(0.7 * 2) + 1 = 2 in the hires pass; per batch of the batch count.
    assert [(c.hr, c.shape) for c in calls] == 2 * ([(False, (4, 4, 16, 16))] * 3 + [(True, (4, 4, 24, 24))] * 2)
    # Each pass patched anew, keyed on the first seed of its own batch (seeds 100, 101 | 102, 103).
    expected = (3 * [merge_options(0.4, 100)] + 2 * [merge_options(0.6, 100)]
                + 3 * [merge_options(0.4, 102)] + 2 * [merge_options(0.6, 102)])
    assert [c.options for c in calls] == expected
    assert not any(c.builtin for c in calls)
    assert len(processed.infotexts) == 4
    for infotext in processed.infotexts:
        assert tome_keys(infotext) == {"ToMe ratio": "0.4", "ToMe hr ratio": "0.6", "ToMe size-weighted keys": "True"}
        assert "Token merging ratio" not in infotext
    fresh.assert_pristine()


def test_hires_only_leaves_every_first_pass_alone(fresh):
    args = fresh.tome_args(enabled=True, ratio=0.3, hr_only=True)
    processed = fresh.txt2img(args, n_iter=2, steps=2, enable_hr=True, hr_second_pass_steps=2,
                              denoising_strength=0.7)
    assert [c.hr for c in fresh.calls] == [False, False, True, True] * 2
    # Batch 2's first pass runs right after batch 1's hires pass: the patch must be gone there too.
    assert [c.options for c in fresh.calls if not c.hr] == [None] * 4
    assert [c.options.ratio for c in fresh.calls if c.hr] == [0.3] * 4  # hires ratio 0: same as the ratio
    assert tome_keys(processed.infotexts[0]) == {"ToMe ratio": "0.3", "ToMe hires only": "True", "ToMe size-weighted keys": "True"}
    fresh.assert_pristine()


def test_img2img_patches_its_one_pass_and_ignores_the_hires_values(fresh):
    args = fresh.tome_args("img2img", enabled=True, ratio=0.45, hr_only=True, hr_ratio=0.8, max_downsample="2")
    processed = fresh.img2img(args, seed=7, steps=4, denoising_strength=0.75)
    # int(0.75 * 4) + 1 = 4 evaluations.
    assert [c.options for c in fresh.calls] == [merge_options(0.45, 7, max_downsample=2)] * 4
    assert tome_keys(processed.infotexts[0]) == {"ToMe ratio": "0.45", "ToMe max downsample": "2", "ToMe size-weighted keys": "True"}
    fresh.assert_pristine()


def test_same_infotext_gives_the_same_image_and_tome_changes_it(fresh):
    args = fresh.tome_args(enabled=True, ratio=0.5)
    first = fresh.txt2img(args, seed=5).images[0]
    again = fresh.txt2img(args, seed=5).images[0]
    plain = fresh.txt2img(fresh.tome_args(), seed=5).images[0]
    assert torch.equal(first, again)
    assert not torch.equal(first, plain)
    fresh.assert_pristine()


def test_an_exception_during_sampling_then_a_second_job(fresh, monkeypatch):
    import tome_core
    from modules import processing

    def fail_in_hires_pass(model, x, t, context):
        if x.shape[-1] == 24:
            raise RuntimeError("out of memory (injected)")

    fresh.model.observers.append(fail_in_hires_pass)
    with pytest.raises(RuntimeError, match="injected"):
        fresh.txt2img(fresh.tome_args(enabled=True, ratio=0.4), enable_hr=True, hr_second_pass_steps=2,
                      denoising_strength=0.7)
    fresh.model.observers.remove(fail_in_hires_pass)
    # postprocess was skipped: the patch is still on, as in the webui.
    assert fresh.calls[-1].options is not None and tome_core.is_patched(fresh.unet)
    # The next job removes it in its first hook, before the webui does anything with the model.
    patched_at_builtin = []
    builtin = processing.apply_token_merging
    monkeypatch.setattr(processing, "apply_token_merging", lambda model, ratio: (
        patched_at_builtin.append(tome_core.is_patched(model.unet)), builtin(model, ratio)))
    fresh.calls.clear()
    fresh.txt2img(fresh.tome_args())
    assert patched_at_builtin[0] is False
    assert [c.options for c in fresh.calls] == [None] * 3
    fresh.assert_pristine()


def test_an_exception_then_a_job_with_tome_on(fresh):
    def fail_at_once(model, x, t, context):
        raise RuntimeError("injected")

    fresh.model.observers.append(fail_at_once)
    with pytest.raises(RuntimeError):
        fresh.txt2img(fresh.tome_args(enabled=True, ratio=0.4))
    fresh.model.observers.remove(fail_at_once)
    fresh.calls.clear()
    fresh.txt2img(fresh.tome_args(enabled=True, ratio=0.2))
    assert [c.options.ratio for c in fresh.calls] == [0.2] * 3
    fresh.assert_pristine()


def test_builtin_token_merging_above_0_is_taken_over_for_the_job(fresh, capsys):
    from modules import shared

    shared.opts.token_merging_ratio = 0.5
    shared.opts.token_merging_ratio_hr = 0.3
    processed = fresh.txt2img(fresh.tome_args(enabled=True, ratio=0.4), enable_hr=True, hr_second_pass_steps=2,
                              denoising_strength=0.7)
    assert not any(c.builtin for c in fresh.calls)
    assert all(c.options is not None for c in fresh.calls)
    assert "Token merging ratio" not in processed.infotexts[0]
    out = capsys.readouterr().out
    assert out.count("[ToMe]") == 1 and "token_merging_ratio=0.5" in out and "token_merging_ratio_hr=0.3" in out
    # The user's settings are back after the job.
    assert (shared.opts.token_merging_ratio, shared.opts.token_merging_ratio_hr) == (0.5, 0.3)

    # With the accordion off, the built-in works as before and ToMe stays out of it.
    fresh.calls.clear()
    processed = fresh.txt2img(fresh.tome_args(), enable_hr=True, hr_second_pass_steps=2, denoising_strength=0.7)
    assert all(c.builtin and c.options is None for c in fresh.calls)
    assert "Token merging ratio: 0.5" in processed.infotexts[0]
    assert capsys.readouterr().out == ""
    fresh.assert_pristine()


def test_builtin_override_from_a_request_does_not_leak_when_config_lacks_the_key(fresh):
    from modules import shared

    del shared.opts.data["token_merging_ratio"]  # a config.json that never saved this setting
    fresh.txt2img(fresh.tome_args(enabled=True), override_settings={"token_merging_ratio": 0.5})
    assert not any(c.builtin for c in fresh.calls)
    assert shared.opts.token_merging_ratio == 0.0
    fresh.assert_pristine()


@pytest.mark.parametrize("sampler, steps, second_half", [
    ("Euler", 4, [False, False, True, True]),
    # Heun: two evaluations a step, one in the last step.
    ("Heun", 4, [False, False, False, False, True, True, True]),
    # Heun, 6 steps: 11 evaluations; steps 3-5 (6 evaluations with the last step's single one) are the second half.
    ("Heun", 6, [False] * 6 + [True] * 5),
    # DDIM: 4 steps call the U-Net 3 times; the third call is the only one in the second half.
    ("DDIM", 4, [False, False, True]),
])
def test_step_window_splits_each_pass_by_steps(fresh, sampler, steps, second_half):
    for start, end, expected in ((0.5, 1.0, second_half), (0.0, 0.5, [not a for a in second_half])):
        fresh.calls.clear()
        fresh.txt2img(fresh.tome_args(enabled=True, step_start=start, step_end=end), sampler_name=sampler,
                      steps=steps)
        assert all(c.options is not None for c in fresh.calls)
        assert [c.merging for c in fresh.calls] == expected
    fresh.assert_pristine()


def test_step_window_restarts_for_the_hires_pass(fresh):
    fresh.txt2img(fresh.tome_args(enabled=True, step_start=0.5), steps=2, enable_hr=True,
                  hr_second_pass_steps=4, denoising_strength=1.0)
    assert [(c.hr, c.merging) for c in fresh.calls] == [(False, False), (False, True)] + [
        (True, False), (True, False), (True, True), (True, True)]
    fresh.assert_pristine()


def test_a_window_holding_no_step_gives_the_unpatched_image(fresh):
    plain = fresh.txt2img(fresh.tome_args(), seed=3, steps=4).images[0]
    windowed = fresh.txt2img(fresh.tome_args(enabled=True, ratio=0.7, step_start=0.9, step_end=0.9), seed=3,
                             steps=4).images[0]
    assert torch.equal(plain, windowed)


def test_cond_and_uncond_in_separate_calls_share_the_evaluation_progress(fresh):
    from modules import shared

    shared.opts.batch_cond_uncond = False
    fresh.txt2img(fresh.tome_args(enabled=True, step_end=0.5), steps=2)
    assert [c.shape[0] for c in fresh.calls] == [1, 1, 1, 1]
    assert [c.merging for c in fresh.calls] == [True, True, False, False]


@pytest.mark.parametrize("bad_args, words", [
    ({"ratio": "0.5"}, ["ratio", "'0.5'", "[0.0, 0.9]"]),
    ({"ratio": 0.95}, ["ratio", "0.95", "[0.0, 0.9]"]),
    ({"sx": 0}, ["sx", "[1, 8]"]),
    ({"method": "fast"}, ["method", "'fast'"]),
])
def test_bad_ui_values_run_without_tome_and_say_why_once(fresh, capsys, bad_args, words):
    processed = fresh.txt2img(fresh.tome_args(enabled=True, **bad_args), n_iter=2, steps=2)
    assert all(c.options is None for c in fresh.calls)
    assert all(tome_keys(text) == {} for text in processed.infotexts)
    lines = [line for line in capsys.readouterr().out.splitlines() if "[ToMe]" in line]
    assert len(lines) == 1 and all(word in lines[0] for word in words), lines
    fresh.assert_pristine()


class _AlternativeUnet:
    option = type("Option", (), {"label": "TensorRT"})()

    def forward(self, x, t, context):
        return torch.zeros_like(x)


@pytest.mark.parametrize("case", ["sd3", "alternative unet", "no u-net"])
def test_unsupported_models_are_skipped_with_one_line(fresh, capsys, case):
    from modules import sd_unet, shared

    if case == "sd3":
        fresh.model.is_sd3 = True
    elif case == "alternative unet":
        sd_unet.current_unet = _AlternativeUnet()
    else:
        fresh.add_checkpoint("other.safetensors", fresh.new_model(kind="transformer"), config="other")
        shared.opts.sd_model_checkpoint = "other.safetensors"  # the user's checkpoint choice
    try:
        processed = fresh.txt2img(fresh.tome_args(enabled=True), n_iter=2, enable_hr=True, hr_second_pass_steps=2,
                                  denoising_strength=0.7)
    finally:
        fresh.model.is_sd3 = False
    assert len(fresh.calls) == 10
    assert all(c.options is None for c in fresh.calls)
    assert tome_keys(processed.infotexts[0]) == {}
    lines = [line for line in capsys.readouterr().out.splitlines() if "[ToMe]" in line]
    assert len(lines) == 1 and "skipped" in lines[0], lines
    fresh.assert_pristine()


def test_step_window_at_the_end_reaches_heuns_single_evaluation_last_step(fresh):
    # Heun, 5 steps: 9 evaluations, the last step has one; the window [0.9, 1] holds that step alone.
    fresh.txt2img(fresh.tome_args(enabled=True, step_start=0.9, step_end=1.0), sampler_name="Heun", steps=5)
    assert [c.merging for c in fresh.calls] == [False] * 8 + [True]
    fresh.assert_pristine()


def test_request_that_keeps_its_setting_changes_only_zeroes_the_builtin_ratio_that_is_on(fresh, capsys):
    from modules import shared

    shared.opts.token_merging_ratio = 0.3
    del shared.opts.data["token_merging_ratio_hr"]  # a config.json that never saved this setting
    fresh.txt2img(fresh.tome_args(enabled=True), override_settings_restore_afterwards=False)
    assert not any(c.builtin for c in fresh.calls)
    assert shared.opts.token_merging_ratio == 0.0
    assert "token_merging_ratio_hr" not in shared.opts.data  # nothing written that was not on
    assert "token_merging_ratio stay 0 after it" in capsys.readouterr().out
    fresh.assert_pristine()


def test_hires_only_without_hires_fix_merges_nothing_and_records_nothing(fresh, capsys):
    processed = fresh.txt2img(fresh.tome_args(enabled=True, hr_only=True), enable_hr=False)
    assert all(c.options is None for c in fresh.calls)
    assert tome_keys(processed.infotexts[0]) == {}
    assert "no hires fix pass" in capsys.readouterr().out
    fresh.assert_pristine()


@pytest.mark.parametrize("case", ["sd3", "alternative unet"])
def test_a_skipped_job_keeps_the_webuis_own_token_merging(fresh, capsys, case):
    """Turning the built-in off for a job that then skips ToMe would leave the user with no merging at all."""
    from modules import sd_unet, shared

    shared.opts.token_merging_ratio = 0.5
    if case == "sd3":
        fresh.model.is_sd3 = True
    else:
        sd_unet.current_unet = _AlternativeUnet()
    try:
        processed = fresh.txt2img(fresh.tome_args(enabled=True, ratio=0.3))
    finally:
        fresh.model.is_sd3 = False
    if case == "sd3":  # the alternative U-Net runs instead of the blocks the built-in patches
        assert fresh.calls and all(c.builtin and c.options is None for c in fresh.calls)
    assert "Token merging ratio: 0.5" in processed.infotexts[0]
    assert tome_keys(processed.infotexts[0]) == {}
    lines = [line for line in capsys.readouterr().out.splitlines() if "[ToMe]" in line]
    assert len(lines) == 1 and "skipped" in lines[0] and "built-in" not in lines[0], lines
    fresh.assert_pristine()


def test_a_unet_class_of_unknown_origin_is_named_as_such(fresh, capsys):
    """A U-Net with transformer blocks from a module ToMe was not made for is left alone, and the line says
    that, not that the model has no transformer blocks."""
    from scripts.tokenmerge_hosts import host_of

    unet = fresh.unet
    cls = type(unet)
    foreign = type(cls.__name__, (cls,), {"__module__": "some_fork.unet"})
    unet.__class__ = foreign
    try:
        reason = host_of(fresh.model).unsupported_reason(fresh.model)
    finally:
        unet.__class__ = cls
    assert "some_fork.unet" in reason and "does not know" in reason and "transformer blocks" not in reason
