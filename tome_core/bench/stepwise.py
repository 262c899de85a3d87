"""What a method does to one step's prediction, along the unmerged run's own trajectory.

The final-picture figure (``fidelity``) follows each method's own 20-step trajectory: where a merge flips a
discrete choice early (which token goes where, a texture's phase), the trajectories part and the final pictures
can differ far more than any one step's prediction did, and by an amount that depends on the model and the
noise. This measure cannot be amplified that way: at every step of the unmerged run, the patched U-Net is
given the very input the unmerged one got (the same x_t, timestep and conditioning, and the same progress told
to the patch as the webui tells it), and only the two predictions are compared.

The figure (the benchmark's "step dB"), per image: the noise each prediction implies, ε = (x_t − x̂0) / σ (what
an eps model outputs; a v model's output converted), its squared error against the unmerged ε, each step's
weighed by how far that step moves the sample, over the unmerged ε's power weighed alike, in dB:
``-10·log10(Σ_i w_i·‖ε_m − ε‖² / Σ_i w_i·‖ε‖²)`` with w_i = (σ_i − σ_{i+1})² (``sample_weights``). An Euler
step moves the sample by (σ_{i+1} − σ_i)·ε, so an error in a late, low-noise step's prediction moves the picture
little and an early one's much; weighing every step alike (``relative_error``) ranked a method whose error
differs from step to step (Cache's reused steps) against the final pictures. 20 dB means a tenth of the
prediction moved, 40 dB a hundredth; ∞: no step moved. It is measured in the sampled space (latents for SD),
no decoder needed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

import tome_core

from .contenders import Contender, Wrapped
from .pipeline import Pipeline
from .sampling import Guidance, denoise, euler_sample, timesteps_and_sigmas

NOT_MEASURED = ("ideal",)  # a speed bound: its repeated tokens predict nothing worth comparing


@dataclass
class Trajectory:
    """The unmerged run's inputs and predictions at every step: ``inputs`` (steps, B, C, h, w) float64 on the
    CPU, ``denoised`` likewise, the step's ``sigmas`` (steps,) and integer ``timesteps`` (steps,)."""

    inputs: torch.Tensor
    denoised: torch.Tensor
    sigmas: list[float]
    timesteps: list[int]
    guidance: Guidance | None = None  # what the run was guided by; every prediction along it is guided alike

    @property
    def steps(self) -> int:
        return len(self.sigmas)


def reference_trajectory(pipe: Pipeline, noise: torch.Tensor, steps: int,
                         guidance: Guidance | None = None) -> tuple[Trajectory, torch.Tensor]:
    """Sample from ``noise`` unmerged (``pipe.unet`` as it is), with ``guidance`` if given, recording every
    step; returns the trajectory and the final sample (as ``euler_sample`` returns it)."""
    ts, sigmas = timesteps_and_sigmas(pipe.alphas_cumprod, steps)
    inputs, denoised = [], []

    def record(i: int, x: torch.Tensor, estimate: torch.Tensor) -> None:
        inputs.append(x.detach().cpu())
        denoised.append(estimate.detach().cpu())

    final = euler_sample(pipe, noise, steps, after_step=record, guidance=guidance)
    return Trajectory(torch.stack(inputs), torch.stack(denoised), [float(s) for s in sigmas[:steps]],
                      [int(t) for t in ts], guidance), final


