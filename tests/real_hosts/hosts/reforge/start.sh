#!/usr/bin/env bash
# Start reForge in the background on 127.0.0.1:$REFORGE_PORT (default 7863), wait until the API answers
# (/sdapi/v1/sd-models), then send a tiny warm-up txt2img (REFORGE_WARMUP=0 skips it): reForge loads the checkpoint
# at start but in a background thread, so the API answers before the model is in memory; the warm-up waits for it.
# The PID (= process-group id, via setsid) goes to $REFORGE_RUN/reforge.pid, the log to $REFORGE_RUN/reforge.log.
# Extra launch.py flags: REFORGE_EXTRA_ARGS="--foo" start.sh ; replace the defaults entirely: REFORGE_ARGS="..." start.sh
# UI mode instead of API-only: REFORGE_UI=1 start.sh (drops --nowebui, keeps --api; the page is served at $REFORGE_URL/)
set -euo pipefail
. "$(dirname "$0")/env.sh"
mkdir -p "$REFORGE_RUN"
PIDFILE=$REFORGE_RUN/reforge.pid
LOG=$REFORGE_RUN/reforge.log
if [ -f "$PIDFILE" ] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; then
  echo "already running, pid $(cat "$PIDFILE")"; exit 0
fi
[ -x "$REFORGE_VENV/bin/python" ] || { echo "no reForge venv at $REFORGE_VENV: run $(dirname "$0")/setup.sh"; exit 1; }
ARGS=${REFORGE_ARGS:-$REFORGE_ARGS_DEFAULT}
if [ "${REFORGE_UI:-0}" = 1 ]; then ARGS=${ARGS//--nowebui/}; fi
ARGS="$ARGS ${REFORGE_EXTRA_ARGS:-}"
cd "$REFORGE"
# Seed config.json (if absent) with the token-merging options at their defaults. reForge (like A1111 1.10) only
# restores an override_settings key after a request if the key is already in opts.data (processing.py:
# stored_opts = {... if k in opts.data}); with no config.json, {"token_merging_ratio": 0.5} in one request would
# silently stay in force for every later request. REFORGE_SEED_CONFIG=0 skips this.
if [ "${REFORGE_SEED_CONFIG:-1}" = 1 ] && [ ! -f "$REFORGE/config.json" ]; then
  echo '{"token_merging_ratio": 0.0, "token_merging_ratio_img2img": 0.0, "token_merging_ratio_hr": 0.0}' > "$REFORGE/config.json"
  echo "seeded $REFORGE/config.json (token merging options at their defaults)"
fi
echo "[start.sh $(date -Is)] python launch.py $ARGS" >> "$LOG"
# setsid: own process group, so stop.sh can end the server and its children by PID/PGID
setsid "$REFORGE_VENV/bin/python" launch.py $ARGS >> "$LOG" 2>&1 < /dev/null &
echo $! > "$PIDFILE"
echo "started pid $(cat "$PIDFILE"), log $LOG"
T0=$(date +%s)
TIMEOUT=${REFORGE_START_TIMEOUT:-600}
ready() { curl -sf -m 5 "$REFORGE_URL/sdapi/v1/sd-models" > /dev/null 2>&1; }
until ready; do
  if ! kill -0 "$(cat "$PIDFILE")" 2>/dev/null; then
    echo "server died during startup; tail of log:"; tail -40 "$LOG"; rm -f "$PIDFILE"; exit 1
  fi
  if [ $(( $(date +%s) - T0 )) -gt "$TIMEOUT" ]; then
    echo "timeout after ${TIMEOUT}s waiting for $REFORGE_URL; tail of log:"; tail -40 "$LOG"; exit 1
  fi
  sleep 2
done
echo "API up after $(( $(date +%s) - T0 ))s: $REFORGE_URL"
# Unless REFORGE_WARMUP=0, send one 64x64 1-step txt2img now, so that start.sh returns with the model in memory
# (it waits for the background load; it also runs AlwaysVisible scripts with their default args).
if [ "${REFORGE_WARMUP:-1}" = 1 ]; then
  T1=$(date +%s)
  curl -sf -m "$TIMEOUT" -H 'Content-Type: application/json' -o /dev/null \
    -d '{"prompt":"warm-up","steps":1,"width":64,"height":64,"sampler_name":"Euler","seed":1,"save_images":false}' \
    "$REFORGE_URL/sdapi/v1/txt2img" || { echo "warm-up txt2img failed; tail of log:"; tail -40 "$LOG"; exit 1; }
  echo "model ready (warm-up txt2img 64x64, 1 step) after $(( $(date +%s) - T1 ))s"
fi
echo "ready after $(( $(date +%s) - T0 ))s: $REFORGE_URL"
