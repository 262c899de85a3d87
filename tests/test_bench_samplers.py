"""The samplers room (``tome_core.bench.samplers``): one line per shipped proxy and sampler, each contender's final
PSNR against the unmerged pictures of the same sampler and noise."""

from __future__ import annotations

import re

import pytest

import torch

from tome_core.bench import samplers
from tome_core.bench.loading import load_proxies
from tome_core.bench.fidelity import noise_for
from tome_core.bench.metrics import psnr

pytestmark = pytest.mark.usefixtures("webui_unet_for_this_test_only")


def test_one_line_per_proxy_and_sampler_with_each_contenders_psnr(capsys):
    threads = torch.get_num_threads()
    assert samplers.main(["--layout", "sd15", "--samplers", "euler", "euler_a", "--contenders", "todo", "cache2",
                          "--steps", "5", "--images", "1", "--unprompted"]) == 0
    assert torch.get_num_threads() == threads  # its --threads is for its own run, not the caller's
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| seed")]
    assert len(rows) == 3 * 2
    # Beside each contender, its levels skipped: ToDo at levels 4 acts on every level but the middle one, the
    # cache "auto" on the levels below the top one.
    cell = r" [\d.]+ \[[\d.]+–[\d.]+\] \|"
    assert all(re.fullmatch(rf"\| seed \d \| (Euler|Euler a) \| none \(no prompt\) \|{cell}{cell[:-3]} \(4,096 "
                            rf"tokens, 1,024 tokens, 256 tokens\) \|{cell}{cell[:-3]} \(1,024 tokens, 256 tokens, "
                            rf"64 tokens\) \|", r) for r in rows), rows


