# shared settings for the Forge Classic CPU harness (sourced by setup.sh, start.sh, stop.sh ...)
# Forge Classic = Haoming02/sd-webui-forge-classic, branch `classic`: an archive of the "old" Forge (A1111 1.x webui
# on gradio 3 + the ldm_patched backend, ComfyUI-derived), with small changes. Not under a dot-folder such as
# ~/.cache: the webui refuses to serve files below one (the UI then loads without its JavaScript).
. "$(dirname "${BASH_SOURCE[0]}")/../common.sh"     # HOSTS (default ~/tome-hosts), get_tree ...
export FCLASSIC_HARNESS=${FCLASSIC_HARNESS:-$HOSTS/forge-classic}
export FCLASSIC=$FCLASSIC_HARNESS/forge-classic     # the Forge Classic source tree (launch.py lives here)
export FCLASSIC_VENV=$FCLASSIC_HARNESS/venv-forge-classic
export FCLASSIC_MODELS=$FCLASSIC_HARNESS/models     # --ckpt-dir is $FCLASSIC_MODELS/Stable-diffusion
export FCLASSIC_PORT=${FCLASSIC_PORT:-7864}         # A1111 harness 7861, Forge 7862, reForge 7863
export FCLASSIC_HOST=127.0.0.1
export FCLASSIC_URL=http://$FCLASSIC_HOST:$FCLASSIC_PORT
export FCLASSIC_RUN=$FCLASSIC_HARNESS/run           # pid + log live here
# fully offline
export HF_HOME=$FCLASSIC_HARNESS/hf-home
export HF_HUB_OFFLINE=1
export TRANSFORMERS_OFFLINE=1
export HF_DATASETS_OFFLINE=1
export DIFFUSERS_OFFLINE=1
export DISABLE_TELEMETRY=1
export DO_NOT_TRACK=1
export GRADIO_ANALYTICS_ENABLED=False
export PYTHONUNBUFFERED=1
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
# torch CPU threads. 1 by default (a good neighbour on this 2-core box); FCLASSIC_THREADS=2 is faster when nothing
# else runs, but the pixels can differ between thread counts: compare images only at the same FCLASSIC_THREADS.
export OMP_NUM_THREADS=${FCLASSIC_THREADS:-1}
export MKL_NUM_THREADS=${FCLASSIC_THREADS:-1}
