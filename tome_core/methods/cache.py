"""Step caching ("Cache" method): each selected transformer stack runs whole on the full steps, and on the steps
between every token gets the stack's output at the last full step, moved by the stack's gain times how far the
token's input has moved since, and by half the stack's drift for each step since (the gain and the drift
measured per image from the stack's last two full calls).

Why: a token's features change little from one sampling step to the next, a redundancy merging leaves alone. On
SDXL at 1024 px the transformer stacks of its deep attention level are 60% of a step's multiply-adds; a stack
skipped on 15 steps of 20 costs a few additions per token instead.

- Which stacks ("auto" levels): every attention level below the highest-resolution one (SDXL: its deep level
  alone). An ancestral sampler (Euler a, DPM++ 2S a, DPM++ SDE) adds fresh noise at every step; at the highest
  resolution it moves every token's input by half its size from one step to the next, so a change kept from an
  earlier step no longer fits, while each downsampling averages the noise out. On the SDXL-layout proxies with
  Euler a, reusing the first level's stacks on 11 steps of 20 ended 21 dB from the unmerged pictures, reusing
  the deep level's 58 dB.
- Which steps run full (``is_full_step``): the first ``cache_warmup`` steps (at least the first), then ever
  further apart, the gaps growing 2, 4, 6 ... up to ``cache_interval``; a step outside the step window runs
  full too. Early steps make the picture's layout, and a change reused there moves the final picture most (on
  the proxies, one early step reused moved it 30 to 100 times as much, in squared error, as one late step); late steps move it little. Steps are
  told apart by the progress the host reports (``set_progress``); where none is told, by the U-Net call's
  timestep (calls at one timestep are one evaluation), which costs a read of the timestep per call (on a GPU,
  a wait for the device).
- What is kept is the transformer's input and output at its boundary (norm, projections, every block and the
  residual inside), its gain (``fitted_gain``: how much of an input's move the output follows; 1 before a
  second full call) and its drift (``drift_per_step``: how far the output moved per step beyond what the
  input's move explains; none before a second full call), per batch row and per call slot (the order of a
  U-Net call within its sampling evaluation: cond and uncond apart, a second-order sampler's two evaluations
  of a step), or where the host names the parts of a call's batch (``set_call_rows``: ComfyUI's cond and
  uncond and each condition) per named part, so an image never depends on the batch it was made in nor on how
  the host split its calls, and a reused call takes what the same kind of call kept.
- A new run (progress or timestep going back: a new pass, a new job), a new image size or batch layout, and a
  restore each start afresh: nothing kept is ever applied to a call it was not made for.
- ControlNet's residuals and anything else outside the stacks change every step as usual: what is kept is only
  the stacks' own response, moved by their current input.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..families import first_arg, slot_value
from .base import CallClock, Method, MethodPatch, below_the_top_level


def _tensor_of(output: Any) -> torch.Tensor | None:
    """The sample a transformer call returned: ldm's tensor, diffusers' ``(sample,)`` or ``.sample``."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    sample = getattr(output, "sample", None)
    return sample if isinstance(sample, torch.Tensor) else None


def _form_of(output: Any) -> Any:
    """How a transformer call returned its sample: None (the tensor), ``tuple`` or the output's class."""
    if isinstance(output, torch.Tensor):
        return None
    return tuple if isinstance(output, tuple) else type(output)


def _like(form: Any, sample: torch.Tensor) -> Any:
    """``sample`` returned in ``form`` (see ``_form_of``)."""
    if form is None:
        return sample
    return (sample,) if form is tuple else form(sample=sample)


class _Kept:
    """A stack's last full call of one call slot: its input and output, (B, C, h, w); the stack's gain, (B, 1, 1,
    1) or 1.0 (see ``fitted_gain``); its drift, (B, C, h, w) or None (see ``drift_per_step``); the sampling
    evaluation it was made at; and the form its output took."""

    __slots__ = ("input", "output", "gain", "drift", "evaluation", "form")

    def __init__(self, input: torch.Tensor, output: torch.Tensor, gain: torch.Tensor | float,
                 drift: torch.Tensor | None, evaluation: int, form: Any) -> None:
        self.input, self.output, self.gain, self.form = input, output, gain, form
        self.drift, self.evaluation = drift, evaluation

    def fits(self, x: torch.Tensor) -> bool:
        i = self.input
        return i.shape == x.shape and i.dtype == x.dtype and i.device == x.device

    def reused(self, x: torch.Tensor, evaluation: int) -> torch.Tensor:
        """The stack's output for input ``x`` at sampling evaluation ``evaluation``: the kept output moved by the
        gain times the input's move, and by ``DRIFT_SHARE`` of its drift for each evaluation since."""
        out = self.output + self.gain * (x - self.input)
        if self.drift is not None and evaluation > self.evaluation:
            out.add_(self.drift, alpha=DRIFT_SHARE * (evaluation - self.evaluation))  # ``out`` is new: no copy
        return out

    def nbytes(self) -> int:
        tensors = [self.input, self.output] + [t for t in (self.gain, self.drift) if isinstance(t, torch.Tensor)]
        return sum(t.numel() * t.element_size() for t in tensors)


