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
SCRIPTS=$(cd "$(dirname "$0")" && pwd)
. "$SCRIPTS/env.sh"
PY=${PYTHON311:-python3.11}
TORCH_WHL=${TORCH_WHL:-torch==2.13.0}
mkdir -p "$FORGE_HARNESS"
T_START=$(date +%s)

# 1. Forge, then the repositories modules/launch_utils.py would clone, at the commits it pins
#    (read from the extracted launch_utils.py, falling back to the values current at Forge dfdcbab)
get_tree lllyasviel+stable-diffusion-webui-forge "${FORGE_COMMIT:-dfdcbab685e57677014f05a3309b48cc87383167}" "$FORGE"
pin() {  # VAR default : commit hash pinned in launch_utils.py
  local v
  v=$(grep -oE "'$1', \"[0-9a-f]{40}\"" "$FORGE/modules/launch_utils.py" | grep -oE '[0-9a-f]{40}' || true)
  echo "${v:-$2}"
}
ASSETS_C=$(pin ASSETS_COMMIT_HASH 6f7db241d2f8ba7457bac5ca9753331f0c266917)
HFGUESS_C=$(pin HUGGINGFACE_GUESS_HASH 84826248b49bb7ca754c73293299c4d4e23a548d)
BLIP_C=$(pin BLIP_COMMIT_HASH 48211a1594f1321b00f14c9f7a5b4813144b2fb9)
CLIP_C=$(grep -oE "openai/CLIP/archive/[0-9a-f]{40}" "$FORGE/modules/launch_utils.py" | grep -oE '[0-9a-f]{40}' || echo d50d76daa670286dd6cacf3bcd80b5e4823fc8e1)
get_tree AUTOMATIC1111+stable-diffusion-webui-assets "$ASSETS_C" "$FORGE/repositories/stable-diffusion-webui-assets"
get_tree lllyasviel+huggingface_guess "$HFGUESS_C" "$FORGE/repositories/huggingface_guess"
get_tree salesforce+BLIP "$BLIP_C" "$FORGE/repositories/BLIP"
get_tree openai+CLIP "$CLIP_C" "$FORGE_HARNESS/src/CLIP"

# 2. venv + CPU torch + Forge's requirements_versions.txt (one pin changed: setuptools), torchvision 0.28.0 patched
T_VENV=$(date +%s)
[ -x "$FORGE_VENV/bin/python" ] || "$PY" -m venv "$FORGE_VENV"
pipq() {  # pip, minus the noisy "Location ... is ignored" lines; keeps pip's exit status
  local out rc=0; out=$("$FORGE_VENV/bin/pip" "$@" 2>&1) || rc=$?
  out=$(grep -v "is ignored: it is neither" <<< "$out" || true); [ -z "$out" ] || echo "$out"; return $rc
}
pipq install -q "$TORCH_WHL"
pipq install -q -r "$SCRIPTS/requirements-forge-cpu.txt" torchvision==0.28.0 -c "$SCRIPTS/constraints-forge.txt"
pipq install -q --no-deps --no-build-isolation "$FORGE_HARNESS/src/CLIP"     # `clip`, as launch_utils would install
"$FORGE_VENV/bin/python" "$SCRIPTS/../patch_torchvision_cpu.py"   # CUDA-only torchvision _C vs CPU torch (every harness's)
"$FORGE_VENV/bin/python" -c "import torch, torchvision, clip, open_clip, transformers, diffusers, gradio; print('torch', torch.__version__, 'tv', torchvision.__version__, 'transformers', transformers.__version__, 'diffusers', diffusers.__version__, 'gradio', gradio.__version__)"
pipq check || echo "WARN: pip check reports conflicts (see above)"
T_VENV=$(( $(date +%s) - T_VENV ))

# 3. random-weight SD1.5-layout checkpoint (full size, fp16 safetensors); tokenizer/configs come from Forge's backend/huggingface
T_MODEL=$(date +%s)
CKPT=$FORGE_MODELS/Stable-diffusion/random-sd15.safetensors
if [ ! -f "$CKPT" ] || [ "${FORCE_MODEL:-0}" = 1 ]; then
  "$FORGE_VENV/bin/python" "$SCRIPTS/make_model.py" --forge "$FORGE" --out "$CKPT"
else
  echo "have $CKPT"
fi
T_MODEL=$(( $(date +%s) - T_MODEL ))
mkdir -p "$FORGE_RUN" "$HF_HOME"
echo "setup done in $(( $(date +%s) - T_START ))s (venv+pip ${T_VENV}s, model ${T_MODEL}s). start: $SCRIPTS/start.sh ; stop: $SCRIPTS/stop.sh"
