"""Whole jobs in the SD.Next double (tests/sdnext_double): a diffusers pipeline, SD.Next's hook order and its
per-pass modifiers (built-in token merging, HiDiffusion's reset), hires fix with no hook between the passes."""

from __future__ import annotations

import pytest
import torch

from sdnext_double.testing import fresh, image, sdnext, tome_keys  # noqa: F401  (fixtures)
from tome_core import settings as tm

SEED = 11


def direct(host, settings: tm.TokenMergeSettings, **fields):
    """The engine's own output: the U-Net patched by the test itself, then a job without the accordion."""
    import tome_core

    tome_core.apply_patch(host.unet, **settings.engine_options(hires=False, seed=SEED))
    try:
        return host.txt2img(**fields)
    finally:
        tome_core.remove_patch(host.unet)


def console_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("[ToMe]")]


@pytest.mark.parametrize("method", ["ToMe", "ToDo", "Local", "Stack"])
def test_a_job_with_tome_gives_the_engines_output_and_leaves_the_unet_as_it_was(fresh, method, capsys):
    plain = fresh.txt2img()
    job = fresh.txt2img([{"enabled": True, "ratio": 0.5, "method": method}])
    assert console_lines(capsys.readouterr().out) == []
    assert not torch.equal(image(job), image(plain))
    fresh.stop_recording()
    assert torch.equal(image(job), image(direct(fresh, tm.TokenMergeSettings(enabled=True, ratio=0.5, method=method))))
    # Reproducible, and a plain job afterwards is plain again.
    assert torch.equal(image(fresh.txt2img([{"enabled": True, "ratio": 0.5, "method": method}])), image(job))
    assert torch.equal(image(fresh.txt2img()), image(plain))
    expected = {"ToMe ratio": 0.5, "ToMe size-weighted keys": "True"} if method == "ToMe" else {"ToMe ratio": 0.5, "ToMe method": method}
    assert tome_keys(job["info"]["infotexts"][0]) == expected


def test_every_unet_call_of_the_job_is_merged_although_hidiffusion_resets_the_unet_before_each_pass(fresh):
    # SD.Next's process_pre runs HiDiffusion's unapply after our patch went on: it resets classes with
    # `_parent` (which undoes tomesd), and forward hooks are not classes.
    fresh.txt2img([{"enabled": True, "ratio": 0.5}], enable_hr=True, hr_denoising_strength=0.5)
    assert len(fresh.calls) == 4 + 2
    assert all(call.merging for call in fresh.calls)


def test_builtin_tome_through_tomesd_is_undone_by_the_hidiffusion_reset(fresh):
    # What the harness found in the real SD.Next: the same pixels as without, while the infotext says ToMe.
    plain = fresh.txt2img()
    builtin = fresh.txt2img(override_settings={"token_merging_method": "ToMe", "tome_ratio": 0.5})
    from modules import shared

    assert "Applying ToMe: ratio=0.5" in shared.log_lines
    assert torch.equal(image(builtin), image(plain))
    assert "ToMe: 0.5" in builtin["info"]["infotexts"][0]
    assert shared.opts.tome_ratio == 0.0 and shared.opts.token_merging_method == "None"  # restored


@pytest.mark.parametrize("method, ratio_key", [("ToMe", "tome_ratio"), ("ToDo", "todo_ratio")])
def test_builtin_token_merging_is_set_aside_for_the_job_and_back_after(fresh, method, ratio_key, capsys):
    from modules import shared

    shared.opts.data.update({"token_merging_method": method, ratio_key: 0.5})
    job = fresh.txt2img([{"enabled": True, "ratio": 0.4}])
    lines = console_lines(capsys.readouterr().out)
    assert lines == [f"[ToMe] SD.Next's built-in token merging (token_merging_method={method}, {ratio_key}=0.5) "
                     f"is off for this job; the ToMe accordion applies"]
    assert not any(line.startswith("Applying") for line in shared.log_lines)
    assert all(call.builtin == "" and call.merging for call in fresh.calls)
    params = tome_keys(job["info"]["infotexts"][0])
    assert params == {"ToMe ratio": 0.4, "ToMe size-weighted keys": "True"}  # and no "ToMe"/"ToDo" entry of SD.Next's
    assert shared.opts.token_merging_method == method and getattr(shared.opts, ratio_key) == 0.5
    # A job without the accordion has the built-in merging again.
    fresh.calls.clear()
    fresh.txt2img()
    if method == "ToDo":  # (tomesd's patch is undone by HiDiffusion's reset before the U-Net runs)
        assert all(call.builtin == "ToDo" for call in fresh.calls)
    assert f"Applying {method}: ratio=0.5" in shared.log_lines


