"""SD.Next's scripts: the ``Script`` base class (every hook a no-op method), script loading and the per-tab
``ScriptRunner``. A hook runs for every always-on script with ``args_to > 0``, whatever its arguments, given
``p.per_script_args.get(title, p.script_args[args_from:args_to])``; an exception in it is displayed and the
job goes on. Script files load as modules named after their file, with the extension's directory first on
``sys.path`` only while the file loads; builtin scripts load first."""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from typing import Any, NamedTuple

import gradio as gr

from modules import errors, script_callbacks


class AlwaysVisible:
    pass


class PostprocessImageArgs:
    def __init__(self, image):
        self.image = image


class PostprocessBatchListArgs:
    def __init__(self, images):
        self.images = images


class ScriptClassData(NamedTuple):
    script_class: type
    path: str
    basedir: str
    module: Any


scripts_data: list[ScriptClassData] = []
current_basedir = ""


def basedir() -> str:
    return current_basedir


class Script:
    parent = None
    name = None
    filename = None
    args_from = 0
    args_to = 0
    alwayson = False
    is_txt2img = False
    is_img2img = False
    api_info = None
    group = None
    infotext_fields = None
    paste_field_names = None
    section = None
    standalone = False
    external = False

    def title(self):
        raise NotImplementedError

    def ui(self, is_img2img):
        pass

    def show(self, is_img2img):
        return True

    def run(self, p, *args):
        pass

    def setup(self, p, *args):
        pass

    def before_process(self, p, *args):
        pass

    def process(self, p, *args):
        pass

    def process_images(self, p, *args):
        pass

    def before_process_batch(self, p, *args, **kwargs):
        pass

    def process_batch(self, p, *args, **kwargs):
        pass

    def postprocess_batch(self, p, *args, **kwargs):
        pass

    def postprocess_image(self, p, pp, *args):
        pass

    def postprocess_batch_list(self, p, pp, *args, **kwargs):
        pass

    def postprocess(self, p, processed, *args):
        pass

    def elem_id(self, item_id):
        title = re.sub(r"[^a-z_0-9]", "", re.sub(r"\s", "_", self.title().lower()))
        return f"script_{self.parent}_{title}_{item_id}"


