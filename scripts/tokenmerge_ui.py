"""The ToMe accordion of txt2img and img2img: UI, per-pass patching, infotext and paste-back, API arguments.

API: ``"alwayson_scripts": {"tome": {"args": [...]}}`` with the positional values, in this order (the same in
both tabs; img2img ignores the two hires values)::

    enabled, ratio, hr_only, hr_ratio, method, max_downsample, sx, sy, use_rand, merge_crossattn, merge_mlp,
    todo_factor, todo_pool, step_start, step_end, local_replan, size_weighted_keys, cache_interval,
    cache_warmup

(calls with fewer values, made before the last ones existed, keep working: the missing ones take their
defaults). ``method`` is "ToMe", "ToDo", "Local", "Stack" or "Cache" (``tome_core.methods.METHODS``).
``size_weighted_keys`` is "Auto" (or null: on for ToMe, off for Local and Stack), "On"/true or "Off"/false;
until it became "Auto" its default was off, so a call that leaves it out now gets it on with ToMe.

or ``{"args": [{"enabled": true, "ratio": 0.4, ...}]}``: one dict with any of those keys, the rest at their
defaults. Bounds and defaults are in ``tome_core.settings.PARAMS``.
"""

from __future__ import annotations

import os
import weakref
from functools import partial
from typing import Any

import gradio as gr
from torch import nn

from modules import script_callbacks, scripts, shared
from modules.ui_components import InputAccordion

import tome_core
from scripts.tokenmerge_hosts import Host, host_of, restore_hypertile, set_aside_hypertile
from scripts.tokenmerge_passes import UnetCallPasses
from tome_core import settings as tm

LOG_PREFIX = "[ToMe]"
# The advanced panel, row by row.
ADVANCED_ROWS = (("method", "max_downsample"), ("sx", "sy"), ("use_rand", "merge_crossattn", "merge_mlp"),
                 ("todo_factor", "todo_pool"), ("local_replan", "size_weighted_keys"),
                 ("cache_interval", "cache_warmup"), ("step_start", "step_end"))
# Controls one method alone reads, shown only while that method is chosen.
METHOD_CONTROLS = tuple(dict.fromkeys(key for keys in tm.METHOD_KEYS.values() for key in keys))
# Our own entries in p.extra_generation_params (also the ones an earlier XYZ cell may have left there).
OWN_INFOTEXT_KEYS = frozenset(tm.INFOTEXT_KEYS) | {tm.REFINER_INFOTEXT, tm.HYPERTILE_INFOTEXT}
# On the processing object: the sampling pass under way, when ToMe applies to it.
PASS_ATTRIBUTE = "tokenmerge_pass"
# On the processing object: the job's settings, parsed once, in its first hook.
SETTINGS_ATTRIBUTE = "tokenmerge_settings"



