"""What differs between the webuis the ToMe extension runs in, each host's answer in one place.

- **AUTOMATIC1111 webui** (v1.10.x): ``shared.sd_model`` is an ldm/sgm model; its U-Net is
  ``sd_model.model.diffusion_model``. An ``sd_unet`` alternative (TensorRT) can run instead of its blocks.
- **Forge** (f2.x): ``shared.sd_model`` is a ``backend.diffusion_engine`` object with no ``.model``; its
  U-Net is ``sd_model.forge_objects.unet.model.diffusion_model`` (a ``backend.nn.unet`` U-Net behind a
  ``UnetPatcher``). Forge rebuilds ``forge_objects`` from a clean copy for every sampling pass, but every
  copy shares the one U-Net module tree, so forward hooks on it (ours) stay until removed and compose with
  the patcher's own patch points (FreeU, HRFix, PAG, SAG, LoRA): those run inside the blocks we hook, and
  our attention hooks merge whatever key/value source Forge's patches hand to attention.

- **reForge and Forge Classic** (the "old Forge" backend, gradio 3.41): ``shared.sd_model`` is an ldm
  ``LatentDiffusion`` shell that also carries ``forge_objects``; ``sd_model.model.diffusion_model`` and
  ``forge_objects.unet.model.diffusion_model`` are one ``ldm_patched`` U-Net (ComfyUI's, with ldm's class
  names and Forge's patch points). As in Forge, the patcher is copied per pass and the module tree stays, so
  the same forward hooks serve. An ``attn1`` entry in ``patches_replace`` makes a block call attn1's
  projections itself, so no hook on attn1 runs there: that block is computed whole (the engine counts it).

Everything else the extension uses (Script hooks, the built-in token-merging settings, infotext, X/Y/Z
plot, the API) is the same in those. This file holds no state: the webui also loads it as a script module.

- **SD.Next** (vladmandic/sdnext): ``shared.sd_model`` is a diffusers pipeline; its U-Net is
  ``sd_model.unet`` (a diffusers ``UNet2DConditionModel``), called once per scheduler timestep with the CFG
  batch. Its Script API differs where ToMe is applied: ``process_before_every_sampling``, ``before_hr`` and
  ``on_cfg_denoiser`` are never called, nothing runs between the base and the hires pass (an img2img
  pipeline built on the same U-Net), ``p.is_hr_pass`` is True during the hires pass, and ``postprocess``
  is skipped when sampling failed (``on_after_process`` still runs). Before each pass its own modifiers run:
  its built-in token merging (settings ``token_merging_method`` "None" / "ToMe" / "ToDo", ``tome_ratio``,
  ``todo_ratio``, read from the settings only) and HiDiffusion's reset, which turns every module that has
  a ``_parent`` attribute back into that class (forward hooks, ours, are untouched). Its infotext reserves
  the keys ``ToMe`` and ``ToDo``.
"""

from __future__ import annotations

import sys
from typing import Any

from torch import nn

from modules import sd_unet


# Where the A1111 webui's built-in Hypertile (extensions-builtin/hypertile) keeps a layer's settings: it wraps
# the layer's forward and tiles whatever sequence it is handed as if it were the image's token grid.
HYPERTILE_PARAMS = "__webui_hypertile_params"


def set_aside_hypertile(attention_modules: list[nn.Module]) -> list[Any]:
    """Turn the built-in Hypertile off on these self-attention layers, where ToMe hands it merged tokens
    (it would cut them into tiles of the wrong grid; with ToDo, its tiled queries would meet whole keys).
    Returns the settings turned off, for ``restore_hypertile``; Hypertile's own hooks set them afresh for
    every job and hires pass anyway."""
    turned_off = []
    for module in attention_modules:
        params = getattr(module, HYPERTILE_PARAMS, None)
        if params is not None and getattr(params, "enabled", False):
            params.enabled = False
            turned_off.append(params)
    return turned_off


def restore_hypertile(turned_off: list[Any]) -> None:
    for params in turned_off:
        params.enabled = True


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
            denoiser = f"{type(model).__name__}'s denoiser ({module}.{type(unet).__name__})"
            if not any(type(m).__name__ == "SpatialTransformer" for m in unet.modules()):
                return (f"{denoiser} is not a U-Net with transformer blocks (Flux, SD3 and other "
                        f"transformer-only models have none to merge)")
            return (f"{denoiser} is a U-Net class ToMe does not know in {self.name} (known: "
                    f"{', '.join(self.unet_modules)}), so it is left unpatched")
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


class ForgeClassicFamily(Forge):
    """reForge and Forge Classic: the U-Net behind ``forge_objects`` as in Forge, from ``ldm_patched``."""

    name = "reForge / Forge Classic"
    unet_modules = ("ldm_patched.ldm",)


