"""ComfyUI nodes: a MODEL in, the same model out with token merging on for every sampling run that uses it.

ComfyUI shares one U-Net module among every clone of a model, so nothing is patched when the node runs: the
node returns a clone carrying an outer-sample wrapper (``SamplingWrapper``), and the U-Net is patched when a
sampling run with that clone starts and given back when it ends, on success, error or interrupt
(``tome_core.SamplingRun``). A branch of the workflow that samples the model without the node sees the plain
U-Net. Inside a run, a per-call wrapper tells the engine each U-Net call's progress (from the run's sigmas and
the sampler's per-step reports) and what its batch holds (ComfyUI's cond or uncond and the condition's id, so
that Cache keeps its state per condition however ComfyUI batches or splits the calls).

The inputs are made from the settings table (``tome_core.settings.PARAMS``) and the method table
(``tome_core.methods.METHODS``): a new method or option appears here without another edit. Their tooltips
are the WebUI's hover hints (``javascript/tokenmerge_hints.js``), one text for both hosts.
"""

from __future__ import annotations

import json
import logging
import os
import re
from typing import Any, Callable

import comfy.model_patcher
import comfy.patcher_extension
from comfy.patcher_extension import WrappersMP

from .. import tome_core
from ..tome_core import settings as tm

log = logging.getLogger("tokenmerge")

KEY = "tokenmerge"
"""The key of this pack's wrappers on a model clone."""

CATEGORY = "model_patches/unet"

RECOMMENDED = "Recommended"
"""The simple node's first method: the settings the README recommends for the model's layout."""

_OUTER_SAMPLE_ARGS = ("noise", "latent_image", "sampler", "sigmas", "denoise_mask", "callback", "disable_pbar",
                      "seed")
_STEP_CACHES = ("easycache", "lazycache")
"""Keys of ComfyUI's own step caches' wrappers (EasyCache, LazyCache): set aside in a run of a method that
reuses steps, which would otherwise see only the steps they did not skip."""


def _hints() -> dict[str, str]:
    """The WebUI's hover hints by control label, read from the one file both hosts use."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "javascript",
                        "tokenmerge_hints.js")
    try:
        with open(path, encoding="utf-8") as file:
            text = file.read()
    except OSError:
        return {}
    return {json.loads(f'"{k}"'): json.loads(f'"{v}"')
            for k, v in re.findall(r'^\s*"((?:[^"\\]|\\.)*)":\s*"((?:[^"\\]|\\.)*)",?\s*$', text, re.M)}


HINTS = _hints()


def _tooltip(param: tm.Param) -> str:
    readers = [m.label for m in tome_core.METHODS if param.key in m.reads]
    hint = HINTS.get(param.label, param.label)
    return f"{hint} (read by {' and '.join(readers)} only)" if readers else hint


def widget(param: tm.Param) -> tuple:
    """A ComfyUI input for ``param``: its type, default, bounds and tooltip, from the table."""
    extra: dict[str, Any] = {"tooltip": _tooltip(param)}
    if param.kind in (tm.FLOAT, tm.INT):
        extra.update(default=param.default, min=param.low, max=param.high, step=param.step)
        if param.kind == tm.FLOAT:
            extra["round"] = 0.001
        return ("FLOAT" if param.kind == tm.FLOAT else "INT", extra)
    if param.kind == tm.BOOL:
        return ("BOOLEAN", {**extra, "default": param.default})
    choices = list(tm.SWITCH_CHOICES if param.kind == tm.SWITCH else param.choices)
    return (choices, {**extra, "default": param.to_ui(param.default)})


ENGINE_PARAMS: tuple[tm.Param, ...] = tuple(p for p in tm.PARAMS if p.engine)
"""What the advanced node shows: every parameter the engine reads (the WebUI's hires parameters are a second
sampler with its own node here)."""


# -- what a run does ------------------------------------------------------------------------------------------

def _is_builtin_tome(patch: Callable) -> bool:
    """Whether an attn1 patch is ComfyUI's built-in TomePatchModel's (comfy_extras/nodes_tomesd.py)."""
    return (str(getattr(patch, "__module__", "")).endswith("nodes_tomesd")
            and str(getattr(patch, "__qualname__", "")).startswith("TomePatchModel."))


def _set_aside_builtin_tome(model_options: dict) -> bool:
    """Remove TomePatchModel's attn1 patches from a run's (cloned) options; True when there were some."""
    patches = model_options.get("transformer_options", {}).get("patches", {})
    found = False
    for name in ("attn1_patch", "attn1_output_patch"):
        kept = [p for p in patches.get(name, []) if not _is_builtin_tome(p)]
        if len(kept) != len(patches.get(name, [])):
            found = True
            patches[name] = kept  # a new list: the lists are shared with the model's own options
    return found


def _set_aside_step_caches(model_options: dict) -> list[str]:
    """Remove EasyCache's and LazyCache's per-call wrappers from a run's (cloned) options; the names found."""
    wrappers = model_options.get("transformer_options", {}).get("wrappers", {})
    found = set()
    for wrapper_type, by_key in wrappers.items():
        if wrapper_type == WrappersMP.OUTER_SAMPLE:
            continue  # already running around this run; without the others it skips nothing
        for key in _STEP_CACHES:
            if by_key.pop(key, None):
                found.add(key)
    return sorted(found)