class JobState:
    """What this module changed for the job under way, to undo when it ends: the U-Nets it patched (what each
    is patched with is the engine's answer, ``tome_core.get_patch``), the Hypertile layers it set aside, the
    hooks that follow the passes where the host calls none, and what other extensions kept from merging.

    Not just the current model's U-Net: the model can change during a job (refiner, hires checkpoint), and a
    job that fails during sampling leaves its patch on."""

    def __init__(self) -> None:
        self.unets: weakref.WeakSet = weakref.WeakSet()
        self.hypertile_set_aside: list = []
        self.pass_watches: list = []
        # Of the patches removed since the job began: attention calls that ran unmerged because another
        # extension handed them other rows or tokens than the plan's, and block calls whose plan no attention
        # call used.
        self.foreign_calls = {"unmerged_calls": 0, "unused_plans": 0}

    def patch(self, unet: nn.Module, options: dict[str, Any]) -> None:
        """Patch ``unet`` with engine ``options`` (the engine's errors pass through; nothing is patched then)."""
        tome_core.apply_patch(unet, **options)
        self.unets.add(unet)

    def patched_with(self, unet: nn.Module | None, options: dict[str, Any]) -> bool:
        """Whether this job patched ``unet`` and its live patch has ``options``."""
        patch = tome_core.get_patch(unet) if unet is not None and unet in self.unets else None
        return patch is not None and patch.options == tome_core.MergeOptions(**options)

    def patched_unets(self) -> list[nn.Module]:
        return [unet for unet in list(self.unets) if tome_core.is_patched(unet)]

    def remove_all_patches(self) -> None:
        """Restore every U-Net this module patched (and Hypertile where ToMe set it aside)."""
        for unet in list(self.unets):
            patch = tome_core.get_patch(unet)
            if patch is not None:
                for counter in self.foreign_calls:
                    self.foreign_calls[counter] += getattr(patch, counter)
            tome_core.remove_patch(unet)
        self.unets.clear()
        restore_hypertile(self.hypertile_set_aside)
        self.hypertile_set_aside.clear()

    def end(self) -> None:
        """Everything this module added for a job removed: the patches and the pass watches."""
        while self.pass_watches:
            self.pass_watches.pop().remove()
        self.remove_all_patches()

    def begin(self) -> None:
        """A new job: what an earlier one left is removed, and the counts start from zero."""
        self.end()
        self.foreign_calls.update(unmerged_calls=0, unused_plans=0)

    def report_foreign_calls(self, p: Any) -> None:
        """Tell the user, once per job, where other extensions kept ToMe from merging (and reset the counts)."""
        unmerged, unused = self.foreign_calls["unmerged_calls"], self.foreign_calls["unused_plans"]
        self.foreign_calls.update(unmerged_calls=0, unused_plans=0)
        if unused:
            note_once(p, f"{unused} block calls ran without merging: another extension replaced or reshaped "
                         f"their self-attention (an attn1 replacement, HyperTile, ControlNet's reference mode "
                         f"...), so those calls computed exact attention")
        elif unmerged:
            note_once(p, f"{unmerged} extra self-attention calls by another extension (on a part of the batch "
                         f"or on tiled tokens) ran exact attention; the ordinary calls were merged")


JOB = JobState()

def current_host() -> Host:
    """The webui this runs in, with the job's model (see ``tokenmerge_hosts.host_of``)."""
    return host_of(shared.sd_model)


def page_host() -> Host:
    """The webui this runs in, for what its page and callbacks do: known without the model, which the
    A1111 webui's ``shared.sd_model`` would load when read while the UI is built."""
    return host_of(None)


def current_unet() -> tuple[nn.Module | None, str | None]:
    """The U-Net the current model samples with and None, or None and why ToMe cannot patch it."""
    model = shared.sd_model
    host = host_of(model)
    reason = host.unsupported_reason(model)
    return (None, reason) if reason else (host.unet(model), None)


def step_cache_conflict(p: Any, settings: tm.TokenMergeSettings) -> str | None:
    """Why the job's method cannot run here (it reuses steps, and the webui's own step cache is on), or None."""
    method = tome_core.method_named(settings.method)
    cache = current_host().own_step_cache(p, shared.opts) if method.reuses_steps else None
    if cache is None:
        return None
    return f"{method.label} does not run beside {cache}, which skips steps of its own; turn one off"


def batch_seed(p: Any) -> int:
    """The seed of the current batch's first image: the key of the random partition, so that one
    infotext always gives the same image."""
    for seeds in (getattr(p, "seeds", None), getattr(p, "all_seeds", None)):
        if seeds:
            return int(seeds[0])
    return int(getattr(p, "seed", 0) or 0)


def note_once(p: Any, message: str) -> None:
    """Print ``message`` once per job (hooks that run per batch or per pass would repeat it)."""
    printed = getattr(p, "tokenmerge_printed", None)
    if printed is None:
        printed = set()
        p.tokenmerge_printed = printed
    if message not in printed:
        printed.add(message)
        print(f"{LOG_PREFIX} {message}")


