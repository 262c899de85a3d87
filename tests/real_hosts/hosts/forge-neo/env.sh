# shared settings for the Forge Neo CPU harness (sourced by setup.sh, start.sh, stop.sh ...)
# Forge Neo = Haoming02/sd-webui-forge-classic, branch `neo`: the continuation of lllyasviel's Forge f2 (gradio 4.40,
# backend/ + huggingface_guess, now vendored in modules_forge/packages/). Not under a dot-folder such as ~/.cache: the
# webui refuses to serve files below one (the UI then loads without its JavaScript).
. "$(dirname "${BASH_SOURCE[0]}")/../common.sh"     # HOSTS (default ~/tome-hosts), get_tree ...
export NEO_HARNESS=${NEO_HARNESS:-$HOSTS/forge-neo}
export NEO=$NEO_HARNESS/forge-neo                   # the Forge Neo source tree (launch.py lives here)
export NEO_VENV=$NEO_HARNESS/venv-forge-neo
export NEO_MODELS=$NEO_HARNESS/models               # --ckpt-dirs is $NEO_MODELS/Stable-diffusion
export NEO_PORT=${NEO_PORT:-7866}                   # A1111 7861, Forge 7862, reForge 7863, Forge Classic 7864, SD.Next 7865
export NEO_HOST=127.0.0.1
export NEO_URL=http://$NEO_HOST:$NEO_PORT
export NEO_RUN=$NEO_HARNESS/run                     # pid + log live here
# fully offline
export HF_HOME=$NEO_HARNESS/hf-home
export HF_HUB_OFFLINE=1
export TRANSFORMERS_OFFLINE=1
export HF_DATASETS_OFFLINE=1
export DIFFUSERS_OFFLINE=1
export DISABLE_TELEMETRY=1
export DO_NOT_TRACK=1
export GRADIO_ANALYTICS_ENABLED=False
export PYTHONUNBUFFERED=1
# launch.py flags. --skip-prepare-environment: no pip install at start (setup.sh laid everything out; Neo clones no
# repositories at all). --cpu: Neo's backend/args.py (ComfyUI-style) flag; Forge's --always-cpu is gone in Neo.
# --fp32-text-enc / --fp32-vae: keep the text encoder and VAE in fp32 on the CPU.
# --use-pytorch-cross-attention: torch SDPA. --no-hashing: no sha256 of the 2 GB checkpoint.
export NEO_ARGS_DEFAULT="--skip-prepare-environment --skip-install --skip-python-version-check --skip-torch-cuda-test --skip-version-check \
 --cpu --fp32-text-enc --fp32-vae --use-pytorch-cross-attention --disable-gpu-warning \
 --no-hashing \
 --api --nowebui --server-name 127.0.0.1 --port $NEO_PORT \
 --ckpt-dirs $NEO_MODELS/Stable-diffusion"
# torch CPU threads. 1 by default (a good neighbour on this 2-core box); NEO_THREADS=2 is faster when nothing else
# runs, but the pixels can differ between thread counts: compare images only at the same NEO_THREADS.
export OMP_NUM_THREADS=${NEO_THREADS:-1}
export MKL_NUM_THREADS=${NEO_THREADS:-1}
