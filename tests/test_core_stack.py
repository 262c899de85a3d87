"""The stack method: whole transformer stacks on merged tokens, against a plain reference written from the method's
definition, on ldm's and diffusers' own transformer classes; one plan per level and call, plan reuse, batch
splits, level choice on SDXL's layout, odd grids, operation counts and exact restore (its int32 path:
test_core_local)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tome_core
from test_core_behaviour import _SkipResizingTorch
from test_core_local import _added_operations
from unets import CONTEXT_DIM, hook_counts, inputs, run, tiny_unet

pytestmark = pytest.mark.filterwarnings("ignore")


# -- the method's meaning, written plainly ------------------------------------------------------------------------

def reference_groups(metric: torch.Tensor, h: int, w: int, ratio: float) -> list[list[int]]:
    """The token groups of one row ``metric`` (N, C) by the method's definition: 2×2 windows in row-major order,
    ``int(4·W·ratio)`` merges (at most 3 a window) spread evenly over them, window j taking
    floor((j+1)·R/W) − floor(j·R/W); one merge joins the bottom pair, two the pairing of the window's four
    tokens with the highest summed cosine (the first of equals in the order 01|23, 02|13, 03|12), three all
    four. Tokens outside whole windows stay alone."""
    wy, wx = h // 2, w // 2
    windows = wy * wx
    total = min(int(4 * windows * ratio), 3 * windows)
    unit = metric.double() / metric.double().norm(dim=-1, keepdim=True).clamp_min(1e-300)
    groups, inside = [], set()
    for j in range(windows):
        q = (j + 1) * total // windows - j * total // windows
        y, x = divmod(j, wx)
        t = [(2 * y) * w + 2 * x, (2 * y) * w + 2 * x + 1, (2 * y + 1) * w + 2 * x, (2 * y + 1) * w + 2 * x + 1]
        inside.update(t)
        if q == 0:
            groups += [[a] for a in t]
        elif q == 1:
            groups += [[t[0]], [t[1]], [t[2], t[3]]]
        elif q == 3:
            groups.append(t)
        else:
            pairings = [((0, 1), (2, 3)), ((0, 2), (1, 3)), ((0, 3), (1, 2))]
            scores = [sum(float(unit[t[a]] @ unit[t[b]]) for a, b in p) for p in pairings]
            best = next(k for k in range(3) if scores[k] >= max(scores) - 1e-9)
            groups += [[t[a] for a in pair] for pair in pairings[best]]
    groups += [[n] for n in range(h * w) if n not in inside]
    return groups


def reference_stack(x: torch.Tensor, h: int, w: int, ratio: float, blocks, **block_kwargs) -> torch.Tensor:
    """Each row's groups averaged, the blocks run on the averages one after the other, and every token given its
    own input plus what the blocks added to its group. The blocks see the groups in an order of the reference's
    own: self-attention, cross-attention and MLP do not depend on the order of the tokens."""
    out = x.clone()
    for b in range(x.shape[0]):
        groups = reference_groups(x[b], h, w, ratio)
        merged = torch.stack([x[b, g].mean(0) for g in groups])[None]
        y = merged
        for blk in blocks:
            y = blk(y, **{k: v[b:b + 1] for k, v in block_kwargs.items()})
        for m, g in enumerate(groups):
            out[b, g] = x[b, g] + (y - merged)[0, m]
    return out


def _randomize(module: nn.Module, std: float = 0.2) -> nn.Module:
    """ldm and diffusers zero-initialise proj_out: with it at zero the stack adds nothing and every comparison of
    the transformer's output would pass."""
    gen = torch.Generator().manual_seed(99)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "proj_out" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    return module.eval()


def ldm_stack(depth: int = 3, channels: int = 32, linear: bool = False) -> nn.Module:
    from ldm.modules.attention import SpatialTransformer

    torch.manual_seed(3)
    return _randomize(SpatialTransformer(channels, 2, channels // 2, depth=depth, context_dim=[CONTEXT_DIM] * depth,
                                         use_linear=linear))


