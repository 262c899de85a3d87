"""tome_core.settings alone: the parameter table, parsing of hook arguments, infotext and derived values."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from dataclasses import fields

import pytest

import tome_core
from tome_core import settings as tm
from tome_core.methods import METHOD_NAMES as METHODS
from tome_core.options import TODO_POOLS
from tome_core.settings import TokenMergeSettings

API_KEYS = ("enabled", "ratio", "hr_only", "hr_ratio", "method", "max_downsample", "sx", "sy", "use_rand",
            "merge_crossattn", "merge_mlp", "todo_factor", "todo_pool", "step_start", "step_end", "local_replan",
            "size_weighted_keys", "cache_interval", "cache_warmup")
FIRST_RELEASE_KEYS = API_KEYS[:15]  # positional API calls written for them must keep working


def test_table_defines_the_documented_api_order_and_the_dataclass_follows_it():
    assert tm.KEYS == API_KEYS
    assert tuple(f.name for f in fields(TokenMergeSettings)) == API_KEYS
    assert {k: getattr(TokenMergeSettings(), k) for k in API_KEYS} == {p.key: p.default for p in tm.PARAMS}


def test_every_engine_parameter_of_the_table_is_the_engines_with_its_default_and_bounds():
    """One table: each parameter the engine reads is ``apply_patch``'s keyword and ``MergeOptions``' field of
    its name with the same default, and the engine refuses just what the table refuses (one set of bounds)."""
    signature = inspect.signature(tome_core.apply_patch).parameters
    merge_fields = {f.name: f.default for f in fields(tome_core.MergeOptions)}
    assert list(merge_fields) == [name for name in signature if name not in ("model", "unknown")]
    assert {name: p.default for name, p in signature.items() if name in merge_fields} == merge_fields
    engine = [p for p in tm.PARAMS if p.engine]
    assert {p.key for p in tm.PARAMS if not p.engine} == {"enabled", "hr_only", "hr_ratio"}
    options = TokenMergeSettings(enabled=True).engine_options(hires=False, seed=0)
    assert set(options) == {p.key for p in engine} | {"seed"}
    for p in engine:
        assert p.key in merge_fields
        default = TokenMergeSettings().effective()  # "Auto" resolved as the engine receives it
        assert merge_fields[p.key] == getattr(default, p.key) or p.key == "size_weighted_keys", p.key
        if p.kind in (tm.FLOAT, tm.INT):
            for inside in (p.low, p.high):
                tome_core.MergeOptions(**{p.key: inside, **({"step_start": 0.0} if p.key == "step_end" else {})})
                tm.PARAM[p.key].normalise(inside)
            beyond = p.high + (p.step if p.kind == tm.INT else 0.01)
            with pytest.raises(ValueError, match=p.key):
                tome_core.MergeOptions(**{p.key: beyond})
            with pytest.raises(ValueError, match=p.key):
                tm.PARAM[p.key].normalise(beyond)
    hr = tm.PARAM["hr_ratio"]  # the hires ratio reaches the engine as the ratio of the hires pass
    assert (hr.low, hr.high) == (tm.PARAM["ratio"].low, tm.PARAM["ratio"].high)


def test_defaults():
    s = TokenMergeSettings()
    assert (s.enabled, s.ratio, s.hr_only, s.hr_ratio, s.method, s.max_downsample) == (False, 0.5, False, 0.0,
                                                                                         "tome", None)
    assert (s.sx, s.sy, s.use_rand, s.merge_crossattn, s.merge_mlp) == (2, 2, True, False, False)
    assert (s.todo_factor, s.todo_pool, s.step_start, s.step_end) == (2, "nearest", 0.0, 1.0)
    assert tm.parse_args(()) == s == tm.DISABLED
    assert s.local_replan == 1 and s.size_weighted_keys is None  # "Auto": the method's own default
    assert s.ui_values() == [False, 0.5, False, 0.0, "ToMe", "auto", 2, 2, True, False, False, 2, "nearest",
                             0.0, 1.0, 1, "Auto", 8, 2]
    ratio = tm.PARAM["ratio"]
    assert (ratio.low, ratio.high, ratio.step) == (0.0, 0.9, 0.05)


def test_infotext_keys_are_ours_and_never_the_builtin_ones():
    keys = tm.INFOTEXT_KEYS
    assert len(set(keys)) == len(keys)
    assert all(k.startswith("ToMe ") for k in keys)
    assert not {"Token merging ratio", "Token merging ratio hr"} & set(keys)
    assert tm.RATIO_INFOTEXT == "ToMe ratio"


def test_positional_args_in_order_with_missing_trailing_ones_at_defaults():
    s = tm.parse_args((True, 0.3, True, 0.6, "ToDo", "4", 3, 1, False, True, True, 4, "average", 0.2, 0.8))
    assert s == TokenMergeSettings(True, 0.3, True, 0.6, "todo", 4, 3, 1, False, True, True, 4, "average", 0.2, 0.8)
    assert tm.parse_args((True, 0.3)) == TokenMergeSettings(enabled=True, ratio=0.3)
    assert tm.parse_args(tuple(TokenMergeSettings(enabled=True, sx=4).ui_values())) == TokenMergeSettings(
        enabled=True, sx=4)
    with pytest.raises(ValueError, match=f"at most {len(API_KEYS)} arguments"):
        tm.parse_args(tuple(TokenMergeSettings().ui_values()) + (1,))


def test_positional_calls_of_the_first_release_keep_their_meaning():
    """The new parameter is appended: a 15-value call means what it meant, and the 16th value is the local
    method's re-plan interval."""
    old = (True, 0.4, False, 0.0, "ToMe", "auto", 2, 2, False, False, False, 2, "nearest", 0.1, 0.9)
    assert tm.KEYS[:15] == FIRST_RELEASE_KEYS
    s = tm.parse_args(old)
    assert s == TokenMergeSettings(enabled=True, ratio=0.4, use_rand=False, step_start=0.1, step_end=0.9)
    assert tm.parse_args(old[:4] + ("Local",) + old[5:] + (3,)) == TokenMergeSettings(
        enabled=True, ratio=0.4, method="local", use_rand=False, step_start=0.1, step_end=0.9, local_replan=3)