def load_scripts(builtin_dir: str, extension_dirs: list[str]) -> None:
    global current_basedir
    scripts_data.clear()
    script_callbacks.clear_callbacks()
    files = [(builtin_dir, os.path.join(builtin_dir, f)) for f in sorted(os.listdir(builtin_dir)) if f.endswith(".py")]
    for directory in extension_dirs:
        folder = os.path.join(directory, "scripts")
        files += [(directory, os.path.join(folder, f)) for f in sorted(os.listdir(folder)) if f.endswith(".py")]
    for base, path in files:
        saved = list(sys.path)
        try:
            sys.path = [base] + sys.path
            current_basedir = base
            spec = importlib.util.spec_from_file_location(os.path.basename(path), path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            for value in module.__dict__.values():
                if isinstance(value, type) and issubclass(value, Script) and value is not Script:
                    scripts_data.append(ScriptClassData(value, path, base, module))
        except Exception as error:
            errors.display(error, f"Load script: {os.path.basename(path)}")
        finally:
            sys.path = saved
            current_basedir = ""


def wrap_call(func, filename, funcname, *args, default=None, **kwargs):
    try:
        return func(*args, **kwargs)
    except Exception as error:
        errors.display(error, f"Calling script: {filename}/{funcname}")
    return default


class ScriptRunner:
    def __init__(self, name: str = "") -> None:
        self.name = name
        self.scripts: list[Script] = []
        self.selectable_scripts: list[Script] = []
        self.alwayson_scripts: list[Script] = []
        self.titles: list[str] = []
        self.infotext_fields: list = []
        self.paste_field_names: list[str] = []
        self.inputs: list = [None]
        self.is_img2img = False

    def initialize_scripts(self, is_img2img: bool = False) -> None:
        self.is_img2img = is_img2img
        for script_class, path, _base, _module in sorted(scripts_data, key=lambda d: d.script_class().title().lower()):
            script = script_class()
            script.filename = path
            script.is_txt2img, script.is_img2img = not is_img2img, is_img2img
            visibility = script.show(script.is_img2img)
            if visibility == AlwaysVisible:
                self.scripts.append(script)
                self.alwayson_scripts.append(script)
                script.alwayson = True
            elif visibility:
                self.scripts.append(script)
                self.selectable_scripts.append(script)

    def setup_ui(self, parent: str = "txt2img") -> list:
        self.titles = [script.title() for script in self.selectable_scripts]
        inputs: list = []

        def create_script_ui(script: Script) -> None:
            script.parent = parent
            script.args_from = script.args_to = len(inputs)
            controls = wrap_call(script.ui, script.filename, "ui", script.is_img2img)
            if controls is None:
                return
            script.name = script.title().lower()
            if script.infotext_fields is not None:
                self.infotext_fields += script.infotext_fields
            if script.paste_field_names is not None:
                self.paste_field_names += script.paste_field_names
            inputs.extend(controls)
            script.args_to = len(inputs)

        dropdown = gr.Dropdown(label="Script", choices=["None"] + self.titles, value="None", type="index")
        inputs.insert(0, dropdown)
        for script in self.alwayson_scripts:
            with gr.Group(elem_id=f"{parent}_script_{script.title().lower().replace(' ', '_')}"):
                create_script_ui(script)
        for script in self.selectable_scripts:
            with gr.Group(visible=False):
                create_script_ui(script)
        self.inputs = inputs
        return inputs

    def default_args(self) -> list:
        """The API's ``init_default_script_args``: every script's ``ui()`` once more, its values."""
        last = max([1] + [script.args_to for script in self.scripts])
        args: list = [None] * last
        args[0] = 0
        with gr.Blocks():
            for script in self.scripts:
                controls = script.ui(script.is_img2img)
                if controls:
                    args[script.args_from:script.args_to] = [c.value for c in controls]
        return args

    def title_to_script(self, name: str) -> Script | None:
        for script in self.scripts:
            if script.title().lower() == name.lower():
                return script
        return None

    def run(self, p, *args):
        index = args[0] if args else 0
        if not index:
            return None
        script = self.selectable_scripts[index - 1]
        return script.run(p, *p.per_script_args.get(script.title(), args[script.args_from:script.args_to]))

    def _each(self, hook: str, p, *leading, **kwargs) -> None:
        for script in self.alwayson_scripts:
            try:
                if script.args_to > 0 and script.args_to >= script.args_from:
                    args = p.per_script_args.get(script.title(), p.script_args[script.args_from:script.args_to])
                    getattr(script, hook)(p, *leading, *args, **kwargs)
            except Exception as error:
                errors.display(error, f"Running script {hook}: {script.filename}")

    def before_process(self, p, **kwargs): self._each("before_process", p, **kwargs)
    def process(self, p, **kwargs): self._each("process", p, **kwargs)
    def before_process_batch(self, p, **kwargs): self._each("before_process_batch", p, **kwargs)
    def process_batch(self, p, **kwargs): self._each("process_batch", p, **kwargs)
    def postprocess(self, p, processed): self._each("postprocess", p, processed)
    def postprocess_image(self, p, pp): self._each("postprocess_image", p, pp)
    def postprocess_batch_list(self, p, pp, **kwargs): self._each("postprocess_batch_list", p, pp, **kwargs)

    def postprocess_batch(self, p, images, **kwargs):
        for script in self.alwayson_scripts:
            try:
                if script.args_to > 0 and script.args_to >= script.args_from:
                    args = p.per_script_args.get(script.title(), p.script_args[script.args_from:script.args_to])
                    script.postprocess_batch(p, *args, images=images, **kwargs)
            except Exception as error:
                errors.display(error, f"Running script postprocess_batch: {script.filename}")

    def process_images(self, p, **kwargs):
        processed = None
        for script in self.alwayson_scripts:
            try:
                if script.args_to > 0 and script.args_to >= script.args_from:
                    args = p.per_script_args.get(script.title(), p.script_args[script.args_from:script.args_to])
                    result = script.process_images(p, *args, **kwargs)
                    processed = result if result is not None else processed
            except Exception as error:
                errors.display(error, f"Running script process_images: {script.filename}")
        return processed
