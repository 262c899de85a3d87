"""The Cache method (``tome_core.methods.cache``) against an independent oracle, and its state: kept per batch row
and call slot, never across runs, sizes or restores.

The oracle is the unpatched U-Net with plain forward hooks on its transformers: on a full step they record each
transformer's input and output, and the gain that best maps its input's move since the last full call of the same
call slot onto its output's (least squares, per batch row, solved by ``torch.linalg.lstsq`` in float64, kept in
[0, 1.5]; 1 at the first full call), and from the second full call the drift: the output's move per step since
the last full call beyond the gain times the input's move; on a reused step they replace each output by the
recorded output plus the gain times the input's move since the recorded input, plus half the drift for each step
since the recorded one."""

from __future__ import annotations

import pytest
import torch

import tome_core
from tome_core.methods import cache
from diffusers_unets import diffusers_unet, run_diffusers
from unets import hook_counts, inputs, run, tiny_unet

STEPS = 6


def _trajectory(batch: int = 2, seed: int = 0, steps: int = STEPS, h: int = 32):
    """Inputs and timesteps of a short run, moving as a sampler's do."""
    x, t, c = inputs(batch, h, h, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    xs = [x * (1 - 0.08 * i) + 0.1 * i * torch.randn(x.shape, generator=gen) for i in range(steps)]
    return xs, [t - 120 * i for i in range(steps)], c


# The full steps of a 6-step run, by (warm-up, longest gap), as the schedule's rule says them: the warm-up (the
# first step at least), then gaps of 2, 4, 6 ... steps, none longer than the longest gap.
FULL_STEPS = {(2, 8): {0, 1, 3}, (2, 3): {0, 1, 3}, (1, 2): {0, 2, 4}, (0, 4): {0, 2}, (0, 1): set(range(STEPS)),
              (4, 8): {0, 1, 2, 3, 5}}


def _full(i: int, warmup: int, interval: int) -> bool:
    return i in FULL_STEPS[warmup, interval]


def least_squares_gain(x0: torch.Tensor, y0: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per row, the ``a`` minimising |(y − y0) − a·(x − x0)|², in [0, 1.5], shaped (B, 1, 1, 1)."""
    gains = []
    for dx, dy in zip((x - x0).double(), (y - y0).double()):
        gains.append(torch.linalg.lstsq(dx.reshape(-1, 1), dy.reshape(-1, 1)).solution.reshape(()))
    return torch.stack(gains).clamp(0.0, 1.5).to(x.dtype).reshape(-1, 1, 1, 1)


class Oracle:
    """Hooks on an unpatched U-Net's transformers that compute what Cache must: see the module docstring."""

    def __init__(self, unet, levels=None) -> None:
        self.kept: dict = {}
        self.gains: list = []  # every gain fitted, to show they are not all 1
        self.drifts: list = []  # every drift and the output it was measured at, to show it is not negligible
        self.mode, self.slot, self.step = "full", 0, 0
        chosen = tome_core.patch.transformer_levels(unet)
        below_top = sorted({lv for _, _, lv in chosen})[1:]  # "auto": every level but the highest-resolution one
        lowest = set(below_top) if levels is None else levels
        self.handles = [t.register_forward_hook(self._hook(i), with_kwargs=True)
                        for i, (_, t, lv) in enumerate(chosen) if lv in lowest]

    def _hook(self, index):
        def hook(module, args, kwargs, output):
            x = args[0] if args else kwargs["hidden_states"]
            y = output if isinstance(output, torch.Tensor) else output[0]
            key = (self.slot, index)
            if self.mode == "full":
                before = self.kept.get(key)
                gain = 1.0 if before is None else least_squares_gain(before[0], before[1], x, y)
                # The drift: the output's move per step beyond the gain times the input's move.
                drift = None if before is None else ((y - before[1]) - gain * (x - before[0])) / (self.step - before[3])
                self.kept[key] = (x.clone(), y.clone(), gain, self.step, drift)
                self.gains.append(gain)
                if drift is not None:
                    self.drifts.append((drift, y.clone()))
                return None
            x0, y0, gain, step0, drift = self.kept[key]
            new = y0 + gain * (x - x0)
            if drift is not None:  # half the drift for each step since the full one
                new = new + 0.5 * (self.step - step0) * drift
            return new if isinstance(output, torch.Tensor) else (new,) + tuple(output[1:])
        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _patched_run(unet, xs, ts, c, *, calls_per_step=1, progress=True, **options):
    tome_core.apply_patch(unet, method="cache", **options)
    out = []
    for i, (x, t) in enumerate(zip(xs, ts)):
        if progress:
            tome_core.set_progress(unet, (i + 0.5) / len(xs))
        parts = x.chunk(calls_per_step)
        cs, tts = c.chunk(calls_per_step), t.chunk(calls_per_step)
        out.append(torch.cat([run(unet, p, tt, cc) for p, tt, cc in zip(parts, tts, cs)]))
    return out


@pytest.mark.parametrize("layout", ["sd1", "sdxl"])
@pytest.mark.parametrize("warmup,interval", [(2, 8), (2, 3), (1, 2), (0, 4), (0, 1), (4, 8)])
def test_each_step_is_the_oracles_full_or_reused_step(layout, warmup, interval):
    unet = tiny_unet(layout)
    xs, ts, c = _trajectory()
    oracle = Oracle(unet)
    want = []
    for i, (x, t) in enumerate(zip(xs, ts)):
        oracle.step, oracle.mode = i, "full" if _full(i, warmup, interval) else "reuse"
        want.append(run(unet, x, t, c))
    oracle.remove()
    fitted = [g for g in oracle.gains if isinstance(g, torch.Tensor)]
    assert fitted and not all(torch.allclose(g, torch.ones_like(g), atol=0.02) for g in fitted)  # not the plain change
    # A drift the reused steps would show without: a change per step of at least a thousandth of the output.
    assert any(float(d.norm()) > 1e-3 * float(y.norm()) for d, y in oracle.drifts)
    got = _patched_run(unet, xs, ts, c, cache_warmup=warmup, cache_interval=interval)
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.allclose(a, b, atol=1e-6), i
    plain = [run(tiny_unet(layout), x, t, c) for x, t in zip(xs, ts)]
    reused = [i for i in range(STEPS) if not _full(i, warmup, interval)]
    assert all(not torch.equal(got[i], plain[i]) for i in reused)
    assert all(torch.equal(got[i], plain[i]) for i in range(STEPS) if i not in reused)


def test_the_fitted_gain_is_each_rows_least_squares_slope():
    """``fitted_gain`` against the slope drawn: outputs that move by a known gain per row times the input's move,
    plus a part unrelated to it, give that gain back; an input that did not move gives 1; a slope past the
    bounds is held to them."""
    gen = torch.Generator().manual_seed(3)
    x0, x = torch.randn(4, 8, 5, 5, generator=gen), torch.randn(4, 8, 5, 5, generator=gen)
    x[3] = x0[3]  # row 3's input did not move
    drawn = torch.tensor([0.8, 1.2, 3.0, 0.5]).view(-1, 1, 1, 1)
    y0 = torch.randn(4, 8, 5, 5, generator=gen)
    unrelated = torch.randn(4, 8, 5, 5, generator=gen)
    dx = (x - x0).flatten(1)
    unrelated -= ((unrelated.flatten(1) * dx).sum(1) / (dx * dx).sum(1).clamp_min(1e-12)).view(-1, 1, 1, 1) * (x - x0)
    y = y0 + drawn * (x - x0) + 0.3 * unrelated  # the unrelated part has no share along the input's move
    gain = cache.fitted_gain(cache._Kept(x0, y0, 1.0, None, 0, None), x, y)
    assert gain.shape == (4, 1, 1, 1)
    assert torch.allclose(gain.flatten(), torch.tensor([0.8, 1.2, 1.5, 1.0]), atol=1e-5)
    half = cache.fitted_gain(cache._Kept(x0.half(), y0.half(), 1.0, None, 0, None), x.half(), y.half())
    assert half.dtype == torch.float16 and torch.allclose(half.float().flatten()[:2], drawn.flatten()[:2], atol=1e-2)


def test_a_host_adding_to_a_stacks_output_in_place_does_not_change_what_is_kept():
    """Forge adds ControlNet's residuals to a block's output in place (``h += control``), and the block's output
    is its transformer's: Cache keeps copies, so an in-place addition gives the pixels an out-of-place one does."""
    xs, ts, c = _trajectory()

    def with_addition(in_place: bool) -> list:
        unet = tiny_unet("sd1")
        stacks = [t for _, t, _ in tome_core.patch.transformer_levels(unet)]

        def add(module, args, output):
            if in_place:
                output.add_(0.5)
                return None
            return output + 0.5
        tome_core.apply_patch(unet, method="cache")
        handles = [t.register_forward_hook(add) for t in stacks]
        out = []
        for i, (x, t) in enumerate(zip(xs, ts)):
            tome_core.set_progress(unet, (i + 0.5) / STEPS)
            out.append(run(unet, x, t, c))
        for handle in handles:
            handle.remove()
        tome_core.remove_patch(unet)
        return out

    assert all(torch.equal(a, b) for a, b in zip(with_addition(True), with_addition(False)))


def test_an_image_does_not_depend_on_its_batch_nor_on_cond_and_uncond_together_or_apart():
    unet = tiny_unet("sdxl")
    xs, ts, c = _trajectory(batch=4)
    together = _patched_run(unet, xs, ts, c)
    apart = _patched_run(unet, xs, ts, c, calls_per_step=2)  # rows 0-1 and 2-3 in two calls: two call slots
    alone = _patched_run(unet, [x[2:3] for x in xs], [t[2:3] for t in ts], c[2:3])
    for a, b, one in zip(together, apart, alone):
        assert torch.allclose(a, b, atol=1e-5) and torch.allclose(a[2:3], one, atol=1e-5)


def _two_evaluations_a_step():
    """A U-Net, a run, a second input at each step (as Heun's corrector has) and the oracle's outputs for the two
    evaluations of each step, each kept in its own slot (the oracle keeps per row: both rows in one call); the
    U-Net then patched with Cache."""
    unet = tiny_unet("sd1")
    xs, ts, c = _trajectory(batch=2)
    second = [x.flip(0) * 0.9 for x in xs]
    oracle = Oracle(unet)
    want = []
    for i in range(STEPS):
        oracle.step, oracle.mode = i, "full" if _full(i, 2, 8) else "reuse"
        for slot, x in enumerate((xs[i], second[i])):
            oracle.slot = slot
            want.append(run(unet, x, ts[i], c))
    oracle.remove()
    tome_core.apply_patch(unet, method="cache")
    return unet, xs, ts, c, second, want


def test_two_calls_a_step_each_reuse_their_own_slots_change():
    """A second-order sampler's two evaluations of a step (the same progress) are slots 0 and 1: each reused
    call takes the change of the call in its own slot, never the other's."""
    unet, xs, ts, c, second, want = _two_evaluations_a_step()
    got = []
    for i in range(STEPS):
        tome_core.set_progress(unet, (i + 0.5) / STEPS)
        got += [run(unet, xs[i], ts[i], c), run(unet, second[i], ts[i], c)]
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got, want))


