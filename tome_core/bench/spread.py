"""How sure a fidelity figure is: one value per image (or per proxy model), summarised by its median and its
range.

The median, not the mean: one picture whose sampling run flipped a discrete choice early can sit 20 dB below
the others, and a mean of dB (or of squared errors) lets that one picture speak for all of them. The range
shows it instead. ``inf`` (an identical picture) is a value like any other: the median of several is ``inf``.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Iterable


@dataclass(frozen=True)
class Figure:
    """A figure over several draws (images, or proxy models): each value, their median and their extremes."""

    values: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.values:
            raise ValueError("a figure needs at least one value")
        if any(math.isnan(v) for v in self.values):
            raise ValueError(f"a figure's values must be numbers, got {self.values}")

    @classmethod
    def of(cls, values: Iterable[float]) -> Figure:
        return cls(tuple(float(v) for v in values))

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    @property
    def low(self) -> float:
        return min(self.values)

    @property
    def high(self) -> float:
        return max(self.values)

    @property
    def count(self) -> int:
        return len(self.values)