class SamplingPass:
    """The ToMe side of one sampling pass: its engine options and the model they were applied to. The webui
    can switch to another model object during the pass (the refiner, when its config differs from the base
    model's) without calling any Script hook; ``follow_model`` patches that one too. A refiner sharing the base
    model's config loads its weights into the same modules (the A1111 WebUI): the patch stays, and forgets what
    it kept from the base weights."""

    def __init__(self, options: dict[str, Any]) -> None:
        self.options = options
        self.model: Any = None
        self.weights: Any = None  # what tells the model's weights apart (Host.loaded_weights)
        self.engine_refused = False
        self.hypertile_set_aside = 0  # Hypertile layers turned off while ToMe merges them

    def patch_current_model(self) -> str | None:
        """Patch the current model's U-Net (and restore any other); None, or what to tell the user about why
        the model runs without ToMe."""
        self.model = shared.sd_model
        self.weights = current_host().loaded_weights(self.model)
        unet, reason = current_unet()
        if reason:
            JOB.remove_all_patches()
            return f"skipped: {reason}"
        if JOB.patched_with(unet, self.options):
            return None
        JOB.remove_all_patches()
        try:
            JOB.patch(unet, self.options)
        except Exception as error:  # the engine refuses what it cannot patch: never fail the generation
            JOB.remove_all_patches()
            self.engine_refused = True
            return f"not applied: {error}; generating without ToMe"
        turned_off = set_aside_hypertile([block.self_attention for block in tome_core.patched_blocks(unet)
                                          if block.self_attention is not None])
        if turned_off:
            JOB.hypertile_set_aside.extend(turned_off)
            self.hypertile_set_aside = len(turned_off)
        return None

    def follow_model(self, p: Any) -> None:
        """Called before every model evaluation: patch a model switched in since the last one."""
        if shared.sd_model is self.model:
            weights = current_host().loaded_weights(self.model)
            if weights != self.weights:  # other weights in the patched modules: nothing kept fits them
                self.weights = weights
                for unet in JOB.patched_unets():
                    tome_core.start_afresh(unet)
            return
        refusal = self.patch_current_model()
        if refusal:
            note_once(p, f"the refiner's steps run without ToMe ({refusal})")
            p.extra_generation_params = {**p.extra_generation_params, tm.REFINER_INFOTEXT: "unmerged"}


EXTENSION_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLAIM_ATTRIBUTE = "tokenmerge_extension_dir"
"""Attribute of the host's ``shared`` module naming the folder of the copy of this extension that runs."""


def claim_extension(here: str = EXTENSION_DIR) -> str | None:
    """Claim this process for the copy of the extension in ``here``; the folder of the copy that claimed it
    first when that is another one (the extension is installed twice: a clone and an "Install from URL"), else
    None. Two copies would each patch every job, and their patches would undo each other's."""
    owner = getattr(shared, CLAIM_ATTRIBUTE, None)
    if owner is not None and owner != here:
        return owner
    setattr(shared, CLAIM_ATTRIBUTE, here)
    return None


def _release_claim() -> None:
    """On "Reload UI" the scripts load afresh: the copy that claimed the process lets it go, so that the one
    still installed claims it then."""
    if getattr(shared, CLAIM_ATTRIBUTE, None) == EXTENSION_DIR:
        delattr(shared, CLAIM_ATTRIBUTE)


OTHER_COPY = claim_extension()
if OTHER_COPY is not None:
    print(f"{LOG_PREFIX} this extension is installed twice, in {OTHER_COPY} and in {EXTENSION_DIR}: the copy in "
          f"{EXTENSION_DIR} steps aside (remove one of the two folders)")


