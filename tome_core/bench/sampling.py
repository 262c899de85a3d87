"""A short deterministic sampling run: Euler steps on SD's discrete schedule, from given noise.

The same noise and timesteps with and without a merging method give two final pictures whose difference is
what the method costs. Timesteps are whole numbers spread evenly from the last to the first (as the webui's
"Euler" with the default schedule does up to rounding), so nothing depends on interpolating the schedule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from .pipeline import Pipeline, prompt_contexts


def timesteps_and_sigmas(alphas_cumprod: torch.Tensor, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(steps,) integer timesteps from the last to the first, and (steps + 1,) float64 sigmas ending in 0."""
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    last = len(alphas_cumprod) - 1
    ts = torch.linspace(last, 0, steps, dtype=torch.float64).round().long()
    sigmas = ((1 - alphas_cumprod[ts]) / alphas_cumprod[ts]).sqrt()
    return ts, torch.cat([sigmas, sigmas.new_zeros(1)])


DEFAULT_CFG = 7.0
"""The guidance scale a prompted run uses unless told (``--cfg``): the webui's default, amid the 5 to 8 users
run."""


@dataclass(frozen=True)
class Guidance:
    """Classifier-free guidance as the webui samples with it: each step evaluates the U-Net with each image's
    prompt (``cond``, (B, T, C)) and with the empty prompt (the pipeline's ``context``), and moves along
    uncond + ``scale``·(cond − uncond). ``batched``: both halves in one U-Net call, the prompts' rows first (as
    the webui batches them); else two calls a step, the prompts' first (as a low-memory host runs them)."""

    cond: torch.Tensor
    scale: float = DEFAULT_CFG
    batched: bool = True

    @property
    def label(self) -> str:
        return f"CFG {self.scale:g}, cond and uncond {'batched' if self.batched else 'apart'}"


def guidance_for(pipe: Pipeline, images: int, scale: float | None = DEFAULT_CFG, batched: bool = True,
                 shift: int = 0) -> Guidance | None:
    """The guidance a run of ``images`` pictures samples with: ``pipe``'s prompts in turn (``prompt_contexts``)
    at ``scale``; None for a pipeline without prompts (its one conditioning is the empty prompt, so guidance
    would change nothing but the cost) or a scale of None."""
    cond = prompt_contexts(pipe, images, shift)
    if cond is None or scale is None:
        return None
    return Guidance(cond, float(scale), batched)


def _to_denoised(pipe: Pipeline, x: torch.Tensor, out: torch.Tensor, sigma: float) -> torch.Tensor:
    """The clean-sample estimate from the U-Net's output ``out`` (float64) for input ``x`` at ``sigma``."""
    if pipe.prediction == "v":
        return x / (sigma ** 2 + 1) - out * sigma / (sigma ** 2 + 1) ** 0.5
    return x - out * sigma


def _call(pipe: Pipeline, x: torch.Tensor, sigma: float, timestep: int, context: torch.Tensor) -> torch.Tensor:
    """One U-Net call on ``x`` (B, channels, h, w) float64 with ``context`` (B, T, C): its clean-sample
    estimate (float64)."""
    dtype = next(pipe.unet.parameters()).dtype
    device, b = x.device, x.shape[0]
    kwargs = {"context": context.to(device, dtype)}
    if pipe.y is not None:
        kwargs["y"] = pipe.y.to(device, dtype).expand(b, *pipe.y.shape[1:])
    scale_in = 1.0 / (sigma ** 2 + 1) ** 0.5
    t = torch.full((b,), int(timestep), device=device, dtype=torch.long)
    return _to_denoised(pipe, x, pipe.unet((x * scale_in).to(dtype), t, **kwargs).double(), sigma)


