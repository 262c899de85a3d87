"""A test double of SD.Next (vladmandic/sdnext at 058a7f0), limited to what an always-on Script meets.

Written from what ``tests/real_hosts/hosts/sdnext/README.md`` records of the real SD.Next and from its source, around
real diffusers classes at a tiny size (``model``):
- ``modules.scripts`` / ``scripts_manager``: Script, AlwaysVisible, scripts_data and SD.Next's ScriptRunner: every
  hook of every always-on script runs, with ``p.per_script_args[title]`` (the API request's args list, as sent)
  or else its slice of ``p.script_args``; an exception in a hook is reported and skipped.
- ``modules.processing``: the processing objects (``p.sd_model`` a read-only property) and ``process_images``
  in SD.Next's order: before_process, override_settings applied, process, before_process_batch,
  process_batch, ``processing_diffusers.process_diffusers``, postprocess_batch(_list), postprocess_image,
  postprocess (skipped when sampling failed or was interrupted), after_process callbacks and the settings
  restored in a ``finally``. Never called: setup, process_before_every_sampling, before_hr, on_cfg_denoiser.
- ``modules.processing_diffusers``: base pass and hires pass (an img2img pipeline from the same components, no
  hook in between, ``p.is_hr_pass`` True during it), each preceded by ``process_pre`` (the built-in token
  merging from the settings, then HiDiffusion's unapply, which resets every module with a ``_parent``) and
  followed by ``process_post``; a RuntimeError/ValueError in a pass is logged and interrupts the job.
- ``modules.token_merge`` / ``hidiffusion``: SD.Next's built-in ToMe (real tomesd 0.1.3) and ToDo, HiDiffusion's
  reset; ``processing_info``: the infotext with SD.Next's reserved ``ToMe``/``ToDo`` keys; ``infotext``: its
  parser (numbers and booleans typed, keys ``[\\w ]+`` only); ``script_callbacks``, ``ui_components``
  (InputAccordion), ``shared``, ``errors``, ``sd_unet``.
- ``builtin_scripts/xyz_grid.py``: the selectable "xyz grid script" with ``axis_options`` (from
  ``xyz_grid_classes``), each cell a full ``process_images`` on a copy of ``p``.
- ``host``: loads scripts like SD.Next, builds both tabs' UI in a gr.Blocks, serves API-style requests.
"""

from __future__ import annotations

import os

SDNEXT_DOUBLE_DIR = os.path.dirname(os.path.abspath(__file__))
