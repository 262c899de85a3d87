"""The engine on Forge's U-Net (the Forge double's classes around ldm modules, with Forge's call signatures
and patch points) and on reForge's and Forge Classic's ``ldm_patched`` U-Net (the reForge double): exact ToMe
against tomesd on an ldm U-Net holding the same weights, keys and values merged also when the host passes
them explicitly, ToDo, the seeded partition, and a clean restore."""

from __future__ import annotations

import pytest
import tomesd
import torch

import tome_core
import tome_core.patch
import reforge_double
from forge_double import install_backend
from unets import LatentModel, hook_counts, inputs, tiny_unet

install_backend()
reforge_double.install()
from forge_double.model import forge_unet  # noqa: E402  (needs the backend on the path)
from ldm_patched.ldm.modules import attention as ldm_patched_attention  # noqa: E402
from reforge_double.model import reforge_unet  # noqa: E402

HOSTS = ["forge", "reforge", "forge classic"]


@pytest.fixture(params=HOSTS)
def host_unet(request, monkeypatch):
    """The U-Net class of each host, as a function of an ldm U-Net whose modules it takes over."""
    monkeypatch.setattr(ldm_patched_attention, "FORGE_CLASSIC", request.param == "forge classic")
    return forge_unet if request.param == "forge" else reforge_unet

pytestmark = pytest.mark.filterwarnings("ignore")


def identity_attn1_patch(n, context, value, extra_options):
    """Any attn1 patch (Forge's own token merging, another extension's) makes Forge pass self-attention's
    key/value source explicitly: context=n, value=n."""
    return n, context, value


def copying_attn1_patch(n, context, value, extra_options):
    """A patch that hands back new tensors with the same values."""
    return n.clone(), context.clone(), value.clone()


def twins(layout: str, host_unet=forge_unet):
    """An ldm U-Net and a host's U-Net (Forge's by default) holding the same weights, loaded from one state
    dict."""
    ldm = tiny_unet(layout)
    forge = host_unet(tiny_unet(layout, seed=99))
    assert set(forge.state_dict()) == set(ldm.state_dict())  # the checkpoint's key names, in both
    forge.load_state_dict(ldm.state_dict())
    return ldm, forge


def forge_call(unet, x, t, c, attn1_patches=()):
    options = {"patches": {"attn1_patch": list(attn1_patches)}} if attn1_patches else {}
    with torch.no_grad():
        return unet(x, t, context=c, transformer_options=options)


def ldm_call(unet, x, t, c):
    with torch.no_grad():
        return unet(x, t, context=c)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


CASES = [
    ("sd1", 2, 32, 32, dict(ratio=0.5)),
    ("sd1", 1, 40, 24, dict(ratio=0.6, sx=3, sy=3)),
    ("sd1", 2, 32, 32, dict(ratio=0.5, max_downsample=4, merge_crossattn=True, merge_mlp=True)),
    ("sd2", 2, 32, 32, dict(ratio=0.5, merge_mlp=True)),
    ("sd2", 4, 16, 24, dict(ratio=0.4, max_downsample=8)),
    ("sdxl", 2, 32, 32, dict(ratio=0.5)),                     # levels auto: SDXL's highest attention level
    ("sdxl", 2, 40, 24, dict(ratio=0.5, max_downsample=4, merge_crossattn=True)),
]


@pytest.mark.parametrize("attn1_patches", [(), (identity_attn1_patch,), (copying_attn1_patch,)],
                         ids=["no patch", "attn1 patch", "copying attn1 patch"])
@pytest.mark.parametrize("layout,batch,h,w,options", CASES)
def test_forge_unet_patched_by_us_gives_tomesd_on_ldm(layout, batch, h, w, options, attn1_patches, host_unet):
    ldm, forge = twins(layout, host_unet)
    x, t, c = inputs(batch, h, w)
    ldm_plain, forge_plain = ldm_call(ldm, x, t, c), forge_call(forge, x, t, c, attn1_patches)
    tomesd_options = dict(options)
    if layout == "sdxl" and "max_downsample" not in options:
        tomesd_options["max_downsample"] = 2  # what "auto" selects on SDXL; tomesd's default selects nothing
    model = LatentModel(ldm)
    tomesd.apply_patch(model, use_rand=False, **tomesd_options)
    reference = ldm_call(ldm, x, t, c)
    tomesd.remove_patch(model)
    tome_core.apply_patch(forge, use_rand=False, **options)
    ours = forge_call(forge, x, t, c, attn1_patches)
    tome_core.remove_patch(forge)

    kernel_difference = max_diff(forge_plain, ldm_plain)  # Forge's attention kernel is not ldm's
    merge_effect = max_diff(reference, ldm_plain)
    assert merge_effect > 1000 * kernel_difference  # the merge moves the output far beyond rounding
    # Rounding of the other kernel passes through the merge, so allow it twice over.
    assert max_diff(ours, reference) <= 2 * kernel_difference