def _named_run(unet, xs, ts, c, layouts, rows=True):
    """A run whose batch is two named parts, A (rows 0-1) and B (rows 2-3), called at step i as ``layouts[i]``:
    "AB" together, "A,B" or "B,A" apart in that order; each call names its parts (``set_call_rows``) unless
    ``rows`` is False."""
    halves = {"A": slice(0, 2), "B": slice(2, 4)}
    tome_core.apply_patch(unet, method="cache")
    out = []
    for i, (x, t) in enumerate(zip(xs, ts)):
        tome_core.set_progress(unet, (i + 0.5) / len(xs))
        got = {}
        for call in layouts[i].split(","):
            index = torch.cat([torch.arange(4)[halves[name]] for name in call])
            if rows:
                tome_core.set_call_rows(unet, tuple(call))
            y = run(unet, x[index], t[index], c[index])
            for name, part in zip(call, y.chunk(len(call))):
                got[name] = part
        out.append(torch.cat([got["A"], got["B"]]))
    tome_core.remove_patch(unet)
    return out


def test_named_parts_keep_their_own_state_however_the_host_splits_and_orders_its_calls():
    """ComfyUI batches cond and uncond together or runs them apart by its free memory, and that can change from
    one step to the next: with each part named, every step takes what the same part kept, whatever the layout."""
    unet = tiny_unet("sdxl")
    xs, ts, c = _trajectory(batch=4)
    together = _named_run(unet, xs, ts, c, ["AB"] * STEPS)
    mixed = ["AB", "B,A", "A,B", "B,A", "AB", "BA"]  # the reused steps 2, 4 and 5 each laid out otherwise
    named = _named_run(unet, xs, ts, c, mixed)
    for a, b in zip(together, named):
        assert torch.allclose(a, b, atol=1e-5)
    # Not vacuous: placed by slot alone, a reused step whose layout changed runs on another call's state.
    unnamed = _named_run(unet, xs, ts, c, mixed, rows=False)
    assert not torch.allclose(unnamed[2], together[2], atol=1e-3)


