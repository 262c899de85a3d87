"""The X/Y/Z plot, as far as axes go.

``axis_options`` is read when a tab's UI is built (plain ``AxisOption`` entries plus those whose
``is_img2img`` matches the tab). Running: each axis's text is split as CSV (or its dropdown values taken,
for axes with ``choices``), converted with the axis ``type``, checked by ``confirm(p, values)`` before any
image is made; then for each cell a shallow copy of ``p`` gets the x, y and z ``apply(pc, value, values)``
and is processed. The 18 positional arguments are those of the webui's X/Y/Z plot.
"""

from __future__ import annotations

import csv
from copy import copy
from io import StringIO

import gradio as gr

from modules import errors, scripts
from modules.processing import Processed, process_images


def apply_field(name):
    def apply(p, value, values):
        setattr(p, name, value)
    return apply


def apply_override(key):
    def apply(p, value, values):
        p.override_settings[key] = value
    return apply


def do_nothing(p, value, values):
    pass


def format_value_add_label(p, opt, value):
    return f"{opt.label}: {value}"


def format_nothing(p, opt, value):
    return ""


class AxisOption:
    def __init__(self, label, type, apply, format_value=format_value_add_label, confirm=None, cost=0.0,
                 choices=None, prepare=None):
        self.label = label
        self.type = type
        self.apply = apply
        self.format_value = format_value
        self.confirm = confirm
        self.cost = cost
        self.choices = choices
        self.prepare = prepare


class AxisOptionImg2Img(AxisOption):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.is_img2img = True


class AxisOptionTxt2Img(AxisOption):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.is_img2img = False


axis_options = [
    AxisOption("Nothing", str, do_nothing, format_value=format_nothing),
    AxisOption("Seed", int, apply_field("seed")),
    AxisOption("Steps", int, apply_field("steps")),
    AxisOptionTxt2Img("Sampler", str, apply_field("sampler_name"), choices=lambda: ["Euler", "Heun", "DDIM"]),
    AxisOption("Token merging ratio", float, apply_override("token_merging_ratio")),
    AxisOption("Token merging ratio high-res", float, apply_override("token_merging_ratio_hr")),
]


def _csv(text: str) -> list[str]:
    return [value.strip() for row in csv.reader(StringIO(text), skipinitialspace=True) for value in row]


class Script(scripts.Script):
    def title(self):
        return "X/Y/Z plot"

    def ui(self, is_img2img):
        self.current_axis_options = [o for o in axis_options
                                     if type(o) is AxisOption or o.is_img2img == is_img2img]
        labels = [o.label for o in self.current_axis_options]
        controls = []
        for axis in ("x", "y", "z"):
            controls += [gr.Dropdown(label=f"{axis.upper()} type", choices=labels, value=labels[0], type="index",
                                     elem_id=self.elem_id(f"{axis}_type")),
                         gr.Textbox(label=f"{axis.upper()} values", elem_id=self.elem_id(f"{axis}_values")),
                         gr.Dropdown(label=f"{axis.upper()} values", multiselect=True,
                                     elem_id=self.elem_id(f"{axis}_values_dropdown"))]
        controls += [gr.Checkbox(label=label, value=value) for label, value in (
            ("Draw legend", True), ("Include Sub Images", False), ("Include Sub Grids", False),
            ("Keep -1 for seeds", False), ("Vary seeds for X", False), ("Vary seeds for Y", False),
            ("Vary seeds for Z", False))]
        controls += [gr.Slider(label="Grid margins (px)", minimum=0, maximum=500, value=0, step=2),
                     gr.Checkbox(label="Use text inputs instead of dropdowns", value=False)]
        return controls

    def run(self, p, x_type, x_values, x_values_dropdown, y_type, y_values, y_values_dropdown, z_type, z_values,
            z_values_dropdown, draw_legend, include_lone_images, include_sub_grids, no_fixed_seeds, vary_seeds_x,
            vary_seeds_y, vary_seeds_z, margin_size, csv_mode):
        if not no_fixed_seeds:
            from modules.processing import fix_seed
            fix_seed(p)

        def process_axis(opt, text, dropdown):
            if opt.label == "Nothing":
                return [0]
            values = dropdown if opt.choices is not None and not csv_mode else _csv(text)
            values = [opt.type(v) for v in values]
            if opt.confirm:
                opt.confirm(p, values)
            return values

        options = self.current_axis_options
        x_opt, y_opt, z_opt = options[x_type], options[y_type], options[z_type]
        xs = process_axis(x_opt, x_values, x_values_dropdown)
        ys = process_axis(y_opt, y_values, y_values_dropdown)
        zs = process_axis(z_opt, z_values, z_values_dropdown)

        images, infotexts = [], []
        for z in zs:
            for y in ys:
                for x in xs:
                    pc = copy(p)
                    pc.styles = pc.styles[:]
                    x_opt.apply(pc, x, xs)
                    y_opt.apply(pc, y, ys)
                    z_opt.apply(pc, z, zs)
                    try:
                        result = process_images(pc)
                    except Exception as error:
                        errors.display(error, "generating image for xyz plot")
                        result = Processed(p, [], p.seed, "")
                    images += result.images
                    infotexts += result.infotexts if result.images else []
        processed = Processed(p, images, p.seed, infotexts[0] if infotexts else "", infotexts)
        return processed
