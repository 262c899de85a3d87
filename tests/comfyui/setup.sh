#!/usr/bin/env bash
# Makes .comfyui/ for the ComfyUI tests: the pinned ComfyUI (v0.3.64, a125cd8) from ../shared/comfyui, extracted, with a
# virtual environment of its own (ComfyUI needs pydantic 2, the WebUI tests gradio 3.41's pydantic 1), and this clone
# in its custom_nodes/ as a user installs it (a link). Idempotent: a second run only checks the pins.
set -euo pipefail
cd "$(dirname "$0")/../.."
SHARED=${TOKENMERGE_SHARED:-../shared}
TARBALL="$SHARED/comfyui/ComfyUI-v0.3.64-a125cd8.tar.gz"
mkdir -p .comfyui
if [ ! -f .comfyui/ComfyUI/main.py ]; then
  tar xzf "$TARBALL" -C .comfyui
fi
[ -x .comfyui/venv/bin/python ] || python3 -m venv .comfyui/venv
PIP=(.comfyui/venv/bin/python -m pip install -q --disable-pip-version-check)
"${PIP[@]}" torch==2.13.0 torchvision==0.28.0
"${PIP[@]}" -r tests/comfyui/requirements.txt
# The PyPI torchvision 0.28.0 wheel is a CUDA build: beside the CPU torch its compiled ops never load, and two of its
# fake-op registrations are unguarded, so it fails at import until they are guarded (the harness's patch).
.comfyui/venv/bin/python "$SHARED/harness/patch_torchvision_cpu.py" >/dev/null
ln -sfn ../../.. .comfyui/ComfyUI/custom_nodes/tokenmerge
