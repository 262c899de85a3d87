"""``shared.opts`` (settings with defaults and a saved config), ``shared.state`` and ``shared.sd_model``."""

from __future__ import annotations

from typing import Any

# Settings the double knows, with the webui's defaults. Setting any other key raises, as opts.set does.
DEFAULTS: dict[str, Any] = {
    "token_merging_ratio": 0.0,
    "token_merging_ratio_img2img": 0.0,
    "token_merging_ratio_hr": 0.0,
    "batch_cond_uncond": True,
    "img2img_fix_steps": False,
    "sd_model_checkpoint": "tiny.safetensors",
    "eta_ddim": 0.0,
    "hires_fix_refiner_pass": "second pass",
    # the built-in Hypertile (builtin_scripts/hypertile_script.py)
    "hypertile_enable_unet": False,
    "hypertile_enable_unet_secondpass": False,
}


class Options:
    """Attribute access to settings. ``data`` is what config.json holds: a key missing there reads as its
    default, and (as in the webui) is not restored after a job that overrode it."""

    def __init__(self, saved: dict[str, Any] | None = None) -> None:
        object.__setattr__(self, "data", dict(DEFAULTS if saved is None else saved))

    def __getattr__(self, key: str) -> Any:
        data = object.__getattribute__(self, "data")
        if key in data:
            return data[key]
        if key in DEFAULTS:
            return DEFAULTS[key]
        raise AttributeError(key)

    def __setattr__(self, key: str, value: Any) -> None:
        self.set(key, value)

    def set(self, key: str, value: Any, is_api: bool = False, run_callbacks: bool = True) -> bool:
        if key not in DEFAULTS:
            raise KeyError(key)
        self.data[key] = value
        return True

    def get_default(self, key: str) -> Any:
        return DEFAULTS.get(key)


class State:
    def __init__(self) -> None:
        self.interrupted = False
        self.skipped = False
        self.stopping_generation = False
        self.sampling_step = 0
        self.sampling_steps = 0
        self.job = ""

    def begin(self, job: str = "") -> None:
        """A new job (the API route or the UI's queue): no interrupt carried over."""
        self.interrupted = self.skipped = self.stopping_generation = False
        self.sampling_step, self.sampling_steps, self.job = 0, 0, job

    def interrupt(self) -> None:
        """The Interrupt button and ``/sdapi/v1/interrupt``."""
        self.interrupted = True


opts = Options()
state = State()
sd_model: Any = None
cmd_opts: Any = None
