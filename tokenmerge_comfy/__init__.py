"""The ComfyUI node pack: ``nodes`` holds the nodes; the repository's own ``__init__.py`` hands them to ComfyUI."""
