"""SD.Next's selectable "xyz grid script" (scripts/xyz_grid.py), as far as axes go. ``axis_options`` is the
list from ``xyz_grid_classes`` (plain ``AxisOption``s; ``AxisOptionTxt2Img`` is not imported into this module);
the UI copies it when built. Running: each axis's type (index or label), its CSV values (or dropdown values
for axes with ``choices``) converted with the axis type, ``confirm(p, values)`` before any image; each cell
is ``process_images`` of a ``copy(p)`` with ``xyz`` True and ``override_settings_restore_afterwards`` False,
after the x, y and z ``apply(pc, value, values)``; axes with ``choices`` take the dropdown's values
unless csv mode is on; the built-in ratios (tome_ratio, todo_ratio) are restored
after the grid (``SharedSettingsStackHelper``)."""

from __future__ import annotations

import csv
from copy import copy
from io import StringIO

import gradio as gr

from modules import errors, processing, scripts_manager, shared


def apply_setting(key):
    def apply(p, value, values):
        shared.opts.data[key] = value
    return apply


def apply_field(name):
    def apply(p, value, values):
        setattr(p, name, value)
    return apply


def do_nothing(p, value, values):
    pass


class AxisOption:
    def __init__(self, label, tipe, apply, fmt=None, confirm=None, cost=0.0, choices=None):
        self.label, self.type, self.apply, self.format_value = label, tipe, apply, fmt
        self.confirm, self.cost, self.choices = confirm, cost, choices


class AxisOptionTxt2Img(AxisOption):
    pass


axis_options = [
    AxisOption("Nothing", str, do_nothing),
    AxisOption("[Param] Seed", int, apply_field("seed")),
    AxisOption("[Param] Steps", int, apply_field("steps")),
    AxisOption("[Token Merging] ToMe ratio", float, apply_setting("tome_ratio")),
    AxisOption("[Token Merging] ToDo ratio", float, apply_setting("todo_ratio")),
]


class Script(scripts_manager.Script):
    def title(self):
        return "XYZ Grid Script"

    def ui(self, is_img2img):
        self.current_axis_options = list(axis_options)
        labels = [o.label for o in self.current_axis_options]
        controls = []
        for axis in "xyz":
            controls += [gr.Dropdown(label=f"{axis} type", choices=labels, value="Nothing", type="index"),
                         gr.Textbox(label=f"{axis} values"), gr.Dropdown(label=f"{axis} values", multiselect=True)]
        controls += [gr.Checkbox(value=False, label=name) for name in ("csv", "legend", "no fixed seeds", "grid",
                                                                       "subgrids", "images", "time", "text")]
        return controls

    def run(self, p, x_type, x_values, x_values_dropdown, y_type, y_values, y_values_dropdown,
            z_type, z_values, z_values_dropdown, *flags):
        options = self.current_axis_options

        def option(kind):
            if isinstance(kind, str):
                return next(o for o in options if o.label == kind)
            return options[kind]

        csv_mode = bool(flags[0]) if flags else False

        def values(opt, text, dropdown):
            if opt.label == "Nothing":
                return [0]
            if opt.choices is not None and not csv_mode:
                raw = list(dropdown or [])
            else:
                raw = [v.strip() for v in next(csv.reader(StringIO(text or "")), []) if v.strip()]
            vals = [opt.type(v) for v in raw]
            if opt.confirm:
                opt.confirm(p, vals)
            return vals

        axes = [(option(t), values(option(t), v, d)) for t, v, d in
                ((x_type, x_values, x_values_dropdown), (y_type, y_values, y_values_dropdown),
                 (z_type, z_values, z_values_dropdown))]
        saved = {key: shared.opts.data.get(key) for key in ("tome_ratio", "todo_ratio")}
        images, infotexts = [], []
        try:
            for z in axes[2][1]:
                for y in axes[1][1]:
                    for x in axes[0][1]:
                        p.xyz = True
                        pc = copy(p)
                        pc.override_settings_restore_afterwards = False
                        for (opt, vals), value in zip(axes, (x, y, z)):
                            opt.apply(pc, value, vals)
                        try:
                            processed = processing.process_images(pc)
                        except Exception as error:
                            errors.display(error, "XYZ grid")
                            processed = None
                        if processed is not None:
                            images += processed.images
                            infotexts += processed.infotexts
        finally:
            for key, value in saved.items():
                if value is None:
                    shared.opts.data.pop(key, None)
                else:
                    shared.opts.data[key] = value
        return processing.Processed(p, images, infotexts)
