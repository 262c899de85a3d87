"""Alternative U-Nets (TensorRT and the like): when one is active the model's own blocks do not run."""

current_unet = None


def apply_unet(option=None) -> None:
    """The webui picks the alternative U-Net here, after the ``process`` hook; the double keeps whatever a
    test set in ``current_unet``."""
