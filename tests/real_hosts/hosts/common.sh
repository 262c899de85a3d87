# Sourced by every host's env.sh / setup.sh: where the hosts live, and where their source trees come from.
#
# HOSTS: the folder that holds every host (default ~/tome-hosts): $HOSTS/a1111, $HOSTS/forge, $HOSTS/reforge,
#   $HOSTS/forge-classic, $HOSTS/forge-neo, $HOSTS/sdnext, and $HOSTS/git (the git objects fetched for them).
#   Never under a dot-folder such as ~/.cache: the webui serves no file below one (the page then has no JavaScript).
# MIRROR: unset (the default), each repository is fetched from GitHub at the pinned commit only
#   (git init --bare + git fetch --depth 1 <url> <commit>, into $HOSTS/git/<owner>+<name>).
#   Set, it names a local folder of bare git directories, one per repository, as $MIRROR/<owner>+<name>/repo;
#   nothing is fetched, and a mirror lacking a pinned commit stops the setup.
# URL_<owner>_<name> (every character other than a letter or digit as "_"): another URL for one repository, e.g.
#   URL_crowsonkb_k_diffusion=https://github.com/<someone>/k-diffusion.git should that repository go away (it must
#   hold the pinned commit).
export HOSTS=${HOSTS:-$HOME/tome-hosts}
case "$HOSTS" in /*) ;; *) HOSTS=$PWD/$HOSTS;; esac   # the scripts change folders
case "$HOSTS/" in */.*) echo "ERROR: HOSTS=$HOSTS is under a dot-folder (the webui would serve no JavaScript)" >&2; exit 1;; esac

repo_url() {  # owner+name -> the URL its pinned commit is fetched from
  local var="URL_${1//[^A-Za-z0-9]/_}"
  if [ -n "${!var:-}" ]; then echo "${!var}"; return; fi
  case "$1" in
    # this mirror name carries A1111's own history (the upstream repository is large to mirror); a clone takes the
    # same commits from AUTOMATIC1111's repository
    kklouzal+stable-diffusion-webui) echo https://github.com/AUTOMATIC1111/stable-diffusion-webui.git;;
    # Stability-AI's repository went away (late 2025); A1111's dev branch clones the same commits from this copy
    Stability-AI+stablediffusion) echo https://github.com/w-e-w/stablediffusion.git;;
    *) echo "https://github.com/${1/+//}.git";;
  esac
}

git_dir_with() {  # owner+name commit -> prints a git dir that holds the commit (the mirror's, else a fetched one)
  local name=$1 commit=$2 d
  if [ -n "${MIRROR:-}" ]; then
    d=$MIRROR/$name/repo
    [ -d "$d" ] || { echo "ERROR: no mirror at $d (a bare git dir of $(repo_url "$name"))" >&2; return 1; }
  else
    d=$HOSTS/git/$name
    [ -d "$d" ] || git init -q --bare "$d"
    if ! git --git-dir="$d" cat-file -e "$commit^{commit}" 2>/dev/null; then
      echo "fetching $commit from $(repo_url "$name")" >&2
      git --git-dir="$d" fetch -q --depth 1 "$(repo_url "$name")" "$commit" >&2 || return 1
    fi
  fi
  git --git-dir="$d" cat-file -e "$commit^{commit}" 2>/dev/null \
    || { echo "ERROR: $d lacks commit $commit" >&2; return 1; }
  echo "$d"
}

