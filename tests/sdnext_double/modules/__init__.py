"""SD.Next's ``modules`` package, as far as the double goes."""

IS_WEBUI_DOUBLE = True
IS_SDNEXT_DOUBLE = True
