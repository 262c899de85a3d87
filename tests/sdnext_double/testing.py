"""Fixtures and helpers for tests that drive the extension through the SD.Next double.

``sdnext`` (module scope) starts a double SD.Next with the extension loaded and the tiny pipeline as
``shared.sd_model``. ``fresh`` (every test) resets settings, logs and reports, records every U-Net call of
the test in ``host.calls``, and afterwards checks that no hook raised and that the U-Net is pristine.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import pytest
import torch

from doubles_shared import imported_afresh
from sdnext_double import SDNEXT_DOUBLE_DIR

EXTENSION_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LATENT = 16  # latent side of the test images (128 px); hires fix at 2x makes it 32


@dataclass
class UnetCall:
    pipeline: str            # class of the pipeline running (StableDiffusionImg2ImgPipeline in the hires pass)
    shape: tuple[int, ...]
    options: Any             # tome_core options of our live patch, or None
    progress: float | None   # our patch's progress at this call
    builtin: str             # SD.Next's built-in token merging on the U-Net at this call: "ToMe", "ToDo" or ""
    output: torch.Tensor | None = None

    @property
    def hires(self) -> bool:
        return "Img2Img" in self.pipeline

    @property
    def merging(self) -> bool:
        return self.options is not None and self.options.in_window(self.progress)


def snapshot(unet) -> dict:
    from sdnext_double.model import CONTEXT_DIM

    x = torch.randn(2, 4, LATENT, LATENT, generator=torch.Generator().manual_seed(5))
    context = torch.randn(2, 8, CONTEXT_DIM, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        output = unet(x, torch.tensor(500), encoder_hidden_states=context).sample
    return {
        "hooks": sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in unet.modules()),
        # (HiDiffusion's reset marks the U-Net ``hidiffusion`` once it has reset a module: SD.Next's own mark)
        "modules": [(name, type(m).__name__, sorted(k for k in vars(m) if not k.startswith("_") and k != "hidiffusion"))
                    for name, m in unet.named_modules()],
        "processors": {name: type(proc).__name__ for name, proc in unet.attn_processors.items()},
        "output": output,
    }


class Host:
    def __init__(self, sdnext, pipe, pristine) -> None:
        self.sdnext = sdnext
        self.pipe = pipe
        self.pristine = pristine
        self.calls: list[UnetCall] = []
        self._recorders: list = []

    @property
    def unet(self):
        return self.pipe.unet

    def record(self, keep_outputs: bool = False) -> None:
        import tome_core
        from modules import shared, token_merge

        def before(module, args, kwargs):
            patch = tome_core.get_patch(module)
            self.calls.append(UnetCall(
                pipeline=type(shared.sd_model).__name__, shape=tuple(args[0].shape),
                options=None if patch is None else patch.options, progress=None if patch is None else patch.progress,
                builtin=token_merge.builtin_state(shared.sd_model)))

        def after(module, args, output):
            if keep_outputs:
                self.calls[-1].output = output[0].detach().clone() if isinstance(output, tuple) else output.sample.detach().clone()

        self._recorders = [self.unet.register_forward_pre_hook(before, with_kwargs=True),
                           self.unet.register_forward_hook(after)]

    def stop_recording(self) -> None:
        for handle in self._recorders:
            handle.remove()
        self._recorders = []

    def assert_pristine(self) -> None:
        import tome_core

        now = snapshot(self.unet)
        assert not tome_core.is_patched(self.unet)
        assert now["hooks"] - len(self._recorders) == self.pristine["hooks"] == 0
        assert now["modules"] == self.pristine["modules"]
        assert now["processors"] == self.pristine["processors"]
        assert torch.equal(now["output"], self.pristine["output"])

    # -- jobs -----------------------------------------------------------------------------------------------

    def txt2img(self, tome: Any = None, **fields: Any):
        """An API txt2img request; ``tome`` is the "alwayson_scripts" args list of ToMe (None: not sent)."""
        request = {"prompt": "a cat", "seed": 11, "steps": 4, "width": LATENT * 8, "height": LATENT * 8, **fields}
        if tome is not None:
            request["alwayson_scripts"] = {**request.get("alwayson_scripts", {}), "tome": {"args": tome}}
        return self.sdnext.api("txt2img", request)

    def img2img(self, tome: Any = None, **fields: Any):
        init = torch.randn(4, LATENT, LATENT, generator=torch.Generator().manual_seed(3))
        request = {"prompt": "a cat", "seed": 11, "steps": 4, "init_images": [init], "denoising_strength": 0.75,
                   **fields}
        if tome is not None:
            request["alwayson_scripts"] = {"tome": {"args": tome}}
        return self.sdnext.api("img2img", request)


def sdnext_modules():
    """``modules`` (and the extension's ``scripts`` package) imported afresh from the SD.Next double, and the
    ones imported before put back afterwards."""
    return imported_afresh(("modules", "scripts", "sdnext_double.host"), [SDNEXT_DOUBLE_DIR])


@contextmanager
def started_sdnext() -> Iterator[Host]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with sdnext_modules():
        from modules import shared
        from sdnext_double.host import SDNext
        from sdnext_double.model import tiny_pipeline

        pipe = tiny_pipeline()
        pipe.sd_checkpoint_info = "Diffusers/tiny-sd15"
        shared.sd_model = pipe
        host = Host(None, pipe, snapshot(pipe.unet))
        host.sdnext = SDNext(EXTENSION_DIR)
        try:
            yield host
        finally:
            host.sdnext.unload()
            shared.sd_model = None
            torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def sdnext():
    with started_sdnext() as host:
        yield host


@pytest.fixture
def fresh(sdnext):
    from modules import errors, shared

    shared.opts.data.clear()
    shared.sd_model = sdnext.pipe
    shared.state.begin()
    shared.log_lines.clear()
    errors.reported.clear()
    sdnext.calls.clear()
    sdnext.record()
    yield sdnext
    sdnext.stop_recording()
    shared.opts.data.clear()
    shared.sd_model = sdnext.pipe
    assert errors.reported == [], "a hook or callback raised"
    sdnext.assert_pristine()


def infotext_params(text: str) -> dict:
    from modules import infotext

    return infotext.parse(text)


def tome_keys(text: str) -> dict:
    """The ToMe entries as a paste reads them: SD.Next's parser, which types its values but skips keys with a
    hyphen, then the infotext_pasted callbacks, whose ToMe one adds those keys as the text spells them."""
    from modules import script_callbacks

    params = infotext_params(text)
    script_callbacks.infotext_pasted_callback(text, params)
    return {k: v for k, v in params.items() if k.startswith("ToMe")}


def image(response) -> torch.Tensor:
    return response["images"][0]
