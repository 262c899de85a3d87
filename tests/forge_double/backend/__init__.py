"""The double's stand-in for Forge's ``backend`` package: the U-Net, its patcher and the model objects."""

IS_FORGE_DOUBLE = True
