"""Every method is one entry of ``tome_core.methods.METHODS``, and every way in follows the table: these tests loop
over it, so a new entry is checked by each of them without a line here."""

from __future__ import annotations

import inspect
import os
import re

import pytest
import torch

import tome_core
import tome_core.patch
from tome_core import methods, settings as tm
from tome_core.methods.base import MethodPatch
from unets import hook_counts, inputs, run, tiny_unet

EXTENSION_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALL = pytest.mark.parametrize("method", methods.METHODS, ids=lambda m: m.name)


def _steps(unet, x, t, c, steps=4):
    """A short run of U-Net calls as a sampler makes them: the progress told, the input and timestep moving."""
    out = []
    for i in range(steps):
        tome_core.set_progress(unet, (i + 0.5) / steps)
        out.append(run(unet, x * (1 - 0.1 * i) + 0.05 * i, t - 100 * i, c))
    return out


@ALL
def test_each_method_changes_the_output_and_restores_exactly(method):
    """Patched, a short run's output moves (the method acted); removed, the U-Net is bitwise what it was,
    hooks, instance attributes and all."""
    unet = tiny_unet("sd1")
    x, t, c = inputs()
    base, hooks = _steps(unet, x, t, c), hook_counts(unet)
    own = {name: dict(m.__dict__) for name, m in unet.named_modules()}
    tome_core.apply_patch(unet, method=method.name, ratio=0.5, cache_warmup=1, cache_interval=2)
    assert tome_core.get_patch(unet).method is method
    assert isinstance(tome_core.get_patch(unet).method_patch, method.behaviour)
    patched = _steps(unet, x, t, c)
    assert any(not torch.equal(a, b) for a, b in zip(patched, base))
    tome_core.remove_patch(unet)
    assert hook_counts(unet) == hooks and not tome_core.is_patched(unet)
    assert {name: set(m.__dict__) for name, m in unet.named_modules()} == {n: set(d) for n, d in own.items()}
    assert all(torch.equal(a, b) for a, b in zip(_steps(unet, x, t, c), base))


@ALL
def test_each_method_is_an_exact_no_op_outside_its_step_window(method):
    unet = tiny_unet("sd1")
    x, t, c = inputs()
    base = [run(unet, x, t - 100 * i, c) for i in range(3)]
    tome_core.apply_patch(unet, method=method.name, ratio=0.5, step_start=0.9, cache_warmup=0)
    for i in range(3):
        tome_core.set_progress(unet, 0.1 + 0.2 * i)
        assert torch.equal(run(unet, x, t - 100 * i, c), base[i])


@ALL
@pytest.mark.parametrize("bad", [dict(ratio=1.5), dict(step_start=0.8, step_end=0.2), dict(local_replan=0)])
def test_each_method_refuses_bad_input_before_anything_changes(method, bad):
    unet = tiny_unet("sd1")
    hooks = hook_counts(unet)
    with pytest.raises(ValueError):
        tome_core.apply_patch(unet, method=method.name, **bad)
    assert hook_counts(unet) == hooks and not tome_core.is_patched(unet)
    with pytest.raises(ValueError):
        tm.TokenMergeSettings(enabled=True, method=method.label, **bad)


def test_a_method_without_an_entry_fails_loudly_everywhere():
    unet = tiny_unet("sd1")
    names = ", ".join(repr(n) for n in methods.METHOD_NAMES)
    with pytest.raises(ValueError, match=re.escape(f"method must be one of {names}, got 'nope'")):
        tome_core.apply_patch(unet, method="nope")
    assert not tome_core.is_patched(unet)
    with pytest.raises(ValueError, match="method"):
        tm.TokenMergeSettings(method="nope")
    with pytest.raises(ValueError, match="method"):
        tm.parse_args([{"enabled": True, "method": "nope"}])
    with pytest.raises(ValueError):
        methods.method_named("ToMe")  # the engine takes the name, the settings the label in any case


def test_an_entry_is_named_by_its_label_and_a_behaviour_must_say_what_it_hooks():
    with pytest.raises(ValueError, match="lowercase"):
        methods.Method("fast", "Quick", (), MethodPatch)
    assert len(set(methods.METHOD_NAMES)) == len(methods.METHODS)
    with pytest.raises(NotImplementedError):
        MethodPatch(None).install()