def test_the_requests_own_builtin_fields_do_not_claim_a_merge(fresh, capsys):
    job = fresh.txt2img([{"enabled": True, "ratio": 0.4}], token_merging_method="ToMe", tome_ratio=0.5)
    assert "built-in token merging (token_merging_method=ToMe, tome_ratio=0.5)" in capsys.readouterr().out
    params = tome_keys(job["info"]["infotexts"][0])
    assert params == {"ToMe ratio": 0.4, "ToMe size-weighted keys": "True"}


def test_hires_only_merges_only_in_the_hires_pass(fresh):
    plain = fresh.txt2img(enable_hr=True)
    base_calls = [call for call in fresh.calls]
    fresh.calls.clear()
    job = fresh.txt2img([{"enabled": True, "ratio": 0.5, "hr_only": True}], enable_hr=True)
    base = [call for call in fresh.calls if not call.hires]
    hires = [call for call in fresh.calls if call.hires]
    assert [c.shape for c in base] == [(2, 4, 16, 16)] * 4 and [c.shape for c in hires] == [(2, 4, 32, 32)] * 2
    assert not any(call.merging for call in base)
    assert all(call.merging and call.options.ratio == 0.5 for call in hires)
    assert len(base_calls) == 6
    assert not torch.equal(image(job), image(plain))
    assert tome_keys(job["info"]["infotexts"][0]) == {"ToMe ratio": 0.5, "ToMe hires only": True, "ToMe size-weighted keys": "True"}


def test_a_separate_hires_ratio_is_used_in_the_hires_pass_only(fresh):
    fresh.txt2img([{"enabled": True, "ratio": 0.3, "hr_ratio": 0.6}], enable_hr=True)
    assert [round(c.options.ratio, 3) for c in fresh.calls] == [0.3] * 4 + [0.6] * 2


def test_hires_only_without_hires_fix_merges_nothing_and_says_so(fresh, capsys):
    plain = fresh.txt2img()
    job = fresh.txt2img([{"enabled": True, "hr_only": True}])
    assert console_lines(capsys.readouterr().out) == [
        "[ToMe] 'Hires fix only' is on but this job has no hires fix pass: nothing is merged"]
    assert torch.equal(image(job), image(plain))
    assert tome_keys(job["info"]["infotexts"][0]) == {}


def test_the_step_window_follows_the_unet_calls_of_each_pass(fresh):
    fresh.stop_recording()
    fresh.record(keep_outputs=True)
    fresh.txt2img(enable_hr=True)
    plain = [call.output for call in fresh.calls]
    fresh.calls.clear()
    fresh.txt2img([{"enabled": True, "ratio": 0.5, "step_start": 0.5}], enable_hr=True)
    # 4 base steps and 2 hires steps: the second half of each pass merges, the first half is exact.
    assert [call.merging for call in fresh.calls] == [False, False, True, True, False, True]
    assert [round(call.progress, 3) for call in fresh.calls] == [0.125, 0.375, 0.625, 0.875, 0.25, 0.75]
    assert torch.equal(fresh.calls[0].output, plain[0]) and torch.equal(fresh.calls[1].output, plain[1])
    assert not torch.equal(fresh.calls[2].output, plain[2])


def test_a_failing_job_leaves_no_patch_and_the_next_job_is_plain(fresh):
    from modules import errors

    plain = fresh.txt2img()

    fresh.calls.clear()

    def fail(module, args, kwargs):
        if len(fresh.calls) == 2:  # the job's second U-Net call, with our patch on
            assert fresh.calls[-1].merging
            raise RuntimeError("out of memory (the test's)")

    handle = fresh.unet.register_forward_pre_hook(fail, with_kwargs=True)
    try:
        failed = fresh.txt2img([{"enabled": True, "ratio": 0.5}])
    finally:
        handle.remove()
    assert failed["images"] == []
    assert errors.reported == ["Processing: RuntimeError: out of memory (the test's)"]
    errors.reported.clear()
    fresh.assert_pristine()  # postprocess was skipped (SD.Next skips it after an error); after_process ran
    assert torch.equal(image(fresh.txt2img()), image(plain))


