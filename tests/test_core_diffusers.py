"""The engine on diffusers U-Nets and pipelines (diffusers' own classes at a tiny size).

Independent expectations: tomesd 0.1.3 on the same diffusers U-Net (with ``use_rand=False`` both use the fixed
partition); an ldm U-Net holding the same weights (diffusers' own checkpoint conversion), patched alike; the
exact unpatched output.
"""

from __future__ import annotations

import pytest
import tomesd
import torch

import tome_core
from diffusers_unets import CONFIGS, diffusers_unet, run_diffusers, twin_unets
from unets import CONTEXT_DIM, hook_counts, inputs, run

pytestmark = pytest.mark.filterwarnings("ignore")


def _tomesd_and_ours(unet, x, t, c, **options):
    base = run_diffusers(unet, x, t, c)
    tomesd.apply_patch(unet, use_rand=False, **options)
    ref = run_diffusers(unet, x, t, c)
    tomesd.remove_patch(unet)
    tome_core.apply_patch(unet, use_rand=False, **options)
    ours = run_diffusers(unet, x, t, c)
    tome_core.remove_patch(unet)
    return base, ref, ours


TOMESD_CASES = [
    # layout, batch, latent h, w, options
    ("sd1", 2, 32, 32, dict(ratio=0.5)),
    ("sd1", 1, 24, 40, dict(ratio=0.3)),                      # non-square; batch 1
    ("sd1", 2, 32, 32, dict(ratio=0.9)),                      # above the cap
    ("sd1", 2, 32, 24, dict(ratio=0.5, sx=4, sy=2)),
    ("sd1", 2, 32, 32, dict(ratio=0.5, max_downsample=2, merge_crossattn=True)),
    ("sd1", 2, 40, 24, dict(ratio=0.6, max_downsample=4, merge_mlp=True)),
    ("sd1", 2, 32, 32, dict(ratio=0.5, merge_attn=False, merge_mlp=True)),
    ("sd2", 2, 32, 32, dict(ratio=0.5, max_downsample=8, merge_crossattn=True, merge_mlp=True)),
    ("sdxl", 2, 32, 32, dict(ratio=0.5, max_downsample=2)),
    ("sdxl", 2, 24, 32, dict(ratio=0.5, max_downsample=4, merge_crossattn=True)),
    ("refiner", 1, 32, 32, dict(ratio=0.4, max_downsample=2)),
]


@pytest.mark.parametrize("layout,batch,h,w,options", TOMESD_CASES)
def test_diffusers_unet_output_equals_tomesd(layout, batch, h, w, options):
    unet = diffusers_unet(layout)
    x, t, c = inputs(batch, h, w)
    base, ref, ours = _tomesd_and_ours(unet, x, t, c, **options)
    assert (ref - base).abs().max() > 1e-3, "the oracle must change the output, or the comparison proves nothing"
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=1e-4)
    assert torch.equal(run_diffusers(unet, x, t, c), base)


def test_sdxl_auto_level_merges_where_tomesd_defaults_merge_nothing():
    unet = diffusers_unet("sdxl")
    x, t, c = inputs(2, 32, 32)
    base = run_diffusers(unet, x, t, c)
    tomesd.apply_patch(unet, ratio=0.5)  # max_downsample=1: SDXL has no attention at full resolution
    assert torch.equal(run_diffusers(unet, x, t, c), base)
    tomesd.remove_patch(unet)
    tome_core.apply_patch(unet, ratio=0.5, use_rand=False)  # auto: the highest-resolution attention level
    auto = run_diffusers(unet, x, t, c)
    selected = {b.name.split(".attentions")[0] for b in tome_core.patched_blocks(unet)}
    assert selected == {"down_blocks.1", "up_blocks.1"}
    tome_core.remove_patch(unet)
    tome_core.apply_patch(unet, ratio=0.5, use_rand=False, max_downsample=2)
    torch.testing.assert_close(auto, run_diffusers(unet, x, t, c), atol=0, rtol=0)
    tome_core.remove_patch(unet)


