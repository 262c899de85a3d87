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
def denoise(pipe: Pipeline, x: torch.Tensor, sigma: float, timestep: int) -> torch.Tensor:
    """The U-Net's estimate of the clean sample (float64, x's shape) from ``x`` (B, channels, h, w), float64,
    at noise level ``sigma`` (k-diffusion's parametrisation: x = x0 + sigma·ε) and discrete ``timestep``."""
    dtype = next(pipe.unet.parameters()).dtype
    device, b = x.device, x.shape[0]
    context = pipe.context.to(device, dtype).expand(b, *pipe.context.shape[1:])
    kwargs = {"context": context}
    if pipe.y is not None:
        kwargs["y"] = pipe.y.to(device, dtype).expand(b, *pipe.y.shape[1:])
    scale_in = 1.0 / (sigma ** 2 + 1) ** 0.5
    t = torch.full((b,), int(timestep), device=device, dtype=torch.long)
    out = pipe.unet((x * scale_in).to(dtype), t, **kwargs).double()
    if pipe.prediction == "v":
        return x / (sigma ** 2 + 1) - out * sigma / (sigma ** 2 + 1) ** 0.5
    return x - out * sigma


@torch.no_grad()
def euler_sample(pipe: Pipeline, noise: torch.Tensor, steps: int,
                 before_step: Callable[[int, int], None] | None = None,
                 after_step: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None) -> torch.Tensor:
    """Sample from ``noise`` (B, channels, h, w), unit variance, with ``steps`` Euler steps.

    ``before_step(i, steps)`` runs before each U-Net call (for example to set a step window's progress);
    ``after_step(i, x, denoised)`` after it, with the step's input ``x`` and the U-Net's clean-sample estimate
    (both float64). Returns the final sample (B, channels, h, w) in the U-Net's dtype.
    """
    ts, sigmas = timesteps_and_sigmas(pipe.alphas_cumprod, steps)
    dtype = next(pipe.unet.parameters()).dtype
    x = noise.double() * sigmas[0].item()
    for i in range(steps):
        sigma, sigma_next = sigmas[i].item(), sigmas[i + 1].item()
        if before_step is not None:
            before_step(i, steps)
        denoised = denoise(pipe, x, sigma, int(ts[i]))
        if after_step is not None:
            after_step(i, x, denoised)
        x = x + (x - denoised) / sigma * (sigma_next - sigma)
    return x.to(dtype)
