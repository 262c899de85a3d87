"""Forge's ``modules``: Forge keeps the A1111 webui's Script API, callbacks, settings, infotext and X/Y/Z
plot, so this package serves the A1111 double's modules, except those whose file is here (``processing``,
``sd_models``), which are Forge's."""

import importlib.util
import os
import sys

IS_WEBUI_DOUBLE = True
IS_FORGE = True

A1111_MODULES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                             "webui_double", "modules")
__path__.append(A1111_MODULES)


def load_a1111(name: str):
    """The A1111 double's module ``name`` as ``modules._a1111_<name>``, for a Forge module built on it."""
    spec = importlib.util.spec_from_file_location(f"modules._a1111_{name}", os.path.join(A1111_MODULES, f"{name}.py"))
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
