#!/usr/bin/env bash
# Set up the Forge Neo harness: Neo's tree, a Python 3.11 venv with CPU torch 2.13 and Neo's pins, a random-weight
# SD 1.5 checkpoint of real size. Idempotent; safe to re-run.
# Sources: from GitHub at the pinned commit (git fetch --depth 1), or with MIRROR=DIR from local bare git dirs
# $MIRROR/<owner>+<name>/repo (see ../common.sh): nolanlane/sd-webui-forge-classic, whose first commit 3df257a
# ("Initial commit for Neo Deployment setup", 2026-02-23) is a copy of Neo's tree (Haoming02/sd-webui-forge-classic,
# branch `neo`; forge_version "neo") plus two deployment files of its own (startup.sh, pod_start_command.txt), left
# out here; and kklouzal/stable-diffusion-webui (one file of A1111 v1.10.1: models/VAE-approx/model.pt, only read
# when the live-preview method is "Approx NN"; Neo's default is "RGB"). Neo clones no repositories at launch
# (huggingface_guess, k-diffusion etc. are vendored). Packages: PyPI only.
# Usage: [HOSTS=DIR] [MIRROR=DIR] [NEO_COMMIT=rev] [NEO_REPO=owner+name] forge-neo/setup.sh  (the harness goes to $HOSTS/forge-neo)
#   NEO_REPO / NEO_COMMIT: which repository and commit to lay out (default nolanlane+sd-webui-forge-classic at
#                    3df257a, the one checked; Haoming02's own: NEO_REPO=Haoming02+sd-webui-forge-classic
#                    NEO_COMMIT=<a commit of its branch neo>); recorded in forge-neo/.harness-extracted
#   REUSE_CKPT=FILE: hard-link (else copy) this random SD 1.5 checkpoint instead of building one (default: the Forge
#                    harness's when present; REUSE_CKPT= (empty) always builds)
#   FORCE_MODEL=1: rebuild the random checkpoint
#   EXTRACT_ONLY=1: lay out the source tree and stop (no pip, no model)
set -euo pipefail
. "$(dirname "$0")/env.sh"      # and ../common.sh: get_tree, setup_phase, setup_venv ...

# 1. Forge Neo's tree: nolanlane's copy of it at 3df257a, without its two deployment files
setup_phase extraction
NEO_REPO=${NEO_REPO:-nolanlane+sd-webui-forge-classic}
if [ "$NEO_REPO" = nolanlane+sd-webui-forge-classic ]; then
  get_tree "$NEO_REPO" "${NEO_COMMIT:-3df257ae13e38826f5bdaece9008915b8b19e4bd}" "$NEO" startup.sh pod_start_command.txt
else
  get_tree "$NEO_REPO" "${NEO_COMMIT:?NEO_COMMIT: the commit of $NEO_REPO to lay out}" "$NEO"
fi
grep -q '"neo"' "$NEO/modules_forge/forge_version.py" || { echo "ERROR: $NEO is not a Forge Neo tree (modules_forge/forge_version.py)"; exit 1; }
# The SD1 "Approx NN" live-preview model (only read when opts.show_progress_type == "Approx NN"; else never), from
# A1111 v1.10.1, so that setting cannot trigger a download.
get_vae_approx
setup_extract_only

# 2. venv (Python 3.11: the local CPU torch wheel is cp311; Neo is "tested with 3.13", its code targets py311) + CPU
#    torch + Neo's requirements.txt (setuptools pin changed) + what prepare_environment adds (gradio 4.40.0,
#    gradio_rangeslider 0.0.8, packaging), torchvision 0.28.0 patched
setup_phase venv+pip
setup_venv
# in prepare_environment's order: packaging and gradio (with their own dependencies) first, then requirements.txt, whose
# pins win where they differ (Pillow 12.1.0 over gradio 4.40.0's pillow<11: pip check reports that one, as in Neo)
# (only while gradio is absent, as there: a re-run would otherwise take Pillow down to 10.4 and back up)
if ! "$NEO_VENV/bin/python" -c "import importlib.metadata as m; assert m.version('gradio') == '4.40.0'" 2>/dev/null; then
  pipq install -q packaging==26.0 gradio==4.40.0 gradio_rangeslider==0.0.8 torchvision==0.28.0 -c "$HOST_SCRIPTS/constraints-forge-neo.txt"
fi
pipq install -q -r "$HOST_SCRIPTS/requirements-forge-neo-cpu.txt" -c "$HOST_SCRIPTS/constraints-forge-neo.txt"
setup_check_venv torch torchvision transformers diffusers gradio pydantic fastapi numpy

# 3. random-weight SD1.5 checkpoint (full size, fp16 safetensors, original LDM key names): ../make_forge_model.py run
#    against Neo's backend (--neo). The Forge harness's file is hard-linked if present.
setup_forge_checkpoint neo "$HOSTS/forge/models/Stable-diffusion/random-sd15.safetensors"
setup_done
