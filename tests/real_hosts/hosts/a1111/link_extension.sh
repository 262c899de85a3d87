#!/usr/bin/env bash
# Put an extension into the webui's extensions/ as a symlink (restart the webui afterwards: stop.sh && start.sh).
# Usage: link_extension.sh SRC_DIR [NAME]    e.g. link_extension.sh /path/to/the/project sd-webui-tokenmerge
#        link_extension.sh --remove NAME
# With --skip-prepare-environment (start.sh default) an extension's install.py is NOT run: pip-install its
# requirements into $VENV yourself.
set -euo pipefail
. "$(dirname "$0")/env.sh"
mkdir -p "$WEBUI/extensions"
if [ "${1:-}" = --remove ]; then rm -f "$WEBUI/extensions/${2:?name}"; echo "removed $WEBUI/extensions/$2"; exit 0; fi
SRC=$(cd "${1:?extension dir}" && pwd)
NAME=${2:-$(basename "$SRC")}
ln -sfn "$SRC" "$WEBUI/extensions/$NAME"
echo "linked $WEBUI/extensions/$NAME -> $SRC"
