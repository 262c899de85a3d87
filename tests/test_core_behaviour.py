"""Patching rules of tome_core: exact no-ops, exact restore, levels, grids, call styles, coexistence."""

import subprocess
import sys

import pytest
import tomesd
import torch
import torch.nn.functional as F
from torch import nn

import tome_core
from tome_core.patch import PATCH_ATTR, transformer_levels
from unets import LatentModel, hook_counts, inputs, run, tiny_unet

pytestmark = pytest.mark.filterwarnings("ignore")


def test_ratio_zero_is_bitwise_noop():
    unet = tiny_unet()
    x, t, c = inputs()
    base = run(unet, x, t, c)
    tome_core.apply_patch(unet, ratio=0.0)
    assert torch.equal(run(unet, x, t, c), base)


def test_remove_patch_restores_exactly_and_leaves_nothing():
    unet = tiny_unet()
    model = LatentModel(unet)
    x, t, c = inputs()
    base = run(unet, x, t, c)
    hooks_before = hook_counts(unet)
    classes_before = [type(m) for m in unet.modules()]
    attrs_before = [sorted(vars(m)) for m in unet.modules()]
    for method in ("tome", "todo"):
        tome_core.apply_patch(model, ratio=0.5, method=method, merge_crossattn=True, merge_mlp=True)
        assert tome_core.is_patched(model)
        assert not torch.allclose(run(unet, x, t, c), base, atol=1e-5)
        tome_core.remove_patch(model)
        assert not tome_core.is_patched(model)
        assert torch.equal(run(unet, x, t, c), base)
        assert hook_counts(unet) == hooks_before
        assert [type(m) for m in unet.modules()] == classes_before
        assert [sorted(vars(m)) for m in unet.modules()] == attrs_before
    tome_core.remove_patch(model)  # removing twice is harmless


def test_apply_again_replaces_settings():
    unet = tiny_unet()
    x, t, c = inputs()
    tome_core.apply_patch(unet, ratio=0.3, use_rand=False, max_downsample=1)
    first = run(unet, x, t, c)
    n_hooks = hook_counts(unet)
    tome_core.apply_patch(unet, ratio=0.6, use_rand=False, max_downsample=1)
    assert tome_core.get_patch(unet).options.ratio == 0.6
    assert hook_counts(unet) == n_hooks  # replaced, not stacked
    second = run(unet, x, t, c)
    tome_core.apply_patch(unet, ratio=0.3, use_rand=False, max_downsample=1)
    assert torch.equal(run(unet, x, t, c), first)
    assert not torch.equal(first, second)


def test_coexists_with_tomesd_markers():
    """The webui's built-in calls tomesd.remove_patch; it must not undo our patch, nor ours undo tomesd's."""
    unet = tiny_unet()
    model = LatentModel(unet)
    x, t, c = inputs()
    tome_core.apply_patch(model, ratio=0.5, use_rand=False)
    ours = run(unet, x, t, c)
    tomesd.remove_patch(model)
    assert tome_core.is_patched(model)
    assert torch.equal(run(unet, x, t, c), ours)
    tome_core.remove_patch(model)

    tomesd.apply_patch(model, ratio=0.5, use_rand=False)
    theirs = run(unet, x, t, c)
    tome_core.remove_patch(model)
    assert any(type(m).__name__ == "ToMeBlock" for m in unet.modules())
    assert torch.equal(run(unet, x, t, c), theirs)
    tomesd.remove_patch(model)
    assert all(type(m).__name__ != "ToMeBlock" for m in unet.modules())
    assert all(not hasattr(m, PATCH_ATTR) for m in unet.modules())


def selected(model):
    return [b.name for b in tome_core.patched_blocks(model)]


def test_auto_levels_sd1_match_max_downsample_1():
    unet = tiny_unet("sd1")
    x, t, c = inputs()
    tome_core.apply_patch(unet, use_rand=False)
    auto_blocks, auto_out = selected(unet), run(unet, x, t, c)
    tome_core.apply_patch(unet, use_rand=False, max_downsample=1)
    assert selected(unet) == auto_blocks
    assert torch.equal(run(unet, x, t, c), auto_out)
    assert auto_blocks == ["input_blocks.1.1.transformer_blocks.0", "output_blocks.6.1.transformer_blocks.0",
                           "output_blocks.7.1.transformer_blocks.0"]