@pytest.mark.parametrize("layout", ["sd1", "sd2", "sdxl"])
def test_levels_from_structure_match_the_ldm_twin(layout):
    ldm, unet = twin_unets(layout)
    levels = lambda m: [lv for _, _, lv in tome_core.patch.transformer_levels(m)]  # noqa: E731
    assert levels(unet) == levels(ldm) and len(levels(unet)) > 0


@pytest.mark.parametrize("layout", ["sd1", "sd2", "sdxl"])
@pytest.mark.parametrize("options", [
    dict(method="tome", ratio=0.5, use_rand=False),
    dict(method="tome", ratio=0.6, use_rand=True, seed=1234, merge_mlp=True, max_downsample=2),
    dict(method="todo", todo_factor=2, max_downsample=2),
    dict(method="todo", todo_factor=3, todo_pool="average"),
    dict(method="local", ratio=0.5),
    dict(method="local", ratio=0.25, max_downsample=4),
    dict(method="stack", ratio=0.5),
    dict(method="stack", ratio=0.6, max_downsample=4),
], ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_ldm_and_diffusers_twins_agree_unpatched_and_patched(layout, options):
    ldm, unet = twin_unets(layout)
    x, t, c = inputs(2, 32, 24)
    ldm_base, ours_base = run(ldm, x, t, c), run_diffusers(unet, x, t, c)
    torch.testing.assert_close(ours_base, ldm_base, atol=2e-5, rtol=1e-4)
    tome_core.apply_patch(ldm, **options)
    tome_core.apply_patch(unet, **options)
    ldm_out, ours = run(ldm, x, t, c), run_diffusers(unet, x, t, c)
    assert (ldm_out - ldm_base).abs().max() > 1e-3
    torch.testing.assert_close(ours, ldm_out, atol=2e-5, rtol=1e-4)
    tome_core.remove_patch(unet)
    assert torch.equal(run_diffusers(unet, x, t, c), ours_base)
    assert hook_counts(unet) == {}


def test_step_window_seed_and_int32_on_diffusers():
    unet = diffusers_unet("sd1")
    x, t, c = inputs(2, 32, 32)
    base = run_diffusers(unet, x, t, c)
    tome_core.apply_patch(unet, ratio=0.5, seed=7, step_start=0.5)
    tome_core.set_progress(unet, 0.2)
    assert torch.equal(run_diffusers(unet, x, t, c), base)  # outside the window: the original code
    tome_core.set_progress(unet, 0.6)
    seeded = run_diffusers(unet, x, t, c)
    assert (seeded - base).abs().max() > 1e-3
    tome_core.apply_patch(unet, ratio=0.5, seed=7, index_dtype=torch.int32)
    torch.testing.assert_close(run_diffusers(unet, x, t, c), seeded, atol=1e-6, rtol=0)
    tome_core.apply_patch(unet, ratio=0.5, seed=8)
    assert (run_diffusers(unet, x, t, c) - seeded).abs().max() > 1e-4  # another seed, another partition
    tome_core.remove_patch(unet)
    assert torch.equal(run_diffusers(unet, x, t, c), base)


def test_timestep_as_keyword_and_python_number_keys_the_partition_alike():
    unet = diffusers_unet("sd1")
    x, _, c = inputs(2, 16, 16)
    tome_core.apply_patch(unet, ratio=0.5, seed=3)
    with torch.no_grad():
        positional = unet(x, torch.tensor([500.0, 500.0]), c).sample
        keyword = unet(sample=x, timestep=500.0, encoder_hidden_states=c).sample
    torch.testing.assert_close(keyword, positional, atol=1e-6, rtol=0)
    tome_core.remove_patch(unet)


def test_bad_options_leave_a_diffusers_unet_untouched():
    unet = diffusers_unet("sd1")
    tome_core.apply_patch(unet, ratio=0.3)
    before = hook_counts(unet)
    for bad in (dict(ratio=1.5), dict(method="fast"), dict(sx=0), dict(todo_factor=99)):
        with pytest.raises((TypeError, ValueError)):
            tome_core.apply_patch(unet, **bad)
        assert hook_counts(unet) == before and tome_core.get_patch(unet).options.ratio == 0.3
    tome_core.remove_patch(unet)
    assert hook_counts(unet) == {}


# -- processors and other libraries on the same U-Net ---------------------------------------------------------

def test_plain_and_sdpa_processors_are_kept_and_merged_alike():
    from diffusers.models.attention_processor import AttnProcessor

    unet = diffusers_unet("sd1")
    x, t, c = inputs(2, 32, 32)
    sdpa = dict(unet.attn_processors)
    _, ref_sdpa, ours_sdpa = _tomesd_and_ours(unet, x, t, c, ratio=0.5)
    assert dict(unet.attn_processors) == sdpa  # the very processor objects, as they were
    unet.set_attn_processor(AttnProcessor())
    plain = dict(unet.attn_processors)
    _, ref_plain, ours_plain = _tomesd_and_ours(unet, x, t, c, ratio=0.5)
    assert dict(unet.attn_processors) == plain
    torch.testing.assert_close(ours_plain, ref_plain, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(ours_plain, ours_sdpa, atol=2e-5, rtol=1e-4)


def _add_ip_adapter(unet, image_dim: int = 12, tokens: int = 4) -> None:
    """IP-Adapter's image projection and attn2 processors, the way diffusers' loader lays them out."""
    from diffusers.models.attention_processor import AttnProcessor2_0, IPAdapterAttnProcessor2_0
    from diffusers.models.embeddings import ImageProjection, MultiIPAdapterImageProjection

    torch.manual_seed(5)
    processors = {}
    for name, attention in unet.attn_processors.items():
        if name.endswith("attn2.processor"):
            module = unet.get_submodule(name[: -len(".processor")])
            ip = IPAdapterAttnProcessor2_0(module.to_q.out_features, CONTEXT_DIM, num_tokens=(tokens,), scale=0.8)
            with torch.no_grad():
                for layer in (*ip.to_k_ip, *ip.to_v_ip):
                    layer.weight.normal_(0, 0.3)
            processors[name] = ip
        else:
            processors[name] = AttnProcessor2_0()
    unet.set_attn_processor(processors)
    unet.encoder_hid_proj = MultiIPAdapterImageProjection(
        [ImageProjection(image_embed_dim=image_dim, cross_attention_dim=CONTEXT_DIM, num_image_text_embeds=tokens)])
    unet.register_to_config(encoder_hid_dim_type="ip_image_proj")


def test_ip_adapter_on_attn2_merged_like_tomesd():
    unet = diffusers_unet("sd1")
    _add_ip_adapter(unet)
    x, t, c = inputs(2, 32, 32)
    image = {"added_cond_kwargs": {"image_embeds": [torch.randn(2, 1, 12, generator=torch.Generator().manual_seed(2))]}}
    no_image = run_diffusers(unet, x, t, c, added_cond_kwargs={"image_embeds": [torch.zeros(2, 1, 12)]})
    base = run_diffusers(unet, x, t, c, **image)
    assert (base - no_image).abs().max() > 1e-3  # the adapter acts
    processors = dict(unet.attn_processors)
    options = dict(ratio=0.5, use_rand=False, merge_crossattn=True, max_downsample=2)
    tomesd.apply_patch(unet, **options)
    ref = run_diffusers(unet, x, t, c, **image)
    tomesd.remove_patch(unet)
    tome_core.apply_patch(unet, **options)
    ours = run_diffusers(unet, x, t, c, **image)
    tome_core.remove_patch(unet)
    assert (ref - base).abs().max() > 1e-3
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=1e-4)
    assert dict(unet.attn_processors) == processors
    assert torch.equal(run_diffusers(unet, x, t, c, **image), base)


def test_peft_lora_merged_like_tomesd():
    from peft import LoraConfig

    unet = diffusers_unet("sd1")
    x, t, c = inputs(2, 32, 32)
    plain = run_diffusers(unet, x, t, c)
    torch.manual_seed(9)
    unet.add_adapter(LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    base, ref, ours = _tomesd_and_ours(unet, x, t, c, ratio=0.5, merge_crossattn=True)
    assert (base - plain).abs().max() > 1e-3  # the LoRA acts
    assert (ref - base).abs().max() > 1e-3
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=1e-4)
    for method in ("todo", "local"):
        tome_core.apply_patch(unet, method=method)
        assert (run_diffusers(unet, x, t, c) - base).abs().max() > 1e-4
    tome_core.remove_patch(unet)
    assert torch.equal(run_diffusers(unet, x, t, c), base)


# -- pipelines ------------------------------------------------------------------------------------------------

def _pipeline():
    from diffusers import AutoencoderKL, EulerDiscreteScheduler, StableDiffusionPipeline

    torch.manual_seed(0)
    vae = AutoencoderKL(block_out_channels=(8, 8), down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, norm_num_groups=4).eval()
    return StableDiffusionPipeline(vae=vae, text_encoder=None, tokenizer=None, unet=diffusers_unet("sd1"),
                                   scheduler=EulerDiscreteScheduler(), safety_checker=None, feature_extractor=None,
                                   requires_safety_checker=False)


def _sample(pipe, **extra):
    gen = torch.Generator().manual_seed(0)
    embeds = torch.randn(1, 7, CONTEXT_DIM, generator=gen)
    with torch.no_grad():
        return pipe(prompt_embeds=embeds, negative_prompt_embeds=torch.zeros_like(embeds), height=128, width=96,
                    num_inference_steps=3, generator=torch.Generator().manual_seed(1), output_type="latent",
                    **extra).images


def test_pipeline_is_patched_through_its_unet_and_restored():
    from diffusers import StableDiffusionImg2ImgPipeline

    pipe = _pipeline()
    base = _sample(pipe)
    assert tome_core.apply_patch(pipe, ratio=0.5) is pipe
    assert tome_core.is_patched(pipe) and tome_core.get_patch(pipe) is tome_core.get_patch(pipe.unet)
    merged = _sample(pipe)
    assert (merged - base).abs().max() > 1e-3
    # An img2img pipeline from the same components shares the U-Net, and so the patch.
    img2img = StableDiffusionImg2ImgPipeline(**pipe.components)
    assert tome_core.is_patched(img2img)
    tome_core.remove_patch(pipe)
    assert not tome_core.is_patched(img2img) and hook_counts(pipe.unet) == {}
    assert torch.equal(_sample(pipe), base)


def test_pipeline_step_window_through_a_step_callback():
    pipe = _pipeline()
    base = _sample(pipe)
    tome_core.apply_patch(pipe, ratio=0.5, step_start=0.9)  # only the last of 3 steps

    def progress(pipeline, step, timestep, kwargs):
        tome_core.set_progress(pipeline, min(1.0, (step + 1) / 2))  # the next step of 3: 0.5, 1.0
        return kwargs

    tome_core.set_progress(pipe, 0.0)
    late = _sample(pipe, callback_on_step_end=progress)
    tome_core.apply_patch(pipe, ratio=0.5)
    always = _sample(pipe)
    tome_core.remove_patch(pipe)
    assert (late - base).abs().max() > 0 and (late - base).abs().max() < (always - base).abs().max()


# -- what cannot be patched -----------------------------------------------------------------------------------

def _pixart():
    from diffusers import PixArtTransformer2DModel

    return PixArtTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8,
                                    num_layers=1, cross_attention_dim=16, sample_size=8, patch_size=2,
                                    caption_channels=16, norm_num_groups=4)


