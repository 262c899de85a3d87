"""ComfyUI's entry to this repository, cloned into ``custom_nodes/``: the Token Merging nodes.

The same clone is an A1111-family WebUI extension (``scripts/``, which ComfyUI never loads) and holds the engine
(``tome_core``), imported here relative to this package so that the clone needs nothing installed and never
meets another copy of the engine.
"""

from .tokenmerge_comfy.nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"]
