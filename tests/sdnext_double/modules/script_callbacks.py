"""SD.Next's script callbacks, those an always-on script registers. ``on_cfg_denoiser`` can be registered but
the diffusers pipelines never call it; ``after_process`` runs in ``process_images``' ``finally``."""

from __future__ import annotations

from typing import Any, Callable

from modules import errors

_CATEGORIES = ("cfg_denoiser", "before_ui", "script_unloaded", "before_process", "after_process",
               "infotext_pasted", "model_loaded")
callbacks: dict[str, list[Callable]] = {name: [] for name in _CATEGORIES}


def clear_callbacks() -> None:
    for entries in callbacks.values():
        entries.clear()


def _run(name: str, *args: Any) -> None:
    for callback in list(callbacks[name]):
        try:
            callback(*args)
        except Exception as error:
            errors.display(error, f"{name}_callback")


def on_cfg_denoiser(callback): callbacks["cfg_denoiser"].append(callback)
def on_before_ui(callback): callbacks["before_ui"].append(callback)
def on_script_unloaded(callback): callbacks["script_unloaded"].append(callback)
def on_before_process(callback): callbacks["before_process"].append(callback)
def on_after_process(callback): callbacks["after_process"].append(callback)
def on_infotext_pasted(callback): callbacks["infotext_pasted"].append(callback)
def on_model_loaded(callback): callbacks["model_loaded"].append(callback)


def before_ui_callback() -> None: _run("before_ui")
def script_unloaded_callback() -> None: _run("script_unloaded")
def before_process_callback(p) -> None: _run("before_process", p)
def after_process_callback(p) -> None: _run("after_process", p)
def infotext_pasted_callback(infotext: str, params: dict) -> None: _run("infotext_pasted", infotext, params)
