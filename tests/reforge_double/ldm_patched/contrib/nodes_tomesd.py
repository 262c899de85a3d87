"""``ldm_patched.contrib.nodes_tomesd``: the built-in token merging (queries only, on a clone of the pass's
patcher), which behaves as Forge's."""

from backend.misc.tomesd import TomePatcher  # noqa: F401
