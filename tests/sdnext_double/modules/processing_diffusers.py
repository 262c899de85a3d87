"""SD.Next's diffusers processing (modules/processing_diffusers.py): per pass ``process_pre`` (DeepCache's
worker enabled where there is one, built-in token merging from the settings, then HiDiffusion, whose unapply
resets ``_parent`` modules), the pipeline call, ``process_post`` in a ``finally``. The hires pass runs the same
U-Net through an img2img pipeline built from the same components; no Script hook runs between the passes. The
refiner (``process_refine``) is the ``shared.sd_refiner`` pipeline of its own, called after them as img2img
where hires fix is on with refiner steps and a refiner start inside (0, 1), with no per-pass modifiers and no
Script hook. A RuntimeError or ValueError in a pass is logged and interrupts the job (its postprocess hooks are
then skipped)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from modules import errors, hidiffusion, sd_models_compile, shared, token_merge

_img2img_pipes: dict[int, object] = {}


def switch_pipeline(pipe, task: str):
    """``sd_models.set_diffuser_pipe``: the pipeline of ``task`` over the same components."""
    from diffusers import StableDiffusionImg2ImgPipeline, StableDiffusionPipeline

    base = getattr(pipe, "base_pipeline", pipe)
    if task == "txt2img":
        return base
    if id(base) not in _img2img_pipes:
        img2img = StableDiffusionImg2ImgPipeline(**base.components, requires_safety_checker=False)
        img2img.set_progress_bar_config(disable=True)
        img2img.base_pipeline = base
        img2img.sd_checkpoint_info = getattr(base, "sd_checkpoint_info", None)
        _img2img_pipes[id(base)] = img2img
    return _img2img_pipes[id(base)]


def process_pre(p) -> None:
    try:
        sd_models_compile.check_deepcache(enable=True)
        token_merge.apply_token_merging(shared.sd_model)
        hidiffusion.apply(p, shared.sd_model_type)
    except Exception as error:
        errors.display(error, "apply")


def process_post(p) -> None:
    try:
        sd_models_compile.check_deepcache(enable=False)
        token_merge.remove_token_merging(shared.sd_model)
        hidiffusion.unapply()
    except Exception as error:
        errors.display(error, "unapply")


def _embeds(p):
    from sdnext_double.model import encode_prompts

    return encode_prompts(p.prompts), encode_prompts([p.negative_prompt] * len(p.prompts))


def _generator(p):
    return [torch.Generator().manual_seed(int(seed)) for seed in p.seeds]


def _run_pass(p, name: str, **pipe_args):
    prompt_embeds, negative = _embeds(p)
    process_pre(p)
    output = None
    try:
        output = shared.sd_model(prompt_embeds=prompt_embeds, negative_prompt_embeds=negative,
                                 guidance_scale=p.cfg_scale, output_type="latent", generator=_generator(p),
                                 **pipe_args)
    except (RuntimeError, ValueError) as error:
        shared.state.interrupted = True
        shared.log(f"Processing: step={name} {error}")
        errors.display(error, "Processing")
    finally:
        process_post(p)
    return output


def is_refiner_enabled(p) -> bool:
    """``processing_helpers.is_refiner_enabled``."""
    return (p.enable_hr and p.refiner_steps > 0 and 0 < p.refiner_start < 1
            and shared.sd_refiner is not None)


def _refine(p, latents):
    """``process_refine``: the refiner pipeline as img2img over the base (or hires) latents, from the refiner
    start on (SD 1.5's img2img pipeline takes it as a strength)."""
    refiner = switch_pipeline(shared.sd_refiner, "img2img")
    prompt_embeds, negative = _embeds(p)
    try:
        output = refiner(prompt_embeds=prompt_embeds, negative_prompt_embeds=negative, guidance_scale=p.cfg_scale,
                         output_type="latent", generator=_generator(p), image=latents,
                         strength=1 - p.refiner_start, num_inference_steps=p.refiner_steps)
    except (RuntimeError, ValueError) as error:
        shared.state.interrupted = True
        shared.log(f"Processing step=refine: {error}")
        errors.display(error, "Processing")
        return None
    return output.images


def process_diffusers(p):
    from modules.processing import StableDiffusionProcessingImg2Img

    orig_pipeline = shared.sd_model
    if isinstance(p, StableDiffusionProcessingImg2Img):
        shared.sd_model = switch_pipeline(shared.sd_model, "img2img")
        init = torch.stack([p.init_images[min(i, len(p.init_images) - 1)] for i in range(len(p.prompts))])
        output = _run_pass(p, "base", image=init, strength=p.denoising_strength, num_inference_steps=p.steps)
    else:
        shared.sd_model = switch_pipeline(shared.sd_model, "txt2img")
        output = _run_pass(p, "base", num_inference_steps=p.steps, height=p.height, width=p.width)
    if output is None or shared.state.interrupted:
        shared.sd_model = orig_pipeline
        return []
    latents = output.images
    if p.enable_hr:
        p.is_hr_pass = True
        p.hr_upscale_to_x, p.hr_upscale_to_y = int(p.width * p.hr_scale), int(p.height * p.hr_scale)
        latents = F.interpolate(latents, size=(p.hr_upscale_to_y // 8, p.hr_upscale_to_x // 8), mode="bilinear")
        shared.sd_model = switch_pipeline(shared.sd_model, "img2img")
        output = _run_pass(p, "hires", image=latents, strength=p.hr_denoising_strength,
                           num_inference_steps=p.hr_second_pass_steps or p.steps)
        p.is_hr_pass = False
        if output is None or shared.state.interrupted:
            shared.sd_model = orig_pipeline
            return []
        latents = output.images
    if is_refiner_enabled(p):
        latents = _refine(p, latents)
        if latents is None:
            shared.sd_model = orig_pipeline
            return []
    vae = shared.sd_model.vae
    with torch.no_grad():
        decoded = vae.decode(latents / vae.config.scaling_factor).sample
    shared.sd_model = orig_pipeline
    return [((image + 1) / 2).clamp(0, 1) for image in decoded]
