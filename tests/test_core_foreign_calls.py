"""Self-attention called in a way the merge plan was not made for: on a subset of the batch (ControlNet's
reference mode attends with the unconditional rows alone), on tiled tokens (HyperTile in the Forge family
hands attn1 (B·T, N/T, C)), or not at all (an attn1 replacement). Such a call gets exact attention on its own
input, for ToMe and ToDo; the ordinary calls of the same block stay merged; nothing raises."""

from __future__ import annotations

import types

import pytest
import torch

import tome_core
import tome_core.patch
from forge_double import install_backend
from unets import inputs, run, tiny_unet

install_backend()
from forge_double.model import forge_unet  # noqa: E402  (needs the backend on the path)

METHODS = [dict(method="tome", ratio=0.5, use_rand=False), dict(method="todo", todo_factor=2)]
METHOD_IDS = ["tome", "todo"]


def top_blocks(unet):
    return [b.block for b in tome_core.patched_blocks(unet)]


def unhooked_attention(attn, x, **kwargs):
    """What ``attn`` computes on ``x`` with no hook at all (ours or anyone's)."""
    with torch.no_grad():
        return type(attn).forward(attn, x, **kwargs)


def add_subset_calls(block, seen: list):
    """Make an ldm block also attend with the first batch row alone, as ControlNet's reference mode does for
    its style-fidelity branch; the result is recorded, not used, so the block's output is unchanged."""
    original = block._forward

    def _forward(self, x, context=None):
        n = self.norm1(x)[:1]
        seen.append((n.clone(), self.attn1(n, context=None)))
        return original(x, context)

    block._forward = types.MethodType(_forward, block)


@pytest.mark.parametrize("options", METHODS, ids=METHOD_IDS)
def test_attention_on_a_subset_of_the_batch_is_exact_and_the_ordinary_call_stays_merged(options):
    x, t, c = inputs(batch=2)
    reference_unet = tiny_unet()
    tome_core.apply_patch(reference_unet, **options)
    merged_output = run(reference_unet, x, t, c)  # the patched U-Net with no extra attention calls
    plain_output = run(tiny_unet(), x, t, c)
    assert (merged_output - plain_output).abs().max() > 1e-3  # the method does change this U-Net

    unet = tiny_unet()
    tome_core.apply_patch(unet, **options)
    seen: list = []
    for block in top_blocks(unet):
        add_subset_calls(block, seen)
    output = run(unet, x, t, c)  # raised before: index_add_(): Number of indices (2048) ... (1024)

    assert torch.equal(output, merged_output)
    assert len(seen) == len(top_blocks(unet))
    for block, (n, out) in zip(top_blocks(unet), seen):
        assert torch.equal(out, unhooked_attention(block.attn1, n))
    patch = tome_core.get_patch(unet)
    assert patch.unmerged_calls == len(seen)
    assert patch.unused_plans == 0
    tome_core.remove_patch(unet)
    assert torch.equal(run(unet, x, t, c), plain_output)


def hypertile_patches(model_channels: int, tiles: int = 2):
    """The Forge family's HyperTile as it meets attention: an attn1_patch that splits the top level's tokens
    into tiles×tiles tiles along both sides ((B, h·w, C) -> (B·tiles², h·w / tiles², C), keys and values from
    the tile) and an attn1_output_patch that puts them back."""
    state = {}

    def tile(q, k, v, extra_options):
        if q.shape[-1] != model_channels:
            return q, k, v
        b, n, c = q.shape
        h, w = extra_options["original_shape"][-2:]
        th, tw = h // tiles, w // tiles
        q = q.view(b, tiles, th, tiles, tw, c).permute(0, 1, 3, 2, 4, 5).reshape(b * tiles * tiles, th * tw, c)
        state["shape"] = (b, h, w, th, tw, c)
        return q, q, q

    def untile(out, extra_options):
        shape = state.pop("shape", None)
        if shape is None:
            return out
        b, h, w, th, tw, c = shape
        return out.view(b, tiles, tiles, th, tw, c).permute(0, 1, 3, 2, 4, 5).reshape(b, h * w, c)

    return tile, untile


@pytest.mark.parametrize("options", METHODS, ids=METHOD_IDS)
def test_tiled_self_attention_in_forge_runs_exact(options):
    unet = forge_unet(tiny_unet())
    x, t, c = inputs(batch=2)
    tile, untile = hypertile_patches(unet.model_channels)
    transformer_options = {"patches": {"attn1_patch": [tile], "attn1_output_patch": [untile]}}

    def call():
        with torch.no_grad():
            return unet(x, t, context=c, transformer_options=dict(transformer_options))

    tiled = call()
    tome_core.apply_patch(unet, **options)  # only the top level, whose every attn1 call is tiled
    patched = call()  # raised before: The size of tensor a (256) must match the size of tensor b (1024)
    patch = tome_core.get_patch(unet)
    assert torch.equal(patched, tiled)
    assert patch.unmerged_calls == len(patch.blocks) > 0
    assert patch.unused_plans == len(patch.blocks)
    tome_core.remove_patch(unet)

    # Without the tiling the same patch does merge: the equality above is the fallback, not a patch that
    # does nothing.
    tome_core.apply_patch(unet, **options)
    with torch.no_grad():
        assert (unet(x, t, context=c) - run(forge_unet(tiny_unet()), x, t, c)).abs().max() > 1e-3
    tome_core.remove_patch(unet)


def test_an_attn1_replacement_leaves_the_block_whole_and_is_counted():
    """A ``patches_replace`` entry for attn1 makes Forge's block call attn1's projections directly, so no
    hook on attn1 runs: the block is computed whole (exactly as without ToMe) and the plan is counted as
    unused, for the host to tell the user."""
    unet = forge_unet(tiny_unet())
    x, t, c = inputs(batch=2)
    calls = []

    def replacement(q, k, v, extra_options):
        calls.append(q.shape)
        heads = extra_options["n_heads"]
        b, n, inner = q.shape
        q, k, v = (z.reshape(b, -1, heads, inner // heads).transpose(1, 2) for z in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return out.transpose(1, 2).reshape(b, n, inner)

    # Forge's key for a block: (block kind, index of the U-Net block, index of the transformer block).
    keys = []
    for name, transformer, level in tome_core.patch.transformer_levels(unet):
        kind, index = name.split(".")[:2]
        if level == 0:
            keys += [(kind.split("_")[0], int(index), i) for i in range(len(transformer.transformer_blocks))]
    options = {"patches_replace": {"attn1": {key: replacement for key in keys}}}

    def call():
        with torch.no_grad():
            return unet(x, t, context=c, transformer_options=dict(options))

    plain = call()
    calls.clear()
    tome_core.apply_patch(unet, ratio=0.5, use_rand=False)
    patched = call()
    patch = tome_core.get_patch(unet)
    assert len(calls) == len(keys) == len(patch.blocks)
    assert all(shape[1] == 32 * 32 for shape in calls)  # the replacement saw every token
    assert torch.equal(patched, plain)
    assert patch.unused_plans == len(patch.blocks) and patch.unmerged_calls == 0
    tome_core.remove_patch(unet)