def test_a_named_parts_second_evaluation_in_a_step_takes_its_own_state():
    """A second-order sampler evaluates each part twice in a step (the same progress): the second occurrence of
    a name is its own part, as the second call slot is, whichever way the parts were batched."""
    unet, xs, ts, c, second, want = _two_evaluations_a_step()
    got = []
    for i in range(STEPS):
        tome_core.set_progress(unet, (i + 0.5) / STEPS)
        for x in (xs[i], second[i]):
            if i % 2:  # the two rows in one call
                tome_core.set_call_rows(unet, ("cond", "uncond"))
                got.append(run(unet, x, ts[i], c))
            else:  # apart, uncond first
                parts = {}
                for row, name in ((1, "uncond"), (0, "cond")):
                    tome_core.set_call_rows(unet, (name,))
                    parts[row] = run(unet, x[row:row + 1], ts[i][row:row + 1], c[row:row + 1])
                got.append(torch.cat([parts[0], parts[1]]))
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(got, want))


def test_call_rows_are_checked_and_told_for_one_call_only():
    unet = tiny_unet("sd1")
    tome_core.apply_patch(unet, method="cache")
    with pytest.raises(ValueError, match="rows"):
        tome_core.set_call_rows(unet, ())
    with pytest.raises(TypeError):
        tome_core.set_call_rows(unet, ([0],))
    x, t, c = inputs(2, 16, 16)
    tome_core.set_progress(unet, 0.1)
    tome_core.set_call_rows(unet, ("cond", "uncond"))
    run(unet, x, t, c)
    assert tome_core.get_patch(unet).clock.chunks == (("cond", 0), ("uncond", 0))
    run(unet, x, t, c)  # told nothing: placed by its slot
    assert tome_core.get_patch(unet).clock.chunks is None and tome_core.get_patch(unet).clock.slot == 1
    tome_core.set_call_rows(tiny_unet("sd1"), ("cond",))  # a model without the patch ignores it


