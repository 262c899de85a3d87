"""What differs between the webuis the ToMe extension runs in, each host's answer in one place.

- **AUTOMATIC1111 webui** (v1.10.x): ``shared.sd_model`` is an ldm/sgm model; its U-Net is
  ``sd_model.model.diffusion_model``. An ``sd_unet`` alternative (TensorRT) can run instead of its blocks.
- **Forge** (f2.x) and **Forge Neo** (its maintained line, gradio 4.40): ``shared.sd_model`` is a
  ``backend.diffusion_engine`` object with no ``.model``; its U-Net is
  ``sd_model.forge_objects.unet.model.diffusion_model`` (a ``backend.nn.unet`` U-Net behind a
  ``UnetPatcher``). Forge rebuilds ``forge_objects`` from a clean copy for every sampling pass, but every
  copy shares the one U-Net module tree, so forward hooks on it (ours) stay until removed and compose with
  the patcher's own patch points (FreeU, HRFix, PAG, SAG, LoRA): those run inside the blocks we hook, and
  our attention hooks merge whatever key/value source Forge's patches hand to attention. Their built-in token
  merging (``backend.misc.tomesd``, an attn1 patch) reads the A1111 webui's settings.

- **reForge and Forge Classic** (the "old Forge" backend, gradio 3.41): ``shared.sd_model`` is an ldm
  ``LatentDiffusion`` shell that also carries ``forge_objects``; ``sd_model.model.diffusion_model`` and
  ``forge_objects.unet.model.diffusion_model`` are one ``ldm_patched`` U-Net (ComfyUI's, with ldm's class
  names and Forge's patch points). As in Forge, the patcher is copied per pass and the module tree stays, so
  the same forward hooks serve. An ``attn1`` entry in ``patches_replace`` makes a block call attn1's
  projections itself, so no hook on attn1 runs there: that block is computed whole (the engine counts it).

Everything else the extension uses (Script hooks, the built-in token-merging settings, infotext, X/Y/Z
plot, the API) is the same in those.

- **SD.Next** (vladmandic/sdnext): ``shared.sd_model`` is a diffusers pipeline; its U-Net is
  ``sd_model.unet`` (a diffusers ``UNet2DConditionModel``), called once per scheduler timestep with the CFG
  batch. Its Script API differs where ToMe is applied: ``process_before_every_sampling``, ``before_hr`` and
  ``on_cfg_denoiser`` are never called, nothing runs between the base and the hires pass (an img2img
  pipeline built on the same U-Net), ``p.is_hr_pass`` is True during the hires pass, and ``postprocess``
  is skipped when sampling failed (``on_after_process`` still runs). Before each pass its own modifiers run:
  its built-in token merging (settings ``token_merging_method`` "None" / "ToMe" / "ToDo", ``tome_ratio``,
  ``todo_ratio``, read from the settings only) and HiDiffusion's reset, which turns every module that has
  a ``_parent`` attribute back into that class (forward hooks, ours, are untouched). Its infotext reserves
  the keys ``ToMe`` and ``ToDo``. Its page has ``InputAccordion`` (``modules.ui_components``, marked unused)
  but not the page script that turns its value on and off, and its paste takes a plain value for a field
  name and calls ``.lower()`` on a function.

Each webui is an entry of ``HOSTS`` (a ``Host``): adding one is adding an entry. This file holds no state:
the webui also loads it as a script module.
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any, Iterable

from torch import nn

from modules import sd_unet
from tome_core.families import family_of


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
    """A webui: where its ``shared.sd_model`` keeps the U-Net, and what it does differently for the extension.

    Attributes:
        name: the webui's name, for console lines.
        unet_modules: modules whose U-Net classes ToMe knows here.
        calls_pass_hooks: the webui calls ``process_before_every_sampling`` before each sampling pass (base
            and hires fix); where it does not, the extension follows the passes from the U-Net's own calls
            (``scripts/tokenmerge_passes.py``) through ``is_hires_pass`` and ``pass_length``.
        links_input_accordion: the page script turns an ``InputAccordion``'s value on and off with it.
        paste_takes_updates: a paste field's function must return a gradio update, not a plain value.
        skips_postprocess_on_failure: a job whose sampling failed gets no ``postprocess`` call; the webui's
            ``script_callbacks.on_after_process`` runs after every job instead.
    """

    name = ""
    unet_modules: tuple[str, ...] = ()
    calls_pass_hooks = True
    links_input_accordion = True
    paste_takes_updates = False
    skips_postprocess_on_failure = False

    def recognises(self, model: Any) -> bool:
        """Whether this process is this webui, given its current model (None before one is loaded)."""
        raise NotImplementedError

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
            if family_of(unet) is None:
                return (f"{denoiser} is not a U-Net with transformer blocks (Flux, SD3 and other "
                        f"transformer-only models have none to merge)")
            return (f"{denoiser} is a U-Net class ToMe does not know in {self.name} (known: "
                    f"{', '.join(self.unet_modules)}), so it is left unpatched")
        return None

    def take_over_token_merging(self, p: Any, opts: Any) -> list[str]:
        """Turn the webui's own token merging off for job ``p``, so that it never stacks with ToMe; what to
        tell the user (console lines, none when it was off)."""
        return []

    def own_step_cache(self, p: Any, opts: Any) -> str | None:
        """The webui's own step cache that job ``p`` runs with (its name and where it is set, for a console
        line), or None. A Cache job is refused beside one: two caches skipping steps would each reuse work the
        other never did."""
        return None

    def loaded_weights(self, model: Any) -> Any:
        """What tells the weights in ``model``'s modules apart: it changes when the webui loads other weights
        into the same modules mid-pass (a refiner sharing the base model's config), so that what the patch
        kept from the old ones is forgotten. The checkpoint's file here."""
        info = getattr(model, "sd_checkpoint_info", None)
        return getattr(info, "filename", info)

    def unpatched_refiner(self, p: Any, unet: nn.Module | None) -> str | None:
        """Why the refiner pass of job ``p`` will run a U-Net other than ``unet`` that the extension does not
        patch (a line for the console), or None: no such refiner, or one the extension follows (the webuis
        that switch models within a pass, ``SamplingPass.follow_model``)."""
        return None

    def is_hires_pass(self, p: Any) -> bool:
        """Where ``calls_pass_hooks`` is False: whether the pass under way is the hires-fix pass."""
        return bool(getattr(p, "is_hr_pass", False))

    def pass_length(self, model: Any) -> int | None:
        """Where ``calls_pass_hooks`` is False: U-Net calls of the pass under way, or None when unknown."""
        return None

    def complete_pasted(self, infotext: str, params: dict, keys: Iterable[str]) -> None:
        """Add to ``params`` (the host's parse of a pasted ``infotext``) the entries of ``keys`` its parser
        missed; the webuis that parse every key leave it as it is."""


class A1111(Host):
    name = "the AUTOMATIC1111 webui"
    unet_modules = ("ldm", "sgm")
    # The built-in token merging: its settings, and the processing object's attributes the webui copies
    # them into before sampling.
    builtin_ratio_settings = ("token_merging_ratio", "token_merging_ratio_hr", "token_merging_ratio_img2img")
    builtin_ratio_attributes = ("token_merging_ratio", "token_merging_ratio_hr")

    def recognises(self, model: Any) -> bool:
        return True  # the webui the others are variants of: whatever no other entry claims

    def unet(self, model: Any) -> nn.Module | None:
        unet = getattr(getattr(model, "model", None), "diffusion_model", None)
        return unet if isinstance(unet, nn.Module) else None

    def take_over_token_merging(self, p: Any, opts: Any) -> list[str]:
        """Zero the built-in ratios through override_settings, which the webui applies after
        ``before_process`` and restores afterwards, and the ratios already copied onto ``p``."""
        notes = []
        overrides = dict(getattr(p, "override_settings", None) or {})
        active = {key: overrides.get(key, getattr(opts, key, 0.0)) for key in self.builtin_ratio_settings}
        active = {key: value for key, value in active.items() if value}
        for attribute in self.builtin_ratio_attributes:
            if getattr(p, attribute, 0):
                active[f"p.{attribute}"] = getattr(p, attribute)
                setattr(p, attribute, 0)
        if active:
            listed = ", ".join(f"{key}={value}" for key, value in active.items())
            notes.append(f"the webui's built-in token merging ({listed}) is off for this job; the ToMe accordion "
                         f"applies")
        if getattr(p, "override_settings_restore_afterwards", True):
            zeroed = self.builtin_ratio_settings
        else:
            # This request keeps its setting changes: zero only what is on, so that no setting changes
            # needlessly, and say that those stay at 0.
            zeroed = tuple(key for key in self.builtin_ratio_settings if key in active)
            if zeroed:
                notes.append(f"override_settings_restore_afterwards is off for this request, so "
                             f"{', '.join(zeroed)} stay 0 after it")
        # A new dict: XYZ plot cells share the old one.
        p.override_settings = {**overrides, **{key: 0.0 for key in zeroed}}
        return notes


class Forge(A1111):
    """Forge and Forge Neo: the U-Net behind ``forge_objects``, from ``backend.nn.unet``; the built-in token
    merging as in the A1111 webui (the same settings, applied by ``backend.misc.tomesd``)."""

    name = "Forge"
    unet_modules = ("backend.nn.unet",)

    def recognises(self, model: Any) -> bool:
        return hasattr(model, "forge_objects")

    def unet(self, model: Any) -> nn.Module | None:
        patcher = getattr(getattr(model, "forge_objects", None), "unet", None)
        unet = getattr(getattr(patcher, "model", None), "diffusion_model", None)
        return unet if isinstance(unet, nn.Module) else None

    def loaded_weights(self, model: Any) -> Any:
        # Forge Neo's refiner with 'Reload "state_dict" only' (refiner_fast_sd) loads the refiner's weights into
        # the base model's U-Net and leaves sd_checkpoint_info as it was; the base checkpoint's file waits in
        # sd_samplers_common.ORIGINAL_CHECKPOINT meanwhile (None otherwise, and in Forge, which has no such name).
        common = sys.modules.get("modules.sd_samplers_common")
        return super().loaded_weights(model), getattr(common, "ORIGINAL_CHECKPOINT", None)


class ForgeClassicFamily(Forge):
    """reForge and Forge Classic: the U-Net behind ``forge_objects`` as in Forge, from ``ldm_patched`` (and
    their model is also an ldm ``LatentDiffusion``)."""

    name = "reForge / Forge Classic"
    unet_modules = ("ldm_patched.ldm",)

    def recognises(self, model: Any) -> bool:
        unet = super().unet(model) if super().recognises(model) else None
        return unet is not None and type(unet).__module__.startswith("ldm_patched.")


class SDNext(Host):
    name = "SD.Next"
    unet_modules = ("diffusers",)
    calls_pass_hooks = False
    links_input_accordion = False
    paste_takes_updates = True
    skips_postprocess_on_failure = True
    # SD.Next's own token merging: the method setting, and the ratio setting each method reads.
    builtin_method_setting = "token_merging_method"
    builtin_ratio_settings = {"ToMe": "tome_ratio", "ToDo": "todo_ratio"}

    def recognises(self, model: Any) -> bool:
        # The webui whose ``modules.scripts`` re-exports ``modules.scripts_manager``.
        return "modules.scripts_manager" in sys.modules

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

    def pass_length(self, model: Any) -> int | None:
        """The running pipeline's ``num_timesteps`` (one U-Net call per scheduler timestep, set before its
        loop), or None when the pipeline does not tell."""
        for owner in (model, getattr(model, "pipe", None)):
            total = getattr(owner, "_num_timesteps", None)
            if isinstance(total, int) and not isinstance(total, bool) and total > 0:
                return total
        return None

    def own_step_cache(self, p: Any, opts: Any) -> str | None:
        """DeepCache, SD.Next's step cache for U-Nets: set up by the "deep-cache" model compile backend, which
        leaves its worker in ``modules.sd_models_compile`` and enables it before every pass."""
        compiled = sys.modules.get("modules.sd_models_compile")
        if getattr(compiled, "deepcache_worker", None) is None:
            return None
        return "SD.Next's DeepCache (Settings, Compute: model compile backend deep-cache)"

    def unpatched_refiner(self, p: Any, unet: nn.Module | None) -> str | None:
        """SD.Next's refiner (``shared.sd_refiner``, the "Refiner model" setting) is a pipeline of its own,
        called after the base (and hires) steps when hires fix is on with refiner steps and a refiner start
        inside (0, 1) (SD.Next's ``is_refiner_enabled``); no U-Net call of the base pipeline comes between."""
        refiner = getattr(sys.modules.get("modules.shared"), "sd_refiner", None)
        runs = (refiner is not None and bool(getattr(p, "enable_hr", False))
                and (getattr(p, "refiner_steps", 0) or 0) > 0 and 0 < (getattr(p, "refiner_start", 0) or 0) < 1)
        if not runs or self.unet(refiner) is unet:
            return None
        return "SD.Next runs its refiner as a pipeline of its own, which ToMe does not patch"

    def complete_pasted(self, infotext: str, params: dict, keys: Iterable[str]) -> None:
        """SD.Next's parser reads only keys of letters, digits, "_" and spaces, so "ToMe merge cross-attention"
        and "ToMe re-plan every" never reach the paste fields: those are found in the text itself."""
        for key in keys:
            if key in params:
                continue
            found = re.search(rf'(?:^|[,\n])\s*{re.escape(key)}:\s*("(?:\\.|[^"\\])*"|[^,\n]*)', infotext)
            if found:
                value = found.group(1).strip()
                if value.startswith('"'):
                    try:
                        value = json.loads(value)
                    except ValueError:
                        continue
                params[key] = value

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

    def take_over_token_merging(self, p: Any, opts: Any) -> list[str]:
        """The ratio setting of the active method at 0, through override_settings, which SD.Next applies
        after ``before_process`` and restores after the request (its X/Y/Z grid, whose cells keep their
        settings, restores the ratios after the grid). The request's own ``token_merging_method`` /
        ``tome_ratio`` / ``todo_ratio`` fields only reach SD.Next's infotext (its patch reads the settings
        alone): they are cleared, so that no ``ToMe``/``ToDo`` entry claims a merge."""
        notes = []
        active = self.active_builtin_token_merging(p, opts)
        fields = (self.builtin_method_setting, *self.builtin_ratio_settings.values())
        requested = {key: getattr(p, key) for key in fields if getattr(p, key, None) is not None}
        for key in requested:
            setattr(p, key, None)
        if active or requested:
            listed = ", ".join(f"{key}={value}" for key, value in {**active, **requested}.items())
            notes.append(f"SD.Next's built-in token merging ({listed}) is off for this job; the ToMe accordion "
                         f"applies")
        if not active:
            return notes
        ratio_key = self.builtin_ratio_settings[active[self.builtin_method_setting]]
        if not getattr(p, "override_settings_restore_afterwards", True) and not getattr(p, "xyz", False):
            notes.append(f"override_settings_restore_afterwards is off for this request, so {ratio_key} stays 0 "
                         f"after it")
        # A new dict: X/Y/Z grid cells may share the old one.
        p.override_settings = {**(getattr(p, "override_settings", None) or {}), ratio_key: 0.0}
        return notes


# Most specific first: the first that recognises the process is its host.
HOSTS: tuple[Host, ...] = (SDNext(), ForgeClassicFamily(), Forge(), A1111())


def host_of(model: Any) -> Host:
    """The webui this process runs, given its current model (``shared.sd_model``), or None where no model is
    at hand (the page, the callbacks): then the host is known as far as the webui's modules tell, and its page
    facts are those of every host told apart only by the model (the A1111 webui and the Forge family)."""
    return next(host for host in HOSTS if host.recognises(model))