class TokenMergeScript(scripts.Script):
    section = "accordions"

    def title(self) -> str:
        return "ToMe"

    def show(self, is_img2img: bool) -> Any:
        # A second copy of the extension shows nothing, so the host never calls its hooks.
        return scripts.AlwaysVisible if OTHER_COPY is None else False

    # -- UI ----------------------------------------------------------------------------------------------------

    def _control(self, key: str, **overrides: Any) -> gr.components.Component:
        param = tm.PARAM[key]
        common = dict(label=param.label, value=param.to_ui(param.default), elem_id=self.elem_id(key), **overrides)
        if param.kind == tm.BOOL:
            return gr.Checkbox(**common)
        if param.kind in (tm.FLOAT, tm.INT):
            return gr.Slider(minimum=param.low, maximum=param.high, step=param.step, **common)
        return gr.Radio(choices=list(param.choices), **common)

    def ui(self, is_img2img: bool) -> list[gr.components.Component]:
        defaults = tm.DISABLED
        c: dict[str, gr.components.Component] = {}
        linked = page_host().links_input_accordion
        if linked:
            accordion = InputAccordion(defaults.enabled, label=tm.PARAM["enabled"].label,
                                       elem_id=self.elem_id("enabled"))
        else:
            # The page would leave an InputAccordion's value as it is whatever the user does: an accordion
            # with the switch as its first control instead.
            accordion = gr.Accordion(tm.PARAM["enabled"].label, open=False, elem_id=self.elem_id("accordion"))
        with accordion:
            # Not isinstance: Forge's InputAccordion is a function that returns an InputAccordionImpl.
            c["enabled"] = accordion if linked else self._control("enabled")
            c["ratio"] = self._control("ratio")
            note_text = tm.ratio_note(defaults.ratio, defaults.hr_ratio, defaults.sx, defaults.sy)
            note = gr.Markdown(note_text, visible=bool(note_text), elem_id=self.elem_id("ratio_note"))
            with gr.Row(visible=not is_img2img):
                # Hidden in img2img but still built, so that both tabs take the same positional arguments.
                c["hr_only"] = self._control("hr_only", visible=not is_img2img)
                c["hr_ratio"] = self._control("hr_ratio", visible=not is_img2img)
            with gr.Accordion("Advanced", open=False, elem_id=self.elem_id("advanced")):
                for row in ADVANCED_ROWS:
                    with gr.Row():
                        for key in row:
                            if key in METHOD_CONTROLS:
                                c[key] = self._control(key, visible=key in tm.METHOD_KEYS[defaults.method])
                            else:
                                c[key] = self._control(key)

        # A pasted infotext sets the method too, and this event then shows that method's controls.
        c["method"].change(_method_controls_update, inputs=[c["method"]],
                           outputs=[c[key] for key in METHOD_CONTROLS], show_progress="hidden", queue=False)
        note_inputs = [c["ratio"], c["hr_ratio"], c["sx"], c["sy"], c["method"]]
        for component in note_inputs:
            component.change(_ratio_note_update, inputs=note_inputs, outputs=[note], show_progress="hidden",
                             queue=False)

        shown = [key for key in tm.KEYS if not (is_img2img and tm.PARAM[key].txt2img_only)]
        pasted = _pasted_update if page_host().paste_takes_updates else tm.pasted_value
        self.infotext_fields = [(c[key], partial(pasted, key)) for key in shown]
        self.paste_field_names = [tm.PARAM[key].infotext for key in shown if tm.PARAM[key].infotext]
        return [c[key] for key in tm.KEYS]

    # -- generation ---------------------------------------------------------------------------------------------

    def job_settings(self, p: Any, args: tuple) -> tm.TokenMergeSettings:
        """The settings of this job, as ``before_process`` parsed them (parsed here, silently, should a host
        call a later hook of a job without it)."""
        settings = getattr(p, SETTINGS_ATTRIBUTE, None)
        if isinstance(settings, tm.TokenMergeSettings):
            return settings
        return self.parse_job_settings(p, args)

    def parse_job_settings(self, p: Any, args: tuple, *, report: bool = False) -> tm.TokenMergeSettings:
        """The settings of this job: the hook's arguments, then the XYZ cell's overrides. A bad value, or a
        method that cannot run beside the webui's own step cache, turns ToMe off for the job; ``report`` prints
        why."""
        try:
            settings = tm.parse_args(args)
            overrides = getattr(p, tm.OVERRIDES_ATTRIBUTE, None)
            if overrides:
                settings = settings.with_overrides(overrides)
            settings = settings.without_hires() if self.is_img2img else settings
        except (TypeError, ValueError) as error:
            if report:
                print(f"{LOG_PREFIX} {error}; generating without ToMe")
            return tm.DISABLED
        if settings.enabled and (conflict := step_cache_conflict(p, settings)):
            if report:
                print(f"{LOG_PREFIX} skipped: {conflict}")
            return tm.DISABLED
        return settings

    def before_process(self, p: Any, *args: Any) -> None:
        settings = self.parse_job_settings(p, args, report=True)
        setattr(p, SETTINGS_ATTRIBUTE, settings)
        p.tokenmerge_printed = set()
        # postprocess does not run when sampling raised, so the previous job may have left its patch on.
        JOB.begin()
        if settings.enabled and (reason := current_unet()[1]):
            # Say why now, and leave the webui's own token merging as the user set it: turning it off for a job
            # that then skips ToMe would leave the user with no merging at all.
            note_once(p, f"skipped: {reason}")
        elif settings.enabled:
            for note in current_host().take_over_token_merging(p, shared.opts):
                note_once(p, note)

    def process_batch(self, p: Any, *args: Any, **kwargs: Any) -> None:
        settings = self.job_settings(p, args)
        # Runs after the alternative U-Net is chosen and before the first infotext is written.
        if settings.enabled and (reason := current_unet()[1]):
            note_once(p, f"skipped: {reason}")
            settings = tm.DISABLED
        if settings.enabled and settings.hr_only and not getattr(p, "enable_hr", False):
            note_once(p, "'Hires fix only' is on but this job has no hires fix pass: nothing is merged")
            settings = tm.DISABLED
        p.extra_generation_params = {**without_own_infotext(p.extra_generation_params), **settings.to_infotext()}
        host = current_host()
        if not host.calls_pass_hooks:
            # No hook per sampling pass: patch now, and follow the passes from the U-Net's calls.
            JOB.end()
            if settings.enabled and (refusal := host.unpatched_refiner(p, current_unet()[0])):
                note_once(p, f"the refiner's steps run without ToMe ({refusal})")
                p.extra_generation_params = {**p.extra_generation_params, tm.REFINER_INFOTEXT: "unmerged"}
            if settings.enabled:
                JOB.pass_watches.append(UnetCallPasses(
                    host, p, current_unet()[0], model=lambda: shared.sd_model,
                    start_pass=lambda hires: self.patch_pass(p, args, hires, keep_same=True),
                    report_progress=_report_progress, give_up=partial(_stop_following, p),
                    hires_follows=bool(getattr(p, "enable_hr", False)) and not self.is_img2img))
                JOB.pass_watches[-1].start_pass(False)

    def process_before_every_sampling(self, p: Any, *args: Any, **kwargs: Any) -> None:
        self.patch_pass(p, args, bool(getattr(p, "is_hr_pass", False)))

    def patch_pass(self, p: Any, args: tuple, hires: bool, *, keep_same: bool = False) -> None:
        """Patch the current model for one sampling pass (the first, or the hires-fix pass), or leave it
        unpatched when ToMe does not apply to that pass. ``keep_same``: a patch with this pass's options
        stays as it is (a host followed by ``UnetCallPasses``, whose passes no other hook separates)."""
        settings = self.job_settings(p, args)
        if not settings.applies_to_pass(hires):
            setattr(p, PASS_ATTRIBUTE, None)
            JOB.remove_all_patches()
            return
        options = settings.engine_options(hires=hires, seed=batch_seed(p))
        unet = current_unet()[0]
        if keep_same and JOB.patched_with(unet, options):
            return
        setattr(p, PASS_ATTRIBUTE, None)
        sampling_pass = SamplingPass(options)
        refusal = sampling_pass.patch_current_model()
        if refusal is None:
            setattr(p, PASS_ATTRIBUTE, sampling_pass)
            if sampling_pass.hypertile_set_aside:
                note_once(p, f"Hypertile is set aside on the {sampling_pass.hypertile_set_aside} self-attention "
                             f"layers ToMe merges (it would tile merged tokens as if they were the image); it "
                             f"still tiles the other layers")
                p.extra_generation_params = {**p.extra_generation_params,
                                             tm.HYPERTILE_INFOTEXT: "set aside on merged blocks"}
            return
        note_once(p, refusal)
        if sampling_pass.engine_refused:
            p.extra_generation_params = without_own_infotext(p.extra_generation_params)

    def postprocess(self, p: Any, processed: Any, *args: Any) -> None:
        setattr(p, PASS_ATTRIBUTE, None)
        JOB.end()
        JOB.report_foreign_calls(p)


