#!/usr/bin/env bash
# Start Forge Neo in the background on 127.0.0.1:$NEO_PORT (default 7866), wait until the API answers
# (/sdapi/v1/sd-models), then send a tiny warm-up txt2img (NEO_WARMUP=0 skips it): Forge Neo, like Forge, loads the
# checkpoint lazily (sd_models.forge_model_reload at the first generation), so the warm-up is what loads it.
# Run it under `nice -n 19` on a shared box: the server inherits the niceness.
# host_start in ../common.sh; the PID (= process-group id, via setsid) goes to $NEO_RUN/forge-neo.pid, the log to
# $NEO_RUN/forge-neo.log.
# Extra launch.py flags: NEO_EXTRA_ARGS="--foo" start.sh ; replace the defaults entirely: NEO_ARGS="..." start.sh
# UI mode instead of API-only: NEO_UI=1 start.sh (drops --nowebui, keeps --api; the page is served at $NEO_URL/)
set -euo pipefail
. "$(dirname "$0")/env.sh"
# Seed config.json (if absent; NEO_SEED_CONFIG=0 skips it) with the token-merging options at their defaults (Forge
# Neo, like A1111 1.10, restores an overridden setting only when the key is in its saved config) and Neo's
# VERSION_UID (modules/launch_utils.py): launch.py's verify_version() otherwise takes the file for one from an old
# version and waits for Enter ("Press Enter to Continue..."), an EOFError with no terminal.
host_prepare() {
  local uid
  uid=$(grep -oE '^VERSION_UID: Final\[str\] = "[^"]+"' "$NEO/modules/launch_utils.py" | grep -oE '"[^"]+"$' || echo '"PY313"')
  host_seed_config "\"VERSION_UID\": $uid, "
}
host_start 600 1
