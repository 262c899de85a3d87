"""Every user-facing ToMe parameter, defined once, and the frozen settings one generation runs with.

A host (the webui's Script, its API, an XYZ plot cell, a pasted infotext) hands over raw values; this module
turns them into a validated ``TokenMergeSettings`` and back into infotext. It knows nothing about any host
beyond plain values (no webui or gradio imports), so it is testable alone.

``PARAMS`` is the table: per parameter its API key (also the dataclass field, the positional order and, for
the parameters the engine reads, ``apply_patch``'s keyword), kind, default, bounds (the engine's, from
``tome_core.options``), UI label (also the hover-hint key), infotext key and XYZ axis label. The settings
object, the engine options, the UI's controls, the X/Y/Z axes and the infotext are made from it; what is
spelled out elsewhere (the dataclass fields, ``apply_patch``'s signature, the advanced panel's rows) is checked
against it by the tests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Mapping, Sequence

from .methods import METHODS, method_named
from .options import (MAX_CACHE_INTERVAL, MAX_CACHE_WARMUP, MAX_DOWNSAMPLES, MAX_LOCAL_REPLAN, MAX_RATIO, MAX_STRIDE,
                      MAX_TODO_FACTOR, TODO_POOLS, check_number, effective_ratio, ratio_cap)

RATIO_INFOTEXT = "ToMe ratio"
"""Written whenever ToMe is on; its presence in a pasted infotext is what turns the accordion on."""

REFINER_INFOTEXT = "ToMe refiner"
"""Written (value "unmerged") when the refiner, switched in during sampling, could not be patched: ToMe
covered the base model's steps only. A record, not a setting: pasting it back sets nothing."""

HYPERTILE_INFOTEXT = "ToMe Hypertile"
"""Written (value "set aside on merged blocks") when the webui's built-in Hypertile was on for layers ToMe
merged: Hypertile tiles the sequence it is handed as if it were the image grid, so on those layers it was
turned off for the job and still tiled every other layer. A record, not a setting."""

OVERRIDES_ATTRIBUTE = "tokenmerge_xyz"
"""Attribute of a host's per-generation object holding ``{key: value}`` overrides for that generation only
(an XYZ plot cell). Its presence turns ToMe on for that generation."""

AUTO_LEVELS = "auto"

BOOL, FLOAT, INT, CHOICE, LEVELS, SWITCH = "bool", "float", "int", "choice", "levels", "switch"
SWITCH_CHOICES = ("Auto", "On", "Off")
"""A switch's spellings in the UI: Auto (canonical None: the chosen method's own default), On (True), Off (False)."""
_SWITCH_VALUES: dict[str, bool | None] = dict(zip((c.lower() for c in SWITCH_CHOICES), (None, True, False)))

_SAME_AS_DEFAULT = object()


