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
#   FORCE_MODEL=1: rebuild the random checkpoint with make_model.py
#   EXTRACT_ONLY=1: lay out the source trees and stop (no pip, no model)
set -euo pipefail
SCRIPTS=$(cd "$(dirname "$0")" && pwd)
. "$SCRIPTS/env.sh"
PY=${PYTHON311:-python3.11}
TORCH_WHL=${TORCH_WHL:-torch==2.13.0}
mkdir -p "$FCLASSIC_HARNESS"
T_START=$(date +%s)

# Blobs a partial mirror may lack that SD 1.5 never reads (none known for Forge Classic); any other absent
# source-type file stops the setup.
export ABSENT_OK_RE=${ABSENT_OK_RE:-}

# 1. Forge Classic, then the repositories modules/launch_utils.py would clone, at the commits it pins (read from the
#    extracted launch_utils.py, falling back to the values current at Forge Classic 1f95d71). Unlike reForge, Forge
#    Classic clones neither k-diffusion (vendored as ldm_patched/k_diffusion) nor BLIP, and pins Stability-AI's
#    stablediffusion itself (cf1d67a, A1111 1.10's pin).
T_EXTRACT=$(date +%s)
get_tree Haoming02+sd-webui-forge-classic "${FCLASSIC_COMMIT:-1f95d7170189cf93952aca122c1ee2f306a07e4c}" "$FCLASSIC"
pin() {  # VAR default : commit hash pinned in launch_utils.py
  local v
  v=$(grep -oE "'$1', \"[0-9a-f]{40}\"" "$FCLASSIC/modules/launch_utils.py" | head -1 | grep -oE '[0-9a-f]{40}' || true)
  echo "${v:-$2}"
}
ASSETS_C=$(pin ASSETS_COMMIT_HASH 6f7db241d2f8ba7457bac5ca9753331f0c266917)
SD_C=$(pin STABLE_DIFFUSION_COMMIT_HASH cf1d67a6fd5ea1aa600c4df58e5b47da45f6bdbf)
SGM_C=$(pin STABLE_DIFFUSION_XL_COMMIT_HASH 45c443b316737a4ab6e40413d7794a7f5657c19f)
CLIP_C=$(grep -oE "openai/CLIP/archive/[0-9a-f]{40}" "$FCLASSIC/modules/launch_utils.py" | grep -oE '[0-9a-f]{40}' || echo d50d76daa670286dd6cacf3bcd80b5e4823fc8e1)
get_tree AUTOMATIC1111+stable-diffusion-webui-assets "$ASSETS_C" "$FCLASSIC/repositories/stable-diffusion-webui-assets"
get_tree Stability-AI+stablediffusion "$SD_C" "$FCLASSIC/repositories/stable-diffusion-stability-ai"
get_tree Stability-AI+generative-models "$SGM_C" "$FCLASSIC/repositories/generative-models"
get_tree openai+CLIP "$CLIP_C" "$FCLASSIC_HARNESS/src/CLIP"
# The SD1 "Approx NN" live-preview model: A1111 ships it in its repository (models/VAE-approx/model.pt), Forge Classic
# does not and downloads it from A1111's v1.0.0-pre release at the first generation (processing.py loads it whenever
# live previews are on, the default) -> offline, every txt2img would be a 500. Taken from A1111 v1.10.1.
get_file "$A1111_REPO" "$A1111_COMMIT" models/VAE-approx/model.pt "$FCLASSIC/models/VAE-approx/model.pt"
T_EXTRACT=$(( $(date +%s) - T_EXTRACT ))
if [ "${EXTRACT_ONLY:-0}" = 1 ]; then echo "sources laid out in ${T_EXTRACT}s (EXTRACT_ONLY=1: no venv, no model)"; exit 0; fi

# 2. venv + CPU torch + Forge Classic's requirements.txt (one pin added: setuptools), torchvision 0.28.0 patched
T_VENV=$(date +%s)
[ -x "$FCLASSIC_VENV/bin/python" ] || "$PY" -m venv "$FCLASSIC_VENV"
pipq() {  # pip, minus the noisy "Location ... is ignored" lines; keeps pip's exit status
  local out rc=0; out=$("$FCLASSIC_VENV/bin/pip" "$@" 2>&1) || rc=$?
  out=$(grep -v "is ignored: it is neither" <<< "$out" || true); [ -z "$out" ] || echo "$out"; return $rc
}
pipq install -q "$TORCH_WHL"
pipq install -q -r "$SCRIPTS/requirements-forge-classic-cpu.txt" torchvision==0.28.0 -c "$SCRIPTS/constraints-forge-classic.txt"
pipq install -q --no-deps --no-build-isolation "$FCLASSIC_HARNESS/src/CLIP"     # `clip`, as launch_utils would install
"$FCLASSIC_VENV/bin/python" "$SCRIPTS/../patch_torchvision_cpu.py"   # CUDA-only torchvision _C vs CPU torch (every harness's)
"$FCLASSIC_VENV/bin/python" -c "import torch, torchvision, clip, open_clip, transformers, diffusers, gradio, pydantic; print('torch', torch.__version__, 'tv', torchvision.__version__, 'transformers', transformers.__version__, 'diffusers', diffusers.__version__, 'gradio', gradio.__version__, 'pydantic', pydantic.VERSION)"
pipq check || echo "WARN: pip check reports conflicts (see above)"
T_VENV=$(( $(date +%s) - T_VENV ))

# 3. random-weight SD1.5 checkpoint (full size, fp16 safetensors, original LDM key names). Forge Classic's backend is
#    the same ldm_patched family as reForge's, so the reForge harness's checkpoint (built from ldm_patched's classes)
#    is reused by hard link when present; otherwise make_model.py builds one from Forge Classic's own classes.
T_MODEL=$(date +%s)
CKPT=$FCLASSIC_MODELS/Stable-diffusion/random-sd15.safetensors
mkdir -p "$(dirname "$CKPT")"
if [ -z "${REUSE_CKPT+x}" ]; then
  for c in "$HOSTS/reforge/models/Stable-diffusion/random-sd15.safetensors" \
           "$HOSTS/forge/models/Stable-diffusion/random-sd15.safetensors"; do
    if [ -f "$c" ]; then REUSE_CKPT=$c; break; fi
  done
fi
if [ -f "$CKPT" ] && [ "${FORCE_MODEL:-0}" != 1 ]; then
  echo "have $CKPT"
elif [ -n "${REUSE_CKPT:-}" ] && [ -f "$REUSE_CKPT" ] && [ "${FORCE_MODEL:-0}" != 1 ]; then
  ln -f "$REUSE_CKPT" "$CKPT" 2>/dev/null || cp "$REUSE_CKPT" "$CKPT"
  echo "reused $REUSE_CKPT -> $CKPT (hard link or copy)"
else
  "$FCLASSIC_VENV/bin/python" "$SCRIPTS/make_model.py" --forge-classic "$FCLASSIC" --out "$CKPT"
fi
T_MODEL=$(( $(date +%s) - T_MODEL ))
mkdir -p "$FCLASSIC_RUN" "$HF_HOME"
echo "setup done in $(( $(date +%s) - T_START ))s (extraction ${T_EXTRACT}s, venv+pip ${T_VENV}s, model ${T_MODEL}s). start: $SCRIPTS/start.sh ; stop: $SCRIPTS/stop.sh"
