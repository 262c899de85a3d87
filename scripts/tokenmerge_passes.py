"""Following the sampling passes from the U-Net's own calls, for a host that calls no Script hook per pass
(``Host.calls_pass_hooks`` False: SD.Next). This file holds no state: the webui also loads it as a script
module."""

from __future__ import annotations

from typing import Any, Callable

from torch import nn

from scripts.tokenmerge_hosts import Host


class UnetCallPasses:
    """ToMe through the passes of one batch, driven by the U-Net's calls. Where the host calls no hook per
    sampling pass and none between the base and the hires pass (both run on this U-Net), hooks on the U-Net
    count its calls: each is one scheduler timestep of the running pipeline, which gives the step window its
    progress, and the last call of the base pass is where the hires pass's patch goes on (another ratio, or
    the first patch with "Hires fix only"). A patch changes only between U-Net calls, never inside one. Should
    a pass begin that was not foreseen (the host's hires flag changed, the pipeline did not tell its length),
    its patch goes on after its first call.

    Args:
        host: tells the pass under way (``is_hires_pass``) and its length (``pass_length``).
        p: the job's processing object.
        unet: the U-Net whose calls are followed.
        model: the current model, for ``pass_length`` (called as ``model()`` at each U-Net call).
        start_pass: patches for a pass (``start_pass(hires)``).
        report_progress: hands each call's progress in the pass (0..1, or None) to the patches.
        give_up: called with the error when following failed (the watch has removed itself by then).
        hires_follows: whether a hires pass follows the base pass.
    """

    def __init__(self, host: Host, p: Any, unet: nn.Module, *, model: Callable[[], Any],
                 start_pass: Callable[[bool], None], report_progress: Callable[[int, int | None], None],
                 give_up: Callable[[Exception], None], hires_follows: bool) -> None:
        self.host, self.p, self.model = host, p, model
        self.start, self.report_progress, self.give_up = start_pass, report_progress, give_up
        self.hires_follows = hires_follows
        self.hires = False
        self.calls = 0  # U-Net calls so far in the pass
        self.total: int | None = None  # U-Net calls the pass makes
        self.pending = False
        self.handles = [unet.register_forward_pre_hook(self._before_call, with_kwargs=True, prepend=True),
                        unet.register_forward_hook(self._after_call)]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def start_pass(self, hires: bool) -> None:
        self.hires, self.calls = hires, 0
        self.start(hires)

    def _guarded(self, step: Callable[[], None]) -> None:
        """Run ``step``; should it raise, stop following (the caller goes on without ToMe)."""
        try:
            step()
        except Exception as error:
            self.remove()
            self.give_up(error)

    def _before_call(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self._guarded(self._track_call)

    def _after_call(self, module: nn.Module, args: tuple, output: Any) -> None:
        self._guarded(self._count_call)

    def _track_call(self) -> None:
        hires = self.host.is_hires_pass(self.p)
        if hires != self.hires:
            self.hires, self.calls, self.pending = hires, 0, True
        self.total = self.host.pass_length(self.model())
        self.report_progress(self.calls, self.total)

    def _count_call(self) -> None:
        self.calls += 1
        if self.pending:
            self.pending = False
            self.start_pass(self.hires)
            self.calls = 1  # this call was the pass's first
        elif not self.hires and self.total is not None and self.calls >= self.total and self.hires_follows:
            self.start_pass(True)  # the base pass's last call: the hires pass comes next