def without_own_infotext(params: dict) -> dict:
    """A copy of ``params`` without our keys. A copy, because XYZ plot cells share one dict and keys an
    earlier cell wrote must neither leak into this cell nor be changed under that cell's results."""
    return {key: value for key, value in params.items() if key not in OWN_INFOTEXT_KEYS}


def _report_progress(calls: int, total: int | None) -> None:
    """A U-Net call's progress in its pass, for the step window of every patch."""
    progress = tm.evaluation_progress(calls, total)
    for unet in JOB.patched_unets():
        tome_core.set_progress(unet, progress)


def _stop_following(p: Any, error: Exception) -> None:
    JOB.remove_all_patches()
    note_once(p, f"stopped following the sampling passes ({error!r}); generating without ToMe")


def _pasted_update(key: str, params: dict) -> Any:
    """``tm.pasted_value`` as a gradio update (None: leave the control as it is)."""
    value = tm.pasted_value(key, params)
    return None if value is None else gr.update(value=value)


def _ratio_note_update(ratio: Any, hr_ratio: Any, sx: Any, sy: Any, method: Any = "ToMe") -> dict:
    text = tm.ratio_note(ratio, hr_ratio, sx, sy, method)
    return gr.update(value=text, visible=bool(text))


def _method_controls_update(method: Any) -> list[dict]:
    """Visibility of ``METHOD_CONTROLS``: those of ``method`` shown, the others hidden (an unknown method,
    which validation refuses at generation time, shows them all)."""
    try:
        wanted = set(tm.METHOD_KEYS[tm.PARAM["method"].normalise(method)])
    except (TypeError, ValueError):
        wanted = set(METHOD_CONTROLS)
    return [gr.update(visible=key in wanted) for key in METHOD_CONTROLS]


