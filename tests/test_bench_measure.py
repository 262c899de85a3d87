"""The benchmark's arithmetic and its honesty: interleaved rounds, spreads, the busy-machine warning, shares of the
ideal's gain, the ideal itself, and U-Nets at any width scale. No test here asserts a speed."""

import math

import pytest
import torch

import tome_core
from tome_core.bench import archs, cli, jobs
from tome_core import local, stack
from tome_core.bench.contenders import IdealPatch, Wrapped, roster
from tome_core.bench.jobs import roster_size
from tome_core.bench.opcount import Cost
from tome_core.bench.report import (BUSY_SPREAD, Case, Entry, Fidelity, Load, busy_warning, find_busy, share_of_ideal,
                                    table, table_line)
from tome_core.bench.timing import Spread, interleaved_rounds, rotated
from unets import inputs, run, tiny_unet

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture
def webui_unet(monkeypatch):
    """The benchmark's process-wide ldm patches, taken back after the test."""
    from ldm.modules.attention import CrossAttention
    from ldm.modules.diffusionmodules import openaimodel

    monkeypatch.setattr(CrossAttention, "forward", CrossAttention.forward)
    monkeypatch.setattr(openaimodel, "th", openaimodel.th)
    archs.use_webui_unet()


def spread(*ms):
    return Spread.of(ms)


# -- spreads and rounds ---------------------------------------------------------------------------------------

def test_spread_is_median_and_quartiles():
    s = spread(13, 10, 100, 12, 11)  # one wild round
    assert (s.median, s.q1, s.q3, s.low, s.high, s.rounds) == (12, 11, 13, 10, 100, 5)
    assert s.relative == pytest.approx(2 / 12)
    assert spread(7).relative == 0 and spread(7).median == 7


def test_rounds_rotate_the_calling_order():
    calls = []
    samples = interleaved_rounds(["none", "ours", "ideal"], lambda name: calls.append(name) or 1.0, 3, warmup=1)
    assert calls == ["none", "ours", "ideal",  # warm-up, not counted
                     "none", "ours", "ideal", "ours", "ideal", "none", "ideal", "none", "ours"]
    assert samples == {"none": [1.0] * 3, "ours": [1.0] * 3, "ideal": [1.0] * 3}
    assert rotated(["a", "b", "c"], 4) == ["b", "c", "a"]


class SimulatedMachine:
    """A clock and contenders of known cost; calls that start inside the burst take ``slowdown`` times longer."""

    def __init__(self, costs_ms, burst, slowdown):
        self.costs, self.burst, self.slowdown, self.now = costs_ms, burst, slowdown, 0.0

    def time_one(self, name):
        ms = self.costs[name] * (self.slowdown if self.burst[0] <= self.now < self.burst[1] else 1)
        self.now += ms / 1000
        return ms

    def clock(self):
        return self.now


def test_a_burst_of_load_does_not_bias_interleaved_medians():
    # True costs: none 100 ms, ours 80 ms (1.25x). A burst that triples every call lasts the first second:
    # timed one contender after the other, it lands on "none" alone and fakes a speed-up of 3.75x.
    costs = {"none": 100.0, "ours": 80.0, "ideal": 60.0}
    machine = SimulatedMachine(costs, burst=(0.0, 1.0), slowdown=3)
    samples = interleaved_rounds(list(costs), machine.time_one, 7, warmup=0, clock=machine.clock)
    ms = {name: Spread.of(v) for name, v in samples.items()}
    assert {name: s.median for name, s in ms.items()} == costs
    assert ms["none"].median / ms["ours"].median == 1.25

    sequential = SimulatedMachine(costs, burst=(0.0, 1.0), slowdown=3)
    one_stretch = {name: Spread.of([sequential.time_one(name) for _ in range(7)]) for name in costs}
    assert one_stretch["none"].median / one_stretch["ours"].median == 3.75


def test_a_budget_stops_new_rounds_after_the_minimum():
    machine = SimulatedMachine({"none": 1000.0, "ours": 1000.0}, burst=(0, 0), slowdown=1)
    samples = interleaved_rounds(["none", "ours"], machine.time_one, 9, warmup=1, min_rounds=3, budget_s=0.5,
                                 clock=machine.clock)
    assert samples == {"none": [1000.0] * 3, "ours": [1000.0] * 3}
    samples = interleaved_rounds(["none", "ours"], machine.time_one, 9, budget_s=1e6, clock=machine.clock)
    assert len(samples["none"]) == 9


