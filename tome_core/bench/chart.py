"""The benchmark's charts (PNG, matplotlib): speed-up against fidelity, one point per method and setting, so a
user sees which setting keeps the most of the picture at the speed they want; or, where no fidelity was
measured (random weights), the speed-ups alone as bars."""

from __future__ import annotations

import math

from .report import Busy, Case

COLORS = {"ToMe": "tab:blue", "ToDo": "tab:green", "tomesd": "tab:orange", "ideal": "black"}
EXTRA_COLORS = ("tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan")


def _color(method: str, seen: dict[str, str]) -> str:
    if method not in seen:
        seen[method] = COLORS.get(method) or EXTRA_COLORS[len([m for m in seen if m not in COLORS])
                                                           % len(EXTRA_COLORS)]
    return seen[method]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _busy_note(fig, busy: Busy | None) -> None:
    if busy:
        fig.text(0.5, 0.01, f"Busy machine, speed-ups uncertain: {busy.summary()}", ha="center", fontsize=7,
                 color="red", wrap=True)


FIDELITY_AXES = (("psnr", "final-picture PSNR against the unmerged image, dB (right: closer)"),
                 ("step", "one-step dB along the unmerged trajectory, each step weighed by its move (right: closer)"))


def label_positions(values: list[float], gap: float) -> list[float]:
    """Heights for labels wanted at ``values`` such that no two are closer than ``gap``, each as near its own
    value as that allows: labels too close form a group, spaced by ``gap`` and centred on the mean of the
    group's values; a group that then reaches its neighbour merges with it. Returned in the order given."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    groups: list[tuple[float, list[int]]] = []  # (the lowest label's height, members from low to high)
    for i in order:
        groups.append((values[i], [i]))
        while len(groups) > 1:
            (low0, members0), (low1, members1) = groups[-2], groups[-1]
            if low0 + len(members0) * gap <= low1 + 1e-12:
                break
            members = members0 + members1
            centre = sum(values[k] for k in members) / len(members)
            groups[-2:] = [(centre - (len(members) - 1) * gap / 2, members)]
    out = [0.0] * len(values)
    for low, members in groups:
        for k, index in enumerate(members):
            out[index] = low + k * gap
    return out


def _ideal_lines(ax, case: Case, left: float) -> None:
    """The ideal's speed-up at each ratio as a dotted line, labelled at the left edge; labels of lines close
    together are spread apart (with a thin leader to their line) instead of printed over each other."""
    ideals = [(e, case.speedup(e.name)) for e in case.entries if e.method == "ideal"]
    ideals = [(e, v) for e, v in ideals if v is not None]
    if not ideals:
        return
    for _, value in ideals:
        ax.axhline(value, color="black", lw=0.8, ls=":")
    ax.figure.canvas.draw()  # the axis' limits and size are needed to turn 10 points into data units
    low, high = ax.get_ylim()
    height_pt = ax.get_window_extent().height * 72.0 / ax.figure.dpi
    gap = (high - low) * 10.0 / max(height_pt, 1.0)
    heights = label_positions([v for _, v in ideals], gap)
    for (entry, value), y in zip(ideals, heights):
        ax.annotate(f"ideal {entry.setting}: {value:.2f}x", (left, value), xytext=(left, y), textcoords="data",
                    fontsize=7, va="center", ha="left",
                    arrowprops=None if abs(y - value) < gap / 4 else dict(arrowstyle="-", lw=0.5, color="grey"))


def write_tradeoff_chart(cases: list[Case], path: str, title: str, busy: Busy | None = None) -> None:
    """``tradeoff_figure`` written to ``path`` as a PNG."""
    plt = _pyplot()
    fig = tradeoff_figure(cases, title, busy)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def tradeoff_figure(cases: list[Case], title: str, busy: Busy | None = None):
    """Speed-up (y, with its spread) against each fidelity figure (x, with its range over the images or the
    proxy models) per method and setting: a panel for the final picture's PSNR and one for the step dB, a
    row per case; a method's settings joined by a line; "no merging" drawn at the right edge (∞) at 1.0x as the
    reference; the ideal's speed-up at each ratio as a dotted line (no method is faster at that ratio)."""
    plt = _pyplot()
    measures = [(m, label) for m, label in FIDELITY_AXES
                if any(getattr(f, m) is not None for case in cases for f in (case.fidelity or {}).values())]
    fig, axes = plt.subplots(len(cases), len(measures), figsize=(7.5 * len(measures), 5.6 * len(cases)),
                             squeeze=False, dpi=120)
    seen: dict[str, str] = {}
    for row, case in zip(axes, cases):
        for ax, (measure, xlabel) in zip(row, measures):
            _tradeoff_panel(ax, case, measure, xlabel, seen)
    fig.suptitle(title, fontsize=8)
    _busy_note(fig, busy)
    fig.tight_layout(rect=(0, 0.04 if busy else 0, 1, 0.95))
    for row, case in zip(axes, cases):  # after the layout: the labels' spacing depends on the panel's size
        for ax in row:
            _ideal_lines(ax, case, ax.get_xlim()[0])
    return fig


