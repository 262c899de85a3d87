"""Stand-ins for the trained models the benchmark's fidelity runs take: a small pixel-space ldm U-Net in a
``Pipeline`` (as the shipped proxy is), installed where ``tome_core.bench.proxy`` would be."""

from __future__ import annotations

import sys
import types

import torch

import tome_core.bench
from tome_core.bench.pipeline import Pipeline
from unets import CONTEXT_DIM, randomize_zero_layers


def stand_in_pipeline(decode: bool = True, channels: int = 32, seed: int = 0) -> Pipeline:
    """A random SD-layout ldm U-Net on 3-channel pixels (downscale 1), with an identity decoder from [-1, 1]
    to [0, 1], or none."""
    from ldm.modules.diffusionmodules.openaimodel import UNetModel

    torch.manual_seed(seed)
    unet = UNetModel(image_size=32, in_channels=3, out_channels=3, model_channels=channels, num_res_blocks=1,
                     attention_resolutions=[4, 2, 1], channel_mult=[1, 2, 4, 4], num_heads=2,
                     use_spatial_transformer=True, transformer_depth=1, context_dim=CONTEXT_DIM, legacy=False)
    unet = randomize_zero_layers(unet).eval()
    context = torch.randn(1, 7, CONTEXT_DIM, generator=torch.Generator().manual_seed(seed))
    return Pipeline("stand-in proxy", unet, context, channels=3, downscale=1,
                    decode=(lambda x: (x + 1) / 2) if decode else None)


def install_proxy(monkeypatch, pipe_factory=stand_in_pipeline, shipped: tuple[str, ...] | None = None,
                  missing: tuple[str, ...] = ()) -> list:
    """Make ``from tome_core.bench.proxy import load_proxy`` give a stand-in; returns the calls' arguments.

    With ``shipped``, the module names those paths as its shipped proxies ("seed 0", "seed 1", ...), and the
    stand-in loaded for the k-th is built from seed k: independently drawn weights, as independently trained
    proxies are; those also in ``missing`` are reported as not there."""
    calls = []
    module = types.ModuleType("tome_core.bench.proxy")

    def load_proxy(device="cpu", dtype=torch.float32, path=None):
        calls.append((device, dtype) if path is None else (device, dtype, path))
        if shipped and path in shipped:
            return pipe_factory(seed=shipped.index(path))
        return pipe_factory()

    module.load_proxy = load_proxy
    module.EVAL_SIZE = 16
    # The stand-ins are all SD 1.5's layout: the real module's SDXL-layout lists, here empty.
    module.SHIPPED_SDXL_WEIGHTS = module.SHIPPED_PROMPTED_SDXL_WEIGHTS = ()
    if shipped:
        module.SHIPPED_WEIGHTS = tuple(shipped)
        module.shipped_weights = lambda layouts=("sd15", "sdxl"), prompted=True: (
            [p for p in shipped if p not in missing], list(missing))
        module.train_command = lambda path: f"python -m tome_core.bench.proxy train --seed {shipped.index(path)}"
        module.describe = lambda path: f"seed {shipped.index(path)}" if path in shipped else path
    monkeypatch.setitem(sys.modules, "tome_core.bench.proxy", module)
    # ``from . import proxy`` reads the package's attribute first, set once the real module has been imported.
    monkeypatch.setattr(tome_core.bench, "proxy", module, raising=False)
    return calls