# -- the busy-machine warning ---------------------------------------------------------------------------------

def test_busy_warning_triggers_only_above_ten_percent():
    assert BUSY_SPREAD == 0.10
    quiet = [("U-Net sd15 512 px none", spread(100, 102, 104, 101, 103)),
             ("U-Net sd15 512 px ours", spread(80, 81, 82, 83, 84))]
    assert busy_warning(quiet, "more rounds") is None
    # Quartiles 100 and 112 around a median of 104: 11.5% of it.
    busy = quiet + [("U-Net sd15 512 px tomesd", spread(95, 100, 104, 112, 130))]
    line = busy_warning(busy, "more rounds (--repeats 6)")
    assert line is not None and "\n" not in line
    assert line.startswith("WARNING: the machine was busy: 1 of 3 timings")
    assert "U-Net sd15 512 px tomesd, 12%" in line and line.endswith("For steadier figures: more rounds (--repeats 6).")
    assert find_busy(busy).over == 1


class QuietWatch:
    """No other process uses any core."""

    def others(self, shortest_s=1.0):
        return 0.0


@pytest.mark.parametrize("noisy, warned", [(False, False), (True, True)])
def test_the_main_job_warns_from_the_timings_it_got(monkeypatch, capsys, webui_unet, noisy, warned):
    # Inject the timings: every contender steady, or "ours" with one slow call in every other round.
    def fake_timer(model, call, racers, device):
        counts = {}

        def time_one(name):
            counts[name] = counts.get(name, 0) + 1
            base = {"none": 100.0, "ToMe 0.50": 80.0, "ToDo f=2": 90.0, "Local 0.50": 70.0, "tomesd 0.50": 85.0,
                    "ideal 0.50": 60.0, "ideal KV 0.50": 65.0, "Stack 0.50": 58.0, "ideal S 0.50": 55.0}[name]
            return base * (1.5 if noisy and name == "ToMe 0.50" and counts[name] % 2 else 1.0)
        return time_one

    monkeypatch.setattr(jobs, "model_timer", fake_timer)
    monkeypatch.setattr(jobs, "CpuWatch", QuietWatch)
    assert cli.main(["--models", "sd15", "--sizes", "64", "--width", "0.1", "--repeats", "5", "--quiet", "--skip",
                     "block", "overhead", "memory"]) == 0
    out = capsys.readouterr().out
    assert ("WARNING: the machine was busy" in out) == warned
    if not warned:
        assert "| sd15 | 64 | none | – | 100.0 (0%) | 1.00x | – | – | – | – | 0 |" in out
        assert "| sd15 | 64 | ToMe | 0.50 | 80.0 (0%) | 1.25x | 37% | – | – |" in out
        assert "| sd15 | 64 | ToDo | f=2 | 90.0 (0%) | 1.11x | – | – | – |" in out
        assert "| sd15 | 64 | Local | 0.50 | 70.0 (0%) | 1.43x | 80% | – | – |" in out  # of the KV ideal's 1.54x
        assert "| sd15 | 64 | tomesd | 0.50 | 85.0 (0%) | 1.18x | 26% | – | – |" in out
        assert "| sd15 | 64 | Stack | 0.50 | 58.0 (0%) | 1.72x | 89% | – | – |" in out  # of the S ideal's 1.82x
        assert "| sd15 | 64 | ideal | 0.50 | 60.0 (0%) | 1.67x | – |" in out
        assert "Random weights: no fidelity figure" in out


@pytest.mark.parametrize("others, cores, threads, contended", [
    (0.05, 2, 2, False), (0.9, 2, 2, True), (1.0, 2, 1, False), (1.3, 2, 1, True), (8.0, 16, 4, False),
    (2.0, 16, 16, True), (0.0, 1, 1, False)])
def test_other_processes_contend_when_they_take_cores_this_run_needs(others, cores, threads, contended):
    # Free cores = cores − others; contended when fewer than this run's threads (a tenth of a core of slack each).
    assert Load("U-Net sd15 512 px", others, cores, threads).contended == contended


