"""Processing objects and ``process_images`` in the webui's order of hooks and events.

One job (``process_images``): ``before_process`` → override settings applied → built-in token merging at the
first-pass ratio → ``process`` → init (hires target size) → ``sd_unet.apply_unet`` → per batch of the batch
count: ``before_process_batch``, ``process_batch``, conds, the early infotext (params.txt), sampling
(``process_before_every_sampling`` with ``p.is_hr_pass`` False; with hires fix then built-in token merging at
the hires ratio, ``before_hr``, ``process_before_every_sampling`` with ``is_hr_pass`` True, the hires pass,
and the first-pass ratio again), ``postprocess_batch``, per image ``postprocess_image`` and its infotext →
``postprocess``. Finally, also after an exception: built-in token merging off and the overridden settings
restored (only those config.json holds). An exception during sampling skips the rest, ``postprocess``
included.

The refiner: before each evaluation (before the ``on_cfg_denoiser`` callbacks), once the pass has done
``refiner_switch_at`` of its evaluations, the denoiser loads the refiner checkpoint with
``sd_models.reload_model_weights`` (in the pass the ``hires_fix_refiner_pass`` setting names, with hires fix),
which makes a new ``shared.sd_model`` when its config differs; each batch, each job and the hires pass start
by loading the base checkpoint back.

Interrupt (``state.interrupt()``): the denoiser's next evaluation raises ``InterruptedException``, which the
sampler catches, returning its last denoised latent; the hires pass is then skipped, and the job goes on
(images, ``postprocess``) with what was sampled. A new job starts with ``state.begin()``.

The U-Net is called once per model evaluation with cond and uncond batched (two calls when
``batch_cond_uncond`` is off); the samplers keep the webui's evaluation counts: Euler one per step, Heun two
per step but one in its last step, DDIM one fewer than its steps. Images are the final latents (no VAE).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import tomesd
import torch
import torch.nn.functional as F

from modules import infotext_utils, script_callbacks, sd_models, sd_unet, shared
from modules.shared import opts, state

current_p: Any = None  # the job being processed; lets tests observe U-Net calls in context (double only)


def apply_token_merging(sd_model, ratio: float) -> None:
    """The webui's built-in token merging: tomesd with ``use_rand=False`` on the whole model."""
    current = getattr(sd_model, "applied_token_merged_ratio", 0)
    if current == ratio:
        return
    if current > 0:
        tomesd.remove_patch(sd_model)
    if ratio > 0:
        tomesd.apply_patch(sd_model, ratio=ratio, use_rand=False, merge_attn=True, merge_crossattn=False,
                           merge_mlp=False)
    sd_model.applied_token_merged_ratio = ratio


@dataclass(repr=False)
class StableDiffusionProcessing:
    prompt: str = ""
    negative_prompt: str = ""
    seed: int = -1
    subseed: int = -1
    batch_size: int = 1
    n_iter: int = 1
    steps: int = 3
    cfg_scale: float = 7.0
    width: int = 256
    height: int = 256
    sampler_name: str = "Euler"
    denoising_strength: float | None = None
    override_settings: dict = field(default_factory=dict)
    override_settings_restore_afterwards: bool = True
    extra_generation_params: dict = field(default_factory=dict)
    styles: list = field(default_factory=list)
    do_not_save_samples: bool = True
    refiner_checkpoint: str | None = None
    refiner_switch_at: float | None = None

    # Plain class attributes in the webui too (not dataclass fields, not API fields).
    token_merging_ratio = 0
    token_merging_ratio_hr = 0
    is_hr_pass = False

    def __post_init__(self) -> None:
        self._scripts = None
        self._script_args = None
        self.scripts_setup_complete = False
        self.is_api = False
        self.iteration = 0
        self.all_prompts = self.all_negative_prompts = self.all_seeds = self.all_subseeds = None
        self.prompts = self.negative_prompts = self.seeds = self.subseeds = None
        self.batch_index = 0
        self.refiner_checkpoint_info = None

    # Assigning both ``scripts`` and ``script_args`` runs the scripts' ``setup`` once.
    @property
    def scripts(self):
        return self._scripts

    @scripts.setter
    def scripts(self, value) -> None:
        self._scripts = value
        self._setup_scripts()

    @property
    def script_args(self):
        return self._script_args

    @script_args.setter
    def script_args(self, value) -> None:
        self._script_args = value
        self._setup_scripts()

    def _setup_scripts(self) -> None:
        if self._scripts is not None and self._script_args is not None and not self.scripts_setup_complete:
            self.scripts_setup_complete = True
            self._scripts.setup_scripts(self)

    @property
    def sd_model(self):
        return shared.sd_model

    def get_token_merging_ratio(self, for_hr: bool = False) -> float:
        if for_hr:
            return (self.token_merging_ratio_hr or opts.token_merging_ratio_hr or self.token_merging_ratio
                    or opts.token_merging_ratio)
        return self.token_merging_ratio or opts.token_merging_ratio

    def init(self, all_prompts, all_seeds, all_subseeds) -> None:
        pass

    def before_batch(self) -> None:
        """At the start of each batch of the batch count: the base model back (the refiner may be loaded)."""
        sd_models.reload_model_weights()

    def job_token_merging(self, ratio: float) -> None:
        """The built-in token merging for the whole job (0: off), set at its start and removed at its end."""
        apply_token_merging(self.sd_model, ratio)

    def setup_conds(self) -> None:
        self.c = self.sd_model.get_learned_conditioning(self.prompts)
        self.uc = self.sd_model.get_learned_conditioning(self.negative_prompts)

    def noise(self, height: int, width: int, salt: int = 0) -> torch.Tensor:
        """Per-image noise from each image's own seed, as the webui does."""
        return torch.stack([torch.randn(4, height, width, generator=torch.Generator().manual_seed(seed + salt))
                            for seed in self.seeds])

    def sample(self, conditioning, unconditional_conditioning, seeds, subseeds, subseed_strength, prompts):
        raise NotImplementedError


