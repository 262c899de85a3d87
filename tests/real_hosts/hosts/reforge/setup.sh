#!/usr/bin/env bash
# Set up the reForge harness: reForge's tree and the repositories its launch_utils.py pins, a Python 3.11 venv with
# CPU torch 2.13 and reForge's pins, a random-weight SD 1.5 checkpoint of real size. Idempotent; safe to re-run.
# Sources: from GitHub at the pinned commits (git fetch --depth 1), or with MIRROR=DIR from local bare git dirs
# $MIRROR/<owner>+<name>/repo (see ../common.sh): Panchovix/stable-diffusion-webui-reForge,
# AUTOMATIC1111/stable-diffusion-webui-assets, Stability-AI/stablediffusion, Stability-AI/generative-models,
# crowsonkb/k-diffusion, salesforce/BLIP, openai/CLIP, kklouzal/stable-diffusion-webui (one file of A1111 v1.10.1:
# the live-preview model models/VAE-approx/model.pt). Packages: PyPI only.
# Usage: [HOSTS=DIR] [MIRROR=DIR] [REFORGE_COMMIT=sha] reforge/setup.sh    (the harness goes to $HOSTS/reforge)
#   REFORGE_COMMIT: reForge commit to lay out (default 3b56b26 of branch main, the one checked; recorded in
#                   reforge/.harness-extracted)
#   FORCE_MODEL=1: rebuild the random checkpoint
#   EXTRACT_ONLY=1: lay out the source trees and stop (no pip, no model)
set -euo pipefail
. "$(dirname "$0")/env.sh"      # and ../common.sh: get_tree, launch_pin, setup_phase, setup_venv ...

# Blobs a partial mirror may lack that SD 1.5 never reads: the Llama tokenizer of ldm_patched's newer text encoders
# (HiDream, Lumina 2 ...). Any other absent source-type file stops the setup (get_tree in ../common.sh).
export ABSENT_OK_RE=${ABSENT_OK_RE:-'^ldm_patched/modules/text_encoders/llama_tokenizer/tokenizer\.json$'}

# 1. reForge, then the repositories modules/launch_utils.py would clone, at the commits it pins (read from the
#    extracted launch_utils.py, falling back to the values current at reForge 3b56b26)
setup_phase extraction
get_tree Panchovix+stable-diffusion-webui-reForge "${REFORGE_COMMIT:-3b56b268ad9158ee8b30900973b6ccda4ec22241}" "$REFORGE"
# reForge clones `ldm` from joypaul162/Stability-AI-stablediffusion @ f16630a (a copy of Stability-AI/stablediffusion,
# whose GitHub repository went away). Stability-AI/stablediffusion @ cf1d67a (the commit A1111 1.10 pins; a clone
# takes it from the A1111 maintainers' copy, see ../common.sh) stands in: reForge uses only ldm's LatentDiffusion
# shell and its config classes (the U-Net, VAE and CLIP it runs are ldm_patched's). SD_COMMIT=f16630a... with
# URL_Stability_AI_stablediffusion=https://github.com/joypaul162/Stability-AI-stablediffusion.git takes reForge's own.
get_tree AUTOMATIC1111+stable-diffusion-webui-assets "$(launch_pin ASSETS_COMMIT_HASH 6f7db241d2f8ba7457bac5ca9753331f0c266917)" "$REFORGE/repositories/stable-diffusion-webui-assets"
get_tree Stability-AI+stablediffusion "${SD_COMMIT:-cf1d67a6fd5ea1aa600c4df58e5b47da45f6bdbf}" "$REFORGE/repositories/stable-diffusion-stability-ai"
get_tree Stability-AI+generative-models "$(launch_pin STABLE_DIFFUSION_XL_COMMIT_HASH 45c443b316737a4ab6e40413d7794a7f5657c19f)" "$REFORGE/repositories/generative-models"
get_tree crowsonkb+k-diffusion "$(launch_pin K_DIFFUSION_COMMIT_HASH ab527a9a6d347f364e3d185ba6d714e22d80cb3c)" "$REFORGE/repositories/k-diffusion"
get_tree salesforce+BLIP "$(launch_pin BLIP_COMMIT_HASH 48211a1594f1321b00f14c9f7a5b4813144b2fb9)" "$REFORGE/repositories/BLIP"
get_tree openai+CLIP "$(launch_clip_pin d50d76daa670286dd6cacf3bcd80b5e4823fc8e1)" "$REFORGE_HARNESS/src/CLIP"
# The SD1 "Approx NN" live-preview model: A1111 ships it in its repository (models/VAE-approx/model.pt), reForge does
# not and downloads it from A1111's v1.0.0-pre release at the first generation (processing.py loads it whenever live
# previews are on, the default) -> an offline reForge answers every txt2img with a 500. Taken from A1111 v1.10.1.
get_vae_approx
setup_extract_only

# 2. venv + CPU torch + reForge's requirements_versions.txt (pins changed: setuptools, pydantic),
#    torchvision 0.28.0 patched
setup_webui_venv torch torchvision clip open_clip transformers diffusers gradio pydantic

# 3. random-weight SD1.5 checkpoint (full size, fp16 safetensors, original LDM key names), built from ldm_patched's
#    own classes and checked with reForge's own model detection
setup_forge_checkpoint reforge
setup_done
