"""A test double of reForge and Forge Classic (the "old Forge" backend), limited to what differs from Forge
for an always-on Script, from the facts in the real-host set-ups' READMEs (``tests/real_hosts/hosts/reforge``, ``forge-classic``)
and reForge's ``ldm_patched`` code as read:

- ``ldm_patched.ldm``: the U-Net (``...diffusionmodules.openaimodel.UNetModel``, ComfyUI's, with ldm's class
  names and module tree) and its attention classes; blocks call self-attention as ``attn1(n, context=...,
  value=...)`` (reForge) or with ``transformer_options=`` too (Forge Classic, ``FORGE_CLASSIC``), add the
  residual out of place, and run ``attn1_patch``/``patches_replace``/``attn1_output_patch`` as Forge does;
- ``ldm_patched.contrib.nodes_tomesd``: the built-in token merging (queries only, on the pass's patcher);
- ``model``: ``shared.sd_model`` as an ldm ``LatentDiffusion`` shell (``model.diffusion_model``) that also
  carries ``forge_objects``, both holding the one U-Net.

Everything else (the patcher, per-pass ``forge_objects`` reset, the built-in before
``process_before_every_sampling``, the hires pass's extra hook call) is as in Forge, so the Forge double's
``backend`` and ``modules`` serve.
"""

from __future__ import annotations

import os
import sys

REFORGE_DOUBLE_DIR = os.path.dirname(os.path.abspath(__file__))


def install() -> None:
    """Make ``import ldm_patched...`` resolve to this double (the Forge double's backend must be there too)."""
    if REFORGE_DOUBLE_DIR not in sys.path:
        sys.path.append(REFORGE_DOUBLE_DIR)