# get_tree owner+name commit dest [path...]: write the commit's files to dest (git archive), leaving out each path
# given (a file or a folder). Blobs a partial mirror lacks are left out too and listed, except source files (.py,
# .json ...), whose absence stops the setup unless they match ABSENT_OK_RE. dest/.harness-extracted records the
# commit; a dest that has it is kept as it is (delete it to lay the tree out again).
get_tree() {
  local name=$1 c=$2 t=$3 d; shift 3
  if [ -e "$t/.harness-extracted" ]; then echo "have $t ($(cat "$t/.harness-extracted"))"; return; fi
  d=$(git_dir_with "$name" "$c") || exit 1
  c=$(git --git-dir="$d" rev-parse "$c^{commit}")
  local listing missing ex=() n_blobs n_missing=0 n_files p h
  listing=$(git --git-dir="$d" ls-tree -r "$c" | awk -F'\t' '$1 ~ / blob / {split($1,a," "); print a[3] "\t" $2}')
  for p in "$@"; do
    ex+=(":(exclude)$p")
    listing=$(awk -F'\t' -v x="$p" '$2 != x && index($2, x "/") != 1' <<< "$listing")
  done
  n_blobs=$(grep -c . <<< "$listing" || true)
  missing=$(cut -f1 <<< "$listing" | git --git-dir="$d" cat-file --batch-check | awk '$2=="missing"{print $1}')
  if [ -n "$missing" ]; then
    while IFS=$'\t' read -r h p; do
      grep -qx "$h" <<< "$missing" || continue
      ex+=(":(exclude)$p"); n_missing=$((n_missing + 1)); echo "WARN: $name: blob absent from the mirror, left out: $p"
      if [ -n "${ABSENT_OK_RE:-}" ] && grep -qE "$ABSENT_OK_RE" <<< "$p"; then continue; fi
      case "$p" in *.py|*.js|*.json|*.txt|*.yaml|*.yml|*.html|*.css|*.sh|*.cfg|*.toml)
        echo "ERROR: a source file is absent: $p"; exit 1;; esac
    done <<< "$listing"
  fi
  rm -rf "$t"; mkdir -p "$t"
  # git 2.39's archive still prints "invalid object" for a left-out absent blob but writes every other file; the
  # count below checks that
  git --git-dir="$d" archive "$c" -- . "${ex[@]}" 2> >(grep -v "^error: invalid object\|^error: cannot read" >&2) \
    | tar -x -C "$t"
  n_files=$(find "$t" \( -type f -o -type l \) | wc -l)
  if [ "$n_files" -ne $((n_blobs - n_missing)) ]; then
    echo "ERROR: $name: extracted $n_files files, expected $((n_blobs - n_missing))"; exit 1
  fi
  echo "$name $c" > "$t/.harness-extracted"
  echo "extracted $name@$c -> $t ($n_files files, $n_missing absent blobs left out)"
}

# get_file owner+name commit path dest: one file of a commit (kept if dest exists)
get_file() {
  local name=$1 c=$2 p=$3 f=$4 d
  if [ -f "$f" ]; then echo "have $f"; return; fi
  d=$(git_dir_with "$name" "$c") || exit 1
  mkdir -p "$(dirname "$f")"
  git --git-dir="$d" show "$c:$p" > "$f.tmp" && mv "$f.tmp" "$f"
  echo "laid out $f from $name@${c:0:7}:$p ($(stat -c %s "$f") bytes)"
}

# A1111 v1.10.1 (plus its changelog commit): the mirror name and commit every host that borrows a file from it uses
A1111_REPO=kklouzal+stable-diffusion-webui
A1111_COMMIT=82a973c04367123ae98bd9abdf80d9eda9b910e2

# The folder of these scripts (patch_torchvision_cpu.py, make_forge_model.py, txt2img.py live here)
HARNESS_SCRIPTS=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

