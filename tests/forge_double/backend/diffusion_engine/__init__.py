"""Forge's model objects (``backend.diffusion_engine``): ``shared.sd_model`` is an engine with no ``.model``;
its U-Net is ``forge_objects.unet`` (a ``UnetPatcher``), reset per sampling pass from
``forge_objects_after_applying_lora``."""

from __future__ import annotations

from typing import Any


class ForgeObjects:
    def __init__(self, unet: Any, clip: Any = None, vae: Any = None, clipvision: Any = None) -> None:
        self.unet, self.clip, self.vae, self.clipvision = unet, clip, vae, clipvision

    def shallow_copy(self) -> "ForgeObjects":
        return ForgeObjects(self.unet, self.clip, self.vae, self.clipvision)


class ForgeDiffusionEngine:
    is_sd1 = is_sd2 = is_sdxl = is_sd3 = False

    def __init__(self, unet: Any) -> None:
        self.forge_objects = ForgeObjects(unet)
        self.forge_objects_original = self.forge_objects.shallow_copy()
        self.forge_objects_after_applying_lora = self.forge_objects.shallow_copy()


class StableDiffusion(ForgeDiffusionEngine):  # backend.diffusion_engine.sd15
    is_sd1 = True


class StableDiffusionXL(ForgeDiffusionEngine):  # backend.diffusion_engine.sdxl
    is_sdxl = True


class Flux(ForgeDiffusionEngine):  # backend.diffusion_engine.flux: a transformer, no U-Net blocks
    pass
