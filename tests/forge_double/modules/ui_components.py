"""Forge's ``ui_components``: the A1111 double's components, except that ``InputAccordion`` is a function (as in
Forge and its forks) that returns an ``InputAccordionImpl``, the component class. Code that tests
``isinstance(x, InputAccordion)`` fails there with a TypeError."""

from modules import load_a1111

_a1111 = load_a1111("ui_components")
globals().update({name: value for name, value in vars(_a1111).items() if not name.startswith("__")})

InputAccordionImpl = _a1111.InputAccordion
del InputAccordion  # noqa: F821  (copied in above)


def InputAccordion(value=None, **kwargs):  # noqa: N802  (Forge's name)
    return InputAccordionImpl(value, **kwargs)
