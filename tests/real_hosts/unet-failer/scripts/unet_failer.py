"""An always-on script for the real-host checks, installed in the host as an extension of its own
(``tests/real_hosts/unet-failer``): with args [true] the U-Net raises "simulated failure" at its 2nd call of
the job, so the checks can see that a failed job leaves no patch behind; with args [false, true] its 2nd call
presses the host's own Interrupt (``shared.state.interrupt()``, what the Interrupt button and
``/sdapi/v1/interrupt`` call), so the host stops the job its own way. Not part of the extension (the webui
loads an extension's top-level ``scripts/`` only)."""

import gradio as gr
from modules import scripts, shared


def find_unet():
    """The U-Net where the host keeps it: the Forge family's ``forge_objects`` (Forge, Forge Neo, reForge,
    Forge Classic), else the A1111 webui's ``model.diffusion_model``, else a diffusers pipeline's ``unet``."""
    model = shared.sd_model
    patcher = getattr(getattr(model, "forge_objects", None), "unet", None)
    unet = getattr(getattr(patcher, "model", None), "diffusion_model", None)
    if unet is None:
        unet = getattr(getattr(model, "model", None), "diffusion_model", None)
    return unet if unet is not None else model.unet


class UnetFailer(scripts.Script):
    def title(self):
        return "unet failer"

    def show(self, is_img2img):
        return scripts.AlwaysVisible

    def ui(self, is_img2img):
        return [gr.Checkbox(False, label="fail"), gr.Checkbox(False, label="interrupt")]

    def process(self, p, fail=False, interrupt=False):
        self.handle = None
        if not (fail or interrupt):
            return
        calls = [0]

        def hook(module, args):
            calls[0] += 1
            if calls[0] == 2:
                self.handle.remove()
                self.handle = None
                if fail:
                    raise RuntimeError("unet failer: simulated failure at the U-Net's 2nd call of the job")
                print("unet failer: Interrupt pressed at the U-Net's 2nd call of the job", flush=True)
                shared.state.interrupt()
        self.handle = find_unet().register_forward_pre_hook(hook)

    def postprocess(self, p, processed, fail=False, interrupt=False):
        if getattr(self, "handle", None) is not None:
            self.handle.remove()
            self.handle = None
