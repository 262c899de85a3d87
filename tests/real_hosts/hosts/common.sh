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