class SDNext(Host):
    name = "SD.Next"
    unet_modules = ("diffusers",)
    # SD.Next's own token merging: the method setting, and the ratio setting each method reads.
    builtin_method_setting = "token_merging_method"
    builtin_ratio_settings = {"ToMe": "tome_ratio", "ToDo": "todo_ratio"}

    def unet(self, model: Any) -> nn.Module | None:
        for owner in (model, getattr(model, "pipe", None)):  # SD.Next wraps some pipelines in ``.pipe``
            unet = getattr(owner, "unet", None)
            if isinstance(unet, nn.Module):
                return unet
        return None

    def unsupported_reason(self, model: Any) -> str | None:
        if model is None:
            return "no model is loaded"
        unet = self.unet(model)
        if unet is None:
            denoiser = getattr(model, "transformer", None)
            what = f" (its denoiser is {type(denoiser).__name__}, a transformer)" if denoiser is not None else ""
            return (f"{type(model).__name__} has no U-Net{what}: Flux, SD3 and other transformer-only models "
                    f"have no U-Net blocks to merge")
        module = type(unet).__module__
        if not any(module == known or module.startswith(known + ".") for known in self.unet_modules):
            return (f"{type(model).__name__}'s U-Net {module}.{type(unet).__name__} is not a diffusers U-Net "
                    f"(ONNX, OpenVINO or a quantised replacement), so it is left unpatched")
        return None

    def is_hires_pass(self, p: Any) -> bool:
        return bool(getattr(p, "is_hr_pass", False))

    def pass_length(self, model: Any) -> int | None:
        """U-Net calls of the pass under way: the running pipeline's ``num_timesteps`` (one call per scheduler
        timestep, set before its loop), or None when the pipeline does not tell."""
        for owner in (model, getattr(model, "pipe", None)):
            total = getattr(owner, "_num_timesteps", None)
            if isinstance(total, int) and not isinstance(total, bool) and total > 0:
                return total
        return None

    def active_builtin_token_merging(self, p: Any, opts: Any) -> dict[str, Any]:
        """SD.Next's own token merging this job would apply ({setting: value}), taking the request's
        override_settings into account; empty when it is off."""
        overrides = getattr(p, "override_settings", None) or {}

        def value(key: str) -> Any:
            return overrides.get(key, getattr(opts, key, None))

        method = value(self.builtin_method_setting)
        ratio_key = self.builtin_ratio_settings.get(method)
        if ratio_key is None or not value(ratio_key):
            return {}
        return {self.builtin_method_setting: method, ratio_key: value(ratio_key)}


A1111_HOST, FORGE_HOST, FORGE_CLASSIC_HOST, SDNEXT_HOST = A1111(), Forge(), ForgeClassicFamily(), SDNext()


def page_links_input_accordion() -> bool:
    """Whether the webui's page script turns an ``InputAccordion``'s value on and off with the accordion
    (A1111 and the Forge family). SD.Next has the class (``modules.ui_components``, marked unused) but not the
    page script, so there its value would never change; SD.Next is the webui whose ``modules.scripts``
    re-exports ``modules.scripts_manager``."""
    return "modules.scripts_manager" not in sys.modules


def paste_needs_updates() -> bool:
    """Whether a paste field's function must return a gradio update rather than a plain value: SD.Next's
    paste (``generation_parameters_copypaste.paste_func``) takes a plain value for a field name and calls
    ``.lower()`` on the function, which fails the whole paste."""
    return not page_links_input_accordion()


def is_diffusers_pipeline(model: Any) -> bool:
    """A diffusers pipeline (SD.Next's ``shared.sd_model``): a ``DiffusionPipeline`` subclass, or an object
    with a ``.unet`` or ``.transformer`` module and no ldm ``.model``."""
    if any(cls.__name__ == "DiffusionPipeline" for cls in type(model).__mro__):
        return True
    if hasattr(model, "model") or hasattr(model, "forge_objects"):
        return False
    return any(isinstance(getattr(model, name, None), nn.Module) for name in ("unet", "transformer"))


def host_of(model: Any) -> Host:
    """The host whose layout ``model`` has: Forge's models carry ``forge_objects``; of those, reForge's and
    Forge Classic's U-Net comes from ``ldm_patched`` (and their model is also an ldm ``LatentDiffusion``);
    SD.Next's is a diffusers pipeline."""
    if is_diffusers_pipeline(model):
        return SDNEXT_HOST
    if not hasattr(model, "forge_objects"):
        return A1111_HOST
    unet = FORGE_HOST.unet(model)
    if unet is not None and type(unet).__module__.startswith("ldm_patched."):
        return FORGE_CLASSIC_HOST
    return FORGE_HOST
