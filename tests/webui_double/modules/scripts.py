"""Scripts: the ``Script`` base class, loading script files, and the per-tab ``ScriptRunner``.

Script files are executed as modules named after their file ("xyz_grid.py"), with the extension's directory
on ``sys.path`` only while the file loads; builtin scripts load before extensions' scripts. Each tab gets its
own instance of every Script class. A hook runs only for always-on scripts whose class overrides it, with
the script's own slice ``p.script_args[args_from:args_to]``; an exception in a hook is reported and skipped.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import re
import sys
from typing import Any, NamedTuple

import gradio as gr

from modules import errors, script_callbacks

AlwaysVisible = object()


class ScriptClassData(NamedTuple):
    script_class: type
    path: str
    basedir: str
    module: Any


scripts_data: list[ScriptClassData] = []
current_basedir = ""


def basedir() -> str:
    """The directory of the extension whose script is being loaded (valid at import time only)."""
    return current_basedir


class Script:
    name: str | None = None
    section: str | None = None
    filename: str | None = None
    args_from: int | None = None
    args_to: int | None = None
    alwayson = False
    is_txt2img = False
    is_img2img = False
    tabname: str | None = None
    group = None
    create_group = True
    infotext_fields: list | None = None
    paste_field_names: list | None = None
    api_info: dict | None = None
    setup_for_ui_only = False
    controls: list | None = None

    def title(self) -> str:
        raise NotImplementedError

    def ui(self, is_img2img: bool):
        return None

    def show(self, is_img2img: bool):
        return True

    def run(self, p, *args):
        return None

    # Hooks: the runner calls only those a subclass overrides.
    def setup(self, p, *args):
        pass

    def before_process(self, p, *args):
        pass

    def process(self, p, *args):
        pass

    def before_process_batch(self, p, *args, **kwargs):
        pass

    def process_batch(self, p, *args, **kwargs):
        pass

    def process_before_every_sampling(self, p, *args, **kwargs):
        pass

    def before_hr(self, p, *args):
        pass

    def postprocess_batch(self, p, *args, **kwargs):
        pass

    def postprocess_image(self, p, pp, *args):
        pass

    def postprocess(self, p, processed, *args):
        pass

    def elem_id(self, item_id: str) -> str:
        """``script_[tab_]<title>_<item_id>``: the tab part only for scripts shown in both tabs alike."""
        tab = (("img2img_" if self.is_img2img else "txt2img_") if self.show(True) == self.show(False) else "")
        title = re.sub(r"[^a-z_0-9]", "", re.sub(r"\s", "_", self.title().lower()))
        return f"script_{tab}{title}_{item_id}"


def load_module(path: str):
    spec = importlib.util.spec_from_file_location(os.path.basename(path), path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_scripts(builtin_dir: str, extension_dirs: list[str]) -> None:
    """Like a webui start or "Reload UI": old scripts are told to unload, callbacks are cleared, then the
    builtin scripts and each extension's ``scripts/*.py`` are executed afresh."""
    global current_basedir
    script_callbacks.script_unloaded_callback()
    scripts_data.clear()
    script_callbacks.clear_callbacks()
    files = [(builtin_dir, os.path.join(builtin_dir, f)) for f in sorted(os.listdir(builtin_dir)) if f.endswith(".py")]
    for ext in extension_dirs:
        folder = os.path.join(ext, "scripts")
        files += [(ext, os.path.join(folder, f)) for f in sorted(os.listdir(folder)) if f.endswith(".py")]
    saved_path = sys.path
    for base, path in files:
        try:
            if base != builtin_dir:
                sys.path = [base] + sys.path
            current_basedir = base
            module = load_module(path)
            for value in module.__dict__.values():
                if inspect.isclass(value) and issubclass(value, Script) and value is not Script:
                    scripts_data.append(ScriptClassData(value, path, base, module))
        except Exception:
            errors.report(f"Error loading script: {path}", exc_info=True)
        finally:
            sys.path = saved_path
            current_basedir = ""


