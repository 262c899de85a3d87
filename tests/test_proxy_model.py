"""The shipped proxy model sees image structure, so fidelity figures measured on it can rank merging methods.

Each test is built to fail on a model that does not: random or barely trained weights merge as badly with
ToMe as with random destinations, and sample noise or flat colour.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import pytest
import torch

import tome_core
import tome_core.methods.tome
import tome_core.patch
from tome_core.bench import proxy
from tome_core.bench.pipeline import Pipeline, sd_alphas_cumprod
from tome_core.bench.proxy import training
from tome_core.bench.contenders import Contender
from tome_core.bench.sampling import euler_sample
from tome_core.bench.stepwise import reference_trajectory, step_errors

pytestmark = [pytest.mark.filterwarnings("ignore"),
              pytest.mark.usefixtures("one_thread_and_webui_ldm_for_this_module")]
T_MODERATE = 300  # ᾱ ≈ 0.59: the picture's structure still shows through the noise
CROPS = 6


@pytest.fixture(scope="module")
def pipe() -> Pipeline:
    return proxy.load_proxy()


@pytest.fixture(scope="module", params=proxy.shipped_weights(("sd15",), prompted=False)[0], ids=lambda path: os.path.basename(path))
def each_shipped(request) -> tuple[str, Pipeline]:
    """Every shipped proxy, each trained from its own seed: the default run's fidelity rests on all of them."""
    return request.param, proxy.load_proxy(path=request.param)


@pytest.fixture(scope="module")
def held_out() -> torch.Tensor:
    """(CROPS, 3, 64, 64) crops of photographs the model never saw."""
    return training.held_out_crops(CROPS, proxy.EVAL_SIZE)


def _noised(x0: torch.Tensor, seed: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.full((x0.shape[0],), T_MODERATE)
    noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(seed))
    return training.noised(x0, t, noise, sd_alphas_cumprod().float()), t


