"""What differs between the webuis the ToMe extension runs in, each host's answer in one place.

- **AUTOMATIC1111 webui** (v1.10.x): ``shared.sd_model`` is an ldm/sgm model; its U-Net is
  ``sd_model.model.diffusion_model``. An ``sd_unet`` alternative (TensorRT) can run instead of its blocks.
- **Forge** (f2.x): ``shared.sd_model`` is a ``backend.diffusion_engine`` object with no ``.model``; its
  U-Net is ``sd_model.forge_objects.unet.model.diffusion_model`` (a ``backend.nn.unet`` U-Net behind a
  ``UnetPatcher``). Forge rebuilds ``forge_objects`` from a clean copy for every sampling pass, but every
  copy shares the one U-Net module tree, so forward hooks on it (ours) stay until removed and compose with
  the patcher's own patch points (FreeU, HRFix, PAG, SAG, LoRA): those run inside the blocks we hook, and
  our attention hooks merge whatever key/value source Forge's patches hand to attention.

Everything else the extension uses (Script hooks, the built-in token-merging settings, infotext, X/Y/Z
plot, the API) is the same in both. This file holds no state: the webui also loads it as a script module.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from modules import sd_unet


class Host:
    """A webui's layout of ``shared.sd_model``."""

    name = ""
    unet_modules: tuple[str, ...] = ()  # modules whose U-Net classes ToMe knows

    def unet(self, model: Any) -> nn.Module | None:
        """The model's U-Net module tree, or None when the model has none where this host keeps it."""
        raise NotImplementedError

    def unsupported_reason(self, model: Any) -> str | None:
        """Why ToMe cannot patch ``model`` here (a line for the console), or None when it can."""
        if model is None:
            return "no model is loaded"
        if getattr(model, "is_sd3", False):
            return "SD3 has no U-Net (it is an MMDiT)"
        if getattr(sd_unet, "current_unet", None) is not None:
            return "an alternative U-Net (SD Unet setting, e.g. TensorRT) runs instead of the model's own blocks"
        unet = self.unet(model)
        if unet is None:
            return f"{type(model).__name__} has no U-Net where {self.name} keeps it"
        module = type(unet).__module__
        if not any(module == known or module.startswith(known + ".") for known in self.unet_modules):
            return (f"{type(model).__name__}'s denoiser ({module}.{type(unet).__name__}) is not a U-Net with "
                    f"transformer blocks (Flux, SD3 and other transformer-only models have none to merge)")
        return None


class A1111(Host):
    name = "the AUTOMATIC1111 webui"
    unet_modules = ("ldm", "sgm")

    def unet(self, model: Any) -> nn.Module | None:
        unet = getattr(getattr(model, "model", None), "diffusion_model", None)
        return unet if isinstance(unet, nn.Module) else None


class Forge(Host):
    name = "Forge"
    unet_modules = ("backend.nn.unet",)

    def unet(self, model: Any) -> nn.Module | None:
        patcher = getattr(getattr(model, "forge_objects", None), "unet", None)
        unet = getattr(getattr(patcher, "model", None), "diffusion_model", None)
        return unet if isinstance(unet, nn.Module) else None


A1111_HOST, FORGE_HOST = A1111(), Forge()


def host_of(model: Any) -> Host:
    """The host whose layout ``model`` has: Forge's models carry ``forge_objects``."""
    return FORGE_HOST if hasattr(model, "forge_objects") else A1111_HOST