@torch.no_grad()
def denoise(pipe: Pipeline, x: torch.Tensor, sigma: float, timestep: int,
            guidance: Guidance | None = None) -> torch.Tensor:
    """The U-Net's estimate of the clean sample (float64, x's shape) from ``x`` (B, channels, h, w), float64,
    at noise level ``sigma`` (k-diffusion's parametrisation: x = x0 + sigma·ε) and discrete ``timestep``:
    with the empty prompt, or with ``guidance``."""
    b = x.shape[0]
    uncond = pipe.context.expand(b, *pipe.context.shape[1:])
    if guidance is None:
        return _call(pipe, x, sigma, timestep, uncond)
    cond = guidance.cond.to(uncond.device, uncond.dtype)
    if guidance.batched:
        both = _call(pipe, torch.cat([x, x]), sigma, timestep, torch.cat([cond, uncond]))
        with_prompt, without = both[:b], both[b:]
    else:
        with_prompt = _call(pipe, x, sigma, timestep, cond)
        without = _call(pipe, x, sigma, timestep, uncond)
    return without + guidance.scale * (with_prompt - without)


@torch.no_grad()
def euler_sample(pipe: Pipeline, noise: torch.Tensor, steps: int,
                 before_step: Callable[[int, int], None] | None = None,
                 after_step: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None,
                 guidance: Guidance | None = None) -> torch.Tensor:
    """Sample from ``noise`` (B, channels, h, w), unit variance, with ``steps`` Euler steps (with ``guidance``:
    classifier-free guided).

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
        denoised = denoise(pipe, x, sigma, int(ts[i]), guidance)
        if after_step is not None:
            after_step(i, x, denoised)
        x = x + (x - denoised) / sigma * (sigma_next - sigma)
    return x.to(dtype)


SAMPLERS = ("euler", "euler_a", "dpmpp_2m")
"""The samplers a fidelity run can use, as the webui names them: "Euler", "Euler a" (fresh noise at every step,
as every ancestral sampler adds) and "DPM++ 2M" (second order from the last two estimates)."""
SAMPLER_LABELS = {"euler": "Euler", "euler_a": "Euler a", "dpmpp_2m": "DPM++ 2M"}


@torch.no_grad()
def sample(pipe: Pipeline, noise: torch.Tensor, steps: int, sampler: str = "euler", seed: int = 0,
           before_step: Callable[[int, int], None] | None = None, guidance: Guidance | None = None) -> torch.Tensor:
    """Sample from ``noise`` (B, channels, h, w), unit variance, with ``steps`` steps of ``sampler`` (one of
    ``SAMPLERS``, the formulas k-diffusion's samplers of those names use, on the schedule of ``euler_sample``).
    Euler a's fresh noise comes from a CPU generator seeded with ``seed``, one draw per step, so every method
    gets the same noise. ``before_step(i, steps)`` runs before each step's U-Net calls; ``guidance``: classifier-
    free guided (``Guidance``). Returns the final sample in the U-Net's dtype."""
    if sampler == "euler":
        return euler_sample(pipe, noise, steps, before_step=before_step, guidance=guidance)
    if sampler not in SAMPLERS:
        raise ValueError(f"sampler must be one of {', '.join(SAMPLERS)}, got {sampler!r}")
    ts, sigmas = timesteps_and_sigmas(pipe.alphas_cumprod, steps)
    dtype = next(pipe.unet.parameters()).dtype
    x = noise.double() * sigmas[0].item()
    gen = torch.Generator().manual_seed(seed)
    old_denoised = None
    for i in range(steps):
        sigma, sigma_next = sigmas[i].item(), sigmas[i + 1].item()
        if before_step is not None:
            before_step(i, steps)
        denoised = denoise(pipe, x, sigma, int(ts[i]), guidance)
        if sampler == "euler_a":
            up = min(sigma_next, (sigma_next ** 2 * (sigma ** 2 - sigma_next ** 2) / sigma ** 2) ** 0.5)
            down = (sigma_next ** 2 - up ** 2) ** 0.5
            x = x + (x - denoised) / sigma * (down - sigma)
            if sigma_next > 0:
                x = x + torch.randn(x.shape, generator=gen, dtype=torch.float64).to(x.device) * up
        else:  # DPM++ 2M: in t = −log σ, a first-order step, then the last two estimates' second-order one
            if sigma_next == 0:
                x = denoised
            else:
                h = math.log(sigma / sigma_next)
                if old_denoised is None:
                    target = denoised
                else:
                    r = math.log(sigmas[i - 1].item() / sigma) / h
                    target = (1 + 1 / (2 * r)) * denoised - (1 / (2 * r)) * old_denoised
                x = (sigma_next / sigma) * x - math.expm1(-h) * target
            old_denoised = denoised
    return x.to(dtype)