@dataclass(frozen=True)
class Param:
    """One parameter. ``default`` is the canonical value; ``choices`` are the spellings the UI shows and the
    infotext records (canonical value: the lowercased spelling; for levels ``None`` or an int)."""

    key: str
    kind: str
    default: Any
    label: str
    infotext: str | None = None
    xyz: str | None = None
    low: float | None = None
    high: float | None = None
    step: float | None = None
    choices: tuple[str, ...] = ()
    txt2img_only: bool = False
    engine: bool = True
    """The engine reads it: ``apply_patch`` takes it under ``key`` (resolved for the pass, see
    ``TokenMergeSettings.engine_options``)."""
    absent: Any = _SAME_AS_DEFAULT
    """What an infotext without this parameter's key means, where that is not the default: images made before
    the default changed must give the same picture when pasted back."""

    @property
    def absent_value(self) -> Any:
        return self.default if self.absent is _SAME_AS_DEFAULT else self.absent

    def normalise(self, value: Any) -> Any:
        """The canonical form of ``value``; TypeError/ValueError naming the parameter, value and range."""
        if self.kind == BOOL:
            if not isinstance(value, bool):
                raise TypeError(f"{self.key} must be True or False, got {value!r} ({type(value).__name__})")
            return value
        if self.kind in (FLOAT, INT):
            check_number(self.key, value, self.low, self.high, integer=self.kind == INT)
            return int(value) if self.kind == INT else float(value)
        if self.kind == CHOICE:
            if isinstance(value, str) and value.lower() in {c.lower() for c in self.choices}:
                return value.lower()
            raise ValueError(f"{self.key} must be one of {', '.join(map(repr, self.choices))}, got {value!r}")
        if self.kind == SWITCH:
            return _normalise_switch(self.key, value)
        return _normalise_levels(self.key, value)

    def to_ui(self, value: Any) -> Any:
        """``value`` (canonical) as the UI control holds it and the infotext records it."""
        if self.kind == CHOICE:
            return next(c for c in self.choices if c.lower() == value)
        if self.kind == LEVELS:
            return AUTO_LEVELS if value is None else str(value)
        if self.kind == SWITCH:
            return next(c for c in SWITCH_CHOICES if _SWITCH_VALUES[c.lower()] is value)
        return value

    def to_infotext(self, value: Any) -> Any:
        """``value`` (canonical, resolved) as the infotext records it: a switch as True/False, which is also
        how the boolean parameter it was before wrote it."""
        return value if self.kind == SWITCH else self.to_ui(value)

    def from_text(self, text: str) -> Any:
        """Parse an infotext value (always a string there) into the canonical value."""
        if self.kind == SWITCH and text.strip().lower() in ("true", "false"):  # what the infotext records
            return text.strip().lower() == "true"
        if self.kind == BOOL:
            lowered = text.strip().lower()
            if lowered not in ("true", "false"):
                raise ValueError(f"{self.key} must be True or False, got {text!r}")
            return lowered == "true"
        if self.kind in (FLOAT, INT):
            try:
                number = float(text)
            except ValueError:
                raise ValueError(f"{self.key} must be a number in [{self.low}, {self.high}], got {text!r}") from None
            return self.normalise(number)
        return self.normalise(text.strip())


def _normalise_switch(key: str, value: Any) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _SWITCH_VALUES:
        return _SWITCH_VALUES[value.strip().lower()]
    spellings = ", ".join(map(repr, SWITCH_CHOICES))
    raise ValueError(f"{key} must be True, False or None (auto), or one of {spellings}, got {value!r}")


def _normalise_levels(key: str, value: Any) -> int | None:
    allowed = f"{AUTO_LEVELS!r} (or None) or one of {', '.join(map(str, MAX_DOWNSAMPLES))}"
    if value is None or (isinstance(value, str) and value.strip().lower() == AUTO_LEVELS):
        return None
    number = value
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            raise ValueError(f"{key} must be {allowed}, got {value!r}") from None
    if isinstance(number, bool) or not isinstance(number, (int, float)) or math.isnan(number):
        raise TypeError(f"{key} must be {allowed}, got {value!r} ({type(value).__name__})")
    if number not in MAX_DOWNSAMPLES:
        raise ValueError(f"{key} must be {allowed}, got {value!r}")
    return int(number)


