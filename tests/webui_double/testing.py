"""Fixtures and helpers for tests that drive the extension's scripts through the doubles.

``host`` (module scope) starts a double webui with the extension loaded and a tiny real U-Net as
``shared.sd_model``, once as the A1111 webui, once as Forge (``tests/forge_double``) and once as reForge
(``tests/reforge_double``, Forge's processing with the ``ldm_patched`` U-Net): tests that use it run on all. ``fresh`` (every test) resets settings, checkpoints, observers and reports, records every U-Net call
of the test in ``host.calls``, and afterwards checks that no hook raised and that every U-Net is pristine.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import pytest
import torch

import forge_double
from doubles_shared import imported_afresh
import reforge_double
import webui_double

FLAVOURS = ("a1111", "forge", "reforge")
BASE_CHECKPOINT = "tiny.safetensors"

LATENT = 16  # latent side of test images (128 px); hires fix at 1.5 makes it 24

EXTENSION_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass
class UnetCall:
    """The state of one U-Net call, seen from inside the sampler."""

    model: Any              # the model object called (the base model, or a refiner switched in)
    hr: bool
    shape: tuple[int, ...]
    options: Any            # tome_core MergeOptions of our live patch, or None when unpatched
    progress: float | None  # the patch's sampling progress at this call
    builtin: bool           # the webui's built-in (tomesd) patch is on
    levels: frozenset = frozenset()  # the U-Net levels our patch selected (0 = full latent resolution)

    @property
    def merging(self) -> bool:
        """Our patch is on and, by its step window, acts in this call."""
        return self.options is not None and self.options.in_window(self.progress)


class Host:
    def __init__(self, flavour, webui, model, pristine) -> None:
        self.flavour = flavour
        self.webui = webui
        self.model = model
        self.pristine = pristine
        self.calls: list[UnetCall] = []

    @property
    def unet(self):
        return self.model.unet

    @property
    def processing(self) -> str:
        """Whose job processing this flavour has: "a1111", or "forge" (Forge's, also reForge's)."""
        return "a1111" if self.flavour == "a1111" else "forge"

    def record(self, model, x, t, context) -> None:
        import tome_core
        from modules import processing

        patch = tome_core.get_patch(model.unet)  # its options and progress, a public view of the patch
        self.calls.append(UnetCall(
            model=model, hr=bool(processing.current_job().is_hr_pass), shape=tuple(x.shape),
            options=None if patch is None else patch.options, progress=None if patch is None else patch.progress,
            builtin=model.builtin_token_merging_on(),
            levels=frozenset(b.level for b in tome_core.patched_blocks(model.unet))))

    def new_model(self, unet=None, kind: str = "u-net"):
        """A model of this host around ``unet`` (a tiny SD 1.x U-Net by default); ``kind`` "transformer" is
        a model with no U-Net blocks (A1111: a module that is not ldm's; Forge: a Flux engine)."""
        if self.flavour == "reforge":
            from reforge_double.model import reforge_unet, tiny_reforge_model

            if kind == "transformer":
                return tiny_reforge_model(_NotAUnet())
            return tiny_reforge_model(reforge_unet(unet) if unet is not None else None)
        if self.flavour == "forge":
            from forge_double.model import forge_unet, tiny_forge_model

            if kind == "transformer":
                return tiny_forge_model(engine="Flux")
            return tiny_forge_model(forge_unet(unet) if unet is not None else None)
        from webui_double.model import TinySDModel

        if kind == "transformer":
            return TinySDModel(unet=_NotAUnet())
        return TinySDModel(unet)

    def add_checkpoint(self, title: str, model, *, config: str):
        """Register a checkpoint whose model object is ``model`` (recorded like the base model)."""
        from modules import sd_models

        model.observers = [self.record]
        weights = {name: tensor.clone() for name, tensor in model.unet.state_dict().items()}
        return sd_models.register(sd_models.CheckpointInfo(title, config, build=lambda info: model,
                                                           weights=lambda: weights))

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


class _NotAUnet(torch.nn.Module):
    def forward(self, x, t, context=None, **kwargs):
        return x


def webui_modules(flavour: str):
    """``modules`` (and the extension's own script modules) imported afresh from the double of ``flavour``,
    and the ones imported before put back afterwards."""
    def install() -> None:
        forge_double.install_backend()
        reforge_double.install()

    first = [] if flavour == "a1111" else [forge_double.FORGE_DOUBLE_DIR]
    return imported_afresh(("modules", "scripts", "webui_double.host"), first, (forge_double.FORGE_DOUBLE_DIR,),
                           install)


@contextmanager
def started_host(flavour: str) -> Iterator[Host]:
    """A double webui of ``flavour`` with the extension loaded and a tiny U-Net as ``shared.sd_model``."""
    if not webui_double.install():
        pytest.skip("a real webui's modules are importable here; these tests drive the double")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny U-Net is faster on one thread, and tests share a 2-core machine
    with webui_modules(flavour):
        from modules import shared
        from webui_double.host import Webui
        from webui_double.model import snapshot

        host = Host(flavour, None, None, None)
        model = host.new_model()
        base = host.add_checkpoint(BASE_CHECKPOINT, model, config="v1")
        shared.sd_model = model
        model.sd_checkpoint_info = base
        host.pristine = snapshot(model)
        host.model = model
        host.webui = Webui(EXTENSION_DIR)
        try:
            yield host
        finally:
            host.webui.unload()
            shared.sd_model = None
            torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=FLAVOURS)
def host(request):
    """Every flavour in turn. A test module about one host family defines its own ``host`` fixture over
    ``started_host`` with just those flavours."""
    with started_host(request.param) as started:
        yield started


@pytest.fixture
def fresh(host):
    from modules import errors, sd_models, sd_unet, shared

    shared.opts.data.clear()
    shared.opts.data.update(shared.DEFAULTS)
    for title in [t for t in sd_models.checkpoints if t != BASE_CHECKPOINT]:
        del sd_models.checkpoints[title]
    shared.sd_model = host.model
    sd_unet.current_unet = None
    errors.reported.clear()
    host.calls.clear()
    host.model.observers[:] = [host.record]
    yield host
    host.model.observers[:] = []
    sd_unet.current_unet = None
    shared.opts.data.clear()
    shared.opts.data.update(shared.DEFAULTS)
    shared.sd_model = host.model
    sd_models.reload_model_weights()  # the base checkpoint's weights, should a refiner have left its own
    assert errors.reported == [], "a hook or callback raised"
    host.assert_pristine()  # after every test's last job, whatever the test checked itself


def infotext_params(infotext: str) -> dict[str, str]:
    from modules import infotext_utils

    return infotext_utils.parse_generation_parameters(infotext)


def tome_keys(infotext: str) -> dict[str, str]:
    return {k: v for k, v in infotext_params(infotext).items() if k.startswith("ToMe ")}
