"""The local method: its merge math against a plain reference, one plan per level and call, plan reuse across
evaluations, static operation counts, batch splits, the int32 path, odd grids and SDXL levels."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import tome_core
from tome_core import local as loc
from tome_core.merge import downsample_tokens
from test_core_behaviour import _SkipResizingTorch
from test_core_random_mps_todo import OpRecorder, violations
from unets import hook_counts, inputs, run, tiny_unet

pytestmark = pytest.mark.filterwarnings("ignore")


def reference_keep(x: torch.Tensor, h: int, w: int, ratio: float) -> torch.Tensor:
    """The plan's meaning, written plainly with Python loops (the oracle of the tests here): the kept tokens
    (B, M, C) of ``x`` (B, h·w, C), with ``x`` itself as the similarity metric: per batch row, each window's
    groups' first members in window order, then the edge tokens in token order."""
    batch, n, _ = x.shape
    windows_y, windows_x = h // loc.WINDOW, w // loc.WINDOW
    merges = loc.window_merges(windows_y * windows_x, ratio)
    out = []
    for b in range(batch):
        rows, edges = [], []
        for j, q in enumerate(merges):
            wy, wx = divmod(j, windows_x)
            tokens = [(wy * 2 + dy) * w + wx * 2 + dx for dy in (0, 1) for dx in (0, 1)]
            feats = x[b, tokens].double()
            unit = feats / feats.norm(dim=-1, keepdim=True).clamp_min(1e-300)
            best, best_groups = None, None
            for cq, groups in loc.CANDIDATES:
                if cq != q or (q == 1 and loc.SINGLE_MERGE_PAIR not in groups):
                    continue
                score = sum(float(unit[g[0]] @ unit[g[1]]) for g in groups if len(g) == 2)
                if best is None or score > best + 1e-6:
                    best, best_groups = score, groups
            rows.extend(x[b, tokens[min(g)]] for g in best_groups)
        for y in range(h):
            for xx in range(w):
                if y >= windows_y * 2 or xx >= windows_x * 2:
                    edges.append(x[b, y * w + xx])
        out.append(torch.stack(rows + edges))
    return torch.stack(out)


