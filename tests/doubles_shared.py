"""What the host doubles (``webui_double`` with ``forge_double`` and ``reforge_double``, and ``sdnext_double``)
share: the API's error and the swap of ``modules`` between doubles within one test session. Each double keeps
its own host's Script API and hook order, which differ between the webuis they stand for."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Callable, Iterator


class HTTPError(Exception):
    """A refused API request, with the status the webui's API answers."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(f"{status}: {detail}")
        self.status = status


@contextmanager
def imported_afresh(owned: tuple[str, ...], first_paths: list[str], hidden_paths: tuple[str, ...] = (),
                    setup: Callable[[], None] = lambda: None) -> Iterator[None]:
    """The modules named in ``owned`` (and their submodules) imported afresh while the context lasts, with
    ``first_paths`` at the front of ``sys.path`` and ``hidden_paths`` off it; ``setup`` runs once the path is
    set. Afterwards the modules and the path are as they were, so doubles of several webuis share a session."""

    def ours(name: str) -> bool:
        return any(name == o or name.startswith(o + ".") for o in owned)

    saved = {name: module for name, module in sys.modules.items() if ours(name)}
    saved_path = list(sys.path)
    for name in saved:
        del sys.modules[name]
    away = set(first_paths) | set(hidden_paths)
    sys.path[:] = list(first_paths) + [d for d in sys.path if d not in away]
    setup()
    try:
        yield
    finally:
        for name in [n for n in sys.modules if ours(n)]:
            del sys.modules[name]
        sys.modules.update(saved)
        sys.path[:] = saved_path