PARAMS: tuple[Param, ...] = (
    Param("enabled", BOOL, False, "Token merging (ToMe)", engine=False),
    Param("ratio", FLOAT, 0.5, "Merge ratio", RATIO_INFOTEXT, "[ToMe] Ratio", 0.0, MAX_RATIO, 0.05),
    Param("hr_only", BOOL, False, "Hires fix only", "ToMe hires only", txt2img_only=True, engine=False),
    Param("hr_ratio", FLOAT, 0.0, "Hires merge ratio (0 = same)", "ToMe hr ratio", "[ToMe] Hires ratio",
          0.0, MAX_RATIO, 0.05, txt2img_only=True, engine=False),
    Param("method", CHOICE, "tome", "Merge method", "ToMe method", "[ToMe] Method",
          choices=tuple(m.label for m in METHODS)),
    Param("max_downsample", LEVELS, None, "Merge levels (max downsample)", "ToMe max downsample",
          "[ToMe] Max downsample", choices=(AUTO_LEVELS,) + tuple(map(str, MAX_DOWNSAMPLES))),
    Param("sx", INT, 2, "Stride x", "ToMe stride x", "[ToMe] Stride", 1, MAX_STRIDE, 1),
    Param("sy", INT, 2, "Stride y", "ToMe stride y", "[ToMe] Stride", 1, MAX_STRIDE, 1),
    Param("use_rand", BOOL, True, "Random partition", "ToMe random"),
    Param("merge_crossattn", BOOL, False, "Merge cross-attention", "ToMe merge cross-attention"),
    Param("merge_mlp", BOOL, False, "Merge MLP", "ToMe merge MLP"),
    Param("todo_factor", INT, 2, "ToDo factor", "ToMe ToDo factor", "[ToMe] ToDo factor", 1, MAX_TODO_FACTOR, 1),
    Param("todo_pool", CHOICE, "nearest", "ToDo pooling", "ToMe ToDo pooling", choices=TODO_POOLS),
    Param("step_start", FLOAT, 0.0, "Start at (fraction of steps)", "ToMe step start", "[ToMe] Step window start",
          0.0, 1.0, 0.05),
    Param("step_end", FLOAT, 1.0, "End at (fraction of steps)", "ToMe step end", "[ToMe] Step window end",
          0.0, 1.0, 0.05),
    # Appended after the parameters of the first release, so positional API calls made for it keep working.
    Param("local_replan", INT, 1, "Re-plan every (steps)", "ToMe re-plan every", "[ToMe] Re-plan every",
          1, MAX_LOCAL_REPLAN, 1),
    # Off by default until Auto existed: an infotext without the key was made with it off.
    Param("size_weighted_keys", SWITCH, None, "Size-weighted keys", "ToMe size-weighted keys",
          "[ToMe] Size-weighted keys", choices=SWITCH_CHOICES, absent=False),
    Param("cache_interval", INT, 8, "Longest gap (Cache)", "ToMe cache interval", "[ToMe] Cache interval",
          1, MAX_CACHE_INTERVAL, 1),
    Param("cache_warmup", INT, 2, "Full steps first (Cache)", "ToMe cache warmup", "[ToMe] Cache warm-up",
          0, MAX_CACHE_WARMUP, 1),
)
METHOD_KEYS: dict[str, tuple[str, ...]] = {m.name: m.reads for m in METHODS}
"""The parameters only one method reads (its entry's ``reads``): the advanced panel shows those of the chosen
method alone."""
PARAM: dict[str, Param] = {p.key: p for p in PARAMS}
KEYS: tuple[str, ...] = tuple(PARAM)
INFOTEXT_KEYS: tuple[str, ...] = tuple(p.infotext for p in PARAMS if p.infotext)


def _default(key: str) -> Any:
    return PARAM[key].default


