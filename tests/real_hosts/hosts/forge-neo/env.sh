# Settings of the Forge Neo CPU harness (sourced by setup.sh, start.sh, stop.sh ...).
# Forge Neo = Haoming02/sd-webui-forge-classic, branch `neo`: the continuation of lllyasviel's Forge f2 (gradio 4.40,
# backend/ + huggingface_guess, now vendored in modules_forge/packages/). host_env (../common.sh) sets what every host
# shares: NEO_HARNESS (default $HOSTS/forge-neo), NEO_MODELS (--ckpt-dirs is $NEO_MODELS/Stable-diffusion), NEO_PORT
# (default 7866; A1111 7861, Forge 7862, reForge 7863, Forge Classic 7864, SD.Next 7865), NEO_URL, NEO_RUN (pid + log),
# the offline variables and the torch CPU threads (NEO_THREADS, default 1; 2 is faster when nothing else runs, but
# the pixels can differ between thread counts).
. "$(dirname "${BASH_SOURCE[0]}")/../common.sh"     # HOSTS (default ~/tome-hosts), get_tree, host_env ...
host_env NEO forge-neo 7866 forge-neo venv-forge-neo "Forge Neo"
export NEO=$HOST_TREE NEO_VENV=$HOST_VENV            # the Forge Neo source tree (launch.py lives here), its venv
# launch.py flags. --skip-prepare-environment: no pip install at start (setup.sh laid everything out; Neo clones no
# repositories at all). --cpu: Neo's backend/args.py (ComfyUI-style) flag; Forge's --always-cpu is gone in Neo.
# --fp32-text-enc / --fp32-vae: keep the text encoder and VAE in fp32 on the CPU.
# --use-pytorch-cross-attention: torch SDPA. --no-hashing: no sha256 of the 2 GB checkpoint.
export NEO_ARGS_DEFAULT="--skip-prepare-environment --skip-install --skip-python-version-check --skip-torch-cuda-test --skip-version-check \
 --cpu --fp32-text-enc --fp32-vae --use-pytorch-cross-attention --disable-gpu-warning \
 --no-hashing \
 --api --nowebui --server-name 127.0.0.1 --port $NEO_PORT \
 --ckpt-dirs $NEO_MODELS/Stable-diffusion"
