"""The benchmark on a diffusers model folder (``--checkpoint FOLDER`` with a ``model_index.json``): a tiny real
StableDiffusionPipeline saved by diffusers, loaded by diffusers, raced by ours and tomesd."""

from __future__ import annotations

import json
import math

import pytest
import torch

import tome_core
from diffusers_unets import diffusers_unet
from tome_core.bench import cli, diffusers_folder, jobs
from tome_core.bench.sampling import euler_sample
from tome_core.bench.tensorfile import CheckpointError
from unets import CONTEXT_DIM

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(autouse=True)
def _webui_unet(webui_unet_for_this_test_only):
    """Every test here runs with ldm as the benchmark patches it, and leaves it as it was."""


def _tokenizer(folder):
    from transformers import CLIPTokenizer

    vocab, merges = folder / "vocab.json", folder / "merges.txt"
    vocab.write_text(json.dumps({"<|startoftext|>": 0, "<|endoftext|>": 1, "a</w>": 2, "photo</w>": 3}))
    merges.write_text("#version: 0.2\n")
    return CLIPTokenizer(str(vocab), str(merges), model_max_length=8, pad_token="<|endoftext|>")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny SD 1.x-layout text-to-image folder, as ``save_pretrained`` writes it."""
    from diffusers import AutoencoderKL, EulerDiscreteScheduler, StableDiffusionPipeline
    from transformers import CLIPTextConfig, CLIPTextModel

    root = tmp_path_factory.mktemp("tiny-sd")
    torch.manual_seed(0)
    text = CLIPTextModel(CLIPTextConfig(vocab_size=4, hidden_size=CONTEXT_DIM, intermediate_size=32,
                                        num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=8,
                                        bos_token_id=0, eos_token_id=1, pad_token_id=1)).eval()
    vae = AutoencoderKL(block_out_channels=(8, 8), down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, norm_num_groups=4).eval()
    pipe = StableDiffusionPipeline(vae=vae, text_encoder=text, tokenizer=_tokenizer(root), unet=diffusers_unet("sd1"),
                                   scheduler=EulerDiscreteScheduler(), safety_checker=None, feature_extractor=None,
                                   requires_safety_checker=False)
    path = root / "model"
    pipe.save_pretrained(str(path))
    return path


def test_folder_loads_as_a_pipeline_the_engine_patches(folder):
    pipe = diffusers_folder.load_pipeline(str(folder), torch.device("cpu"), torch.float32)
    unet = pipe.unet.diffusion_model
    assert type(unet).__name__ == "UNet2DConditionModel" and pipe.downscale == 2
    assert pipe.context.shape == (1, 8, CONTEXT_DIM) and pipe.context.abs().max() > 0  # its own text encoder
    assert tome_core.resolve_unet(pipe.unet) is unet  # through the adapter, as every contender finds it
    # The adapter calls the U-Net as diffusers does.
    x, t = torch.randn(2, 4, 16, 16), torch.tensor([500, 500])
    with torch.no_grad():
        direct = unet(x, t, encoder_hidden_states=pipe.context.expand(2, -1, -1)).sample
        torch.testing.assert_close(pipe.unet(x, t, context=pipe.context.expand(2, -1, -1)), direct, atol=0, rtol=0)
    base = euler_sample(pipe, torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(0)), 2)
    tome_core.apply_patch(pipe.unet, ratio=0.5)
    assert tome_core.get_patch(unet) is not None and len(tome_core.patched_blocks(unet)) == 3
    tome_core.remove_patch(pipe.unet)
    again = euler_sample(pipe, torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(0)), 2)
    assert torch.equal(again, base)


def test_the_benchmark_races_ours_and_tomesd_on_the_folder(folder, capsys, monkeypatch):
    # Timing is not under test: every call "takes" a fixed time.
    monkeypatch.setattr(jobs, "model_timer", lambda *a: (lambda name: {"none": 10.0}.get(name, 8.0)))
    assert cli.main(["--checkpoint", str(folder), "--sizes", "32", "--ratios", "0.5", "--todo-factors", "2",
                     "--steps", "2", "--repeats", "1", "--quiet", "--no-rand", "--device", "cpu", "--tomesd"]) == 0
    out = capsys.readouterr().out
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| model") and len(cells) > 7:
            rows[(cells[2], cells[3])] = cells
    assert {("ToMe", "0.50"), ("tomesd", "0.50"), ("ToDo", "f=2"), ("Local", "0.50")} <= set(rows)
    psnr = {k: v[7] for k, v in rows.items()}
    assert math.isfinite(float(psnr[("ToMe", "0.50")]))
    # Without randomness ours and tomesd merge alike on a diffusers U-Net: the same pictures.
    assert psnr[("ToMe", "0.50")] == psnr[("tomesd", "0.50")]
    assert "model (diffusers)" in out


def test_folders_that_cannot_be_benchmarked_are_refused_in_one_line(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli.main(["--checkpoint", str(empty)]) == 2
    err = capsys.readouterr().err
    assert "a folder without model_index.json" in err and len(err.strip().splitlines()) == 1
    pixart = tmp_path / "pixart"
    pixart.mkdir()
    (pixart / "model_index.json").write_text(json.dumps({"_class_name": "PixArtAlphaPipeline"}))
    with pytest.raises(CheckpointError, match="a PixArtAlphaPipeline; this benchmark samples"):
        diffusers_folder.load_pipeline(str(pixart), torch.device("cpu"), torch.float32)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionPipeline",
                                                         "unet": ["diffusers", "UNet2DConditionModel"]}))
    with pytest.raises(CheckpointError, match="diffusers could not load it"):
        diffusers_folder.load_pipeline(str(broken), torch.device("cpu"), torch.float32)


def test_the_diffusers_architecture_has_sd15s_layout_and_is_patched_alike():
    from tome_core.bench import archs

    archs.use_webui_unet()  # undone after the test by the fixture
    ldm, ldm_context = archs.build_unet("sd15", torch.device("cpu"), torch.float32, width=0.1)
    ours, context = archs.build_unet("sd15-diffusers", torch.device("cpu"), torch.float32, width=0.1)
    assert context == ldm_context == 768 and type(tome_core.resolve_unet(ours)).__name__ == "UNet2DConditionModel"
    levels = lambda m: [lv for _, _, lv in tome_core.patch.transformer_levels(m)]  # noqa: E731
    assert levels(ours) == levels(ldm) == [0, 0, 1, 1, 2, 2, 3, 2, 2, 2, 1, 1, 1, 0, 0, 0]
    for model in (ldm, ours):
        tome_core.apply_patch(model, ratio=0.5)
        assert len(tome_core.patched_blocks(model)) == 5
        tome_core.remove_patch(model)
    x, t, text = torch.randn(1, 4, 16, 16), torch.tensor([500.0]), torch.randn(1, 7, 768)
    with torch.no_grad():
        assert ours(x, t, context=[text]).shape == (1, 4, 16, 16)  # ldm's per-depth list of contexts is taken
