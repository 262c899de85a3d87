"""Forge's processing: the A1111 double's jobs, samplers and infotext, with what Forge changes.

- ``shared.sd_model`` runs through ``forge_objects.unet`` (a ``UnetPatcher``). Every sampling pass starts from
  a fresh shallow copy, ``forge_objects = forge_objects_after_applying_lora.shallow_copy()``, so patches set on
  the previous pass's patcher are gone; each batch also starts from ``forge_objects_original``.
- The built-in token merging is applied to that pass's patcher (queries only, ``backend.misc.tomesd``),
  between the reset and ``process_before_every_sampling``; there is no job-wide built-in patch.
- In the hires pass, ``process_before_every_sampling`` runs twice: before the reset (its patcher changes are
  lost) and after it.
- Models are (re)loaded with ``forge_model_reload`` (``sd_models``): at the job's start, at each batch, and
  for the refiner.
"""

from __future__ import annotations

from modules import load_a1111, sd_models, shared

_a1111 = load_a1111("processing")

from modules._a1111_processing import *  # noqa: E402,F401,F403  (what Forge keeps as it is)
from modules._a1111_processing import create_sampler  # noqa: E402


def apply_token_merging(sd_model, ratio: float) -> None:
    """Forge's built-in: on this pass's patcher only, and only when the ratio is above 0."""
    if ratio <= 0:
        return
    from backend.misc.tomesd import TomePatcher

    sd_model.forge_objects.unet = TomePatcher().patch(model=sd_model.forge_objects.unet, ratio=ratio)


def fresh_pass(p, ratio: float) -> None:
    p.sd_model.forge_objects = p.sd_model.forge_objects_after_applying_lora.shallow_copy()
    apply_token_merging(p.sd_model, ratio)


class ForgeJob:
    """What Forge changes in every job, whatever its kind."""

    def before_batch(self) -> None:
        sd_models.forge_model_reload()
        self.sd_model.forge_objects = self.sd_model.forge_objects_original.shallow_copy()
        self.sd_model.forge_objects = self.sd_model.forge_objects_after_applying_lora.shallow_copy()

    def job_token_merging(self, ratio: float) -> None:
        """None for the whole job: Forge applies its built-in per sampling pass (``fresh_pass``)."""


class StableDiffusionProcessingTxt2Img(ForgeJob, _a1111.StableDiffusionProcessingTxt2Img):
    def sample(self, conditioning, unconditional_conditioning, seeds, subseeds, subseed_strength, prompts):
        sampler = create_sampler(self.sampler_name)
        x = self.noise(self.height // 8, self.width // 8)
        fresh_pass(self, self.get_token_merging_ratio())
        if self.scripts is not None:
            self.scripts.process_before_every_sampling(self, x=x, noise=x, c=conditioning,
                                                       uc=unconditional_conditioning)
        samples = sampler.sample(self, x, conditioning, unconditional_conditioning)
        if not self.enable_hr:
            return samples
        return self.sample_hr_pass(samples)

    def sample_hr_pass(self, samples):
        if shared.state.interrupted:
            return samples
        samples, sampler, noise = self.start_hr_pass(samples)
        if self.scripts is not None:
            self.scripts.before_hr(self)
            self.scripts.process_before_every_sampling(self, x=samples, noise=noise, c=self.c, uc=self.uc)
        fresh_pass(self, self.get_token_merging_ratio(for_hr=True))
        if self.scripts is not None:
            self.scripts.process_before_every_sampling(self, x=samples, noise=noise, c=self.c, uc=self.uc)
        samples = sampler.sample_img2img(self, samples, noise, self.c, self.uc,
                                         steps=self.hr_second_pass_steps or self.steps)
        self.is_hr_pass = False
        return samples


class StableDiffusionProcessingImg2Img(ForgeJob, _a1111.StableDiffusionProcessingImg2Img):
    def sample(self, conditioning, unconditional_conditioning, seeds, subseeds, subseed_strength, prompts):
        sampler = create_sampler(self.sampler_name)
        noise = self.noise(*self.init_latent.shape[-2:])
        fresh_pass(self, self.get_token_merging_ratio())
        if self.scripts is not None:
            self.scripts.process_before_every_sampling(self, x=self.init_latent, noise=noise, c=conditioning,
                                                       uc=unconditional_conditioning)
        return sampler.sample_img2img(self, self.init_latent, noise, conditioning, unconditional_conditioning)

