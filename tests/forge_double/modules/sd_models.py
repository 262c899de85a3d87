"""Forge's checkpoint loading: every load builds a new model object (``forge_model_reload``); it never loads
another checkpoint's weights into the current modules. The refiner is such a load, and the next batch's
``forge_model_reload`` loads the base checkpoint back. The double builds each checkpoint's model once and
keeps it."""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Any

from modules import shared

_spec = importlib.util.spec_from_file_location(
    "modules._a1111_sd_models",
    os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "webui_double",
                 "modules", "sd_models.py"))
_a1111 = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_a1111)

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