# ------------------------------------------------------------------------------------------------ a host's settings
# host_env PREFIX NAME PORT TREE VENV LABEL: what every host's env.sh sets, under the host's own prefix:
#   ${PREFIX}_HARNESS (default $HOSTS/NAME), ${PREFIX}_MODELS, ${PREFIX}_PORT (default PORT), ${PREFIX}_HOST
#   (127.0.0.1), ${PREFIX}_URL and ${PREFIX}_RUN (pid, console log, check.txt); HF_HOME and the variables that keep
#   the host offline; the torch CPU threads, ${PREFIX}_THREADS (default 1, a good neighbour on a small shared box;
#   pixels can differ between thread counts: compare images only at the same count). The code below reads the same
#   under fixed names: HOST_PREFIX, HOST_NAME, HOST_LABEL, HOST_HARNESS, HOST_TREE (the source tree,
#   $HOST_HARNESS/TREE, launch.py lives there), HOST_VENV ($HOST_HARNESS/VENV), HOST_RUN, HOST_URL, HOST_SCRIPTS
#   (the host's folder of scripts).
host_env() {
  HOST_PREFIX=$1 HOST_NAME=$2 HOST_LABEL=$6
  HOST_SCRIPTS=$(cd "$(dirname "${BASH_SOURCE[1]}")" && pwd)
  local v=${1}_HARNESS port=${1}_PORT threads=${1}_THREADS
  HOST_HARNESS=${!v:-$HOSTS/$2} port=${!port:-$3} threads=${!threads:-1}
  HOST_TREE=$HOST_HARNESS/$4 HOST_VENV=$HOST_HARNESS/$5 HOST_RUN=$HOST_HARNESS/run HOST_URL=http://127.0.0.1:$port
  export "${1}_HARNESS=$HOST_HARNESS" "${1}_MODELS=$HOST_HARNESS/models" "${1}_PORT=$port" "${1}_HOST=127.0.0.1" \
         "${1}_URL=$HOST_URL" "${1}_RUN=$HOST_RUN"
  export HF_HOME=$HOST_HARNESS/hf-home HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 \
         DIFFUSERS_OFFLINE=1 DISABLE_TELEMETRY=1 DO_NOT_TRACK=1 GRADIO_ANALYTICS_ENABLED=False PYTHONUNBUFFERED=1
  export OMP_NUM_THREADS=$threads MKL_NUM_THREADS=$threads
}

