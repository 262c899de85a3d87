"""SD.Next's ``create_infotext`` (modules/processing_info.py): its own entries, the built-in token merging as
``ToMe``/``ToDo`` (read from ``p`` first, then the settings, whether or not a patch was applied), then
``p.extra_generation_params``; entries that are None, <= -1, empty or "0x0" are dropped."""

from __future__ import annotations

from modules import shared
from modules.infotext import quote


def create_infotext(p, index: int = 0) -> str:
    def get_opt(key):
        value = getattr(p, key, None)
        return value if value is not None else getattr(shared.opts, key, None)

    seeds = p.all_seeds or [p.seed]
    args = {"Steps": p.steps, "Size": f"{p.width}x{p.height}", "Sampler": "Euler", "Seed": seeds[min(index, len(seeds) - 1)],
            "CFG scale": p.cfg_scale, "App": "SD.Next", "Pipeline": type(shared.sd_model).__name__,
            "Model": "tiny-sd15"}
    if p.enable_hr:
        args.update({"Hires strength": p.hr_denoising_strength, "Hires size": f"{p.hr_upscale_to_x}x{p.hr_upscale_to_y}"})
    method = get_opt("token_merging_method")
    if method == "ToMe":
        args["ToMe"] = get_opt("tome_ratio") or None
    elif method == "ToDo":
        args["ToDo"] = get_opt("todo_ratio") or None
    args.update(p.extra_generation_params)
    for key, value in list(args.items()):
        if value is None or (type(value) in (int, float) and value <= -1) or (type(value) is str and value in ("", "0x0")):
            del args[key]
    params = ", ".join(k if k == v else f"{k}: {quote(v)}" for k, v in args.items())
    return f"{p.prompt}\nNegative prompt: {p.negative_prompt}\n{params}"
