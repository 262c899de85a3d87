"""The refiner: the webui (A1111 and Forge) switches to another checkpoint during sampling without calling
any Script hook. ToMe must follow it with the same settings, keep counting the pass's steps, restore both
models after the job, and say in the infotext when the refiner could not be merged."""

from __future__ import annotations

import sys

import pytest
import torch

import tome_core
from webui_double.model import hook_count, snapshot, tiny_unet
from webui_double.testing import fresh, host, tome_keys  # noqa: F401  (fixtures)

STEPS = 4


def refiner(host, *, own_config: bool = True, kind: str = "u-net", layout: str = "sdxl"):
    """Register a refiner checkpoint: with its own config (a new model object at the switch; by default with
    SDXL's levels, so "auto" must pick another level than on the base model), or sharing the base model's
    config (its weights load into the base model's modules)."""
    model = host.new_model(tiny_unet(seed=5, layout=layout if own_config else "sd1"), kind=kind)
    host.add_checkpoint("refiner.safetensors", model, config="refiner" if own_config else "v1")
    return model


def assert_unpatched(model) -> None:
    assert hook_count(model.unet) == 0 and not tome_core.is_patched(model.unet)


def test_tome_covers_the_refiners_steps_with_the_same_settings(fresh):
    other = refiner(fresh)
    args = fresh.tome_args(enabled=True, ratio=0.4, step_start=0.2)
    processed = fresh.txt2img(args, steps=STEPS, refiner_checkpoint="refiner.safetensors", refiner_switch_at=0.5)
    calls = fresh.calls
    assert [c.model for c in calls] == [fresh.model] * 2 + [other] * 2
    assert all(c.options is not None for c in calls)
    assert len({c.options for c in calls}) == 1  # the same engine options before and after the switch
    # The step window keeps counting the pass's steps across the switch.
    assert [c.progress for c in calls] == [0.125, 0.375, 0.625, 0.875]
    assert [c.merging for c in calls] == [False, True, True, True]
    # Levels "auto" adapt to each U-Net: SD 1.x merges at full resolution, the SDXL-layout refiner at half.
    assert [c.levels for c in calls] == [{0}] * 2 + [{1}] * 2
    assert tome_keys(processed.infotexts[0]) == {"ToMe ratio": "0.4", "ToMe step start": "0.2", "ToMe size-weighted keys": "True"}
    assert "Refiner: refiner" in processed.infotexts[0]
    assert_unpatched(other)  # both models restored after the job (the base by the fixture)


def test_the_refiners_steps_are_merged_and_a_plain_job_afterwards_is_plain(fresh):
    refiner(fresh)
    job = dict(seed=3, steps=STEPS, refiner_checkpoint="refiner.safetensors", refiner_switch_at=0.5)
    plain = fresh.txt2img(fresh.tome_args(), **job).images[0]
    whole = fresh.txt2img(fresh.tome_args(enabled=True, ratio=0.5), **job).images[0]
    base_steps_only = fresh.txt2img(fresh.tome_args(enabled=True, ratio=0.5, step_end=0.5), **job).images[0]
    assert not torch.equal(whole, base_steps_only)  # the refiner's steps merge too
    assert not torch.equal(whole, plain)
    assert torch.equal(fresh.txt2img(fresh.tome_args(), **job).images[0], plain)


def test_a_refiner_sharing_the_base_config_keeps_the_patch(fresh):
    other = refiner(fresh, own_config=False)
    processed = fresh.txt2img(fresh.tome_args(enabled=True, ratio=0.3), steps=STEPS,
                              refiner_checkpoint="refiner.safetensors", refiner_switch_at=0.5)
    if fresh.processing == "a1111":  # the refiner's weights load into the base model's modules
        assert [c.model for c in fresh.calls] == [fresh.model] * 4
    else:  # Forge builds a model object for every checkpoint it loads
        assert [c.model for c in fresh.calls] == [fresh.model] * 2 + [other] * 2
    assert [c.options.ratio for c in fresh.calls] == [0.3] * 4
    assert tome_keys(processed.infotexts[0]) == {"ToMe ratio": "0.3", "ToMe size-weighted keys": "True"}
    assert_unpatched(other)


