#!/usr/bin/env bash
# Set up the A1111 WebUI v1.10.1 harness: the webui's tree and the repositories it pins, a Python 3.11 venv with CPU
# torch, a tiny random-weight SD 1 checkpoint with an offline CLIP tokenizer. Idempotent; safe to re-run.
# Sources: from GitHub at the pinned commits (git fetch --depth 1), or with MIRROR=DIR from local bare git dirs
# $MIRROR/<owner>+<name>/repo (see ../common.sh): kklouzal/stable-diffusion-webui (A1111's own history; a clone
# takes AUTOMATIC1111/stable-diffusion-webui), Stability-AI/stablediffusion (a clone takes the A1111 maintainers'
# copy w-e-w/stablediffusion: the original repository is gone), Stability-AI/generative-models,
# crowsonkb/k-diffusion, AUTOMATIC1111/stable-diffusion-webui-assets, salesforce/BLIP, openai/CLIP.
# Packages: PyPI only.
# Usage: [HOSTS=DIR] [MIRROR=DIR] a1111/setup.sh    (the harness goes to $HOSTS/a1111)
set -euo pipefail
. "$(dirname "$0")/env.sh"      # and ../common.sh: get_tree, setup_phase, setup_venv ...

# 1. webui = upstream master 82a973c (v1.10.1 + changelog), then the repositories launch_utils.py would clone, at the
#    commits it pins (large pictures and notebooks left out)
setup_phase sources
get_tree "$A1111_REPO" "$A1111_COMMIT" "$WEBUI"
get_tree AUTOMATIC1111+stable-diffusion-webui-assets 6f7db241d2f8ba7457bac5ca9753331f0c266917 "$WEBUI/repositories/stable-diffusion-webui-assets"
get_tree Stability-AI+stablediffusion cf1d67a6fd5ea1aa600c4df58e5b47da45f6bdbf "$WEBUI/repositories/stable-diffusion-stability-ai" assets
get_tree Stability-AI+generative-models 45c443b316737a4ab6e40413d7794a7f5657c19f "$WEBUI/repositories/generative-models"
get_tree crowsonkb+k-diffusion ab527a9a6d347f364e3d185ba6d714e22d80cb3c "$WEBUI/repositories/k-diffusion"
get_tree salesforce+BLIP 48211a1594f1321b00f14c9f7a5b4813144b2fb9 "$WEBUI/repositories/BLIP" BLIP.gif
get_tree openai+CLIP d50d76daa670286dd6cacf3bcd80b5e4823fc8e1 "$A1111_HARNESS/src/CLIP" CLIP.png notebooks
setup_extract_only

# 2. venv + CPU torch + requirements (setuptools pin relaxed, torch/torchvision pinned via constraints), `clip`
setup_webui_venv torch torchvision clip open_clip transformers gradio

# 3. tiny random SD1 model + offline CLIP tokenizer/config
setup_phase model
if [ ! -f "$A1111_MODELS/Stable-diffusion/tiny-sd1.safetensors" ]; then
  "$VENV/bin/python" "$HOST_SCRIPTS/make_tiny_model.py" --webui "$WEBUI" --out "$A1111_MODELS" --hf-home "$HF_HOME"
else
  echo "have $A1111_MODELS/Stable-diffusion/tiny-sd1.safetensors"
fi
setup_done
