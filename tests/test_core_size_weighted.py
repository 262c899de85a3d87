"""Size-weighted keys: a self-attention key that stands for k tokens adds log k to its logit.

Independent expectation: the module's own attention (its class forward, no hooks) with each key and value
repeated k times, which is what the weighting stands in for; off, outputs are exactly the default's.
"""

from __future__ import annotations

import pytest
import torch

import tome_core
from diffusers_unets import diffusers_unet, run_diffusers
from unets import inputs, run, tiny_unet

pytestmark = pytest.mark.filterwarnings("ignore")


def _first_attn1(model):
    rec = tome_core.get_patch(model).selected[0]
    return rec, rec.module.attn1


def _capture(attn1, rec):
    """Hooks after ours on attn1: the call's arguments as ours left them, the plan, and the output."""
    seen = {}

    def pre(module, args, kwargs):
        seen.setdefault("args", (args, dict(kwargs)))
        seen.setdefault("plan", rec.plan)

    def post(module, args, output):
        seen.setdefault("out", output)

    return seen, [attn1.register_forward_pre_hook(pre, with_kwargs=True), attn1.register_forward_hook(post)]


def _repeated(tokens: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """(B, M, C) rows repeated by their sizes (B, M) along the token axis -> (B, sum of sizes, C)."""
    return torch.stack([torch.repeat_interleave(t, s.round().long(), dim=0) for t, s in zip(tokens, sizes)])


def _class_forward(attn1, x, kv, diffusers: bool):
    """The module's own attention, bypassing hooks and any instance forward: keys and values from ``kv``."""
    with torch.no_grad():
        if diffusers:
            return type(attn1).forward(attn1, x, encoder_hidden_states=kv)
        return type(attn1).forward(attn1, x, context=kv)


FAMILIES = {
    "ldm": (lambda: tiny_unet("sd1"), lambda m, x, t, c: run(m, x, t, c), False),
    "diffusers": (lambda: diffusers_unet("sd1"), run_diffusers, True),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_tome_weighted_attention_equals_keys_repeated_by_group_size(family):
    build, call, is_diffusers = FAMILIES[family]
    unet = build()
    x, t, c = inputs(2, 32, 24)
    tome_core.apply_patch(unet, ratio=0.6, use_rand=False, size_weighted_keys=True)
    rec, attn1 = _first_attn1(unet)
    seen, handles = _capture(attn1, rec)
    call(unet, x, t, c)
    for h in handles:
        h.remove()
    (args, _), plan = seen["args"], seen["plan"]
    merged = args[0]
    sizes = plan.counts.view(plan.batch, plan.merged_tokens)
    assert sizes.max() > sizes.min()  # uneven groups, or the weighting would cancel
    reference = plan.unmerge(_class_forward(attn1, merged, _repeated(merged, sizes), is_diffusers))
    torch.testing.assert_close(seen["out"], reference, atol=2e-5, rtol=1e-4)
    tome_core.remove_patch(unet)


@pytest.mark.parametrize("family", FAMILIES)
def test_local_weighted_attention_equals_kept_keys_repeated_by_group_size(family):
    build, call, is_diffusers = FAMILIES[family]
    unet = build()
    x, t, c = inputs(2, 32, 24)
    tome_core.apply_patch(unet, method="local", ratio=0.25, size_weighted_keys=True)  # pairs and singles
    rec, attn1 = _first_attn1(unet)
    seen, handles = _capture(attn1, rec)
    call(unet, x, t, c)
    for h in handles:
        h.remove()
    (args, kwargs), plan = seen["args"], seen["plan"]
    tokens = args[0]
    kept = plan.merge(tokens)
    sizes = plan.sizes.view(plan.batch, plan.merged_tokens)
    assert sorted(set(sizes.flatten().tolist())) == [1.0, 2.0]
    assert torch.equal(sizes.sum(-1), torch.full((plan.batch,), float(plan.tokens)))
    reference = _class_forward(attn1, tokens, _repeated(kept, sizes), is_diffusers)
    torch.testing.assert_close(seen["out"], reference, atol=2e-5, rtol=1e-4)
    tome_core.remove_patch(unet)


@pytest.mark.parametrize("family", FAMILIES)
def test_off_is_the_default_and_todo_ignores_it(family):
    build, call, _ = FAMILIES[family]
    unet = build()
    x, t, c = inputs(2, 32, 32)
    base = call(unet, x, t, c)
    for method, extra in (("tome", dict(ratio=0.5, seed=3)), ("local", dict(ratio=0.25)), ("todo", {})):
        tome_core.apply_patch(unet, method=method, **extra)
        default = call(unet, x, t, c)
        tome_core.apply_patch(unet, method=method, size_weighted_keys=False, **extra)
        assert torch.equal(call(unet, x, t, c), default)
        tome_core.apply_patch(unet, method=method, size_weighted_keys=True, **extra)
        weighted = call(unet, x, t, c)
        if method == "todo":
            assert torch.equal(weighted, default)
        else:
            assert (weighted - default).abs().max() > 1e-5
    tome_core.remove_patch(unet)
    assert torch.equal(call(unet, x, t, c), base)
    assert not any("forward" in m.__dict__ for m in unet.modules())  # no instance forward left behind


def test_another_extensions_instance_forward_is_kept_and_given_back():
    """ldm's attention takes no bias, so the patch sets its own forward on attn1. Where another extension had
    set one there before (the webui's Hypertile does, on every attention layer), calls without a bias go to
    that one, and removing the patch gives it back: the module is as it was."""
    unet = tiny_unet("sd1")
    x, t, c = inputs(2, 32, 32)
    calls = []

    def wrapped_forward(attn):
        inner = attn.forward

        def forward(*args, **kwargs):
            calls.append(attn)
            return inner(*args, **kwargs)
        return forward

    attn_layers = [m for name, m in unet.named_modules() if name.endswith(("attn1", "attn2"))]
    for attn in attn_layers:
        attn.forward = wrapped_forward(attn)
    theirs = {attn: attn.__dict__["forward"] for attn in attn_layers}
    base = run(unet, x, t, c)
    tome_core.apply_patch(unet, ratio=0.5, seed=3, size_weighted_keys=True)
    rec, attn1 = _first_attn1(unet)
    assert attn1.__dict__["forward"] is not theirs[attn1]
    calls.clear()
    run(unet, x, t, c)
    # Merged self-attention computes the weighted attention itself; every other layer still goes through theirs.
    assert attn1 not in calls and set(calls) == set(attn_layers) - {b.block.attn1 for b in
                                                                    tome_core.patched_blocks(unet)}
    tome_core.remove_patch(unet)
    assert {attn: attn.__dict__.get("forward") for attn in attn_layers} == theirs
    assert torch.equal(run(unet, x, t, c), base)


def test_the_bias_is_broadcast_over_queries_not_a_token_by_token_mask(monkeypatch):
    import torch.nn.functional as F

    shapes = []
    sdpa = F.scaled_dot_product_attention

    def recording(q, k, v, attn_mask=None, **kwargs):
        if attn_mask is not None:
            shapes.append((tuple(k.shape), tuple(attn_mask.shape)))
        return sdpa(q, k, v, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    x, t, c = inputs(2, 32, 32)
    for build, call, _ in FAMILIES.values():
        unet = build()
        tome_core.apply_patch(unet, ratio=0.5, size_weighted_keys=True)
        call(unet, x, t, c)
        tome_core.remove_patch(unet)
    assert shapes
    for k, mask in shapes:
        assert mask[-2] == 1 and mask[-1] == k[-2]  # one row for all queries, one entry per key


def test_bad_value_is_refused():
    unet = diffusers_unet("sd1")
    with pytest.raises(TypeError, match="size_weighted_keys must be True or False"):
        tome_core.apply_patch(unet, size_weighted_keys="yes")
    assert not tome_core.is_patched(unet)
