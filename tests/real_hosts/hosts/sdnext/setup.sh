#!/usr/bin/env bash
# Set up the SD.Next harness: SD.Next's tree, diffusers at the commit SD.Next pins, a Python 3.11 venv with CPU torch,
# a random-weight SD 1.5 diffusers folder. Idempotent; safe to re-run.
# Sources: from GitHub at the pinned commits (git fetch --depth 1), or with MIRROR=DIR from local bare git dirs
# $MIRROR/<owner>+<name>/repo (see ../common.sh): vladmandic/sdnext, huggingface/diffusers. Packages: PyPI only.
# Usage: [HOSTS=DIR] [MIRROR=DIR] [SDNEXT_COMMIT=sha] sdnext/setup.sh    (the harness goes to $HOSTS/sdnext)
#   SDNEXT_COMMIT: SD.Next commit to lay out (default: the pinned one below, the one checked)
#   FORCE_MODEL=1: rebuild the random model(s);  SDNEXT_FULL_MODEL=1: also make models/Diffusers/sd15-full, the
#   real SD 1.5 shapes (2.1 GB; select it with SDNEXT_MODEL_NAME=sd15-full start.sh)
# Layout ($HOSTS/sdnext): sdnext/ (source tree, config.json, extensions/), venv-sdnext/, src/diffusers/,
#   models/Diffusers/tiny-sd15/ (+ sd15-full/), run/ (pid, logs), hf-home/
set -euo pipefail
SCRIPTS=$(cd "$(dirname "$0")" && pwd)
. "$SCRIPTS/env.sh"
PIN_SDNEXT=058a7f0cf326f39c0135c6257d7b7e61073e51fd       # master, 2026-07-23 (Merge pull request #5002)
PY=${PYTHON311:-python3.11}
T_START=$(date +%s)
mkdir -p "$SDNEXT_HARNESS" "$SDNEXT_RUN" "$HF_HOME" "$SDNEXT_MODELS/Diffusers"

# 1. SD.Next. Its git submodules (extensions-builtin/sdnext-modernui, sdnext-kanvas, sd-extension-chainner, wiki)
#    stay empty folders: not needed for the API; start.sh selects the Standard theme instead of ModernUI.
T_SRC=$(date +%s)
get_tree vladmandic+sdnext "${SDNEXT_COMMIT:-$PIN_SDNEXT}" "$SDNEXT"
# 2. diffusers at the commit SD.Next's installer.check_diffusers() would pip-install from GitHub
DIFFUSERS_C=$(grep -oE 'target_commit = "[0-9a-f]{40}" # diffusers' "$SDNEXT/installer.py" | grep -oE '[0-9a-f]{40}' \
              || echo 01969142b55379991fee07608c9e7e8f80afced0)
get_tree huggingface+diffusers "$DIFFUSERS_C" "$SDNEXT_HARNESS/src/diffusers"
T_SRC=$(( $(date +%s) - T_SRC ))

# 3. venv: CPU torch (local wheel), the runtime packages, diffusers from source, gradio 3.43.2 without its deps
T_VENV=$(date +%s)
[ -x "$SDNEXT_VENV/bin/python" ] || "$PY" -m venv "$SDNEXT_VENV"
# pipq (../common.sh): this venv's pip without the "Location ... is ignored" noise; keeps pip's exit status
C=$SCRIPTS/constraints-sdnext.txt
pipq install -q torch==2.13.0+cpu -c "$C"
pipq install -q -r "$SCRIPTS/requirements-sdnext-cpu.txt" -c "$C"
if ! "$SDNEXT_VENV/bin/python" -c "import diffusers, sys; sys.exit(0 if diffusers.__version__ == '$(grep -oE 'version="[^"]+"' "$SDNEXT_HARNESS/src/diffusers/setup.py" | head -1 | cut -d'"' -f2)' else 1)" 2>/dev/null; then
  pipq install -q --no-build-isolation "$SDNEXT_HARNESS/src/diffusers" -c "$C"
fi
# installer.install_gradio(): gradio 3.43.2 + gradio-client 0.5.0 with --no-deps (their pins on numpy<2, pillow<11,
# websockets<12 ... are ignored on purpose, as SD.Next does); installer.install_compel(): compel 2.4.0 --no-deps
pipq install -q --no-deps gradio==3.43.2 gradio-client==0.5.0 compel==2.4.0
# installer.ensure_base_requirements() runs `pip install setuptools==69.5.1 wheel` at EVERY start unless exactly that
# version is importable. torch 2.13 declares setuptools>=77.0.3 but uses it only in torch.utils.cpp_extension, so
# 69.5.1 is installed last, on its own (pip check then reports that one conflict).
pipq install -q setuptools==69.5.1
# the PyPI torchvision 0.28.0 wheel is a CUDA build; without this patch `import torchvision` fails on CPU torch
"$SDNEXT_VENV/bin/python" "$SCRIPTS/../patch_torchvision_cpu.py"   # every harness's
"$SDNEXT_VENV/bin/python" -c "import torch, torchvision, diffusers, transformers, gradio, tomesd, cv2, setuptools; \
print('torch', torch.__version__, '| torchvision', torchvision.__version__, '| diffusers', diffusers.__version__, \
'| transformers', transformers.__version__, '| gradio', gradio.__version__, '| setuptools', setuptools.__version__, \
'| cuda', torch.cuda.is_available())"
if "$SDNEXT_VENV/bin/pip" list 2>/dev/null | grep -qiE '^(nvidia-|triton )'; then echo "ERROR: a CUDA package got installed:"; \
  "$SDNEXT_VENV/bin/pip" list 2>/dev/null | grep -iE '^(nvidia-|triton )'; exit 1; fi
pipq check || echo "NOTE: pip check lists the expected conflicts (gradio 3.43.2 pins, torch vs setuptools 69.5.1, compel's notebook)"
T_VENV=$(( $(date +%s) - T_VENV ))

# 4. random-weight SD 1.5 diffusers folders: small -> models/Diffusers/tiny-sd15 (always), full -> sd15-full
T_MODEL=$(date +%s)
for size in small ${SDNEXT_FULL_MODEL:+full}; do
  name=tiny-sd15; [ "$size" = full ] && name=sd15-full
  if [ ! -f "$SDNEXT_MODELS/Diffusers/$name/model_index.json" ] || [ "${FORCE_MODEL:-0}" = 1 ]; then
    "$SDNEXT_VENV/bin/python" "$SCRIPTS/make_model.py" --sdnext "$SDNEXT" --out "$SDNEXT_MODELS/Diffusers/$name" --size "$size"
  else
    echo "have $SDNEXT_MODELS/Diffusers/$name"
  fi
done
T_MODEL=$(( $(date +%s) - T_MODEL ))
echo "setup done in $(( $(date +%s) - T_START ))s (sources ${T_SRC}s, venv+pip ${T_VENV}s, model ${T_MODEL}s)."
echo "start: $SCRIPTS/start.sh   stop: $SCRIPTS/stop.sh   probe: $SCRIPTS/link_extension.sh $SCRIPTS/probe_extension"