def test_local_method_settings_cap_infotext_and_engine_options():
    s = TokenMergeSettings(enabled=True, ratio=0.9, method="Local", sx=1, sy=1, local_replan=4)
    # The local method's cap is its 2×2 window's, whatever the (unused) stride says.
    assert s.pass_ratio(False) == 0.75
    assert s.to_infotext() == {"ToMe ratio": 0.75, "ToMe method": "Local", "ToMe stride x": 1,
                               "ToMe stride y": 1, "ToMe re-plan every": 4}
    options = s.engine_options(hires=False, seed=3)
    assert options["method"] == "local" and options["local_replan"] == 4 and options["ratio"] == 0.75
    assert "2×2 window caps the ratio at 0.75" in tm.ratio_note(0.9, 0.0, 1, 1, "Local")
    assert tm.ratio_note(0.7, 0.0, 1, 1, "Local") == ""
    for bad in (0, 11, 2.5, "3"):
        with pytest.raises((TypeError, ValueError), match="local_replan"):
            TokenMergeSettings(local_replan=bad)
    assert set(tm.METHOD_KEYS) == set(METHODS)


def test_dict_form_takes_defaults_for_missing_keys_and_ignores_the_other_slots():
    defaults = TokenMergeSettings().ui_values()[1:]
    s = tm.parse_args(({"enabled": True, "ratio": 0.3, "method": "todo"}, *defaults))
    assert s == TokenMergeSettings(enabled=True, ratio=0.3, method="todo")
    assert tm.parse_args(({"ratio": 0.3},)) == TokenMergeSettings(ratio=0.3)  # "enabled" defaults to off
    assert tm.parse_args(({},)) == TokenMergeSettings()