def _tradeoff_panel(ax, case: Case, measure: str, xlabel: str, seen: dict[str, str]) -> None:
    fid = case.fidelity or {}
    values = {name: getattr(f, measure) for name, f in fid.items() if getattr(f, measure) is not None}
    ranges = {name: getattr(f, f"{measure}_range") for name, f in fid.items()}
    finite = [v for name, v in values.items() if name != "none" and math.isfinite(v)]
    finite += [lo for name, r in ranges.items() if r and name != "none" for lo in r if math.isfinite(lo)]
    right = (max(finite) if finite else 40.0) + 4.0  # where "∞" is drawn
    left = (min(finite) if finite else 20.0) - 2.0
    methods = [m for m in dict.fromkeys(e.method for e in case.entries) if m not in ("none", "ideal")]
    for method in methods:
        points = []
        for entry in (e for e in case.entries if e.method == method):
            if entry.name not in values or case.speedup(entry.name) is None:
                continue
            x = values[entry.name]
            lo, hi = ranges.get(entry.name) or (x, x)
            clip = lambda v: right if math.isinf(v) else v  # noqa: E731
            points.append((clip(x), case.speedup(entry.name), entry, case.speedup_range(entry.name),
                           (clip(lo), clip(hi))))
        if not points:
            continue
        color = _color(method, seen)
        ax.plot([p[0] for p in points], [p[1] for p in points], "-", color=color, lw=1, alpha=0.5)
        for x, y, entry, (lo, hi), (xlo, xhi) in points:
            ax.errorbar([x], [y], yerr=[[max(0, y - lo)], [max(0, hi - y)]],
                        xerr=[[max(0, x - xlo)], [max(0, xhi - x)]], fmt="o", color=color, ms=7, capsize=3,
                        label=method if entry is points[0][2] else None)
            ax.annotate(entry.setting, (x, y), textcoords="offset points", xytext=(6, 5), fontsize=8, color=color)
    ax.plot([right], [1.0], marker="*", ms=14, color="black", ls="none", label="no merging (∞)")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlim(left, right + 2.0)
    ideal_values = [case.speedup(e.name) for e in case.entries if e.method == "ideal"]
    top = max([1.0] + [v for v in ideal_values if v is not None]
              + [case.speedup_range(e.name)[1] for e in case.entries if case.speedup_range(e.name)])
    ax.set_ylim(min(0.9, ax.get_ylim()[0]), top * 1.08)
    ticks = [t for t in ax.get_xticks() if left <= t < right - 1.0]
    ax.set_xticks(ticks + [right], [f"{t:g}" for t in ticks] + ["∞"])
    ax.set_xlabel(xlabel)
    ax.set_ylabel("speed-up over no merging (up: faster)")
    ax.set_title(f"{case.model} at {case.size} px", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper right")


def write_speed_chart(cases: list[Case], path: str, title: str, busy: Busy | None = None) -> None:
    """Where no fidelity was measured: per case, a bar per contender (its speed-up, labelled, with the spread),
    one colour per method, and a line at 1 (no gain)."""
    plt = _pyplot()
    entries = [[e for e in case.entries if e.method != "none"] for case in cases]
    width = max(6.4, 5.0 * len(cases), 0.55 * sum(len(e) for e in entries) + 2.0)
    fig, axes = plt.subplots(1, len(cases), figsize=(width, 5.0), squeeze=False,
                             gridspec_kw=dict(width_ratios=[max(1, len(e)) for e in entries]))
    seen: dict[str, str] = {}
    for ax, case, shown in zip(axes[0], cases, entries):
        values = [case.speedup(e.name) or 0.0 for e in shown]
        ranges = [case.speedup_range(e.name) or (v, v) for e, v in zip(shown, values)]
        colors = [_color(e.method, seen) for e in shown]
        bars = ax.bar(range(len(shown)), values, 0.8, color=colors,
                      yerr=[[max(0.0, v - lo) for v, (lo, _) in zip(values, ranges)],
                            [max(0.0, hi - v) for v, (_, hi) in zip(values, ranges)]],
                      capsize=3, error_kw=dict(lw=1, ecolor="black"))
        ax.bar_label(bars, labels=[f"{v:.2f}x" for v in values], fontsize=7, padding=2)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xticks(range(len(shown)), [f"{e.method}\n{e.setting}" for e in shown], fontsize=7)
        ax.set_ylim(0, max([1.0] + [hi for _, hi in ranges]) * 1.2)
        ax.set_title(f"{case.model} at {case.size} px\n(random weights: speed only)", fontsize=9)
        ax.set_ylabel("speed-up over no merging")
    fig.suptitle(title, fontsize=8)
    _busy_note(fig, busy)
    fig.tight_layout(rect=(0, 0.04 if busy else 0, 1, 0.94))
    fig.savefig(path, dpi=120)
    plt.close(fig)
