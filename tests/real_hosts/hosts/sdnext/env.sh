# shared settings for the SD.Next CPU harness (sourced by setup.sh, start.sh, stop.sh ...)
# Not under a dot-folder such as ~/.cache: gradio refuses to serve files from below one (the UI then loads without
# its JavaScript), as in the A1111/Forge harnesses.
. "$(dirname "${BASH_SOURCE[0]}")/../common.sh"     # HOSTS (default ~/tome-hosts), get_tree, host_env ...
# host_env sets what every host shares: SDNEXT_HARNESS (default $HOSTS/sdnext), SDNEXT_MODELS (--models-dir; the random
# model is $SDNEXT_MODELS/Diffusers/tiny-sd15), SDNEXT_PORT (default 7865), SDNEXT_URL, SDNEXT_RUN (pid + server log +
# probe log), the offline variables (SD.Next itself also needs "offline_mode": true in config.json, see start.sh) and
# the torch CPU threads (SDNEXT_THREADS, default 1, a good neighbour on this shared 2-core box; pixels can differ
# between thread counts: compare images only at the same SDNEXT_THREADS).
host_env SDNEXT sdnext 7865 sdnext venv-sdnext SD.Next
export SDNEXT=$HOST_TREE SDNEXT_VENV=$HOST_VENV      # the SD.Next source tree (launch.py lives here; config.json too)
export SDNEXT_MODEL_NAME=${SDNEXT_MODEL_NAME:-tiny-sd15}
export SDNEXT_PROBE_LOG=${SDNEXT_PROBE_LOG:-$SDNEXT_RUN/probe.jsonl}   # read by probe_extension
export SD_NOHASHING=1                                # no sha256 of model files
# launch.py flags.
#   --skip-all: no pip/git/version work at start (installer.check_diffusers/check_transformers would otherwise
#     pip-install diffusers/transformers from GitHub commits, install_requirements would run pip, check_version
#     asks api.github.com); it also skips set_environment(), so the few env vars that matter are set below.
#   --skip-git: no git calls (the extracted tree is not a git checkout).
#   --skip-torch is NOT used: check_torch only reports on a CPU box (no nvidia-smi -> "CPU-only version installed").
#   --models-dir: models outside the source tree. --server-name/--port: bind 127.0.0.1:$SDNEXT_PORT.
#   The API is always on in SD.Next (--api defaults to True); the gradio UI is always built as well.
export SDNEXT_ARGS_DEFAULT="--skip-all --skip-git --server-name $SDNEXT_HOST --port $SDNEXT_PORT --models-dir $SDNEXT_MODELS"
# what installer.set_environment() would have set and that still matters on a CPU box
export TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1
export TOKENIZERS_PARALLELISM=0
export K_DIFFUSION_USE_COMPILE=0
# torch.compile off (TORCH_COMPILE_DISABLE=1 sets torch._dynamo.config.disable; TORCHDYNAMO_DISABLE=1 makes
# torch.compile a no-op). Otherwise SD.Next's devices.test_triton() compiles a test function with Inductor at every
# start (~30 s on this box) and, as that "passes" on a CPU, turns on sdnq_dequantize_compile, whose end-of-job timer
# import (modules/timer_sdnq.py -> modules/sdnq/kernels/triton_atten.py: import triton) then fails EVERY txt2img
# with HTTP 500 "No module named 'triton'". SDNEXT_DYNAMO=1 leaves torch.compile on (start.sh still pins
# sdnq_dequantize_compile=false in config.json, which is enough to avoid the 500).
if [ "${SDNEXT_DYNAMO:-0}" != 1 ]; then export TORCH_COMPILE_DISABLE=1 TORCHDYNAMO_DISABLE=1; fi
