"""Prompts, classifier-free guidance and the levels' measure: what the benchmark samples with as users sample.

Expectations come from outside the code under test: guidance's own formula (scale 1 is the prompt alone, 0 the
empty prompt), the same rows computed in one batch and in two calls, a scene's shape found where its prompt
puts it by its pixels, a skipped transformer's output being exactly its input.
"""

from __future__ import annotations

import pytest
import torch

import tome_core
from tome_core.bench import levels, proxy
from tome_core.bench.pipeline import prompt_contexts
from tome_core.bench.proxy import scenes, training
from tome_core.bench.samplers import final_pictures
from tome_core.bench.sampling import Guidance, denoise, guidance_for

from unets import randomize_zero_layers

pytestmark = [pytest.mark.filterwarnings("ignore"),
              pytest.mark.usefixtures("one_thread_and_webui_ldm_for_this_module")]
BACKGROUNDS = ("grass", "brick", "moon")


@pytest.fixture(scope="module")
def prompted(tmp_path_factory):
    """A prompted SDXL-layout proxy as ``train --data scenes`` writes one, its zero-initialised layers and its
    prompt encoder given random values (trained for a few steps only, its transformers would still add nothing
    and every prompt would look alike), loaded back as the benchmark loads it."""
    config = training.TrainConfig(seed=3, layout="sdxl", stages=((32, 1, 1),), warmup=1, data="scenes")
    images = [torch.linspace(-1, 1, 3 * 48 * 64).view(3, 48, 64), torch.zeros(3, 40, 40)]
    state = training.train(config, images, log=lambda line: None)
    unet = randomize_zero_layers(proxy.build_proxy_unet(0, "sdxl"))
    gen = torch.Generator().manual_seed(9)
    state.update({k: v for k, v in unet.state_dict().items()})
    state["prompt.words"] = torch.randn(state["prompt.words"].shape, generator=gen)
    path = str(tmp_path_factory.mktemp("prompted") / "prompted.safetensors")
    training.save_weights(state, path, training.training_metadata(config), "sdxl")
    return proxy.load_proxy(path=path)


def test_a_prompt_reads_back_as_the_scene_it_says_and_a_wrong_one_is_refused_in_one_line():
    gen = torch.Generator().manual_seed(0)
    drawn = [scenes.random_scene(BACKGROUNDS, gen) for _ in range(40)]
    assert {len(s.shapes) for s in drawn} == {1, 2}
    for scene in drawn:
        assert scenes.parse(scene.text, BACKGROUNDS) == scene
        assert len(scene.words) == scenes.PROMPT_WORDS
    assert scenes.parse("", BACKGROUNDS) == scenes.EMPTY and scenes.EMPTY.words == ("",) * scenes.PROMPT_WORDS
    assert scenes.parse("an orange ring at the top", BACKGROUNDS).shapes == (("orange", "ring", "top"),)
    for bad, said in (("a pink disc on the left", "colour of red"), ("a red disc, on lava", "unknown background"),
                      ("a red disc on the left and a red disc on the right and a red disc at the top", "at most two")):
        with pytest.raises(ValueError, match=said) as error:
            scenes.parse(bad, BACKGROUNDS)
        assert "\n" not in str(error.value)


@pytest.mark.parametrize("place, side", [("left", "x<"), ("right", "x>"), ("top", "y<"), ("bottom", "y>")])
def test_a_scene_draws_its_shape_where_and_in_the_colour_its_prompt_says(place, side):
    size = 64
    scene = scenes.Scene("grass", (("blue", "square", place),))
    image = scenes.render(scene, torch.zeros(3, size, size), size, torch.Generator().manual_seed(1))
    drawn = image.abs().sum(0) > 0.3  # the background is flat 0: the shape is what is not
    ys, xs = drawn.nonzero(as_tuple=True)
    centre = {"x": xs.float().mean() / size, "y": ys.float().mean() / size}[side[0]]
    assert (centre < 0.42) if side[1] == "<" else (centre > 0.58)
    assert 0.06 < drawn.float().mean() < 0.3  # a large shape, not the whole picture
    colour = image[:, drawn].mean(1)
    assert colour[2] > 0.5 and colour[0] < -0.3  # blue: much blue, little red


