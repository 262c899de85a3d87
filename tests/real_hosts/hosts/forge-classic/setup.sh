#!/usr/bin/env bash
# Set up the Forge Classic harness: its tree and the repositories its launch_utils.py pins, a Python 3.11 venv with
# CPU torch 2.13 and its pins, a random-weight SD 1.5 checkpoint of real size. Idempotent; safe to re-run.
# Sources: from GitHub at the pinned commits (git fetch --depth 1), or with MIRROR=DIR from local bare git dirs
# $MIRROR/<owner>+<name>/repo (see ../common.sh): Haoming02/sd-webui-forge-classic,
# AUTOMATIC1111/stable-diffusion-webui-assets, Stability-AI/stablediffusion, Stability-AI/generative-models,
# openai/CLIP, kklouzal/stable-diffusion-webui (one file of A1111 v1.10.1: the live-preview model
# models/VAE-approx/model.pt). Packages: PyPI only.
# Usage: [HOSTS=DIR] [MIRROR=DIR] [FCLASSIC_COMMIT=rev] forge-classic/setup.sh  (the harness goes to $HOSTS/forge-classic)
#   FCLASSIC_COMMIT: Forge Classic commit to lay out (default 1f95d71 of branch `classic`, the one checked; recorded
#                    in forge-classic/.harness-extracted)
#   REUSE_CKPT=FILE: hard-link (else copy) this random SD 1.5 checkpoint instead of building one (default: the
#                    reForge harness's, then the Forge harness's, when present; REUSE_CKPT= (empty) always builds)
#   FORCE_MODEL=1: rebuild the random checkpoint with ../make_forge_model.py
#   EXTRACT_ONLY=1: lay out the source trees and stop (no pip, no model)
set -euo pipefail
. "$(dirname "$0")/env.sh"      # and ../common.sh: get_tree, launch_pin, setup_phase, setup_venv ...

# Blobs a partial mirror may lack that SD 1.5 never reads (none known for Forge Classic); any other absent
# source-type file stops the setup.
export ABSENT_OK_RE=${ABSENT_OK_RE:-}

# 1. Forge Classic, then the repositories modules/launch_utils.py would clone, at the commits it pins (read from the
#    extracted launch_utils.py, falling back to the values current at Forge Classic 1f95d71). Unlike reForge, Forge
#    Classic clones neither k-diffusion (vendored as ldm_patched/k_diffusion) nor BLIP, and pins Stability-AI's
#    stablediffusion itself (cf1d67a, A1111 1.10's pin).
setup_phase extraction
get_tree Haoming02+sd-webui-forge-classic "${FCLASSIC_COMMIT:-1f95d7170189cf93952aca122c1ee2f306a07e4c}" "$FCLASSIC"
get_tree AUTOMATIC1111+stable-diffusion-webui-assets "$(launch_pin ASSETS_COMMIT_HASH 6f7db241d2f8ba7457bac5ca9753331f0c266917)" "$FCLASSIC/repositories/stable-diffusion-webui-assets"
get_tree Stability-AI+stablediffusion "$(launch_pin STABLE_DIFFUSION_COMMIT_HASH cf1d67a6fd5ea1aa600c4df58e5b47da45f6bdbf)" "$FCLASSIC/repositories/stable-diffusion-stability-ai"
get_tree Stability-AI+generative-models "$(launch_pin STABLE_DIFFUSION_XL_COMMIT_HASH 45c443b316737a4ab6e40413d7794a7f5657c19f)" "$FCLASSIC/repositories/generative-models"
get_tree openai+CLIP "$(launch_clip_pin d50d76daa670286dd6cacf3bcd80b5e4823fc8e1)" "$FCLASSIC_HARNESS/src/CLIP"
# The SD1 "Approx NN" live-preview model: A1111 ships it in its repository (models/VAE-approx/model.pt), Forge Classic
# does not and downloads it from A1111's v1.0.0-pre release at the first generation (processing.py loads it whenever
# live previews are on, the default) -> offline, every txt2img would be a 500. Taken from A1111 v1.10.1.
get_vae_approx
setup_extract_only

# 2. venv + CPU torch + Forge Classic's requirements.txt (one pin added: setuptools), torchvision 0.28.0 patched
setup_webui_venv torch torchvision clip open_clip transformers diffusers gradio pydantic

# 3. random-weight SD1.5 checkpoint (full size, fp16 safetensors, original LDM key names). Forge Classic's backend is
#    the same ldm_patched family as reForge's, so the reForge harness's checkpoint (built from ldm_patched's classes)
#    is reused by hard link when present (else the Forge harness's); otherwise ../make_forge_model.py builds one
#    from Forge Classic's own classes.
setup_forge_checkpoint forge-classic "$HOSTS/reforge/models/Stable-diffusion/random-sd15.safetensors" "$HOSTS/forge/models/Stable-diffusion/random-sd15.safetensors"
setup_done