def test_a_steady_load_warns_even_with_steady_rounds():
    steady = [("U-Net sd15 512 px none", spread(100, 100, 100))]
    assert busy_warning(steady, "a quiet machine", Load("x", 0.05, 2, 2)) is None
    line = busy_warning(steady, "a quiet machine", Load("U-Net sd15 768 px r=0.5", 0.93, 2, 2))
    assert line == ("WARNING: the machine was busy: other processes kept 0.9 of the 2 cores busy (during U-Net sd15 "
                    "768 px r=0.5) while this run computed with 2 threads, so these speed-ups may be off. For "
                    "steadier figures: a quiet machine.")


class BusyWatch:
    """Other processes keep every core busy."""

    def others(self, shortest_s=1.0):
        import os

        return float(os.cpu_count())


def test_the_main_job_warns_when_other_processes_hold_its_cores(monkeypatch, capsys, webui_unet):
    monkeypatch.setattr(jobs, "model_timer", lambda *a: (lambda name: 10.0))
    monkeypatch.setattr(jobs, "CpuWatch", BusyWatch)
    assert cli.main(["--models", "sd15", "--sizes", "64", "--width", "0.1", "--repeats", "3", "--quiet", "--skip",
                     "block", "overhead", "memory"]) == 0
    out = capsys.readouterr().out
    warnings = [line for line in out.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 1 and "other processes kept" in warnings[0]
    assert "# load: other processes kept at most" in out


def test_a_single_round_says_it_cannot_judge(monkeypatch, capsys, webui_unet):
    monkeypatch.setattr(jobs, "model_timer", lambda *a: (lambda name: 10.0))
    monkeypatch.setattr(jobs, "CpuWatch", QuietWatch)
    assert cli.main(["--models", "sd15", "--sizes", "64", "--width", "0.1", "--repeats", "1", "--quiet", "--skip",
                     "block", "overhead", "memory"]) == 0
    assert "NOTE: 1 round(s) per U-Net case measure no spread" in capsys.readouterr().out


# -- shares of the ideal's gain -------------------------------------------------------------------------------

@pytest.mark.parametrize("speedup, ideal, share", [
    (1.5, 2.0, 0.5), (2.0, 2.0, 1.0), (1.0, 1.5, 0.0), (0.9, 1.2, -0.5), (1.11, 1.37, 0.11 / 0.37),
    (1.2, 1.0, None), (1.1, 0.95, None)])
def test_share_of_the_ideal_gain(speedup, ideal, share):
    got = share_of_ideal(speedup, ideal)
    assert got == share if share is None else got == pytest.approx(share)


ENTRIES = [Entry("none", "none", "–"), Entry("ToMe 0.50", "ToMe", "0.50", "ideal 0.50"),
           Entry("ToDo f=2", "ToDo", "f=2"), Entry("tomesd 0.50", "tomesd", "0.50", "ideal 0.50"),
           Entry("ideal 0.50", "ideal", "0.50")]


def test_table_line_shows_speed_share_fidelity_and_ops_side_by_side():
    case = Case("sd15", 512, ENTRIES, {"none": spread(300, 300, 300), "ToMe 0.50": spread(200, 200, 200),
                                       "ToDo f=2": spread(250, 250, 250), "tomesd 0.50": spread(240, 240, 240),
                                       "ideal 0.50": spread(150, 150, 150)},
                {"none": Fidelity(math.inf, 1.0, math.inf),
                 "ToMe 0.50": Fidelity(31.25, 0.9512, 40.04, (28.96, 33.0), (0.9400, 0.9600), (39.5, 41.0)),
                 "ToDo f=2": Fidelity(35.0, 0.97), "tomesd 0.50": Fidelity(30.0, 0.94)},
                {"ToMe 0.50": Cost(84.0, 168.0, 0.62), "ToDo f=2": Cost(6.0, 12.0, 0.81),
                 "tomesd 0.50": Cost(120.0, 240.0, None), "ideal 0.50": Cost(7.0, None, 0.55)})
    # speed-ups 1.5, 1.2, 1.25 and 2.0; shares 0.5 / 1.0 and 0.25 / 1.0; ToDo has no ideal to share.
    lines = [table_line(case, e) for e in ENTRIES]
    # Medians with their range beside them; a figure without a range (one draw, or not measured) stands alone.
    assert lines == [
        "| sd15 | 512 | none | – | 300.0 (0%) | 1.00x | – | ∞ | 1.000 | ∞ | 0 | 0 | 1.00 |",
        "| sd15 | 512 | ToMe | 0.50 | 200.0 (0%) | 1.50x | 50% | 31.2 (29.0–33.0) | 0.951 (0.940–0.960) | "
        "40.0 (39.5–41.0) | 84 | 168 | 0.62 |",
        "| sd15 | 512 | ToDo | f=2 | 250.0 (0%) | 1.20x | – | 35.0 | 0.970 | – | 6 | 12 | 0.81 |",
        "| sd15 | 512 | tomesd | 0.50 | 240.0 (0%) | 1.25x | 25% | 30.0 | 0.940 | – | 120 | 240 | – |",
        "| sd15 | 512 | ideal | 0.50 | 150.0 (0%) | 2.00x | – | – | – | – | 7 | – | 0.55 |"]
    no_fidelity = Case("sd15", 512, ENTRIES, case.ms)
    assert table_line(no_fidelity, ENTRIES[1]) == \
        "| sd15 | 512 | ToMe | 0.50 | 200.0 (0%) | 1.50x | 50% | – | – | – | – | – | – |"
    text = table([case], "Whole U-Net step", "Random weights.")
    assert "over 3 interleaved rounds" in text
    assert "| method | setting | ms | speed-up | share | PSNR dB | SSIM | step dB | ops/block |" in text


def test_no_share_of_an_ideal_gain_lost_in_noise():
    # The ideal is 1.10x by its medians, but none's and the ideal's quartiles overlap: no share is shown.
    case = Case("sd15", 512, ENTRIES, {"none": spread(80, 110, 140), "ToMe 0.50": spread(100, 100, 100),
                                       "ideal 0.50": spread(70, 100, 130)})
    assert case.speedup("ideal 0.50") == pytest.approx(1.1)
    assert case.share("ToMe 0.50") is None
    # A gain under 5% is not shared out either, however steady.
    tiny = Case("sd15", 512, ENTRIES, {"none": spread(103, 103, 103), "ToMe 0.50": spread(101, 101, 101),
                                       "ideal 0.50": spread(100, 100, 100)})
    assert tiny.share("ToMe 0.50") is None


# -- the ideal ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("h, w, ratio, kept", [
    (64, 64, 0.5, 2048), (64, 64, 0.9, 1024), (5, 5, 0.5, 13), (1, 9, 0.5, 9), (8, 8, 0.0, 64)])