def _call_rows(transformer_options: dict) -> tuple | None:
    """What a U-Net call's batch holds, one name per equal part: ComfyUI's cond (0) or uncond (1) with the
    condition's id; None where ComfyUI did not say."""
    which, ids = transformer_options.get("cond_or_uncond"), transformer_options.get("uuids")
    if not which or not ids or len(which) != len(ids):
        return None
    return tuple((int(w), str(i)) for w, i in zip(which, ids))


class SamplingWrapper:
    """The outer-sample wrapper a node's model clone carries: one sampling run with ``settings``."""

    def __init__(self, settings: tm.TokenMergeSettings) -> None:
        self.settings = settings

    def __call__(self, executor, *args: Any, **kwargs: Any) -> Any:
        bound = {**dict(zip(_OUTER_SAMPLE_ARGS, args)), **kwargs}
        guider = executor.class_obj
        unet = guider.model_patcher.model.diffusion_model
        settings = self.settings
        try:
            options = settings.engine_options(hires=False, seed=bound.get("seed"))
            run = tome_core.SamplingRun(unet, options, bound["sigmas"].detach().float().cpu().tolist())
            run.__enter__()
        except (TypeError, ValueError) as error:
            log.warning("[ToMe] skipped, this sampling run is unmerged: %s", error)
            return executor(*args, **kwargs)
        own_options = guider.model_options
        try:
            guider.model_options = comfy.model_patcher.create_model_options_clone(own_options)
            if _set_aside_builtin_tome(guider.model_options):
                log.info("[ToMe] ComfyUI's TomePatchModel is set aside for this sampling run: Token Merging "
                         "(%s) applies", settings.method)
            if tome_core.method_named(settings.method).reuses_steps:
                for name in _set_aside_step_caches(guider.model_options):
                    log.info("[ToMe] %s is set aside for this sampling run: Cache reuses steps itself", name)
            comfy.patcher_extension.add_wrapper_with_key(WrappersMP.APPLY_MODEL, KEY, _CallWrapper(run),
                                                         guider.model_options, is_model_options=True)
            reporter = _StepReporter(run, bound.get("callback"))
            args = list(args)
            if len(args) > _OUTER_SAMPLE_ARGS.index("callback"):  # positional, as ComfyUI passes them and the
                args[_OUTER_SAMPLE_ARGS.index("callback")] = reporter  # other wrappers read them
            else:
                kwargs["callback"] = reporter
            return executor(*args, **kwargs)
        finally:
            guider.model_options = own_options
            _report_foreign_calls(tome_core.get_patch(unet))
            run.__exit__(None, None, None)


def _report_foreign_calls(patch: Any) -> None:
    """One console line where other code kept some block calls from merging (an attn1 replacement, attention
    on a part of the batch): the picture is right, those calls ran exact attention."""
    if patch is None:
        return
    if patch.unused_plans:
        log.info("[ToMe] %d block calls ran without merging: another node replaced or reshaped their "
                 "self-attention (an attn1 replacement ...), so those calls computed exact attention",
                 patch.unused_plans)
    elif patch.unmerged_calls:
        log.info("[ToMe] %d extra self-attention calls by another node (on a part of the batch or on tiled "
                 "tokens) ran exact attention; the ordinary calls were merged", patch.unmerged_calls)


class _CallWrapper:
    """Around every ``apply_model`` of a run: tells the run the call's sigma and what its batch holds."""

    def __init__(self, run: tome_core.SamplingRun) -> None:
        self.run = run

    def __call__(self, executor, x, t, *args: Any, **kwargs: Any) -> Any:
        options = args[3] if len(args) > 3 else kwargs.get("transformer_options", {})
        sigma = float(t.reshape(-1)[0]) if hasattr(t, "reshape") and t.numel() else None
        self.run.before_call(sigma, _call_rows(options if isinstance(options, dict) else {}))
        return executor(x, t, *args, **kwargs)


