"""What the user reads: markdown tables with medians and spreads, each method's share of the ideal's gain, one
warning line when the machine was too busy for the figures to hold, and a chart that shows the same."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from .timing import Spread

# A contender whose interquartile range over the rounds is wider than this fraction of its median makes the
# run's figures suspect: a speed-up is a ratio of two medians, each that uncertain.
BUSY_SPREAD = 0.10
# Below this gain of the ideal a share is a quotient of two small, noisy numbers: it is left out.
MIN_IDEAL_GAIN = 0.05
METHODS = ("ours", "tomesd")


def share_of_ideal(speedup: float, ideal: float) -> float | None:
    """How much of the ideal's gain a method delivers: (speed-up − 1) / (ideal − 1).

    1 means all of it, 0 none, below 0 slower than no ToMe. None when the ideal itself gains nothing
    (ideal ≤ 1): there is no gain to share.
    """
    if ideal <= 1.0:
        return None
    return (speedup - 1.0) / (ideal - 1.0)


@dataclass
class Row:
    """One measured case: ``ms`` holds each contender's milliseconds per call; ``ratio`` is the one used."""

    model: str
    size: int
    ratio: float
    ms: dict[str, Spread] = field(default_factory=dict)

    def speedup(self, name: str) -> float | None:
        """Median of no ToMe over median of ``name``."""
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
        """``share_of_ideal`` of ``name``; None also when the ideal gains less than ``MIN_IDEAL_GAIN`` or nothing
        beyond its spread (its low end, none's first quartile over the ideal's third, is not above 1): a share
        of such a gain would be noise."""
        speedup, ideal = self.speedup(name), self.speedup("ideal")
        if speedup is None or ideal is None:
            return None
        if ideal < 1.0 + MIN_IDEAL_GAIN or self.speedup_range("ideal")[0] <= 1.0:
            return None
        return share_of_ideal(speedup, ideal)


def ms_cell(spread: Spread | None) -> str:
    return "–" if spread is None else f"{spread.median:.1f} ({spread.relative:.0%})"


def _x(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}x"


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{value:.0%}"


def speed_table_head(title: str, rounds: str) -> str:
    """A markdown section's title, legend and table head; ``rounds`` says how many rounds (e.g. "5")."""
    return "\n".join([
        f"## {title}", "",
        f"Median ms per call over {rounds} interleaved rounds, (spread) = interquartile range / median; "
        f"speed-up = none / method; share = (speed-up − 1) / (ideal − 1), – where the ideal gains under "
        f"{MIN_IDEAL_GAIN:.0%} or nothing beyond its spread.", "",
        "| model | px | ratio | none ms | ours ms | tomesd ms | ideal ms | ours | tomesd | ideal "
        "| ours share | tomesd share |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"])


def speed_table_line(row: Row) -> str:
    """One table line: ms per contender, speed-ups over no ToMe, shares of the ideal's gain ("–": not run)."""
    cells = [row.model, str(row.size), f"{row.ratio:.2f}"]
    cells += [ms_cell(row.ms.get(name)) for name in ("none", "ours", "tomesd", "ideal")]
    cells += [_x(row.speedup(name)) for name in ("ours", "tomesd", "ideal")]
    cells += [_pct(row.share(name)) for name in METHODS]
    return "| " + " | ".join(cells) + " |"


def speed_table(rows: list[Row], title: str) -> str:
    """A markdown section: ms per call (median, spread), speed-ups, and shares of the ideal's gain."""
    rounds = sorted({s.rounds for row in rows for s in row.ms.values()})
    counted = f"{rounds[0]}" if len(rounds) == 1 else f"{rounds[0]}-{rounds[-1]}"
    return "\n".join([speed_table_head(title, counted)] + [speed_table_line(row) for row in rows])


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


def row_timings(rows: Iterable[Row], section: str) -> list[tuple[str, Spread]]:
    """(label, spread) of every timing in ``rows``, for ``busy_warning``."""
    return [(f"{section} {row.model} {row.size} px {name}", spread)
            for row in rows for name, spread in row.ms.items()]


def write_chart(rows: list[Row], path: str, title: str, ylabel: str, busy: Busy | None = None) -> None:
    """A PNG: per row, a bar per method (its speed-up, labelled, with the spread as an error bar), the ideal as
    a dashed line across the row's bars, and a line at 1 (no gain). A busy run says so on the chart itself."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    methods = [m for m in METHODS if any(m in row.ms for row in rows)]
    width = 0.8 / len(methods)
    fig, ax = plt.subplots(figsize=(max(6.4, 1.5 * len(rows) + 3.0), 5.0))
    colors = {"ours": "tab:blue", "tomesd": "tab:orange"}
    top = 1.0
    for j, name in enumerate(methods):
        xs = [i - 0.4 + width * (j + 0.5) for i in range(len(rows))]
        values = [row.speedup(name) or 0.0 for row in rows]
        ranges = [row.speedup_range(name) or (v, v) for row, v in zip(rows, values)]
        errors = [[max(0.0, v - lo) for v, (lo, _) in zip(values, ranges)],
                  [max(0.0, hi - v) for v, (_, hi) in zip(values, ranges)]]
        bars = ax.bar(xs, values, width * 0.9, yerr=errors, capsize=4, label=name, color=colors[name],
                      error_kw=dict(lw=1, ecolor="black"))
        # Inside the bar, so neither the whiskers nor the ideal's line can cover the figure.
        ax.bar_label(bars, labels=[f"{v:.2f}x" if v else "–" for v in values], label_type="center", fontsize=9,
                     color="white", fontweight="bold")
        top = max([top] + [hi for _, hi in ranges])
    handles, _ = ax.get_legend_handles_labels()
    for i, row in enumerate(rows):
        ideal = row.speedup("ideal")
        if ideal is None:
            continue
        ax.hlines(ideal, i - 0.42, i + 0.42, colors="black", linestyles="dashed", lw=1.5, zorder=3)
        ax.annotate(f"ideal {ideal:.2f}x", (i + 0.42, ideal), textcoords="offset points", xytext=(0, 3),
                    ha="right", fontsize=8)
        top = max(top, ideal)
    if any(row.speedup("ideal") is not None for row in rows):
        handles.append(Line2D([], [], color="black", ls="dashed", lw=1.5,
                              label="ideal: attention on N − r tokens, no merge cost"))
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_ylim(0, top * 1.15)
    ax.set_xticks(range(len(rows)), [f"{r.model} {r.size} px\nratio {r.ratio:.2f}" for r in rows], fontsize=9)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=8)
    ax.legend(handles=handles, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=3, frameon=False)
    if busy:
        fig.text(0.5, 0.01, f"Busy machine, figures uncertain: {busy.summary()}", ha="center", fontsize=7,
                 color="red", wrap=True)
    fig.tight_layout(rect=(0, 0.04 if busy else 0, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