# ------------------------------------------------------------------------------------------------ start, stop, link
# host_start TIMEOUT WARMUP: the body of every start.sh. Starts launch.py in $HOST_TREE in the background with
#   ${PREFIX}_ARGS (default ${PREFIX}_ARGS_DEFAULT), less --nowebui with ${PREFIX}_UI=1 (the page is then served at
#   $HOST_URL/ too), plus ${PREFIX}_EXTRA_ARGS. setsid gives it its own process group, so stop.sh ends the server
#   and its children by PID/PGID; the PID goes to $HOST_RUN/NAME.pid, the console to $HOST_RUN/NAME.log. Waits
#   ${PREFIX}_START_TIMEOUT seconds at most (default TIMEOUT) until host_ready, then, if ${PREFIX}_WARMUP (default
#   WARMUP) is 1, sends one 64x64 1-step txt2img, so that start.sh returns with the model in memory (a host that
#   loads it lazily or in a background thread has then loaded it; AlwaysVisible scripts run with their default args).
# A start.sh may define before: host_prepare (run in $HOST_TREE just before the launch) and host_ready (default
#   host_api_up); host_log_since_start prints this start's part of the log.
host_api_up() { curl -sf -m 5 -o /dev/null "$HOST_URL/sdapi/v1/sd-models" 2>/dev/null; }
host_log_since_start() { tail -n +$((HOST_LOG_LINE0 + 1)) "$HOST_LOG"; }
host_start() {
  local p=$HOST_PREFIX v d args timeout warmup t0 t1 pid
  mkdir -p "$HOST_RUN"
  HOST_LOG=$HOST_RUN/$HOST_NAME.log
  local pidfile=$HOST_RUN/$HOST_NAME.pid
  if [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then
    echo "already running, pid $(cat "$pidfile")"; exit 0
  fi
  if curl -s -m 3 -o /dev/null "$HOST_URL/" 2>/dev/null; then
    echo "ERROR: something else already answers on $HOST_URL"; exit 1
  fi
  [ -x "$HOST_VENV/bin/python" ] || { echo "ERROR: no $HOST_LABEL venv at $HOST_VENV: run $HOST_SCRIPTS/setup.sh"; exit 1; }
  v=${p}_ARGS d=${p}_ARGS_DEFAULT; args=${!v:-${!d}}
  v=${p}_UI; if [ "${!v:-0}" = 1 ]; then args=${args//--nowebui/}; fi
  v=${p}_EXTRA_ARGS; args="$args ${!v:-}"
  v=${p}_START_TIMEOUT; timeout=${!v:-$1}
  v=${p}_WARMUP; warmup=${!v:-$2}
  cd "$HOST_TREE"
  if declare -F host_prepare > /dev/null; then host_prepare; fi
  touch "$HOST_LOG"; HOST_LOG_LINE0=$(wc -l < "$HOST_LOG")
  echo "[start.sh $(date -Is)] python launch.py $args" >> "$HOST_LOG"
  # shellcheck disable=SC2086  # the flags are words
  setsid "$HOST_VENV/bin/python" launch.py $args >> "$HOST_LOG" 2>&1 < /dev/null &
  pid=$!; echo "$pid" > "$pidfile"
  echo "started pid $pid, log $HOST_LOG"
  t0=$(date +%s)
  declare -F host_ready > /dev/null || host_ready() { host_api_up; }
  until host_ready; do
    if ! kill -0 "$pid" 2>/dev/null; then
      echo "server died during startup; tail of log:"; tail -40 "$HOST_LOG"; rm -f "$pidfile"; exit 1
    fi
    if [ $(( $(date +%s) - t0 )) -gt "$timeout" ]; then
      echo "timeout after ${timeout}s waiting for $HOST_URL; tail of log:"; tail -40 "$HOST_LOG"; exit 1
    fi
    sleep 2
  done
  echo "API up after $(( $(date +%s) - t0 ))s: $HOST_URL"
  if [ "$warmup" = 1 ]; then
    t1=$(date +%s)
    curl -sf -m "$timeout" -H 'Content-Type: application/json' -o /dev/null \
      -d '{"prompt":"warm-up","steps":1,"width":64,"height":64,"sampler_name":"Euler","seed":1,"save_images":false}' \
      "$HOST_URL/sdapi/v1/txt2img" || { echo "warm-up txt2img failed; tail of log:"; tail -40 "$HOST_LOG"; exit 1; }
    echo "model ready (warm-up txt2img 64x64, 1 step) after $(( $(date +%s) - t1 ))s"
  fi
  echo "ready after $(( $(date +%s) - t0 ))s: $HOST_URL"
}

# host_seed_config [JSON_PAIRS]: unless ${PREFIX}_SEED_CONFIG=0, write $HOST_TREE/config.json, where there is none,
#   with the token-merging options at their defaults (after JSON_PAIRS, given as '"key": value, '). A webui of A1111
#   1.10's line restores an override_settings key after a request only if the key is already in opts.data
#   (processing.py: stored_opts = {... if k in opts.data}); with no config.json, {"token_merging_ratio": 0.5} in one
#   request would silently stay in force for every later request.
host_seed_config() {
  local v=${HOST_PREFIX}_SEED_CONFIG
  if [ "${!v:-1}" = 1 ] && [ ! -f "$HOST_TREE/config.json" ]; then
    echo "{${1:-}\"token_merging_ratio\": 0.0, \"token_merging_ratio_img2img\": 0.0, \"token_merging_ratio_hr\": 0.0}" \
      > "$HOST_TREE/config.json"
    echo "seeded $HOST_TREE/config.json (${1:+${1%, } and }token merging options at their defaults)"
  fi
}

# host_stop: the body of every stop.sh. Ends the server start.sh started by the PID it saved and that PID's process
#   group (SIGTERM, then SIGKILL after 15 s). Never by name.
host_stop() {
  local pidfile=$HOST_RUN/$HOST_NAME.pid pid
  [ -f "$pidfile" ] || { echo "no pid file ($pidfile): nothing to stop"; return 0; }
  pid=$(cat "$pidfile")
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid"
    for _ in $(seq 1 30); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    if kill -0 "$pid" 2>/dev/null; then
      kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid"; echo "killed pid $pid (SIGKILL)"
    else
      echo "stopped pid $pid"
    fi
  else
    echo "pid $pid not running"
  fi
  rm -f "$pidfile"
}

# host_link SRC_DIR [NAME] | --remove NAME | --list: the body of every link_extension.sh. Puts an extension into
#   $HOST_TREE/extensions as a symlink (NAME defaults to the folder's name); the server loads it at its next start.
host_link() {
  local ext=$HOST_TREE/extensions src name
  mkdir -p "$ext"
  case "${1:-}" in
    --remove) rm -f "$ext/${2:?name}"; echo "removed $ext/$2"; return 0;;
    --list) ls -la "$ext"; return 0;;
  esac
  src=$(cd "${1:?extension dir}" && pwd)
  name=${2:-$(basename "$src")}
  ln -sfn "$src" "$ext/$name"
  echo "linked $ext/$name -> $src (restart $HOST_LABEL to load it: stop.sh, start.sh)"
}