def test_the_prompted_proxy_loads_with_its_encoder_and_the_benchmarks_prompts(prompted):
    assert "prompted scenes" in prompted.name
    assert prompted.prompts == proxy.BENCHMARK_PROMPTS
    empty, red = prompted.encode_prompt(""), prompted.encode_prompt(proxy.BENCHMARK_PROMPTS[0])
    assert empty.shape == red.shape == (1, scenes.PROMPT_WORDS, proxy.CONTEXT_DIM)
    assert torch.equal(prompted.context, empty) and not torch.equal(empty, red)
    cond = prompt_contexts(prompted, 8)
    assert cond.shape[0] == 8 and torch.equal(cond[6], cond[0]) and not torch.equal(cond[1], cond[0])
    with pytest.raises(ValueError, match="cannot read"):
        prompted.encode_prompt("a dog")


def test_guidance_follows_its_formula_and_batched_equals_apart(prompted):
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * 3
    cond = prompt_contexts(prompted, 2)
    plain = denoise(prompted, x, 3.0, 600)
    alone = denoise(prompted, x, 3.0, 600, Guidance(cond, 1.0))
    assert (alone - plain).abs().max() > 1e-2  # the prompt changes the prediction: the checks below can fail
    assert torch.allclose(denoise(prompted, x, 3.0, 600, Guidance(cond, 0.0)), plain, atol=1e-6)
    batched = denoise(prompted, x, 3.0, 600, Guidance(cond, 7.0))
    apart = denoise(prompted, x, 3.0, 600, Guidance(cond, 7.0, batched=False))
    assert torch.allclose(batched, plain + 7.0 * (alone - plain), atol=1e-4)
    assert torch.allclose(batched, apart, atol=1e-5)
    assert guidance_for(prompted, 2, None) is None
    assert guidance_for(prompted, 2, 5.0, batched=False).label == "CFG 5, cond and uncond apart"


def test_a_pipeline_without_prompts_samples_without_guidance(prompted):
    from dataclasses import replace

    assert guidance_for(replace(prompted, encode_prompt=None, prompts=()), 2) is None


@pytest.mark.parametrize("options", [dict(method="cache"), dict(method="todo", max_downsample=4)],
                         ids=["cache", "todo"])
def test_a_method_gives_the_same_pictures_with_cond_and_uncond_batched_or_apart(prompted, options):
    noise = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(4))
    run = dict(steps=6, sampler="euler", noise_seed=7, options=options)
    whole = final_pictures(prompted, noise, **dict(run, options=None), guidance=guidance_for(prompted, 2))
    batched = final_pictures(prompted, noise, **run, guidance=guidance_for(prompted, 2))
    apart = final_pictures(prompted, noise, **run, guidance=guidance_for(prompted, 2, batched=False))
    assert (batched - whole).abs().max() > 1e-3  # the method acts, so agreeing below says something
    assert torch.allclose(batched, apart, atol=1e-4)


def test_skipping_a_level_makes_its_transformers_return_their_input_and_is_undone(prompted):
    unet = prompted.unet
    stacks = tome_core.patch.transformer_levels(unet)
    assert levels.attention_levels(unet) == [1, 2]
    assert [levels.level_name(prompted, lv, 128) for lv in (1, 2)] == ["4,096 tokens", "1,024 tokens"]
    x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(5))
    t, context = torch.tensor([500]), prompted.encode_prompt(proxy.BENCHMARK_PROMPTS[1])
    before = unet(x, t, context=context)
    seen = []
    with levels.skipped(unet, {2}) as count:
        # Registered after the skip's: they see what the stack hands on.
        hooks = [m.register_forward_hook(lambda m, a, out, level=level: seen.append((level, torch.equal(a[0], out))))
                 for _, m, level in stacks]
        try:
            skipped_out = unet(x, t, context=context)
        finally:
            for hook in hooks:
                hook.remove()
    assert count == sum(level == 2 for _, _, level in stacks) > 0
    assert sorted(set(seen)) == [(1, False), (2, True)]
    assert not torch.equal(skipped_out, before)
    assert torch.equal(unet(x, t, context=context), before)


