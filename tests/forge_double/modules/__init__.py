"""Forge's ``modules``: Forge keeps the A1111 webui's Script API, callbacks, settings, infotext and X/Y/Z
plot, so this package serves the A1111 double's modules, except those whose file is here (``processing``,
``sd_models``), which are Forge's."""

import os

IS_WEBUI_DOUBLE = True
IS_FORGE = True

__path__.append(os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                             "webui_double", "modules"))