@pytest.mark.parametrize("values, error, words", [
    ({"enabled": True, "ratoi": 0.3}, ValueError, ["unknown key 'ratoi'", "ratio"]),
    ({"ratio": "0.3"}, TypeError, ["ratio", "'0.3'", "[0.0, 0.9]"]),
    ({"ratio": True}, TypeError, ["ratio", "True"]),
    ({"enabled": 1}, TypeError, ["enabled", "True or False", "1"]),
    ({"sx": 2.5}, TypeError, ["sx", "integer", "[1, 8]", "2.5"]),
    ({"ratio": 0.95}, ValueError, ["ratio", "[0.0, 0.9]", "0.95"]),
    ({"hr_ratio": -0.1}, ValueError, ["hr_ratio", "[0.0, 0.9]"]),
    ({"sy": 9}, ValueError, ["sy", "[1, 8]", "9"]),
    ({"todo_factor": 0}, ValueError, ["todo_factor", "[1, 8]"]),
    ({"step_end": 1.5}, ValueError, ["step_end", "[0.0, 1.0]"]),
    ({"step_start": 0.7, "step_end": 0.3}, ValueError, ["step_start", "step_end", "0.7", "0.3"]),
    ({"method": "fast"}, ValueError, ["method", "'ToMe', 'ToDo'", "'fast'"]),
    ({"todo_pool": "max"}, ValueError, ["todo_pool", "'nearest', 'average'", "'max'"]),
    ({"max_downsample": 3}, ValueError, ["max_downsample", "'auto'", "1, 2, 4, 8", "3"]),
    ({"max_downsample": [2]}, TypeError, ["max_downsample", "[2]"]),
    ({"ratio": float("nan")}, ValueError, ["ratio", "nan"]),
])
def test_bad_values_name_parameter_value_and_range(values, error, words):
    with pytest.raises(error) as caught:
        tm.parse_args((values,))
    for word in words:
        assert word in str(caught.value)


def test_choices_and_levels_accept_ui_and_api_spellings():
    assert TokenMergeSettings(method="ToDo").method == TokenMergeSettings(method="todo").method == "todo"
    assert TokenMergeSettings(todo_pool="Average").todo_pool == "average"
    for value in (2, 2.0, "2"):
        assert TokenMergeSettings(max_downsample=value).max_downsample == 2
    for value in (None, "auto", "Auto"):
        assert TokenMergeSettings(max_downsample=value).max_downsample is None
    assert TokenMergeSettings(sx=3.0).sx == 3 and isinstance(TokenMergeSettings(sx=3.0).sx, int)
    assert isinstance(TokenMergeSettings(ratio=0).ratio, float)


def test_settings_are_frozen_and_replace_validates():
    s = TokenMergeSettings()
    with pytest.raises(Exception):
        s.ratio = 0.2
    with pytest.raises(ValueError):
        s.with_overrides({"ratio": 2.0})
    with pytest.raises(ValueError, match="unknown key"):
        s.with_overrides({"speed": 2})
    assert s.with_overrides({"ratio": 0.2}) == TokenMergeSettings(enabled=True, ratio=0.2)