def test_an_unsupported_refiner_runs_unmerged_and_the_infotext_says_so(fresh, capsys):
    other = refiner(fresh, kind="transformer")
    processed = fresh.txt2img(fresh.tome_args(enabled=True, ratio=0.5), n_iter=2, steps=STEPS,
                              refiner_checkpoint="refiner.safetensors", refiner_switch_at=0.5)
    assert [(c.model is other, c.options is not None) for c in fresh.calls] == 2 * (
        [(False, True)] * 2 + [(True, False)] * 2)
    for infotext in processed.infotexts:
        assert tome_keys(infotext) == {"ToMe ratio": "0.5", "ToMe refiner": "unmerged", "ToMe size-weighted keys": "True"}
    lines = [line for line in capsys.readouterr().out.splitlines() if "[ToMe]" in line]
    assert len(lines) == 1 and "refiner" in lines[0] and "transformer" in lines[0], lines


@pytest.mark.parametrize("refiner_pass, switched", [
    # Hires fix with the refiner: in which passes the switch happens (the webui's setting). The A1111 webui
    # starts the hires pass on the base model again; Forge goes on with the model the first pass ended on.
    ("first pass", {"a1111": [False, False, True, True] + [False] * 3, "forge": [False, False, True, True] + [True] * 3}),
    ("second pass", {"a1111": [False] * 4 + [False, False, True], "forge": [False] * 4 + [False, False, True]}),
    ("both passes", {"a1111": [False, False, True, True] + [False, False, True],
                     "forge": [False, False, True, True] + [True] * 3}),
])
def test_hires_fix_with_the_refiner_merges_every_step_with_each_pass_ratio(fresh, refiner_pass, switched):
    from modules import shared

    shared.opts.hires_fix_refiner_pass = refiner_pass
    other = refiner(fresh)
    processed = fresh.txt2img(fresh.tome_args(enabled=True, ratio=0.4, hr_ratio=0.6), steps=STEPS,
                              enable_hr=True, hr_second_pass_steps=3, denoising_strength=0.7,
                              refiner_checkpoint="refiner.safetensors", refiner_switch_at=0.5)
    calls = fresh.calls
    # 4 first-pass evaluations, then int(0.7 * 3) + 1 = 3 in the hires pass.
    assert [c.hr for c in calls] == [False] * 4 + [True] * 3
    assert [c.model is other for c in calls] == switched[fresh.processing]
    assert [c.options.ratio for c in calls] == [0.4] * 4 + [0.6] * 3
    assert [c.levels for c in calls] == [{1} if c.model is other else {0} for c in calls]
    assert tome_keys(processed.infotexts[0]) == {"ToMe ratio": "0.4", "ToMe hr ratio": "0.6", "ToMe size-weighted keys": "True"}
    assert_unpatched(other)


def test_a_job_that_fails_on_the_refiner_leaves_nothing_on_the_next_job(fresh):
    other = refiner(fresh)
    pristine = snapshot(other)

    def fail_on_the_refiner(model, x, t, context):
        raise RuntimeError("out of memory (injected)")

    other.observers.append(fail_on_the_refiner)
    with pytest.raises(RuntimeError, match="injected"):
        fresh.txt2img(fresh.tome_args(enabled=True), steps=STEPS, refiner_checkpoint="refiner.safetensors",
                      refiner_switch_at=0.5)
    other.observers.remove(fail_on_the_refiner)
    assert tome_core.is_patched(other.unet)  # postprocess did not run, as in the webui
    fresh.calls.clear()
    fresh.txt2img(fresh.tome_args(), steps=STEPS, refiner_checkpoint="refiner.safetensors", refiner_switch_at=0.5)
    assert [c.options for c in fresh.calls] == [None] * 4
    now = snapshot(other)
    assert now["hooks"] == 0 and now["modules"] == pristine["modules"]
    assert torch.equal(now["output"], pristine["output"])


