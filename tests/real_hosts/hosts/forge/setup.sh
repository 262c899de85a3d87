#!/usr/bin/env bash
# Set up the Forge harness: Forge's tree and the repositories its launch_utils.py pins, a Python 3.11 venv with CPU
# torch 2.13 and Forge's pins, a random-weight SD 1.5 checkpoint of real size. Idempotent; safe to re-run.
# Sources: from GitHub at the pinned commits (git fetch --depth 1), or with MIRROR=DIR from local bare git dirs
# $MIRROR/<owner>+<name>/repo (see ../common.sh): lllyasviel/stable-diffusion-webui-forge,
# lllyasviel/huggingface_guess, AUTOMATIC1111/stable-diffusion-webui-assets, salesforce/BLIP, openai/CLIP.
# Packages: PyPI only.
# Usage: [HOSTS=DIR] [MIRROR=DIR] [FORGE_COMMIT=sha] forge/setup.sh    (the harness goes to $HOSTS/forge)
#   FORGE_COMMIT: Forge commit to lay out (default dfdcbab, f2.0.1v1.10.1, the one checked; recorded in
#                 forge/.harness-extracted)
#   FORCE_MODEL=1: rebuild the random checkpoint
set -euo pipefail
. "$(dirname "$0")/env.sh"      # and ../common.sh: get_tree, launch_pin, setup_phase, setup_venv ...

# 1. Forge, then the repositories modules/launch_utils.py would clone, at the commits it pins
#    (read from the extracted launch_utils.py, falling back to the values current at Forge dfdcbab)
setup_phase sources
get_tree lllyasviel+stable-diffusion-webui-forge "${FORGE_COMMIT:-dfdcbab685e57677014f05a3309b48cc87383167}" "$FORGE"
get_tree AUTOMATIC1111+stable-diffusion-webui-assets "$(launch_pin ASSETS_COMMIT_HASH 6f7db241d2f8ba7457bac5ca9753331f0c266917)" "$FORGE/repositories/stable-diffusion-webui-assets"
get_tree lllyasviel+huggingface_guess "$(launch_pin HUGGINGFACE_GUESS_HASH 84826248b49bb7ca754c73293299c4d4e23a548d)" "$FORGE/repositories/huggingface_guess"
get_tree salesforce+BLIP "$(launch_pin BLIP_COMMIT_HASH 48211a1594f1321b00f14c9f7a5b4813144b2fb9)" "$FORGE/repositories/BLIP"
get_tree openai+CLIP "$(launch_clip_pin d50d76daa670286dd6cacf3bcd80b5e4823fc8e1)" "$FORGE_HARNESS/src/CLIP"
setup_extract_only

# 2. venv + CPU torch + Forge's requirements_versions.txt (one pin changed: setuptools), torchvision 0.28.0 patched
setup_webui_venv torch torchvision clip open_clip transformers diffusers gradio

# 3. random-weight SD1.5-layout checkpoint (full size, fp16 safetensors); tokenizer/configs come from Forge's backend/huggingface
setup_forge_checkpoint forge
setup_done