def test_pass_ratio_and_engine_options():
    s = TokenMergeSettings(enabled=True, ratio=0.4, hr_ratio=0.6)
    assert (s.pass_ratio(False), s.pass_ratio(True)) == (0.4, 0.6)
    assert TokenMergeSettings(ratio=0.4).pass_ratio(True) == 0.4  # hires ratio 0: same as the ratio
    assert TokenMergeSettings(ratio=0.9).pass_ratio(False) == 0.75  # stride 2×2 caps at 1 - 1/4
    assert TokenMergeSettings(ratio=0.9, sx=3, sy=3).pass_ratio(False) == pytest.approx(8 / 9)
    assert TokenMergeSettings(ratio=0.5, sx=1, sy=1).pass_ratio(False) == 0.0
    options = s.engine_options(hires=True, seed=42)
    assert set(options) <= set(inspect.signature(tome_core.apply_patch).parameters)
    merge = tome_core.MergeOptions(**options)  # the engine accepts every value the table allows
    assert (merge.ratio, merge.seed, merge.max_downsample, merge.method) == (0.6, 42, None, "tome")
    assert {tm.PARAM["method"].normalise(c) for c in tm.PARAM["method"].choices} == set(METHODS)
    assert {tm.PARAM["todo_pool"].normalise(c) for c in tm.PARAM["todo_pool"].choices} == set(TODO_POOLS)


def test_which_passes_are_patched():
    on, hr_only = TokenMergeSettings(enabled=True), TokenMergeSettings(enabled=True, hr_only=True)
    assert (on.applies_to_pass(False), on.applies_to_pass(True)) == (True, True)
    assert (hr_only.applies_to_pass(False), hr_only.applies_to_pass(True)) == (False, True)
    assert not TokenMergeSettings().applies_to_pass(True)
    assert hr_only.without_hires() == TokenMergeSettings(enabled=True)


def test_infotext_when_off_is_empty_and_at_defaults_only_the_ratio():
    assert TokenMergeSettings(ratio=0.3).to_infotext() == {}
    # ToMe's Auto size-weighted keys are on, and on is not what an infotext without the key means.
    assert TokenMergeSettings(enabled=True).to_infotext() == {"ToMe ratio": 0.5, "ToMe size-weighted keys": True}
    assert TokenMergeSettings(enabled=True, method="local").to_infotext() == {"ToMe ratio": 0.5,
                                                                             "ToMe method": "Local"}


def test_infotext_records_every_non_default_parameter_and_the_effective_ratio():
    s = TokenMergeSettings(True, 0.9, True, 0.8, "todo", 2, 2, 2, False, True, True, 3, "average", 0.1, 0.9)
    assert s.to_infotext() == {
        "ToMe ratio": 0.75, "ToMe hires only": True, "ToMe hr ratio": 0.75, "ToMe method": "ToDo",
        "ToMe max downsample": "2", "ToMe random": False, "ToMe merge cross-attention": True,
        "ToMe merge MLP": True, "ToMe ToDo factor": 3, "ToMe ToDo pooling": "average", "ToMe step start": 0.1,
        "ToMe step end": 0.9}
    assert TokenMergeSettings(enabled=True, sx=3, sy=1, size_weighted_keys=False).to_infotext() == {
        "ToMe ratio": 0.5, "ToMe stride x": 3, "ToMe stride y": 1}


ROUND_TRIP = [
    TokenMergeSettings(enabled=True),
    TokenMergeSettings(enabled=True, ratio=0.05, hr_ratio=0.35, step_start=0.25, step_end=0.3),
    TokenMergeSettings(enabled=True, ratio=0.9, sx=3, sy=3, hr_only=True),
    TokenMergeSettings(True, 0.9, True, 0.8, "todo", 8, 4, 1, False, True, True, 8, "average", 0.15, 0.85),
    TokenMergeSettings(enabled=True, max_downsample=1, method="ToMe", use_rand=False),
    TokenMergeSettings(enabled=True, ratio=0.8, method="Local", local_replan=3, merge_mlp=True),
    TokenMergeSettings(enabled=True, ratio=0.25, method="Local", size_weighted_keys="On"),
    TokenMergeSettings(enabled=True, size_weighted_keys=False),
]


@pytest.mark.parametrize("settings", ROUND_TRIP)
def test_infotext_round_trip_gives_the_same_behaviour(settings):
    # As the host writes and parses it: str() of every value, read back as strings.
    text = {key: str(value) for key, value in settings.to_infotext().items()}
    back = TokenMergeSettings.from_infotext(text)
    assert back == settings.effective()
    for hires in (False, True):
        assert back.engine_options(hires=hires, seed=1) == settings.engine_options(hires=hires, seed=1)