@pytest.mark.parametrize("args, message", [
    ([{"enabled": True, "ratio": 2.0}], "ratio"),
    ([{"enabled": True, "method": "tomesd"}], "method"),
    ([{"enabled": True, "colour": "red"}], "unknown key 'colour'"),
    ([True, 0.5, False, 0.0, "ToMe", "auto", 2, 2, True, False, False, 2, "nearest", 0.0, 1.0, 1, False, 3, 2,
      "extra"], "at most"),
])
def test_bad_arguments_give_one_console_line_and_a_plain_job(fresh, capsys, args, message):
    plain = fresh.txt2img()
    capsys.readouterr()
    job = fresh.txt2img(args)
    lines = console_lines(capsys.readouterr().out)
    assert len(lines) == 1 and message in lines[0] and lines[0].endswith("; generating without ToMe")
    assert torch.equal(image(job), image(plain))
    assert tome_keys(job["info"]["infotexts"][0]) == {}


def test_an_unpatchable_unet_gives_one_console_line_and_a_plain_job(fresh, capsys):
    from diffusers import UNet2DConditionModel

    class CompiledUNet(UNet2DConditionModel):  # a U-Net class from outside diffusers (ONNX/OpenVINO/quantised)
        pass

    plain = fresh.txt2img()
    unet = fresh.unet
    unet.__class__ = CompiledUNet
    try:
        capsys.readouterr()
        job = fresh.txt2img([{"enabled": True, "ratio": 0.5}])
    finally:
        unet.__class__ = UNet2DConditionModel
    lines = console_lines(capsys.readouterr().out)
    assert len(lines) == 1 and lines[0].startswith("[ToMe] skipped: StableDiffusionPipeline's U-Net ")
    assert "is not a diffusers U-Net" in lines[0]
    assert torch.equal(image(job), image(plain))
    assert tome_keys(job["info"]["infotexts"][0]) == {}


def test_positional_args_as_the_api_sends_them_are_the_dict_form(fresh):
    by_dict = fresh.txt2img([{"enabled": True, "ratio": 0.5, "method": "ToDo"}])
    positional = fresh.txt2img([True, 0.5, False, 0.0, "ToDo"])
    assert torch.equal(image(by_dict), image(positional))
    assert tome_keys(positional["info"]["infotexts"][0]) == {"ToMe ratio": 0.5, "ToMe method": "ToDo"}


def test_the_accordion_off_changes_nothing(fresh, capsys):
    plain = fresh.txt2img()
    off = fresh.txt2img([{"enabled": False, "ratio": 0.5}])
    assert console_lines(capsys.readouterr().out) == []
    assert torch.equal(image(off), image(plain))
    assert all(call.options is None for call in fresh.calls)


def test_img2img_merges_its_one_pass(fresh):
    plain = fresh.img2img()
    job = fresh.img2img([{"enabled": True, "ratio": 0.5, "hr_ratio": 0.8}])
    assert not torch.equal(image(job), image(plain))
    assert {c.pipeline for c in fresh.calls} == {"StableDiffusionImg2ImgPipeline"}
    assert [c.merging for c in fresh.calls if c.options is not None] == [True] * 3
    assert all(c.options.ratio == 0.5 for c in fresh.calls if c.options is not None)
    assert tome_keys(job["info"]["infotexts"][0]) == {"ToMe ratio": 0.5, "ToMe size-weighted keys": "True"}


def test_batches_of_a_job_each_get_their_seed(fresh):
    job = fresh.txt2img([{"enabled": True, "ratio": 0.5}], n_iter=2)
    seeds = {call.options.seed for call in fresh.calls}
    assert seeds == {SEED, SEED + 1}
    fresh.stop_recording()
    second = fresh.txt2img([{"enabled": True, "ratio": 0.5}], seed=SEED + 1)
    assert torch.equal(job["images"][1], image(second))


def test_a_cache_job_reuses_between_full_steps_and_gives_its_pixels_again(fresh):
    """SD.Next calls no hook per step: Cache places each U-Net call by the progress the pass watch reports."""
    plain = fresh.txt2img()
    args = [{"enabled": True, "method": "Cache", "cache_warmup": 1, "cache_interval": 2}]
    job = fresh.txt2img(args)
    assert not torch.equal(image(job), image(plain))
    assert torch.equal(image(fresh.txt2img(args)), image(job))
    assert torch.equal(image(fresh.txt2img()), image(plain))
    assert tome_keys(job["info"]["infotexts"][0]) == {"ToMe ratio": 0.5, "ToMe method": "Cache",
                                                      "ToMe cache interval": 2, "ToMe cache warmup": 1}


