"""What the benchmark races, each as a way to patch a model and undo it.

- ``none``: the model as it is.
- ``ToMe``: ours, ``tome_core.apply_patch``.
- ``tomesd``: tomesd 0.1.3 with the same options (when installed).
- ``ToDo``: ours with ``method="todo"``: self-attention's keys and values from a grid downsampled by a factor f
  per side (1/f² of them), queries whole.
- ``Local``: ours with ``method="local"``: self-attention's keys and values from the tokens one plan per level
  and call keeps in 2×2 windows; queries whole.
- ``ideal``: the blocks ours patches run self-attention on the N − r tokens it would keep, but chosen for
  free: the first N − r, no similarity, no matching, no merge; the output goes back to N tokens by a repeat.
  No merging method can be faster, so (speed-up − 1) / (ideal − 1) is the share of what merging can give
  that a method delivers; the rest is its overhead. ToMe and tomesd are measured against it.
- ``ideal KV``: the same blocks' self-attention with every query but only the first N − r tokens as keys and
  values: what a method that keeps queries whole (Local) can gain at that ratio; Local is measured against it.
- ``Stack``: ours with ``method="stack"``: each patched transformer stack's tokens merged once at its entrance,
  every block of it on the merged tokens, restored once at its exit.
- ``ideal S``: every block of the stacks Stack patches on the first N − r tokens, taken at the stack's entrance
  for free and repeated back to N at its exit: what a whole-stack method can gain at that ratio; Stack is
  measured against it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

import tome_core
from tome_core.families import DIFFUSERS, family_of
from tome_core.patch import transformer_levels


@dataclass(frozen=True)
class Contender:
    """``apply(model)`` patches the model (a U-Net or any module tree holding SpatialTransformers, wrapped as
    ``model.model.diffusion_model``), ``remove(model)`` restores it exactly."""

    name: str
    apply: Callable[[nn.Module], None]
    remove: Callable[[nn.Module], None]
    method: str = ""  # what the tables call it: "none", "ToMe", "ToDo", "tomesd", "ideal"
    setting: str = ""  # its setting as the tables show it: "0.50" (a ratio), "f=2" (ToDo's factor)
    ideal: str | None = None  # the name of the ideal whose gain this contender's share is taken of


class Wrapped(nn.Module):
    """The ``model.model.diffusion_model`` nesting tomesd insists on, around a U-Net or a lone transformer."""

    def __init__(self, unet: nn.Module) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.diffusion_model = unet


def tomesd_target(model: nn.Module) -> nn.Module:
    """What tomesd is to be given: a diffusers U-Net itself (tomesd tells diffusers models by their class, and
    patches anything else as ldm), else the ``model.model.diffusion_model`` nesting."""
    root = tome_core.resolve_unet(model)
    return root if family_of(root) is DIFFUSERS else model


def tomesd_available() -> bool:
    try:
        import tomesd  # noqa: F401
        return True
    except ImportError:
        return False


class IdealPatch:
    """Self-attention on the first N − r tokens of each block ours patches, its output repeated back to N.

    r is what ours removes: int(N · ratio), capped at the sources of the sy×sx stride grid (N minus one
    destination per whole cell). Grids smaller than one cell are left alone, as ours leaves them.
    """

    def __init__(self, ratio: float, max_downsample: int | None, sx: int = 2, sy: int = 2,
                 keys_only: bool = False, whole_stacks: bool = False) -> None:
        self.ratio, self.max_downsample, self.sx, self.sy = ratio, max_downsample, sx, sy
        self.keys_only = keys_only  # every query, keys and values from the first N − r tokens
        self.whole_stacks = whole_stacks  # every block of a stack on the first N − r tokens (Stack's count)
        self._handles: list = []

    def apply(self, model: nn.Module) -> None:
        root = tome_core.resolve_unet(model)
        # The same blocks as ours, by asking ours which it patches.
        tome_core.apply_patch(root, ratio=self.ratio, max_downsample=self.max_downsample, sx=self.sx, sy=self.sy)
        blocks = {id(b.block) for b in tome_core.patched_blocks(root)}
        tome_core.remove_patch(root)
        self.remove(model)
        family = family_of(root)
        self.tokens, self.kv_source = family.tokens_keyword, family.kv_slots[0]
        for _, transformer, _ in transformer_levels(root):
            selected = [blk for blk in transformer.transformer_blocks if id(blk) in blocks]
            if not selected:
                continue
            grid: dict[str, tuple[int, int]] = {}
            self._handles.append(transformer.register_forward_pre_hook(_grid_recorder(grid, self.tokens),
                                                                      with_kwargs=True))
            if self.whole_stacks:
                kept: dict[str, int] = {}
                self._handles.append(selected[0].register_forward_pre_hook(self._stack_shrinker(grid, kept),
                                                                           with_kwargs=True))
                self._handles.append(selected[-1].register_forward_hook(_repeater(kept)))
                continue
            for blk in selected:
                kept: dict[str, int] = {}
                self._handles.append(blk.attn1.register_forward_pre_hook(self._shrinker(grid, kept),
                                                                         with_kwargs=True))
                if not self.keys_only:
                    self._handles.append(blk.attn1.register_forward_hook(_repeater(kept)))

    def remove(self, model: nn.Module | None = None) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def kept_tokens(self, h: int, w: int) -> int:
        """N − r for an h×w grid (N when nothing would merge): r as ours removes it (ToMe, or Local for the
        keys-and-values ideal)."""
        n = h * w
        cells = (h // self.sy) * (w // self.sx)
        cell = self.sx * self.sy
        if self.keys_only or self.whole_stacks:
            # Local's and Stack's count: merges in whole cells only (odd grids' edge tokens never merge)
            r = min(int(cell * cells * self.ratio), (cell - 1) * cells)
        else:  # ToMe's: int(N·ratio), capped at one destination per whole cell
            r = min(int(n * self.ratio), n - cells)
        return n if cells == 0 or r <= 0 else n - r

    def _shrinker(self, grid: dict, kept: dict):
        position, keyword = self.kv_source

        def hook(module, args, kwargs):
            x = args[0] if args else kwargs[self.tokens]
            context = args[position] if len(args) > position else kwargs.get(keyword)
            kept.clear()
            if context is not None:  # attn1 as cross-attention (disable_self_attn)
                return None
            m = self._kept_of(grid, x)
            if m is None:
                return None
            n = x.shape[1]
            if self.keys_only:  # context None here: by position when the caller passed it so, else by keyword
                if len(args) > position:
                    return (args[0], x[:, :m]) + tuple(args[2:]), kwargs
                return args, dict(kwargs, **{keyword: x[:, :m]})
            kept["n"] = n
            x = x[:, :m]
            return ((x,) + tuple(args[1:]), kwargs) if args else (args, dict(kwargs, **{self.tokens: x}))
        return hook


    def _kept_of(self, grid: dict, x: torch.Tensor) -> int | None:
        """N − r for the tokens ``x`` (B, N, C) of the recorded grid; None when they are not that grid's, or
        nothing would merge."""
        if "hw" not in grid:
            return None
        h, w = grid["hw"]
        m = self.kept_tokens(h, w)
        return None if x.shape[1] != h * w or m == h * w else m

    def _stack_shrinker(self, grid: dict, kept: dict):
        def hook(module, args, kwargs):
            x = args[0] if args else kwargs[self.tokens]
            kept.clear()
            m = self._kept_of(grid, x)
            if m is None:
                return None
            kept["n"] = x.shape[1]
            x = x[:, :m]
            return ((x,) + tuple(args[1:]), kwargs) if args else (args, dict(kwargs, **{self.tokens: x}))
        return hook


def _grid_recorder(grid: dict, keyword: str = "x"):
    def hook(module, args, kwargs):
        x = args[0] if args else kwargs[keyword]
        grid["hw"] = (int(x.shape[-2]), int(x.shape[-1]))
    return hook


def _repeater(kept: dict):
    def hook(module, args, output: torch.Tensor):
        n = kept.get("n")
        if n is None:
            return None
        # (B, M, C) -> (B, N, C): a plain copy, the cheapest way back to N tokens.
        return output.repeat(1, math.ceil(n / output.shape[1]), 1)[:, :n]
    return hook


SAME_LEVELS = object()  # a roster's Stack at the levels of the other methods
SIZE_WEIGHTED = "+sw"  # what the tables add to a method's name when its keys are size-weighted
MERGE_MLP = "+mlp"  # what the tables add to ToMe's name when its MLP merges too


def setting_name(method: str, setting: str) -> str:
    """A contender's unique name in a roster."""
    return method if method == "none" else f"{method} {setting}"


