#!/usr/bin/env bash
# Submit `opd train CONFIG` (with --run: `opd run CONFIG`) to a running Ray cluster as a Ray job.
#   cluster/submit.sh [--dry-run] [--run] [--address URL] [--token-file FILE] [--python PY] CONFIG [args...]
# --run: training, then the before/after table and, with eval.suite, the benchmark suite's table (the paper's).
# The address is the cluster's dashboard (http://HOST:8265), from --address or RAY_ADDRESS. CONFIG must lie
# inside this checkout: the checkout is uploaded as the job's working directory and CONFIG is read from there.
# Token auth (on by default since Ray 2.60): the head's token from --token-file, RAY_AUTH_TOKEN_PATH,
# RAY_AUTH_TOKEN or ~/.ray/auth_token is sent; RAY_AUTH_MODE=disabled sends none. The job runs
# `PY -m opd.cli train|run ...` (PY: --python, default python), so it needs no `opd` on the head's PATH.
# The job is submitted without waiting; the script prints the job id, the dashboard URL and how to follow it.
set -euo pipefail

die() { echo "error: $*" >&2; exit 2; }

dry_run=0
address="${RAY_ADDRESS:-}"
python=python
command=train
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry-run) dry_run=1; shift ;;
    --run) command=run; shift ;;
    --address) [[ $# -ge 2 ]] || die "--address needs a URL (e.g. http://HEAD:8265)"; address="$2"; shift 2 ;;
    --address=*) address="${1#--address=}"; shift ;;
    --token-file) [[ $# -ge 2 ]] || die "--token-file needs a file (the head's ~/.ray/auth_token)"
                  [[ -r "$2" ]] || die "token file $2 not readable (copy the head's ~/.ray/auth_token)"
                  export RAY_AUTH_TOKEN_PATH="$(cd "$(dirname "$2")" && pwd)/$(basename "$2")"; shift 2 ;;
    --python) [[ $# -ge 2 ]] || die "--python needs the head's Python (e.g. /home/ray/anaconda3/bin/python)"
              python="$2"; shift 2 ;;
    -h|--help) sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) break ;;
  esac
done
[[ $# -ge 1 ]] || die "missing CONFIG (usage: cluster/submit.sh [--dry-run] [--address URL] CONFIG [opd train args...])"
config="$1"; shift
[[ -f "$config" ]] || die "config $config not found"

# runtime_env.yaml's working_dir "." means the repository root, so submit from there with CONFIG relative to it.
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
config_abs="$(cd "$(dirname "$config")" && pwd)/$(basename "$config")"
[[ "$config_abs" == "$root"/* ]] || die "config $config is outside $root (only this checkout is uploaded to the cluster)"
config="${config_abs#"$root"/}"
cd "$root"

# Fail fast on a bad spec here rather than minutes later on the cluster. Paths are not checked: they name the
# cluster's shared storage. The resolved spec also gives the run's name, which --set may have changed.
name=""
if command -v opd >/dev/null; then
  resolved="$(opd validate "$config" --no-path-check "$@")" || exit 2
  name="$(sed -n 's/^name: *//p' <<<"$resolved" | head -n1)"
fi
# Without a local opd (e.g. a laptop with only ray installed) the config's file name stands in for the name.
name="${name:-$(basename "$config" .yaml)}"
# Job ids end up in URLs and log file names: keep them to letters, digits, dots, dashes and underscores.
submission_id="opd-$(tr -c 'A-Za-z0-9._\n-' '-' <<<"$name")-$(date +%Y%m%d-%H%M%S)"

# Token auth: Ray's client sends a token only in RAY_AUTH_MODE=token, so turn that on when a token is at hand.
if [[ -n "${RAY_AUTH_TOKEN_PATH:-}" ]]; then
  [[ -r "$RAY_AUTH_TOKEN_PATH" ]] || die "token file $RAY_AUTH_TOKEN_PATH not readable (copy the head's ~/.ray/auth_token)"
fi
if [[ -z "${RAY_AUTH_MODE:-}" ]] && [[ -n "${RAY_AUTH_TOKEN:-}${RAY_AUTH_TOKEN_PATH:-}" || -r "$HOME/.ray/auth_token" ]]; then
  export RAY_AUTH_MODE=token
fi

cmd=(ray job submit --address "${address:-\$RAY_ADDRESS}" --runtime-env cluster/runtime_env.yaml
     --submission-id "$submission_id" --no-wait -- "$python" -m opd.cli "$command" "$config" "$@")
if [[ $dry_run -eq 1 ]]; then
  printf '%q ' "${cmd[@]}" | sed 's/ $//; s/\\\$RAY_ADDRESS/$RAY_ADDRESS/'
  echo
  exit 0
fi
[[ -n "$address" ]] || die "RAY_ADDRESS is not set (export RAY_ADDRESS=http://HEAD:8265 or pass --address)"
command -v ray >/dev/null || die "ray not found on PATH (pip install 'ray[default]')"
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
if ! "${cmd[@]}" >"$log" 2>&1; then
  if grep -q "AuthenticationError\|Unauthorized" "$log"; then
    die "the cluster at $address wants its Ray auth token: copy the head's ~/.ray/auth_token and pass --token-file FILE (or export RAY_AUTH_TOKEN), or start the cluster with RAY_AUTH_MODE=disabled"
  fi
  die "ray job submit failed: $(grep -v '^[[:space:]]*$' "$log" | tail -n1)"
fi
grep -v "^[[:space:]]*$" "$log" | grep -iv "token authentication" || true

# The dashboard serves on 8265 whatever port the address used (e.g. ray://HEAD:10001).
host="${address#*://}"; host="${host%%/*}"; host="${host%:*}"
echo "job id:    $submission_id"
echo "dashboard: http://$host:8265/#/jobs/$submission_id"
echo "follow:    ray job logs --address $address --follow $submission_id"
echo "stop:      ray job stop --address $address $submission_id"