def diffusers_stack(depth: int = 3, channels: int = 32) -> nn.Module:
    from diffusers.models.transformers.transformer_2d import Transformer2DModel

    torch.manual_seed(3)
    return _randomize(Transformer2DModel(num_attention_heads=2, attention_head_dim=channels // 2,
                                         in_channels=channels, num_layers=depth, cross_attention_dim=CONTEXT_DIM,
                                         norm_num_groups=8))


def _stack_io(transformer: nn.Module, call) -> tuple[torch.Tensor, torch.Tensor]:
    """(first block's input, last block's output as the transformer goes on with it) of one call."""
    seen = {}
    blocks = transformer.transformer_blocks
    def first_input(module, args, kwargs):
        seen.setdefault("x", args[0] if args else next(iter(kwargs.values())))

    handles = [blocks[0].register_forward_pre_hook(first_input, with_kwargs=True, prepend=True),
               blocks[-1].register_forward_hook(lambda m, a, o: seen.__setitem__("y", o))]  # after the patch's
    try:
        with torch.no_grad():
            call()
    finally:
        for handle in handles:
            handle.remove()
    return seen["x"], seen["y"]


@pytest.mark.parametrize("family", ["ldm", "ldm-linear", "diffusers"])
@pytest.mark.parametrize("h,w,ratio", [(8, 8, 0.5), (9, 7, 0.5), (6, 10, 0.3), (8, 6, 0.75), (8, 8, 0.25)])
def test_a_stack_equals_the_plain_reference(family, h, w, ratio):
    """Every block of the stack on the groups' means, each token its input plus its group's change, on the
    family's own transformer classes (a lone transformer plans at each of its calls)."""
    if family == "diffusers":
        transformer = diffusers_stack()
        kw_name = "encoder_hidden_states"
    else:
        transformer = ldm_stack(linear=family == "ldm-linear")
        kw_name = "context"
    gen = torch.Generator().manual_seed(h * 100 + w)
    image = torch.randn(2, 32, h, w, generator=gen)
    text = torch.randn(2, 5, CONTEXT_DIM, generator=gen)
    if family == "diffusers":
        def call():
            return transformer(image, encoder_hidden_states=text).sample
    else:
        def call():
            return transformer(image, context=[text] * 3)
    tokens, plain_out = _stack_io(transformer, call)
    tome_core.apply_patch(transformer, method="stack", ratio=ratio)
    patched_tokens, merged_out = _stack_io(transformer, call)
    tome_core.remove_patch(transformer)
    assert torch.equal(patched_tokens, tokens)  # the stack's input is the unmerged one's
    expected = reference_stack(tokens, h, w, ratio, transformer.transformer_blocks, **{kw_name: text})
    torch.testing.assert_close(merged_out, expected, rtol=1e-4, atol=1e-4)
    # The reference moves the output where the unmerged stack puts it, but not onto it: the test can fail.
    assert (merged_out - plain_out).abs().max() > 1e-3