def test_ideal_keeps_what_ours_keeps(h, w, ratio, kept):
    # int(N·ratio) removed, capped at N minus one destination per whole 2×2 cell; nothing below one cell.
    assert IdealPatch(ratio, None).kept_tokens(h, w) == kept


@pytest.mark.parametrize("h, w", [(64, 64), (9, 7), (5, 6), (2, 2)])
@pytest.mark.parametrize("ratio", [0.25, 0.5, 0.6, 0.9])
def test_the_keys_and_values_ideal_keeps_as_many_tokens_as_local(h, w, ratio):
    plan = local.plan_local(torch.randn(1, h * w, 4), h, w, ratio, torch.int64)
    assert IdealPatch(ratio, None, keys_only=True).kept_tokens(h, w) == (plan.merged_tokens if plan else h * w)


@pytest.mark.parametrize("h, w", [(64, 64), (9, 7), (5, 6), (2, 2)])
@pytest.mark.parametrize("ratio", [0.25, 0.5, 0.6, 0.9])
def test_the_whole_stack_ideal_keeps_as_many_tokens_as_stack(h, w, ratio):
    plan = stack.plan_stack(torch.randn(1, h * w, 4), h, w, ratio, torch.int64)
    assert IdealPatch(ratio, None, whole_stacks=True).kept_tokens(h, w) == (plan.merged_tokens if plan else h * w)


