#!/usr/bin/env bash
# Start Forge Neo in the background on 127.0.0.1:$NEO_PORT (default 7866), wait until the API answers
# (/sdapi/v1/sd-models), then send a tiny warm-up txt2img (NEO_WARMUP=0 skips it): Forge Neo, like Forge, loads the
# checkpoint lazily (sd_models.forge_model_reload at the first generation), so the warm-up is what loads it.
# Run it under `nice -n 19` on a shared box: the server inherits the niceness.
# The PID (= process-group id, via setsid) goes to $NEO_RUN/forge-neo.pid, the log to $NEO_RUN/forge-neo.log.
# Extra launch.py flags: NEO_EXTRA_ARGS="--foo" start.sh ; replace the defaults entirely: NEO_ARGS="..." start.sh
# UI mode instead of API-only: NEO_UI=1 start.sh (drops --nowebui, keeps --api; the page is served at $NEO_URL/)
set -euo pipefail
. "$(dirname "$0")/env.sh"
mkdir -p "$NEO_RUN"
PIDFILE=$NEO_RUN/forge-neo.pid
LOG=$NEO_RUN/forge-neo.log
if [ -f "$PIDFILE" ] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; then
  echo "already running, pid $(cat "$PIDFILE")"; exit 0
fi
[ -x "$NEO_VENV/bin/python" ] || { echo "no Forge Neo venv at $NEO_VENV: run $(dirname "$0")/setup.sh"; exit 1; }
ARGS=${NEO_ARGS:-$NEO_ARGS_DEFAULT}
if [ "${NEO_UI:-0}" = 1 ]; then ARGS=${ARGS//--nowebui/}; fi
ARGS="$ARGS ${NEO_EXTRA_ARGS:-}"
cd "$NEO"
# Seed config.json (if absent) with the token-merging options at their defaults. Forge Neo (like A1111 1.10) only
# restores an override_settings key after a request if the key is already in opts.data (processing.py:
# stored_opts = {... if k in opts.data}); with no config.json, {"token_merging_ratio": 0.5} in one request would
# silently stay in force for every later request. NEO_SEED_CONFIG=0 skips this.
# It also carries Neo's VERSION_UID (modules/launch_utils.py): launch.py's verify_version() otherwise takes the file
# for one from an old version and waits for Enter ("Press Enter to Continue..."), an EOFError with no terminal.
if [ "${NEO_SEED_CONFIG:-1}" = 1 ] && [ ! -f "$NEO/config.json" ]; then
  UID_=$(grep -oE '^VERSION_UID: Final\[str\] = "[^"]+"' "$NEO/modules/launch_utils.py" | grep -oE '"[^"]+"$' || echo '"PY313"')
  echo "{\"VERSION_UID\": $UID_, \"token_merging_ratio\": 0.0, \"token_merging_ratio_img2img\": 0.0, \"token_merging_ratio_hr\": 0.0}" > "$NEO/config.json"
  echo "seeded $NEO/config.json (VERSION_UID $UID_, token merging options at their defaults)"
fi
echo "[start.sh $(date -Is)] python launch.py $ARGS" >> "$LOG"
# setsid: own process group, so stop.sh can end the server and its children by PID/PGID
setsid "$NEO_VENV/bin/python" launch.py $ARGS >> "$LOG" 2>&1 < /dev/null &
echo $! > "$PIDFILE"
echo "started pid $(cat "$PIDFILE"), log $LOG"
T0=$(date +%s)
TIMEOUT=${NEO_START_TIMEOUT:-600}
ready() { curl -sf -m 5 "$NEO_URL/sdapi/v1/sd-models" > /dev/null 2>&1; }
until ready; do
  if ! kill -0 "$(cat "$PIDFILE")" 2>/dev/null; then
    echo "server died during startup; tail of log:"; tail -40 "$LOG"; rm -f "$PIDFILE"; exit 1
  fi
  if [ $(( $(date +%s) - T0 )) -gt "$TIMEOUT" ]; then
    echo "timeout after ${TIMEOUT}s waiting for $NEO_URL; tail of log:"; tail -40 "$LOG"; exit 1
  fi
  sleep 2
done
echo "API up after $(( $(date +%s) - T0 ))s: $NEO_URL"
# Unless NEO_WARMUP=0, send one 64x64 1-step txt2img now, so that start.sh returns with the model in memory
# (it waits for the background load; it also runs AlwaysVisible scripts with their default args).
if [ "${NEO_WARMUP:-1}" = 1 ]; then
  T1=$(date +%s)
  curl -sf -m "$TIMEOUT" -H 'Content-Type: application/json' -o /dev/null \
    -d '{"prompt":"warm-up","steps":1,"width":64,"height":64,"sampler_name":"Euler","seed":1,"save_images":false}' \
    "$NEO_URL/sdapi/v1/txt2img" || { echo "warm-up txt2img failed; tail of log:"; tail -40 "$LOG"; exit 1; }
  echo "model ready (warm-up txt2img 64x64, 1 step) after $(( $(date +%s) - T1 ))s"
fi
echo "ready after $(( $(date +%s) - T0 ))s: $NEO_URL"
