"""X/Y/Z plot axes and the HTTP API (alwayson_scripts), through the double."""

from __future__ import annotations

import json

import pytest

from tome_core import settings as tm
from webui_double.testing import EXTENSION_DIR, LATENT, fresh, host, tome_keys  # noqa: F401  (fixtures)

REQUIRED_AXES = ("[ToMe] Ratio", "[ToMe] Hires ratio", "[ToMe] Method", "[ToMe] Max downsample", "[ToMe] Stride",
                 "[ToMe] Step window start", "[ToMe] Step window end")


def axis_labels(webui, tab):
    return [o.label for o in webui.script(tab, "X/Y/Z plot").current_axis_options]


def test_axes_are_in_the_lists_once_also_with_nowebui(host):
    from modules import shared
    from webui_double.host import Webui

    for webui in (host.webui, None):
        if webui is None:  # API-only start: the scripts' UI is built before on_before_ui callbacks run
            webui = Webui(EXTENSION_DIR, nowebui=True)
        txt2img, img2img = axis_labels(webui, "txt2img"), axis_labels(webui, "img2img")
        for label in REQUIRED_AXES:
            assert txt2img.count(label) == 1
            assert img2img.count(label) == (0 if label == "[ToMe] Hires ratio" else 1)
    # Back to the module's host (loading scripts again is a "Reload UI").
    shared.sd_model = host.model
    host.webui = Webui(EXTENSION_DIR)


def run_grid(host, x_label, x_values, y_label="Nothing", y_values="", tome_values=None, **fields):
    """Generate with the X/Y/Z plot selected, as the UI sends it."""
    from modules import processing

    webui = host.webui
    xyz = webui.script("txt2img", "X/Y/Z plot")
    labels = axis_labels(webui, "txt2img")
    args = list(host.tome_args(**(tome_values or {})))
    args[0] = webui.runners["txt2img"].selectable_scripts.index(xyz) + 1
    xyz_args = [labels.index(x_label), x_values, [], labels.index(y_label), y_values, [], 0, "", [],
                True, False, False, False, False, False, False, 0, True]  # csv_mode: values as text
    args[xyz.args_from:xyz.args_to] = xyz_args
    fields = {"prompt": "a cat", "seed": 4, "steps": 2, "width": LATENT * 8, "height": LATENT * 8, **fields}
    p = processing.StableDiffusionProcessingTxt2Img(**fields)
    return p, webui.generate(p, tuple(args))


def test_xyz_grid_of_three_ratio_cells(fresh):
    p, processed = run_grid(fresh, "[ToMe] Ratio", "0.2, 0.4, 0.6")  # the accordion itself is off
    assert [c.options.ratio for c in fresh.calls] == [0.2, 0.2, 0.4, 0.4, 0.6, 0.6]
    assert [tome_keys(t) for t in processed.infotexts] == [{"ToMe ratio": r, "ToMe size-weighted keys": "True"} for r in ("0.2", "0.4", "0.6")]
    assert not hasattr(p, tm.OVERRIDES_ATTRIBUTE)  # values live on each cell's copy only
    assert p.extra_generation_params == {}
    fresh.assert_pristine()


def test_xyz_cells_do_not_leak_into_each_other(fresh):
    p, processed = run_grid(fresh, "[ToMe] Method", "ToDo, ToMe", "[ToMe] Stride", "1, 3",
                            tome_values={"enabled": True, "ratio": 0.3})
    cells = [(c.options.method, c.options.sx, c.options.sy) for c in fresh.calls[::2]]
    assert cells == [("todo", 1, 1), ("tome", 1, 1), ("todo", 3, 3), ("tome", 3, 3)]
    assert [tome_keys(t) for t in processed.infotexts] == [
        {"ToMe ratio": "0.0", "ToMe method": "ToDo", "ToMe stride x": "1", "ToMe stride y": "1"},
        {"ToMe ratio": "0.0", "ToMe stride x": "1", "ToMe stride y": "1", "ToMe size-weighted keys": "True"},
        {"ToMe ratio": "0.3", "ToMe method": "ToDo", "ToMe stride x": "3", "ToMe stride y": "3"},
        {"ToMe ratio": "0.3", "ToMe stride x": "3", "ToMe stride y": "3", "ToMe size-weighted keys": "True"}]
    fresh.assert_pristine()


def test_xyz_step_window_and_levels_axes(fresh):
    run_grid(fresh, "[ToMe] Step window start", "0, 0.5", "[ToMe] Max downsample", "auto, 4")
    assert [(c.options.step_start, c.options.max_downsample, c.merging) for c in fresh.calls] == [
        (0.0, None, True), (0.0, None, True), (0.5, None, False), (0.5, None, True),
        (0.0, 4, True), (0.0, 4, True), (0.5, 4, False), (0.5, 4, True)]


def test_xyz_local_method_and_replan_axes(fresh):
    p, processed = run_grid(fresh, "[ToMe] Method", "Local, ToMe", "[ToMe] Re-plan every", "1, 3",
                            tome_values={"enabled": True, "ratio": 0.8})
    cells = [(c.options.method, c.options.local_replan, c.options.ratio) for c in fresh.calls[::2]]
    assert cells == [("local", 1, 0.75), ("tome", 1, 0.75), ("local", 3, 0.75), ("tome", 3, 0.75)]
    assert [tome_keys(t) for t in processed.infotexts] == [
        {"ToMe ratio": "0.75", "ToMe method": "Local"}, {"ToMe ratio": "0.75", "ToMe size-weighted keys": "True"},
        {"ToMe ratio": "0.75", "ToMe method": "Local", "ToMe re-plan every": "3"},
        {"ToMe ratio": "0.75", "ToMe re-plan every": "3", "ToMe size-weighted keys": "True"}]
    fresh.assert_pristine()


