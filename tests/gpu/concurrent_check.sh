#!/usr/bin/env bash
# gpu:concurrent_check: 16 `jitfuse check` processes at once on one GPU (issue 26, item 10: uploads of the
# reference harness not ordered with its non-blocking stream made half of them FAIL under load).
# Usage: concurrent_check.sh JITFUSE_BIN EXAMPLE_JSON [N] [SHAPE]; exits 77 (CTest's skip) without a GPU, 1 when any
# run does not end in PASS (FAIL, an error, a crash).
set -u
bin="$1" example="$2" n="${3:-16}" shape="${4:-100x72}"
if absent="$("$bin" doctor | grep -o "no GPU present.*")"; then
  echo "SKIP: $absent"
  exit 77
fi
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
export JITFUSE_CACHE_DIR="$out/cache"  # one cache shared by the 16, as ranks share one
pids=()
for i in $(seq 1 "$n"); do
  "$bin" check "$example" --recipe fp32 --shape "$shape" >"$out/$i.log" 2>&1 &
  pids+=("$!")
done
failed=0
for i in $(seq 1 "$n"); do
  wait "${pids[$((i - 1))]}"
  rc=$?
  if [ "$rc" -ne 0 ] || grep -q FAIL "$out/$i.log" || [ "$(tail -n 1 "$out/$i.log")" != PASS ]; then
    failed=$((failed + 1))
    echo "--- run $i of $n (exit $rc) did not pass:"
    tail -n 20 "$out/$i.log"
  fi
done
echo "$((n - failed)) of $n concurrent checks passed"
[ "$failed" -eq 0 ]
