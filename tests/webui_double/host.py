"""A running double webui: scripts loaded, the UI of both tabs built in a real gr.Blocks, jobs and requests.

``Webui(extension_dir)`` loads the builtin scripts (X/Y/Z plot) and then the extension's, like a start of the
webui. With ``nowebui=True`` the scripts' UI is built before the ``on_before_ui`` callbacks run, as in a
webui started with ``--nowebui``; otherwise after them.
"""

from __future__ import annotations

import json
import os
from typing import Any

import gradio as gr

from doubles_shared import HTTPError
from modules import infotext_utils, processing, script_callbacks, scripts, shared

BUILTIN_SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "builtin_scripts")
TABS = ("txt2img", "img2img")


class Webui:
    def __init__(self, extension_dir: str, *, nowebui: bool = False, more_extension_dirs: tuple[str, ...] = ()
                 ) -> None:
        scripts.load_scripts(BUILTIN_SCRIPTS, [extension_dir, *more_extension_dirs])
        self.runners = {tab: scripts.ScriptRunner() for tab in TABS}
        for tab, runner in self.runners.items():
            runner.initialize_scripts(is_img2img=tab == "img2img")
        if not nowebui:
            script_callbacks.before_ui_callback()
        with gr.Blocks() as self.blocks:
            for tab, runner in self.runners.items():
                with gr.Tab(tab):
                    runner.setup_ui()
        if nowebui:
            script_callbacks.before_ui_callback()
        # The API's defaults: every script's ui() once more, at startup.
        self.default_args = {tab: runner.default_args() for tab, runner in self.runners.items()}

    def script(self, tab: str, title: str) -> scripts.Script:
        script = self.runners[tab].title_to_script(title)
        assert script is not None, f"no script {title!r} in {tab}"
        return script

    def ui_args(self, tab: str, values: dict[str, dict[int, Any]] | None = None) -> tuple:
        """The input list a Generate click sends: every control at its UI value, ``values`` set by
        ``{script title: {index within the script's args: value}}``."""
        runner = self.runners[tab]
        args = [c.value if c is not None else 0 for c in runner.inputs]
        args[0] = 0
        for title, by_index in (values or {}).items():
            script = self.script(tab, title)
            for index, value in by_index.items():
                args[script.args_from + index] = value
        return tuple(args)

    def generate(self, p, args: tuple):
        """A Generate click: the runner, its args, then the selected script or ``process_images``."""
        tab = "img2img" if isinstance(p, processing.StableDiffusionProcessingImg2Img) else "txt2img"
        shared.state.begin(job=tab)
        p.scripts = self.runners[tab]
        p.script_args = tuple(args)
        processed = p.scripts.run(p, *p.script_args)
        return processed if processed is not None else processing.process_images(p)

    def api(self, tab: str, request: dict) -> dict:
        """``POST /sdapi/v1/<tab>``: ``alwayson_scripts`` args are positional and fill the script's slots in
        order over the defaults; an unknown script name is HTTP 422."""
        request = dict(request)
        runner = self.runners[tab]
        args = list(self.default_args[tab])
        for name, entry in (request.pop("alwayson_scripts", None) or {}).items():
            script = runner.title_to_script(name)
            if script is None or not script.alwayson:
                raise HTTPError(422, f"always on script {name} not found")
            given = entry.get("args", [])
            for i in range(min(script.args_to - script.args_from, len(given))):
                args[script.args_from + i] = given[i]
        cls = (processing.StableDiffusionProcessingImg2Img if tab == "img2img"
               else processing.StableDiffusionProcessingTxt2Img)
        p = cls(**request)
        shared.state.begin(job=f"scripts_{tab}")
        p.is_api = True
        p.scripts = runner
        p.script_args = tuple(args)
        processed = processing.process_images(p)
        return {"images": processed.images, "parameters": request, "info": processed.js()}

    def paste(self, tab: str, infotext: str) -> dict[Any, Any]:
        """The paste button: ``{component: new value}`` for every field the paste changes."""
        fields = self.runners[tab].infotext_fields
        values = infotext_utils.paste_values(fields, infotext)
        return {field[0]: value for field, value in zip(fields, values) if value is not infotext_utils.NO_CHANGE}

    def unload(self) -> None:
        script_callbacks.script_unloaded_callback()
        script_callbacks.clear_callbacks()
        scripts.scripts_data.clear()
