"""SD.Next's HiDiffusion step (modules/hidiffusion): ``apply`` always starts with ``unapply``, whose
``remove_hidiffusion`` turns every U-Net module that has a ``_parent`` attribute back into that class and
removes the hooks a module keeps in ``module.info["hooks"]``. The double applies no HiDiffusion itself."""

from __future__ import annotations

from modules import shared


def remove_hidiffusion(model):
    model = model.unet if hasattr(model, "unet") else model
    for _, module in model.named_modules():
        while hasattr(module, "_parent"):
            model.hidiffusion = True
            module.__class__ = module._parent
        if hasattr(module, "info"):
            for hook in module.info.get("hooks", []):
                hook.remove()
            module.info["hooks"].clear()
            del module.info


def apply(p, model_type):
    unapply()
    pipe = shared.sd_model
    if hasattr(pipe, "unet") and getattr(pipe.unet, "hidiffusion", False):
        shared.log("HiDiffusion: model reload recomended")


def unapply():
    pipe = shared.sd_model
    if hasattr(pipe, "unet") and pipe.unet is not None:
        remove_hidiffusion(pipe)
