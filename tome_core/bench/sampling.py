"""A short deterministic sampling run: Euler steps on SD's discrete schedule, from given noise.

The same noise and timesteps with and without a merging method give two final pictures whose difference is
what the method costs. Timesteps are whole numbers spread evenly from the last to the first (as the webui's
"Euler" with the default schedule does up to rounding), so nothing depends on interpolating the schedule.
"""

from __future__ import annotations

from typing import Callable

import torch

from .pipeline import Pipeline


def timesteps_and_sigmas(alphas_cumprod: torch.Tensor, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(steps,) integer timesteps from the last to the first, and (steps + 1,) float64 sigmas ending in 0."""
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    last = len(alphas_cumprod) - 1
    ts = torch.linspace(last, 0, steps, dtype=torch.float64).round().long()
    sigmas = ((1 - alphas_cumprod[ts]) / alphas_cumprod[ts]).sqrt()
    return ts, torch.cat([sigmas, sigmas.new_zeros(1)])


@torch.no_grad()
def euler_sample(pipe: Pipeline, noise: torch.Tensor, steps: int,
                 before_step: Callable[[int, int], None] | None = None) -> torch.Tensor:
    """Sample from ``noise`` (B, channels, h, w), unit variance, with ``steps`` Euler steps.

    ``before_step(i, steps)`` runs before each U-Net call (for example to set a step window's progress).
    Returns the final sample (B, channels, h, w) in the U-Net's dtype.
    """
    ts, sigmas = timesteps_and_sigmas(pipe.alphas_cumprod, steps)
    dtype = next(pipe.unet.parameters()).dtype
    device = noise.device
    b = noise.shape[0]
    context = pipe.context.to(device, dtype).expand(b, *pipe.context.shape[1:])
    y = None if pipe.y is None else pipe.y.to(device, dtype).expand(b, *pipe.y.shape[1:])
    x = noise.double() * sigmas[0].item()
    for i in range(steps):
        sigma, sigma_next = sigmas[i].item(), sigmas[i + 1].item()
        if before_step is not None:
            before_step(i, steps)
        scale_in = 1.0 / (sigma ** 2 + 1) ** 0.5
        t = torch.full((b,), int(ts[i]), device=device, dtype=torch.long)
        kwargs = {"context": context} if y is None else {"context": context, "y": y}
        out = pipe.unet((x * scale_in).to(dtype), t, **kwargs).double()
        if pipe.prediction == "v":
            denoised = x / (sigma ** 2 + 1) - out * sigma / (sigma ** 2 + 1) ** 0.5
        else:
            denoised = x - out * sigma
        x = x + (x - denoised) / sigma * (sigma_next - sigma)
    return x.to(dtype)
