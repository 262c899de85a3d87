"""Token Merging (ToMe for SD), Token Downsampling (ToDo), local merging (one plan per level from 2×2 windows,
``tome_core.local``) and stack merging (whole transformer stacks on merged tokens, ``tome_core.stack``) for
ldm/sgm and diffusers U-Nets. Each method is one entry of ``METHODS`` (``tome_core.methods``).

Pure PyTorch: nothing here imports the webui, gradio, ldm, sgm or diffusers. Public API::

    apply_patch(model, ratio=0.5, ...)   # patch in place (again = new settings); returns model
    remove_patch(model)                  # exact restore
    patched_blocks(model)                # what a patch acts on (PatchedBlock: name, level, block, attn1)
    check_patch(model, ratio=0.5, ...)   # what apply_patch would act on, or its error, touching nothing
    set_progress(model, 0.3)             # sampling progress, for the step window (and level plan reuse)
    set_call_rows(model, rows)           # what the next call's batch holds (cond, uncond ...), for Cache
    with SamplingRun(model, options, sigmas) as run: ...   # one run's patch, removed however it ends
    model_layout(model), RECOMMENDED     # "sd" or "sdxl", and the settings recommended for each
"""

from .families import RECOMMENDED, model_layout
from .local import LocalPlan, plan_local
from .stack import StackPlan, plan_stack
from .merge import MergePlan, downsample_tokens, plan_merge
from .methods import METHODS, Method, method_named
from .options import MergeOptions, effective_ratio, ratio_cap
from .patch import (PatchedBlock, apply_patch, check_patch, get_patch, is_patched, patched_blocks, remove_patch, resolve_unet,
                    set_call_rows, set_progress, start_afresh)
from .scope import SamplingRun

__all__ = [
    "LocalPlan", "METHODS", "RECOMMENDED", "SamplingRun", "model_layout", "MergeOptions", "MergePlan", "Method", "PatchedBlock", "StackPlan", "apply_patch", "check_patch",
    "downsample_tokens", "effective_ratio", "get_patch", "is_patched", "method_named", "patched_blocks", "plan_local",
    "plan_merge", "plan_stack", "ratio_cap", "remove_patch", "resolve_unet", "set_call_rows", "set_progress",
    "start_afresh",
]
__version__ = "1.0.0"