def test_auto_levels_sdxl_merge_where_tomesd_default_does_nothing():
    unet = tiny_unet("sdxl")
    model = LatentModel(unet)
    x, t, c = inputs()
    base = run(unet, x, t, c)
    tomesd.apply_patch(model, ratio=0.5)
    assert torch.equal(run(unet, x, t, c), base), "tomesd's default should not merge on SDXL"
    tomesd.remove_patch(model)
    tome_core.apply_patch(model, ratio=0.5)
    assert selected(model) == ["input_blocks.3.1.transformer_blocks.0", "output_blocks.2.1.transformer_blocks.0",
                               "output_blocks.3.1.transformer_blocks.0"]
    assert not torch.allclose(run(unet, x, t, c), base, atol=1e-4)
    levels = {name: level for name, _, level in transformer_levels(unet)}
    assert levels["input_blocks.3.1"] == 1 and levels["middle_block.1"] == 2


def test_max_downsample_selects_levels():
    unet = tiny_unet("sd1")
    counts = {}
    for md in (1, 2, 4, 8):
        tome_core.apply_patch(unet, max_downsample=md)
        counts[md] = len(selected(unet))
    assert counts == {1: 3, 2: 6, 4: 9, 8: 10}


def test_keyword_call_equals_positional_call():
    unet = tiny_unet()
    x, t, c = inputs()
    tome_core.apply_patch(unet, ratio=0.5, seed=5)
    with torch.no_grad():
        positional = unet(x, t, context=c)
        keyword = unet(x=x, timesteps=t, context=c)
    assert torch.equal(positional, keyword)


class _SkipResizingTorch:
    """What the webui does to ldm's U-Net: mismatched skip tensors are resized before concatenation, so any
    latent size runs (the plain U-Net needs multiples of 8)."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def cat(tensors, *args, **kwargs):
        if len(tensors) == 2 and tensors[0].shape[-2:] != tensors[1].shape[-2:]:
            tensors = [F.interpolate(tensors[0], size=tensors[1].shape[-2:], mode="nearest"), tensors[1]]
        return torch.cat(tensors, *args, **kwargs)


@pytest.mark.parametrize("h,w", [(8, 8), (9, 9), (33, 36), (17, 8), (11, 23)])
def test_every_latent_size_works(monkeypatch, h, w):
    """Grids are read from each transformer's input, not guessed: tomesd's estimate breaks on sizes like
    33×36 (264×288 px) at max_downsample 8."""
    import ldm.modules.diffusionmodules.openaimodel as openaimodel

    monkeypatch.setattr(openaimodel, "th", _SkipResizingTorch())
    unet = tiny_unet("sd1")
    x, t, c = inputs(2, h, w)
    base = run(unet, x, t, c)
    grids = []
    tome_core.apply_patch(unet, ratio=0.5, max_downsample=8, use_rand=True)
    for rec in tome_core.get_patch(unet).selected:
        rec.module.register_forward_pre_hook(lambda m, a, rec=rec: grids.append((rec.level, rec.grid,
                                                                                a[0].shape[1])))
    out = run(unet, x, t, c)
    assert out.shape == base.shape and torch.isfinite(out).all()
    assert not torch.equal(out, base)
    for level, (gh, gw), tokens in grids:
        assert gh * gw == tokens
    # the level-0 grid is the latent itself
    assert any(g == (h, w) for lv, g, _ in grids if lv == 0)


class SgmStyleAttention(nn.Module):
    """sgm's CrossAttention takes extra keyword arguments; this one records them and what x it was given."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.seen = []

    def forward(self, x, context=None, additional_tokens=None, n_times_crossframe_attn_in_self=0):
        self.seen.append((x.shape[1], additional_tokens, n_times_crossframe_attn_in_self))
        return self.inner(x, context=context)


class SgmStyleBlock(nn.Module):
    """The signature of sgm's BasicTransformerBlock (SDXL): extra arguments reach attn1 and attn2."""

    def __init__(self, inner):
        super().__init__()
        self.attn1, self.attn2 = SgmStyleAttention(inner.attn1), SgmStyleAttention(inner.attn2)
        self.ff = inner.ff
        self.norm1, self.norm2, self.norm3 = inner.norm1, inner.norm2, inner.norm3

    def forward(self, x, context=None, additional_tokens=None, n_times_crossframe_attn_in_self=0):
        x = self.attn1(self.norm1(x), context=None, additional_tokens=additional_tokens,
                       n_times_crossframe_attn_in_self=n_times_crossframe_attn_in_self) + x
        x = self.attn2(self.norm2(x), context=context, additional_tokens=additional_tokens) + x
        return self.ff(self.norm3(x)) + x


