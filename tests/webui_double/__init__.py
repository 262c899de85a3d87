"""A test double of the AUTOMATIC1111 webui v1.10.1, limited to the API an always-on Script uses.

It is written from the webui's documented and observed behaviour, not from its code:
- ``modules.*``: scripts (Script, AlwaysVisible, scripts_data, ScriptRunner with the webui's hook dispatch),
  shared (opts, state, sd_model), processing (txt2img/img2img processing objects and ``process_images`` with
  the webui's hook order, hires fix, batches, override settings and the built-in token merging through
  tomesd), script_callbacks, ui_components.InputAccordion (a real gradio component), sd_unet, errors and
  infotext_utils (infotext writing, parsing and paste);
- ``builtin_scripts/xyz_grid.py``: the X/Y/Z plot with AxisOption, confirm and per-cell shallow copies;
- ``model``: a real, tiny ldm U-Net wrapped like ``shared.sd_model``;
- ``host``: loads scripts like the webui, builds their UI in a gr.Blocks, serves API-style requests.

``install()`` puts ``modules`` on the import path only when the real webui's is not importable.
"""

from __future__ import annotations

import importlib.util
import os
import sys

DOUBLE_DIR = os.path.dirname(os.path.abspath(__file__))


def _is_webui_package(directory: str) -> bool:
    return all(os.path.isfile(os.path.join(directory, f)) for f in ("script_callbacks.py", "processing.py"))


def real_webui_present() -> bool:
    """A ``modules`` package that is not this double is imported or importable (a real webui's, or another
    package of that name that the double must not shadow once imported)."""
    loaded = sys.modules.get("modules")
    if loaded is not None:
        return not getattr(loaded, "IS_WEBUI_DOUBLE", False)
    spec = importlib.util.find_spec("modules")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    return any(_is_webui_package(d) for d in locations if not d.startswith(DOUBLE_DIR))


def install() -> bool:
    """Make ``import modules...`` resolve to this double; False (and nothing done) where a real webui's
    ``modules`` is importable or some other ``modules`` is already imported."""
    if real_webui_present():
        return False
    if DOUBLE_DIR not in sys.path:
        sys.path.insert(0, DOUBLE_DIR)
    return True