class ScriptRunner:
    """The scripts of one tab: UI building (``inputs`` is the tab's flat input list; slot 0 is the
    dropdown of selectable scripts), hook dispatch, and running a selected script."""

    def __init__(self) -> None:
        self.scripts: list[Script] = []
        self.alwayson_scripts: list[Script] = []
        self.selectable_scripts: list[Script] = []
        self.inputs: list[Any] = [None]
        self.infotext_fields: list = []
        self.paste_field_names: list[str] = []

    def initialize_scripts(self, is_img2img: bool) -> None:
        for data in scripts_data:
            script = data.script_class()
            script.filename = data.path
            script.is_txt2img = not is_img2img
            script.is_img2img = is_img2img
            script.tabname = "img2img" if is_img2img else "txt2img"
            visibility = script.show(is_img2img)
            if visibility is AlwaysVisible:
                script.alwayson = True
                self.scripts.append(script)
                self.alwayson_scripts.append(script)
            elif visibility:
                self.scripts.append(script)
                self.selectable_scripts.append(script)

    def create_script_ui(self, script: Script) -> None:
        script.args_from = len(self.inputs)
        script.args_to = len(self.inputs)
        try:
            controls = script.ui(script.is_img2img)
        except Exception:
            errors.report(f"Error creating UI for {script.filename}", exc_info=True)
            return
        script.controls = controls
        if controls is None:
            return
        script.name = script.title().lower()
        script.api_info = {"name": script.name, "is_img2img": script.is_img2img, "is_alwayson": script.alwayson,
                           "args": [_arg_info(c) for c in controls]}
        self.infotext_fields += script.infotext_fields or []
        self.paste_field_names += script.paste_field_names or []
        self.inputs += controls
        script.args_to = len(self.inputs)

    def setup_ui(self) -> None:
        """Always-on scripts first, then the dropdown of selectable scripts, then their controls."""
        for script in self.alwayson_scripts:
            self.create_script_ui(script)
        self.inputs[0] = gr.Dropdown(choices=["None"] + [s.title() for s in self.selectable_scripts],
                                     value="None", type="index", label="Script")
        for script in self.selectable_scripts:
            self.create_script_ui(script)

    def default_args(self) -> list[Any]:
        """API defaults: every script's ``ui()`` again, in a throw-away Blocks, taking each control's value."""
        args = [0] * len(self.inputs)
        with gr.Blocks():
            for script in self.alwayson_scripts + self.selectable_scripts:
                if script.args_from == script.args_to:
                    continue
                controls = script.ui(script.is_img2img)
                for i, control in enumerate(controls[: script.args_to - script.args_from]):
                    args[script.args_from + i] = control.value
        return args

    def title_to_script(self, name: str) -> Script | None:
        for script in self.scripts:
            if script.title().lower() == name.lower():
                return script
        return None

    # -- hooks ------------------------------------------------------------------------------------------------

    def _call(self, hook: str, p, *args, **kwargs) -> None:
        for script in self.alwayson_scripts:
            if getattr(type(script), hook) is getattr(Script, hook):
                continue
            own = p.script_args[script.args_from:script.args_to]
            try:
                getattr(script, hook)(p, *args, *own, **kwargs)
            except Exception:
                errors.report(f"Error running {hook}: {script.filename}", exc_info=True)

    def setup_scripts(self, p) -> None:
        self._call("setup", p)

    def before_process(self, p) -> None:
        self._call("before_process", p)

    def process(self, p) -> None:
        self._call("process", p)

    def before_process_batch(self, p, **kwargs) -> None:
        self._call("before_process_batch", p, **kwargs)

    def process_batch(self, p, **kwargs) -> None:
        self._call("process_batch", p, **kwargs)

    def process_before_every_sampling(self, p, **kwargs) -> None:
        self._call("process_before_every_sampling", p, **kwargs)

    def before_hr(self, p) -> None:
        self._call("before_hr", p)

    def postprocess_batch(self, p, images, **kwargs) -> None:
        self._call("postprocess_batch", p, images=images, **kwargs)

    def postprocess_image(self, p, pp) -> None:
        self._call("postprocess_image", p, pp)

    def postprocess(self, p, processed) -> None:
        self._call("postprocess", p, processed)

    def run(self, p, *args):
        """Run the script selected in slot 0, or return None when none is."""
        index = args[0] or 0
        if index == 0:
            return None
        script = self.selectable_scripts[index - 1]
        return script.run(p, *args[script.args_from:script.args_to])


def _arg_info(control) -> dict:
    info = {"label": getattr(control, "label", None) or ""}
    for field in ("value", "minimum", "maximum", "step"):
        if getattr(control, field, None) is not None:
            info[field] = getattr(control, field)
    choices = getattr(control, "choices", None)
    if choices is not None:
        info["choices"] = [c[0] if isinstance(c, tuple) else c for c in choices]
    return info