# ------------------------------------------------------------------------------------------------ set-up
# setup_phase LABEL: the set-up's next part begins (the first call also makes $HOST_HARNESS); setup_done lists
#   each part's time
setup_phase() {
  local now; now=$(date +%s)
  if [ -z "${SETUP_T0:-}" ]; then SETUP_T0=$now; mkdir -p "$HOST_HARNESS"; fi
  [ -z "${SETUP_LABEL:-}" ] || SETUP_TIMES="${SETUP_TIMES:+$SETUP_TIMES, }$SETUP_LABEL $((now - SETUP_PHASE_T))s"
  SETUP_LABEL=$1 SETUP_PHASE_T=$now
}
# setup_done: the set-up's last line: its time, each part's, and how to start and stop the host
setup_done() {
  setup_phase ""
  mkdir -p "$HOST_RUN" "$HF_HOME"
  echo "setup done in $(( $(date +%s) - SETUP_T0 ))s ($SETUP_TIMES). start: $HOST_SCRIPTS/start.sh ; stop: $HOST_SCRIPTS/stop.sh"
}
# setup_extract_only: with EXTRACT_ONLY=1, the set-up ends once the sources are laid out (no venv, no model)
setup_extract_only() {
  [ "${EXTRACT_ONLY:-0}" = 1 ] || return 0
  setup_phase ""; echo "sources laid out ($SETUP_TIMES; EXTRACT_ONLY=1: no venv, no model)"; exit 0
}

# launch_pin VAR DEFAULT: the commit $HOST_TREE/modules/launch_utils.py pins as VAR (DEFAULT where it names none)
launch_pin() {
  local v
  v=$(grep -oE "'$1', \"[0-9a-f]{40}\"" "$HOST_TREE/modules/launch_utils.py" | head -1 | grep -oE '[0-9a-f]{40}' || true)
  echo "${v:-$2}"
}
# launch_clip_pin DEFAULT: the openai/CLIP commit launch_utils.py installs `clip` from
launch_clip_pin() {
  grep -oE "openai/CLIP/archive/[0-9a-f]{40}" "$HOST_TREE/modules/launch_utils.py" | head -1 | grep -oE '[0-9a-f]{40}' \
    || echo "$1"
}

