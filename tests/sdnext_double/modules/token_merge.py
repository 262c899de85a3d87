"""SD.Next's built-in token merging (modules/token_merge.py): called from ``process_pre`` without ``p``, so it
reads the settings alone. ToMe: ``tomesd.apply_patch(pipe, ratio=tome_ratio, use_rand=False,
merge_attn=True, merge_crossattn=False, merge_mlp=False)`` (a class swap, with ``_parent``). ToDo: SD.Next's
``todo_utils.patch_attention_proc`` replaces each self-attention's processor; that one merges only where the
layer's width is 320 or 640 (SD 1.5's), so on the tiny U-Net the double's stand-in computes the same."""

from __future__ import annotations

from modules import shared


class TodoProcessor:
    """Stand-in for SD.Next's ToDo attention processor on widths it leaves alone: the original processor."""

    def __init__(self, original) -> None:
        self.original = original

    def __call__(self, *args, **kwargs):
        return self.original(*args, **kwargs)


def apply_token_merging(sd_model, p=None):
    def _opt(key):
        if p is not None and getattr(p, key, None) is not None:
            return getattr(p, key)
        return getattr(shared.opts, key, None)

    current_tome = getattr(sd_model, "applied_tome", 0)
    current_todo = getattr(sd_model, "applied_todo", 0)
    method, tome, todo = _opt("token_merging_method"), _opt("tome_ratio"), _opt("todo_ratio")
    hypertile = _opt("hypertile_unet_enabled")
    if method == "ToMe" and tome > 0:
        if current_tome == tome:
            return
        if hypertile and not shared.cmd_opts.experimental:
            shared.log("Token merging not supported with HyperTile for UNet")
            return
        import tomesd

        tomesd.apply_patch(sd_model, ratio=tome, use_rand=False, merge_attn=True, merge_crossattn=False,
                           merge_mlp=False)
        shared.log(f"Applying ToMe: ratio={tome}")
        sd_model.applied_tome = tome
    else:
        sd_model.applied_tome = 0
    if method == "ToDo" and todo > 0:
        if current_todo == todo:
            return
        for module in sd_model.unet.modules():
            attn1 = getattr(module, "attn1", None)
            if attn1 is not None and not isinstance(attn1.processor, TodoProcessor):
                attn1.set_processor(TodoProcessor(attn1.processor))
        shared.log(f"Applying ToDo: ratio={todo}")
        sd_model.applied_todo = todo
    else:
        sd_model.applied_todo = 0


def remove_token_merging(sd_model):
    if getattr(sd_model, "applied_tome", 0) > 0:
        import tomesd

        tomesd.remove_patch(sd_model)
        sd_model.applied_tome = 0
    if getattr(sd_model, "applied_todo", 0) > 0:
        for module in sd_model.unet.modules():
            attn1 = getattr(module, "attn1", None)
            if attn1 is not None and isinstance(attn1.processor, TodoProcessor):
                attn1.set_processor(attn1.processor.original)
        sd_model.applied_todo = 0


def builtin_state(sd_model) -> str:
    """What of the built-in token merging is on the U-Net now: "ToMe" (tomesd's blocks), "ToDo" or ""."""
    unet = sd_model.unet
    if any(type(m).__name__ == "ToMeBlock" for m in unet.modules()):
        return "ToMe"
    if any(isinstance(getattr(m, "processor", None), TodoProcessor) for m in unet.modules()):
        return "ToDo"
    return ""
