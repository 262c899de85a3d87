"""ToMe equals the paper's reference implementation (tomesd 0.1.3, a test dependency only).

With ``use_rand=False`` both use the same fixed partition, so a patched U-Net must give tomesd's output.
"""

import pytest
import tomesd
import tomesd.merge
import torch

import tome_core
from tome_core.partition import fixed_partition
from unets import LatentModel, inputs, tiny_unet

pytestmark = pytest.mark.filterwarnings("ignore")


def _outputs(layout, batch, h, w, **options):
    unet = tiny_unet(layout)
    model = LatentModel(unet)
    x, t, c = inputs(batch, h, w)
    with torch.no_grad():
        base = unet(x, t, context=c)
        tomesd.apply_patch(model, use_rand=False, **options)
        ref = unet(x, t, context=c)
        tomesd.remove_patch(model)
        tome_core.apply_patch(model, use_rand=False, **options)
        ours = unet(x, t, context=c)
        tome_core.remove_patch(model)
    return base, ref, ours


CASES = [
    # layout, batch, latent h, w, options
    ("sd1", 2, 32, 32, dict(ratio=0.5)),
    ("sd1", 1, 32, 32, dict(ratio=0.5)),
    ("sd1", 4, 16, 16, dict(ratio=0.5)),
    ("sd1", 2, 40, 24, dict(ratio=0.25)),               # non-square, odd grid at the lowest level (5×3)
    ("sd1", 2, 24, 40, dict(ratio=0.9)),                # above the cap: every source merges
    ("sd1", 2, 40, 24, dict(ratio=0.6, sx=3, sy=3)),    # stride does not divide the grid
    ("sd1", 2, 32, 32, dict(ratio=0.5, sx=1, sy=1)),    # stride 1: nothing can merge
    ("sd1", 2, 32, 32, dict(ratio=0.8, sx=4, sy=4)),
    ("sd1", 2, 32, 24, dict(ratio=0.5, sx=4, sy=2)),
    ("sd1", 2, 32, 32, dict(ratio=0.5, max_downsample=2)),
    ("sd1", 2, 40, 24, dict(ratio=0.5, max_downsample=4)),
    ("sd1", 2, 40, 24, dict(ratio=0.5, max_downsample=8)),
    ("sd1", 2, 32, 32, dict(ratio=0.5, merge_crossattn=True)),
    ("sd1", 2, 32, 32, dict(ratio=0.5, merge_mlp=True)),
    ("sd1", 1, 24, 32, dict(ratio=0.7, merge_crossattn=True, merge_mlp=True, max_downsample=2)),
    ("sd1", 2, 32, 32, dict(ratio=0.5, merge_attn=False, merge_mlp=True)),
    ("sd2", 2, 32, 32, dict(ratio=0.5)),
    ("sd2", 1, 40, 24, dict(ratio=0.4, max_downsample=8, merge_mlp=True)),
    ("sd2", 4, 16, 24, dict(ratio=0.5, sx=2, sy=3)),
    ("sdxl", 2, 32, 32, dict(ratio=0.5, max_downsample=2)),
    ("sdxl", 2, 40, 24, dict(ratio=0.5, max_downsample=4, merge_crossattn=True)),
]


@pytest.mark.parametrize("layout,batch,h,w,options", CASES)
def test_unet_output_equals_tomesd(layout, batch, h, w, options):
    options = dict(options)
    if "max_downsample" not in options:
        options["max_downsample"] = 1  # tomesd's default; ours defaults to the model's top attention level
    base, ref, ours = _outputs(layout, batch, h, w, **options)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    sx, sy = options.get("sx", 2), options.get("sy", 2)
    if sx * sy > 1:
        assert not torch.allclose(ref, base, atol=1e-4), "the oracle merged nothing: the case proves nothing"


