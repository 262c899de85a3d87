"""The callbacks a Script registers at import time, and their invocation by the host."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from modules import errors

_CATEGORIES = ("cfg_denoiser", "before_ui", "script_unloaded", "model_loaded", "infotext_pasted")
callback_map: dict[str, list[Callable]] = {name: [] for name in _CATEGORIES}


@dataclass
class CFGDenoiserParams:
    """Passed to ``on_cfg_denoiser`` callbacks once per model evaluation, before the U-Net runs.

    ``sampling_step`` is the last completed step (it lags by one); ``denoiser`` is the CFG denoiser, whose
    ``step`` counts evaluations of the current pass from 0 against its ``total_steps``.
    """

    x: Any
    image_cond: Any
    sigma: Any
    sampling_step: int
    total_sampling_steps: int
    text_cond: Any
    text_uncond: Any
    denoiser: Any = None


def clear_callbacks() -> None:
    for callbacks in callback_map.values():
        callbacks.clear()


def _add(category: str, callback: Callable) -> None:
    callback_map[category].append(callback)


def on_cfg_denoiser(callback: Callable[[CFGDenoiserParams], None]) -> None:
    _add("cfg_denoiser", callback)


def on_before_ui(callback: Callable[[], None]) -> None:
    _add("before_ui", callback)


def on_script_unloaded(callback: Callable[[], None]) -> None:
    _add("script_unloaded", callback)


def on_model_loaded(callback: Callable[[Any], None]) -> None:
    _add("model_loaded", callback)


def on_infotext_pasted(callback: Callable[[str, dict], None]) -> None:
    _add("infotext_pasted", callback)


def _run(category: str, *args: Any) -> None:
    for callback in list(callback_map[category]):
        try:
            callback(*args)
        except Exception:
            errors.report(f"Error executing callback {callback} for {category}", exc_info=True)


def cfg_denoiser_callback(params: CFGDenoiserParams) -> None:
    _run("cfg_denoiser", params)


def before_ui_callback() -> None:
    _run("before_ui")


def script_unloaded_callback() -> None:
    _run("script_unloaded")


def infotext_pasted_callback(infotext: str, params: dict) -> None:
    _run("infotext_pasted", infotext, params)
