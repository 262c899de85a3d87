"""The Script's UI built in a real gr.Blocks by the double: controls, ids, hints, the ratio note, paste-back;
and the packaging the webui relies on."""

from __future__ import annotations

import configparser
import json
import os
import re
import subprocess
import sys

import gradio as gr
import pytest
import torch

from tome_core import options, settings as tm
from webui_double.testing import EXTENSION_DIR, fresh, host, tome_keys  # noqa: F401  (fixtures)

TABS = ("txt2img", "img2img")


def test_script_identity(host):
    for tab in TABS:
        script = host.webui.script(tab, "ToMe")
        assert script.title() == "ToMe" and script.name == "tome"
        assert script.alwayson and script.section == "accordions"
        assert script.api_info["is_alwayson"]


def test_controls_same_order_in_both_tabs_with_table_labels_defaults_and_bounds(host):
    from modules import ui_components

    # Forge and its forks make InputAccordion a function that returns an InputAccordionImpl.
    accordion_class = getattr(ui_components, "InputAccordionImpl", ui_components.InputAccordion)
    per_tab = {tab: host.webui.script(tab, "ToMe").controls for tab in TABS}
    for tab, controls in per_tab.items():
        assert len(controls) == len(tm.KEYS)
        enabled = controls[0]
        assert isinstance(enabled, accordion_class) and enabled.value is False and enabled.accordion.open is False
        assert enabled.accordion_id == f"script_{tab}_tome_enabled"
        for key, control in zip(tm.KEYS[1:], controls[1:]):
            param = tm.PARAM[key]
            assert control.elem_id == f"script_{tab}_tome_{key}"
            assert control.label == param.label
            assert control.value == param.to_ui(param.default)
            if param.kind in (tm.FLOAT, tm.INT):
                assert (control.minimum, control.maximum, control.step) == (param.low, param.high, param.step)
            if param.kind in (tm.CHOICE, tm.LEVELS):
                assert [c[1] if isinstance(c, tuple) else c for c in control.choices] == list(param.choices)
    labels = {tab: [c.label for c in controls] for tab, controls in per_tab.items()}
    assert labels["txt2img"] == labels["img2img"]
    hidden = {tm.KEYS[i] for i, c in enumerate(per_tab["img2img"]) if c.visible is False}
    # The accordion's value checkbox is always hidden; the controls of the methods not chosen (ToDo's and
    # the local method's, the default being ToMe) wait for the method radio.
    assert hidden == {"hr_only", "hr_ratio"} | {"enabled"} | {"todo_factor", "todo_pool", "local_replan",
                                                              "cache_interval", "cache_warmup"}


def test_ratio_slider_and_advanced_panel(host):
    controls = dict(zip(tm.KEYS, host.webui.script("txt2img", "ToMe").controls))
    ratio = controls["ratio"]
    assert (ratio.minimum, ratio.maximum, ratio.step, ratio.value) == (0, 0.9, 0.05, 0.5)
    advanced = [b for b in host.webui.blocks.blocks.values()
                if isinstance(b, gr.Accordion) and b.elem_id == "script_txt2img_tome_advanced"]
    assert len(advanced) == 1 and advanced[0].open is False and advanced[0].label == "Advanced"


def _note_dependency(host, trigger):
    config = host.webui.blocks.config
    for index, dep in enumerate(config["dependencies"]):
        targets = [t[0] if isinstance(t, (list, tuple)) else t for t in dep["targets"]]  # gradio 4 | 3
        if trigger._id in targets and dep["outputs"]:
            return host.webui.blocks.fns[index]
    raise AssertionError("no change event")


def test_ratio_note_follows_ratio_and_stride(host):
    controls = dict(zip(tm.KEYS, host.webui.script("txt2img", "ToMe").controls))
    for key in ("ratio", "hr_ratio", "sx", "sy"):
        block_fn = _note_dependency(host, controls[key])
        shown = block_fn.fn(0.9, 0.0, 2, 2)
        assert shown["visible"] is True and "0.75" in shown["value"]
        assert block_fn.fn(0.5, 0.0, 2, 2)["visible"] is False
        assert block_fn.fn(0.9, 0.0, 4, 4)["visible"] is False  # cap 0.9375 at 4×4


def _dependency(host, trigger, outputs):
    config = host.webui.blocks.config
    for index, dep in enumerate(config["dependencies"]):
        targets = [t[0] if isinstance(t, (list, tuple)) else t for t in dep["targets"]]  # gradio 4 | 3
        if trigger._id in targets and dep["outputs"] == [o._id for o in outputs]:
            return host.webui.blocks.fns[index]
    raise AssertionError("no such change event")


