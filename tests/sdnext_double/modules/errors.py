"""SD.Next's error display: print and carry on. ``reported`` keeps them for tests."""

from __future__ import annotations

reported: list[str] = []


def display(error: BaseException, task: str, **kwargs) -> None:
    text = f"{task}: {type(error).__name__}: {error}"
    reported.append(text)
    print(text)