def fitted_gain(before: _Kept, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per batch row, (B, 1, 1, 1): the least-squares gain ``a`` of the stack's output move against its input
    move between two full calls, minimising |(y − y₀) − a·(x − x₀)|², in [0, 1.5]; 1 where the input did not move.

    Why: a stack's output is its input plus what its blocks add, and the blocks answer a moved input too (their
    norms and attention pull part of the move back), so the output moves less than the input. A gain of 1 (the
    input plus the kept change) carries all of an ancestral sampler's fresh noise through, where the stack
    would have damped part of it: on the SDXL-layout proxies with Euler a the fitted gain ended 3.6 to 7.8 dB
    closer to the unmerged pictures than a gain of 1. A fixed gain does not serve every model (0.9 gained 5.7 dB
    with Euler a on one proxy and lost 7.9 with Euler on another); measured per stack, image and run, it needs
    no setting. Reduced in float32, per row, so an image never depends on its batch."""
    dx = (x - before.input).flatten(1).float()
    dy = (y - before.output).flatten(1).float()
    moved = (dx * dx).sum(1)
    gain = torch.where(moved > 0, (dx * dy).sum(1) / moved.clamp_min(torch.finfo(torch.float32).tiny),
                       torch.ones_like(moved))
    return gain.clamp(0.0, 1.5).to(x.dtype).view(-1, *([1] * (x.dim() - 1)))


# How much of a stack's drift a reused call extrapolates: half. Measured on the deep-first SDXL-layout proxies
# (seeds 1 and 2, CFG 7, docs/methods.md#cache): half the drift ended 2.2 and 3.5 dB closer to the whole model's
# pictures than none with Euler, 3.2 with DPM++ 2M (seed 2), and about as close with Euler a (+0.6, −0.4); all
# of it 2.5 dB closer with Euler on seed 2 but 2.0 further with Euler a, whose fresh noise at every step is part
# of what a drift measures; a quarter gained less (1.5 dB on seed 1 with Euler). The drift is measured over the
# gap before the last full call, and sampling slows as it goes (the steps' moves shrink), so all of it overshoots.
DRIFT_SHARE = 0.5


def drift_per_step(before: _Kept, evaluation: int, x: torch.Tensor, y: torch.Tensor,
                   gain: torch.Tensor | float) -> torch.Tensor | None:
    """(B, C, h, w): how far the stack's output moved per sampling evaluation between its last two full calls
    beyond what its input's move explains, ``((y − y₀) − gain·(x − x₀)) / (evaluation − evaluation₀)``; None
    where no evaluation lies between them.

    Why: the gain follows the input, but what the blocks add also changes as the noise level falls (their
    attention sharpens as the picture forms), whatever the input does; a reused call that carries that change
    on, as a first-order step in sampling time, keeps closer to the whole stack than one that holds it where it
    was at the last full call."""
    steps = evaluation - before.evaluation
    if steps <= 0:
        return None
    return ((y - before.output) - gain * (x - before.input)) / steps


class CachedTransformer:
    """The forward set on a selected transformer's instance: the transformer's own (or the one another
    extension set before ours, ``previous``), or its kept output moved as its input moved (``_Kept.reused``)."""

    def __init__(self, module: nn.Module, owner: CachePatch, index: int) -> None:
        self.module, self.owner, self.index = module, owner, index
        self.previous = module.__dict__.get("forward")  # an instance forward set before ours, if any

    def run(self, *args: Any, **kwargs: Any) -> Any:
        if self.previous is not None:
            return self.previous(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        owner = self.owner
        x = first_arg(args, kwargs, owner.patch.family.tokens_keyword)
        parts = owner.parts
        if not (isinstance(x, torch.Tensor) and x.dim() == 4) or parts is None or x.shape[0] % len(parts):
            return self.run(*args, **kwargs)
        keys = [(part, self.index) for part in parts]
        xs = x.chunk(len(parts)) if len(parts) > 1 else (x,)
        kept = [owner.kept.get(key) for key in keys]
        kept = [k if k is not None and k.fits(xi) else None for k, xi in zip(kept, xs)]
        if owner.reusing and all(k is not None for k in kept) and len({k.form for k in kept}) == 1:
            reused = [k.reused(xi, owner.evaluation) for k, xi in zip(kept, xs)]
            return _like(kept[0].form, reused[0] if len(reused) == 1 else torch.cat(reused))
        output = self.run(*args, **kwargs)
        y = _tensor_of(output)
        if y is not None and y.shape == x.shape:  # a full call: also one nothing kept fitted
            ys = y.detach().chunk(len(parts)) if len(parts) > 1 else (y.detach(),)
            for key, before, xi, yi in zip(keys, kept, xs, ys):
                xi = xi.detach()
                gain = 1.0 if before is None else fitted_gain(before, xi, yi)
                drift = None if before is None else drift_per_step(before, owner.evaluation, xi, yi, gain)
                # Copies: a host may add to these tensors in place after the call (ControlNet's residuals in Forge).
                owner.kept[key] = _Kept(xi.clone(), yi.clone(), gain, drift, owner.evaluation, _form_of(output))
        else:  # an output of another shape: nothing stale stays
            for key in keys:
                owner.kept.pop(key, None)
        return output


def is_full_step(step: int, warmup: int, longest_gap: int) -> bool:
    """Whether sampling step ``step`` (0 first) runs the stacks whole: the first ``warmup`` steps (the first
    always: nothing is kept before it), then steps ever further apart, the gap after each one 2 longer than the
    last (2, 4, 6 ...) and at most ``longest_gap``. With 2 and 8: steps 0, 1, 3, 7, 13, 21, 29, 37 ..."""
    last = max(warmup, 1) - 1
    if step <= last:
        return True
    gap = 2
    while step > last:
        last += min(gap, longest_gap)
        gap += 2
    return step == last


def _timestep_of(timestep: Any) -> float | None:
    """A U-Net call's timestep as a number (the first row's), or None where it is not one."""
    if isinstance(timestep, torch.Tensor) and timestep.numel() > 0:
        return float(timestep.reshape(-1)[0])
    if isinstance(timestep, (int, float)) and not isinstance(timestep, bool):
        return float(timestep)
    return None


class CachePatch(MethodPatch):
    def __init__(self, patch) -> None:
        super().__init__(patch)
        # By (part, stack index): a part is the call's slot, or where the host names the parts of its batch
        # (``set_call_rows``) each part's name and occurrence in the evaluation (``CallClock.chunks``).
        self.kept: dict[tuple[Any, int], _Kept] = {}
        self._own: list[tuple[nn.Module, CachedTransformer]] = []
        # Where no progress is told: calls at one timestep are one evaluation, a higher one starts a run.
        self._timesteps = CallClock()
        self.parts: tuple | None = None  # what this call's batch is kept as, in order; None: run as unpatched
        self.reusing = False  # this call takes what was kept (where it fits)
        self.evaluation = 0  # this call's sampling evaluation, counted from the run's first
        # U-Net calls since the patch was made that the schedule runs whole, and that it reuses on (a call it
        # reuses on whose stacks have nothing kept that fits, the first at a new size, still runs them whole).
        self.scheduled_full = 0
        self.scheduled_reuses = 0

    def install(self) -> None:
        if not self.patch.has_call_hook:
            return  # a lone transformer: no U-Net call to place among the steps
        for index, (transformer, _) in enumerate(self.patch.transformers):
            forward = CachedTransformer(transformer, self, index)
            transformer.forward = forward
            self._own.append((transformer, forward))

    def begin_call(self, args: tuple, kwargs: dict) -> None:
        patch, o = self.patch, self.patch.options
        clock = patch.clock
        if clock.slot is None:  # no progress told: the timestep places the call
            clock = self._timesteps
            t = _timestep_of(slot_value(args, kwargs, *patch.family.timestep_slot))
            clock.tick(None if t is None else -t, patch.rows)
        if clock.slot is None:
            self.parts, self.reusing = None, False
            return
        if clock.new_run:
            self.kept.clear()
        self.evaluation = clock.evaluation
        full = is_full_step(clock.evaluation, o.cache_warmup, o.cache_interval)
        self.parts = clock.chunks if clock.chunks is not None else (clock.slot,)
        self.reusing = not full and o.in_window(patch.progress)
        if self.reusing:
            self.scheduled_reuses += 1
        else:
            self.scheduled_full += 1

    def start_afresh(self) -> None:
        self.kept.clear()  # each stack's next call runs whole: nothing fits it

    def kept_bytes(self) -> int:
        """Memory the kept calls take now (per call slot and selected stack, its input and output)."""
        return sum(k.nbytes() for k in self.kept.values())

    def uninstall(self) -> None:
        self.kept.clear()
        for module, ours in self._own:
            if module.__dict__.get("forward") is ours:
                if ours.previous is None:
                    del module.forward
                else:
                    module.forward = ours.previous
        self._own.clear()


METHOD = Method("cache", "Cache", ("cache_interval", "cache_warmup"), CachePatch,
                auto_levels=below_the_top_level, reuses_steps=True)