def test_advanced_panel_shows_only_the_chosen_methods_own_controls(host):
    """Stride, random partition and the cross-attention and MLP switches for ToMe, factor and pooling for
    ToDo, the re-plan interval for Local, size-weighted keys for ToMe and Local; the method radio's change
    event (also fired by a paste) switches them."""
    for tab in TABS:
        controls = dict(zip(tm.KEYS, host.webui.script(tab, "ToMe").controls))
        own = list(dict.fromkeys(key for keys in tm.METHOD_KEYS.values() for key in keys))  # each control once
        block_fn = _dependency(host, controls["method"], [controls[key] for key in own])
        for method in ("ToMe", "ToDo", "Local", "Stack"):
            shown = {key for key, update in zip(own, block_fn.fn(method)) if update["visible"]}
            assert shown == set(tm.METHOD_KEYS[method.lower()]), method
        assert all(update["visible"] for update in block_fn.fn("nonsense"))  # refused later, never hidden
        assert {key for key in own if controls[key].visible is not False} == {
            "sx", "sy", "use_rand", "merge_crossattn", "merge_mlp", "size_weighted_keys"}


def test_ui_has_no_side_effects_and_gives_the_same_defaults_again(host):
    from modules import script_callbacks

    before = {k: len(v) for k, v in script_callbacks.callback_map.items()}
    script = host.webui.script("txt2img", "ToMe")
    with gr.Blocks():
        again = script.ui(False)
    assert [c.value for c in again] == [c.value for c in script.controls]
    assert {k: len(v) for k, v in script_callbacks.callback_map.items()} == before
    assert host.webui.default_args["txt2img"][script.args_from:script.args_to] == tm.DISABLED.ui_values()


def test_every_control_has_a_hover_hint():
    with open(os.path.join(EXTENSION_DIR, "javascript", "tokenmerge_hints.js"), encoding="utf-8") as f:
        source = f.read()
    hints = dict(re.findall(r'^\s*"([^"]+)":\s*"([^"]+)"', source, flags=re.M))
    for param in tm.PARAMS:
        assert hints.get(param.label), f"no hint for {param.label!r}"
    assert "titles" in source


def test_paste_field_names(host):
    assert host.webui.script("txt2img", "ToMe").paste_field_names == list(tm.INFOTEXT_KEYS)
    img2img = host.webui.script("img2img", "ToMe").paste_field_names
    assert "ToMe hr ratio" not in img2img and "ToMe hires only" not in img2img and "ToMe ratio" in img2img


def _controls_after_paste(host, tab, infotext, start_values):
    """The ToMe control values after pasting ``infotext`` over ``start_values``."""
    script = host.webui.script(tab, "ToMe")
    changes = host.webui.paste(tab, infotext)
    return [changes.get(control, start) for control, start in zip(script.controls, start_values)]


WANTED = [
    tm.TokenMergeSettings(True, 0.9, False, 0.0, "tome", 2, 3, 1, False, True, False, 2, "nearest", 0.0, 0.75),
    tm.TokenMergeSettings(True, 0.6, False, 0.0, "local", 2, 2, 2, True, True, False, 2, "nearest", 0.0, 1.0, 2),
]


@pytest.mark.parametrize("wanted", WANTED, ids=["tome", "local"])
def test_paste_of_an_infotext_restores_every_control_and_the_image(fresh, wanted):
    made = fresh.txt2img(fresh.tome_args(**dict(zip(tm.KEYS, wanted.ui_values()))), seed=21, steps=4)
    infotext = made.infotexts[0]
    # Paste it into a panel that shows something else entirely.
    other = tm.TokenMergeSettings(False, 0.2, True, 0.4, "todo", 8, 2, 2, True, False, True, 4, "average", 0.5, 1.0,
                                  5)
    pasted = _controls_after_paste(fresh, "txt2img", infotext, other.ui_values())
    assert tm.parse_args(tuple(pasted)) == wanted.effective()  # the infotext records the ratio in use
    again = fresh.txt2img(fresh.tome_args(**dict(zip(tm.KEYS, pasted))), seed=21, steps=4)
    assert torch.equal(again.images[0], made.images[0])
    assert tome_keys(again.infotexts[0]) == tome_keys(infotext)
    fresh.assert_pristine()


def test_paste_without_tome_turns_the_accordion_off_and_leaves_the_rest(host):
    start = tm.TokenMergeSettings(True, 0.3, True, 0.4, "todo", 8, 3, 3, False, True, True, 4, "average", 0.1, 0.9)
    text = "a cat\nSteps: 20, Sampler: Euler, Seed: 1, Size: 512x512, Token merging ratio: 0.5"
    for tab in TABS:
        pasted = _controls_after_paste(host, tab, text, start.ui_values())
        assert pasted == [False] + start.ui_values()[1:]