class _DitPipeline:
    """Stands for a DiT pipeline (PixArt's): its denoiser is ``.transformer``, it has no ``.unet``."""

    def __init__(self, transformer):
        self.transformer = transformer
        self.components = {"transformer": transformer}


def test_diffusion_transformers_are_refused_by_name():
    from diffusers import Transformer2DModel

    pixart = _pixart()
    with pytest.raises(ValueError, match="diffusion transformer.*PixArtTransformer2DModel"):
        tome_core.apply_patch(pixart, ratio=0.5)
    assert hook_counts(pixart) == {} and not tome_core.is_patched(pixart)
    with pytest.raises(ValueError, match="_DitPipeline has no U-Net.*PixArtTransformer2DModel"):
        tome_core.apply_patch(_DitPipeline(pixart))
    patched_input = Transformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, patch_size=2,
                                       sample_size=8, num_layers=1, norm_type="ada_norm_zero", num_embeds_ada_norm=10)
    with pytest.raises(ValueError, match="diffusion transformer"):
        tome_core.apply_patch(patched_input)


@pytest.mark.parametrize("name", ["SD3Transformer2DModel", "FluxTransformer2DModel"])
def test_sd3_and_flux_refused_by_name(name):
    import diffusers

    cls = getattr(diffusers, name)
    if name == "SD3Transformer2DModel":
        model = cls(sample_size=8, patch_size=2, in_channels=4, num_layers=1, attention_head_dim=8,
                    num_attention_heads=2, joint_attention_dim=16, caption_projection_dim=16,
                    pooled_projection_dim=16, out_channels=4, pos_embed_max_size=16)
    else:
        model = cls(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=8,
                    num_attention_heads=2, joint_attention_dim=16, pooled_projection_dim=16, axes_dims_rope=(2, 2, 4))
    with pytest.raises(ValueError, match=f"diffusion transformer \\({name}"):
        tome_core.apply_patch(model)
    assert hook_counts(model) == {}


