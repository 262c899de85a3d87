"""A test double of Stable Diffusion WebUI Forge, limited to what differs from the A1111 webui for an
always-on Script (Forge keeps A1111's Script API, callbacks, infotext and X/Y/Z plot, so those parts of the
A1111 double in ``tests/webui_double`` serve both):

- ``backend``: the U-Net with Forge's call signatures and patch points (``backend.nn.unet``), the
  ``UnetPatcher`` (``backend.patcher.unet``), the model objects with ``forge_objects``
  (``backend.diffusion_engine``) and Forge's built-in token merging (``backend.misc.tomesd``);
- ``modules``: Forge's ``processing`` (a fresh ``forge_objects`` for every sampling pass, the built-in applied
  to that pass's clone, the hires pass's hook called twice, the refiner as a reload of the model) over the
  A1111 double's other modules;
- ``model``: tiny real U-Nets in Forge's model objects.

It is written from Forge's observed behaviour and documented structure, not from its code.
"""

from __future__ import annotations

import os
import sys

FORGE_DOUBLE_DIR = os.path.dirname(os.path.abspath(__file__))


def install_backend() -> None:
    """Make ``import backend...`` resolve to this double. Appended to the path, so that ``modules`` stays
    whichever double ``webui_double.testing`` put first."""
    if FORGE_DOUBLE_DIR not in sys.path:
        sys.path.append(FORGE_DOUBLE_DIR)
