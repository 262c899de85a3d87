"""The methods, one entry each: ``METHODS`` is the table every way in reads (the engine, the settings, the UI,
the infotext, the API, X/Y/Z, the hints).

A method is a module here with its ``Method`` entry (name, label, the options it reads, its defaults) and its
behaviour (a ``MethodPatch``); adding one is a new module and a line below.
"""

from __future__ import annotations

from . import cache, local, stack, todo, tome
from .base import WINDOW, Method, MethodPatch

METHODS: tuple[Method, ...] = (tome.METHOD, todo.METHOD, local.METHOD, stack.METHOD, cache.METHOD)
"""In the order the UI lists them."""
METHOD_NAMES: tuple[str, ...] = tuple(m.name for m in METHODS)
_BY_NAME = {m.name: m for m in METHODS}


def method_named(name: str) -> Method:
    """The entry of the method ``name`` (its engine value); ValueError naming the known ones."""
    found = _BY_NAME.get(name) if isinstance(name, str) else None
    if found is None:
        raise ValueError(f"method must be one of {', '.join(map(repr, METHOD_NAMES))}, got {name!r}")
    return found


__all__ = ["METHODS", "METHOD_NAMES", "WINDOW", "Method", "MethodPatch", "method_named"]
