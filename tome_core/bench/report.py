"""What the user reads: markdown tables with medians and spreads, each method's share of the ideal's gain, one
warning line when the machine was too busy for the figures to hold. Every contender is one line, its speed
beside its fidelity."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable

from .opcount import Cost
from .timing import Spread

# A contender whose interquartile range over the rounds is wider than this fraction of its median makes the
# run's figures suspect: a speed-up is a ratio of two medians, each that uncertain.
BUSY_SPREAD = 0.10
# Below this gain of the ideal a share is a quotient of two small, noisy numbers: it is left out.
MIN_IDEAL_GAIN = 0.05


def share_of_ideal(speedup: float, ideal: float) -> float | None:
    """How much of the ideal's gain a method delivers: (speed-up − 1) / (ideal − 1).

    1 means all of it, 0 none, below 0 slower than no ToMe. None when the ideal itself gains nothing
    (ideal ≤ 1): there is no gain to share.
    """
    if ideal <= 1.0:
        return None
    return (speedup - 1.0) / (ideal - 1.0)


@dataclass(frozen=True)
class Fidelity:
    """How far a contender's final picture moved from the unmerged one's (same noise, same steps), and how far
    one step's prediction moved along the unmerged trajectory (``stepwise``): each a median over draws (the
    images of one model, or the proxy models) with the draws' range (low, high) beside it."""

    psnr: float  # dB, inf when identical
    ssim: float  # 1 when identical
    step: float | None = None  # dB (stepwise), inf when no step moved; None: not measured
    psnr_range: tuple[float, float] | None = None
    ssim_range: tuple[float, float] | None = None
    step_range: tuple[float, float] | None = None
    draws: int = 1  # how many values each median is of


@dataclass(frozen=True)
class Entry:
    """A contender as the tables show it (see ``contenders.Contender``)."""

    name: str
    method: str
    setting: str
    ideal: str | None = None


@dataclass
class Case:
    """One model at one size, every contender raced together: ``ms`` by contender name; ``fidelity`` and
    ``ops`` (what a contender adds: operations per patched block and stack, multiply-adds) by name where
    measured."""

    model: str
    size: int
    entries: list[Entry]
    ms: dict[str, Spread] = field(default_factory=dict)
    fidelity: dict[str, Fidelity] | None = None  # None: not measured (random weights, or --no-fidelity)
    ops: dict[str, Cost] = field(default_factory=dict)

    def speedup(self, name: str) -> float | None:
        """Median of no merging over median of ``name``."""
        if name not in self.ms or "none" not in self.ms:
            return None
        return self.ms["none"].median / self.ms[name].median

    def speedup_range(self, name: str) -> tuple[float, float] | None:
        """The speed-up's spread: from none's first quartile over ``name``'s third to none's third over
        ``name``'s first."""
        if name not in self.ms or "none" not in self.ms:
            return None
        base, other = self.ms["none"], self.ms[name]
        return base.q1 / other.q3, base.q3 / other.q1

    def share(self, name: str) -> float | None:
        """``share_of_ideal`` of ``name`` against its own ideal; None where it has none, when the ideal gains less
        than ``MIN_IDEAL_GAIN`` or nothing beyond its spread (its low end, none's first quartile over the
        ideal's third, is not above 1): a share of such a gain would be noise."""
        entry = next((e for e in self.entries if e.name == name), None)
        if entry is None or entry.ideal is None:
            return None
        speedup, ideal = self.speedup(name), self.speedup(entry.ideal)
        if speedup is None or ideal is None:
            return None
        if ideal < 1.0 + MIN_IDEAL_GAIN or self.speedup_range(entry.ideal)[0] <= 1.0:
            return None
        return share_of_ideal(speedup, ideal)


def count_cell(value: float | None) -> str:
    return "–" if value is None else f"{value:.0f}"


def ms_cell(spread: Spread | None) -> str:
    return "–" if spread is None else f"{spread.median:.1f} ({spread.relative:.0%})"


def _x(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}x"


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{value:.0%}"


def psnr_cell(value: float | None) -> str:
    if value is None:
        return "–"
    return "∞" if math.isinf(value) else f"{value:.1f}"


def figure_cell(value: float | None, spread: tuple[float, float] | None = None, digits: int = 1) -> str:
    """"45.6 (43.1–48.0)": a median and, when the draws differ, their range; ∞ for identical, – for none."""
    def number(v: float) -> str:
        return "∞" if math.isinf(v) else f"{v:.{digits}f}"

    if value is None:
        return "–"
    if spread is None or number(spread[0]) == number(spread[1]):
        return number(value)
    return f"{number(value)} ({number(spread[0])}–{number(spread[1])})"


def table_head(title: str, rounds: str, fidelity_note: str) -> str:
    """A markdown section's title, legend and table head; ``rounds`` says how many rounds (e.g. "5");
    ``fidelity_note`` what the PSNR and SSIM columns compare (or why they are empty)."""
    return "\n".join([
        f"## {title}", "",
        f"Median ms per call over {rounds} interleaved rounds, (spread) = interquartile range / median; "
        f"speed-up = none / method; share = (speed-up − 1) / (ideal − 1) against the ideal at the same ratio "
        f"(Local: the keys-and-values ideal, ideal KV; Stack: the whole-stack ideal, ideal S), "
        f"– where the ideal gains under {MIN_IDEAL_GAIN:.0%} or nothing beyond its spread; ops/block = "
        f"dispatched operations a patched transformer block adds, ops/stack those a patched transformer stack "
        f"adds; MACs = the call's multiply-adds over none's. {fidelity_note}", "",
        "| model | px | method | setting | ms | speed-up | share | PSNR dB | SSIM | step dB | ops/block | ops/stack "
        "| MACs |",
        "|---|--:|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"])