def test_the_levels_command_prints_each_levels_figure_and_the_prompts(prompted, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("tome_core.bench.samplers.load_proxies",
                        lambda *args, **kwargs: [("tiny", prompted)])
    monkeypatch.setattr(prompted, "size", 32)
    assert levels.main(["--samplers", "euler", "--steps", "2", "--images", "1", "--cfg", "5"]) == 0
    out = capsys.readouterr().out
    assert "CFG 5, cond and uncond batched" in out
    row = next(line for line in out.splitlines() if line.startswith("| Euler |"))
    assert len(row.split("|")) == 6  # two levels and another prompt
    assert "| 256 tokens skipped | 64 tokens skipped | another prompt |" in out


def test_a_prompted_proxys_samples_sheet_has_a_row_per_prompt_from_the_same_noises(prompted, monkeypatch):
    from tome_core.bench.proxy.__main__ import prompted_grid

    monkeypatch.setattr(prompted, "size", 16)
    sheet = prompted_grid(prompted, cols=2, steps=2, zoom=2)
    rows = len(proxy.BENCHMARK_PROMPTS)
    assert sheet.size == (170 + 2 * (32 + 2) + 2, rows * (32 + 2) + 2)
    tiles = [[sheet.crop((170 + 2 + c * 34, 2 + r * 34, 170 + 2 + c * 34 + 32, 2 + r * 34 + 32)).tobytes()
              for c in range(2)] for r in range(rows)]
    assert tiles[0][0] != tiles[1][0]  # the same noise, another prompt: another picture
    assert tiles[0][0] != tiles[0][1]  # the same prompt, another noise


def test_training_on_scenes_repeats_bitwise_and_learns_a_word_table_not_one_context():
    config = training.TrainConfig(seed=4, layout="sdxl", stages=((32, 2, 2),), warmup=1, data="scenes")
    images = [torch.linspace(-1, 1, 3 * 48 * 64).view(3, 48, 64), torch.zeros(3, 40, 40)]
    first = training.train(config, images, log=lambda line: None)
    second = training.train(config, images, log=lambda line: None)
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert "context" not in first and first["prompt.words"].shape == (len(scenes.vocabulary(training.TRAIN_IMAGES)),
                                                                      proxy.CONTEXT_DIM)
    metadata = training.training_metadata(config)
    assert metadata["data"] == "scenes" and json_list(metadata["vocabulary"])[0] == ""


def json_list(text: str) -> list:
    import json

    return json.loads(text)


def test_the_sdxl_figure_sets_each_sdxl_setting_beside_its_levels_deleted_and_counts_the_whole_run(prompted,
                                                                                                   monkeypatch):
    """Cache's whole-run multiply-adds against an expectation built from outside its patch: the unmerged call's
    count less the deep level's transformers (their own share of the unmerged call's count) on each step its
    schedule reuses."""
    from tome_core.bench import sdxl_figure
    from tome_core.bench.fidelity import noise_for
    from tome_core.bench.macs import MultiplyAddCounter
    from tome_core.bench.metrics import psnr_each
    from tome_core.bench.runtime import call_counts

    monkeypatch.setattr(prompted, "size", 32)
    steps = 8
    lines = sdxl_figure.sdxl_table("tiny", prompted, steps=steps, images=2, cfg=5)
    assert lines[0].startswith(f"{prompted.label} tiny, 32 px: SDXL's settings over a whole run of {steps} Euler "
                               f"steps, CFG 5, cond and uncond batched")
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")[1:]]
            for line in lines if line.startswith("| ") and "setting" not in line}
    assert list(rows) == ["Cache (defaults)", "ToDo f=2 levels 4"]
    assert rows["Cache (defaults)"][1].endswith("(64 tokens)")  # the deep level at 32 px
    assert rows["ToDo f=2 levels 4"][1].endswith("(256 tokens, 64 tokens)")

    # The ToDo row's closeness, from a run made here.
    guidance = guidance_for(prompted, 2, 5)
    noise = noise_for(prompted, 32, 2, 0)
    run = dict(steps=steps, sampler="euler", noise_seed=7, guidance=guidance)
    whole = final_pictures(prompted, noise, options=None, **run)
    todo = final_pictures(prompted, noise, options=dict(method="todo", max_downsample=4), **run)
    each = sorted(psnr_each(todo, whole))
    assert rows["ToDo f=2 levels 4"][0] == f"{each[1]:.1f} [{each[0]:.1f}–{each[1]:.1f}]"

    x = torch.randn(4, 3, 32, 32)
    t = torch.full((4,), 500.0)
    context = torch.cat([guidance.cond, prompted.context.expand(2, -1, -1)])

    counter = MultiplyAddCounter()
    with counter, torch.no_grad():
        prompted.unet(x, t, context=context)
    none, per_module = counter.total, counter.get_flop_counts()
    deep_level = max(levels.attention_levels(prompted.unet))
    deep = sum(sum(per_module[f"UNetModel.{name}"].values()) // 2
               for name, _, level in tome_core.patch.transformer_levels(prompted.unet) if level == deep_level)
    assert 0 < deep < none
    full, reused = call_counts(steps, {"method": "cache"})
    assert reused > 0 and full + reused == steps
    expected = 1 - reused * deep / (steps * none)
    assert abs(float(rows["Cache (defaults)"][2]) - expected) <= 0.02, (rows, expected)
    assert float(rows["ToDo f=2 levels 4"][2]) < 1.0


