# shared settings for the reForge CPU harness (sourced by setup.sh, start.sh, stop.sh ...)
# reForge = Panchovix/stable-diffusion-webui-reForge, branch main: A1111 1.10 webui + the old Forge backend
# (ldm_patched, ComfyUI-derived). Not under a dot-folder such as ~/.cache: the webui refuses to serve files below
# one (the UI then loads without its JavaScript).
. "$(dirname "${BASH_SOURCE[0]}")/../common.sh"     # HOSTS (default ~/tome-hosts), get_tree ...
export REFORGE_HARNESS=${REFORGE_HARNESS:-$HOSTS/reforge}
export REFORGE=$REFORGE_HARNESS/reforge             # the reForge source tree (launch.py lives here)
export REFORGE_VENV=$REFORGE_HARNESS/venv-reforge
export REFORGE_MODELS=$REFORGE_HARNESS/models       # --ckpt-dir is $REFORGE_MODELS/Stable-diffusion
export REFORGE_PORT=${REFORGE_PORT:-7863}           # A1111 harness 7861, Forge harness 7862
export REFORGE_HOST=127.0.0.1
export REFORGE_URL=http://$REFORGE_HOST:$REFORGE_PORT
export REFORGE_RUN=$REFORGE_HARNESS/run             # pid + log live here
# fully offline
export HF_HOME=$REFORGE_HARNESS/hf-home
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
# --no-hashing: no sha256 of the 2 GB checkpoint. reForge loads the checkpoint at start, in a background thread
# (the API answers before it is loaded); start.sh sends a warm-up request that waits for it.
# Not here: Forge's --disable-gpu-warning (reForge's parser is strict and does not know it), A1111's
# --use-cpu all / --no-half / --precision full / --opt-sdp-attention (ldm_patched picks devices and dtypes itself).
export REFORGE_ARGS_DEFAULT="--skip-prepare-environment --skip-install --skip-python-version-check --skip-torch-cuda-test --skip-version-check \
 --always-cpu --clip-in-fp32 --attention-pytorch \
 --no-hashing --no-download-sd-model --do-not-download-clip \
 --api --nowebui --server-name 127.0.0.1 --port $REFORGE_PORT \
 --ckpt-dir $REFORGE_MODELS/Stable-diffusion"
# torch CPU threads. 1 by default (a good neighbour on this 2-core box); REFORGE_THREADS=2 is faster when nothing
# else runs, but the pixels can differ between thread counts: compare images only at the same REFORGE_THREADS.
export OMP_NUM_THREADS=${REFORGE_THREADS:-1}
export MKL_NUM_THREADS=${REFORGE_THREADS:-1}
