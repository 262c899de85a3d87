#!/usr/bin/env bash
# Start Forge Classic in the background on 127.0.0.1:$FCLASSIC_PORT (default 7864), wait until the API answers
# (/sdapi/v1/sd-models), then send a tiny warm-up txt2img (FCLASSIC_WARMUP=0 skips it): Forge Classic loads the checkpoint
# at start but in a background thread, so the API answers before the model is in memory; the warm-up waits for it.
# The PID (= process-group id, via setsid) goes to $FCLASSIC_RUN/forge-classic.pid, the log to $FCLASSIC_RUN/forge-classic.log.
# Extra launch.py flags: FCLASSIC_EXTRA_ARGS="--foo" start.sh ; replace the defaults entirely: FCLASSIC_ARGS="..." start.sh
# UI mode instead of API-only: FCLASSIC_UI=1 start.sh (drops --nowebui, keeps --api; the page is served at $FCLASSIC_URL/)
set -euo pipefail
. "$(dirname "$0")/env.sh"
mkdir -p "$FCLASSIC_RUN"
PIDFILE=$FCLASSIC_RUN/forge-classic.pid
LOG=$FCLASSIC_RUN/forge-classic.log
if [ -f "$PIDFILE" ] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; then
  echo "already running, pid $(cat "$PIDFILE")"; exit 0
fi
[ -x "$FCLASSIC_VENV/bin/python" ] || { echo "no Forge Classic venv at $FCLASSIC_VENV: run $(dirname "$0")/setup.sh"; exit 1; }
ARGS=${FCLASSIC_ARGS:-$FCLASSIC_ARGS_DEFAULT}
if [ "${FCLASSIC_UI:-0}" = 1 ]; then ARGS=${ARGS//--nowebui/}; fi
ARGS="$ARGS ${FCLASSIC_EXTRA_ARGS:-}"
cd "$FCLASSIC"
# Seed config.json (if absent) with the token-merging options at their defaults. Forge Classic (like A1111 1.10) only
# restores an override_settings key after a request if the key is already in opts.data (processing.py:
# stored_opts = {... if k in opts.data}); with no config.json, {"token_merging_ratio": 0.5} in one request would
# silently stay in force for every later request. FCLASSIC_SEED_CONFIG=0 skips this.
if [ "${FCLASSIC_SEED_CONFIG:-1}" = 1 ] && [ ! -f "$FCLASSIC/config.json" ]; then
  echo '{"token_merging_ratio": 0.0, "token_merging_ratio_img2img": 0.0, "token_merging_ratio_hr": 0.0}' > "$FCLASSIC/config.json"
  echo "seeded $FCLASSIC/config.json (token merging options at their defaults)"
fi
echo "[start.sh $(date -Is)] python launch.py $ARGS" >> "$LOG"
# setsid: own process group, so stop.sh can end the server and its children by PID/PGID
setsid "$FCLASSIC_VENV/bin/python" launch.py $ARGS >> "$LOG" 2>&1 < /dev/null &
echo $! > "$PIDFILE"
echo "started pid $(cat "$PIDFILE"), log $LOG"
T0=$(date +%s)
TIMEOUT=${FCLASSIC_START_TIMEOUT:-600}
ready() { curl -sf -m 5 "$FCLASSIC_URL/sdapi/v1/sd-models" > /dev/null 2>&1; }
until ready; do
  if ! kill -0 "$(cat "$PIDFILE")" 2>/dev/null; then
    echo "server died during startup; tail of log:"; tail -40 "$LOG"; rm -f "$PIDFILE"; exit 1
  fi
  if [ $(( $(date +%s) - T0 )) -gt "$TIMEOUT" ]; then
    echo "timeout after ${TIMEOUT}s waiting for $FCLASSIC_URL; tail of log:"; tail -40 "$LOG"; exit 1
  fi
  sleep 2
done
echo "API up after $(( $(date +%s) - T0 ))s: $FCLASSIC_URL"
# Unless FCLASSIC_WARMUP=0, send one 64x64 1-step txt2img now, so that start.sh returns with the model in memory
# (it waits for the background load; it also runs AlwaysVisible scripts with their default args).
if [ "${FCLASSIC_WARMUP:-1}" = 1 ]; then
  T1=$(date +%s)
  curl -sf -m "$TIMEOUT" -H 'Content-Type: application/json' -o /dev/null \
    -d '{"prompt":"warm-up","steps":1,"width":64,"height":64,"sampler_name":"Euler","seed":1,"save_images":false}' \
    "$FCLASSIC_URL/sdapi/v1/txt2img" || { echo "warm-up txt2img failed; tail of log:"; tail -40 "$LOG"; exit 1; }
  echo "model ready (warm-up txt2img 64x64, 1 step) after $(( $(date +%s) - T1 ))s"
fi
echo "ready after $(( $(date +%s) - T0 ))s: $FCLASSIC_URL"