def test_merging_only_the_queries_under_an_attn1_patch_is_caught(monkeypatch):
    """The check above is sharp: a patch that merges x alone while Forge passes keys and values explicitly
    (queries-only merging, as Forge's built-in does) is far from tomesd."""
    ldm, forge = twins("sd1")
    x, t, c = inputs(2, 32, 32)
    model = LatentModel(ldm)
    tomesd.apply_patch(model, ratio=0.5, use_rand=False)
    reference = ldm_call(ldm, x, t, c)
    tomesd.remove_patch(model)
    kernel_difference = max_diff(forge_call(forge, x, t, c), ldm_call(ldm, x, t, c))
    monkeypatch.setattr(tome_core.methods.tome, "map_kv_sources", lambda *args: None)
    tome_core.apply_patch(forge, ratio=0.5, use_rand=False)
    naive = forge_call(forge, x, t, c, (identity_attn1_patch,))
    tome_core.remove_patch(forge)
    assert max_diff(naive, reference) > 1000 * kernel_difference


@pytest.mark.parametrize("options", [dict(method="todo"), dict(method="todo", todo_factor=4, todo_pool="average"),
                                     dict(ratio=0.5, use_rand=True, seed=1234), dict(method="local", ratio=0.5),
                                     dict(method="local", ratio=0.7, merge_mlp=True, max_downsample=2),
                                     dict(method="stack", ratio=0.5, max_downsample=2)])
@pytest.mark.parametrize("attn1_patches", [(), (identity_attn1_patch,)], ids=["no patch", "attn1 patch"])
def test_todo_and_the_seeded_partition_act_on_forge_as_on_ldm(options, attn1_patches, host_unet):
    """What was checked on ldm against the paper's definitions (ToDo: attention on downsampled keys and
    values; the seeded random partition) holds on Forge's U-Net, also when keys and values come explicitly."""
    ldm, forge = twins("sd1", host_unet)
    x, t, c = inputs(2, 32, 32)
    kernel_difference = max_diff(forge_call(forge, x, t, c), ldm_call(ldm, x, t, c))
    tome_core.apply_patch(ldm, **options)
    on_ldm = ldm_call(ldm, x, t, c)
    tome_core.remove_patch(ldm)
    tome_core.apply_patch(forge, **options)
    on_forge = forge_call(forge, x, t, c, attn1_patches)
    tome_core.remove_patch(forge)
    assert max_diff(on_ldm, ldm_call(ldm, x, t, c)) > 1000 * kernel_difference
    assert max_diff(on_forge, on_ldm) <= 2 * kernel_difference


def test_a_key_value_source_of_another_length_is_left_alone():
    """Extra reference tokens appended to self-attention's keys and values (reference-only style patches)
    cannot follow the merge plan: queries merge, the extra keys and values stay whole, and the block runs."""
    _, forge = twins("sd1")
    x, t, c = inputs(1, 16, 16)
    seen = []

    def append_reference(n, context, value, extra_options):
        extra = torch.zeros_like(context[:, :5])
        return n, torch.cat([context, extra], 1), torch.cat([value, extra], 1)

    tome_core.apply_patch(forge, ratio=0.5)
    # Registered after ours, this pre-hook sees what attention gets.
    attention = forge.input_blocks[1][1].transformer_blocks[0].attn1
    handle = attention.register_forward_pre_hook(
        lambda m, a, k: seen.append((a[0].shape[1], k["context"].shape[1], k["value"].shape[1])), with_kwargs=True)
    out = forge_call(forge, x, t, c, (append_reference,))
    handle.remove()
    tome_core.remove_patch(forge)
    tokens = 16 * 16
    assert seen == [(tokens - tokens // 2, tokens + 5, tokens + 5)]
    assert torch.isfinite(out).all()


def test_remove_patch_leaves_forges_unet_as_it_was():
    _, forge = twins("sdxl")
    x, t, c = inputs(2, 32, 32)
    before = forge_call(forge, x, t, c)
    tome_core.apply_patch(forge, ratio=0.5, merge_mlp=True)
    assert tome_core.patched_blocks(forge)  # SDXL merges at default levels on Forge too
    tome_core.remove_patch(forge)
    assert hook_counts(forge) == {}
    assert torch.equal(forge_call(forge, x, t, c), before)
