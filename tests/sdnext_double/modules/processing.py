"""SD.Next's processing objects and ``process_images`` (modules/processing.py, processing_class.py)."""

from __future__ import annotations

from typing import Any

from modules import errors, script_callbacks, shared
from modules.processing_info import create_infotext


class StableDiffusionProcessing:
    def __init__(self, prompt: str = "", negative_prompt: str = "", seed: int = 1, steps: int = 4,
                 cfg_scale: float = 6.0, width: int = 128, height: int = 128, batch_size: int = 1, n_iter: int = 1,
                 override_settings: dict | None = None, override_settings_restore_afterwards: bool = True,
                 enable_hr: bool = False, hr_scale: float = 2.0, hr_second_pass_steps: int = 0,
                 hr_denoising_strength: float = 0.5, hidiffusion: bool = False,
                 token_merging_method: str | None = None, tome_ratio: float | None = None,
                 todo_ratio: float | None = None, init_images: list | None = None,
                 denoising_strength: float = 0.5, refiner_steps: int = 5, refiner_start: float = 0.0,
                 **unknown: Any) -> None:
        if unknown:
            raise TypeError(f"unknown fields {sorted(unknown)}")
        self.prompt, self.negative_prompt, self.seed, self.steps = prompt, negative_prompt, seed, steps
        self.cfg_scale, self.width, self.height = cfg_scale, width, height
        self.batch_size, self.n_iter = batch_size, n_iter
        self.override_settings = dict(override_settings or {})
        self.override_settings_restore_afterwards = override_settings_restore_afterwards
        self.enable_hr, self.hr_scale, self.hr_second_pass_steps = enable_hr, hr_scale, hr_second_pass_steps
        self.hr_denoising_strength = hr_denoising_strength
        self.hr_upscale_to_x = self.hr_upscale_to_y = 0
        self.is_hr_pass = False
        self.hidiffusion = hidiffusion
        self.token_merging_method, self.tome_ratio, self.todo_ratio = token_merging_method, tome_ratio, todo_ratio
        self.init_images = init_images
        self.denoising_strength = denoising_strength
        self.refiner_steps, self.refiner_start = refiner_steps, refiner_start
        self.extra_generation_params: dict[str, Any] = {}
        self.per_script_args: dict[str, list] = {}
        self.scripts_value = None
        self.script_args_value: tuple = ()
        self.all_seeds: list[int] = []
        self.seeds: list[int] = []
        self.prompts: list[str] = []
        self.xyz = False
        self.ops: list[str] = []

    @property
    def sd_model(self):
        return shared.sd_model

    @property
    def scripts(self):
        return self.scripts_value

    @scripts.setter
    def scripts(self, value):
        self.scripts_value = value

    @property
    def script_args(self):
        return self.script_args_value

    @script_args.setter
    def script_args(self, value):
        self.script_args_value = value


class StableDiffusionProcessingTxt2Img(StableDiffusionProcessing):
    pass


class StableDiffusionProcessingImg2Img(StableDiffusionProcessing):
    pass


class Processed:
    def __init__(self, p, images: list, infotexts: list[str]) -> None:
        self.images = images
        self.infotexts = infotexts
        self.info = infotexts[0] if infotexts else ""
        self.seed = p.all_seeds[0] if p.all_seeds else p.seed
        self.extra_generation_params = p.extra_generation_params

    def js(self) -> dict:
        return {"infotexts": self.infotexts, "seed": self.seed, "extra_generation_params": self.extra_generation_params}


def process_images(p) -> Processed | None:
    if p.scripts is not None:
        p.scripts.before_process(p)
    stored_opts = {}
    for key, value in p.override_settings.copy().items():
        if key not in shared.opts.data and key not in shared.opts.data_labels:
            continue
        if getattr(shared.opts, key, None) == value:
            p.override_settings.pop(key, None)
    for key in p.override_settings:
        stored_opts[key] = getattr(shared.opts, key, None)
    try:
        for key, value in p.override_settings.items():
            setattr(shared.opts, key, value)
        script_callbacks.before_process_callback(p)
        results = process_images_inner(p)
    finally:
        script_callbacks.after_process_callback(p)
        if p.override_settings_restore_afterwards:
            for key, value in stored_opts.items():
                setattr(shared.opts, key, value)
    return results


def process_images_inner(p) -> Processed:
    from modules.processing_diffusers import process_diffusers, switch_pipeline

    p.all_seeds = [int(p.seed) + i for i in range(p.batch_size * p.n_iter)]
    p.all_prompts = [p.prompt] * (p.batch_size * p.n_iter)
    if p.scripts is not None:
        p.scripts.process(p)
    shared.state.begin()
    images, infotexts = [], []
    for n in range(p.n_iter):
        p.iteration = n
        if shared.state.interrupted:
            break
        p.prompts = p.all_prompts[n * p.batch_size:(n + 1) * p.batch_size]
        p.seeds = p.all_seeds[n * p.batch_size:(n + 1) * p.batch_size]
        if p.scripts is not None:
            p.scripts.before_process_batch(p, batch_number=n, prompts=p.prompts, seeds=p.seeds)
            p.scripts.process_batch(p, batch_number=n, prompts=p.prompts, seeds=p.seeds)
        samples = process_diffusers(p)
        if shared.state.interrupted:
            samples = []
        if p.scripts is not None:
            p.scripts.postprocess_batch(p, samples, batch_number=n)
            from modules.scripts_manager import PostprocessBatchListArgs, PostprocessImageArgs

            batch = PostprocessBatchListArgs(list(samples))
            p.scripts.postprocess_batch_list(p, batch, batch_number=n)
            samples = batch.images
        for i, image in enumerate(samples):
            if p.scripts is not None:
                pp = PostprocessImageArgs(image)
                p.scripts.postprocess_image(p, pp)
                image = pp.image
            images.append(image)
            infotexts.append(create_infotext(p, index=n * p.batch_size + i))
    if not p.xyz:
        shared.sd_model = switch_pipeline(shared.sd_model, "txt2img")
    processed = Processed(p, images, infotexts)
    if p.scripts is not None and not (shared.state.interrupted or shared.state.skipped):
        p.scripts.postprocess(p, processed)
    return processed
