# Settings of the A1111 WebUI harness (sourced by setup.sh, start.sh, stop.sh ...). host_env (../common.sh) sets what
# every host shares: A1111_HARNESS (default $HOSTS/a1111), A1111_MODELS (--ckpt-dir is $A1111_MODELS/Stable-diffusion),
# A1111_PORT (default 7861), A1111_URL, A1111_RUN (pid + log), the offline variables and the torch CPU threads
# (A1111_THREADS, default 1: much faster for this tiny model on a 2-core box, especially when another process also
# uses the CPU; with 2 OpenMP threads each small op waits for a free core: ~30 ms vs ~2 ms per conv).
. "$(dirname "${BASH_SOURCE[0]}")/../common.sh"     # HOSTS (default ~/tome-hosts), get_tree, host_env ...
host_env A1111 a1111 7861 webui venv-a1111 A1111
export WEBUI=$HOST_TREE VENV=$HOST_VENV              # the webui's source tree (launch.py lives here), its venv
# do not let launch.py try to clone/install anything
export A1111_ARGS_DEFAULT="--skip-prepare-environment --skip-install --skip-python-version-check --skip-torch-cuda-test --skip-version-check \
 --use-cpu all --no-half --precision full --no-hashing --no-download-sd-model --do-not-download-clip \
 --opt-sdp-attention \
 --api --nowebui --server-name 127.0.0.1 --port $A1111_PORT \
 --ckpt-dir $A1111_MODELS/Stable-diffusion"