def _noise_errors(reference: torch.Tensor, other: torch.Tensor, inputs: torch.Tensor, sigmas: list[float]
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(steps, B) each: ‖ε_other − ε_ref‖² and ‖ε_ref‖², where ε = (x_t − x̂0) / σ."""
    sig = torch.tensor(sigmas, dtype=torch.float64).view(-1, *([1] * (reference.dim() - 1)))
    eps_ref = (inputs - reference) / sig
    eps_other = (inputs - other) / sig
    error = (eps_other - eps_ref).pow(2).flatten(2).sum(-1)
    return error, eps_ref.pow(2).flatten(2).sum(-1).clamp_min(1e-300)


def relative_error(reference: torch.Tensor, other: torch.Tensor, inputs: torch.Tensor,
                   sigmas: list[float]) -> torch.Tensor:
    """Per image (B,): the mean over steps of ‖ε_other − ε_ref‖² / ‖ε_ref‖², where ε = (x_t − x̂0) / σ.

    reference, other: clean-sample estimates (steps, B, C, h, w); inputs: the steps' x_t, same shape."""
    error, power = _noise_errors(reference, other, inputs, sigmas)
    return (error / power).mean(0)


def sample_weights(sigmas: list[float]) -> torch.Tensor:
    """(steps,) float64: (σ_i − σ_{i+1})², σ 0 after the last step: how far an Euler step moves the sample per
    unit of predicted noise (x_{i+1} = x_i + (σ_{i+1} − σ_i)·ε), squared."""
    ends = list(sigmas) + [0.0]
    return torch.tensor([(ends[i] - ends[i + 1]) ** 2 for i in range(len(sigmas))], dtype=torch.float64)


def weighted_relative_error(reference: torch.Tensor, other: torch.Tensor, inputs: torch.Tensor,
                            sigmas: list[float]) -> torch.Tensor:
    """Per image (B,): Σ_i w_i·‖ε_other − ε_ref‖² / Σ_i w_i·‖ε_ref‖², w = ``sample_weights``: each step's error
    weighed by how far that step moves the sample, so that a late, low-noise step's error (a short move) counts
    little and an early one's much, as in the final picture. Same arguments as ``relative_error``."""
    error, power = _noise_errors(reference, other, inputs, sigmas)
    w = sample_weights(sigmas).view(-1, 1)
    return (w * error).sum(0) / (w * power).sum(0)


def summed_relative_error(reference: torch.Tensor, other: torch.Tensor, inputs: torch.Tensor,
                          sigmas: list[float]) -> torch.Tensor:
    """Per image (B,): ‖Σ_i (σ_{i+1} − σ_i)·(ε_other − ε_ref)_i‖² / ‖Σ_i (σ_{i+1} − σ_i)·ε_ref,i‖²: the Euler moves'
    errors added up before they are squared, as they would add in the final sample if no error changed a later
    step's input (errors of one sign from step to step add up, errors that alternate cancel), over the whole
    run's move. Same arguments as ``relative_error``."""
    sig = torch.tensor(sigmas, dtype=torch.float64).view(-1, *([1] * (reference.dim() - 1)))
    ends = list(sigmas) + [0.0]
    move = torch.tensor([ends[i + 1] - ends[i] for i in range(len(sigmas))], dtype=torch.float64
                        ).view(-1, *([1] * (reference.dim() - 1)))
    eps_ref = (inputs - reference) / sig
    eps_other = (inputs - other) / sig
    error = (move * (eps_other - eps_ref)).sum(0).pow(2).flatten(1).sum(-1)
    return error / (move * eps_ref).sum(0).pow(2).flatten(1).sum(-1).clamp_min(1e-300)


def to_db(relative: float) -> float:
    """A mean relative squared error as dB (∞ for none)."""
    return math.inf if relative <= 0 else -10.0 * math.log10(relative)


def predictions_along(pipe: Pipeline, wrapped: Wrapped, trajectory: Trajectory,
                      device: torch.device | None = None) -> torch.Tensor:
    """(steps, B, C, h, w) on the CPU: the clean-sample estimates of ``pipe.unet`` as it is patched now (through
    ``wrapped``, the nesting it was patched in) at each step's input of ``trajectory``, one call a step in the
    sampling order, with each step's progress told to the patch first, as the webui and the sampling runs tell
    it (a method that acts by step, Cache, places its calls by it)."""
    device = device or next(pipe.unet.parameters()).device
    estimates = []
    for i in range(trajectory.steps):
        tome_core.set_progress(wrapped, (i + 0.5) / trajectory.steps)
        estimates.append(denoise(pipe, trajectory.inputs[i].to(device), trajectory.sigmas[i],
                                 trajectory.timesteps[i], trajectory.guidance).cpu())
    return torch.stack(estimates)


def step_errors(pipe: Pipeline, racers: list[Contender], trajectory: Trajectory, seed: int = 0,
                device: torch.device | None = None, on_done=None) -> dict[str, list[float]]:
    """Each contender's one-step figure (``weighted_relative_error``) in dB per image along ``trajectory`` (no
    merging: ∞), its predictions from ``predictions_along`` (the global RNG seeded first, for tomesd's
    partition generator); ``on_done(name)`` after each."""
    wrapped = Wrapped(pipe.unet)
    out: dict[str, list[float]] = {}
    for racer in racers:
        if racer.method in NOT_MEASURED:
            continue
        if racer.method == "none":  # the trajectory's own predictions
            out[racer.name] = [math.inf] * trajectory.inputs.shape[1]
        else:
            torch.manual_seed(seed)
            racer.apply(wrapped)
            try:
                estimates = predictions_along(pipe, wrapped, trajectory, device)
            finally:
                racer.remove(wrapped)
            rel = weighted_relative_error(trajectory.denoised, estimates, trajectory.inputs, trajectory.sigmas)
            out[racer.name] = [to_db(float(v)) for v in rel]
        if on_done is not None:
            on_done(racer.name)
    return out