def test_from_infotext_without_tome_is_off_and_rejects_bad_text():
    assert TokenMergeSettings.from_infotext({"Steps": "20"}) == TokenMergeSettings()
    with pytest.raises(ValueError, match="ratio"):
        TokenMergeSettings.from_infotext({"ToMe ratio": "fast"})
    with pytest.raises(ValueError, match="use_rand"):
        TokenMergeSettings.from_infotext({"ToMe ratio": "0.5", "ToMe random": "maybe"})


def test_infotexts_of_the_first_release_paste_back_unchanged():
    """Texts written before the local method existed: every control takes the value it took then, and the
    new controls their defaults, but size-weighted keys off, as they were then."""
    text = {"ToMe ratio": "0.6", "ToMe method": "ToDo", "ToMe ToDo factor": "3", "ToMe step start": "0.2"}
    pasted = {key: tm.pasted_value(key, text) for key in tm.KEYS}
    assert pasted == dict(zip(tm.KEYS, [True, 0.6, False, 0.0, "ToDo", "auto", 2, 2, True, False, False, 3,
                                        "nearest", 0.2, 1.0, 1, "Off", 8, 2]))
    assert TokenMergeSettings.from_infotext(text) == TokenMergeSettings(True, 0.6, method="todo", todo_factor=3,
                                                                        step_start=0.2, size_weighted_keys=False)


def test_pasted_values():
    text = {"ToMe ratio": "0.3", "ToMe method": "ToDo", "ToMe stride x": "4", "ToMe random": "False"}
    assert tm.pasted_value("enabled", text) is True
    assert tm.pasted_value("ratio", text) == 0.3
    assert tm.pasted_value("method", text) == "ToDo"
    assert tm.pasted_value("sx", text) == 4
    assert tm.pasted_value("use_rand", text) is False
    # Absent keys return to their defaults, so the paste reproduces the generation.
    assert tm.pasted_value("sy", text) == 2
    assert tm.pasted_value("max_downsample", text) == "auto"
    assert tm.pasted_value("merge_mlp", text) is False
    # No ToMe in the text: the accordion turns off, the other controls stay as they are.
    assert tm.pasted_value("enabled", {"Steps": "20"}) is False
    assert tm.pasted_value("enabled", {"ToMe ratio": "abc"}) is False
    assert tm.pasted_value("enabled", {"ToMe ratio": "0.95"}) is False  # beyond the slider's range
    assert tm.pasted_value("ratio", {"Steps": "20"}) is None
    assert tm.pasted_value("ratio", {"ToMe ratio": "lots"}) is None


def test_evaluation_progress_counts_each_evaluation_at_the_middle_of_its_share():
    # Euler, 4 steps: one evaluation a step; the window [0, 0.5] holds steps 0 and 1.
    assert [tm.evaluation_progress(i, 4) for i in range(4)] == [0.125, 0.375, 0.625, 0.875]
    # Heun, 3 steps: 6 expected evaluations, 5 made (the last step has one); each counts as its step's middle.
    assert [tm.evaluation_progress(i, 6, 3) for i in range(5)] == [1 / 6, 1 / 6, 0.5, 0.5, 5 / 6]
    # Heun, 5 steps: the window [0.5, 1] holds steps 2 (middle 0.5), 3 and 4, both evaluations of each.
    heun5 = [tm.evaluation_progress(i, 10, 5) for i in range(9)]
    assert [p >= 0.5 for p in heun5] == [False] * 4 + [True] * 5
    assert [p >= 0.9 for p in heun5] == [False] * 8 + [True]  # the last step, though it has one evaluation
    # Without the step count each evaluation is a step of its own.
    assert [tm.evaluation_progress(i, 6) for i in range(2)] == [0.5 / 6, 1.5 / 6]
    # DDIM, 4 steps: 3 U-Net calls; each lies in its own quarter.
    assert [tm.evaluation_progress(i, 4) for i in range(3)] == [0.125, 0.375, 0.625]
    for unknown in [(None, 4), (0, None), (0, 0), (True, 4), (1.0, 4)]:
        assert tm.evaluation_progress(*unknown) is None
    assert tm.evaluation_progress(9, 4) == 1.0


