"""A user's checkpoint as a sampling pipeline: small files laid out exactly like real SD 1.x / 2.x / SDXL
checkpoints (the same keys, tiny widths) load into a Pipeline whose parts compute what the architecture says.

The expectations are computed here from the raw tensors, written from the architecture's definition (a causal
pre-norm transformer, one head at a time, GELU from erf), not by the code under test.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tome_core.bench import archs, textenc
from tome_core.bench.checkpoint import at_size, load_pipeline, predicts_velocity
from tome_core.bench.pipeline import sd_alphas_cumprod
from tome_core.bench.sampling import euler_sample
from tome_core.bench.tensorfile import CheckpointError
from unets import randomize_zero_layers

pytestmark = pytest.mark.filterwarnings("ignore")
CPU = torch.device("cpu")
WIDTH = 128  # text encoder width: 2 heads of 64, as every SD text encoder's heads are
LAYERS = 3
VOCAB = 49408
VAE = dict(ch=32, ch_mult=[1, 1, 1, 1], num_res_blocks=1, attn_resolutions=[], z_channels=4, out_ch=3,
           in_channels=3, resolution=64, double_z=True, dropout=0.0)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These models are tiny: one thread computes them fastest, and far faster than several threads on a
    machine whose cores other processes share."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def webui_unet_for_this_test_only(monkeypatch):
    from ldm.modules.attention import CrossAttention
    from ldm.modules.diffusionmodules import openaimodel

    monkeypatch.setattr(CrossAttention, "forward", CrossAttention.forward)
    monkeypatch.setattr(openaimodel, "th", openaimodel.th)
    archs.use_webui_unet()


# ----------------------------------------------------------------------------------------- tiny real layouts

def _randn(gen, *shape, std=0.05):
    return torch.randn(*shape, generator=gen) * std


def _norm(gen, width):
    return 1 + _randn(gen, width, std=0.1), _randn(gen, width, std=0.1)


def hf_clip_tensors(prefix: str, seed: int) -> dict[str, torch.Tensor]:
    """Hugging Face CLIPTextModel keys (as in SD 1.x files and SDXL's first embedder), tiny width."""
    gen = torch.Generator().manual_seed(seed)
    t = {prefix + "embeddings.token_embedding.weight": _randn(gen, VOCAB, WIDTH, std=0.5),
         prefix + "embeddings.position_embedding.weight": _randn(gen, 77, WIDTH, std=0.5),
         prefix + "embeddings.position_ids": torch.arange(77)[None]}
    for i in range(LAYERS):
        p = f"{prefix}encoder.layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
            t[f"{p}self_attn.{name}.weight"] = _randn(gen, WIDTH, WIDTH, std=0.2)
            t[f"{p}self_attn.{name}.bias"] = _randn(gen, WIDTH)
        t[p + "layer_norm1.weight"], t[p + "layer_norm1.bias"] = _norm(gen, WIDTH)
        t[p + "layer_norm2.weight"], t[p + "layer_norm2.bias"] = _norm(gen, WIDTH)
        t[p + "mlp.fc1.weight"], t[p + "mlp.fc1.bias"] = _randn(gen, 4 * WIDTH, WIDTH, std=0.2), _randn(gen, 4 * WIDTH)
        t[p + "mlp.fc2.weight"], t[p + "mlp.fc2.bias"] = _randn(gen, WIDTH, 4 * WIDTH, std=0.1), _randn(gen, WIDTH)
    t[prefix + "final_layer_norm.weight"], t[prefix + "final_layer_norm.bias"] = _norm(gen, WIDTH)
    return t


def open_clip_tensors(prefix: str, seed: int, projection: bool = False) -> dict[str, torch.Tensor]:
    """OpenCLIP text tower keys (as in SD 2.x files and SDXL's second embedder), tiny width."""
    gen = torch.Generator().manual_seed(seed)
    t = {prefix + "token_embedding.weight": _randn(gen, VOCAB, WIDTH, std=0.5),
         prefix + "positional_embedding": _randn(gen, 77, WIDTH, std=0.5),
         prefix + "logit_scale": torch.tensor(4.6)}
    for i in range(LAYERS):
        p = f"{prefix}transformer.resblocks.{i}."
        t[p + "attn.in_proj_weight"], t[p + "attn.in_proj_bias"] = _randn(gen, 3 * WIDTH, WIDTH, std=0.2), \
            _randn(gen, 3 * WIDTH)
        t[p + "attn.out_proj.weight"], t[p + "attn.out_proj.bias"] = _randn(gen, WIDTH, WIDTH, std=0.2), \
            _randn(gen, WIDTH)
        t[p + "ln_1.weight"], t[p + "ln_1.bias"] = _norm(gen, WIDTH)
        t[p + "ln_2.weight"], t[p + "ln_2.bias"] = _norm(gen, WIDTH)
        t[p + "mlp.c_fc.weight"], t[p + "mlp.c_fc.bias"] = _randn(gen, 4 * WIDTH, WIDTH, std=0.2), \
            _randn(gen, 4 * WIDTH)
        t[p + "mlp.c_proj.weight"], t[p + "mlp.c_proj.bias"] = _randn(gen, WIDTH, 4 * WIDTH, std=0.1), \
            _randn(gen, WIDTH)
    t[prefix + "ln_final.weight"], t[prefix + "ln_final.bias"] = _norm(gen, WIDTH)
    if projection:
        t[prefix + "text_projection"] = _randn(gen, WIDTH, WIDTH, std=0.1)
    return t


def vae_tensors(seed: int = 5) -> dict[str, torch.Tensor]:
    """``first_stage_model.*`` as an ldm AutoencoderKL holds it: encoder, quant convs, decoder."""
    from ldm.modules.diffusionmodules.model import Decoder, Encoder

    torch.manual_seed(seed)
    parts = {"encoder": Encoder(**VAE), "decoder": Decoder(**VAE), "quant_conv": nn.Conv2d(8, 8, 1),
             "post_quant_conv": nn.Conv2d(4, 4, 1)}
    with torch.no_grad():  # conv_out at random values (not a flat image), norms off their identity
        for name, p in parts["decoder"].named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return {f"first_stage_model.{part}.{k}": v.contiguous() for part, m in parts.items()
            for k, v in m.state_dict().items()}


def unet_tensors(layout: str, context_dim: int, adm: int | None = None) -> dict[str, torch.Tensor]:
    from ldm.modules.diffusionmodules.openaimodel import UNetModel

    torch.manual_seed(0)
    kw = dict(sd1=dict(attention_resolutions=[4, 2, 1], channel_mult=[1, 2, 4, 4], num_heads=8,
                       use_linear_in_transformer=False),
              sd2=dict(attention_resolutions=[4, 2, 1], channel_mult=[1, 2, 4, 4], num_head_channels=32,
                       use_linear_in_transformer=True),
              sdxl=dict(attention_resolutions=[4, 2], channel_mult=[1, 2, 4], num_head_channels=32,
                        use_linear_in_transformer=True))[layout]
    unet = UNetModel(image_size=32, in_channels=4, out_channels=4, model_channels=32, num_res_blocks=1,
                     use_spatial_transformer=True, transformer_depth=1, context_dim=context_dim, legacy=False, **kw)
    unet = randomize_zero_layers(unet)
    with torch.no_grad():  # ldm also zero-initialises each ResBlock's last conv, which would hide the embedding
        for p in unet.parameters():
            if not p.any():
                p.normal_(0, 0.05)
    t = {"model.diffusion_model." + k: v.contiguous() for k, v in unet.state_dict().items()}
    if adm is not None:  # SDXL's label_emb: Linear, SiLU, Linear inside a Sequential inside a Sequential
        t["model.diffusion_model.label_emb.0.0.weight"] = torch.randn(128, adm) * 0.05
        t["model.diffusion_model.label_emb.0.0.bias"] = torch.randn(128) * 0.05
        t["model.diffusion_model.label_emb.0.2.weight"] = torch.randn(128, 128) * 0.05
        t["model.diffusion_model.label_emb.0.2.bias"] = torch.randn(128) * 0.05
    return t


def schedule_tensors() -> dict[str, torch.Tensor]:
    betas = torch.linspace(0.00085 ** 0.5, 0.012 ** 0.5, 1000, dtype=torch.float64) ** 2
    return {"betas": betas.float(), "alphas_cumprod": torch.cumprod(1 - betas, 0).float()}


def checkpoint_tensors(layout: str, unet: bool = True, text: bool = True, first_stage: bool = True,
                       schedule: bool = True) -> dict[str, torch.Tensor]:
    t = {}
    if unet:
        context = 2 * WIDTH if layout == "sdxl" else WIDTH
        t.update(unet_tensors(layout, context, adm=WIDTH + 6 * 256 if layout == "sdxl" else None))
    if text:
        if layout == "sd1":
            t.update(hf_clip_tensors("cond_stage_model.transformer.text_model.", 1))
        elif layout == "sd2":
            t.update(open_clip_tensors("cond_stage_model.model.", 2))
        else:
            t.update(hf_clip_tensors("conditioner.embedders.0.transformer.text_model.", 3))
            t.update(open_clip_tensors("conditioner.embedders.1.model.", 4, projection=True))
    if first_stage:
        t.update(vae_tensors())
    if schedule:
        t.update(schedule_tensors())
    return t


def save(tensors: dict[str, torch.Tensor], path) -> str:
    if str(path).endswith(".safetensors"):
        from safetensors.torch import save_file

        save_file(tensors, str(path))
    else:
        torch.save({"state_dict": tensors, "global_step": 1}, str(path))
    return str(path)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("checkpoints")
    made = {}
    for layout in ("sd1", "sd2", "sdxl"):
        tensors = checkpoint_tensors(layout)
        made[layout] = tensors
        for ext in ("safetensors", "ckpt"):
            made[layout, ext] = save(tensors, folder / f"{layout}.{ext}")
    return made


# ----------------------------------------------------------------------------------------- independent reference

def reference_hidden_states(w: dict[str, torch.Tensor], prefix: str, ids: list[int], hf: bool) -> list[torch.Tensor]:
    """The text transformer from its definition, in float64, one head at a time: tokens plus positions, then per
    layer x += attention(LN(x)) with a causal mask, x += MLP(LN(x)). Returns every hidden state (T, width)."""
    g = {k[len(prefix):]: v.double() for k, v in w.items() if k.startswith(prefix)}

    def ln(x, name):
        mean = x.mean(-1, keepdim=True)
        var = ((x - mean) ** 2).mean(-1, keepdim=True)
        return (x - mean) / torch.sqrt(var + 1e-5) * g[name + ".weight"] + g[name + ".bias"]

    if hf:
        x = g["embeddings.token_embedding.weight"][ids] + g["embeddings.position_embedding.weight"][:len(ids)]
    else:
        x = g["token_embedding.weight"][ids] + g["positional_embedding"][:len(ids)]
    n = len(ids)
    future = torch.ones(n, n, dtype=torch.bool).triu(1)
    hidden = [x]
    for i in range(LAYERS):
        if hf:
            p = f"encoder.layers.{i}."
            wq, wk, wv = (g[f"{p}self_attn.{c}_proj.weight"] for c in "qkv")
            bq, bk, bv = (g[f"{p}self_attn.{c}_proj.bias"] for c in "qkv")
            wo, bo = g[p + "self_attn.out_proj.weight"], g[p + "self_attn.out_proj.bias"]
            ln1, ln2 = p + "layer_norm1", p + "layer_norm2"
            w1, b1 = g[p + "mlp.fc1.weight"], g[p + "mlp.fc1.bias"]
            w2, b2 = g[p + "mlp.fc2.weight"], g[p + "mlp.fc2.bias"]
        else:
            p = f"transformer.resblocks.{i}."
            wq, wk, wv = g[p + "attn.in_proj_weight"].chunk(3)
            bq, bk, bv = g[p + "attn.in_proj_bias"].chunk(3)
            wo, bo = g[p + "attn.out_proj.weight"], g[p + "attn.out_proj.bias"]
            ln1, ln2 = p + "ln_1", p + "ln_2"
            w1, b1, w2, b2 = g[p + "mlp.c_fc.weight"], g[p + "mlp.c_fc.bias"], g[p + "mlp.c_proj.weight"], \
                g[p + "mlp.c_proj.bias"]
        h = ln(x, ln1)
        q, k, v = h @ wq.T + bq, h @ wk.T + bk, h @ wv.T + bv
        heads = []
        for head in range(WIDTH // 64):
            cols = slice(64 * head, 64 * (head + 1))
            scores = (q[:, cols] @ k[:, cols].T) / 8.0
            scores = scores.masked_fill(future, float("-inf"))
            heads.append(torch.softmax(scores, dim=-1) @ v[:, cols])
        x = x + torch.cat(heads, dim=-1) @ wo.T + bo
        m = ln(x, ln2) @ w1.T + b1
        # OpenAI's CLIP: x·sigmoid(1.702x); OpenCLIP's ViT-H/bigG: exact GELU.
        m = m / (1 + torch.exp(-1.702 * m)) if hf else 0.5 * m * (1 + torch.erf(m / math.sqrt(2)))
        x = x + m @ w2.T + b2
        hidden.append(x)
    return hidden


def final_norm(w, name, x):
    return F.layer_norm(x.double(), (WIDTH,), w[name + ".weight"].double(), w[name + ".bias"].double(), 1e-5)


CLIP_EMPTY = [49406, 49407] + [49407] * 75
OPEN_CLIP_EMPTY = [49406, 49407] + [0] * 75


def expected_conditioning(layout: str, w: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What the webui computes for an empty prompt, from the architecture: (77, C) context, pooled or None."""
    if layout == "sd1":  # last layer, final LayerNorm
        prefix = "cond_stage_model.transformer.text_model."
        last = reference_hidden_states(w, prefix, CLIP_EMPTY, True)[-1]
        return final_norm(w, prefix + "final_layer_norm", last), None
    if layout == "sd2":  # penultimate layer, then ln_final
        prefix = "cond_stage_model.model."
        penultimate = reference_hidden_states(w, prefix, OPEN_CLIP_EMPTY, False)[-2]
        return final_norm(w, prefix + "ln_final", penultimate), None
    pl, pg = "conditioner.embedders.0.transformer.text_model.", "conditioner.embedders.1.model."
    hl = reference_hidden_states(w, pl, CLIP_EMPTY, True)
    hg = reference_hidden_states(w, pg, OPEN_CLIP_EMPTY, False)
    pooled = final_norm(w, pg + "ln_final", hg[-1][1]) @ w[pg + "text_projection"].double()
    return torch.cat([hl[-2], hg[-2]], dim=-1), pooled


def expected_size_part(numbers: list[int]) -> torch.Tensor:
    """256 channels per number: cos(n·10000^(-k/128)) for k < 128, then the sines."""
    out = []
    for n in numbers:
        freqs = [10000 ** (-k / 128) for k in range(128)]
        out += [math.cos(n * f) for f in freqs] + [math.sin(n * f) for f in freqs]
    return torch.tensor(out, dtype=torch.float64)


# ----------------------------------------------------------------------------------------- tests

def test_empty_prompt_token_ids():
    assert textenc.empty_prompt_tokens(49407).tolist() == [CLIP_EMPTY]
    assert textenc.empty_prompt_tokens(0).tolist() == [OPEN_CLIP_EMPTY]


@pytest.mark.parametrize("hf", [True, False])
def test_text_transformer_follows_the_architecture_in_both_layouts(hf):
    prefix = "text_model." if hf else "model."
    w = hf_clip_tensors(prefix, 7) if hf else open_clip_tensors(prefix, 7)
    model = textenc.from_hf_clip(w, prefix, CPU) if hf else textenc.from_open_clip(w, prefix, CPU)
    ids = [49406, 320, 1125, 539, 49407] + [49407 if hf else 0] * 3
    got = model(torch.tensor([ids]))
    expected = reference_hidden_states(w, prefix, ids, hf)
    assert len(got) == LAYERS + 1
    for a, b in zip(got, expected):
        assert torch.allclose(a[0].double(), b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("ext", ["safetensors", "ckpt"])
@pytest.mark.parametrize("layout", ["sd1", "sd2", "sdxl"])
def test_checkpoint_loads_with_the_empty_prompts_conditioning(files, layout, ext):
    pipe = load_pipeline(files[layout, ext], CPU, torch.float32)
    context, pooled = expected_conditioning(layout, files[layout])
    width = 2 * WIDTH if layout == "sdxl" else WIDTH
    assert pipe.context.shape == (1, 77, width)
    assert torch.allclose(pipe.context[0].double(), context, atol=1e-4, rtol=1e-4)
    if layout == "sdxl":
        assert pipe.y.shape == (1, WIDTH + 6 * 256)
        assert torch.allclose(pipe.y[0, :WIDTH].double(), pooled, atol=1e-4, rtol=1e-4)
        assert torch.allclose(pipe.y[0, WIDTH:].double(), expected_size_part([1024, 1024, 0, 0, 1024, 1024]),
                              atol=1e-4)
    else:
        assert pipe.y is None
    assert pipe.prediction == "eps" and pipe.notes == [] and pipe.decode is not None
    assert torch.equal(pipe.alphas_cumprod, sd_alphas_cumprod())


def test_sd1_files_from_older_transformers_load_alike(files, tmp_path):
    # Before transformers 4.x the CLIP text model had no "text_model." level; the webui renames such keys.
    old = {k.replace("cond_stage_model.transformer.text_model.", "cond_stage_model.transformer."): v
           for k, v in files["sd1"].items()}
    pipe = load_pipeline(save(old, tmp_path / "old.safetensors"), CPU, torch.float32)
    assert torch.equal(pipe.context, load_pipeline(files["sd1", "safetensors"], CPU, torch.float32).context)


def test_vae_decoder_equals_ldms_decode_path(files):
    from ldm.modules.diffusionmodules.model import Decoder

    w = files["sd1"]
    decoder, post_quant = Decoder(**VAE), nn.Conv2d(4, 4, 1)
    decoder.load_state_dict({k[len("first_stage_model.decoder."):]: v for k, v in w.items()
                             if k.startswith("first_stage_model.decoder.")})
    post_quant.load_state_dict({"weight": w["first_stage_model.post_quant_conv.weight"],
                                "bias": w["first_stage_model.post_quant_conv.bias"]})
    z = torch.randn(2, 4, 8, 6, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():  # AutoencoderKL.decode(z / scale), then [-1, 1] -> [0, 1] as the webui saves images
        expected = ((decoder(post_quant(z / 0.18215)) + 1) / 2).clamp(0, 1)
    got = load_pipeline(files["sd1", "safetensors"], CPU, torch.float32).decode(z)
    assert got.shape == (2, 3, 64, 48) and got.dtype == torch.float32
    assert 0 < expected.mean() < 1 and torch.allclose(got, expected, atol=1e-5)


def test_sdxl_vae_uses_sdxls_scale_factor(files):
    # Both files hold the same VAE: latents scaled by each family's factor decode alike.
    z = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(4))
    sd1 = load_pipeline(files["sd1", "safetensors"], CPU, torch.float32).decode(z * 0.18215)
    sdxl = load_pipeline(files["sdxl", "safetensors"], CPU, torch.float32).decode(z * 0.13025)
    assert torch.allclose(sd1, sdxl, atol=1e-5)


@pytest.mark.parametrize("layout", ["sd1", "sdxl"])
def test_euler_sample_runs_and_decodes_to_an_image(files, layout):
    pipe = at_size(load_pipeline(files[layout, "safetensors"], CPU, torch.float32), 64, 48)
    noise = torch.randn(2, 4, 8, 6, generator=torch.Generator().manual_seed(0))
    latents = euler_sample(pipe, noise, steps=3)
    image = pipe.decode(latents)
    assert latents.shape == (2, 4, 8, 6) and torch.isfinite(latents).all()
    assert image.shape == (2, 3, 64, 48) and image.min() >= 0 and image.max() <= 1


def test_at_size_puts_the_sampled_size_into_sdxls_vector(files):
    pipe = load_pipeline(files["sdxl", "safetensors"], CPU, torch.float32)
    sized = at_size(pipe, 512, 768)
    assert torch.equal(sized.y[:, :WIDTH], pipe.y[:, :WIDTH])
    assert torch.allclose(sized.y[0, WIDTH:].double(), expected_size_part([512, 768, 0, 0, 512, 768]), atol=1e-4)
    with torch.no_grad():  # the U-Net reads y: another size moves its prediction
        x, t = torch.randn(1, 4, 8, 8), torch.tensor([500])
        assert not torch.allclose(pipe.unet(x, t, context=pipe.context, y=pipe.y),
                                  sized.unet(x, t, context=pipe.context, y=sized.y))
    for bad in ((512, 516), (0, 512)):
        with pytest.raises(CheckpointError, match="multiple of 8 px"):
            at_size(pipe, *bad)


@pytest.mark.parametrize("layout", ["sd1", "sdxl"])
def test_a_u_net_only_file_compares_latents_and_says_so(tmp_path, layout):
    tensors = checkpoint_tensors(layout, text=False, first_stage=False, schedule=False)
    path = save(tensors, tmp_path / "u.safetensors")
    pipe = load_pipeline(path, CPU, torch.float32)
    assert pipe.decode is None
    assert f"no VAE in {path}: latents are compared" in pipe.notes
    assert any("no text encoder" in note for note in pipe.notes)
    assert torch.equal(pipe.context, torch.zeros(1, 77, 2 * WIDTH if layout == "sdxl" else WIDTH))
    if layout == "sdxl":  # zero pooled text, the sizes as ever
        assert torch.equal(pipe.y[0, :WIDTH], torch.zeros(WIDTH))
        assert torch.allclose(pipe.y[0, WIDTH:].double(), expected_size_part([1024, 1024, 0, 0, 1024, 1024]),
                              atol=1e-4)
    assert euler_sample(pipe, torch.randn(1, 4, 8, 8), steps=2).shape == (1, 4, 8, 8)


def test_a_half_precision_schedule_is_sds_and_another_schedule_is_used(tmp_path):
    tensors = checkpoint_tensors("sd1", text=False, first_stage=False)
    tensors["alphas_cumprod"] = sd_alphas_cumprod().half()
    assert torch.equal(load_pipeline(save(tensors, tmp_path / "h.safetensors"), CPU, torch.float32).alphas_cumprod,
                       sd_alphas_cumprod())
    tensors["alphas_cumprod"] = sd_alphas_cumprod(0.001, 0.02).float()
    pipe = load_pipeline(save(tensors, tmp_path / "o.safetensors"), CPU, torch.float32)
    assert torch.allclose(pipe.alphas_cumprod, sd_alphas_cumprod(0.001, 0.02), rtol=1e-6)
    assert any("its own noise schedule" in note for note in pipe.notes)


def test_velocity_is_told_apart_as_the_webui_does():
    class Constant(nn.Module):  # returns a fixed multiple of its input latent
        def __init__(self, k):
            super().__init__()
            self.k = nn.Parameter(torch.tensor(float(k)))

        def forward(self, x, t, context=None):
            return x * self.k

    assert predicts_velocity(Constant(-3.0), 8)  # mean(out - x) = 0.5·(-4) = -2 < -1
    assert not predicts_velocity(Constant(1.0), 8)


def test_velocity_fine_tunes_that_say_so_are_read_as_velocity(tmp_path):
    from safetensors.torch import save_file

    tensors = checkpoint_tensors("sd1", text=False, first_stage=False, schedule=False)
    path = str(tmp_path / "v.safetensors")
    save_file(tensors, path, metadata={"modelspec.prediction_type": "v"})
    assert load_pipeline(path, CPU, torch.float32).prediction == "v"
    tensors["v_pred"] = torch.tensor([])
    assert load_pipeline(save(tensors, tmp_path / "k.safetensors"), CPU, torch.float32).prediction == "v"


def test_prediction_can_be_forced(files):
    assert load_pipeline(files["sd2", "safetensors"], CPU, torch.float32, prediction="v").prediction == "v"
    assert load_pipeline(files["sd2", "safetensors"], CPU, torch.float32, prediction="eps").prediction == "eps"
    with pytest.raises(CheckpointError, match="prediction"):
        load_pipeline(files["sd2", "safetensors"], CPU, torch.float32, prediction="x0")


def _refused(tmp_path, tensors, match, name="bad.safetensors"):
    path = save(tensors, tmp_path / name)
    with pytest.raises(CheckpointError, match=match) as error:
        load_pipeline(path, CPU, torch.float32)
    assert "\n" not in str(error.value)


def test_bad_inputs_are_refused_with_one_line_naming_the_problem(tmp_path, files):
    with pytest.raises(CheckpointError, match="no such file"):
        load_pipeline(str(tmp_path / "none.safetensors"), CPU, torch.float32)
    (tmp_path / "junk.safetensors").write_text("not a checkpoint")
    with pytest.raises(CheckpointError, match="not a readable"):
        load_pipeline(str(tmp_path / "junk.safetensors"), CPU, torch.float32)
    (tmp_path / "junk.ckpt").write_bytes(b"\x80\x04not a pickle")
    with pytest.raises(CheckpointError, match="not a readable"):
        load_pipeline(str(tmp_path / "junk.ckpt"), CPU, torch.float32)
    lora = {"lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight": torch.zeros(4, 320)}
    _refused(tmp_path, lora, "no U-Net in this checkpoint; it holds a LoRA")
    _refused(tmp_path, {k[len("first_stage_model."):]: v for k, v in vae_tensors().items()}, "a VAE alone")
    _refused(tmp_path, {"encoder.down_blocks.0.resnets.0.conv1.weight": torch.zeros(1),
                        "decoder.up_blocks.0.resnets.0.conv1.weight": torch.zeros(1)}, "a VAE alone")
    _refused(tmp_path, {"down_blocks.0.resnets.0.conv1.weight": torch.zeros(1)}, "diffusers layout")
    _refused(tmp_path, {"model.diffusion_model.joint_blocks.0.x_block.attn.qkv.weight": torch.zeros(3, 1)},
             "no U-Net in this checkpoint")
    _refused(tmp_path, {"double_blocks.0.img_attn.qkv.weight": torch.zeros(3, 1)}, "Flux")
    _refused(tmp_path, hf_clip_tensors("cond_stage_model.transformer.text_model.", 1), "a text encoder alone")
    sd1 = files["sd1"]
    broken = {k: v for k, v in sd1.items() if "encoder.layers.1." not in k}
    _refused(tmp_path, broken, "broken text encoder: layers \\[1\\] are missing")
    wrong_te = {k: v for k, v in sd1.items() if not k.startswith("cond_stage_model.")}
    wrong_te.update(open_clip_tensors("cond_stage_model.model.", 2))
    _refused(tmp_path, wrong_te, "not the one SD 1.x uses")
    narrow = {k: v for k, v in sd1.items() if not k.startswith("cond_stage_model.")}
    narrow.update({k: v[..., :64].contiguous() if v.shape[-1] == WIDTH else v
                   for k, v in hf_clip_tensors("cond_stage_model.transformer.text_model.", 1).items()})
    _refused(tmp_path, narrow, "broken text encoder|gives 64 channels")
    no_decoder_conv = {k: v for k, v in sd1.items() if k != "first_stage_model.decoder.conv_out.weight"}
    _refused(tmp_path, no_decoder_conv, "VAE")
    inpaint = dict(sd1)
    inpaint["model.diffusion_model.input_blocks.0.0.weight"] = torch.zeros(32, 9, 3, 3)
    _refused(tmp_path, inpaint, "9 channels")
    one_encoder = {k: v for k, v in files["sdxl"].items() if not k.startswith("conditioner.embedders.1.")}
    _refused(tmp_path, one_encoder, "broken text encoder: no conditioner.embedders.1.model.token_embedding")
    refiner = dict(files["sdxl"])
    refiner.update(open_clip_tensors("conditioner.embedders.0.model.", 2, projection=True))
    _refused(tmp_path, refiner, "SDXL refiner")


def test_safetensors_are_read_as_safetensors_reads_them(tmp_path):
    from safetensors.torch import load_file

    from tome_core.bench.tensorfile import TensorFile

    tensors = {"a": torch.randn(3, 4).half(), "b": torch.randn(5).bfloat16(), "c": torch.arange(77)[None],
               "d": torch.randn(2, 2, 1, 1, dtype=torch.float64), "e": torch.zeros(0, 3), "f": torch.tensor(True)}
    path = save(tensors, tmp_path / "t.safetensors")
    expected, got = load_file(path), TensorFile(path).read()
    assert set(got) == set(expected)
    for k in expected:
        assert got[k].dtype == expected[k].dtype and torch.equal(got[k], expected[k])
    assert TensorFile(path).read("a", torch.float32)["a"].dtype == torch.float32
    truncated = tmp_path / "cut.safetensors"
    truncated.write_bytes(open(path, "rb").read()[:-8])
    with pytest.raises(CheckpointError, match="truncated"):
        TensorFile(str(truncated)).read()


def test_pipeline_modules_import_without_ldm():
    import os
    import subprocess
    import sys

    code = ("import sys, tome_core.bench.textenc, tome_core.bench.vae, tome_core.bench.checkpoint; "
            "assert not [m for m in sys.modules if m.split('.')[0] in ('ldm', 'safetensors')], sys.modules")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)


@pytest.mark.parametrize("layout", ["sd1", "sdxl"])
def test_token_merging_patches_a_loaded_pipeline_and_comes_off_cleanly(files, layout):
    import tome_core

    pipe = at_size(load_pipeline(files[layout, "safetensors"], CPU, torch.float32), 128, 128)
    noise = torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(2))
    plain = euler_sample(pipe, noise, steps=2)
    tome_core.apply_patch(pipe.unet, ratio=0.5, seed=1, max_downsample=2 if layout == "sdxl" else 1)
    merged = euler_sample(pipe, noise, steps=2)
    tome_core.remove_patch(pipe.unet)
    assert not torch.equal(merged, plain)  # the merge reached the U-Net through the pipeline
    assert torch.equal(euler_sample(pipe, noise, steps=2), plain)


def test_a_lightning_ckpt_with_training_state_loads_without_running_its_code(tmp_path, files, monkeypatch):
    import sys
    import types

    import numpy as np

    # A ModelCheckpoint callback and numpy scalars beside the weights, as PyTorch Lightning saved SD 1.x; the
    # class exists only while saving, as pytorch_lightning is absent where the benchmark runs.
    names = ["pytorch_lightning", "pytorch_lightning.callbacks", "pytorch_lightning.callbacks.model_checkpoint"]
    for name in names:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    ran = []
    callback_class = type("ModelCheckpoint", (), {"__setstate__": lambda self, state: ran.append(state)})
    callback_class.__module__ = names[-1]
    sys.modules[names[-1]].ModelCheckpoint = callback_class
    path = str(tmp_path / "lightning.ckpt")
    torch.save({"state_dict": files["sd1"], "epoch": np.float64(3.0), "callbacks": {"cb": callback_class()}}, path)
    for name in names:
        monkeypatch.delitem(sys.modules, name)
    pipe = load_pipeline(path, CPU, torch.float32)
    assert pipe.context.shape == (1, 77, WIDTH) and pipe.decode is not None and ran == []
