#!/usr/bin/env bash
# Sets up everything the tests need on a fresh machine with Python 3.11 (a venv in .venv with pinned
# packages, Debian's chromium for the browser test) and runs the whole suite. Extra arguments go to pytest.
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
# pytest exits non-zero on any failure and with 5 when nothing was collected, so both fail the run.
exec .venv/bin/python -m pytest tests "$@"
