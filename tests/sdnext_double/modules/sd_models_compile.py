"""SD.Next's model compile (modules/sd_models_compile.py), as far as DeepCache: the "deep-cache" compile backend
leaves a ``DeepCacheSDHelper`` in ``deepcache_worker`` (None until then), which ``check_deepcache`` enables
before every pass and disables after it. The worker here counts those calls; a test puts one in place."""

from __future__ import annotations

deepcache_worker = None


class Worker:
    """A stand-in for DeepCache's helper: whether it is on, and how often it was turned on."""

    def __init__(self) -> None:
        self.enabled, self.enables = False, 0

    def enable(self) -> None:
        self.enabled, self.enables = True, self.enables + 1

    def disable(self) -> None:
        self.enabled = False


def check_deepcache(enable: bool) -> None:
    if deepcache_worker is not None:
        if enable:
            deepcache_worker.enable()
        else:
            deepcache_worker.disable()
