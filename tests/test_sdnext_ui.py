"""The accordion, infotext paste-back and the X/Y/Z grid in the SD.Next double."""

from __future__ import annotations

import pytest
import torch

from sdnext_double.testing import fresh, image, sdnext, tome_keys  # noqa: F401  (fixtures)
from tome_core import settings as tm


@pytest.mark.parametrize("tab", ["txt2img", "img2img"])
def test_the_accordion_is_in_both_tabs_with_every_control(sdnext, tab):
    import gradio as gr
    from modules.ui_components import InputAccordion

    script = sdnext.sdnext.script(tab, "ToMe")
    controls = sdnext.sdnext.runners[tab].inputs[script.args_from:script.args_to]
    assert len(controls) == len(tm.KEYS)
    # SD.Next's page has no script that ties an InputAccordion's value to the accordion: the switch is a
    # visible checkbox, the first control of a plain accordion.
    assert type(controls[0]) is gr.Checkbox and not isinstance(controls[0], InputAccordion)
    assert controls[0].visible is not False and controls[0].label == "Token merging (ToMe)"
    accordion = next(block for block in sdnext.sdnext.blocks.blocks.values()
                     if isinstance(block, gr.Accordion) and block.elem_id == f"script_{tab}_tome_accordion")
    assert accordion.label == "Token merging (ToMe)" and accordion.open is False
    def inside(block):
        return [block] + [d for child in getattr(block, "children", []) for d in inside(child)]

    assert controls[0] in inside(accordion) and all(c in inside(accordion) for c in controls)
    assert [c.label for c in controls[1:]] == [tm.PARAM[k].label for k in tm.KEYS[1:]]
    # The API's defaults are the controls' values: the accordion off.
    assert sdnext.sdnext.default_args[tab][script.args_from:script.args_to] == [c.value for c in controls]
    assert controls[0].value is False


@pytest.mark.parametrize("values", [
    {"ratio": 0.4, "method": "Local", "local_replan": 3, "step_start": 0.2},
    {"ratio": 0.25, "method": "Local", "size_weighted_keys": True},
    {"ratio": 0.3, "merge_crossattn": True, "max_downsample": "2", "use_rand": False, "hr_only": True,
     "hr_ratio": 0.6},
    {"ratio": 0.5, "method": "ToDo", "todo_factor": 3, "todo_pool": "average"},
])
def test_the_infotext_pastes_back_to_the_same_settings(fresh, values):
    fields = {"enabled": True, **values}
    job = fresh.txt2img([fields], enable_hr=True)
    text = job["info"]["infotexts"][0]
    pasted = fresh.sdnext.paste("txt2img", text)
    script = fresh.sdnext.script("txt2img", "ToMe")
    controls = fresh.sdnext.runners["txt2img"].inputs[script.args_from:script.args_to]
    expected = tm.TokenMergeSettings(**{k: v for k, v in fields.items()}).effective().ui_values()
    assert [pasted.get(c, "(unchanged)") for c in controls] == expected
    # And those values, sent back as positional args, make the same image.
    again = fresh.txt2img(expected, enable_hr=True)
    assert torch.equal(image(again), image(job))


def test_sdnexts_own_tome_entry_is_not_ours(fresh):
    # SD.Next's "ToMe: 0.5" (its built-in ratio, mapped to tome_ratio) does not turn the accordion on; like
    # any infotext without "ToMe ratio", it turns it off and leaves the other controls.
    text = "a cat\nNegative prompt: \nSteps: 4, Seed: 11, ToMe: 0.5"
    script = fresh.sdnext.script("txt2img", "ToMe")
    accordion = fresh.sdnext.runners["txt2img"].inputs[script.args_from]
    assert fresh.sdnext.paste("txt2img", text) == {accordion: False}


def test_the_xyz_grid_lists_our_axes_and_runs_a_cell_per_value(fresh):
    import importlib

    xyz = next(d.module for d in importlib.import_module("modules.scripts").scripts_data
               if d.script_class.__module__ == "xyz_grid.py")
    labels = [o.label for o in xyz.axis_options]
    assert set(axis.label for axis in tm.XYZ_AXES) <= set(labels)
    assert labels.count("[ToMe] Ratio") == 1
    plain = fresh.txt2img()
    args = ["[ToMe] Ratio", "0.3, 0.6", "", "[ToMe] Method", "", ["ToMe", "ToDo"], "Nothing", "", "",
            False, True, False, True, False, True, False, False]
    grid = fresh.sdnext.api("txt2img", {"prompt": "a cat", "seed": 11, "steps": 4, "width": 128, "height": 128,
                                        "script_name": "xyz grid script", "script_args": args})
    infos = [tome_keys(text) for text in grid["info"]["infotexts"]]
    on = {"ToMe size-weighted keys": "True"}  # ToMe's "Auto"
    assert infos == [{"ToMe ratio": 0.3, **on}, {"ToMe ratio": 0.6, **on},
                     {"ToMe ratio": 0.3, "ToMe method": "ToDo"}, {"ToMe ratio": 0.6, "ToMe method": "ToDo"}]
    images = grid["images"]
    assert len(images) == 4 and all(not torch.equal(i, image(plain)) for i in images)
    assert not torch.equal(images[0], images[1])
    # A plain job after the grid is plain.
    assert torch.equal(image(fresh.txt2img()), image(plain))


def test_a_bad_xyz_value_stops_the_grid_before_any_image(fresh):
    from modules import errors

    args = ["[ToMe] Ratio", "0.3, 5", "", "Nothing", "", "", "Nothing", "", "",
            False, True, False, True, False, True, False, False]
    with pytest.raises(ValueError, match="ratio"):
        fresh.sdnext.api("txt2img", {"prompt": "a cat", "seed": 11, "steps": 4, "script_name": "xyz grid script",
                                     "script_args": args})
    assert fresh.calls == [] and errors.reported == []
