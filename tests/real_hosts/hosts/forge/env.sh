# shared settings for the Forge CPU harness (sourced by setup.sh, start.sh, stop.sh ...)
# Not under a dot-folder such as ~/.cache: the webui refuses to serve files below one (the UI then
# loads without its JavaScript).
. "$(dirname "${BASH_SOURCE[0]}")/../common.sh"     # HOSTS (default ~/tome-hosts), get_tree ...
export FORGE_HARNESS=${FORGE_HARNESS:-$HOSTS/forge}
export FORGE=$FORGE_HARNESS/forge                 # the Forge source tree (launch.py lives here)
export FORGE_VENV=$FORGE_HARNESS/venv-forge
export FORGE_MODELS=$FORGE_HARNESS/models         # --ckpt-dir is $FORGE_MODELS/Stable-diffusion
export FORGE_PORT=${FORGE_PORT:-7862}
export FORGE_HOST=127.0.0.1
export FORGE_URL=http://$FORGE_HOST:$FORGE_PORT
export FORGE_RUN=$FORGE_HARNESS/run               # pid + log live here
# fully offline
export HF_HOME=$FORGE_HARNESS/hf-home
export HF_HUB_OFFLINE=1
export TRANSFORMERS_OFFLINE=1
export HF_DATASETS_OFFLINE=1
export DIFFUSERS_OFFLINE=1
export DISABLE_TELEMETRY=1
export DO_NOT_TRACK=1
export GRADIO_ANALYTICS_ENABLED=False
export PYTHONUNBUFFERED=1
# launch.py flags. --skip-prepare-environment: no git clone / pip install at start (setup.sh laid everything out).
# --always-cpu: Forge's backend otherwise assumes CUDA (memory_management.get_torch_device -> torch.cuda).
# --clip-in-fp32: on the CPU Forge computes in fp32 anyway, but stores the text encoder in fp16 unless told.
# --attention-pytorch: torch SDPA (the default on a non-CUDA box is sub-quadratic attention).
# --no-hashing: no sha256 of the 2 GB checkpoint. Forge loads the checkpoint lazily (first generation), whatever
# --skip-load-model-at-start says (a no-op in Forge); start.sh sends a warm-up request instead.
export FORGE_ARGS_DEFAULT="--skip-prepare-environment --skip-install --skip-python-version-check --skip-torch-cuda-test --skip-version-check \
 --always-cpu --clip-in-fp32 --attention-pytorch --disable-gpu-warning \
 --no-hashing --no-download-sd-model --do-not-download-clip \
 --api --nowebui --server-name 127.0.0.1 --port $FORGE_PORT \
 --ckpt-dir $FORGE_MODELS/Stable-diffusion"
# torch CPU threads. 1 by default, as in the A1111 harness (a good neighbour on this 2-core box). For this full-size
# SD1.5 U-Net FORGE_THREADS=2 is ~1.8x faster when nothing else runs (256x256 4 steps: 14 s vs 26 s), but the
# pixels differ between 1 and 2 threads: compare images only at the same thread count.
export OMP_NUM_THREADS=${FORGE_THREADS:-1}
export MKL_NUM_THREADS=${FORGE_THREADS:-1}
