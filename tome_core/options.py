"""Validated, frozen options of one patch. Every check names the parameter, its value and what is allowed."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from .methods import method_named

TODO_POOLS = ("nearest", "average")
MAX_DOWNSAMPLES = (1, 2, 4, 8)
MAX_STRIDE = 8
MAX_TODO_FACTOR = 8
INDEX_DTYPES = (torch.int32, torch.int64)
# The bounds every way in shares (the engine's checks, the settings and the UI's sliders): one set.
MAX_RATIO = 0.9  # the stride caps what is used anyway (ratio_cap: 0.75 at 2×2)
MAX_LOCAL_REPLAN = 10
MAX_CACHE_INTERVAL = 10
MAX_CACHE_WARMUP = 20


def ratio_cap(sx: int, sy: int) -> float:
    """Largest fraction of tokens that can merge: every sy×sx cell keeps one destination token."""
    return 1.0 - 1.0 / (sx * sy)


def effective_ratio(ratio: float, sx: int, sy: int) -> float:
    """The ratio really applied on a grid the stride divides: requests above the cap merge every source."""
    return min(float(ratio), ratio_cap(sx, sy))


def check_number(name: str, value: Any, low: float, high: float, *, high_inclusive: bool = True,
                 integer: bool = False) -> None:
    """Raise TypeError/ValueError naming ``name`` unless ``value`` is a number in the given range."""
    kind = "an integer" if integer else "a number"
    interval = f"[{low}, {high}{']' if high_inclusive else ')'}"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not _is_whole(value)):
        raise TypeError(f"{name} must be {kind} in {interval}, got {value!r} ({type(value).__name__})")
    if math.isnan(value) or value < low or value > high or (value == high and not high_inclusive):
        raise ValueError(f"{name} must be {kind} in {interval}, got {value!r}")


def check_choice(name: str, value: Any, allowed: tuple) -> None:
    if isinstance(value, bool) or value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(repr(a) for a in allowed)}, got {value!r}")


def check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")


def _is_whole(value: Any) -> bool:
    return isinstance(value, int) or (isinstance(value, float) and value.is_integer())


@dataclass(frozen=True)
class MergeOptions:
    """Everything one patch needs; built by ``apply_patch`` and immutable afterwards.

    ``ratio``, ``max_downsample``, ``sx``, ``sy``, ``use_rand`` and the ``merge_*`` flags mean what they mean
    in tomesd; ``max_downsample=None`` selects the model's highest-resolution attention level.
    """

    ratio: float = 0.5
    max_downsample: int | None = None
    sx: int = 2
    sy: int = 2
    use_rand: bool = True
    merge_attn: bool = True
    merge_crossattn: bool = False
    merge_mlp: bool = False
    seed: int | None = None
    index_dtype: torch.dtype | None = None
    method: str = "tome"
    todo_factor: int = 2
    todo_pool: str = "nearest"
    step_start: float = 0.0
    step_end: float = 1.0
    score_chunk_elements: int | None = None
    local_replan: int = 1
    size_weighted_keys: bool = False
    cache_interval: int = 8
    cache_warmup: int = 2

    def __post_init__(self) -> None:
        check_number("ratio", self.ratio, 0.0, MAX_RATIO)
        if self.max_downsample is not None:
            check_choice("max_downsample", self.max_downsample, (None,) + MAX_DOWNSAMPLES)
        check_number("sx", self.sx, 1, MAX_STRIDE, integer=True)
        check_number("sy", self.sy, 1, MAX_STRIDE, integer=True)
        for flag in ("use_rand", "merge_attn", "merge_crossattn", "merge_mlp", "size_weighted_keys"):
            check_bool(flag, getattr(self, flag))
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise TypeError(f"seed must be an integer or None, got {self.seed!r} ({type(self.seed).__name__})")
        if self.index_dtype is not None and self.index_dtype not in INDEX_DTYPES:
            raise ValueError(f"index_dtype must be torch.int32, torch.int64 or None (automatic), "
                             f"got {self.index_dtype!r}")
        method_named(self.method)  # a method without an entry is refused, naming those that have one
        check_number("todo_factor", self.todo_factor, 1, MAX_TODO_FACTOR, integer=True)
        check_choice("todo_pool", self.todo_pool, TODO_POOLS)
        check_number("local_replan", self.local_replan, 1, MAX_LOCAL_REPLAN, integer=True)
        check_number("cache_interval", self.cache_interval, 1, MAX_CACHE_INTERVAL, integer=True)
        check_number("cache_warmup", self.cache_warmup, 0, MAX_CACHE_WARMUP, integer=True)
        check_number("step_start", self.step_start, 0.0, 1.0)
        check_number("step_end", self.step_end, 0.0, 1.0)
        if self.step_start > self.step_end:
            raise ValueError(f"step_start must not exceed step_end, got step_start={self.step_start!r} "
                             f"and step_end={self.step_end!r}")
        if self.score_chunk_elements is not None:
            check_number("score_chunk_elements", self.score_chunk_elements, 1, 1 << 40, integer=True)
            object.__setattr__(self, "score_chunk_elements", int(self.score_chunk_elements))
        # Normalise whole floats (e.g. from JSON) so equality and hashing behave.
        for name in ("sx", "sy", "todo_factor", "local_replan", "cache_interval", "cache_warmup"):
            object.__setattr__(self, name, int(getattr(self, name)))
        for name in ("ratio", "step_start", "step_end"):
            object.__setattr__(self, name, float(getattr(self, name)))

    def in_window(self, progress: float | None) -> bool:
        """True when sampling progress (0..1, None = unknown) lies inside [step_start, step_end]."""
        return progress is None or self.step_start <= progress <= self.step_end