def test_paste_with_tome_ratio_only_resets_the_other_controls(host):
    start = tm.TokenMergeSettings(False, 0.3, True, 0.4, "todo", 8, 3, 3, False, True, True, 4, "average", 0.1, 0.9)
    pasted = _controls_after_paste(host, "txt2img", "x\nSteps: 20, ToMe ratio: 0.25", start.ui_values())
    # An infotext without the size-weighted key was made with it off (so were those from before "Auto").
    assert pasted == tm.TokenMergeSettings(enabled=True, ratio=0.25, size_weighted_keys="Off").ui_values()
    img2img = _controls_after_paste(host, "img2img", "x\nSteps: 20, ToMe ratio: 0.25", start.ui_values())
    assert img2img[:2] == [True, 0.25] and img2img[2:4] == [True, 0.4]  # hidden hires controls untouched


def test_install_py_is_quiet_and_imports_nothing_heavy():
    code = ("import runpy, sys; runpy.run_path('install.py', run_name='__main__'); "
            "print(sorted(m for m in ('torch', 'gradio', 'modules', 'tome_core') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=EXTENSION_DIR, capture_output=True, text=True,
                         check=True)
    assert out.stdout == "[]\n" and out.stderr == ""


def test_metadata_and_script_module_names():
    config = configparser.ConfigParser()
    config.read(os.path.join(EXTENSION_DIR, "metadata.ini"))
    assert config["Extension"]["Name"].strip()
    names = sorted(os.listdir(os.path.join(EXTENSION_DIR, "scripts")))
    python = [n for n in names if n.endswith(".py")]
    # The webui imports every scripts/*.py under its bare file name, in one namespace with all other scripts.
    assert python and all(n.startswith("tokenmerge_") for n in python)


def test_api_info_lists_the_choices_the_api_accepts(host):
    info = host.webui.script("txt2img", "ToMe").api_info
    by_label = {arg["label"]: arg for arg in info["args"]}
    assert by_label["Merge method"]["choices"] == ["ToMe", "ToDo", "Local", "Stack", "Cache"]
    assert by_label["Re-plan every (steps)"]["maximum"] == options.MAX_LOCAL_REPLAN
    assert by_label["Merge levels (max downsample)"]["choices"] == ["auto", "1", "2", "4", "8"]
    assert json.dumps(info)  # serialisable, as /sdapi/v1/script-info needs


def test_the_ui_module_names_every_parameter_of_the_table_once():
    """What the UI spells out beside the table falls in step with it: the advanced panel's rows hold every
    parameter but the four shown above them, once each, and the module's API paragraph lists them all in
    the positional order."""
    import ast

    source = open(os.path.join(EXTENSION_DIR, "scripts", "tokenmerge_ui.py"), encoding="utf-8").read()
    tree = ast.parse(source)
    rows = next(ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                and any(getattr(t, "id", None) == "ADVANCED_ROWS" for t in node.targets))
    panel = [key for row in rows for key in row]
    assert sorted(panel) == sorted(set(tm.KEYS) - {"enabled", "ratio", "hr_only", "hr_ratio"})
    listed = re.search(r"order \(the same in\s+both tabs.*?\)::\n\n(.*?)\n\n", ast.get_docstring(tree), re.S)
    assert listed is not None
    assert [word.strip() for word in listed.group(1).replace("\n", " ").split(",")] == list(tm.KEYS)


def test_the_script_names_no_host_and_every_host_answers_the_same_questions(host):
    """Host differences live in ``tokenmerge_hosts.HOSTS``: the Script's code names no host class or entry,
    and every entry answers every question the Script asks (so adding a host is adding an entry)."""
    import ast

    hosts_source = open(os.path.join(EXTENSION_DIR, "scripts", "tokenmerge_hosts.py"), encoding="utf-8").read()
    host_classes = {node.name for node in ast.walk(ast.parse(hosts_source)) if isinstance(node, ast.ClassDef)}
    assert {"Host", "A1111", "Forge", "ForgeClassicFamily", "SDNext"} <= host_classes
    ui = ast.parse(open(os.path.join(EXTENSION_DIR, "scripts", "tokenmerge_ui.py"), encoding="utf-8").read())
    names = {node.id for node in ast.walk(ui) if isinstance(node, ast.Name)}
    names |= {alias.name for node in ast.walk(ui) if isinstance(node, ast.ImportFrom) for alias in node.names}
    assert names & host_classes <= {"Host"}  # the type, in annotations
    assert not {name for name in names if name.isupper() and name.endswith("_HOST")}
    asked = {node.attr for node in ast.walk(ui) if isinstance(node, ast.Attribute)
             and isinstance(node.value, ast.Call) and getattr(node.value.func, "id", "") in ("current_host",
                                                                                         "page_host")}
    asked |= {"unet", "unsupported_reason", "take_over_token_merging", "is_hires_pass", "pass_length"}
    assert {"links_input_accordion", "paste_takes_updates", "calls_pass_hooks"} & asked
    import scripts.tokenmerge_hosts as hosts

    for entry in hosts.HOSTS:
        assert all(hasattr(entry, question) for question in asked), type(entry).__name__
    assert isinstance(hosts.HOSTS[-1], hosts.A1111) and hosts.HOSTS[-1].recognises(object())
