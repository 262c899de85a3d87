#!/usr/bin/env bash
# Put an extension into the webui's extensions/ as a symlink (restart it afterwards: stop.sh && start.sh).
# Usage: link_extension.sh SRC_DIR [NAME]    e.g. link_extension.sh /path/to/the/project sd-webui-tokenmerge
#        link_extension.sh --remove NAME
#        link_extension.sh --list
# With --skip-prepare-environment (start.sh default) an extension's install.py is NOT run: pip-install its
# requirements into the host's venv yourself. host_link in ../common.sh.
set -euo pipefail
. "$(dirname "$0")/env.sh"
host_link "$@"