def test_ratio_note_appears_only_above_the_cap():
    assert tm.ratio_note(0.5, 0.0, 2, 2) == ""
    assert tm.ratio_note(0.75, 0.0, 2, 2) == ""
    assert tm.ratio_note(0.9, 0.0, 2, 2) == "Stride 2×2 caps the ratio at 0.75: ratio 0.9 will be used as 0.75."
    assert tm.ratio_note(0.5, 0.8, 2, 2) == ("Stride 2×2 caps the ratio at 0.75: hires ratio 0.8 will be used as "
                                              "0.75.")
    assert "0.8889" in tm.ratio_note(0.9, 0.0, 3, 3)
    assert tm.ratio_note(0.85, 0.0, 3, 3) == ""
    assert tm.ratio_note("x", 0.0, 2, 2) == ""


def test_xyz_axes():
    labels = [axis.label for axis in tm.XYZ_AXES]
    for required in ("[ToMe] Ratio", "[ToMe] Hires ratio", "[ToMe] Method", "[ToMe] Max downsample",
                     "[ToMe] Stride", "[ToMe] Step window start", "[ToMe] Step window end"):
        assert required in labels
    assert len(labels) == len(set(labels))
    axes = {axis.label: axis for axis in tm.XYZ_AXES}
    assert axes["[ToMe] Stride"].overrides(3) == {"sx": 3, "sy": 3}
    assert axes["[ToMe] Hires ratio"].txt2img_only and not axes["[ToMe] Ratio"].txt2img_only
    assert axes["[ToMe] Method"].choices == ("ToMe", "ToDo", "Local", "Stack", "Cache")
    assert axes["[ToMe] Cache interval"].overrides(4) == {"cache_interval": 4}
    assert axes["[ToMe] Re-plan every"].overrides(2) == {"local_replan": 2}
    assert axes["[ToMe] Ratio"].value_type is float and axes["[ToMe] Stride"].value_type is int
    with pytest.raises(ValueError, match=r"\[ToMe\] Ratio: ratio must be a number in \[0.0, 0.9\], got 1.5"):
        axes["[ToMe] Ratio"].check(1.5)
    axes["[ToMe] Max downsample"].check("auto")


def test_settings_import_no_host():
    code = ("import sys, tome_core.settings; "
            "print(sorted(m for m in ('modules', 'gradio', 'ldm', 'sgm', 'tomesd') if m in sys.modules))")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_size_weighted_keys_reaches_the_engine_infotext_and_paste_back():
    s = TokenMergeSettings(enabled=True, method="Local", ratio=0.25, size_weighted_keys=True)
    assert s.engine_options(hires=False, seed=1)["size_weighted_keys"] is True
    text = s.to_infotext()
    assert text["ToMe size-weighted keys"] is True
    assert TokenMergeSettings.from_infotext({k: str(v) for k, v in text.items()}) == s.effective()
    at = API_KEYS.index("size_weighted_keys")
    assert tm.parse_args([True, 0.5] + [tm.PARAM[k].default for k in API_KEYS[2:at]] + [True]).size_weighted_keys
    assert tm.parse_args([{"enabled": True, "size_weighted_keys": True}]).size_weighted_keys
    assert "size_weighted_keys" in tm.METHOD_KEYS["tome"] and "size_weighted_keys" in tm.METHOD_KEYS["local"]
    assert "size_weighted_keys" not in tm.METHOD_KEYS["todo"]


