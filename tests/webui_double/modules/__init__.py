"""The double's stand-in for the webui's ``modules`` package."""

IS_WEBUI_DOUBLE = True
