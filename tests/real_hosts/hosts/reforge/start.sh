#!/usr/bin/env bash
# Start reForge in the background on 127.0.0.1:$REFORGE_PORT (default 7863), wait until the API answers
# (/sdapi/v1/sd-models), then send a tiny warm-up txt2img (REFORGE_WARMUP=0 skips it): reForge loads the checkpoint
# at start but in a background thread, so the API answers before the model is in memory; the warm-up waits for it.
# host_start in ../common.sh; the PID (= process-group id, via setsid) goes to $REFORGE_RUN/reforge.pid, the log to
# $REFORGE_RUN/reforge.log.
# Extra launch.py flags: REFORGE_EXTRA_ARGS="--foo" start.sh ; replace the defaults entirely: REFORGE_ARGS="..." start.sh
# UI mode instead of API-only: REFORGE_UI=1 start.sh (drops --nowebui, keeps --api; the page is served at $REFORGE_URL/)
# config.json is seeded (if absent) with the token-merging options at their defaults (REFORGE_SEED_CONFIG=0 skips
# it): reForge, like A1111 1.10, restores an overridden setting only when the key is in its saved config.
set -euo pipefail
. "$(dirname "$0")/env.sh"
host_prepare() { host_seed_config; }
host_start 600 1
