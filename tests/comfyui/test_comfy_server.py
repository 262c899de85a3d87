"""The node pack in a running ComfyUI server, driven over its HTTP API (``POST /prompt``, ``GET /history/<id>``
and the PNG files SaveImage writes): see ``comfy_server``."""

from __future__ import annotations

import json
import os
import urllib.error

import numpy as np
import pytest
from PIL import Image

from comfy_server import advanced, workflow


def test_the_server_lists_the_nodes_with_their_inputs(server):
    info = server.get("/object_info")
    assert info["TokenMerging"]["display_name"] == "Token Merging (ToMe)"
    required = info["TokenMergingAdvanced"]["input"]["required"]
    assert required["method"][0] == ["ToMe", "ToDo", "Local", "Stack", "Cache"]
    assert required["ratio"][1]["max"] == 0.9 and "cache_warmup" in required
    assert info["TokenMerging"]["category"] == "model_patches/unet"


@pytest.mark.parametrize("method", ["ToMe", "Cache"])
def test_a_workflow_samples_the_same_checkpoint_with_and_without_the_node(server, method):
    plain = server.images(server.run(workflow(prefix="plain")))["7"]
    entry = server.run(workflow(merge=advanced(method=method), plain_branch=True, prefix=f"both-{method}"))
    assert entry["status"]["status_str"] == "success"
    images = server.images(entry)
    assert np.array_equal(images["32"], plain)  # the branch without the node: exactly the plain pixels
    assert not np.array_equal(images["7"], plain)
    # A second prompt with the plain workflow alone, after the merged one: still the plain pixels.
    assert np.array_equal(server.images(server.run(workflow(prefix="plain-again")))["7"], plain)


def test_the_simple_node_and_a_hires_workflow_run(server):
    entry = server.run(workflow(merge={"class_type": "TokenMerging",
                                       "inputs": {"method": "Recommended", "ratio": 0.5}},
                                hires=True, sampler="dpmpp_2m", prefix="hires"))
    assert entry["status"]["status_str"] == "success"
    assert server.images(entry)["7"].shape == (96, 96, 3)


def test_an_image_loaded_back_from_its_png_gives_the_same_pixels(server):
    entry = server.run(workflow(merge=advanced(method="ToMe", ratio=0.6, sx=3), prefix="saved"))
    image = entry["outputs"]["7"]["images"][0]
    png = Image.open(os.path.join(server.output, image["subfolder"], image["filename"]))
    saved = json.loads(png.info["prompt"])  # what SaveImage wrote into the PNG: every setting and the seed
    assert saved["10"]["inputs"]["ratio"] == 0.6 and saved["10"]["inputs"]["sx"] == 3
    assert saved["5"]["inputs"]["seed"] == 5
    assert "workflow" not in png.info or png.info["workflow"]  # written by the page's own queueing
    saved["7"]["inputs"]["filename_prefix"] = "reloaded"
    again = server.run(saved)
    assert np.array_equal(server.images(again)["7"], np.asarray(png.convert("RGB")))


def test_out_of_range_values_are_refused_before_anything_runs(server):
    with pytest.raises(urllib.error.HTTPError) as refused:
        server.post("/prompt", {"prompt": workflow(merge=advanced(ratio=5.0))})
    body = json.loads(refused.value.read())
    assert refused.value.code == 400
    errors = body["node_errors"]["10"]["errors"]
    assert [(e["details"], e["message"]) for e in errors] == [("ratio", "Value 5.0 bigger than max of 0.9")]


def test_settings_that_cannot_be_used_fail_the_prompt_with_the_reason_and_patch_nothing(server):
    plain = server.images(server.run(workflow(prefix="plain-before")))["7"]
    entry = server.run(workflow(merge=advanced(step_start=0.9, step_end=0.1), prefix="bad-window"))
    assert entry["status"]["status_str"] == "error"
    messages = json.dumps(entry["status"]["messages"])
    assert "step_start must not exceed step_end" in messages
    assert np.array_equal(server.images(server.run(workflow(prefix="plain-after")))["7"], plain)
