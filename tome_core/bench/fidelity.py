"""What a method does to the picture: the same short sampling run from the same noise with no merging and with
each contender, the final pictures compared with the unmerged one by PSNR and SSIM, image by image (the median
over the images, and their range). The unmerged run's trajectory is kept for ``stepwise``.

Every contender is deterministic: ours keys its random partition on a seed; tomesd forks its generator off
torch's global RNG at its first call, so the global RNG is seeded before each run. The ideal is left out: it
bounds speed, and its repeated tokens make no picture worth comparing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import tome_core

from .contenders import Contender, Wrapped
from .metrics import psnr_each, ssim_each
from .pipeline import Pipeline
from .report import Fidelity
from .sampling import Guidance, euler_sample, sample
from .spread import Figure
from .stepwise import Trajectory, reference_trajectory

NOT_SAMPLED = ("ideal",)


@dataclass
class Pictures:
    """Each contender's final pictures (B, 3, H, W) in [0, 1] (or, without a decoder, its sampled tensors
    scaled by the unmerged one's range, at most 3 channels shown), and what was compared."""

    images: dict[str, torch.Tensor]
    on_tensors: bool  # True: the pipeline has no decoder, so the sampled tensors were compared
    trajectory: Trajectory | None = None  # the unmerged run's steps, for ``stepwise``

    def fidelity(self, reference: str = "none", steps: dict[str, list[float]] | None = None
                 ) -> dict[str, Fidelity]:
        """PSNR and SSIM of every contender's pictures against ``reference``'s, image by image: the median and
        range over the images; with ``steps`` (``stepwise.step_errors``), the one-step figure beside them."""
        ref = self.images[reference]
        out = {}
        for name, img in self.images.items():
            p, s = Figure.of(psnr_each(img, ref)), Figure.of(ssim_each(img, ref))
            step = Figure.of(steps[name]) if steps and name in steps else None
            out[name] = over_images(p, s, step)
        return out


def over_images(psnr: Figure, ssim: Figure, step: Figure | None = None) -> Fidelity:
    """A ``Fidelity`` of per-image figures: medians, with the ranges beside them."""
    return Fidelity(psnr.median, ssim.median, None if step is None else step.median, (psnr.low, psnr.high),
                    (ssim.low, ssim.high), None if step is None else (step.low, step.high), psnr.count)


def noise_for(pipe: Pipeline, size: int, images: int, seed: int) -> torch.Tensor:
    """(images, channels, size/downscale, size/downscale) unit Gaussian noise from ``seed``, made on the CPU so
    every device starts from the same numbers."""
    side = size // pipe.downscale
    return torch.randn(images, pipe.channels, side, side, generator=torch.Generator().manual_seed(seed))


def sample_pictures(pipe: Pipeline, racers: list[Contender], size: int, steps: int, seed: int = 0,
                    images: int = 1, device: torch.device | None = None, on_done=None,
                    sampler: str = "euler", guidance: Guidance | None = None) -> Pictures:
    """Sample ``images`` pictures of ``size`` px with ``steps`` steps of ``sampler`` (``sampling.SAMPLERS``) for
    no merging and each contender (the ideal excepted), all from the same noise (and Euler a's same fresh
    noise); ``on_done(name)`` after each. Each step's progress is told to the patch before its U-Net call, as
    the webui tells it. The unmerged run's trajectory (for the one-step figure) is kept with Euler only. With
    ``guidance`` (``sampling.guidance_for``), every run is guided alike."""
    device = device or next(pipe.unet.parameters()).device
    noise = noise_for(pipe, size, images, seed).to(device)
    wrapped = Wrapped(pipe.unet)  # the nesting tomesd needs; ours finds the U-Net in it
    raw: dict[str, torch.Tensor] = {}
    trajectory = None
    for racer in racers:
        if racer.method in NOT_SAMPLED:
            continue
        torch.manual_seed(seed)  # tomesd's partition generator is forked off the global RNG
        racer.apply(wrapped)
        try:
            if racer.method == "none" and sampler == "euler":
                trajectory, x = reference_trajectory(pipe, noise, steps, guidance)
            else:
                x = sample(pipe, noise, steps, sampler, seed, before_step=lambda i, n: tome_core.set_progress(
                    wrapped, (i + 0.5) / n), guidance=guidance)
            raw[racer.name] = (pipe.decode(x) if pipe.decode is not None else x).detach().float().cpu()
        finally:
            racer.remove(wrapped)
        if on_done is not None:
            on_done(racer.name)
    if pipe.decode is not None:
        return Pictures({name: img.clamp(0, 1) for name, img in raw.items()}, on_tensors=False,
                        trajectory=trajectory)
    # No decoder: compare the sampled tensors, mapped to [0, 1] by the unmerged one's range (the same map for
    # all, so distances are kept; values outside it are not clipped).
    ref = raw["none"]
    low, high = ref.min(), ref.max()
    scale = (high - low).clamp_min(1e-12)
    return Pictures({name: (x - low) / scale for name, x in raw.items()}, on_tensors=True, trajectory=trajectory)