@pytest.mark.parametrize("method, auto", [("ToMe", True), ("Local", False), ("ToDo", False)])
def test_size_weighted_keys_auto_is_the_methods_measured_default(method, auto):
    """Auto: on for ToMe, off for Local (the README's measure); ToDo reads no switch. The engine gets the
    resolved value, and the infotext records it: written when on, absent when off."""
    s = TokenMergeSettings(enabled=True, method=method)
    assert s.size_weighted_keys is None and s.keys_size_weighted() is auto
    assert s.engine_options(hires=False, seed=0)["size_weighted_keys"] is auto
    assert s.effective().size_weighted_keys is auto
    text = s.to_infotext()
    assert text.get("ToMe size-weighted keys") == (True if auto else None)
    again = TokenMergeSettings.from_infotext({k: str(v) for k, v in text.items()})
    assert again == s.effective() and again.keys_size_weighted() is auto
    for explicit in (True, False):  # an explicit choice wins over the method's default
        chosen = TokenMergeSettings(enabled=True, method=method, size_weighted_keys=explicit)
        assert chosen.keys_size_weighted() is explicit


def test_an_infotext_written_before_auto_keeps_size_weighted_keys_off():
    """Before "Auto", the default was off and an image with it off carried no key: pasted back, such an image
    must still get it off (ToMe's Auto would turn it on), in the settings and in the UI control."""
    legacy = {"ToMe ratio": "0.5", "Seed": "1"}
    assert TokenMergeSettings.from_infotext(legacy).keys_size_weighted() is False
    assert tm.pasted_value("size_weighted_keys", legacy) == "Off"
    assert tm.pasted_value("size_weighted_keys", {**legacy, "ToMe size-weighted keys": "True"}) == "On"
    assert tm.pasted_value("size_weighted_keys", {**legacy, "ToMe size-weighted keys": "perhaps"}) is None
    assert tm.pasted_value("size_weighted_keys", {"Seed": "1"}) is None  # no ToMe entries: leave the control
    # ToMe with it off explicitly writes nothing, and so pastes back as off too.
    off = TokenMergeSettings(enabled=True, size_weighted_keys="Off")
    assert "ToMe size-weighted keys" not in off.to_infotext()
    assert TokenMergeSettings.from_infotext({k: str(v) for k, v in off.to_infotext().items()}) == off.effective()


@pytest.mark.parametrize("value, canonical", [(None, None), (True, True), (False, False), ("Auto", None),
                                              ("on", True), (" OFF ", False)])
def test_size_weighted_keys_takes_the_ui_spellings_and_the_booleans_api_callers_sent(value, canonical):
    assert tm.parse_args([{"enabled": True, "size_weighted_keys": value}]).size_weighted_keys is canonical
    args = [True, 0.5] + [tm.PARAM[k].default for k in API_KEYS[2:API_KEYS.index("size_weighted_keys")]] + [value]
    assert tm.parse_args(args).size_weighted_keys is canonical


@pytest.mark.parametrize("value", ["yes", 1, 0.0, [True]])
def test_size_weighted_keys_refuses_other_values_naming_them(value):
    with pytest.raises(ValueError, match=r"size_weighted_keys must be True, False or None \(auto\), or one of "
                                         r"'Auto', 'On', 'Off', got"):
        tm.parse_args([{"enabled": True, "size_weighted_keys": value}])


def test_size_weighted_keys_is_an_xyz_axis_whose_cells_say_auto_on_or_off():
    axis = next(a for a in tm.XYZ_AXES if a.label == "[ToMe] Size-weighted keys")
    assert axis.keys == ("size_weighted_keys",) and axis.choices == ("Auto", "On", "Off")
    cells = {v: TokenMergeSettings().with_overrides(axis.overrides(v)).keys_size_weighted() for v in axis.choices}
    assert cells == {"Auto": True, "On": True, "Off": False}
    with pytest.raises(ValueError, match=r"\[ToMe\] Size-weighted keys: size_weighted_keys must be"):
        axis.check("sometimes")