def _predict(pipe: Pipeline, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return pipe.unet(x, t, context=pipe.context.expand(x.shape[0], -1, -1))


def _random_metric_plan(seed: int):
    """``plan_split`` as the engine calls it, but scoring similarity on Gaussian noise instead of the block
    input: the same partition, the same number of merged tokens and the same merge/unmerge, with each merged
    source going to a uniformly random destination. What merging costs when it ignores the picture."""
    real = tome_core.methods.tome.plan_split
    gen = torch.Generator().manual_seed(seed)

    def plan_split(metric, rows, r, *args, **kwargs):
        noise = torch.randn(metric.shape, generator=gen).to(metric.device, metric.dtype)
        return real(noise, rows, r, *args, **kwargs)
    return plan_split


def _change(pipe: Pipeline, x: torch.Tensor, t: torch.Tensor, base: torch.Tensor, ratio: float,
            monkeypatch=None, random_destinations: bool = False) -> float:
    """RMS change of the predicted noise under a merge at ``ratio``, relative to the prediction's RMS."""
    with pytest.MonkeyPatch.context() as mp:
        if random_destinations:
            mp.setattr(tome_core.methods.tome, "plan_split", _random_metric_plan(seed=11))
        tome_core.apply_patch(pipe.unet, ratio=ratio, use_rand=False)
        try:
            out = _predict(pipe, x, t)
        finally:
            tome_core.remove_patch(pipe.unet)
    return float((out - base).pow(2).mean().sqrt() / base.pow(2).mean().sqrt())


def test_weights_ship_small_and_load_as_a_pixel_space_pipeline(each_shipped):
    path, pipe = each_shipped
    assert os.path.getsize(path) <= 10.5e6
    assert (pipe.channels, pipe.downscale, pipe.prediction) == (3, 1, "eps")
    assert pipe.context.shape == (1, proxy.CONTEXT_TOKENS, proxy.CONTEXT_DIM)
    assert not any(p.requires_grad for p in pipe.unet.parameters()) and not pipe.unet.training
    assert torch.equal(pipe.decode(torch.tensor([-1.0, 0.0, 1.0, 3.0])), torch.tensor([0.0, 0.5, 1.0, 1.0]))
    # Trained, not fresh: ldm initialises every proj_out and the output conv to zero.
    assert pipe.unet.out[-1].weight.abs().max() > 0.01
    assert all(t.proj_out.weight.abs().max() > 0.01 for _, t, _ in tome_core.patch.transformer_levels(pipe.unet))


def test_missing_or_foreign_weights_say_how_to_get_them(tmp_path):
    with pytest.raises(FileNotFoundError, match="python -m tome_core.bench.proxy train"):
        proxy.load_proxy(path=str(tmp_path / "absent.safetensors"))
    from safetensors.torch import save_file

    foreign = str(tmp_path / "foreign.safetensors")
    save_file({"context": torch.zeros(1, 4, 32)}, foreign, metadata={"arch": '{"model_channels": 64}'})
    with pytest.raises(ValueError, match="another architecture"):
        proxy.load_proxy(path=foreign)


def test_a_proxy_of_other_widths_loads_as_trained_and_other_levels_are_refused(tmp_path):
    images = [torch.linspace(-1, 1, 3 * 48 * 64).view(3, 48, 64)]
    config = training.TrainConfig(seed=2, layout="sdxl", stages=((32, 1, 1),), warmup=1, channel_mult=(1, 1, 3))
    state = training.train(config, images, log=lambda line: None)
    path = str(tmp_path / "wide.safetensors")
    training.save_weights(state, path, training.training_metadata(config), "sdxl")
    wide = proxy.load_proxy(path=path)
    # The deep level's stacks are three times the base width (32), the level above them once, as trained.
    widths = {t.proj_in.in_features for _, t, _ in tome_core.patch.transformer_levels(wide.unet)}
    assert widths == {32, 96}
    loaded = wide.unet.state_dict()
    assert all(torch.equal(loaded[k], state[k].half().float()) for k in loaded)
    with pytest.raises(ValueError, match="3 levels"):
        proxy.build_proxy_unet(0, "sdxl", (1, 2))
    # Widths are a proxy's own; its levels are the layout's.
    metadata = training.training_metadata(config)
    arch = json.loads(metadata["arch"])
    deeper = str(tmp_path / "deeper.safetensors")
    training.save_weights(state, deeper, {**metadata, "arch": json.dumps({**arch, "attention_resolutions": [4]})},
                          "sdxl")
    with pytest.raises(ValueError, match="another architecture"):
        proxy.load_proxy(path=deeper)


@pytest.mark.parametrize("flags, said", [(["--channel-mult", "1,2"], "expected 3 positive integers"),
                                         (["--channel-mult", "1,x,3"], "expected 3 positive integers"),
                                         (["--stages", "32:600"], "expected 3 positive integers"),
                                         (["--stages", "32:0:16"], "expected 3 positive integers"),
                                         (["--eval-shift", "0"], "expected a positive number"),
                                         (["--eval-shift", "nan"], "expected a positive number"),
                                         (["--eval-shift", "inf"], "expected a positive number"),
                                         (["--deep-first", "3"], "expected 0 to 2, fewer than the 3 stages"),
                                         (["--deep-first", "-1"], "expected 0 to 2"),
                                         (["--first-levels", "ends"], "give --deep-first N too")])
def test_train_refuses_malformed_widths_and_stages_in_one_line_before_training(flags, said, tmp_path, capsys):
    from tome_core.bench.proxy.__main__ import main

    out = str(tmp_path / "never.safetensors")
    with pytest.raises(SystemExit) as stop:
        main(["train", "--layout", "sdxl", "--out", out] + flags)
    assert stop.value.code == 2 and said in capsys.readouterr().err
    assert not os.path.exists(out)


def test_shifted_timesteps_follow_the_shift_and_only_the_evaluation_size_stage_draws_them(tmp_path):
    # shift·u / (1 + (shift − 1)·u) with u uniform: above the middle when u > 1 / (1 + shift), so a share
    # shift / (1 + shift) of the draws; the median u = 1/2 maps to shift / (1 + shift) of the way.
    for shift in (1.0, 3.0):
        t = training.shifted_timesteps(40000, shift, 1000, torch.Generator().manual_seed(0))
        assert t.dtype == torch.int64 and 0 <= int(t.min()) and int(t.max()) <= 999
        assert abs(float((t >= 500).double().mean()) - shift / (1 + shift)) < 0.01
        assert abs(float(t.double().median()) - 1000 * shift / (1 + shift)) < 10
    # A stage below the evaluation size draws as before (the same weights after it); the evaluation size's
    # stage draws the shifted timesteps, and the file says so.
    images = [torch.linspace(-1, 1, 3 * 80 * 80).view(3, 80, 80)]
    after = {}
    for shift in (1.0, 3.0):
        pattern = str(tmp_path / f"shift{shift}-{{stage}}.safetensors")
        config = training.TrainConfig(seed=5, stages=((16, 1, 1), (64, 1, 1)), warmup=1, eval_shift=shift,
                                      save_every_stage=pattern)
        after[shift] = (training.train(config, images, log=lambda line: None), pattern)
    from safetensors.torch import load_file

    first = [load_file(pattern.format(stage="16px")) for _, pattern in after.values()]
    assert all(torch.equal(first[0][k], first[1][k]) for k in first[0])
    assert not all(torch.equal(after[1.0][0][k], after[3.0][0][k]) for k in after[1.0][0])
    assert "eval_shift" not in training.training_metadata(training.TrainConfig())
    assert training.training_metadata(training.TrainConfig(eval_shift=3.0))["eval_shift"] == "3.0"


@pytest.mark.parametrize("first_levels, trained_first", [("deepest", {3}), ("ends", {0, 3})])
def test_deep_first_trains_only_the_chosen_attention_levels_in_its_stages_then_every_level(first_levels, trained_first):
    images = [torch.linspace(-1, 1, 3 * 80 * 80).view(3, 80, 80)]
    first_stage = ((16, 6, 1),)
    runs = {stages: training.train(training.TrainConfig(seed=3, stages=stages, warmup=1, deep_first=1,
                                                        first_levels=first_levels), images, log=lambda line: None)
            for stages in (first_stage, first_stage + ((32, 4, 1),))}
    initial = dict(proxy.build_proxy_unet(3, "sd15").named_parameters())
    levels = tome_core.patch.transformer_levels(proxy.build_proxy_unet(3, "sd15"))
    names = {level: [f"{path}.{n}" for path, module, lv in levels if lv == level for n, _ in module.named_parameters()]
             for level in {lv for _, _, lv in levels}}
    assert sorted(names) == [0, 1, 2, 3]  # SD 1.x: 4,096, 1,024 and 256 tokens, and the middle block's 64

    def moved(state, level):  # how many of the level's parameters training moved (the EMA rounds at 1e-7)
        return sum(not torch.allclose(state[n], initial[n].detach(), rtol=1e-6, atol=1e-7) for n in names[level])

    # In the first stage the held levels never reach the loss, so they keep their initial weights; the chosen
    # levels' transformers (the middle block's; with "ends" the 4,096-token level's too) and the rest of the
    # U-Net learn.
    after_first = runs[first_stage]
    assert all(moved(after_first, level) == 0 for level in set(names) - trained_first)
    assert all(moved(after_first, level) > len(names[level]) // 2 for level in trained_first)
    assert not torch.allclose(after_first["out.2.weight"], initial["out.2.weight"].detach(), rtol=1e-6, atol=1e-7)
    # From the next stage on every level learns.
    assert all(moved(runs[first_stage + ((32, 4, 1),)], level) > len(names[level]) // 2 for level in names)
    said = training.training_metadata(training.TrainConfig(deep_first=1, first_levels=first_levels))
    assert said["deep_first"] == "1" and said.get("first_levels", "deepest") == first_levels
    assert ("first_levels" in said) == (first_levels != "deepest")
    assert "deep_first" not in training.training_metadata(training.TrainConfig())


@pytest.mark.parametrize("layout, flags, said", [("sd15", [], {"deep_first": "1", "first_levels": "ends"}),
                                                  ("sd15", ["--deep-first", "0"], {}),
                                                  ("sd15", ["--first-levels", "deepest"], {"deep_first": "1"}),
                                                  ("sdxl", [], {"deep_first": "1"}),
                                                  ("sdxl", ["--deep-first", "0"], {})])
def test_a_prompted_proxy_trains_with_its_layouts_curriculum_unless_told_otherwise(layout, flags, said, tmp_path):
    from safetensors import safe_open

    from tome_core.bench.proxy.__main__ import main

    out = str(tmp_path / "prompted.safetensors")
    stages = "16:1:1,16:1:1" if layout == "sd15" else "32:1:1,32:1:1"
    assert main(["train", "--layout", layout, "--data", "scenes", "--stages", stages, "--out", out] + flags) == 0
    with safe_open(out, "pt") as weights:
        metadata = weights.metadata()
    assert {k: metadata[k] for k in ("deep_first", "first_levels") if k in metadata} == said


def test_held_levels_are_every_attention_level_but_the_chosen_ones():
    assert training.held_levels([0, 1, 2, 3], "deepest") == {0, 1, 2}
    assert training.held_levels([0, 1, 2, 3], "ends") == {1, 2}
    assert training.held_levels([1, 2], "deepest") == {1}  # SDXL's two levels: its deep level trains first
    assert training.held_levels([1, 2], "ends") == set()  # both are ends: nothing held, every level trains


def test_layout_is_sd1_and_the_patcher_merges_4096_top_tokens_at_64px(pipe):
    levels = {}
    for _, t, level in tome_core.patch.transformer_levels(pipe.unet):
        levels[level] = levels.get(level, 0) + 1
    # SD 1.x: attention at downsampling 1, 2, 4 (input and output blocks) and in the middle block only at 8.
    assert sorted(levels) == [0, 1, 2, 3] and levels[3] == 1 and min(levels[0], levels[1], levels[2]) >= 2

    seen = []
    top = [t for _, t, level in tome_core.patch.transformer_levels(pipe.unet) if level == 0]
    # Tokens self-attention actually computes on: its query projection's input (after any merge).
    handles = [t.transformer_blocks[0].attn1.to_q.register_forward_pre_hook(lambda m, a: seen.append(a[0].shape[1]))
               for t in top]
    x = torch.zeros(1, 3, proxy.EVAL_SIZE, proxy.EVAL_SIZE)
    t = torch.tensor([500])
    try:
        _predict(pipe, x, t)
        unpatched = list(seen)
        seen.clear()
        tome_core.apply_patch(pipe.unet, ratio=0.5, use_rand=False)
        selected = tome_core.patched_blocks(pipe.unet)
        _predict(pipe, x, t)
    finally:
        tome_core.remove_patch(pipe.unet)
        for h in handles:
            h.remove()
    assert {b.level for b in selected} == {0} and len(selected) == levels[0]
    assert unpatched == [4096] * levels[0]
    assert seen == [2048] * levels[0]


def _tome_and_random_changes(pipe: Pipeline, x0: torch.Tensor) -> tuple[float, float]:
    """Relative change of ``pipe``'s prediction on ``x0`` noised to ``T_MODERATE`` under ToMe at ratio 0.5 and
    under the same merge into random destinations."""
    x, t = _noised(x0)
    base = _predict(pipe, x, t)
    return _change(pipe, x, t, base, 0.5), _change(pipe, x, t, base, 0.5, random_destinations=True)


def test_tome_moves_the_prediction_far_less_than_random_destinations(pipe, held_out):
    """Choosing destinations by similarity must pay off clearly on pictures the model never saw. (The same
    architecture with random weights gets about 0.6 of the random control, because neighbouring features of any
    convolutional net are alike; the trained proxy must do clearly better.) Seed 0's proxy only: seed 1's,
    trained by the same recipe, gets 0.60, no better than random weights, though it orders the methods as
    seed 0's does (the README's fidelity tables)."""
    tome, random = _tome_and_random_changes(pipe, held_out)
    print(f"\nheld-out crops, t={T_MODERATE}, ratio 0.5: ToMe {tome:.4f}, random destinations {random:.4f} "
          f"({tome / random:.2f})")
    assert tome > 0  # the patch acted at all
    assert tome < 0.55 * random


def test_tome_change_grows_with_the_ratio(pipe, held_out):
    x, t = _noised(held_out)
    base = _predict(pipe, x, t)
    changes = [_change(pipe, x, t, base, ratio) for ratio in (0.25, 0.5, 0.75)]
    print(f"\nToMe change at ratio 0.25/0.5/0.75: {changes}")
    assert 0 < changes[0] < changes[1] < changes[2]


def test_training_made_tokens_more_mergeable_than_the_architecture_alone(pipe, held_out):
    """The same U-Net with random weights (its zero-initialised layers given random values so every block
    counts), on the same crops: ToMe's advantage over random destinations must be larger on the trained proxy,
    i.e. it comes from what training on photographs taught, not from convolutions smoothing any input."""
    from unets import randomize_zero_layers

    untrained = Pipeline(name="random weights", unet=randomize_zero_layers(proxy.build_proxy_unet(0), 0.02).eval(),
                         context=torch.randn(1, proxy.CONTEXT_TOKENS, proxy.CONTEXT_DIM,
                                             generator=torch.Generator().manual_seed(0)), channels=3, downscale=1)
    tome, random = _tome_and_random_changes(pipe, held_out)
    tome_u, random_u = _tome_and_random_changes(untrained, held_out)
    print(f"\nToMe / random destinations: trained {tome / random:.2f}, random weights {tome_u / random_u:.2f}")
    assert tome / random < tome_u / random_u - 0.05


def _psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean PSNR (dB) of pictures (B, 3, h, w) in [0, 1]."""
    return float((10 * torch.log10(1 / (a - b).pow(2).flatten(1).mean(1))).mean())


def _step_db(pipe: Pipeline, trajectory, ratio: float, random_destinations: bool = False) -> float:
    """The benchmark's one-step figure (dB, the median over the images) of ToMe at ``ratio`` along the
    unmerged ``trajectory``."""
    tome = Contender("ToMe", lambda model: tome_core.apply_patch(model, ratio=ratio, use_rand=False),
                     tome_core.remove_patch, "ToMe")
    with pytest.MonkeyPatch.context() as mp:
        if random_destinations:
            mp.setattr(tome_core.methods.tome, "plan_split", _random_metric_plan(seed=11))
        return statistics.median(step_errors(pipe, [tome], trajectory)["ToMe"])


def test_sampled_fidelity_falls_as_the_ratio_rises(pipe):
    """The benchmark's own measures on a short run. Per step along the unmerged trajectory (the measure the
    README ranks by): the change grows with the ratio, and choosing destinations by similarity beats random
    ones (by 6.0 dB on the seed-0 proxy; a U-Net with random weights gets about as much, so that training
    made similarity pay is the held-out tests' concern, above). The final pictures only have to stay close at
    every ratio: which ratio ends closest after the whole trajectory differs between proxies trained alike, so
    no order of them is asserted."""
    noise = torch.randn(2, 3, proxy.EVAL_SIZE, proxy.EVAL_SIZE, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        trajectory, reference = reference_trajectory(pipe, noise.double(), steps=8)
        step = {ratio: _step_db(pipe, trajectory, ratio) for ratio in (0.25, 0.5, 0.75)}
        random = _step_db(pipe, trajectory, 0.5, random_destinations=True)
        final = {}
        for ratio in (0.25, 0.5, 0.75):
            tome_core.apply_patch(pipe.unet, ratio=ratio, use_rand=False)
            try:
                final[ratio] = _psnr(pipe.decode(euler_sample(pipe, noise.double(), steps=8)), pipe.decode(reference))
            finally:
                tome_core.remove_patch(pipe.unet)
    print(f"\n8 steps, ToMe at 0.25/0.5/0.75: step dB {step}, random destinations at 0.5 {random:.2f}; "
          f"final-picture PSNR {final}")
    assert step[0.25] > step[0.5] > step[0.75] > 20
    assert random < step[0.5] - 3
    assert min(final.values()) > 30


def test_loading_needs_no_photograph_packages():
    """The benchmark's default run loads only the weights: scikit-image and scikit-learn are for training."""
    code = ("import sys; from tome_core.bench.proxy import load_proxy; load_proxy(); "
            "assert not {'skimage', 'sklearn'} & set(sys.modules), sorted({'skimage', 'sklearn'} & set(sys.modules))")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def _neighbour_correlation(images: torch.Tensor) -> float:
    """Mean correlation of horizontally adjacent pixels, per image and channel: (B, C, h, w) -> scalar."""
    a, b = images[..., :, :-1].flatten(2), images[..., :, 1:].flatten(2)
    a, b = a - a.mean(-1, keepdim=True), b - b.mean(-1, keepdim=True)
    corr = (a * b).sum(-1) / (a.pow(2).sum(-1) * b.pow(2).sum(-1)).sqrt().clamp_min(1e-12)
    return float(corr.mean())


def test_samples_look_like_pictures_not_noise(pipe, held_out):
    noise = torch.randn(2, 3, proxy.EVAL_SIZE, proxy.EVAL_SIZE, generator=torch.Generator().manual_seed(0))
    samples = euler_sample(pipe, noise, steps=12).float()
    smooth = _neighbour_correlation(samples)
    photographs = _neighbour_correlation(held_out)
    print(f"\nneighbour correlation: samples {smooth:.3f}, held-out photographs {photographs:.3f}, "
          f"noise {_neighbour_correlation(noise):.3f}")
    # Far above noise's 0 (photographs: about 0.95; 12 steps leave some grain, 25 steps give about 0.8).
    assert smooth > 0.5 and abs(_neighbour_correlation(noise)) < 0.1
    # In the pictures' range and not one flat colour: a model that denoises everything to grey fails here.
    assert samples.abs().max() < 1.5
    assert float(samples.flatten(1).std(-1).min()) > 0.05
    # Differing seeds give different pictures.
    assert (samples[0] - samples[1]).abs().mean() > 0.05


def test_training_is_deterministic_and_runs_end_to_end(tmp_path):
    images = [training.load_photographs(("coffee",))[0][:, :96, :128],
              torch.linspace(-1, 1, 3 * 48 * 64).view(3, 48, 64)]
    config = training.TrainConfig(seed=5, stages=((16, 2, 2), (32, 1, 1)), warmup=1)
    logs: list[str] = []
    first = training.train(config, images, log=logs.append)
    second = training.train(config, images, log=logs.append)
    other = training.train(training.TrainConfig(seed=6, stages=config.stages, warmup=1), images, log=logs.append)
    assert first.keys() == second.keys() and "context" in first
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert not all(torch.equal(first[k], other[k]) for k in first)
    assert any("loss" in line for line in logs)

    path = str(tmp_path / "tiny.safetensors")
    training.save_weights(first, path, {"seed": "5"})
    tiny = proxy.load_proxy(path=path)
    noise = torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    sample = euler_sample(tiny, noise, steps=2)
    assert sample.shape == noise.shape and torch.isfinite(sample).all()


@pytest.mark.parametrize("prompted", [False, True], ids=["photographs", "prompted"])
@pytest.mark.parametrize("layout", sorted(proxy.LAYOUTS))
def test_the_shipped_proxies_are_trained_from_distinct_seeds_with_the_same_recipe(layout, prompted):
    seeds, stages = [], set()
    here, _ = proxy.shipped_weights((layout,), prompted=prompted)
    for path in here:
        meta = proxy.read_metadata(path)
        seeds.append(int(meta["seed"]))
        stages.add(meta["stages"])
        assert proxy.layout_of(meta).name == layout
        assert proxy.describe(path) == f"seed {meta['seed']}"
    assert len(set(seeds)) == len(seeds) >= 3
    # The layout's default recipe, as --seed N (--layout sdxl) (--data scenes) makes it.
    assert stages == {json.dumps(proxy.PROMPTED_STAGES[layout] if prompted else proxy.LAYOUTS[layout].stages)}


def test_shipped_weights_lists_what_is_here_and_how_to_make_what_is_not(tmp_path, monkeypatch):
    here, gone = str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")
    open(here, "wb").close()
    monkeypatch.setattr(proxy, "SHIPPED_WEIGHTS", (here, gone))
    monkeypatch.setattr(proxy, "SHIPPED_SDXL_WEIGHTS", (gone + "-sdxl",))
    monkeypatch.setattr(proxy, "SHIPPED_PROMPTED_WEIGHTS", (gone + "-prompted", here))
    monkeypatch.setattr(proxy, "SHIPPED_PROMPTED_SDXL_WEIGHTS", ())
    assert proxy.shipped_weights(prompted=False) == ([here], [gone, gone + "-sdxl"])
    assert proxy.shipped_weights(("sd15",), prompted=False) == ([here], [gone])
    assert proxy.shipped_weights() == ([here], [gone + "-prompted"])  # the prompted ones unless asked otherwise
    assert proxy.shipped_weights(("sdxl",)) == ([], [])
    assert proxy.train_command(gone + "-sdxl") == (f"python -m tome_core.bench.proxy train --layout sdxl --seed 0 "
                                                    f"--out {gone}-sdxl")
    assert proxy.train_command(gone) == f"python -m tome_core.bench.proxy train --seed 1 --out {gone}"
    with pytest.raises(FileNotFoundError, match=f"train --seed 1 --out {gone}"):
        proxy.load_proxy(path=gone)


def test_a_library_install_without_the_weights_folder_says_where_the_weights_are(tmp_path, monkeypatch):
    # A pip-installed engine has no weights folder: the refusal points at the repository's, not at training.
    folder = tmp_path / "weights"
    monkeypatch.setattr(proxy, "WEIGHTS_DIR", str(folder))
    monkeypatch.setattr(proxy, "WEIGHTS_FILE", str(folder / "proxy_weights.safetensors"))
    monkeypatch.setattr(proxy, "SHIPPED_WEIGHTS", (proxy.WEIGHTS_FILE,))
    with pytest.raises(FileNotFoundError) as refused:
        proxy.load_proxy()
    line = str(refused.value)
    assert "\n" not in line and "tome_core/bench/weights/" in line and "--proxy FILE" in line
    assert "train" not in line


# -- the SDXL-layout proxies -------------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=proxy.shipped_weights(("sdxl",), prompted=False)[0], ids=lambda path: os.path.basename(path))
def each_sdxl(request) -> tuple[str, Pipeline]:
    return request.param, proxy.load_proxy(path=request.param)


def test_sdxl_layout_proxies_have_sdxls_levels_and_its_token_counts_at_128px(each_sdxl):
    """No attention at full resolution, two blocks a transformer at the first attention level and ten at the
    second, holding 4,096 and 1,024 tokens at 128 px as SDXL's do at 1024 px; trained weights, small file."""
    path, pipe = each_sdxl
    assert os.path.getsize(path) <= 10.5e6 and pipe.size == proxy.SDXL_EVAL_SIZE == 128
    assert pipe.label == "SDXL-layout proxy"
    depths = {}
    for _, t, level in tome_core.patch.transformer_levels(pipe.unet):
        depths.setdefault(level, set()).add(len(t.transformer_blocks))
        assert t.proj_out.weight.abs().max() > 0.01
    assert depths == {1: {2}, 2: {10}}
    seen = set()
    blocks = [m for m in pipe.unet.modules() if type(m).__name__ == "BasicTransformerBlock"]
    handles = [b.attn1.register_forward_pre_hook(lambda m, a, k: seen.add((a[0] if a else k["x"]).shape[1]),
                                                 with_kwargs=True) for b in blocks]
    _predict(pipe, torch.zeros(1, 3, 128, 128), torch.tensor([500]))
    for handle in handles:
        handle.remove()
    assert seen == {4096, 1024}


def test_sdxl_layout_proxies_predict_the_noise_and_stack_merging_moves_them_with_the_ratio(each_sdxl):
    """On held-out photographs the trained model's noise prediction is far better than none (predicting zero);
    Stack at levels 4 (both attention levels) moves it more as the ratio rises."""
    _, pipe = each_sdxl
    x0 = training.held_out_crops(2, 128)
    t = torch.full((2,), T_MODERATE)
    noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(7))
    x = training.noised(x0, t, noise, sd_alphas_cumprod().float())
    base = _predict(pipe, x, t)
    assert (base - noise).pow(2).mean() < 0.3 * noise.pow(2).mean()
    changes = []
    for ratio in (0.25, 0.5, 0.75):
        tome_core.apply_patch(pipe.unet, method="stack", ratio=ratio, max_downsample=4)
        try:
            out = _predict(pipe, x, t)
        finally:
            tome_core.remove_patch(pipe.unet)
        changes.append(float((out - base).pow(2).mean().sqrt() / base.pow(2).mean().sqrt()))
    print(f"\nStack change at ratio 0.25/0.5/0.75: {changes}")
    assert 0 < changes[0] < changes[1] < changes[2]


# -- the prompted proxies, of either layout --------------------------------------------------------------------

# Each layout's shipped prompted proxies, what the tables call that layout's proxies, and the transformer depth of
# each attention level: SD 1.5's four levels one transformer each, SDXL's two and ten.
PROMPTED = {"sd15": proxy.SHIPPED_PROMPTED_WEIGHTS, "sdxl": proxy.SHIPPED_PROMPTED_SDXL_WEIGHTS}
PROMPTED_LABEL = {"sd15": "proxy", "sdxl": "SDXL-layout proxy"}
PROMPTED_DEPTHS = {"sd15": {0: {1}, 1: {1}, 2: {1}, 3: {1}}, "sdxl": {1: {2}, 2: {10}}}
PROMPTED_SEEDS = {"sd15": list(proxy.SHIPPED_PROMPTED_SEEDS), "sdxl": [0, 1, 2]}


@pytest.fixture(scope="module", params=[(layout, path) for layout, paths in PROMPTED.items() for path in paths
                                        if os.path.isfile(path)],
                ids=lambda param: os.path.basename(param[1]))
def each_prompted(request) -> tuple[str, str, Pipeline]:
    layout, path = request.param
    return layout, path, proxy.load_proxy(path=path)


@pytest.mark.parametrize("layout", sorted(PROMPTED))
def test_every_prompted_proxy_ships_and_its_train_command_gives_its_own_recipe(layout, monkeypatch):
    """The file's training metadata is what the CLI makes of ``train_command``'s arguments: the command trains
    that proxy again (the same seed, stages, widths, curriculum and words), and the three seeds differ."""
    import shlex

    from tome_core.bench.proxy import __main__ as cli

    class Configured(Exception):
        pass

    def capture(config, log=print):
        raise Configured(config)

    monkeypatch.setattr(cli, "train", capture)
    seeds = []
    assert len(PROMPTED[layout]) == 3
    for path in PROMPTED[layout]:
        assert os.path.isfile(path), proxy.train_command(path)
        command = shlex.split(proxy.train_command(path))
        assert command[:3] == ["python", "-m", "tome_core.bench.proxy"]
        with pytest.raises(Configured) as configured:
            cli.main(command[3:])
        config = configured.value.args[0]
        metadata = proxy.read_metadata(path)
        assert {k: metadata.get(k) for k in training.training_metadata(config)} == training.training_metadata(config)
        assert config.layout == layout and config.data == "scenes"
        assert config.stages == proxy.PROMPTED_STAGES[layout]
        assert (config.deep_first, config.first_levels) == proxy.PROMPTED_CURRICULUM[layout]
        widths = proxy.PROMPTED_WIDTHS[layout] or proxy.LAYOUTS[layout].arch["channel_mult"]
        assert json.loads(metadata["arch"])["channel_mult"] == list(widths)
        assert proxy.is_shipped(path) and proxy.describe(path) == f"seed {config.seed}"
        seeds.append(config.seed)
    assert seeds == PROMPTED_SEEDS[layout]


def test_prompted_proxies_load_with_their_layouts_levels_and_the_benchmarks_prompts(each_prompted):
    layout, path, pipe = each_prompted
    assert os.path.getsize(path) <= 18e6 and pipe.size == proxy.LAYOUTS[layout].eval_size
    assert pipe.label == PROMPTED_LABEL[layout] and pipe.prompts == proxy.BENCHMARK_PROMPTS
    depths = {}
    for _, t, level in tome_core.patch.transformer_levels(pipe.unet):
        depths.setdefault(level, set()).add(len(t.transformer_blocks))
        assert t.proj_out.weight.abs().max() > 0.01  # trained away from the zero it starts at
    assert depths == PROMPTED_DEPTHS[layout]
    # The empty prompt is guidance's unconditional half, and each word moves the context.
    assert torch.equal(pipe.context, pipe.encode_prompt(""))
    assert not torch.equal(pipe.encode_prompt(proxy.BENCHMARK_PROMPTS[0]), pipe.encode_prompt(""))


def test_prompted_proxies_predict_the_noise_better_when_told_the_scene(each_prompted):
    """On scenes drawn from a seed training never used, the noise prediction is far better than none, and
    better with the scene's own prompt than with the empty one, most of all where the noise hides the layout."""
    from tome_core.bench.proxy import scenes

    _, _, pipe = each_prompted
    gen = torch.Generator().manual_seed(20261206)
    pyramids = [training.pyramid(image) for image in training.load_photographs(training.TRAIN_IMAGES)]
    x0, said = scenes.scene_batch(pyramids, training.TRAIN_IMAGES, 4, pipe.size, gen, training.random_crops)
    told = torch.cat([pipe.encode_prompt(scene.text) for scene in said])
    noise = torch.randn(x0.shape, generator=gen)
    errors = {}
    for t_value in (T_MODERATE, 800):
        t = torch.full((4,), t_value)
        x = training.noised(x0, t, noise, sd_alphas_cumprod().float())
        with torch.no_grad():
            errors[t_value] = [float((pipe.unet(x, t, context=context) - noise).pow(2).mean())
                               for context in (told, pipe.context.expand(4, -1, -1))]
    print(f"\nnoise MSE with the prompt / the empty prompt: {errors}")
    assert errors[T_MODERATE][0] < 0.3 * float(noise.pow(2).mean())
    assert all(with_prompt < without for with_prompt, without in errors.values())


def test_every_attention_level_of_a_prompted_proxy_matters_and_so_does_the_prompt(each_prompted):
    """The yardstick's bar, as ``python -m tome_core.bench.levels`` measures it (Euler, 20 steps, 3 images,
    guidance 7 batched): each attention level skipped alone moves the final pictures to 20 dB or less from the
    whole model's, and so does asking for other prompts from the same noise."""
    from tome_core.bench import levels
    from tome_core.bench.fidelity import noise_for
    from tome_core.bench.metrics import psnr_each
    from tome_core.bench.samplers import final_pictures
    from tome_core.bench.sampling import guidance_for

    layout, _, pipe = each_prompted
    noise = noise_for(pipe, pipe.size, 3, 0)
    run = dict(steps=20, sampler="euler", noise_seed=7, options=None)
    guidance = guidance_for(pipe, 3, 7.0)
    whole = final_pictures(pipe, noise, guidance=guidance, **run)
    moved = {}
    for level in levels.attention_levels(pipe.unet):
        with levels.skipped(pipe.unet, {level}):
            moved[level] = statistics.median(psnr_each(final_pictures(pipe, noise, guidance=guidance, **run), whole))
    moved["another prompt"] = statistics.median(psnr_each(final_pictures(
        pipe, noise, guidance=guidance_for(pipe, 3, 7.0, shift=1), **run), whole))
    print(f"\nfinal PSNR dB, each level skipped / another prompt: {moved}")
    assert sorted(k for k in moved if k != "another prompt") == sorted(PROMPTED_DEPTHS[layout])
    assert all(db <= levels.MATTERS_DB for db in moved.values()), moved
