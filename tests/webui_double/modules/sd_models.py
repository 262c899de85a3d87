"""Checkpoints and model switching, as the webui does it for the refiner and at each batch of the batch count.

``reload_model_weights(info=...)`` loads a checkpoint: into the current model object when both use the same
model config (the modules stay, only their weights change), else as a new model object that becomes
``shared.sd_model`` (SDXL base and refiner: ``sd_xl_base.yaml``, ``sd_xl_refiner.yaml``). Without ``info`` it
loads the checkpoint of the ``sd_model_checkpoint`` setting, which is how the base model comes back for the
next batch and the next job. The double keeps each checkpoint's model object once built, as the webui's
checkpoint cache does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from modules import shared


@dataclass(eq=False)
class CheckpointInfo:
    title: str
    config: str                                  # the model config the checkpoint is built from
    build: Callable[["CheckpointInfo"], Any]     # its model object, built (once) when first loaded
    weights: Callable[[], dict] | None = None    # its U-Net weights, for loading into a model of its config
    model: Any = field(default=None, repr=False)

    @property
    def filename(self) -> str:
        return f"models/Stable-diffusion/{self.title}"

    @property
    def short_title(self) -> str:
        return self.title.rsplit(".", 1)[0]


checkpoints: dict[str, CheckpointInfo] = {}


def register(info: CheckpointInfo) -> CheckpointInfo:
    checkpoints[info.title] = info
    return info


def get_closet_checkpoint_match(name: str) -> CheckpointInfo | None:
    return checkpoints.get(name) or next((c for c in checkpoints.values() if c.short_title == name), None)


def model_for(info: CheckpointInfo) -> Any:
    if info.model is None:
        info.model = info.build(info)
        info.model.sd_checkpoint_info = info
    return info.model


def reload_model_weights(sd_model: Any = None, info: CheckpointInfo | None = None) -> Any:
    info = info or checkpoints.get(shared.opts.sd_model_checkpoint)
    current = shared.sd_model
    if info is None or getattr(current, "sd_checkpoint_info", None) is info:
        return current
    loaded = getattr(current, "sd_checkpoint_info", None)
    if loaded is not None and loaded.config == info.config and info.weights is not None:
        current.load_unet_weights(info.weights())
        current.sd_checkpoint_info = info
        return current
    shared.sd_model = model_for(info)
    return shared.sd_model