def test_a_cache_job_with_the_refiner_keeps_each_models_changes_apart_and_repeats(fresh):
    """Cache keeps each U-Net's changes in its own patch: the refiner's first steps run whole (nothing of the
    base model's is ever applied to it), the job repeats to the pixel, and both models are restored."""
    other = refiner(fresh)
    job = dict(seed=3, steps=6, refiner_checkpoint="refiner.safetensors", refiner_switch_at=0.5)
    cache = fresh.tome_args(enabled=True, method="Cache", cache_warmup=1, cache_interval=2)
    plain = fresh.txt2img(fresh.tome_args(), **job).images[0]
    kept_before = []  # what the refiner's own patch holds before each of its calls
    other.observers.append(lambda model, *_: kept_before.append(
        len(tome_core.get_patch(model.unet).method_patch.kept)))
    first = fresh.txt2img(cache, **job)
    assert [c.model for c in fresh.calls][-6:] == [fresh.model] * 3 + [other] * 3
    assert kept_before[0] == 0 and kept_before[1] > 0  # it starts empty, then keeps its own
    assert not torch.equal(first.images[0], plain)
    assert torch.equal(fresh.txt2img(cache, **job).images[0], first.images[0])
    base_only = fresh.txt2img(fresh.tome_args(enabled=True, method="Cache", cache_warmup=1, cache_interval=2,
                                              step_end=0.5), **job).images[0]
    assert not torch.equal(base_only, first.images[0])  # the refiner's steps reuse too
    assert_unpatched(other)



def test_a_cache_job_with_a_refiner_sharing_the_base_config_forgets_the_base_weights_changes(fresh):
    """A1111 loads such a refiner's weights into the base model's modules, so the patch stays; what it kept was
    made by the base weights, and the refiner's first call (a reused one by the schedule: calls 0 and 2 run
    whole, 1 and 3 reuse) must run whole with its own. (Forge builds a model object for every checkpoint, whose
    own patch starts empty.)"""
    other = refiner(fresh, own_config=False)
    job = dict(seed=3, steps=4, refiner_checkpoint="refiner.safetensors", refiner_switch_at=0.25)
    cache = fresh.tome_args(enabled=True, method="Cache", cache_warmup=1, cache_interval=2)
    seen = []  # before each call: the weights' checkpoint, and how many changes the model's patch holds
    for model in (fresh.model, other):
        model.observers.append(lambda model, *_: seen.append(
            (model.sd_checkpoint_info.title, len(tome_core.get_patch(model.unet).method_patch.kept))))
    first = fresh.txt2img(cache, **job)
    assert [title for title, _ in seen] == ["tiny.safetensors"] + ["refiner.safetensors"] * 3
    kept = [count for _, count in seen]
    assert kept[0] == 0 and kept[1] == 0 and kept[2] > 0
    assert torch.equal(fresh.txt2img(cache, **job).images[0], first.images[0])
    assert_unpatched(fresh.model)
    assert_unpatched(other)


def test_forge_neos_refiner_loaded_into_the_base_modules_tells_other_weights(fresh, monkeypatch):
    """Forge Neo's 'Reload "state_dict" only' refiner (``refiner_fast_sd``) loads the refiner's weights into the
    base model's U-Net, leaves ``sd_checkpoint_info`` as it was and notes the base checkpoint's file in
    ``modules.sd_samplers_common.ORIGINAL_CHECKPOINT`` until the job ends: the weights it tells apart change
    then (and the glue forgets what the patch kept, as for A1111's refiner above)."""
    import types

    import scripts.tokenmerge_hosts as hosts

    common = types.SimpleNamespace(ORIGINAL_CHECKPOINT=None)
    monkeypatch.setitem(sys.modules, "modules.sd_samplers_common", common)
    entry = hosts.host_of(fresh.model)
    before = entry.loaded_weights(fresh.model)
    common.ORIGINAL_CHECKPOINT = "models/Stable-diffusion/tiny.safetensors"
    refined = entry.loaded_weights(fresh.model)
    common.ORIGINAL_CHECKPOINT = None
    assert entry.loaded_weights(fresh.model) == before
    assert (refined != before) == (fresh.processing == "forge")  # A1111's refiner always changes the checkpoint
