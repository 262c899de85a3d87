"""One sampling run's patch, for a host that sees a run begin and end and knows its noise schedule (ComfyUI's
sampler wrappers; a hand-written diffusers loop could use it the same way).

A host whose model object is shared (ComfyUI shares one U-Net module among every clone of a model) must patch
it exactly for the run that asked and give it back after, whatever happens: ``SamplingRun`` is that scope, as
a context manager. Inside it the host reports what it sees, and the run turns it into what the engine reads:
- ``step_reported(i)``: the sampler reported step ``i`` (its per-step callback, which k-diffusion's samplers
  call right after each step's first evaluation);
- ``before_call(sigma, rows)``: a U-Net call is about to run at noise level ``sigma``, its batch made of
  ``rows`` (one name per equal part: cond or uncond and the condition's id), or None where unknown.

Progress is that of the step each evaluation belongs to (``evaluation_progress``), as in the WebUI: a
second-order sampler's evaluations of one step share it. The noise level alone cannot say which step an
evaluation belongs to (Heun evaluates its correction at the next step's sigma; DPM++ 2S a, with its noise, at
one that may lie below it), so the run counts: calls at one sigma with no part named twice are one evaluation;
after step ``r`` is reported, the evaluations before the next step's first belong to step ``r``; and how many
evaluations a step makes is learnt between the first two reports. Until then, an evaluation above step 1's
sigma belongs to step 0 and one at or below it to step 1; where that took a corrector of step 0 for step 1's
(Heun, DPM++ 2S a), what Cache kept from those steps is dropped, so its first reused step runs whole. A sampler
that reports no step is placed by sigma alone: the step whose sigma is the last not below the call's.
"""

from __future__ import annotations

from typing import Any, Hashable, Mapping, Sequence

from .patch import apply_patch, remove_patch, set_call_rows, set_progress, start_afresh
from .settings import evaluation_progress


class SamplingRun:
    """The patch of one sampling run of ``model`` with ``options`` (``apply_patch``'s keywords), over the noise
    schedule ``sigmas`` (the run's, highest first, ending at its last, often 0).

    ``with SamplingRun(...) as run:`` patches on entry (raising as ``apply_patch`` does, with the model left as
    it was) and removes the patch on exit, on success, error or interrupt alike.
    """

    def __init__(self, model: Any, options: Mapping[str, Any], sigmas: Sequence[float]) -> None:
        self.model = model
        self.options = dict(options)
        self.sigmas = [float(s) for s in sigmas]
        self.steps = max(len(self.sigmas) - 1, 1)
        self.reported = -1  # the last step the sampler reported
        self.per_step: int | None = None  # evaluations a step makes, once learnt
        self._since_report: list[int] = []  # the step given to each evaluation since the last report
        self._evaluation: tuple[float | None, set, int] | None = None  # the one under way: sigma, names, step

    def __enter__(self) -> SamplingRun:
        apply_patch(self.model, **self.options)
        return self

    def __exit__(self, *exc: Any) -> bool:
        remove_patch(self.model)
        return False

    def step_reported(self, index: int) -> None:
        """The sampler reported its step ``index`` (0 first), after that step's first evaluation."""
        index = int(index)
        if index <= self.reported:
            return
        if self.reported == 0 and index == 1 and self.per_step is None:
            self.per_step = len(self._since_report)  # step 0's later evaluations, then step 1's first
            if any(step == 1 for step in self._since_report[:-1]):
                start_afresh(self.model)  # a later evaluation of step 0 was taken for step 1's
        self.reported = index
        self._since_report = []
        self._evaluation = None  # the step's first evaluation is over: the next call starts another

    def _interval(self, sigma: float | None) -> int:
        if sigma is None:
            return max(self.reported, 0)
        return max(sum(1 for s in self.sigmas[:self.steps] if s >= sigma * (1 - 1e-5)) - 1, 0)

    def step_of_next_evaluation(self, sigma: float | None) -> int:
        """The step a new evaluation at ``sigma`` belongs to (see the module)."""
        r = self.reported
        if r < 0:
            return self._interval(sigma)
        if self.per_step is None:
            after = self.sigmas[min(r + 1, self.steps)]
            return r if sigma is not None and sigma > after * (1 + 1e-5) else r + 1
        return r if len(self._since_report) < self.per_step - 1 else r + 1

    def before_call(self, sigma: float | None, rows: Sequence[Hashable] | None = None) -> None:
        """A U-Net call at ``sigma`` is next, its batch made of ``rows`` (see ``set_call_rows``) if known."""
        names = tuple(rows) if rows is not None else ()
        current = self._evaluation
        if current is None or current[0] != sigma or any(name in current[1] for name in names):
            current = (sigma, set(), self.step_of_next_evaluation(sigma))
            self._evaluation = current
            self._since_report.append(current[2])
        current[1].update(names)
        set_progress(self.model, evaluation_progress(min(current[2], self.steps - 1), self.steps))
        set_call_rows(self.model, rows)
