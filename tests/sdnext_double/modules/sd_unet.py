"""SD.Next's sd_unet: UNet overrides loaded from files (``loaded_unet``); it has no ``current_unet``."""

unet_dict: dict = {}
loaded_unet = None
failed_unet: list = []