@dataclass(frozen=True)
class TokenMergeSettings:
    """What one generation asked for, validated and normalised on construction (also by ``replace``)."""

    enabled: bool = _default("enabled")
    ratio: float = _default("ratio")
    hr_only: bool = _default("hr_only")
    hr_ratio: float = _default("hr_ratio")
    method: str = _default("method")
    max_downsample: int | None = _default("max_downsample")
    sx: int = _default("sx")
    sy: int = _default("sy")
    use_rand: bool = _default("use_rand")
    merge_crossattn: bool = _default("merge_crossattn")
    merge_mlp: bool = _default("merge_mlp")
    todo_factor: int = _default("todo_factor")
    todo_pool: str = _default("todo_pool")
    step_start: float = _default("step_start")
    step_end: float = _default("step_end")
    local_replan: int = _default("local_replan")
    size_weighted_keys: bool | None = _default("size_weighted_keys")
    cache_interval: int = _default("cache_interval")
    cache_warmup: int = _default("cache_warmup")

    def __post_init__(self) -> None:
        for param in PARAMS:
            object.__setattr__(self, param.key, param.normalise(getattr(self, param.key)))
        if self.step_start > self.step_end:
            raise ValueError(f"step_start must not exceed step_end, got step_start={self.step_start} "
                             f"and step_end={self.step_end}")

    # -- what to run ---------------------------------------------------------------------------------------

    def applies_to_pass(self, hires: bool) -> bool:
        """Whether the sampling pass (first pass, or the hires-fix pass) is patched at all."""
        return self.enabled and (hires or not self.hr_only)

    def pass_ratio(self, hires: bool) -> float:
        """The ratio the pass really uses: the hires ratio in the hires pass unless it is 0, capped by the
        stride (see ``options.ratio_cap``)."""
        ratio = self.hr_ratio if hires and self.hr_ratio > 0 else self.ratio
        return effective_ratio(ratio, *self.cap_cell())

    def keys_size_weighted(self) -> bool:
        """Whether self-attention weighs each key by the tokens it stands for: the switch, or with "Auto"
        (None) the method's own default (its entry's ``size_weighted_default``, chosen by the benchmark's
        fidelity measure on the shipped proxies; README, "Size-weighted keys")."""
        if self.size_weighted_keys is None:
            return method_named(self.method).size_weighted_default
        return self.size_weighted_keys

    def cap_cell(self) -> tuple[int, int]:
        """(sx, sy) of the cell that caps the ratio: the stride, or a windowed method's 2×2 window."""
        return method_named(self.method).cap_cell(self.sx, self.sy)

    def engine_options(self, *, hires: bool, seed: int) -> dict[str, Any]:
        """Keyword arguments of ``tome_core.apply_patch`` for one sampling pass: every parameter the engine
        reads, each "Auto" resolved for the method, the pass's ratio, and the batch's seed."""
        used = replace(self.effective(), ratio=self.pass_ratio(hires))
        return {**{p.key: getattr(used, p.key) for p in PARAMS if p.engine}, "seed": seed}

    # -- derived settings ----------------------------------------------------------------------------------

    def with_overrides(self, overrides: Mapping[str, Any]) -> TokenMergeSettings:
        """These settings with ``overrides`` applied and ToMe on (an XYZ cell); validated like the rest."""
        _check_keys(overrides)
        return replace(self, **{**overrides, "enabled": True})

    def without_hires(self) -> TokenMergeSettings:
        """For jobs with no hires pass to configure (img2img): the hires parameters at their defaults."""
        return replace(self, hr_only=_default("hr_only"), hr_ratio=_default("hr_ratio"))

    def effective(self) -> TokenMergeSettings:
        """The same behaviour, with each ratio replaced by the ratio the stride allows and each "Auto" by what
        it means for this method."""
        return replace(self, ratio=effective_ratio(self.ratio, *self.cap_cell()),
                       hr_ratio=effective_ratio(self.hr_ratio, *self.cap_cell()),
                       size_weighted_keys=self.keys_size_weighted())

    # -- infotext ------------------------------------------------------------------------------------------

    def to_infotext(self) -> dict[str, Any]:
        """Infotext entries: none when off; else "ToMe ratio" (the effective ratio) and every other parameter
        whose effective value differs from what its absence means (``Param.absent_value``: the default, or
        for size-weighted keys off, as before its default became per method). ``from_infotext`` of the text
        gives back ``self.effective()``."""
        if not self.enabled:
            return {}
        used = self.effective()
        entries: dict[str, Any] = {RATIO_INFOTEXT: used.ratio}
        for param in PARAMS:
            value = getattr(used, param.key)
            if param.infotext and param.infotext != RATIO_INFOTEXT and value != param.absent_value:
                entries[param.infotext] = param.to_infotext(value)
        return entries

    @classmethod
    def from_infotext(cls, params: Mapping[str, str]) -> TokenMergeSettings:
        """Settings from parsed infotext (``{key: text}``): on when "ToMe ratio" is there, absent keys at what
        their absence means (``Param.absent_value``). Raises TypeError/ValueError on a value that does not
        parse."""
        if RATIO_INFOTEXT not in params:
            return cls()
        values = {p.key: p.from_text(str(params[p.infotext])) if p.infotext in params else p.absent_value
                  for p in PARAMS if p.infotext}
        return cls(enabled=True, **values)

    def ui_values(self) -> list[Any]:
        """The values of the UI controls, in positional order."""
        return [PARAM[key].to_ui(getattr(self, key)) for key in KEYS]


DISABLED = TokenMergeSettings()


def _check_keys(values: Mapping[str, Any]) -> None:
    unknown = [k for k in values if k not in PARAM]
    if unknown:
        raise ValueError(f"unknown key {unknown[0]!r}; known keys: {', '.join(KEYS)}")


def parse_args(args: Sequence[Any]) -> TokenMergeSettings:
    """Settings from a hook's arguments: the UI's positional values (in ``KEYS`` order; missing trailing ones
    take defaults) or, as the first argument, one dict with any of ``KEYS`` (the other arguments are then the
    defaults the host filled in and are ignored). Raises TypeError/ValueError naming the parameter."""
    if args and isinstance(args[0], Mapping):
        values = args[0]
        _check_keys(values)
        return TokenMergeSettings(**values)
    if len(args) > len(KEYS):
        raise ValueError(f"expected at most {len(KEYS)} arguments ({', '.join(KEYS)}), got {len(args)}")
    return TokenMergeSettings(**dict(zip(KEYS, args)))


