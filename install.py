# The webui runs this at launch. ToMe needs only torch, which the webui already has: nothing to install.
