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


def write_tradeoff_chart(cases: list[Case], path: str, title: str, busy: Busy | None = None) -> None:
    """Speed-up (y, with its spread) against PSNR (x) per method and setting, one panel per case; a method's
    settings joined by a line; "no merging" drawn at the right edge (PSNR ∞) at 1.0x as the reference; the
    ideal's speed-up at each ratio as a dotted line (no method is faster at that ratio)."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(cases), figsize=(7.5 * len(cases), 5.6), squeeze=False)
    seen: dict[str, str] = {}
    for ax, case in zip(axes[0], cases):
        fid = case.fidelity or {}
        finite = [f.psnr for name, f in fid.items() if name != "none" and math.isfinite(f.psnr)]
        right = (max(finite) if finite else 40.0) + 4.0  # where "∞" is drawn
        left = (min(finite) if finite else 20.0) - 2.0
        methods = [m for m in dict.fromkeys(e.method for e in case.entries) if m not in ("none", "ideal")]
        for method in methods:
            points = []
            for entry in (e for e in case.entries if e.method == method):
                if entry.name not in fid or case.speedup(entry.name) is None:
                    continue
                x = fid[entry.name].psnr
                points.append((right if math.isinf(x) else x, case.speedup(entry.name), entry,
                               case.speedup_range(entry.name)))
            if not points:
                continue
            color = _color(method, seen)
            ax.plot([p[0] for p in points], [p[1] for p in points], "-", color=color, lw=1, alpha=0.5)
            for x, y, entry, (lo, hi) in points:
                ax.errorbar([x], [y], yerr=[[max(0, y - lo)], [max(0, hi - y)]], fmt="o", color=color, ms=7,
                            capsize=3, label=method if entry is points[0][2] else None)
                ax.annotate(entry.setting, (x, y), textcoords="offset points", xytext=(6, 5), fontsize=8,
                            color=color)
        ax.plot([right], [1.0], marker="*", ms=14, color="black", ls="none", label="no merging (PSNR ∞)")
        ax.axhline(1.0, color="grey", lw=0.8)
        for entry in (e for e in case.entries if e.method == "ideal"):
            value = case.speedup(entry.name)
            if value is not None:
                ax.axhline(value, color="black", lw=0.8, ls=":")
                ax.annotate(f"ideal {entry.setting}: {value:.2f}x", (left, value), textcoords="offset points",
                            xytext=(2, 2), fontsize=7)
        ax.set_xlim(left, right + 2.0)
        ticks = [t for t in ax.get_xticks() if left <= t < right - 1.0]
        ax.set_xticks(ticks + [right], [f"{t:g}" for t in ticks] + ["∞"])
        ax.set_xlabel("PSNR against the unmerged image, dB (right: more faithful)")
        ax.set_ylabel("speed-up over no merging (up: faster)")
        ax.set_title(f"{case.model} at {case.size} px", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper right")
    fig.suptitle(title, fontsize=8)
    _busy_note(fig, busy)
    fig.tight_layout(rect=(0, 0.04 if busy else 0, 1, 0.95))
    fig.savefig(path, dpi=120)
    plt.close(fig)


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