def test_proxy_weights_of_ones_choosing_are_measured_instead_of_the_shipped_ones(capsys):
    from tome_core.bench import proxy

    weights = proxy.SHIPPED_WEIGHTS[1]
    assert samplers.main(["--layout", "sd15", "--proxy", weights, "--samplers", "euler", "--contenders", "todo",
                          "--steps", "3", "--images", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| seed")]
    assert len(rows) == 1 and rows[0].startswith("| seed 1 | Euler |")


def test_drift_share_sets_caches_share_for_its_run_only_and_changes_its_pictures(capsys, monkeypatch):
    from tome_core.bench import proxy
    from tome_core.methods import cache

    shares = []
    run = samplers._run
    monkeypatch.setattr(samplers, "_run", lambda args, argv: shares.append(cache.DRIFT_SHARE) or run(args, argv))
    before = cache.DRIFT_SHARE
    figures = {}
    for share in ("0", "2"):
        assert samplers.main(["--layout", "sd15", "--proxy", proxy.SHIPPED_WEIGHTS[0], "--samplers", "euler",
                              "--contenders", "cache2", "--steps", "8", "--images", "1", "--drift-share", share]) == 0
        [row] = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| seed")]
        figures[share] = row.split("|")[4]
    assert shares == [0.0, 2.0] and cache.DRIFT_SHARE == before  # the engine's own share again after each run
    assert figures["0"] != figures["2"]  # the reused steps carry the drift on, or not
    with pytest.raises(SystemExit):
        samplers.main(["--drift-share", "-1"])
    assert "expected 0 to 2" in capsys.readouterr().err


def test_ancestral_noise_repeats_and_no_patch_gives_the_unmerged_picture():
    _, pipe = load_proxies(torch.device("cpu"), torch.float32, prompted=False)[0]
    noise = noise_for(pipe, pipe.size, 1, 0)
    a = samplers.final_pictures(pipe, noise, 3, "euler_a", 7, None)
    assert torch.equal(a, samplers.final_pictures(pipe, noise, 3, "euler_a", 7, None))
    other = samplers.final_pictures(pipe, noise, 3, "euler_a", 8, None)
    assert psnr(other, a) < 60  # another fresh noise: another picture
    todo = samplers.final_pictures(pipe, noise, 3, "euler_a", 7, samplers.CONTENDERS["todo"][1])
    assert not torch.equal(todo, a)


def test_the_extensions_tome_is_raced_beside_the_papers(capsys):
    """tome50-sw is ToMe as the extension runs it (size-weighted keys, its Auto for ToMe), tome50 the paper's: at
    one ratio they share a merge plan and differ only in the keys' weights, so their pictures differ."""
    from tome_core.bench import proxy

    assert samplers.CONTENDERS["tome50-sw"][1] == dict(method="tome", ratio=0.5, size_weighted_keys=True)
    _, pipe = load_proxies(torch.device("cpu"), torch.float32, prompted=False)[0]
    noise = noise_for(pipe, pipe.size, 1, 0)
    papers = samplers.final_pictures(pipe, noise, 3, "euler", 7, samplers.CONTENDERS["tome50"][1])
    ours = samplers.final_pictures(pipe, noise, 3, "euler", 7, samplers.CONTENDERS["tome50-sw"][1])
    assert not torch.equal(papers, ours)

    # The main race's "ToMe 0.50" and "ToMe +sw 0.50", sampled by the race's own path from the same noise: the
    # same pictures, so a figure of either room speaks for the other.
    from tome_core.bench.contenders import roster
    from tome_core.bench.fidelity import sample_pictures

    racers = [c for c in roster([0.5], [], with_tomesd=False, with_ideal=False, with_size_weighted=True)
              if c.name in ("ToMe 0.50", "ToMe +sw 0.50")]
    raced = sample_pictures(pipe, racers, pipe.size, 3, seed=0, images=1).images
    assert torch.equal(raced["ToMe 0.50"], papers.clamp(0, 1))
    assert torch.equal(raced["ToMe +sw 0.50"], ours.clamp(0, 1))
    assert samplers.main(["--layout", "sd15", "--proxy", proxy.SHIPPED_WEIGHTS[0], "--samplers", "euler",
                          "--contenders", "tome50-sw", "--steps", "2", "--images", "1"]) == 0
    assert "| ToMe 0.5 size-weighted |" in capsys.readouterr().out


def test_the_weighted_one_step_figure_weighs_each_step_by_its_move_of_the_sample():
    """Two steps at σ 3 then 1 (then 0): Euler moves the sample by 2ε and then by 1ε, so the weights are 4 and 1.
    An error of 0.5 on every number of the second step's ε (of ones): every step alike, (0 + 0.25) / 2; weighted,
    (4·0 + 1·0.25·4) / (4·4 + 1·4) over the 4 numbers of a 1×2×2 image."""
    from tome_core.bench.stepwise import relative_error, sample_weights, weighted_relative_error

    sigmas = [3.0, 1.0]
    eps = torch.ones(2, 1, 1, 2, 2, dtype=torch.float64)
    moved = eps.clone()
    moved[1] += 0.5
    inputs = torch.zeros_like(eps)
    sig = torch.tensor(sigmas, dtype=torch.float64).view(-1, 1, 1, 1, 1)
    reference, other = inputs - sig * eps, inputs - sig * moved  # x̂0 = x_t − σ·ε
    assert sample_weights(sigmas).tolist() == [4.0, 1.0]
    assert relative_error(reference, other, inputs, sigmas).tolist() == pytest.approx([0.125])
    assert weighted_relative_error(reference, other, inputs, sigmas).tolist() == pytest.approx([0.05])


def test_the_summed_figure_adds_the_moves_errors_before_squaring_them():
    """The same two steps (moves −2 and −1 per unit of ε): errors of +0.5 then −1 on every number cancel in the
    sum of the moves, (−2·0.5 + −1·−1) = 0; errors of +0.5 twice add up, (−1 − 0.5)² = 2.25 per number, over
    the whole run's move of ε = 1, (−2 − 1)² = 9 per number."""
    from tome_core.bench.stepwise import summed_relative_error

    sigmas = [3.0, 1.0]
    eps = torch.ones(2, 1, 1, 2, 2, dtype=torch.float64)
    inputs = torch.zeros_like(eps)
    sig = torch.tensor(sigmas, dtype=torch.float64).view(-1, 1, 1, 1, 1)
    cancelling, adding = eps.clone(), eps + 0.5
    cancelling[0] += 0.5
    cancelling[1] -= 1.0
    reference = inputs - sig * eps
    assert summed_relative_error(reference, inputs - sig * cancelling, inputs, sigmas).tolist() == pytest.approx([0.0])
    assert summed_relative_error(reference, inputs - sig * adding, inputs, sigmas).tolist() == pytest.approx([0.25])


def test_step_figures_are_printed_beside_the_final_pictures(capsys):
    assert samplers.main(["--layout", "sd15", "--samplers", "euler", "--contenders", "todo", "cache", "--steps", "4",
                          "--images", "1", "--step-figures", "--unprompted"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| seed")]
    assert len(rows) == 3 * 4
    assert sum("weighted by the sample's move" in r for r in rows) == 3
    assert sum("summed as the sample's moves" in r for r in rows) == 3
    cell = r" [\d.]+ \[[\d.]+–[\d.]+\]"
    assert all(re.fullmatch(rf"\| seed \d \| Euler \| none \(no prompt\) \|({cell} \|{cell} \([^)]+\) \|){{2}}", r)
               or re.fullmatch(rf"\| seed \d \| [^|]+ \(Euler\) \| none \|({cell} \| – \|){{2}}", r) for r in rows), rows
    agreement = [line for line in out.splitlines() if line.startswith("- seed")]
    assert len(agreement) == 3 and all(re.fullmatch(r"- seed \d: one step, every step alike [01] of 1, one step, "
                                                    r"weighted by the sample's move [01] of 1, one step, summed as "
                                                    r"the sample's moves [01] of 1", a) for a in agreement)


def test_pairs_in_order_counts_the_pairs_a_figure_orders_as_the_pictures():
    # Pictures 40 > 30 > 20 (and a tie 30 = 30, not counted); the figure swaps the first two: 4 of 5 pairs.
    assert samplers.pairs_in_order([40, 30, 20, 30], [5, 6, 1, 2]) == (4, 5)
    assert samplers.pairs_in_order([1, 2], [1, 2]) == (1, 1)
    assert samplers.pairs_in_order([1, 1], [3, 2]) == (0, 0)


def test_the_room_takes_its_layout_as_the_main_race_spells_it_too():
    """``--layouts`` (the race's spelling) is this room's ``--layout``, one layout a run; the default is SDXL's."""
    import argparse

    ap = argparse.ArgumentParser()
    samplers.add_run_arguments(ap)
    assert ap.parse_args([]).layout == "sdxl"
    assert ap.parse_args(["--layout", "sd15"]).layout == ap.parse_args(["--layouts", "sd15"]).layout == "sd15"
    with pytest.raises(SystemExit):
        ap.parse_args(["--layouts", "sd21"])
