"""ToMe axes for the webui's X/Y/Z plot: "[ToMe] Ratio", "[ToMe] Method", ... (see ``tome_core.settings``).

An axis value lives on the processing object of its grid cell only (``p.tokenmerge_xyz``, a new dict per
cell), turns ToMe on for that cell and is checked by ``confirm`` before the grid starts.

The axes are added when this file is imported, since the X/Y/Z script is a builtin script and so already
loaded, and a webui started with ``--nowebui`` builds the scripts' UI (which fixes the axis list) before
``on_before_ui`` callbacks run. ``on_before_ui`` adds them too, for a load order where X/Y/Z comes later.
"""

from __future__ import annotations

from typing import Any, Callable

from modules import script_callbacks, scripts

from tome_core import settings as tm

XYZ_MODULE_NAME = "xyz_grid.py"  # the webui names each script module after its file


def find_xyz_module() -> Any | None:
    for data in scripts.scripts_data:
        if data.script_class.__module__ == XYZ_MODULE_NAME:
            return data.module
    return None


def _apply(axis: tm.Axis) -> Callable[[Any, Any, list], None]:
    def apply(p: Any, value: Any, values: list) -> None:
        current = getattr(p, tm.OVERRIDES_ATTRIBUTE, None) or {}
        setattr(p, tm.OVERRIDES_ATTRIBUTE, {**current, **axis.overrides(value)})
    return apply


def _confirm(axis: tm.Axis) -> Callable[[Any, list], None]:
    def confirm(p: Any, values: list) -> None:
        for value in values:
            axis.check(value)
    return confirm


def _choices(axis: tm.Axis) -> Callable[[], list[str]] | None:
    return (lambda: list(axis.choices)) if axis.choices else None


def add_axes(*, report_missing: bool = False) -> None:
    """Add every ToMe axis the X/Y/Z plot does not have yet. Never raises: a failure is printed."""
    try:
        xyz = find_xyz_module()
        if xyz is None:
            if report_missing:
                print("[ToMe] the X/Y/Z plot script is not loaded; no ToMe axes")
            return
        present = {getattr(option, "label", None) for option in xyz.axis_options}
        for axis in tm.XYZ_AXES:
            if axis.label in present:
                continue
            option_class = getattr(xyz, "AxisOptionTxt2Img", xyz.AxisOption) if axis.txt2img_only else xyz.AxisOption
            xyz.axis_options.append(option_class(axis.label, axis.value_type, _apply(axis),
                                                 confirm=_confirm(axis), choices=_choices(axis)))
    except Exception as error:
        print(f"[ToMe] could not add the X/Y/Z plot axes: {error!r}")


def _add_axes_before_ui() -> None:
    add_axes(report_missing=True)


add_axes()
script_callbacks.on_before_ui(_add_axes_before_ui)
