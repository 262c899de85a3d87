# settings of the A1111 WebUI harness (sourced by setup.sh, start.sh, stop.sh ...)
# Not under a dot-folder (such as ~/.cache): the webui serves no /file= path below one (403), so the UI
# would load without its JavaScript.
. "$(dirname "${BASH_SOURCE[0]}")/../common.sh"     # HOSTS (default ~/tome-hosts), get_tree ...
export A1111_HARNESS=${A1111_HARNESS:-$HOSTS/a1111}
export WEBUI=$A1111_HARNESS/webui                 # the webui's source tree (launch.py lives here)
export VENV=$A1111_HARNESS/venv-a1111
export A1111_MODELS=$A1111_HARNESS/models         # --ckpt-dir is $A1111_MODELS/Stable-diffusion
export A1111_PORT=${A1111_PORT:-7861}
export A1111_HOST=127.0.0.1
export A1111_URL=http://$A1111_HOST:$A1111_PORT
export A1111_RUN=$A1111_HARNESS/run    # pid + log live here
# fully offline
export HF_HOME=$A1111_HARNESS/hf-home
export HF_HUB_OFFLINE=1
export TRANSFORMERS_OFFLINE=1
export HF_DATASETS_OFFLINE=1
export DISABLE_TELEMETRY=1
export DO_NOT_TRACK=1
export GRADIO_ANALYTICS_ENABLED=False
export PYTHONUNBUFFERED=1
# do not let launch.py try to clone/install anything
export A1111_ARGS_DEFAULT="--skip-prepare-environment --skip-install --skip-python-version-check --skip-torch-cuda-test --skip-version-check \
 --use-cpu all --no-half --precision full --no-hashing --no-download-sd-model --do-not-download-clip \
 --opt-sdp-attention \
 --api --nowebui --server-name 127.0.0.1 --port $A1111_PORT \
 --ckpt-dir $A1111_MODELS/Stable-diffusion"
# torch CPU threads: 1 is much faster for this tiny model on a 2-core box, especially when another process
# also uses the CPU (with 2 OpenMP threads each small op waits for a free core: ~30 ms vs ~2 ms per conv).
export OMP_NUM_THREADS=${A1111_THREADS:-1}
export MKL_NUM_THREADS=${A1111_THREADS:-1}
