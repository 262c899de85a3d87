# Settings of the Forge Classic CPU harness (sourced by setup.sh, start.sh, stop.sh ...).
# Forge Classic = Haoming02/sd-webui-forge-classic, branch `classic`: an archive of the "old" Forge (A1111 1.x webui
# on gradio 3 + the ldm_patched backend, ComfyUI-derived), with small changes. host_env (../common.sh) sets what every
# host shares: FCLASSIC_HARNESS (default $HOSTS/forge-classic), FCLASSIC_MODELS (--ckpt-dir is
# $FCLASSIC_MODELS/Stable-diffusion), FCLASSIC_PORT (default 7864; A1111 7861, Forge 7862, reForge 7863), FCLASSIC_URL,
# FCLASSIC_RUN (pid + log), the offline variables and the torch CPU threads (FCLASSIC_THREADS, default 1; 2 is faster
# when nothing else runs, but the pixels can differ between thread counts).
. "$(dirname "${BASH_SOURCE[0]}")/../common.sh"     # HOSTS (default ~/tome-hosts), get_tree, host_env ...
host_env FCLASSIC forge-classic 7864 forge-classic venv-forge-classic "Forge Classic"
export FCLASSIC=$HOST_TREE FCLASSIC_VENV=$HOST_VENV  # the Forge Classic source tree (launch.py lives here), its venv
# launch.py flags. --skip-prepare-environment: no git clone / pip install at start (setup.sh laid everything out).
# --always-cpu: ldm_patched's model_management otherwise asks torch.cuda for the device.
# --clip-in-fp32: on the CPU ldm_patched would store (and run) the text encoder in fp16 unless told.
# --attention-pytorch: torch SDPA (ldm_patched's default on the CPU is sub-quadratic attention).
# --no-hashing: no sha256 of the 2 GB checkpoint.
# Not here: reForge's/A1111's --do-not-download-clip and Forge f2's --disable-gpu-warning (Forge Classic's parser is
# strict, modules/shared_cmd_options.py parse_args(), and knows neither: unknown flags stop the start).
export FCLASSIC_ARGS_DEFAULT="--skip-prepare-environment --skip-install --skip-python-version-check --skip-torch-cuda-test --skip-version-check \
 --always-cpu --clip-in-fp32 --attention-pytorch \
 --no-hashing --no-download-sd-model \
 --api --nowebui --server-name 127.0.0.1 --port $FCLASSIC_PORT \
 --ckpt-dir $FCLASSIC_MODELS/Stable-diffusion"