def test_sgm_block_signature_keeps_working():
    unet = tiny_unet("sd1")
    transformer = unet.input_blocks[1][1]
    transformer.transformer_blocks[0] = SgmStyleBlock(transformer.transformer_blocks[0])
    x = torch.randn(2, 32, 16, 16)
    c = torch.randn(2, 7, 24)
    blk = transformer.transformer_blocks[0]
    extra = torch.randn(2, 3, 32)
    with torch.no_grad():
        base = transformer(x, context=c)
        tome_core.apply_patch(transformer, ratio=0.5)
        out = transformer(x, context=c)
        blk.attn1.seen.clear()
        direct = blk(torch.randn(2, 256, 32), context=c, additional_tokens=extra, n_times_crossframe_attn_in_self=2)
    assert out.shape == base.shape and not torch.equal(out, base)
    assert direct.shape == (2, 256, 32)
    # The merged x (256 - 128 tokens) reached attn1 together with sgm's own keyword arguments.
    tokens, tokens_arg, n_times = blk.attn1.seen[-1]
    assert (tokens, tokens_arg is extra, n_times) == (128, True, 2)


def test_single_spatial_transformer_can_be_patched_alone():
    unet = tiny_unet("sd1")
    transformer = unet.input_blocks[1][1]
    x = torch.randn(2, 32, 16, 16)
    c = torch.randn(2, 7, 24)
    with torch.no_grad():
        base = transformer(x, context=c)
        tome_core.apply_patch(transformer, ratio=0.5)
        assert [b.level for b in tome_core.patched_blocks(transformer)] == [0]
        assert not torch.equal(transformer(x, context=c), base)
        tome_core.remove_patch(transformer)
        assert torch.equal(transformer(x, context=c), base)


def test_step_window_runs_unpatched_outside():
    unet = tiny_unet()
    x, t, c = inputs()
    base = run(unet, x, t, c)
    tome_core.apply_patch(unet, ratio=0.5, step_start=0.25, step_end=0.5)
    inside = None
    for progress, active in ((0.0, False), (0.2, False), (0.25, True), (0.4, True), (0.5, True), (0.51, False),
                             (1.0, False), (None, True)):
        tome_core.set_progress(unet, progress)
        out = run(unet, x, t, c)
        if active:
            assert not torch.equal(out, base)
            inside = out if inside is None else inside
        else:
            assert torch.equal(out, base), progress
    with pytest.raises(ValueError, match="progress"):
        tome_core.set_progress(unet, 1.5)


def test_import_loads_no_host_modules():
    code = ("import sys, tome_core, tome_core.settings\n"
            "bad = [m for m in ('modules', 'gradio', 'ldm', 'sgm', 'diffusers', 'tomesd') if m in sys.modules]\n"
            "print(','.join(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=tome_core.__path__[0] + "/..")
    assert out.stdout.strip() == ""


def test_each_block_draws_its_own_partition(monkeypatch):
    """The partition is keyed on (seed, timestep, block): blocks of one level differ within a call, and the
    same block at the same timestep gets the same partition in every call."""
    import tome_core.methods.tome as patch_module

    unet = tiny_unet("sd1")
    x, t, c = inputs()
    drawn = []  # the destinations each block's merge plan is built on, in call order
    original = patch_module.plan_split
    monkeypatch.setattr(patch_module, "plan_split",
                        lambda metric, rows, r, chunk: drawn.append(rows.dst.clone()) or
                        original(metric, rows, r, chunk))
    tome_core.apply_patch(unet, ratio=0.5, seed=3)
    run(unet, x, t, c)
    run(unet, x, t, c)
    assert len(drawn) == 6  # three level-0 blocks, two calls
    first, second = drawn[:3], drawn[3:]
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert not torch.equal(first[0], first[1]) and not torch.equal(first[1], first[2])


def test_diffusion_wrapper_resolves_to_its_u_net():
    unet = tiny_unet("sd1")
    wrapper = LatentModel(unet).model  # what the webui calls DiffusionWrapper: .diffusion_model is the U-Net
    tome_core.apply_patch(wrapper, ratio=0.5)
    assert tome_core.get_patch(unet) is tome_core.get_patch(wrapper)
    assert len(tome_core.patched_blocks(unet)) == 3
    tome_core.remove_patch(wrapper)
    assert not tome_core.is_patched(unet)