def test_every_block_of_a_merged_stack_sees_fewer_tokens_and_the_rest_of_the_unet_all():
    """SDXL's layout at ``max_downsample`` 4: both attention levels' stacks, every block's self-attention,
    cross-attention and MLP on the merged tokens; outside the blocks the U-Net sees every token."""
    unet = tiny_unet("sdxl")
    x, t, c = inputs(batch=2, h=32, w=32)
    shapes = {}
    blocks = [m for m in unet.modules() if type(m).__name__ == "BasicTransformerBlock"]
    for i, blk in enumerate(blocks):
        for part in ("attn1", "attn2", "ff"):
            getattr(blk, part).register_forward_pre_hook(
                lambda m, a, k, key=(i, part): shapes.__setitem__(key, tuple((a[0] if a else k["x"]).shape)),
                with_kwargs=True)
    run(unet, x, t, c)
    plain = dict(shapes)
    tome_core.apply_patch(unet, method="stack", ratio=0.5, max_downsample=4)
    out = run(unet, x, t, c)
    tome_core.remove_patch(unet)
    assert out.shape == x.shape
    for key, (batch, n, ch) in plain.items():
        assert shapes[key] == (batch, n // 2, ch), key  # 2 merges in each 2×2 window of even grids
    # Levels auto on SDXL: both attention levels too (its first holds 17% of the work, the second 63%) ...
    shapes.clear()
    tome_core.apply_patch(unet, method="stack", ratio=0.5)
    run(unet, x, t, c)
    tome_core.remove_patch(unet)
    for key, (batch, n, ch) in plain.items():
        assert shapes[key] == (batch, n // 2, ch), key
    # ... and levels 2 its first attention level only.
    tome_core.apply_patch(unet, method="stack", ratio=0.5, max_downsample=2)
    run(unet, x, t, c)
    tome_core.remove_patch(unet)
    top = max(n for _, n, _ in plain.values())
    for key, (batch, n, ch) in plain.items():
        assert shapes[key][1] == (n // 2 if n == top else n), key


def test_ratio_zero_and_outside_the_step_window_are_bitwise_noops_and_remove_restores_exactly():
    unet = tiny_unet("sdxl")
    x, t, c = inputs(batch=2)
    base = run(unet, x, t, c)
    hooks = hook_counts(unet)
    tome_core.apply_patch(unet, method="stack", ratio=0.0, max_downsample=4)
    assert torch.equal(run(unet, x, t, c), base)
    tome_core.apply_patch(unet, method="stack", ratio=0.5, max_downsample=4, step_start=0.5)
    tome_core.set_progress(unet, 0.2)
    assert torch.equal(run(unet, x, t, c), base)
    tome_core.set_progress(unet, 0.7)
    assert not torch.equal(run(unet, x, t, c), base)
    tome_core.remove_patch(unet)
    assert hook_counts(unet) == hooks
    assert torch.equal(run(unet, x, t, c), base)


def _count_plans(monkeypatch):
    made = []
    real = tome_core.methods.stack.plan_stack

    def counting(metric, h, w, ratio, idt):
        made.append((tuple(metric.shape), h, w))
        return real(metric, h, w, ratio, idt)

    monkeypatch.setattr("tome_core.methods.stack.plan_stack", counting)
    return made


def test_one_plan_per_level_and_call_and_reuse_every_k_evaluations(monkeypatch):
    """The first stack of a level plans for all of the level's stacks (SDXL's layout, two levels: two plans
    a call); with ``local_replan`` 3 and the progress reported, evaluations 1, 2, 4, 5 reuse the plans."""
    unet = tiny_unet("sdxl")
    x, t, c = inputs(batch=2)
    made = _count_plans(monkeypatch)
    noise = torch.randn((6,) + x.shape, generator=torch.Generator().manual_seed(5))

    def sample(every):
        tome_core.apply_patch(unet, method="stack", ratio=0.5, max_downsample=4, local_replan=every)
        outs, counts = [], []
        for step in range(6):
            tome_core.set_progress(unet, (step + 0.5) / 6)
            before = len(made)
            outs.append(run(unet, x + noise[step], t, c))
            counts.append(len(made) - before)
        tome_core.remove_patch(unet)
        return torch.stack(outs), counts

    plain, counts = sample(1)
    assert counts == [2] * 6
    reused, counts = sample(3)
    assert counts == [2, 0, 0, 2, 0, 0]
    assert torch.equal(reused[0], plain[0]) and torch.equal(reused[3], plain[3])
    assert not torch.equal(reused[1], plain[1])
    assert torch.equal(sample(3)[0], reused)  # reproducible


def test_cond_and_uncond_apart_equal_stacked():
    """Plans are per batch row: split calls give each row the plan of the stacked call."""
    unet = tiny_unet("sdxl")
    x, t, c = inputs(batch=2)
    tome_core.apply_patch(unet, method="stack", ratio=0.5, max_downsample=4)
    stacked = run(unet, x, t, c)
    apart = torch.cat([run(unet, x[i:i + 1], t[i:i + 1], c[i:i + 1]) for i in range(2)])
    tome_core.remove_patch(unet)
    torch.testing.assert_close(apart, stacked, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("h,w", [(8, 8), (9, 9), (17, 8), (11, 23), (12, 20)])
def test_every_latent_size_works(monkeypatch, h, w):
    import ldm.modules.diffusionmodules.openaimodel as openaimodel

    monkeypatch.setattr(openaimodel, "th", _SkipResizingTorch())  # the U-Net's own skip joins need it
    unet = tiny_unet("sdxl")
    x, t, c = inputs(batch=1, h=h, w=w)
    tome_core.apply_patch(unet, method="stack", ratio=0.6, max_downsample=4)
    out = run(unet, x, t, c)
    tome_core.remove_patch(unet)
    assert out.shape == x.shape and torch.isfinite(out).all()


def test_operations_added_per_stack_are_few_and_do_not_grow_with_the_image():
    """Merge and restore are a few large operations per stack; the plan, made once per level and call, is
    shared by the level's stacks (this U-Net has 5 at its top level and 3 below it)."""
    unet = tiny_unet("sdxl")
    stacks = sum(1 for m in unet.modules() if type(m).__name__ == "SpatialTransformer")
    counts = {}
    for side in (16, 32, 48):
        x, t, c = inputs(batch=2, h=side, w=side)
        counts[side], _ = _added_operations(unet, x, t, c, method="stack", ratio=0.5, max_downsample=4)
        assert counts[side] / stacks <= 15, (side, counts[side], stacks)
    assert len(set(counts.values())) == 1, counts


def test_a_stack_whose_output_another_extension_changed_is_left_as_it_is():
    """A last block whose output is not on the merged tokens (another extension gave them back itself) is left
    alone and counted, not restored twice; the next call merges again."""
    transformer = ldm_stack(depth=2)
    image = torch.randn(1, 32, 8, 8)
    text = torch.randn(1, 5, CONTEXT_DIM)
    tome_core.apply_patch(transformer, method="stack", ratio=0.5)
    grow = transformer.transformer_blocks[1].register_forward_hook(lambda m, a, o: o.repeat(1, 2, 1), prepend=True)
    with torch.no_grad():
        out = transformer(image, context=[text] * 2)
    grow.remove()
    assert out.shape == image.shape
    assert tome_core.get_patch(transformer).unmerged_calls == 1
    _, y = _stack_io(transformer, lambda: transformer(image, context=[text] * 2))
    assert y.shape == (1, 64, 32)
    tome_core.remove_patch(transformer)


@pytest.mark.parametrize("kwargs,exc,name", [
    (dict(ratio=0.8), None, None),  # above the 2×2 window's cap: every window merges all four
    (dict(ratio=1.0), ValueError, "ratio"),
    (dict(ratio=-0.1), ValueError, "ratio"),
    (dict(max_downsample=3), ValueError, "max_downsample"),
    (dict(local_replan=0), ValueError, "local_replan"),
])
def test_bad_options_are_refused_and_leave_the_model_alone(kwargs, exc, name):
    unet = tiny_unet("sdxl")
    hooks = hook_counts(unet)
    if exc is None:
        tome_core.apply_patch(unet, method="stack", **kwargs)
        tome_core.remove_patch(unet)
    else:
        with pytest.raises(exc, match=name):
            tome_core.apply_patch(unet, method="stack", **kwargs)
    assert hook_counts(unet) == hooks and not tome_core.is_patched(unet)