def test_the_main_job_ends_with_the_sdxl_figure_or_says_why_it_has_none(monkeypatch, capsys, tmp_path):
    from tome_core.bench import cli, jobs, sdxl_figure
    from tome_core.bench.arguments import parse_args

    # The main job asks for it; a run of other proxies, of a checkpoint, of both layouts or without pictures does not.
    assert cli.wants_sdxl_figure(parse_args([]))
    for argv in (["--no-sdxl-figure"], ["--proxy", "x"], ["--checkpoint", "x"], ["--layouts", "sd15", "sdxl"],
                 ["--no-fidelity"]):
        assert not cli.wants_sdxl_figure(parse_args(argv)), argv

    sd15 = proxy.SHIPPED_WEIGHTS[0]
    gone, gone_too = str(tmp_path / "gone.safetensors"), str(tmp_path / "gone-too.safetensors")
    monkeypatch.setattr(proxy, "SHIPPED_SDXL_WEIGHTS", (gone,))
    monkeypatch.setattr(proxy, "SHIPPED_PROMPTED_SDXL_WEIGHTS", (gone_too,))
    assert sdxl_figure.sdxl_figure(steps=1, images=1) == [
        "# note: no SDXL-layout figure: no SDXL-layout proxy here (python -m tome_core.bench.proxy train --layout "
        f"sdxl --data scenes --seed 0 --out {gone_too} makes one)"]
    monkeypatch.setattr(proxy, "SHIPPED_SDXL_WEIGHTS", (sd15,))
    assert sdxl_figure.sdxl_figure(steps=1, images=1) == [
        f"# note: no SDXL-layout figure: {sd15} is a proxy of SD 1.5's layout"]
    # A run of the photograph-trained proxies ends on a photograph-trained SDXL-layout one, never a prompted one.
    monkeypatch.setattr(proxy, "SHIPPED_SDXL_WEIGHTS", (gone,))
    monkeypatch.setattr(proxy, "SHIPPED_PROMPTED_SDXL_WEIGHTS", (sd15,))
    assert sdxl_figure.sdxl_figure(steps=1, images=1) == [
        f"# note: no SDXL-layout figure: {sd15} is a proxy of SD 1.5's layout"]
    assert sdxl_figure.sdxl_figure(steps=1, images=1, prompted=False) == [
        "# note: no SDXL-layout figure: no SDXL-layout proxy here (python -m tome_core.bench.proxy train --layout "
        f"sdxl --seed 0 --out {gone} makes one)"]
    monkeypatch.setattr(proxy, "SHIPPED_PROMPTED_SDXL_WEIGHTS", (gone_too,))
    monkeypatch.setattr(proxy, "SHIPPED_SDXL_WEIGHTS", (sd15,))

    # In the main job itself: the SD part's tables, then the figure's line.
    monkeypatch.setattr(jobs, "model_timer", lambda *a: (lambda name: {"none": 10.0}.get(name, 8.0)))
    monkeypatch.setattr(proxy, "SHIPPED_PROMPTED_WEIGHTS", (sd15,))
    assert cli.main(["--steps", "1", "--repeats", "1", "--quiet", "--sheet", "", "--device", "cpu", "--images", "1",
                     "--ratios", "0.5", "--todo-factors", "2", "--no-tomesd", "--no-ideal", "--methods", "ToDo",
                     "--skip", "block", "overhead", "memory"]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith(f"# note: no SDXL-layout figure: {sd15} is a proxy of SD 1.5's layout")
    assert out.index("| ToDo |") < out.index("no SDXL-layout figure")

    # An --unprompted main job ends on the photograph-trained kind too: here none is left, and it says which to train.
    monkeypatch.setattr(proxy, "SHIPPED_WEIGHTS", proxy.SHIPPED_WEIGHTS[:1])
    monkeypatch.setattr(proxy, "SHIPPED_PROMPTED_SDXL_WEIGHTS", (sd15,))
    monkeypatch.setattr(proxy, "SHIPPED_SDXL_WEIGHTS", (gone,))
    assert cli.main(["--unprompted", "--steps", "1", "--repeats", "1", "--quiet", "--sheet", "", "--device", "cpu",
                     "--images", "1", "--ratios", "0.5", "--todo-factors", "2", "--no-ideal", "--methods", "ToDo",
                     "--skip", "block", "overhead", "memory"]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith("no SDXL-layout proxy here (python -m tome_core.bench.proxy train --layout sdxl "
                                 f"--seed 0 --out {gone} makes one)")