class _StepReporter:
    """The sampler's per-step callback, reporting each step to the run first."""

    def __init__(self, run: tome_core.SamplingRun, callback: Callable | None) -> None:
        self.run, self.callback = run, callback

    def __call__(self, step: int, *args: Any, **kwargs: Any) -> Any:
        self.run.step_reported(step)
        if self.callback is not None:
            return self.callback(step, *args, **kwargs)
        return None


# -- the nodes ------------------------------------------------------------------------------------------------

def with_token_merging(model: Any, settings: tm.TokenMergeSettings, recommended: bool = False) -> Any:
    """A clone of ``model`` (a ComfyUI ModelPatcher) whose sampling runs merge with ``settings`` (with
    ``recommended``, the README's settings for the model's layout at ``settings.ratio``); ``model`` itself where
    the settings cannot apply to it (one console line says why)."""
    unet = model.model.diffusion_model
    try:
        if recommended:  # the clone's runs sample this U-Net: its layout is known now
            settings = tm.TokenMergeSettings(enabled=True, ratio=settings.ratio,
                                             **tome_core.RECOMMENDED[tome_core.model_layout(unet)])
        blocks = tome_core.check_patch(unet, **settings.engine_options(hires=False, seed=0))
    except (TypeError, ValueError) as error:
        log.warning("[ToMe] the model is passed through unmerged: %s", error)
        return model
    if not blocks:
        levels = sorted({lv for _, _, lv in tome_core.patch.transformer_levels(unet)})
        log.warning("[ToMe] the model is passed through unmerged: Merge levels %s select none of its attention "
                    "levels (max downsample %s)", settings.max_downsample, ", ".join(str(2 ** lv) for lv in levels))
        return model
    clone = model.clone()
    if clone.get_wrappers(WrappersMP.OUTER_SAMPLE, KEY):
        log.info("[ToMe] an earlier Token Merging node on this model is replaced by this one")
        clone.remove_wrappers_with_key(WrappersMP.OUTER_SAMPLE, KEY)
    clone.add_wrapper_with_key(WrappersMP.OUTER_SAMPLE, KEY, SamplingWrapper(settings))
    return clone


class _ModelPatchNode:
    """What both nodes are to ComfyUI: a MODEL in, one out, listed with its model patches."""

    CATEGORY = CATEGORY
    RETURN_TYPES = ("MODEL",)
    FUNCTION = "patch"
    MODEL_INPUT = ("MODEL", {"tooltip": "The model to sample with token merging."})


class TokenMerging(_ModelPatchNode):
    """The simple form: a method (or the settings recommended for the model) and a ratio."""

    DESCRIPTION = ("Token merging for every sampling run with this model: faster and lighter at high resolutions. "
                   "Recommended picks the settings measured best for the model: ToDo factor 2 for SD 1.x and 2.x, "
                   "Cache for SDXL.")

    @classmethod
    def INPUT_TYPES(cls) -> dict:
        method = tm.PARAM["method"]
        return {"required": {
            "model": cls.MODEL_INPUT,
            "method": ([RECOMMENDED, *method.choices], {
                "default": RECOMMENDED,
                "tooltip": f"{RECOMMENDED}: ToDo factor 2 for SD 1.x and 2.x, Cache for SDXL. {_tooltip(method)}"}),
            "ratio": widget(tm.PARAM["ratio"]),
        }}

    def patch(self, model: Any, method: str, ratio: float) -> tuple:
        recommended = method == RECOMMENDED
        settings = tm.TokenMergeSettings(enabled=True, ratio=ratio, method="tome" if recommended else method)
        return (with_token_merging(model, settings, recommended),)


class TokenMergingAdvanced(_ModelPatchNode):
    """Every option of every method (each tooltip says which method reads it)."""

    DESCRIPTION = ("Token merging for every sampling run with this model, with every option of every method: "
                   "ToMe, ToDo, Local, Stack and Cache.")

    @classmethod
    def INPUT_TYPES(cls) -> dict:
        return {"required": {"model": cls.MODEL_INPUT, **{p.key: widget(p) for p in ENGINE_PARAMS}}}

    def patch(self, model: Any, **values: Any) -> tuple:
        settings = tm.TokenMergeSettings(enabled=True, **values)
        return (with_token_merging(model, settings),)


NODE_CLASS_MAPPINGS = {"TokenMerging": TokenMerging, "TokenMergingAdvanced": TokenMergingAdvanced}
NODE_DISPLAY_NAME_MAPPINGS = {"TokenMerging": "Token Merging (ToMe)",
                              "TokenMergingAdvanced": "Token Merging (ToMe, advanced)"}