def test_without_progress_the_timestep_tells_the_steps():
    unet = tiny_unet("sd1")
    xs, ts, c = _trajectory(batch=2)
    told = _patched_run(unet, xs, ts, c, cache_warmup=1, cache_interval=2)
    oracle = Oracle(unet)
    want = []
    for i, (x, t) in enumerate(zip(xs, ts)):
        oracle.step, oracle.mode = i, "full" if _full(i, 1, 2) else "reuse"
        want.append(run(unet, x, t, c))
    oracle.remove()
    untold = _patched_run(unet, xs, ts, c, progress=False, cache_warmup=1, cache_interval=2)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(untold, want))
    assert all(torch.equal(a, b) for a, b in zip(told, untold))
    apart = _patched_run(unet, xs, ts, c, progress=False, calls_per_step=2, cache_warmup=1, cache_interval=2)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(untold, apart))


def test_a_new_run_a_rerun_and_a_new_size_start_afresh():
    unet = tiny_unet("sd1")
    xs, ts, c = _trajectory()
    first = _patched_run(unet, xs, ts, c)
    patch = tome_core.get_patch(unet)
    # The same patch, a second run (progress back at the start): the same pixels, nothing of the first kept.
    again = []
    for i, (x, t) in enumerate(zip(xs, ts)):
        tome_core.set_progress(unet, (i + 0.5) / STEPS)
        again.append(run(unet, x, t, c))
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    # A run at another size, halfway through a run: its first call runs full (nothing kept fits it).
    tome_core.set_progress(unet, 0.5 / STEPS)
    run(unet, xs[0], ts[0], c)
    small = inputs(2, 16, 16)[0]
    plain = tiny_unet("sd1")
    for i in range(1, 5):
        tome_core.set_progress(unet, (i + 0.5) / STEPS)
        if i == 4:  # a reused step of the schedule, but the first at this size
            assert torch.equal(run(unet, small, ts[i], c), run(plain, small, ts[i], c))
        else:
            run(unet, xs[i], ts[i], c)
    assert patch.method_patch.kept_bytes() > 0



