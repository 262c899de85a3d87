"""A running ComfyUI server (the pinned copy, ``main.py --cpu``) for the tests, driven over its HTTP API as a
user's browser drives it, and the workflows they send it. Its checkpoint is an SD 1.5-shaped one with random
weights, made with ComfyUI's own classes (``comfy_models.write_checkpoint``) and loaded by CheckpointLoaderSimple;
this clone is in its ``custom_nodes/`` as a link, as a user installs it (``setup.sh``)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import numpy as np
from PIL import Image

from conftest import COMFYUI, _load_pack

CHECKPOINT = "tokenmerge-tiny-sd15.safetensors"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, output: str) -> None:
        self.output = output
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(os.path.join(output, "server.log"), "w")
        self.process = subprocess.Popen(
            [sys.executable, "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(self.port), "--cache-none",
             "--output-directory", output, "--disable-auto-launch"],
            cwd=COMFYUI, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 240
        while True:
            try:
                self.get("/system_stats")
                return
            except (urllib.error.URLError, ConnectionError):
                if self.process.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"ComfyUI did not start: see {self.log.name}") from None
                time.sleep(0.5)

    def get(self, path: str):
        with urllib.request.urlopen(self.url + path, timeout=60) as response:
            return json.loads(response.read())

    def post(self, path: str, body: dict):
        request = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            return json.loads(response.read())

    def run(self, prompt: dict, timeout: float = 300) -> dict:
        """Queue ``prompt`` and wait for its history entry."""
        prompt_id = self.post("/prompt", {"prompt": prompt})["prompt_id"]
        deadline = time.time() + timeout
        while time.time() < deadline:
            history = self.get(f"/history/{prompt_id}")
            if prompt_id in history and history[prompt_id].get("status", {}).get("completed") is not None:
                return history[prompt_id]
            time.sleep(0.2)
        raise TimeoutError(f"prompt {prompt_id} did not finish")

    def images(self, entry: dict) -> dict[str, np.ndarray]:
        """The pixels SaveImage wrote, by node id."""
        out = {}
        for node_id, result in entry["outputs"].items():
            for image in result.get("images", []):
                path = os.path.join(self.output, image["subfolder"], image["filename"])
                out[node_id] = np.asarray(Image.open(path).convert("RGB"))
        return out

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()


def start_server(output: str) -> Server:
    """A server writing into ``output``, with the test checkpoint in its models (made once)."""
    checkpoints = os.path.join(COMFYUI, "models", "checkpoints")
    if not os.path.exists(os.path.join(checkpoints, CHECKPOINT)):
        from comfy_models import write_checkpoint
        os.makedirs(checkpoints, exist_ok=True)
        write_checkpoint(os.path.join(checkpoints, CHECKPOINT + ".part"))
        os.replace(os.path.join(checkpoints, CHECKPOINT + ".part"), os.path.join(checkpoints, CHECKPOINT))
    return Server(output)


def workflow(*, merge: dict | None = None, plain_branch: bool = False, hires: bool = False, prefix: str = "run",
             sampler: str = "euler", seed: int = 5) -> dict:
    """An API-format workflow: checkpoint, prompts, a 64 px latent, KSampler, decode, save; with ``merge`` a Token
    Merging node ({"class_type": ..., "inputs": ...}) between the model and the KSampler; with ``plain_branch``
    a second KSampler on the plain model beside it; with ``hires`` a second pass on an upscaled latent."""
    model = ["1", 0]
    graph = {
        "1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": CHECKPOINT}},
        "2": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["1", 1], "text": "a red cube on a blue floor"}},
        "3": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["1", 1], "text": "blurry"}},
        "4": {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
    }
    if merge is not None:
        graph["10"] = {"class_type": merge["class_type"], "inputs": {"model": ["1", 0], **merge["inputs"]}}
        model = ["10", 0]

    def ksampler(model_in, latent, denoise=1.0, steps=6):
        return {"class_type": "KSampler", "inputs": {
            "model": model_in, "positive": ["2", 0], "negative": ["3", 0], "latent_image": latent, "seed": seed,
            "steps": steps, "cfg": 7.0, "sampler_name": sampler, "scheduler": "normal", "denoise": denoise}}

    graph["5"] = ksampler(model, ["4", 0])
    last = ["5", 0]
    if hires:
        graph["20"] = {"class_type": "LatentUpscale", "inputs": {"samples": ["5", 0], "upscale_method": "nearest-exact",
                                                                 "width": 96, "height": 96, "crop": "disabled"}}
        graph["21"] = ksampler(model, ["20", 0], denoise=0.5)
        last = ["21", 0]
    graph["6"] = {"class_type": "VAEDecode", "inputs": {"samples": last, "vae": ["1", 2]}}
    graph["7"] = {"class_type": "SaveImage", "inputs": {"images": ["6", 0], "filename_prefix": prefix}}
    if plain_branch:
        graph["30"] = ksampler(["1", 0], ["4", 0])
        graph["31"] = {"class_type": "VAEDecode", "inputs": {"samples": ["30", 0], "vae": ["1", 2]}}
        graph["32"] = {"class_type": "SaveImage", "inputs": {"images": ["31", 0], "filename_prefix": prefix + "-plain"}}
    return graph


def advanced(**inputs) -> dict:
    node = _load_pack().tokenmerge_comfy.nodes.TokenMergingAdvanced
    defaults = {k: v[1]["default"] for k, v in node.INPUT_TYPES()["required"].items() if k != "model"}
    return {"class_type": "TokenMergingAdvanced", "inputs": {**defaults, **inputs}}


