#!/usr/bin/env bash
# The real-host check of one host, start to end: set the host up (hosts/<host>/setup.sh, idempotent), link this
# repository (as sd-webui-tokenmerge) and unet-failer/ into its extensions/, start it, run the check script against
# it, stop it. The check's output also goes to the host's run/check.txt.
#   Usage: [HOSTS=DIR] [MIRROR=DIR] tests/real_hosts/run_host_check.sh [--no-setup] HOST
#   HOST: a1111, forge, reforge, forge-classic, forge-neo or sdnext. --no-setup: the host is set up already.
#   HOSTS (default ~/tome-hosts) and MIRROR (default: fetch from GitHub): see hosts/common.sh.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
SETUP=1
if [ "${1:-}" = --no-setup ]; then SETUP=0; shift; fi
HOST=${1:-}
D=$HERE/hosts/$HOST
[ -n "$HOST" ] && [ -f "$D/env.sh" ] || { sed -n '2,7p' "$0"; exit 2; }
. "$D/env.sh"
CHECK=webui_harness_check.py FLAGS=()
case $HOST in
  a1111)         URL=$A1111_URL    RUN=$A1111_RUN    LOG=$A1111_RUN/a1111.log             CKPTS=$A1111_MODELS ;;
  forge)         URL=$FORGE_URL    RUN=$FORGE_RUN    LOG=$FORGE_RUN/forge.log             CKPTS=$FORGE_MODELS FLAGS=(--forge) ;;
  reforge)       URL=$REFORGE_URL  RUN=$REFORGE_RUN  LOG=$REFORGE_RUN/reforge.log         CKPTS=$REFORGE_MODELS FLAGS=(--forge) ;;
  forge-classic) URL=$FCLASSIC_URL RUN=$FCLASSIC_RUN LOG=$FCLASSIC_RUN/forge-classic.log  CKPTS=$FCLASSIC_MODELS FLAGS=(--forge) ;;
  forge-neo)     URL=$NEO_URL      RUN=$NEO_RUN      LOG=$NEO_RUN/forge-neo.log           CKPTS=$NEO_MODELS FLAGS=(--forge) ;;
  sdnext)        URL=$SDNEXT_URL   RUN=$SDNEXT_RUN   LOG=$SDNEXT_RUN/sdnext.log  CKPTS= CHECK=sdnext_harness_check.py ;;
  *) echo "unknown host $HOST"; exit 2 ;;
esac

T0=$(date +%s)
if [ "$SETUP" = 1 ]; then "$D/setup.sh"; fi
T_SETUP=$(( $(date +%s) - T0 ))
# The refiner check's second checkpoint: the same file under another name (a hard link, with its config beside
# it), so a refiner job switches checkpoints and loads the same weights.
if [ -n "$CKPTS" ]; then
  for f in "$CKPTS"/Stable-diffusion/*.safetensors; do
    case $f in *-refiner.safetensors) continue ;; esac
    base=${f%.safetensors}
    [ -e "$base-refiner.safetensors" ] || ln "$f" "$base-refiner.safetensors"
    if [ -f "$base.yaml" ] && [ ! -e "$base-refiner.yaml" ]; then ln "$base.yaml" "$base-refiner.yaml"; fi
    break
  done
fi
"$D/link_extension.sh" "$ROOT" sd-webui-tokenmerge
"$D/link_extension.sh" "$HERE/unet-failer" unet-failer
"$D/stop.sh"              # a server started before the links were made has not loaded them
trap '"$D/stop.sh"' EXIT
T1=$(date +%s)
"$D/start.sh"
T_START=$(( $(date +%s) - T1 ))
mkdir -p "$RUN"
T2=$(date +%s)
set +e
python3 "$HERE/$CHECK" "${FLAGS[@]}" --url "$URL" --log "$LOG" 2>&1 | tee "$RUN/check.txt"
RC=${PIPESTATUS[0]}
set -e
T_CHECK=$(( $(date +%s) - T2 ))
echo "$HOST at $(git -C "$ROOT" rev-parse --short HEAD): $(grep -c '^ok  ' "$RUN/check.txt") of" \
     "$(grep -cE '^(ok  |FAIL)' "$RUN/check.txt") passed; setup ${T_SETUP}s, start ${T_START}s, check ${T_CHECK}s" \
     | tee -a "$RUN/check.txt"
exit "$RC"
