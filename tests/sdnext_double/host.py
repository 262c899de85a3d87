"""A running double SD.Next: scripts loaded (builtin X/Y/Z grid, then the extension), ``on_before_ui``
callbacks, both tabs' UI in one gr.Blocks, API requests and paste."""

from __future__ import annotations

import os
from typing import Any

import gradio as gr

from doubles_shared import HTTPError
from modules import infotext, processing, script_callbacks, scripts_manager

BUILTIN_SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "builtin_scripts")
TABS = ("txt2img", "img2img")


class SDNext:
    def __init__(self, extension_dir: str) -> None:
        scripts_manager.load_scripts(BUILTIN_SCRIPTS, [extension_dir])
        self.runners = {tab: scripts_manager.ScriptRunner(tab) for tab in TABS}
        for tab, runner in self.runners.items():
            runner.initialize_scripts(is_img2img=tab == "img2img")
        script_callbacks.before_ui_callback()
        with gr.Blocks() as self.blocks:
            for tab, runner in self.runners.items():
                with gr.Tab(tab):
                    runner.setup_ui(tab)
        self.default_args = {tab: runner.default_args() for tab, runner in self.runners.items()}

    def script(self, tab: str, title: str) -> scripts_manager.Script:
        script = self.runners[tab].title_to_script(title)
        assert script is not None, f"no script {title!r} in {tab}"
        return script

    def api(self, tab: str, request: dict) -> dict:
        """``POST /sdapi/v1/<tab>`` as ``modules/api/generate.py`` and ``script.init_script_args`` serve it."""
        request = dict(request)
        runner = self.runners[tab]
        args = list(self.default_args[tab])
        alwayson = request.pop("alwayson_scripts", None) or {}
        script_name, script_args = request.pop("script_name", None), request.pop("script_args", [])
        cls = (processing.StableDiffusionProcessingImg2Img if tab == "img2img"
               else processing.StableDiffusionProcessingTxt2Img)
        p = cls(**request)
        selectable = None
        if script_name:
            names = [s.title().lower() for s in runner.selectable_scripts]
            if script_name.lower() not in names:
                raise HTTPError(422, f"Script not found: {script_name}")
            index = names.index(script_name.lower())
            selectable = runner.selectable_scripts[index]
            for i, value in enumerate(script_args):
                args[selectable.args_from + i] = value
            args[0] = index + 1
        for name, entry in alwayson.items():
            script = runner.title_to_script(name)
            if script is None:
                raise HTTPError(422, f"Always on script not found: {name}")
            if not script.alwayson:
                raise HTTPError(422, f"Selectable script cannot be in always on params: {name}")
            if "args" in entry:
                for i in range(min(script.args_to - script.args_from, len(entry["args"]))):
                    args[script.args_from + i] = entry["args"][i]
                p.per_script_args[script.title()] = entry["args"]
        p.scripts = runner
        p.script_args = tuple(args)
        processed = runner.run(p, *args) if selectable is not None else processing.process_images(p)
        return {"images": processed.images, "info": processed.js()}

    def generate(self, tab: str, values: dict[str, dict[int, Any]] | None = None, **fields: Any):
        """A Generate click: every control at its UI value, ``values`` set by
        ``{script title: {index within the script's args: value}}``."""
        runner = self.runners[tab]
        args = [c.value if c is not None else 0 for c in runner.inputs]
        args[0] = 0
        for title, by_index in (values or {}).items():
            script = self.script(tab, title)
            for index, value in by_index.items():
                args[script.args_from + index] = value
        cls = (processing.StableDiffusionProcessingImg2Img if tab == "img2img"
               else processing.StableDiffusionProcessingTxt2Img)
        p = cls(**fields)
        p.scripts = runner
        p.script_args = tuple(args)
        return processing.process_images(p)

    def paste(self, tab: str, text: str) -> dict[Any, Any]:
        """``generation_parameters_copypaste.connect_paste``: ``{component: value}`` for the fields it sets. As
        there, a field given by a function must return None or a gradio update: for a plain value SD.Next checks
        whether the field's *name* is in its skip list (``should_skip(key)`` calls ``key.lower()``), and the
        AttributeError fails the whole paste."""
        params = infotext.parse(text)
        script_callbacks.infotext_pasted_callback(text, params)
        out = {}
        for component, key in self.runners[tab].infotext_fields:
            value = key(params) if callable(key) else params.get(key)
            if value is None:
                continue
            if isinstance(value, type(gr.update())):  # SD.Next's type_of_gr_update
                if "value" in value:
                    out[component] = value["value"]
                continue
            key.lower()  # should_skip(key)
            kind = type(component.value)
            if isinstance(getattr(component, "step", None), float):
                kind = float
            out[component] = (str(value).lower() != "false") if kind is bool else kind(value)
        return out

    def unload(self) -> None:
        script_callbacks.script_unloaded_callback()
        script_callbacks.clear_callbacks()
        scripts_manager.scripts_data.clear()
