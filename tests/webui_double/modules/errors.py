"""Error reporting as the webui does it: print and carry on. ``reported`` keeps them for tests."""

from __future__ import annotations

import traceback

reported: list[str] = []


def report(message: str, *, exc_info: bool = False) -> None:
    text = message + ("\n" + traceback.format_exc() if exc_info else "")
    reported.append(text)
    print(text)


def display(error: BaseException, task: str, *, full_traceback: bool = False) -> None:
    report(f"{task}: {type(error).__name__}: {error}")