@pytest.mark.parametrize("h,w", [(1, 1), (1, 7), (2, 2), (3, 5), (5, 3), (7, 9), (8, 8), (9, 16), (13, 11)])
@pytest.mark.parametrize("sx,sy", [(1, 1), (2, 2), (3, 2), (2, 3), (4, 4)])
def test_merge_then_unmerge_equals_tomesd_on_any_grid(h, w, sx, sy):
    """tomesd's matching function, given the true grid, is the oracle for every grid size and stride."""
    gen = torch.Generator().manual_seed(h * 100 + w * 10 + sx + sy)
    metric = torch.randn(2, h * w, 6, generator=gen)
    values = torch.randn(2, h * w, 5, generator=gen)
    for ratio in (0.3, 0.5, 0.99):
        r = int(h * w * ratio)
        if (h // sy) * (w // sx) == 0:  # no whole cell, so no destination: tomesd raises, we merge nothing
            src, dst = fixed_partition(h, w, sx, sy, torch.device("cpu"), torch.int64)
            assert dst.numel() == 0 and tome_core.plan_merge(metric, src, dst, r) is None
            continue
        m_ref, u_ref = tomesd.merge.bipartite_soft_matching_random2d(metric, w, h, sx, sy, r, no_rand=True)
        for dtype in (torch.int64, torch.int32):
            src, dst = fixed_partition(h, w, sx, sy, torch.device("cpu"), dtype)
            plan = tome_core.plan_merge(metric, src, dst, r)
            if plan is None:  # nothing to merge: tomesd must agree that no token changes
                torch.testing.assert_close(u_ref(m_ref(values)), values)
                continue
            merged = plan.merge(values)
            assert merged.shape == m_ref(values).shape
            torch.testing.assert_close(plan.unmerge(merged), u_ref(m_ref(values)), rtol=1e-6, atol=1e-6)
            # the merged set is the same multiset of rows, whatever the order
            torch.testing.assert_close(merged.sort(dim=1).values, m_ref(values).sort(dim=1).values,
                                       rtol=1e-6, atol=1e-6)


# -- half precision: the paper's matching in exact arithmetic as the oracle ----------------------------------

@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.float16, 4e-3), (torch.bfloat16, 3e-2)])
def test_half_precision_plan_departs_from_exact_matching_only_at_near_ties(dtype, tolerance):
    # GPUs and Macs run the U-Net in half precision. Rounding may swap near-tied choices, but nothing more:
    # every merged source goes to a destination whose exact cosine similarity is within rounding of its best,
    # and the merged sources are the r most similar ones, again up to rounding. Exact = float64 on the same
    # rounded tokens. Tokens are a smooth field plus noise, so near-ties occur as in image features.
    gen = torch.Generator().manual_seed(0)
    batch, h, w, c = 2, 32, 24, 64
    smooth = torch.nn.functional.interpolate(torch.randn(batch, c, 4, 3, generator=gen), size=(h, w),
                                             mode="bilinear")
    x = ((smooth + 0.3 * torch.randn(batch, c, h, w, generator=gen)).flatten(2).transpose(1, 2) * 5).to(dtype)
    src, dst = fixed_partition(h, w, 2, 2, torch.device("cpu"), torch.int64)
    r = h * w // 2
    plan = tome_core.plan_merge(x, src, dst, r)

    unit = x.double() / x.double().norm(dim=-1, keepdim=True)
    similarity = unit[:, src] @ unit[:, dst].transpose(1, 2)  # (B, Ns, Nd)
    best = similarity.max(dim=-1).values
    kept = src.numel() - r
    slots = plan.slot_index.view(batch, h * w) - torch.arange(batch)[:, None] * plan.merged_tokens
    src_slots = slots[:, src]
    merged = src_slots >= kept
    assert merged.sum(dim=1).tolist() == [r] * batch
    for b in range(batch):
        chosen = src_slots[b][merged[b]] - kept
        chosen_similarity = similarity[b][merged[b]].gather(1, chosen[:, None]).squeeze(1)
        assert (best[b][merged[b]] - chosen_similarity).max() <= tolerance
        assert best[b][merged[b]].min() >= best[b][~merged[b]].max() - tolerance
