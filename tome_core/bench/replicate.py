"""The same fidelity figures on several independently trained proxy models: each model's figures, their median
across the models, and which orderings of the contenders hold on every one of them.

One proxy's figures rank methods only as far as another proxy, trained from another seed, ranks them alike:
magnitudes moved by 20 dB between seeds, and some orderings flipped. A claim is as good as the orderings that
hold on every model; the rest is one model's luck.
"""

from __future__ import annotations

from dataclasses import dataclass

from .report import Entry, Fidelity, figure_cell
from .spread import Figure

MEASURES = ("psnr", "ssim", "step")  # each: higher is closer to the unmerged run
TITLES = {"psnr": "final-picture PSNR dB", "ssim": "final-picture SSIM", "step": "one-step dB"}


def value(fid: Fidelity, measure: str) -> float | None:
    return getattr(fid, measure)


def spread_of(fid: Fidelity, measure: str) -> tuple[float, float] | None:
    return getattr(fid, f"{measure}_range")


def across(per_model: list[dict[str, Fidelity]]) -> dict[str, Fidelity]:
    """Per contender measured on every model: the median of the models' medians, with their range, for each
    measure every model has."""
    if not per_model:
        return {}
    names = [n for n in per_model[0] if all(n in m for m in per_model)]
    out = {}
    for name in names:
        figures = {}
        for measure in MEASURES:
            values = [value(m[name], measure) for m in per_model]
            figures[measure] = None if any(v is None for v in values) else Figure.of(values)
        p, s, st = figures["psnr"], figures["ssim"], figures["step"]
        out[name] = Fidelity(p.median, s.median, None if st is None else st.median, (p.low, p.high),
                             (s.low, s.high), None if st is None else (st.low, st.high), len(per_model))
    return out


def closer_everywhere(per_model: list[dict[str, Fidelity]], names: list[str], measure: str) -> dict[str, list[str]]:
    """For each contender a, the contenders b that a is strictly closer to the unmerged run than, by
    ``measure``, on every model (a tie on any model breaks it)."""
    out: dict[str, list[str]] = {}
    for a in names:
        beaten = []
        for b in names:
            if a == b:
                continue
            pairs = [(value(m[a], measure), value(m[b], measure)) for m in per_model]
            if all(x is not None and y is not None and x > y for x, y in pairs):
                beaten.append(b)
        out[a] = beaten
    return out


@dataclass(frozen=True)
class Orderings:
    """What ``closer_everywhere`` found for one measure, and how many of the pairs it could have been."""

    measure: str
    closer: dict[str, list[str]]
    pairs: int  # unordered pairs of distinct contenders

    @property
    def held(self) -> int:
        return sum(len(v) for v in self.closer.values())


def orderings(per_model: list[dict[str, Fidelity]], names: list[str], measure: str) -> Orderings:
    return Orderings(measure, closer_everywhere(per_model, names, measure), len(names) * (len(names) - 1) // 2)


def grouped(names: list[str], entries: dict[str, Entry]) -> str:
    """"ToMe 0.25/0.50, ToDo f=3": names grouped by method, in the order given."""
    by_method: dict[str, list[str]] = {}
    for name in names:
        entry = entries[name]
        by_method.setdefault(entry.method, []).append(entry.setting)
    return ", ".join(f"{method} {'/'.join(settings)}" for method, settings in by_method.items())


def orderings_lines(found: Orderings, entries: dict[str, Entry], models: int) -> list[str]:
    """Markdown: one line per contender that is closer than some other on every model."""
    lines = [f"### {TITLES[found.measure]}: {found.held} of {found.pairs} pairs in the same order on all {models} "
             f"models", ""]
    for name, beaten in found.closer.items():
        if beaten:
            lines.append(f"- {name} is closer than {grouped(beaten, entries)}")
    if not found.held:
        lines.append("- no pair keeps its order on every model")
    return lines


def per_model_table(labels: list[str], per_model: list[dict[str, Fidelity]], entries: list[Entry],
                    measure: str) -> list[str]:
    """Markdown: a row per contender, a column per model (median over its images, with their range) and the
    median across the models."""
    combined = across(per_model)
    digits = 3 if measure == "ssim" else 1
    lines = [f"| method | setting | {' | '.join(labels)} | median |",
             "|---|--:|" + "--:|" * (len(labels) + 1)]
    for entry in entries:
        if entry.name not in combined:
            continue
        cells = [figure_cell(value(m[entry.name], measure), spread_of(m[entry.name], measure), digits)
                 for m in per_model]
        cells.append(figure_cell(value(combined[entry.name], measure), None, digits))
        lines.append(f"| {entry.method} | {entry.setting} | " + " | ".join(cells) + " |")
    return lines
