"""The Cache method through whole jobs: in the webui double (its own pixels, reproduced from the infotext, the
hires pass, a failed job and one stopped by Interrupt each leaving nothing for the next, an image independent of
its batch) and in the SD.Next double."""

from __future__ import annotations

import pytest
import torch

from tome_core import settings as tm
from webui_double.testing import fresh, host, infotext_params, tome_keys  # noqa: F401  (fixtures)

CACHE = dict(enabled=True, method="Cache", cache_warmup=1, cache_interval=2)


def test_a_cache_job_has_its_own_pixels_and_its_infotext_reproduces_them(fresh):
    plain = fresh.txt2img(fresh.tome_args(), steps=6).images[0]
    job = fresh.txt2img(fresh.tome_args(**CACHE), steps=6)
    assert not torch.equal(job.images[0], plain)
    assert tome_keys(job.infotexts[0]) == {"ToMe ratio": "0.5", "ToMe method": "Cache", "ToMe cache interval": "2",
                                           "ToMe cache warmup": "1"}
    pasted = tm.TokenMergeSettings.from_infotext(infotext_params(job.infotexts[0]))
    assert pasted == tm.TokenMergeSettings(ratio=0.5, **CACHE).effective()
    args = fresh.tome_args(**{k: getattr(pasted, k) for k in tm.KEYS})
    assert torch.equal(fresh.txt2img(args, steps=6).images[0], job.images[0])
    fresh.assert_pristine()


def test_the_hires_pass_starts_afresh_and_an_interrupted_job_leaves_nothing(fresh):
    hires = dict(steps=6, enable_hr=True, hr_scale=1.5, hr_second_pass_steps=4, denoising_strength=0.7)
    first = fresh.txt2img(fresh.tome_args(**CACHE), **hires).images[0]
    calls = []

    def stop_at_the_third(model, x, t, context):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("interrupted (injected)")

    fresh.model.observers.append(stop_at_the_third)
    with pytest.raises(RuntimeError, match="interrupted"):
        fresh.txt2img(fresh.tome_args(**CACHE), seed=99, **hires)
    fresh.model.observers.remove(stop_at_the_third)
    assert torch.equal(fresh.txt2img(fresh.tome_args(**CACHE), **hires).images[0], first)
    fresh.assert_pristine()


def test_an_image_does_not_depend_on_the_batch_it_was_made_in(fresh):
    alone = fresh.txt2img(fresh.tome_args(**CACHE), steps=6, seed=21).images[0]
    batch = fresh.txt2img(fresh.tome_args(**CACHE), steps=6, seed=21, batch_size=2).images
    # Up to the rounding the unpatched U-Net itself shows between a batch of one and of two (the CPU's matrix
    # products sum in another order): a kept change of another row would move it by far more.
    plain_alone = fresh.txt2img(fresh.tome_args(), steps=6, seed=21).images[0]
    plain_batch = fresh.txt2img(fresh.tome_args(), steps=6, seed=21, batch_size=2).images[0]
    rounding = (plain_batch - plain_alone).abs().max().item()
    assert (batch[0] - alone).abs().max().item() <= max(2 * rounding, 1e-5)
    assert not torch.allclose(batch[1], alone, atol=1e-2)  # the second image is another picture
    fresh.assert_pristine()


def test_a_job_stopped_by_interrupt_leaves_nothing_for_the_next(fresh):
    """The WebUI's Interrupt: the sampler stops at its next evaluation and the job ends normally with what was
    sampled (postprocess runs); the next Cache job of the same seed gives the whole job's pixels."""
    from modules import shared

    hires = dict(steps=6, enable_hr=True, hr_scale=1.5, hr_second_pass_steps=4, denoising_strength=0.7)
    whole = fresh.txt2img(fresh.tome_args(**CACHE), seed=99, **hires).images[0]
    calls = []

    def interrupt_at_the_third(model, x, t, context):
        calls.append(1)
        if len(calls) == 3:
            shared.state.interrupt()

    fresh.model.observers.append(interrupt_at_the_third)
    stopped = fresh.txt2img(fresh.tome_args(**CACHE), seed=99, **hires)
    fresh.model.observers.remove(interrupt_at_the_third)
    assert len(calls) == 3  # nothing ran after the interrupt, the hires pass included
    assert stopped.images[0].shape != whole.shape and tome_keys(stopped.infotexts[0])["ToMe method"] == "Cache"
    fresh.assert_pristine()  # postprocess removed the patch
    assert torch.equal(fresh.txt2img(fresh.tome_args(**CACHE), seed=99, **hires).images[0], whole)
    fresh.assert_pristine()
