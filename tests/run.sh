#!/usr/bin/env bash
# Sets up everything the tests need on a fresh machine with Python 3.11 (a venv in .venv with pinned
# packages, Debian's chromium for the browser tests, the pinned ComfyUI in .comfyui) and runs the whole suite: the
# engine and the WebUI glue in .venv, then the ComfyUI node pack in ComfyUI's environment. Extra arguments go to
# the first pytest run alone, and then the ComfyUI run is left out (run it with the last line's command).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -r tests/requirements.txt
# ldm (the U-Net classes the webui runs for SD 1.x/2.x); its own pins are ancient, hence --no-deps.
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps stable-diffusion-sdkit==2.1.5
if ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
  else
    echo "chromium is missing and this is not root: install Debian's chromium for the browser test" >&2
  fi
fi
# The ComfyUI node pack's tests run in ComfyUI's own environment (.comfyui/, made by tests/comfyui/setup.sh from the
# pinned copy in ../shared/comfyui): ComfyUI needs pydantic 2, the WebUI tests gradio 3.41's pydantic 1.
bash tests/comfyui/setup.sh
# pytest exits non-zero on any failure and with 5 when nothing was collected, so both fail the run; both runs run.
status=0
.venv/bin/python -m pytest tests "$@" || status=$?
if [ $# -eq 0 ]; then
  TOKENMERGE_COMFYUI_RUN=1 .comfyui/venv/bin/python -m pytest tests/comfyui || status=$?
fi
exit $status