@dataclass(repr=False)
class StableDiffusionProcessingTxt2Img(StableDiffusionProcessing):
    enable_hr: bool = False
    hr_scale: float = 1.5
    hr_upscaler: str = "Latent (nearest)"
    hr_second_pass_steps: int = 0
    hr_resize_x: int = 0
    hr_resize_y: int = 0
    hr_sampler_name: str | None = None
    firstpass_image: Any = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self.hr_upscale_to_x = self.hr_upscale_to_y = 0

    def init(self, all_prompts, all_seeds, all_subseeds) -> None:
        if self.enable_hr:
            self.hr_upscale_to_x = int(self.width * self.hr_scale)
            self.hr_upscale_to_y = int(self.height * self.hr_scale)
            self.extra_generation_params["Hires upscale"] = self.hr_scale
            if self.hr_second_pass_steps:
                self.extra_generation_params["Hires steps"] = self.hr_second_pass_steps

    def sample(self, conditioning, unconditional_conditioning, seeds, subseeds, subseed_strength, prompts):
        sampler = create_sampler(self.sampler_name)
        x = self.noise(self.height // 8, self.width // 8)
        if self.scripts is not None:
            self.scripts.process_before_every_sampling(self, x=x, noise=x, c=conditioning,
                                                       uc=unconditional_conditioning)
        samples = sampler.sample(self, x, conditioning, unconditional_conditioning)
        if not self.enable_hr:
            return samples
        sd_models.reload_model_weights()  # the hires pass starts on the base model (a refiner may be loaded)
        return self.sample_hr_pass(samples)

    def start_hr_pass(self, samples: torch.Tensor):
        """The hires pass's upscaled latent, sampler and noise."""
        self.is_hr_pass = True
        target = (self.hr_upscale_to_y // 8, self.hr_upscale_to_x // 8)
        samples = F.interpolate(samples, size=target, mode="nearest")
        return samples, create_sampler(self.hr_sampler_name or self.sampler_name), self.noise(*target, salt=1)

    def sample_hr_pass(self, samples: torch.Tensor) -> torch.Tensor:
        if state.interrupted:
            return samples
        samples, sampler, noise = self.start_hr_pass(samples)
        apply_token_merging(self.sd_model, self.get_token_merging_ratio(for_hr=True))
        if self.scripts is not None:
            self.scripts.before_hr(self)
            self.scripts.process_before_every_sampling(self, x=samples, noise=noise, c=self.c, uc=self.uc)
        samples = sampler.sample_img2img(self, samples, noise, self.c, self.uc,
                                         steps=self.hr_second_pass_steps or self.steps)
        apply_token_merging(self.sd_model, self.get_token_merging_ratio())
        self.is_hr_pass = False
        return samples


@dataclass(repr=False)
class StableDiffusionProcessingImg2Img(StableDiffusionProcessing):
    init_images: list = field(default_factory=list)  # latents (4, h, w) in the double: it has no VAE
    denoising_strength: float = 0.75
    mask: Any = None

    def get_token_merging_ratio(self, for_hr: bool = False) -> float:
        use_main = "token_merging_ratio" in self.override_settings
        return (self.token_merging_ratio or (use_main and opts.token_merging_ratio)
                or opts.token_merging_ratio_img2img or opts.token_merging_ratio)

    def init(self, all_prompts, all_seeds, all_subseeds) -> None:
        latents = [self.init_images[i % len(self.init_images)] for i in range(self.batch_size)]
        self.init_latent = torch.stack(latents)

    def sample(self, conditioning, unconditional_conditioning, seeds, subseeds, subseed_strength, prompts):
        sampler = create_sampler(self.sampler_name)
        noise = self.noise(*self.init_latent.shape[-2:])
        if self.scripts is not None:
            self.scripts.process_before_every_sampling(self, x=self.init_latent, noise=noise, c=conditioning,
                                                       uc=unconditional_conditioning)
        return sampler.sample_img2img(self, self.init_latent, noise, conditioning, unconditional_conditioning)


# -- samplers -------------------------------------------------------------------------------------------------

class InterruptedException(BaseException):
    """``sd_samplers_common.InterruptedException``."""


class CFGDenoiser:
    """One model evaluation: the ``on_cfg_denoiser`` callbacks, then the U-Net on cond and uncond."""

    def __init__(self, sampler) -> None:
        self.sampler = sampler
        self.step = 0
        self.steps = None
        self.total_steps = None
        self.p = None

    def __call__(self, x: torch.Tensor, sigma: torch.Tensor, cond, uncond, cond_scale: float) -> torch.Tensor:
        if state.interrupted or state.skipped:
            raise InterruptedException
        apply_refiner(self)
        params = script_callbacks.CFGDenoiserParams(x, None, sigma, state.sampling_step, state.sampling_steps,
                                                    cond, uncond, self)
        script_callbacks.cfg_denoiser_callback(params)
        x, sigma = params.x, params.sigma
        batch = x.shape[0]
        x_in, sigma_in = torch.cat([x, x]), torch.cat([sigma, sigma])
        if opts.batch_cond_uncond:
            out = self.sampler.model_output(x_in, sigma_in, torch.cat([cond, uncond]))
        else:
            out = torch.cat([self.sampler.model_output(x_in[:batch], sigma_in[:batch], cond),
                             self.sampler.model_output(x_in[batch:], sigma_in[batch:], uncond)])
        denoised_cond, denoised_uncond = out[:batch], out[batch:]
        self.step += 1
        denoised = denoised_uncond + (denoised_cond - denoised_uncond) * cond_scale
        self.sampler.last_latent = denoised
        return denoised


def apply_refiner(denoiser: CFGDenoiser) -> bool:
    """Switch to the refiner once ``refiner_switch_at`` of the pass's evaluations are done."""
    p = denoiser.p
    info = p.refiner_checkpoint_info
    if info is None or p.refiner_switch_at is None or denoiser.step / denoiser.total_steps < p.refiner_switch_at:
        return False
    if getattr(shared.sd_model, "sd_checkpoint_info", None) is info:
        return False
    if getattr(p, "enable_hr", False):
        wanted = opts.hires_fix_refiner_pass
        if (wanted == "first pass" and p.is_hr_pass) or (wanted == "second pass" and not p.is_hr_pass):
            return False
    p.extra_generation_params["Refiner"] = info.short_title
    p.extra_generation_params["Refiner switch at"] = p.refiner_switch_at
    load_refiner(info)
    p.setup_conds()
    return True


def load_refiner(info) -> None:
    sd_models.reload_model_weights(info=info)


class Sampler:
    second_order = False

    def __init__(self, name: str) -> None:
        self.name = name
        self.denoiser = CFGDenoiser(self)
        self.last_latent: torch.Tensor | None = None

    def launch_sampling(self, steps: int, func):
        self.denoiser.steps = steps
        self.denoiser.total_steps = steps * 2 if self.second_order else steps
        state.sampling_steps, state.sampling_step = steps, 0
        try:
            return func()
        except InterruptedException:
            return self.last_latent

    def callback_state(self, i: int) -> None:
        state.sampling_step = i

    def initialize(self, p) -> None:
        self.denoiser.p = p
        self.denoiser.step = 0

    def evaluate(self, p, x, sigma, cond, uncond) -> torch.Tensor:
        return self.denoiser(x, torch.full((x.shape[0],), float(sigma)), cond, uncond, p.cfg_scale)


SIGMA_MAX = 14.6


class KDiffusionSampler(Sampler):
    """Sigma-space samplers; the U-Net gets the continuous timestep of each sigma."""

    def sigmas(self, steps: int) -> torch.Tensor:
        return torch.cat([torch.linspace(SIGMA_MAX, 0.03, steps), torch.zeros(1)])

    def model_output(self, x, sigma, cond) -> torch.Tensor:
        c_in = 1 / (sigma ** 2 + 1) ** 0.5
        t = sigma / SIGMA_MAX * 999
        eps = shared.sd_model.apply_model(x * c_in[:, None, None, None], t, cond)
        return x - eps * sigma[:, None, None, None]

    def run(self, p, x, sigmas, cond, uncond) -> torch.Tensor:
        for i in range(len(sigmas) - 1):
            s, s_next = sigmas[i], sigmas[i + 1]
            d = (x - self.evaluate(p, x, s, cond, uncond)) / s
            if self.second_order and s_next > 0:
                x2 = x + d * (s_next - s)
                d2 = (x2 - self.evaluate(p, x2, s_next, cond, uncond)) / s_next
                d = (d + d2) / 2
            x = x + d * (s_next - s)
            self.callback_state(i)
        return x

    def sample(self, p, x, cond, uncond, steps=None) -> torch.Tensor:
        steps = steps or p.steps
        self.initialize(p)
        sigmas = self.sigmas(steps)
        return self.launch_sampling(steps, lambda: self.run(p, x * sigmas[0], sigmas, cond, uncond))

    def sample_img2img(self, p, x, noise, cond, uncond, steps=None) -> torch.Tensor:
        steps, t_enc = img2img_steps(p, steps)
        self.initialize(p)
        sigmas = self.sigmas(steps)[steps - t_enc - 1:]
        return self.launch_sampling(t_enc + 1, lambda: self.run(p, x + noise * sigmas[0], sigmas, cond, uncond))


class HeunSampler(KDiffusionSampler):
    second_order = True


class DDIMSampler(Sampler):
    """Timestep sampler: the U-Net gets whole-valued float timesteps, and ``params.sigma`` holds them."""

    def timesteps(self, steps: int) -> torch.Tensor:
        return torch.clamp(torch.arange(0, 1000, 1000 // steps) + 1, 0, 999)

    def model_output(self, x, t, cond) -> torch.Tensor:
        return shared.sd_model.apply_model(x, t.float(), cond)

    def run(self, p, x, timesteps, cond, uncond) -> torch.Tensor:
        for i in range(len(timesteps) - 1):
            t = timesteps[len(timesteps) - 1 - i]
            eps = self.evaluate(p, x, t, cond, uncond)
            x = x - 0.1 * eps
            self.callback_state(i)
        return x

    def sample(self, p, x, cond, uncond, steps=None) -> torch.Tensor:
        steps = steps or p.steps
        self.initialize(p)
        return self.launch_sampling(steps, lambda: self.run(p, x, self.timesteps(steps), cond, uncond))

    def sample_img2img(self, p, x, noise, cond, uncond, steps=None) -> torch.Tensor:
        steps, t_enc = img2img_steps(p, steps)
        self.initialize(p)
        timesteps = self.timesteps(steps)[:t_enc]
        return self.launch_sampling(t_enc + 1, lambda: self.run(p, x + noise, timesteps, cond, uncond))


SAMPLERS = {"Euler": KDiffusionSampler, "Heun": HeunSampler, "DDIM": DDIMSampler}


def create_sampler(name: str) -> Sampler:
    return SAMPLERS[name](name)


def img2img_steps(p, steps: int | None) -> tuple[int, int]:
    steps = steps or p.steps
    return steps, int(min(p.denoising_strength, 0.999) * steps)


# -- jobs -----------------------------------------------------------------------------------------------------

class Processed:
    def __init__(self, p, images: list, seed: int, info: str, infotexts: list[str] | None = None) -> None:
        self.images = images
        self.seed = seed
        self.info = info
        self.infotexts = infotexts or [info]
        self.all_seeds = p.all_seeds
        self.extra_generation_params = p.extra_generation_params
        self.token_merging_ratio = p.token_merging_ratio
        self.token_merging_ratio_hr = p.token_merging_ratio_hr

    def js(self) -> str:
        extra = {k: (None if callable(v) else v) for k, v in self.extra_generation_params.items()}
        return json.dumps({"infotexts": self.infotexts, "extra_generation_params": extra, "seed": self.seed,
                           "all_seeds": self.all_seeds})


def create_infotext(p, all_prompts, all_seeds, all_subseeds, comments=None, iteration: int = 0,
                    position_in_batch: int = 0, use_main_prompt: bool = False, index: int | None = None,
                    all_negative_prompts=None) -> str:
    if index is None:
        index = position_in_batch + iteration * p.batch_size
    enable_hr = getattr(p, "enable_hr", False)
    token_merging_ratio = p.get_token_merging_ratio()
    token_merging_ratio_hr = p.get_token_merging_ratio(for_hr=True)
    params = {
        "Steps": p.steps,
        "Sampler": p.sampler_name,
        "CFG scale": p.cfg_scale,
        "Seed": all_seeds[index],
        "Size": f"{p.width}x{p.height}",
        "Denoising strength": p.denoising_strength,
        "Token merging ratio": None if token_merging_ratio == 0 else token_merging_ratio,
        "Token merging ratio hr": None if not enable_hr or token_merging_ratio_hr == 0 else token_merging_ratio_hr,
    }
    for key, value in p.extra_generation_params.items():
        if callable(value):
            value = value(**locals())
        elif isinstance(value, list):
            value = value[index]
        params[key] = value
    negative = f"\nNegative prompt: {p.negative_prompt}" if p.negative_prompt else ""
    return f"{all_prompts[index]}{negative}\n{infotext_utils.join_parameters(params)}"


def fix_seed(p) -> None:
    if p.seed is None or p.seed == -1:
        p.seed = int(torch.randint(0, 2**32 - 1, ()).item())


def current_job():
    """The job being processed (double only)."""
    return current_p


def process_images(p) -> Processed:
    global current_p
    current_p = p
    if p.scripts is not None:
        p.scripts.before_process(p)
    stored = {k: opts.data[k] for k in p.override_settings if k in opts.data}
    try:
        for key, value in p.override_settings.items():
            opts.set(key, value, is_api=True, run_callbacks=False)
        sd_models.reload_model_weights()  # the base model back, should the last job have ended on the refiner
        p.job_token_merging(p.get_token_merging_ratio())
        return process_images_inner(p)
    finally:
        p.job_token_merging(0)
        if p.override_settings_restore_afterwards:
            for key, value in stored.items():
                opts.set(key, value)
        current_p = None


def process_images_inner(p) -> Processed:
    fix_seed(p)
    total = p.n_iter * p.batch_size
    p.all_prompts = [p.prompt] * total
    p.all_negative_prompts = [p.negative_prompt] * total
    p.all_seeds = [p.seed + i for i in range(total)]
    p.all_subseeds = [p.subseed + i for i in range(total)]
    if p.scripts is not None:
        p.scripts.process(p)
    if p.refiner_checkpoint not in (None, "", "None"):
        p.refiner_checkpoint_info = sd_models.get_closet_checkpoint_match(p.refiner_checkpoint)
        if p.refiner_checkpoint_info is None:
            raise Exception(f"Could not find checkpoint with name {p.refiner_checkpoint}")
    p.init(p.all_prompts, p.all_seeds, p.all_subseeds)
    sd_unet.apply_unet()

    images, infotexts = [], []
    p.params_txt = None
    for n in range(p.n_iter):
        p.iteration = n
        if state.interrupted:
            break
        batch = slice(n * p.batch_size, (n + 1) * p.batch_size)
        p.prompts, p.negative_prompts = p.all_prompts[batch], p.all_negative_prompts[batch]
        p.seeds, p.subseeds = p.all_seeds[batch], p.all_subseeds[batch]
        batch_kwargs = dict(batch_number=n, prompts=p.prompts, seeds=p.seeds, subseeds=p.subseeds)
        p.before_batch()
        if p.scripts is not None:
            p.scripts.before_process_batch(p, **batch_kwargs)
            p.scripts.process_batch(p, **batch_kwargs)
        p.setup_conds()
        if n == 0:
            p.params_txt = create_infotext(p, p.all_prompts, p.all_seeds, p.all_subseeds)
        with torch.no_grad():
            samples = p.sample(conditioning=p.c, unconditional_conditioning=p.uc, seeds=p.seeds,
                               subseeds=p.subseeds, subseed_strength=0.0, prompts=p.prompts)
        batch_images = list(samples)
        if p.scripts is not None:
            p.scripts.postprocess_batch(p, batch_images, batch_number=n)
        for i, image in enumerate(batch_images):
            p.batch_index = i
            if p.scripts is not None:
                p.scripts.postprocess_image(p, PostprocessImageArgs(image))
            infotexts.append(create_infotext(p, p.all_prompts, p.all_seeds, p.all_subseeds, iteration=n,
                                             position_in_batch=i))
            images.append(image)
    processed = Processed(p, images, p.all_seeds[0], infotexts[0] if infotexts else "", infotexts)
    if p.scripts is not None:
        p.scripts.postprocess(p, processed)
    return processed


@dataclass
class PostprocessImageArgs:
    image: Any