def table_line(case: Case, entry: Entry) -> str:
    """One line: a contender's ms, speed-up, share, fidelity and added ops ("–": not measured or not apt)."""
    fid = None if case.fidelity is None else case.fidelity.get(entry.name)
    cost = case.ops.get(entry.name)
    if entry.method == "none":
        ops_cells = ["0", "0", "1.00"] if case.ops else ["–"] * 3
    elif cost is None:
        ops_cells = ["–"] * 3
    else:
        ops_cells = [count_cell(cost.per_block), count_cell(cost.per_stack),
                     "–" if cost.multiply_adds is None else f"{cost.multiply_adds:.2f}"]
    cells = [case.model, str(case.size), entry.method, entry.setting, ms_cell(case.ms.get(entry.name)),
             _x(case.speedup(entry.name)), _pct(case.share(entry.name))]
    if fid is None:
        cells += ["–", "–", "–"]
    else:
        cells += [figure_cell(fid.psnr, fid.psnr_range), figure_cell(fid.ssim, fid.ssim_range, 3),
                  figure_cell(fid.step, fid.step_range)]
    cells += ops_cells
    return "| " + " | ".join(cells) + " |"


def case_lines(case: Case) -> list[str]:
    return [table_line(case, entry) for entry in case.entries]


def rounds_text(cases: list[Case]) -> str:
    rounds = sorted({s.rounds for case in cases for s in case.ms.values()})
    if not rounds:
        return "0"
    return f"{rounds[0]}" if len(rounds) == 1 else f"{rounds[0]}-{rounds[-1]}"


def table(cases: list[Case], title: str, fidelity_note: str) -> str:
    """A markdown section: every contender of every case, speed and fidelity side by side."""
    lines = [table_head(title, rounds_text(cases), fidelity_note)]
    for case in cases:
        lines += case_lines(case)
    return "\n".join(lines)


@dataclass(frozen=True)
class Load:
    """How many cores other processes kept busy during one measurement (the one where they used the most)."""

    label: str
    others: float
    cores: int
    threads: int  # the threads this run computes with (1 on a GPU: the thread that feeds it)

    @property
    def contended(self) -> bool:
        """Others left fewer free cores than this run has threads (with a tenth of a core of slack per thread)."""
        return self.others > max(0, self.cores - self.threads) + 0.1 * self.threads

    def summary(self) -> str:
        return (f"other processes kept {self.others:.1f} of the {self.cores} cores busy (during {self.label}) "
                f"while this run computed with {self.threads} thread{'s' if self.threads > 1 else ''}")


def worst_load(loads: Iterable[tuple[str, float | None]], cores: int, threads: int) -> Load | None:
    """The ``Load`` of the (label, cores used by others) pair with the most; None when nothing was measured."""
    measured = [(label, others) for label, others in loads if others is not None]
    if not measured:
        return None
    label, others = max(measured, key=lambda item: item[1])
    return Load(label, others, cores, threads)


@dataclass(frozen=True)
class Busy:
    """Why the figures may be off: timings whose spread between rounds exceeded the limit, and other processes
    holding cores this run needed."""

    over: int
    total: int
    worst_label: str
    worst: float
    limit: float
    load: Load | None = None

    def summary(self) -> str:
        parts = []
        if self.load is not None and self.load.contended:
            parts.append(self.load.summary())
        if self.over:
            parts.append(f"{self.over} of {self.total} timings varied between rounds by more than {self.limit:.0%} "
                         f"of their median (worst: {self.worst_label}, {self.worst:.0%})")
        return "; ".join(parts)

    def line(self, hint: str) -> str:
        return f"WARNING: the machine was busy: {self.summary()}, so these speed-ups may be off. For steadier " \
               f"figures: {hint}."


def find_busy(timings: Iterable[tuple[str, Spread]], load: Load | None = None,
              limit: float = BUSY_SPREAD) -> Busy | None:
    """``Busy`` when any (label, spread) pair's interquartile range exceeds ``limit`` of its median, or when
    ``load`` shows other processes holding cores this run needed; else None."""
    timings = list(timings)
    over = [(label, s.relative) for label, s in timings if s.relative > limit]
    contended = load is not None and load.contended
    if not over and not contended:
        return None
    label, worst = max(over, key=lambda item: item[1]) if over else ("", 0.0)
    return Busy(len(over), len(timings), label, worst, limit, load if contended else None)


def busy_warning(timings: Iterable[tuple[str, Spread]], hint: str, load: Load | None = None,
                 limit: float = BUSY_SPREAD) -> str | None:
    """The one warning line for ``timings`` ((label, spread) pairs) and ``load``, or None when every spread is
    within ``limit`` and no other process held cores this run needed; ``hint`` says how to get steadier
    figures with this command."""
    busy = find_busy(timings, load, limit)
    return busy.line(hint) if busy else None


def case_timings(cases: Iterable[Case], section: str) -> list[tuple[str, Spread]]:
    """(label, spread) of every timing in ``cases``, for ``busy_warning``."""
    return [(f"{section} {case.model} {case.size} px {name}", spread)
            for case in cases for name, spread in case.ms.items()]