def test_unknown_unets_and_objects_get_one_clear_message():
    from diffusers import UNet2DModel

    plain = UNet2DModel(sample_size=8, in_channels=3, out_channels=3, layers_per_block=1,
                        block_out_channels=(8, 8), norm_num_groups=4,
                        down_block_types=("DownBlock2D", "AttnDownBlock2D"), up_block_types=("AttnUpBlock2D", "UpBlock2D"))
    with pytest.raises(ValueError, match="UNet2DModel has no transformer blocks"):
        tome_core.apply_patch(plain)
    assert hook_counts(plain) == {}

    class NoUnet:
        unet = None
        components = {"unet": None}

    with pytest.raises(ValueError, match="NoUnet has no U-Net"):
        tome_core.apply_patch(NoUnet())
    with pytest.raises(TypeError, match="got str"):
        tome_core.apply_patch("sd15.safetensors")


def test_meta_device_and_accelerate_offload_refused_with_nothing_changed():
    from accelerate import cpu_offload, init_empty_weights
    from diffusers import UNet2DConditionModel

    with init_empty_weights():
        empty = UNet2DConditionModel(sample_size=8, layers_per_block=1, norm_num_groups=8,
                                     cross_attention_dim=CONTEXT_DIM, **CONFIGS["sd1"])
    with pytest.raises(ValueError, match="meta device"):
        tome_core.apply_patch(empty)
    assert hook_counts(empty) == {} and not tome_core.is_patched(empty)

    unet = diffusers_unet("sd1")
    x, t, c = inputs(1, 16, 16)
    base = run_diffusers(unet, x, t, c)
    cpu_offload(unet, execution_device=torch.device("cpu"))
    counts = hook_counts(unet)
    with pytest.raises(ValueError, match="meta device|offloaded by accelerate"):
        tome_core.apply_patch(unet)
    assert hook_counts(unet) == counts and not tome_core.is_patched(unet)
    torch.testing.assert_close(run_diffusers(unet, x, t, c), base, atol=1e-6, rtol=0)