# pipq ARGS...: the host venv's pip, minus the noisy "Location ... is ignored" lines; keeps pip's exit status
pipq() {
  local out rc=0; out=$("$HOST_VENV/bin/pip" "$@" 2>&1) || rc=$?
  out=$(grep -v "is ignored: it is neither" <<< "$out" || true); [ -z "$out" ] || echo "$out"; return $rc
}
# setup_venv: the host's venv (Python 3.11; PYTHON311=<interpreter> names another) with CPU torch (TORCH_WHL=<requirement
#   or wheel file>, default torch==2.13.0)
setup_venv() {
  [ -x "$HOST_VENV/bin/python" ] || "${PYTHON311:-python3.11}" -m venv "$HOST_VENV"
  pipq install -q "${TORCH_WHL:-torch==2.13.0}"
}
# setup_webui_packages: a webui's packages: requirements-NAME-cpu.txt with torchvision 0.28.0 under
#   constraints-NAME.txt, then `clip` from $HOST_HARNESS/src/CLIP, as launch_utils would install it
setup_webui_packages() {
  pipq install -q -r "$HOST_SCRIPTS/requirements-$HOST_NAME-cpu.txt" torchvision==0.28.0 \
    -c "$HOST_SCRIPTS/constraints-$HOST_NAME.txt"
  pipq install -q --no-deps --no-build-isolation "$HOST_HARNESS/src/CLIP"
}
# setup_webui_venv MODULE...: the set-up's venv+pip part for a webui: setup_venv, setup_webui_packages and
#   setup_check_venv MODULE...
setup_webui_venv() {
  setup_phase venv+pip
  setup_venv
  setup_webui_packages
  setup_check_venv "$@"
}
# setup_check_venv MODULE...: guard torchvision 0.28.0's CUDA-only _C beside the CPU torch (every harness's), import
#   each module and print its version, and run pip check (a conflict is reported, not fatal)
setup_check_venv() {
  "$HOST_VENV/bin/python" "$HARNESS_SCRIPTS/patch_torchvision_cpu.py"
  "$HOST_VENV/bin/python" - "$@" <<'PY'
import importlib, sys
mods = [(n, importlib.import_module(n)) for n in sys.argv[1:]]
print(", ".join(f"{n} {getattr(m, '__version__', getattr(m, 'VERSION', ''))}".strip() for n, m in mods))
PY
  pipq check || echo "WARN: pip check reports conflicts (see above)"
}
# setup_checkpoint CKPT [CANDIDATE...] -- COMMAND...: the host's random checkpoint. Kept where CKPT exists (FORCE_MODEL=1
#   makes it anew); else hard-linked (or copied) from REUSE_CKPT=FILE or, with REUSE_CKPT unset, from the first
#   CANDIDATE that exists (another harness's file of the same layout; REUSE_CKPT= (empty) always builds); else
#   COMMAND builds it.
setup_checkpoint() {
  local ckpt=$1 reuse=${REUSE_CKPT:-}; shift
  while [ $# -gt 0 ] && [ "$1" != -- ]; do
    if [ -z "${REUSE_CKPT+x}" ] && [ -z "$reuse" ] && [ -f "$1" ]; then reuse=$1; fi
    shift
  done
  shift
  mkdir -p "$(dirname "$ckpt")"
  if [ -f "$ckpt" ] && [ "${FORCE_MODEL:-0}" != 1 ]; then
    echo "have $ckpt"
  elif [ -n "$reuse" ] && [ -f "$reuse" ] && [ "${FORCE_MODEL:-0}" != 1 ]; then
    ln -f "$reuse" "$ckpt" 2>/dev/null || cp "$reuse" "$ckpt"
    echo "reused $reuse -> $ckpt (hard link or copy)"
  else
    "$@"
  fi
}
# setup_forge_checkpoint FLAG [CANDIDATE...]: the set-up's model part for a host of the Forge family: its random SD 1.5
#   checkpoint $HOST_HARNESS/models/Stable-diffusion/random-sd15.safetensors, by setup_checkpoint (kept, reused from
#   a CANDIDATE, or built by make_forge_model.py --FLAG $HOST_TREE with the host's venv)
setup_forge_checkpoint() {
  local flag=$1 ckpt=$HOST_HARNESS/models/Stable-diffusion/random-sd15.safetensors; shift
  setup_phase model
  setup_checkpoint "$ckpt" "$@" -- "$HOST_VENV/bin/python" "$HARNESS_SCRIPTS/make_forge_model.py" "--$flag" "$HOST_TREE" --out "$ckpt"
}
# get_vae_approx: the SD1 "Approx NN" live-preview model, models/VAE-approx/model.pt of A1111 v1.10.1, into $HOST_TREE
#   (a host that lacks it downloads it from A1111's v1.0.0-pre release when it needs it)
get_vae_approx() {
  get_file "$A1111_REPO" "$A1111_COMMIT" models/VAE-approx/model.pt "$HOST_TREE/models/VAE-approx/model.pt"
}
