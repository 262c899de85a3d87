"""``shared.opts`` (settings with ``data`` and ``data_labels``), ``shared.state``, ``shared.sd_model``, ``shared.sd_refiner``."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

DEFAULTS: dict[str, Any] = {
    "token_merging_method": "None",  # "None" | "ToMe" | "ToDo"
    "tome_ratio": 0.0,
    "todo_ratio": 0.0,
    "hypertile_unet_enabled": False,
    "sd_model_checkpoint": "Diffusers/tiny-sd15",
    "hidiffusion_raunet": True,
}


class Options:
    """Attribute access to settings; ``data`` holds the values set, ``data_labels`` every known key."""

    def __init__(self) -> None:
        object.__setattr__(self, "data", {})
        object.__setattr__(self, "data_labels", {key: SimpleNamespace(default=value) for key, value in DEFAULTS.items()})

    def __getattr__(self, key: str) -> Any:
        data = object.__getattribute__(self, "data")
        if key in data:
            return data[key]
        labels = object.__getattribute__(self, "data_labels")
        if key in labels:
            return labels[key].default
        raise AttributeError(key)

    def __setattr__(self, key: str, value: Any) -> None:
        self.data[key] = value


class State:
    def __init__(self) -> None:
        self.interrupted = False
        self.skipped = False

    def begin(self) -> None:
        self.interrupted = self.skipped = False


opts = Options()
state = State()
sd_model: Any = None
sd_refiner: Any = None  # the "Refiner model" setting's pipeline, loaded beside sd_model
sd_model_type = "sd"
cmd_opts = SimpleNamespace(experimental=False)
log_lines: list[str] = []


def log(message: str) -> None:
    """SD.Next's log (not stdout): kept for tests."""
    log_lines.append(message)