def test_other_weights_loaded_into_the_patched_unet_start_afresh_when_told():
    """A host that loads other weights into the patched modules mid-run (A1111's refiner of the same config)
    calls ``start_afresh``: the next call, a reused one by the schedule (full steps 0, 1, 3), runs whole with
    the new weights; without it, the old weights' changes would be applied."""
    refiner = tiny_unet("sd1", seed=5)
    xs, ts, c = _trajectory()

    def third_step(told: bool) -> torch.Tensor:
        unet = tiny_unet("sd1")
        tome_core.apply_patch(unet, method="cache")
        for i in range(2):
            tome_core.set_progress(unet, (i + 0.5) / STEPS)
            run(unet, xs[i], ts[i], c)
        unet.load_state_dict(refiner.state_dict())
        if told:
            tome_core.start_afresh(unet)
        tome_core.set_progress(unet, 2.5 / STEPS)
        return run(unet, xs[2], ts[2], c)

    assert torch.equal(third_step(told=True), run(refiner, xs[2], ts[2], c))
    assert not torch.allclose(third_step(told=False), run(refiner, xs[2], ts[2], c), atol=1e-4)
    tome_core.start_afresh(tiny_unet("sd1"))  # a model without the patch: nothing to forget

def test_an_interrupted_run_leaves_nothing_for_the_next():
    unet = tiny_unet("sd1")
    xs, ts, c = _trajectory()
    fresh = _patched_run(unet, xs, ts, c)
    tome_core.apply_patch(unet, method="cache")
    for i in range(4):
        tome_core.set_progress(unet, (i + 0.5) / STEPS)
        run(unet, xs[i] * 3, ts[i], c)  # another picture, stopped after its 4th step
    again = []
    for i, (x, t) in enumerate(zip(xs, ts)):
        tome_core.set_progress(unet, (i + 0.5) / STEPS)
        again.append(run(unet, x, t, c))
    assert all(torch.equal(a, b) for a, b in zip(fresh, again))


def test_kept_memory_is_an_input_and_output_per_stack_and_slot_and_the_restore_is_exact():
    unet = tiny_unet("sdxl")
    xs, ts, c = _trajectory(batch=2)
    hooks = hook_counts(unet)
    base = [run(unet, x, t, c) for x, t in zip(xs, ts)]
    sizes = []
    stacks = tome_core.patch.transformer_levels(unet)
    top = min(lv for _, _, lv in stacks)  # "auto" keeps nothing for the highest-resolution level's stacks
    handles = [t.register_forward_hook(lambda m, a, out: sizes.append(out.numel() * out.element_size()))
               for _, t, lv in stacks if lv != top]
    run(unet, xs[0], ts[0], c)
    for handle in handles:
        handle.remove()
    _patched_run(unet, xs[:3], ts[:3], c, calls_per_step=2)
    # Per stack and slot (two slots of half the batch: the sizes of one call of the whole batch) an input and an
    # output, and from the second full step a drift of the same size and a gain per row: 2 slots × len(sizes)
    # stacks × 1 row of float32.
    assert tome_core.get_patch(unet).method_patch.kept_bytes() == 3 * sum(sizes) + 2 * len(sizes) * 4
    tome_core.remove_patch(unet)
    assert hook_counts(unet) == hooks
    assert not any("forward" in m.__dict__ for m in unet.modules())
    assert all(torch.equal(run(unet, x, t, c), b) for x, t, b in zip(xs, ts, base))


