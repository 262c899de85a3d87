"""Forge's checkpoint loading: every load builds a new model object (``forge_model_reload``); it never loads
another checkpoint's weights into the current modules. The refiner is such a load, and the next batch's
``forge_model_reload`` loads the base checkpoint back. The double builds each checkpoint's model once and
keeps it."""

from __future__ import annotations

from typing import Any

from modules import load_a1111, shared

_a1111 = load_a1111("sd_models")

from modules._a1111_sd_models import *  # noqa: E402,F401,F403  (what Forge keeps as it is)


def forge_model_reload(info: Any = None) -> tuple[Any, bool]:
    info = info or checkpoints.get(shared.opts.sd_model_checkpoint)
    if info is None or getattr(shared.sd_model, "sd_checkpoint_info", None) is info:
        return shared.sd_model, False
    shared.sd_model = model_for(info)
    return shared.sd_model, True


def reload_model_weights(sd_model: Any = None, info: Any = None) -> Any:
    """What the shared parts of the double call: Forge's reload."""
    return forge_model_reload(info)[0]
