# Settings of the Forge CPU harness (sourced by setup.sh, start.sh, stop.sh ...). host_env (../common.sh) sets what
# every host shares: FORGE_HARNESS (default $HOSTS/forge), FORGE_MODELS (--ckpt-dir is $FORGE_MODELS/Stable-diffusion),
# FORGE_PORT (default 7862), FORGE_URL, FORGE_RUN (pid + log), the offline variables and the torch CPU threads
# (FORGE_THREADS, default 1). For this full-size SD1.5 U-Net FORGE_THREADS=2 is ~1.8x faster when nothing else runs
# (256x256 4 steps: 14 s vs 26 s), but the pixels differ between 1 and 2 threads.
. "$(dirname "${BASH_SOURCE[0]}")/../common.sh"     # HOSTS (default ~/tome-hosts), get_tree, host_env ...
host_env FORGE forge 7862 forge venv-forge Forge
export FORGE=$HOST_TREE FORGE_VENV=$HOST_VENV        # the Forge source tree (launch.py lives here), its venv
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