@pytest.mark.parametrize("label, values, words", [
    ("[ToMe] Re-plan every", "2, 0", ["[ToMe] Re-plan every", "local_replan", "[1, 10]", "0"]),
    ("[ToMe] Ratio", "0.3, 1.5", ["[ToMe] Ratio", "ratio", "[0.0, 0.9]", "1.5"]),
    ("[ToMe] Stride", "2, 9", ["[ToMe] Stride", "sx", "[1, 8]", "9"]),
    ("[ToMe] Method", "ToMe, fast", ["[ToMe] Method", "'fast'"]),
    ("[ToMe] Max downsample", "3", ["[ToMe] Max downsample", "3"]),
])
def test_xyz_confirm_rejects_bad_values_before_the_grid_starts(fresh, label, values, words):
    with pytest.raises(ValueError) as caught:
        run_grid(fresh, label, values)
    assert all(word in str(caught.value) for word in words)
    assert fresh.calls == []


def api(host, request, tab="txt2img"):
    request = {"prompt": "a cat", "seed": 9, "steps": 2, "width": LATENT * 8, "height": LATENT * 8, **request}
    if tab == "img2img":
        import torch
        request.setdefault("init_images", [torch.zeros(4, LATENT, LATENT)])
    response = host.webui.api(tab, request)
    return response, json.loads(response["info"])


@pytest.mark.parametrize("tab", ["txt2img", "img2img"])
def test_api_positional_args(fresh, tab):
    _, info = api(fresh, {"alwayson_scripts": {"tome": {"args": [True, 0.3, False, 0.0, "ToDo", 2]}}}, tab)
    assert [(c.options.ratio, c.options.method, c.options.max_downsample) for c in fresh.calls] == [
        (0.3, "todo", 2)] * len(fresh.calls)
    assert tome_keys(info["infotexts"][0]) == {"ToMe ratio": "0.3", "ToMe method": "ToDo",
                                               "ToMe max downsample": "2"}
    assert info["extra_generation_params"]["ToMe ratio"] == 0.3
    fresh.assert_pristine()


@pytest.mark.parametrize("tab", ["txt2img", "img2img"])
def test_api_positional_args_with_the_local_method(fresh, tab):
    args = [True, 0.5, False, 0.0, "Local", "auto", 2, 2, True, False, False, 2, "nearest", 0.0, 1.0, 2]
    _, info = api(fresh, {"alwayson_scripts": {"tome": {"args": args}}}, tab)
    assert {(c.options.method, c.options.local_replan, c.options.ratio) for c in fresh.calls} == {("local", 2, 0.5)}
    assert tome_keys(info["infotexts"][0]) == {"ToMe ratio": "0.5", "ToMe method": "Local",
                                               "ToMe re-plan every": "2"}
    fresh.assert_pristine()


def test_api_dict_args_and_case_insensitive_name(fresh):
    request = {"alwayson_scripts": {"ToMe": {"args": [{"enabled": True, "ratio": 0.35, "method": "todo",
                                                       "todo_pool": "average", "sx": 3}]}}}
    _, info = api(fresh, request)
    assert {(c.options.ratio, c.options.method, c.options.todo_pool, c.options.sx) for c in fresh.calls} == {
        (0.35, "todo", "average", 3)}
    assert tome_keys(info["infotexts"][0]) == {"ToMe ratio": "0.35", "ToMe method": "ToDo",
                                               "ToMe ToDo pooling": "average", "ToMe stride x": "3"}


def test_api_dict_without_enabled_is_off_and_no_alwayson_entry_is_off(fresh):
    for request in ({"alwayson_scripts": {"tome": {"args": [{"ratio": 0.35}]}}}, {}):
        fresh.calls.clear()
        _, info = api(fresh, request)
        assert all(c.options is None for c in fresh.calls)
        assert tome_keys(info["infotexts"][0]) == {}


@pytest.mark.parametrize("args, words", [
    ([{"enabled": True, "ratio": 2}], ["ratio", "2", "[0.0, 0.9]"]),
    ([{"enabled": True, "speed": 2}], ["unknown key 'speed'"]),
    ([True, "0.5"], ["ratio", "'0.5'"]),
    ([True, 0.5, False, 0.0, "ToMe", "auto", 2, 2, "yes"], ["use_rand", "'yes'"]),
    ([{"enabled": True, "method": "local", "local_replan": 0}], ["local_replan", "0", "[1, 10]"]),
    ([{"enabled": True, "method": "tile"}], ["method", "'tile'"]),
])
def test_api_bad_value_gives_an_image_without_tome(fresh, capsys, args, words):
    response, info = api(fresh, {"alwayson_scripts": {"tome": {"args": args}}})
    assert len(response["images"]) == 1
    assert all(c.options is None for c in fresh.calls)
    assert tome_keys(info["infotexts"][0]) == {}
    assert not any(k.startswith("ToMe") for k in info["extra_generation_params"])
    lines = [line for line in capsys.readouterr().out.splitlines() if "[ToMe]" in line]
    assert len(lines) == 1 and all(word in lines[0] for word in words), lines
    fresh.assert_pristine()


def test_api_unknown_script_name_is_422(fresh):
    from doubles_shared import HTTPError

    with pytest.raises(HTTPError) as caught:
        api(fresh, {"alwayson_scripts": {"token merging": {"args": [True]}}})
    assert caught.value.status == 422
