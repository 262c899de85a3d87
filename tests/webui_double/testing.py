"""Fixtures and helpers for tests that drive the extension's scripts through the double.

``host`` (module scope) starts a double webui with the extension loaded and a tiny real U-Net as
``shared.sd_model``; ``fresh`` (every test) resets settings, observers and reports, records every U-Net call
of the test in ``host.calls``, and afterwards checks that no hook raised and that the U-Net is pristine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import webui_double

LATENT = 16  # latent side of test images (128 px); hires fix at 1.5 makes it 24

EXTENSION_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass
class UnetCall:
    """The state of one U-Net call, seen from inside the sampler."""

    hr: bool
    shape: tuple[int, ...]
    options: Any            # tome_core MergeOptions of our live patch, or None when unpatched
    progress: float | None  # the patch's sampling progress at this call
    builtin: bool           # the webui's built-in (tomesd) patch is on

    @property
    def merging(self) -> bool:
        """Our patch is on and, by its step window, acts in this call."""
        return self.options is not None and self.options.in_window(self.progress)


class Host:
    def __init__(self, webui, model, pristine) -> None:
        self.webui = webui
        self.model = model
        self.pristine = pristine
        self.calls: list[UnetCall] = []

    def record(self, model, x, t, context) -> None:
        import tome_core
        from modules import processing

        patch = tome_core.get_patch(model)
        self.calls.append(UnetCall(
            hr=bool(processing.current_p.is_hr_pass), shape=tuple(x.shape),
            options=None if patch is None else patch.options, progress=None if patch is None else patch.progress,
            builtin=any(type(m).__name__ == "ToMeBlock" for m in model.modules())))

    def assert_pristine(self) -> None:
        """The U-Net is exactly as before any job: same output bits, no hooks, no added attributes."""
        from webui_double.model import snapshot

        now = snapshot(self.model)
        assert now["hooks"] == self.pristine["hooks"] == 0
        assert now["modules"] == self.pristine["modules"]
        assert torch.equal(now["output"], self.pristine["output"])

    # -- jobs -----------------------------------------------------------------------------------------------

    def tome_args(self, tab: str = "txt2img", **values: Any) -> tuple:
        """The Generate click's input list with the ToMe controls at their UI defaults, ``values`` (by API
        key) set."""
        from tome_core import settings as tm

        return self.webui.ui_args(tab, {"ToMe": {tm.KEYS.index(k): v for k, v in values.items()}})

    def txt2img(self, args: tuple | None = None, **fields: Any):
        from modules import processing

        fields = {"prompt": "a cat", "seed": 11, "steps": 3, "width": LATENT * 8, "height": LATENT * 8, **fields}
        return self.webui.generate(processing.StableDiffusionProcessingTxt2Img(**fields),
                                   args if args is not None else self.tome_args())

    def img2img(self, args: tuple | None = None, **fields: Any):
        from modules import processing

        init = torch.randn(4, LATENT, LATENT, generator=torch.Generator().manual_seed(3))
        fields = {"prompt": "a cat", "seed": 11, "steps": 4, "init_images": [init], "denoising_strength": 0.75,
                  **fields}
        return self.webui.generate(processing.StableDiffusionProcessingImg2Img(**fields),
                                   args if args is not None else self.tome_args("img2img"))


@pytest.fixture(scope="module")
def host():
    if not webui_double.install():
        pytest.skip("a real webui's modules are importable here; these tests drive the double")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny U-Net is faster on one thread, and tests share a 2-core machine
    from modules import shared
    from webui_double.host import Webui
    from webui_double.model import TinySDModel, snapshot

    model = TinySDModel()
    shared.sd_model = model
    webui = Webui(EXTENSION_DIR)
    try:
        yield Host(webui, model, snapshot(model))
    finally:
        webui.unload()
        shared.sd_model = None
        torch.set_num_threads(threads)


@pytest.fixture
def fresh(host):
    from modules import errors, sd_unet, shared

    shared.opts.data.clear()
    shared.opts.data.update(shared.DEFAULTS)
    shared.sd_model = host.model
    sd_unet.current_unet = None
    errors.reported.clear()
    host.calls.clear()
    host.model.observers[:] = [host.record]
    yield host
    host.model.observers[:] = []
    sd_unet.current_unet = None
    shared.sd_model = host.model
    assert errors.reported == [], "a hook or callback raised"
    host.assert_pristine()  # after every test's last job, whatever the test checked itself


def infotext_params(infotext: str) -> dict[str, str]:
    from modules import infotext_utils

    return infotext_utils.parse_generation_parameters(infotext)


def tome_keys(infotext: str) -> dict[str, str]:
    return {k: v for k, v in infotext_params(infotext).items() if k.startswith("ToMe ")}