def roster(ratios: list[float], todo_factors: list[int], *, use_rand: bool = True, seed: int = 0,
           max_downsample: int | None = None, tomesd_max_downsample: int = 1, with_tomesd: bool = True,
           with_ideal: bool = True, tomesd_setup: Callable[[nn.Module], None] | None = None,
           with_local: bool = True, with_size_weighted: bool = False, with_stack: bool = True,
           stack_max_downsample: int | None | object = SAME_LEVELS, with_merge_mlp: bool = False,
           cache_intervals: tuple[int, ...] = ()) -> list[Contender]:
    """Every method at every setting, raced together: none; ToMe at each ratio; ToDo at each factor; Local at
    each ratio; Stack at each ratio (with ``with_stack``); with ``with_merge_mlp``, "ToMe +mlp" (its MLP merged
    too) at each ratio; with ``with_size_weighted``, "ToMe +sw" and "Local +sw" at each ratio
    (``size_weighted_keys``: a key that stands for k tokens adds log k to its attention logit); Cache at each of
    ``cache_intervals`` (its longest gap between full steps, at its own levels); tomesd at each ratio (when installed and
    wanted, with the same options); the ideal at each ratio, (with Local) the keys-and-values ideal at each
    ratio and (with Stack) the whole-stack ideal at each ratio.

    ``stack_max_downsample`` sets Stack's levels (and its ideal's) apart from the others' (``SAME_LEVELS``: the
    same): on SDXL, whose first attention level holds a small part of the work, Stack is meant to run at 4.

    ToMe's and ToDo's random partition is keyed on ``seed``. tomesd draws its partition from a generator it
    forks off torch's global RNG at its first call: seed the global RNG before a run to make it repeatable.
    Ratios are the ones used (above the stride's cap, the cap).
    """
    def labelled(method: str, setting: str, apply, remove, ideal: str | None = None) -> Contender:
        return Contender(setting_name(method, setting), apply, remove, method, setting, ideal)

    out = [labelled("none", "–", lambda m: None, lambda m: None)]
    stack_levels = max_downsample if stack_max_downsample is SAME_LEVELS else stack_max_downsample
    ideal_of = (lambda r: setting_name("ideal", f"{r:.2f}")) if with_ideal else (lambda r: None)
    kv_ideal_of = (lambda r: setting_name("ideal", f"KV {r:.2f}")) if with_ideal else (lambda r: None)
    stack_ideal_of = (lambda r: setting_name("ideal", f"S {r:.2f}")) if with_ideal else (lambda r: None)
    for ratio in ratios:
        out.append(labelled("ToMe", f"{ratio:.2f}", lambda m, r=ratio: tome_core.apply_patch(
            m, ratio=r, max_downsample=max_downsample, use_rand=use_rand, seed=seed), tome_core.remove_patch,
            ideal_of(ratio)))
    for factor in todo_factors:
        out.append(labelled("ToDo", f"f={factor}", lambda m, f=factor: tome_core.apply_patch(
            m, method="todo", todo_factor=f, max_downsample=max_downsample, seed=seed), tome_core.remove_patch))
    if with_local:
        for ratio in ratios:
            out.append(labelled("Local", f"{ratio:.2f}", lambda m, r=ratio: tome_core.apply_patch(
                m, method="local", ratio=r, max_downsample=max_downsample), tome_core.remove_patch,
                kv_ideal_of(ratio)))
    if with_merge_mlp:  # tomesd's merge_mlp: the MLP's tokens merged too, as Stack's are
        for ratio in ratios:
            out.append(labelled(f"ToMe {MERGE_MLP}", f"{ratio:.2f}", lambda m, r=ratio: tome_core.apply_patch(
                m, ratio=r, max_downsample=max_downsample, use_rand=use_rand, seed=seed, merge_mlp=True),
                tome_core.remove_patch, ideal_of(ratio)))
    if with_stack:
        for ratio in ratios:
            out.append(labelled("Stack", f"{ratio:.2f}", lambda m, r=ratio: tome_core.apply_patch(
                m, method="stack", ratio=r, max_downsample=stack_levels), tome_core.remove_patch,
                stack_ideal_of(ratio)))
    if with_size_weighted:
        for ratio in ratios:
            out.append(labelled(f"ToMe {SIZE_WEIGHTED}", f"{ratio:.2f}", lambda m, r=ratio: tome_core.apply_patch(
                m, ratio=r, max_downsample=max_downsample, use_rand=use_rand, seed=seed, size_weighted_keys=True),
                tome_core.remove_patch, ideal_of(ratio)))
        for ratio in ratios if with_local else ():
            out.append(labelled(f"Local {SIZE_WEIGHTED}", f"{ratio:.2f}", lambda m, r=ratio: tome_core.apply_patch(
                m, method="local", ratio=r, max_downsample=max_downsample, size_weighted_keys=True),
                tome_core.remove_patch, kv_ideal_of(ratio)))
    for interval in cache_intervals:  # at its own levels ("auto": those below the top one), as users get it
        out.append(labelled("Cache", f"gap {interval}", lambda m, n=interval: tome_core.apply_patch(
            m, method="cache", cache_interval=n), tome_core.remove_patch))
    if with_tomesd and tomesd_available():
        import tomesd

        for ratio in ratios:
            def apply_tomesd(m: nn.Module, r: float = ratio) -> None:
                tomesd.apply_patch(tomesd_target(m), ratio=r, max_downsample=tomesd_max_downsample,
                                   use_rand=use_rand)
                if tomesd_setup is not None:
                    tomesd_setup(m)

            out.append(labelled("tomesd", f"{ratio:.2f}", apply_tomesd,
                                lambda m: tomesd.remove_patch(tomesd_target(m)), ideal_of(ratio)))
    if with_ideal:
        for ratio in ratios:
            patch = IdealPatch(ratio, max_downsample)
            out.append(labelled("ideal", f"{ratio:.2f}", patch.apply, patch.remove))
        for ratio in ratios if with_local else ():
            patch = IdealPatch(ratio, max_downsample, keys_only=True)
            out.append(labelled("ideal", f"KV {ratio:.2f}", patch.apply, patch.remove))
        for ratio in ratios if with_stack else ():
            patch = IdealPatch(ratio, stack_levels, whole_stacks=True)
            out.append(labelled("ideal", f"S {ratio:.2f}", patch.apply, patch.remove))
    return out