def _on_cfg_denoiser(params: Any) -> None:
    """Before every model evaluation: follow a model switch within the pass (the refiner), and feed the step
    window the progress of this evaluation within the pass."""
    denoiser = getattr(params, "denoiser", None)
    sampling_pass = getattr(getattr(denoiser, "p", None), PASS_ATTRIBUTE, None)
    if sampling_pass is not None:
        sampling_pass.follow_model(denoiser.p)
    unets = JOB.patched_unets()
    if not unets:
        return
    # params.sampling_step lags by one and repeats for second-order samplers; the denoiser's own evaluation
    # counter does not; it restarts for the hires pass and keeps counting across a refiner switch.
    progress = tm.evaluation_progress(getattr(denoiser, "step", None), getattr(denoiser, "total_steps", None),
                                      getattr(denoiser, "steps", None))
    for unet in unets:
        tome_core.set_progress(unet, progress)


_callbacks_registered = False


def _register_callbacks() -> None:
    global _callbacks_registered
    if _callbacks_registered:
        return
    _callbacks_registered = True
    script_callbacks.on_cfg_denoiser(_on_cfg_denoiser)
    script_callbacks.on_script_unloaded(JOB.end)
    script_callbacks.on_script_unloaded(_release_claim)
    script_callbacks.on_infotext_pasted(_on_infotext_pasted)
    if page_host().skips_postprocess_on_failure:
        # Runs after every job, also one whose sampling failed.
        script_callbacks.on_after_process(_after_process)


def _after_process(p: Any) -> None:
    JOB.end()


def _on_infotext_pasted(infotext: str, params: dict) -> None:
    """Our entries the host's infotext parser missed, added where it misses some (``Host.complete_pasted``)."""
    if isinstance(infotext, str) and isinstance(params, dict) and tm.RATIO_INFOTEXT in params:
        page_host().complete_pasted(infotext, params, tm.INFOTEXT_KEYS)


if OTHER_COPY is None:
    _register_callbacks()