def test_a_cache_job_is_refused_in_one_line_beside_deepcache_and_other_methods_still_run(fresh, monkeypatch, capsys):
    """SD.Next's DeepCache (its "deep-cache" compile backend) skips U-Net steps of its own: a Cache job beside it
    runs without ToMe, saying so once; a ToMe job is not a step cache and runs as without DeepCache."""
    from modules import sd_models_compile

    plain = fresh.txt2img()
    tome = fresh.txt2img([{"enabled": True, "ratio": 0.5}])
    worker = sd_models_compile.Worker()
    monkeypatch.setattr(sd_models_compile, "deepcache_worker", worker)
    capsys.readouterr()
    job = fresh.txt2img([{"enabled": True, "method": "Cache"}])
    assert console_lines(capsys.readouterr().out) == [
        "[ToMe] skipped: Cache does not run beside SD.Next's DeepCache (Settings, Compute: model compile backend "
        "deep-cache), which skips steps of its own; turn one off"]
    assert worker.enables == 1 and not worker.enabled  # SD.Next's own on and off, untouched
    assert torch.equal(image(job), image(plain))  # the stand-in worker changes nothing: no patch did
    assert tome_keys(job["info"]["infotexts"][0]) == {}
    assert torch.equal(image(fresh.txt2img([{"enabled": True, "ratio": 0.5}])), image(tome))
    fresh.assert_pristine()


def test_the_refiner_pipeline_runs_unmerged_and_the_infotext_says_so(fresh, monkeypatch, capsys):
    """SD.Next's refiner is a pipeline of its own, called after the base and hires passes: the base steps
    merge, the refiner's U-Net is never patched, Cache's state never reaches it, and the image says so
    (`ToMe refiner: unmerged`, as where the A1111 WebUI cannot patch a refiner)."""
    import tome_core
    from modules import shared
    from sdnext_double.model import tiny_pipeline

    refiner = tiny_pipeline()  # the same weights in modules of its own, as SD.Next loads a refiner
    refiner_calls: list[bool] = []
    hook = refiner.unet.register_forward_pre_hook(
        lambda module, args: refiner_calls.append(tome_core.get_patch(module) is not None))
    monkeypatch.setattr(shared, "sd_refiner", refiner)
    with_refiner = dict(enable_hr=True, hr_scale=1.0, refiner_steps=2, refiner_start=0.5)
    try:
        no_refiner = fresh.txt2img(enable_hr=True, hr_scale=1.0)
        plain = fresh.txt2img(**with_refiner)
        assert refiner_calls == [False] and not torch.equal(image(plain), image(no_refiner))  # one refiner step ran
        capsys.readouterr()
        fresh.calls.clear()
        tome = fresh.txt2img([{"enabled": True, "ratio": 0.5}], **with_refiner)
        assert console_lines(capsys.readouterr().out) == [
            "[ToMe] the refiner's steps run without ToMe (SD.Next runs its refiner as a pipeline of its own, which "
            "ToMe does not patch)"]
        assert len(fresh.calls) == 4 + 2 and all(call.merging for call in fresh.calls)  # base and hires passes
        assert refiner_calls == [False, False] and not tome_core.is_patched(refiner.unet)
        assert tome_keys(tome["info"]["infotexts"][0]) == {"ToMe ratio": 0.5, "ToMe size-weighted keys": "True",
                                                           "ToMe refiner": "unmerged"}
        cache_args = [{"enabled": True, "method": "Cache", "cache_warmup": 1, "cache_interval": 2}]
        cache = fresh.txt2img(cache_args, **with_refiner)
        assert not torch.equal(image(cache), image(plain))
        assert torch.equal(image(fresh.txt2img(cache_args, **with_refiner)), image(cache))
        assert refiner_calls[2:] == [False, False]
        assert torch.equal(image(fresh.txt2img(**with_refiner)), image(plain))
        # Without refiner steps no refiner runs, and the image claims nothing of it.
        job = fresh.txt2img([{"enabled": True, "ratio": 0.5}], enable_hr=True, hr_scale=1.0, refiner_steps=0)
        assert len(refiner_calls) == 5 and "ToMe refiner" not in tome_keys(job["info"]["infotexts"][0])
    finally:
        hook.remove()
