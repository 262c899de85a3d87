"""The ComfyUI tests run in ComfyUI's own virtual environment (it needs pydantic 2, gradio 3.41 pydantic 1), which
``tests/comfyui/setup.sh`` makes in ``.comfyui/`` from the pinned copy in ``../shared/comfyui``; ``tests/run.sh``
runs them there after the rest. ComfyUI's modules are imported from that copy, on the CPU, and this clone is
loaded as ComfyUI loads a custom node pack."""

from __future__ import annotations

import asyncio
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMFYUI = os.environ.get("TOKENMERGE_COMFYUI", os.path.join(ROOT, ".comfyui", "ComfyUI"))
HERE = os.path.dirname(os.path.abspath(__file__))
for path in (COMFYUI, HERE):
    if path not in sys.path:
        sys.path.insert(0, path)

import comfy.cli_args  # noqa: E402

comfy.cli_args.args.cpu = True  # before comfy.model_management reads it

import pytest  # noqa: E402
import torch  # noqa: E402

import nodes  # noqa: E402


def _load_pack():
    """This repository, loaded by ComfyUI's own custom-node loader (as from ``custom_nodes/``)."""
    if "TokenMerging" not in nodes.NODE_CLASS_MAPPINGS:
        assert asyncio.run(nodes.load_custom_node(ROOT)), "ComfyUI could not load the node pack"
    return sys.modules[nodes.NODE_CLASS_MAPPINGS["TokenMerging"].__module__.rsplit(".", 2)[0]]


@pytest.fixture(scope="session")
def pack():
    """The loaded pack's root module (``pack.tome_core`` is the engine the nodes use)."""
    return _load_pack()


@pytest.fixture(scope="session")
def builtin_nodes():
    """ComfyUI's own TomePatchModel and EasyCache nodes, loaded by its loader as it loads its extras."""
    extras = os.path.join(COMFYUI, "comfy_extras")
    for name in ("nodes_tomesd.py", "nodes_easycache.py"):
        if not asyncio.run(nodes.load_custom_node(os.path.join(extras, name), module_parent="comfy_extras")):
            raise RuntimeError(f"ComfyUI could not load {name}")
    return nodes.NODE_CLASS_MAPPINGS


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """One ComfyUI server for the session's HTTP and browser tests (``comfy_server``)."""
    from comfy_server import start_server
    running = start_server(str(tmp_path_factory.mktemp("comfyui-output")))
    yield running
    running.stop()