def pasted_value(key: str, params: Mapping[str, str]) -> Any:
    """The UI value a control takes when ``params`` (parsed infotext) is pasted: None (leave the control as
    it is) when the text has no ToMe entries or holds a bad value for ``key``; what the key's absence means
    when it is absent (``Param.absent_value``), so that pasting reproduces the generation."""
    param = PARAM[key]
    if key == "enabled":  # on only with a ratio that parses: a broken ratio must not switch ToMe on
        return RATIO_INFOTEXT in params and pasted_value("ratio", params) is not None
    if RATIO_INFOTEXT not in params:
        return None
    if param.infotext not in params:
        return param.to_ui(param.absent_value)
    try:
        return param.to_ui(param.from_text(str(params[param.infotext])))
    except (TypeError, ValueError):
        return None


def ratio_note(ratio: Any, hr_ratio: Any, sx: Any, sy: Any, method: Any = "ToMe") -> str:
    """A line for the UI when a requested ratio exceeds what the stride (the local method: its 2×2 window)
    allows; "" otherwise or when the values are not valid (validation reports those at generation time)."""
    try:
        settings = TokenMergeSettings(ratio=ratio, hr_ratio=hr_ratio, sx=sx, sy=sy, method=method)
    except (TypeError, ValueError):
        return ""
    cap = ratio_cap(*settings.cap_cell())
    notes = [f"{name} {requested:g} will be used as {cap:.4g}"
             for name, requested in (("ratio", settings.ratio), ("hires ratio", settings.hr_ratio))
             if requested > cap]
    if not notes:
        return ""
    windowed = method_named(settings.method).windowed
    cell = f"The {settings.method} method's 2×2 window" if windowed else f"Stride {settings.sx}×{settings.sy}"
    return f"{cell} caps the ratio at {cap:.4g}: {'; '.join(notes)}."


def evaluation_progress(step: Any, total: Any, steps: Any = None) -> float | None:
    """Sampling progress in [0, 1] of model evaluation ``step`` (counted from 0) in the current pass, where
    ``total`` evaluations are expected for ``steps`` sampler steps; None when unknown.

    Progress is that of the evaluation's step, taken at the step's middle, so a step window [a, b] holds
    exactly the steps whose middle lies in it: [0, 0.5] and [0.5, 1] split an even number of steps into
    halves. Second-order samplers (Heun: ``total`` = 2 × ``steps``) count both evaluations of a step as that
    step, also in the last step, which makes only one. Samplers that skip the last evaluation (DDIM calls the
    model once less than its steps) simply never reach it. Without ``steps``, each evaluation is a step.
    """
    def whole(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    if not whole(step) or not whole(total) or total <= 0 or step < 0:
        return None
    if whole(steps) and 0 < steps <= total:
        step, total = step // (total // steps), steps
    return min(1.0, (step + 0.5) / total)


@dataclass(frozen=True)
class Axis:
    """An XYZ plot axis: one label setting one or more parameters to the same value."""

    label: str
    keys: tuple[str, ...]
    value_type: type
    choices: tuple[str, ...]
    txt2img_only: bool

    def overrides(self, value: Any) -> dict[str, Any]:
        return {key: value for key in self.keys}

    def check(self, value: Any) -> None:
        """Raise ValueError naming the axis, the parameter, the value and what is allowed."""
        try:
            for key in self.keys:
                PARAM[key].normalise(value)
        except (TypeError, ValueError) as error:
            raise ValueError(f"{self.label}: {error}") from None


def _axes() -> tuple[Axis, ...]:
    by_label: dict[str, list[Param]] = {}
    for param in PARAMS:
        if param.xyz:
            by_label.setdefault(param.xyz, []).append(param)
    value_types = {FLOAT: float, INT: int, CHOICE: str, LEVELS: str, SWITCH: str}
    return tuple(Axis(label, tuple(p.key for p in params), value_types[params[0].kind], params[0].choices,
                      all(p.txt2img_only for p in params))
                 for label, params in by_label.items())


XYZ_AXES: tuple[Axis, ...] = _axes()
