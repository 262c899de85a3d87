# Settings of the reForge CPU harness (sourced by setup.sh, start.sh, stop.sh ...).
# reForge = Panchovix/stable-diffusion-webui-reForge, branch main: A1111 1.10 webui + the old Forge backend
# (ldm_patched, ComfyUI-derived). host_env (../common.sh) sets what every host shares: REFORGE_HARNESS (default
# $HOSTS/reforge), REFORGE_MODELS (--ckpt-dir is $REFORGE_MODELS/Stable-diffusion), REFORGE_PORT (default 7863; A1111
# 7861, Forge 7862), REFORGE_URL, REFORGE_RUN (pid + log), the offline variables and the torch CPU threads
# (REFORGE_THREADS, default 1; 2 is faster when nothing else runs, but the pixels can differ between thread counts).
. "$(dirname "${BASH_SOURCE[0]}")/../common.sh"     # HOSTS (default ~/tome-hosts), get_tree, host_env ...
host_env REFORGE reforge 7863 reforge venv-reforge reForge
export REFORGE=$HOST_TREE REFORGE_VENV=$HOST_VENV    # the reForge source tree (launch.py lives here), its venv
# launch.py flags. --skip-prepare-environment: no git clone / pip install at start (setup.sh laid everything out).
# --always-cpu: ldm_patched's model_management otherwise asks torch.cuda for the device.
# --clip-in-fp32: on the CPU ldm_patched would store (and run) the text encoder in fp16 unless told.
# --attention-pytorch: torch SDPA (ldm_patched's default on the CPU is sub-quadratic attention).
# --no-hashing: no sha256 of the 2 GB checkpoint. reForge loads the checkpoint at start, in a background thread
# (the API answers before it is loaded); start.sh sends a warm-up request that waits for it.
# Not here: Forge's --disable-gpu-warning (reForge's parser is strict and does not know it), A1111's
# --use-cpu all / --no-half / --precision full / --opt-sdp-attention (ldm_patched picks devices and dtypes itself).
export REFORGE_ARGS_DEFAULT="--skip-prepare-environment --skip-install --skip-python-version-check --skip-torch-cuda-test --skip-version-check \
 --always-cpu --clip-in-fp32 --attention-pytorch \
 --no-hashing --no-download-sd-model --do-not-download-clip \
 --api --nowebui --server-name 127.0.0.1 --port $REFORGE_PORT \
 --ckpt-dir $REFORGE_MODELS/Stable-diffusion"
