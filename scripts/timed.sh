#!/usr/bin/env bash
# Usage: scripts/timed.sh FILE NAME COMMAND...
# Runs COMMAND, then appends NAME, its wall time and, if it failed, its exit status to FILE, and
# exits with COMMAND's status (make test times its stages with it; .ci/run prints FILE at the end).
set -u
file=$1 name=$2
shift 2
start=$SECONDS
status=0
"$@" || status=$?
mkdir -p "$(dirname "$file")"
note=""
[ "$status" -eq 0 ] || note="  (failed, exit status $status)"
printf '%-24s %5d s%s\n' "$name" $((SECONDS - start)) "$note" >> "$file"
exit "$status"