@ALL
def test_each_method_has_a_ui_choice_an_infotext_spelling_an_api_value_and_an_xyz_value(method):
    assert method.label in tm.PARAM["method"].choices
    settings = tm.TokenMergeSettings(enabled=True, method=method.label)
    assert settings.method == method.name
    # The infotext spells it by its label (the default's absence means the default), and pastes back.
    entries = settings.to_infotext()
    if method.name != tm.PARAM["method"].default:
        assert entries["ToMe method"] == method.label
    pasted = tm.TokenMergeSettings.from_infotext({k: str(v) for k, v in entries.items()})
    assert pasted.method == method.name and pasted == settings.effective()
    assert tm.pasted_value("method", {tm.RATIO_INFOTEXT: "0.5", "ToMe method": method.label}) == method.label
    # The API: by label or name, positional or by key.
    assert tm.parse_args([{"enabled": True, "method": method.label}]).method == method.name
    assert tm.parse_args([True, 0.5, False, 0.0, method.name]).method == method.name
    # X/Y/Z.
    axis = {a.label: a for a in tm.XYZ_AXES}["[ToMe] Method"]
    assert method.label in axis.choices
    axis.check(method.label)
    # The engine options of a pass name it as the engine does, with what "Auto" means for it.
    options = settings.engine_options(hires=False, seed=1)
    assert options["method"] == method.name
    assert options["size_weighted_keys"] is method.size_weighted_default


@ALL
def test_each_method_has_a_hover_hint_and_is_named_in_the_api_paragraph(method):
    with open(os.path.join(EXTENSION_DIR, "javascript", "tokenmerge_hints.js"), encoding="utf-8") as f:
        hints = dict(re.findall(r'^\s*"([^"]+)":\s*"([^"]+)"', f.read(), flags=re.M))
    assert hints.get(method.label), f"no hint for {method.label!r}"
    assert method.label in hints["Merge method"], "the method radio's hint should say what each choice does"
    with open(os.path.join(EXTENSION_DIR, "scripts", "tokenmerge_ui.py"), encoding="utf-8") as f:
        api = f.read().split('"""')[1]
    assert f'"{method.label}"' in api


@ALL
def test_the_options_a_method_reads_are_parameters_of_the_table(method):
    assert set(method.reads) <= set(tm.KEYS)
    assert tm.METHOD_KEYS[method.name] == method.reads
    assert method.weighs_keys == ("size_weighted_keys" in method.reads)


# "auto" levels per method and layout: where each gains (SD 1.x: attention at levels 0-3; SDXL: at 1 and 2).
AUTO_LEVELS = {"tome": ({0}, {1}), "todo": ({0}, {1}), "local": ({0}, {1}), "stack": ({0}, {1, 2}),
               "cache": ({1, 2, 3}, {2})}


@ALL
def test_each_methods_auto_levels_are_where_it_gains_and_max_downsample_still_chooses(method):
    assert set(AUTO_LEVELS) == set(methods.METHOD_NAMES)
    for layout, want in zip(("sd1", "sdxl"), AUTO_LEVELS[method.name]):
        unet = tiny_unet(layout)
        assert {lv for _, _, lv in tome_core.patch.transformer_levels(unet)} == ({0, 1, 2, 3} if layout == "sd1"
                                                                                else {1, 2})
        tome_core.apply_patch(unet, method=method.name)
        assert {b.level for b in tome_core.patched_blocks(unet)} == want, layout
        tome_core.apply_patch(unet, method=method.name, max_downsample=2)
        assert {b.level for b in tome_core.patched_blocks(unet)} == ({0, 1} if layout == "sd1" else {1}), layout


def test_the_patch_names_no_method():
    """The patch's life cycle calls the method's behaviour without knowing which it is."""
    source = inspect.getsource(tome_core.patch)
    body = source.split("# -- public API")[0]
    assert not re.search(r"\.method\s*(==|!=|in\b)", body)
    for method in methods.METHODS:
        assert f'"{method.name}"' not in body, method.name