# -- the plan's math -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("h,w", [(8, 8), (9, 7), (5, 6), (3, 3), (2, 2), (12, 4)])
@pytest.mark.parametrize("ratio", [0.1, 0.25, 0.3, 0.5, 0.6, 0.75, 0.9])
def test_kept_tokens_equal_a_plain_reference(h, w, ratio):
    """Per window, the grouping with the window's merge count and the most similar pairs, each group kept as
    its first member; edge tokens of odd grids always kept; the int32 and int64 paths give the same plan."""
    x = torch.randn(3, h * w, 6, generator=torch.Generator().manual_seed(h * 100 + w))
    plans = [loc.plan_local(x, h, w, ratio, idt) for idt in (torch.int32, torch.int64)]
    want = reference_keep(x, h, w, ratio)
    if want.shape[1] == h * w:  # no merge at all: no plan
        assert plans == [None, None]
        return
    for plan in plans:
        assert torch.equal(plan.merge(x), want)  # a gather of real tokens: bit for bit
    assert torch.equal(plans[0].keep_index.long(), plans[1].keep_index)
    windows = (h // 2) * (w // 2)
    assert plans[0].merged_tokens == h * w - min(int(4 * windows * ratio), 3 * windows)


def test_the_most_similar_pairs_merge():
    """Two windows of 2×2 tokens whose alike pairs are known: the kept tokens are one of each alike pair."""
    a, b, c, d = torch.eye(4)
    # Window 1: locals 0 and 3 alike, 1 and 2 alike; window 2: 0 and 1 alike, 2 and 3 alike.
    grid = torch.zeros(2, 4, 4)  # (rows, cols, C) of a 2×4 token grid
    grid[0, 0], grid[1, 1], grid[0, 1], grid[1, 0] = a, a + 0.01 * b, c, c + 0.01 * d
    grid[0, 2], grid[0, 3], grid[1, 2], grid[1, 3] = b, b + 0.01 * a, d, d + 0.01 * c
    x = grid.reshape(1, 8, 4)
    plan = loc.plan_local(x, 2, 4, 0.5, torch.int64)
    assert plan.keep_index.tolist() == [0, 1, 2, 6]  # (0,3)|(1,2) keeps locals 0, 1; (0,1)|(2,3) keeps 0, 2


def test_one_merge_per_window_leaves_out_the_bottom_right_token_whatever_the_features():
    x = torch.randn(2, 6 * 8, 5)
    plan = loc.plan_local(x, 6, 8, 0.25, torch.int64)
    grid = x.view(2, 3, 2, 4, 2, 5)  # (B, window row, dy, window col, dx, C)
    want = torch.stack([grid[:, :, 0, :, 0], grid[:, :, 0, :, 1], grid[:, :, 1, :, 0]], dim=3)  # locals 0, 1, 2
    assert torch.equal(plan.merge(x), want.reshape(2, 3 * 4 * 3, 5))


@pytest.mark.parametrize("ratio", [0.1, 0.25, 0.75, 0.9])
def test_a_plan_without_choices_costs_a_call_nothing(ratio):
    """With one or three merges in every window the kept tokens do not depend on the features: once the
    grid's tables exist, making the plan dispatches no operation at all."""
    x, other = torch.randn(2, 8 * 8, 5), torch.randn(2, 8 * 8, 5)
    loc.plan_local(x, 8, 8, ratio, torch.int64)
    with DispatchCounter() as counter:
        plan = loc.plan_local(other, 8, 8, ratio, torch.int64)
    assert counter.count == 0 and plan.merged_tokens < 64
    with DispatchCounter() as counter:
        loc.plan_local(x, 8, 8, 0.5, torch.int64)  # two merges per window: the features choose
    assert counter.count > 0


def test_three_merges_per_window_are_todos_nearest_downsampling():
    """At the window's cap every group is the whole window and stands for it by its top-left token: the
    plan gives the key/value source of ToDo with factor 2 and nearest pooling, whatever the features."""
    x = torch.randn(2, 8 * 6, 5)
    plan = loc.plan_local(x, 8, 6, 0.75, torch.int64)
    assert torch.equal(plan.merge(x), downsample_tokens(x, 8, 6, 2, "nearest"))


def test_merge_counts_are_static_and_evenly_spread():
    assert loc.window_merges(4, 0.5) == [2, 2, 2, 2]
    assert loc.window_merges(5, 0.3) == [1, 1, 1, 1, 2]  # int(20 · 0.3) = 6 merges
    assert loc.window_merges(3, 0.9) == [3, 3, 3]  # capped: one token per window stays
    assert sum(loc.window_merges(2304, 0.45)) == int(4 * 2304 * 0.45)


def test_nothing_to_merge_gives_no_plan():
    assert loc.plan_local(torch.randn(1, 5, 4), 1, 5, 0.5, torch.int64) is None  # no whole 2×2 window
    assert loc.plan_local(torch.randn(1, 4, 4), 2, 2, 0.1, torch.int64) is None  # int(4 · 0.1) = 0 merges


# -- in the U-Net --------------------------------------------------------------------------------------------

def test_ratio_zero_is_bitwise_noop_and_remove_restores_exactly():
    unet = tiny_unet()
    x, t, c = inputs()
    before, hooks = run(unet, x, t, c), hook_counts(unet)
    tome_core.apply_patch(unet, ratio=0.0, method="local")
    assert torch.equal(run(unet, x, t, c), before)
    tome_core.apply_patch(unet, ratio=0.5, method="local", local_replan=3)
    assert not torch.equal(run(unet, x, t, c), before)
    tome_core.remove_patch(unet)
    assert torch.equal(run(unet, x, t, c), before) and hook_counts(unet) == hooks


def _count_plans(monkeypatch):
    made = []
    real = loc.plan_local

    def counting(metric, h, w, ratio, idt, with_sizes=False):
        made.append((tuple(metric.shape), h, w))
        return real(metric, h, w, ratio, idt, with_sizes)

    monkeypatch.setattr("tome_core.methods.local.plan_local", counting)
    return made


@pytest.mark.parametrize("layout,levels", [("sd1", 1), ("sdxl", 4), ("sd1", 8)])
def test_one_plan_per_level_and_call_used_by_every_block_of_the_level(monkeypatch, layout, levels):
    unet = tiny_unet(layout)
    x, t, c = inputs()
    made = _count_plans(monkeypatch)
    tome_core.apply_patch(unet, ratio=0.5, method="local", max_downsample=None if levels == 1 else levels)
    patch = tome_core.get_patch(unet)
    used = []
    for rec in patch.selected:
        rec.module.attn1.register_forward_pre_hook(lambda m, a, rec=rec: used.append((rec.level, id(rec.plan))))
    run(unet, x, t, c)
    selected_levels = {rec.level for rec in patch.selected}
    if layout == "sdxl" and levels == 4:
        assert selected_levels == {1, 2}  # SDXL has no attention at full resolution
    assert len(made) == len(selected_levels)
    for level in selected_levels:
        assert len({plan for lv, plan in used if lv == level}) == 1
    assert len(used) == len(patch.selected) > len(selected_levels)


def test_auto_levels_on_sdxl_merge_at_its_first_attention_level():
    unet = tiny_unet("sdxl")
    tome_core.apply_patch(unet, method="local")
    assert {b.level for b in tome_core.patched_blocks(unet)} == {1}
    x, t, c = inputs()
    assert run(unet, x, t, c).shape == x.shape


@pytest.mark.parametrize("h,w", [(8, 8), (9, 9), (17, 8), (11, 23), (33, 36)])
def test_every_latent_size_works(monkeypatch, h, w):
    import ldm.modules.diffusionmodules.openaimodel as openaimodel

    monkeypatch.setattr(openaimodel, "th", _SkipResizingTorch())
    unet = tiny_unet()
    x, t, c = inputs(batch=2, h=h, w=w)
    before = run(unet, x, t, c)
    tome_core.apply_patch(unet, ratio=0.6, method="local", max_downsample=8, merge_crossattn=True, merge_mlp=True)
    out = run(unet, x, t, c)
    assert out.shape == before.shape and torch.isfinite(out).all()


def test_cond_and_uncond_apart_equal_stacked_also_with_plan_reuse():
    """Plans are per batch row, so split calls give each row the plan of the stacked call; with reuse, the
    calls of one evaluation are told apart by their order, the same in every evaluation."""
    unet = tiny_unet()
    x, t, c = inputs(batch=2)
    for every in (1, 3):
        outs = {}
        for split in (False, True):
            tome_core.apply_patch(unet, ratio=0.5, method="local", local_replan=every)
            steps = []
            for step in range(4):
                tome_core.set_progress(unet, (step + 0.5) / 4)
                xs = x * (1 - 0.1 * step)
                if split:
                    steps.append(torch.cat([run(unet, xs[i:i + 1], t[i:i + 1], c[i:i + 1]) for i in range(2)]))
                else:
                    steps.append(run(unet, xs, t, c))
            outs[split] = torch.stack(steps)
        # Float noise of batched against single-row kernels only; a different plan moves outputs by ~1e-2.
        torch.testing.assert_close(outs[True], outs[False], rtol=1e-5, atol=1e-5)


def test_plan_reuse_every_k_evaluations(monkeypatch):
    """Fresh plans at evaluations 0, k, 2k, ... of a run, reused in between; a lower progress starts a new
    run; k = 1, or no progress, plans every call and equals no reuse bit for bit."""
    unet = tiny_unet()
    x, t, c = inputs(batch=2)
    made = _count_plans(monkeypatch)
    # Each step's latent differs in direction, not only in scale (cosine similarity ignores scale).
    noise = torch.randn((6,) + x.shape, generator=torch.Generator().manual_seed(5))

    def sample(every, progress=True, steps=6):
        tome_core.apply_patch(unet, ratio=0.5, method="local", local_replan=every)
        outs, counts = [], []
        for step in range(steps):
            tome_core.set_progress(unet, (step + 0.5) / steps if progress else None)
            before = len(made)
            outs.append(run(unet, x + noise[step], t, c))
            counts.append(len(made) - before)
        return torch.stack(outs), counts

    plain, counts = sample(1, progress=False)
    assert counts == [1] * 6
    every_one, counts = sample(1)
    assert torch.equal(every_one, plain) and counts == [1] * 6
    reused, counts = sample(3)
    assert counts == [1, 0, 0, 1, 0, 0]
    assert torch.equal(reused[0], plain[0]) and torch.equal(reused[3], plain[3])
    assert not torch.equal(reused[1], plain[1])
    again, _ = sample(3)
    assert torch.equal(again, reused)
    # The same patch, a second run: progress goes back down, so the run starts with fresh plans.
    patch = tome_core.get_patch(unet)
    for step in range(2):
        tome_core.set_progress(unet, (step + 0.5) / 6)
        before = len(made)
        out = run(unet, x + noise[step], t, c)
        assert len(made) - before == (1 if step == 0 else 0)
        assert torch.equal(out, reused[step])
    assert tome_core.get_patch(unet) is patch


class DispatchCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def _added_operations(unet, x, t, c, **options) -> tuple[int, int]:
    def count():
        run(unet, x, t, c)  # tables made once per grid are not what a step costs
        with DispatchCounter() as counter:
            run(unet, x, t, c)
        return counter.count

    plain = count()
    tome_core.apply_patch(unet, **options)
    blocks = len(tome_core.patched_blocks(unet))
    added = count() - plain
    tome_core.remove_patch(unet)
    return added, blocks


def test_operations_added_per_block_are_few_and_do_not_grow_with_the_image():
    """A count of dispatched operations is behaviour, not time: each costs host time on a GPU. The kept keys
    and values are one gather (and its views) per block; the plan about a dozen per level and call, shared by
    the level's blocks (SD 1.5's top level has 5, SDXL's 10; this U-Net's 3, the hardest case)."""
    unet = tiny_unet("sd1")
    x = torch.randn(2, 64, 8)
    plan = loc.plan_local(x, 8, 8, 0.5, torch.int64)
    with DispatchCounter() as counter:
        plan.merge(x)
    assert counter.count <= 3
    counts = {}
    for side in (16, 32, 48):
        x, t, c = inputs(batch=2, h=side, w=side)
        added, blocks = _added_operations(unet, x, t, c, ratio=0.5, method="local")
        counts[side] = added
        assert added / blocks <= 15, (side, added, blocks)
    assert len(set(counts.values())) == 1, counts
    # Exact ToMe adds many more per block (its figure grows with nothing either, but is far above 15).
    x, t, c = inputs(batch=2, h=32, w=32)
    tome, blocks = _added_operations(unet, x, t, c, ratio=0.5)
    assert tome / blocks > 3 * counts[32] / blocks


@pytest.mark.parametrize("layout,opts,ops", [
    ("sd1", dict(ratio=0.6, method="local", merge_crossattn=True, merge_mlp=True, max_downsample=2),
     {"index_select", "argmax", "bmm"}),
    ("sdxl", dict(method="stack", ratio=0.5, max_downsample=4),  # the stack method shares Local's plan
     {"index_select", "scatter_add", "gather", "argmax", "bmm"}),
], ids=["local", "stack"])
def test_int32_path_obeys_mps_rules_and_equals_int64(layout, opts, ops):
    unet = tiny_unet(layout)
    x, t, c = inputs(batch=2, h=24, w=40)
    tome_core.apply_patch(unet, index_dtype=torch.int64, **opts)
    wide = run(unet, x, t, c)
    tome_core.apply_patch(unet, index_dtype=torch.int32, **opts)
    run(unet, x, t, c)  # index tables are made on the CPU once per grid, then moved: record a step
    with OpRecorder() as rec, torch.no_grad():
        narrow = unet(x, t, context=c)
    tome_core.remove_patch(unet)
    assert torch.equal(narrow, wide)
    names = {f.overloadpacket.__name__.rstrip("_") for f, _, _ in rec.calls}
    assert ops <= names, "the plan did not run under the recorder"
    assert violations(rec.calls) == []


def test_an_attention_call_with_another_batch_or_token_count_runs_unmerged():
    """ControlNet's reference mode runs attn1 on part of the batch; HyperTile splits the tokens: such a call
    gets exact attention, and the next call of the block is merged again."""
    unet = tiny_unet()
    tome_core.apply_patch(unet, ratio=0.5, method="local")
    rec = tome_core.get_patch(unet).selected[0]
    attn1 = rec.module.attn1
    x = torch.randn(2, 64, attn1.to_q.in_features)
    rec.grid = (8, 8)
    rec.plan = tome_core.get_patch(unet).method_patch.levels.plan(rec, x)
    assert rec.plan is not None
    with torch.no_grad():
        for part in (x[:1], x[:, :32]):
            tome_core.get_patch(unet).uninstall()
            exact = attn1(part)
            tome_core.apply_patch(unet, ratio=0.5, method="local")
            rec = tome_core.get_patch(unet).selected[0]
            rec.grid, rec.input_shape = (8, 8), (2, 64)
            rec.plan = tome_core.get_patch(unet).method_patch.levels.plan(rec, x)
            assert torch.equal(attn1(part), exact)
            merged = attn1(x)
            assert merged.shape == x.shape and not torch.equal(merged, attn1.forward(x))


def test_queries_stay_whole_and_keys_and_values_come_from_the_kept_tokens():
    """Self-attention by its equation: every token's own query, against the keys and values of the tokens
    the plan keeps (found here by the plain reference); each token gets its own output."""
    unet = tiny_unet()
    tome_core.apply_patch(unet, ratio=0.5, method="local")
    patch = tome_core.get_patch(unet)
    rec = patch.selected[0]
    attn1 = rec.module.attn1
    x = torch.randn(2, 64, attn1.to_q.in_features, generator=torch.Generator().manual_seed(3))
    rec.grid, rec.input_shape = (8, 8), (2, 64)
    rec.plan = patch.method_patch.levels.plan(rec, x)
    kept = reference_keep(x, 8, 8, 0.5)
    assert kept.shape[1] == 32
    with torch.no_grad():
        got = attn1(x)
        heads = attn1.heads
        q, k, v = attn1.to_q(x), attn1.to_k(kept), attn1.to_v(kept)
        split = lambda t: t.view(t.shape[0], t.shape[1], heads, -1).transpose(1, 2)  # noqa: E731
        q, k, v = split(q), split(k), split(v)
        weights = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
        want = attn1.to_out((weights @ v).transpose(1, 2).reshape(2, 64, -1))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert rec.used and torch.unique(got.reshape(-1, got.shape[-1]), dim=0).shape[0] == 2 * 64


@pytest.mark.parametrize("kwargs,exc,name", [
    (dict(method="local", local_replan=0), ValueError, "local_replan"),
    (dict(method="local", local_replan=2.5), TypeError, "local_replan"),
    (dict(method="local", local_replan=True), TypeError, "local_replan"),
    (dict(method="Local"), ValueError, "method"),
])
def test_bad_options_are_refused_and_leave_the_model_alone(kwargs, exc, name):
    unet = tiny_unet()
    hooks = hook_counts(unet)
    with pytest.raises(exc, match=name):
        tome_core.apply_patch(unet, **kwargs)
    assert hook_counts(unet) == hooks and not tome_core.is_patched(unet)


def test_a_lone_transformer_plans_per_block_call():
    unet = tiny_unet()
    transformer = next(m for m in unet.modules() if type(m).__name__ == "SpatialTransformer")
    tome_core.apply_patch(transformer, ratio=0.5, method="local")
    x = torch.randn(2, transformer.in_channels, 8, 8)
    c = torch.randn(2, 7, 24)
    with torch.no_grad():
        out = transformer(x, context=c)
    assert out.shape == x.shape and isinstance(transformer, nn.Module)