def test_a_diffusers_unet_reuses_through_its_tuple_outputs():
    unet = diffusers_unet("sdxl")
    x, t, c = inputs(2, 16, 16, tokens=7)
    c = torch.randn(2, 7, unet.config.cross_attention_dim, generator=torch.Generator().manual_seed(2))
    xs = [x * (1 - 0.1 * i) for i in range(STEPS)]
    ts = [t - 100 * i for i in range(STEPS)]
    oracle = Oracle(unet)
    want = []
    for i in range(STEPS):
        oracle.step, oracle.mode = i, "full" if _full(i, 2, 8) else "reuse"
        want.append(run_diffusers(unet, xs[i], ts[i], c))
    oracle.remove()
    tome_core.apply_patch(unet, method="cache")
    got = []
    for i in range(STEPS):
        tome_core.set_progress(unet, (i + 0.5) / STEPS)
        got.append(run_diffusers(unet, xs[i], ts[i], c))
    tome_core.remove_patch(unet)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(got, want))
    assert not all(torch.equal(a, run_diffusers(unet, xs[i], ts[i], c)) for i, a in enumerate(got))


def test_bad_options_are_refused_naming_them():
    unet = tiny_unet("sd1")
    for bad, words in ((dict(cache_interval=0), "cache_interval"), (dict(cache_warmup=-1), "cache_warmup"),
                       (dict(cache_interval=2.5), "cache_interval")):
        with pytest.raises((TypeError, ValueError), match=words):
            tome_core.apply_patch(unet, method="cache", **bad)
        assert not tome_core.is_patched(unet)


def _controlnet_residuals(unet, x, t, c, step: int):
    """ControlNet's residuals for one step, shaped as diffusers' U-Net takes them (one per skip connection and
    one for the middle block), drawn afresh per step: a control's effect changes every step."""
    shapes = []
    handles = [unet.conv_in.register_forward_hook(lambda m, a, out: shapes.append(out.shape))]
    handles += [block.register_forward_hook(lambda m, a, out: shapes.extend(s.shape for s in out[1]))
                for block in unet.down_blocks]
    handles.append(unet.mid_block.register_forward_hook(lambda m, a, out: shapes.append(out.shape)))
    run_diffusers(unet, x, t, c)
    for handle in handles:
        handle.remove()
    gen = torch.Generator().manual_seed(100 + step)
    residuals = [0.3 * torch.randn(shape, generator=gen) for shape in shapes]
    return {"down_block_additional_residuals": tuple(residuals[:-1]), "mid_block_additional_residual": residuals[-1]}


def test_controlnet_residuals_act_on_every_step_the_reused_ones_too():
    """ControlNet adds its residuals outside the transformer stacks (to the skip connections and the middle
    block's output), so on a reused step the current control still reaches every token: Cache's output is the
    oracle's (each stack's current input, the control's effect in it, plus its kept change), and another
    control at a reused step gives another output."""
    unet = diffusers_unet("sdxl")
    x, t, c = inputs(2, 16, 16, tokens=7)
    c = torch.randn(2, 7, unet.config.cross_attention_dim, generator=torch.Generator().manual_seed(2))
    xs = [x * (1 - 0.1 * i) for i in range(STEPS)]
    ts = [t - 100 * i for i in range(STEPS)]
    controls = [_controlnet_residuals(unet, xs[i], ts[i], c, i) for i in range(STEPS)]
    oracle = Oracle(unet)
    want = []
    for i in range(STEPS):
        oracle.step, oracle.mode = i, "full" if _full(i, 2, 8) else "reuse"
        want.append(run_diffusers(unet, xs[i], ts[i], c, **controls[i]))
    oracle.remove()
    tome_core.apply_patch(unet, method="cache")

    def patched(controls):
        out = []
        for i in range(STEPS):
            tome_core.set_progress(unet, (i + 0.5) / STEPS)
            out.append(run_diffusers(unet, xs[i], ts[i], c, **controls[i]))
        return out

    got = patched(controls)
    doubled = list(controls)  # a new run, the same but for another control at step 2, a reused step
    doubled[2] = {key: tuple(2 * r for r in value) if isinstance(value, tuple) else 2 * value
                  for key, value in controls[2].items()}
    other = patched(doubled)
    tome_core.remove_patch(unet)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(got, want))
    assert not _full(2, 2, 8)
    assert all(torch.equal(a, b) for a, b in zip(got[:2], other[:2]))
    assert not torch.allclose(other[2], got[2], atol=1e-3)
