"""Through whole jobs in the Forge family (Forge, reForge / Forge Classic): an attn1 replacement
(``patches_replace``, the Forge family's patch point) keeps ToMe out of those blocks, and the console says so."""

from __future__ import annotations

import pytest
import torch

from webui_double.testing import fresh, started_host, tome_keys  # noqa: F401  (fixtures)


@pytest.fixture(scope="module", params=["forge", "reforge"])
def host(request):
    with started_host(request.param) as started:
        yield started


def image(processed) -> torch.Tensor:
    return torch.as_tensor(processed.images[0])


def test_an_attn1_replacement_in_the_forge_family_is_reported(fresh, capsys):
    from tome_core.patch import transformer_levels

    def replacement(q, k, v, extra_options):
        heads = extra_options["n_heads"]
        b, n, inner = q.shape
        q, k, v = (z.reshape(b, -1, heads, inner // heads).transpose(1, 2) for z in (q, k, v))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, inner)

    keys = [(name.split(".")[0].split("_")[0], int(name.split(".")[1]), 0)
            for name, _, level in transformer_levels(fresh.unet) if level == 0]
    patcher = fresh.model.forge_objects_after_applying_lora.unet
    saved = patcher.model_options
    patcher.model_options = {**saved, "transformer_options": {
        **saved["transformer_options"], "patches_replace": {"attn1": {key: replacement for key in keys}}}}
    try:
        plain = fresh.txt2img()
        processed = fresh.txt2img(fresh.tome_args(enabled=True, ratio=0.5))
    finally:
        patcher.model_options = saved
    out = capsys.readouterr().out
    assert "block calls ran without merging" in out
    # Every merged block's attention was replaced, and ToMe merges nothing else by default: the same image.
    assert torch.equal(image(processed), image(plain))
    assert tome_keys(processed.infotexts[0]) == {"ToMe ratio": "0.5", "ToMe size-weighted keys": "True"}
