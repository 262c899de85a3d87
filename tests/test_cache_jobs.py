"""The Cache method through whole jobs: in the webui double (its own pixels, reproduced from the infotext, the
hires pass and an interrupted job starting afresh, an image independent of its batch) and in the SD.Next double."""

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