def test_the_whole_stack_ideal_runs_every_block_of_the_stacks_stack_patches_on_the_kept_tokens():
    """SDXL's layout at levels 4: every attention, cross-attention and MLP call of the patched stacks sees the
    first N − r tokens, the same counts Stack gives them; the output is back on N tokens; it undoes itself."""
    unet = tiny_unet("sdxl")
    x, t, c = inputs(h=32, w=32)
    plain = run(unet, x, t, c)

    def shapes(patch_on, patch_off):
        seen = []
        blocks = [m for m in unet.modules() if type(m).__name__ == "BasicTransformerBlock"]
        handles = [getattr(b, part).register_forward_pre_hook(
            lambda mod, a, k: seen.append(tuple((a[0] if a else k["x"]).shape)), with_kwargs=True)
            for b in blocks for part in ("attn1", "attn2", "ff")]
        patch_on()
        out = run(unet, x, t, c)
        patch_off()
        for handle in handles:
            handle.remove()
        return seen, out

    ours, _ = shapes(lambda: tome_core.apply_patch(unet, method="stack", ratio=0.5, max_downsample=4),
                     lambda: tome_core.remove_patch(unet))
    ideal = IdealPatch(0.5, 4, whole_stacks=True)
    seen, out = shapes(lambda: ideal.apply(Wrapped(unet)), ideal.remove)
    assert seen == ours and all(n < 1024 // 4 + 1 for _, n, _ in seen)
    assert out.shape == plain.shape and not torch.equal(out, plain)
    assert torch.equal(run(unet, x, t, c), plain)


def test_the_keys_and_values_ideal_keeps_every_query():
    """Each patched self-attention call: all N queries against the first N − r tokens as keys and values, by
    the attention module's own code with that context; nothing else changes, and it undoes itself."""
    unet = tiny_unet()
    x, t, c = inputs(h=16, w=16)
    plain = run(unet, x, t, c)
    ideal = IdealPatch(0.5, None, keys_only=True)
    ideal.apply(Wrapped(unet))
    attn1 = next(m for m in unet.modules() if type(m).__name__ == "BasicTransformerBlock").attn1
    out = run(unet, x, t, c)  # the transformer's hook records the 16×16 grid
    assert out.shape == plain.shape and not torch.equal(out, plain)
    tokens = torch.randn(2, 256, attn1.to_q.in_features)
    with torch.no_grad():
        assert torch.equal(attn1(tokens), attn1.forward(tokens, context=tokens[:, :128]))
    ideal.remove()
    assert torch.equal(run(unet, x, t, c), plain)


def _self_attention_tokens(unet, x, t, c):
    seen = []
    handles = [m.attn1.register_forward_pre_hook(lambda mod, a, k: seen.append((a[0] if a else k["x"]).shape[1]),
                                                 with_kwargs=True)
               for m in unet.modules() if type(m).__name__ == "BasicTransformerBlock"]
    out = run(unet, x, t, c)
    for handle in handles:
        handle.remove()
    return seen, out


@pytest.mark.parametrize("layout", ["sd1", "sdxl"])
def test_ideal_shrinks_self_attention_in_the_blocks_ours_patches_and_undoes_itself(layout):
    unet = tiny_unet(layout)
    x, t, c = inputs(h=32, w=32)
    plain_tokens, plain = _self_attention_tokens(unet, x, t, c)
    tome_core.apply_patch(unet, ratio=0.5)
    patched = {id(b.block) for b in tome_core.patched_blocks(unet)}
    tome_core.remove_patch(unet)
    blocks = [m for m in unet.modules() if type(m).__name__ == "BasicTransformerBlock"]
    expected = [n // 2 if id(b) in patched else n for b, n in zip(blocks, plain_tokens)]

    ideal = IdealPatch(0.5, None)
    ideal.apply(Wrapped(unet))
    seen, out = _self_attention_tokens(unet, x, t, c)
    assert len(patched) > 0 and seen == expected
    assert out.shape == plain.shape and not torch.equal(out, plain)
    ideal.remove()
    assert torch.equal(run(unet, x, t, c), plain)


def test_the_roster_has_every_method_at_every_setting():
    racers = roster([0.3, 0.5], [2, 4])
    assert [c.name for c in racers] == ["none", "ToMe 0.30", "ToMe 0.50", "ToDo f=2", "ToDo f=4", "Local 0.30",
                                        "Local 0.50", "Stack 0.30", "Stack 0.50", "tomesd 0.30", "tomesd 0.50",
                                        "ideal 0.30", "ideal 0.50", "ideal KV 0.30", "ideal KV 0.50",
                                        "ideal S 0.30", "ideal S 0.50"]
    assert {c.name: c.ideal for c in racers if c.ideal} == {"ToMe 0.30": "ideal 0.30", "ToMe 0.50": "ideal 0.50",
                                                           "Local 0.30": "ideal KV 0.30",
                                                           "Local 0.50": "ideal KV 0.50",
                                                           "Stack 0.30": "ideal S 0.30",
                                                           "Stack 0.50": "ideal S 0.50",
                                                           "tomesd 0.30": "ideal 0.30", "tomesd 0.50": "ideal 0.50"}
    assert len(racers) == roster_size(2, 2)
    bare = roster([0.5], [2], with_tomesd=False, with_ideal=False, with_local=False, with_stack=False)
    assert [c.name for c in bare] == ["none", "ToMe 0.50", "ToDo f=2"] and all(c.ideal is None for c in bare)


# -- any width scale, every model -----------------------------------------------------------------------------

@pytest.mark.parametrize("arch", sorted(archs.ARCHS))
def test_head_width_divides_every_attention_level_at_any_width_scale(arch):
    cfg = archs.ARCHS[arch]
    for width in [w / 100 for w in range(1, 201)]:
        channels = archs.scaled_channels(cfg["model_channels"], width)
        assert channels % 32 == 0 and channels >= 32
        if "num_head_channels" in cfg:
            head = archs.head_channels(channels, cfg["num_head_channels"])
            assert all(channels * mult % head == 0 for mult in cfg["channel_mult"])
            assert head == (64 if channels % 64 == 0 else 32)
        else:
            assert channels % cfg["num_heads"] == 0


@pytest.mark.parametrize("arch, width", [("sd2", 0.5), ("sd2", 0.3), ("sd15", 0.3)])
def test_scaled_u_nets_run(webui_unet, arch, width):
    # sd2 at width 0.5 has 160 channels: 64-channel heads made 2 heads (128 channels) and the first call failed
    # with "mat1 and mat2 shapes cannot be multiplied (…x128 and 160x128)".
    unet, ctx_dim = archs.build_unet(arch, torch.device("cpu"), torch.float32, width)
    x = torch.randn(2, 4, 8, 8)
    with torch.no_grad():
        out = unet(x, torch.full((2,), 500.0), context=[torch.randn(2, 77, ctx_dim)] * archs.unet_depth(unet))
    assert out.shape == x.shape and torch.isfinite(out).all()


@pytest.mark.parametrize("latent", [2, 3, 9, 13])
def test_any_multiple_of_8_px_runs_as_in_the_webui(webui_unet, latent):
    # 3 downsamplings need latents divisible by 8 in plain ldm; the webui's resizing cat lifts that.
    unet, ctx_dim = archs.build_unet("sd15", torch.device("cpu"), torch.float32, 0.1)
    x = torch.randn(2, 4, latent, latent)
    with torch.no_grad():
        assert unet(x, torch.full((2,), 500.0), context=[torch.randn(2, 77, ctx_dim)]).shape == x.shape


def test_top_grid_rounds_up_as_strided_convolutions_do():
    assert [archs.top_grid(px, 1) for px in (16, 24, 72, 1024)] == [1, 2, 5, 64]
    assert archs.top_grid(520, 0) == 65 and math.ceil(65 / 2) == archs.top_grid(520, 1)


def test_size_weighted_contenders_join_the_roster_only_when_asked():
    plain = roster([0.5], [2], with_tomesd=False)
    weighted = roster([0.5], [2], with_tomesd=False, with_size_weighted=True)
    added = [c for c in weighted if c.name not in {p.name for p in plain}]
    assert [(c.name, c.method, c.ideal) for c in added] == [("ToMe +sw 0.50", "ToMe +sw", "ideal 0.50"),
                                                            ("Local +sw 0.50", "Local +sw", "ideal KV 0.50")]
    assert jobs.roster_size(1, 1, False, True, True) == len(weighted)
    unet = tiny_unet("sd1")
    wrapped = Wrapped(unet)
    for racer in added:
        racer.apply(wrapped)
        try:
            assert tome_core.get_patch(unet).options.size_weighted_keys
        finally:
            racer.remove(wrapped)
        assert not tome_core.is_patched(unet)
