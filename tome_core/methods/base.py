"""What a method is to the patch: its entry (``Method``), its live behaviour in one patch (``MethodPatch``), and
the hook pieces more than one method uses.

The patch (``tome_core.patch.TokenMergePatch``) owns what every method shares: the selected blocks and their
token grids, sampling progress and the step window, the U-Net call clock, the hooks' handles and the exact
restore. A method adds its hooks through ``patch.hook`` and keeps its own state between calls; the patch
calls it without knowing which method it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from ..families import Family, first_arg, set_slot, slot_value
from ..local import WINDOW

if TYPE_CHECKING:
    from ..patch import TokenMergePatch

def first_level(levels: list[int]) -> set[int]:
    """The highest-resolution level with attention (also SDXL's, at downsampling 2): where merging a block's
    self-attention gains most."""
    return {levels[0]}


def where_the_work_is(levels: list[int]) -> set[int]:
    """The highest-resolution attention level and, where that is not the latent's own resolution (SDXL: 17% of
    the work at its first attention level, 63% at the second), the next one too: where a method that reaches
    whole stacks gains."""
    return set(levels[:1] if levels[0] == 0 else levels[:2])


def below_the_top_level(levels: list[int]) -> set[int]:
    """Every attention level but the highest-resolution one (all of them where there is one): the levels an
    ancestral sampler's fresh noise moves least between steps, each downsampling averaging it out (SDXL: its
    deep level alone, 60% of the work at 1024 px)."""
    return set(levels[1:]) or set(levels)


@dataclass(frozen=True)
class Method:
    """One method, as every way in sees it: the engine, the settings, the UI, the infotext, the API, X/Y/Z.

    Attributes:
        name: the engine's value (``apply_patch(method=...)``), the lowercase of ``label``.
        label: the UI's choice, the infotext's, the API's and the X/Y/Z value (any case is accepted).
        reads: the user-facing options only this method reads: the advanced panel shows them while it is
            chosen. ``size_weighted_keys`` among them means its keys can stand for groups of unequal size.
        behaviour: the class of its live behaviour in one patch (a ``MethodPatch``).
        size_weighted_default: what the "Auto" size-weighted keys switch means for it.
        windowed: it groups tokens inside ``WINDOW``×``WINDOW`` windows, whose one kept token caps the ratio
            (the stride does for the others).
        auto_levels: the levels "auto" merge levels (``max_downsample=None``) selects, from the sorted levels
            that have attention: where the method gains on that U-Net (``first_level``,
            ``where_the_work_is``, ``below_the_top_level``).
        reuses_steps: it reuses work from one sampling step on later ones, so it cannot run beside a host's
            own step cache (which would skip the steps it keeps its work from).
    """

    name: str
    label: str
    reads: tuple[str, ...]
    behaviour: type[MethodPatch]
    size_weighted_default: bool = False
    windowed: bool = False
    auto_levels: Callable[[list[int]], set[int]] = first_level
    reuses_steps: bool = False

    def __post_init__(self) -> None:
        if self.name != self.label.lower():
            raise ValueError(f"method {self.label!r}: its name must be its label in lowercase, got {self.name!r}")

    @property
    def weighs_keys(self) -> bool:
        """Whether its self-attention keys can stand for groups of unequal size (``size_weighted_keys``)."""
        return "size_weighted_keys" in self.reads

    def cap_cell(self, sx: int, sy: int) -> tuple[int, int]:
        """The cell whose one kept token caps the ratio: the stride, or the 2×2 window."""
        return (WINDOW, WINDOW) if self.windowed else (sx, sy)


class MethodPatch:
    """One method's hooks and what it keeps between calls, in one patch.

    ``install`` adds its hooks with ``patch.hook``; ``begin_call`` runs at the start of every U-Net call (on
    U-Nets, where the patch sees the call); ``uninstall`` (at restore, after the patch removed the hooks) takes
    back anything else it set and forgets everything it keeps. It must leave a block with nothing to do
    running exactly its original code.
    """

    def __init__(self, patch: TokenMergePatch) -> None:
        self.patch = patch

    def install(self) -> None:
        raise NotImplementedError

    def begin_call(self, args: tuple, kwargs: dict) -> None:
        """A new U-Net call begins (``args``/``kwargs``: its arguments)."""

    def start_afresh(self) -> None:
        """Forget what was kept from earlier calls: the weights under the patch changed."""

    def uninstall(self) -> None:
        """Take back what ``install`` set beyond the hooks, and forget everything kept between calls."""


class CallClock:
    """Places each U-Net call among the sampling evaluations, from the progress the host reports (or any value
    that grows through a run: the Cache method, told none, ticks with the negated timestep).

    Calls with the same progress belong to one evaluation (cond and uncond apart, or a second-order step's two
    evaluations) and are numbered by their order in it (``slot``); a lower progress starts a new run
    (``new_run``: a new pass or job). The host's progress rather than the timestep: reading a device timestep
    would make the host wait for the device. Without progress, ``slot`` is None.

    Where the host says what each equal part of a call's batch is (``rows``: one hashable per part, such as
    ComfyUI's cond or uncond and the condition's id), ``chunks`` names each part by that and by how many parts
    of the same name came earlier in the evaluation (a second-order sampler's second evaluation of a step is
    the second occurrence). Unlike the slot, a chunk's name does not depend on whether the host ran the parts
    in one call or in several, nor in which order.
    """

    def __init__(self) -> None:
        self.evaluation = -1
        self.slot: int | None = None
        self.chunks: tuple[tuple[Any, int], ...] | None = None
        self.new_run = False
        self._last_progress: float | None = None
        self._seen: dict[Any, int] = {}

    def tick(self, progress: float | None, rows: tuple | None = None) -> None:
        """A new U-Net call at sampling ``progress``, its batch made of ``rows`` (see the class) if told."""
        self.new_run = False
        self.chunks = None
        if progress is None:
            self.slot = None
            return
        if self._last_progress is None or progress < self._last_progress:
            self.evaluation, self.slot, self.new_run = 0, 0, True
        elif progress == self._last_progress and self.slot is not None:
            self.slot += 1
        else:
            self.evaluation, self.slot = self.evaluation + 1, 0
        self._last_progress = progress
        if self.slot == 0:
            self._seen = {}
        if rows is not None:
            chunks = []
            for row in rows:
                chunks.append((row, self._seen.get(row, 0)))
                self._seen[row] = chunks[-1][1] + 1
            self.chunks = tuple(chunks)


class BlockRecord:
    """A transformer block of the patched U-Net and the state of its call under way.

    ``plan`` is what this block call acts with (None: it runs as unpatched), made from the input of
    ``input_shape`` (batch, tokens): an attention call on anything else (a subset of the batch, tiled tokens)
    runs as it would unpatched.
    """

    __slots__ = ("name", "index", "level", "module", "self_attention", "grid", "plan", "row", "input_shape",
                 "used", "key_bias")

    def __init__(self, name: str, index: int, level: int, module: nn.Module, family: Family) -> None:
        self.name, self.index, self.level, self.module = name, index, level, module
        self.self_attention = family.attends_to_image(module)
        self.grid: tuple[int, int] | None = None
        self.plan: Any = None
        self.input_shape: tuple[int, int] = (0, 0)
        self.used = False  # the plan reached at least one attention or MLP call of this block call
        # Size-weighted keys, where the family's attention takes no bias: (B, M) for attn1's call under way.
        self.key_bias: torch.Tensor | None = None
        self.row = 0  # its place among the selected blocks

    def take_key_bias(self) -> torch.Tensor | None:
        """The size-weighted keys' bias pending for attn1's call under way, once."""
        bias, self.key_bias = self.key_bias, None
        return bias

    def fits(self, x: Any) -> bool:
        """``x`` is laid out as the block input the plan was made for: same batch rows, same tokens."""
        return isinstance(x, torch.Tensor) and x.dim() == 3 and (x.shape[0], x.shape[1]) == self.input_shape


class BlockPlanMethod(MethodPatch):
    """A method that acts inside each selected block with a plan made at the block's entrance (``plan_for``)
    and dropped at its exit; ``hook_block`` adds what uses it."""

    def install(self) -> None:
        patch = self.patch
        for rec in patch.selected:
            block = rec.module
            patch.hook(block.register_forward_pre_hook(self._plan_maker(rec), with_kwargs=True))
            patch.hook(block.register_forward_hook(self._plan_dropper(rec)))
            if patch.weighs_keys and rec.self_attention:
                patch.take_key_bias_in_attention(rec)
            self.hook_block(rec)

    def plan_for(self, rec: BlockRecord, x: torch.Tensor) -> Any:
        """The plan of this call of ``rec`` from its input ``x``, or None to run it unpatched."""
        raise NotImplementedError

    def hook_block(self, rec: BlockRecord) -> None:
        raise NotImplementedError

    def _plan_maker(self, rec: BlockRecord):
        keyword = self.patch.family.tokens_keyword

        def hook(module, args, kwargs):
            x = first_arg(args, kwargs, keyword)
            rec.plan = self.plan_for(rec, x) if self.patch.acts_on(rec, x) else None
            rec.used = False
            if rec.plan is not None:
                rec.input_shape = (int(x.shape[0]), int(x.shape[1]))
        return hook

    def _plan_dropper(self, rec: BlockRecord):
        patch = self.patch

        def hook(module, args, output):
            if rec.plan is not None and not rec.used:
                patch.unused_plans += 1
            rec.plan = None
            rec.key_bias = None  # a bias no attn1 call took (an attn1 replacement) must not reach the next call
        return hook


def kv_reducer(patch: TokenMergePatch, rec: BlockRecord):
    """A pre-hook on ``rec``'s self-attention: keys and values from fewer tokens (``rec.plan.merge``: ToDo's
    downsampled grid, or the tokens the local plan keeps), queries whole."""
    family = patch.family
    kv_source = family.kv_slots[0]

    def hook(module, args, kwargs):
        plan = rec.plan
        if plan is None or not rec.self_attention:
            return None
        x = first_arg(args, kwargs, family.tokens_keyword)
        if not (rec.fits(x) and plan.fits(x)):
            # Called on rows or tokens the plan was not made for (ControlNet's reference mode attends with the
            # unconditional rows alone, HyperTile tiles the tokens): exact attention on that input.
            patch.unmerged_calls += 1
            return None
        rec.used = True
        args, kwargs = list(args), dict(kwargs)
        if slot_value(args, kwargs, *kv_source) is None:  # keys and values would come from x itself
            set_slot(args, kwargs, *kv_source, plan.merge(x))
        else:
            map_kv_sources(args, kwargs, x, plan.merge, {}, family.kv_slots)
        if patch.weighs_keys:
            add_key_bias(family, rec, kwargs, plan.key_log_sizes(x.dtype))
        return tuple(args), kwargs
    return hook


def per_token(t: Any, x: torch.Tensor) -> bool:
    """``t`` holds one row per token of ``x`` (so a merge plan or the token grid applies to it)."""
    return isinstance(t, torch.Tensor) and t.dim() == 3 and t.shape[:2] == x.shape[:2]


def map_kv_sources(args: list, kwargs: dict, x: torch.Tensor, fn, done: dict, slots: tuple) -> None:
    """Apply ``fn`` in place to each explicitly passed key/value source that has one row per token of ``x``;
    ``done`` maps ids of tensors already mapped (Forge passes the same tensor as x, context and value).
    Sources of another length (text, extra reference tokens) stay as they are. ``slots``: the family's
    ``kv_slots``."""
    for index, name in slots:
        t = slot_value(args, kwargs, index, name)
        if not per_token(t, x):
            continue
        if id(t) not in done:
            done[id(t)] = fn(t)
        set_slot(args, kwargs, index, name, done[id(t)])


def add_key_bias(family: Family, rec: BlockRecord, kwargs: dict, log_sizes: torch.Tensor) -> None:
    """Hand self-attention's call the log of the tokens each key stands for (B, M), added to every query's
    logit for that key: the family's bias argument (B, 1, M), where its attention takes one and the caller
    passed none; else the record, which the family's ``biased_attention`` takes it from."""
    if family.bias_keyword is None:
        rec.key_bias = log_sizes
    elif kwargs.get(family.bias_keyword) is None:
        kwargs[family.bias_keyword] = log_sizes[:, None, :]


def default_index_dtype(device: torch.device) -> torch.dtype:
    """int32 on Apple's MPS, whose int64 support is partial (no negation, some gathers); int64 elsewhere."""
    return torch.int32 if device.type == "mps" else torch.int64
