#!/usr/bin/env bash
# Start Forge Classic in the background on 127.0.0.1:$FCLASSIC_PORT (default 7864), wait until the API answers
# (/sdapi/v1/sd-models), then send a tiny warm-up txt2img (FCLASSIC_WARMUP=0 skips it): Forge Classic loads the
# checkpoint at start but in a background thread, so the API answers before the model is in memory; the warm-up
# waits for it. host_start in ../common.sh; the PID (= process-group id, via setsid) goes to
# $FCLASSIC_RUN/forge-classic.pid, the log to $FCLASSIC_RUN/forge-classic.log.
# Extra launch.py flags: FCLASSIC_EXTRA_ARGS="--foo" start.sh ; replace the defaults entirely: FCLASSIC_ARGS="..." start.sh
# UI mode instead of API-only: FCLASSIC_UI=1 start.sh (drops --nowebui, keeps --api; the page is served at $FCLASSIC_URL/)
# config.json is seeded (if absent) with the token-merging options at their defaults (FCLASSIC_SEED_CONFIG=0 skips
# it): Forge Classic, like A1111 1.10, restores an overridden setting only when the key is in its saved config.
set -euo pipefail
. "$(dirname "$0")/env.sh"
host_prepare() { host_seed_config; }
host_start 600 1
