#!/usr/bin/env bash
# gpu:concurrent_check: 16 `jitfuse check` processes at once on one GPU (issue 26, item 10: unordered
# uploads of the reference harness made half of them FAIL under load). Every one must end in PASS.
# Usage: concurrent_check.sh JITFUSE_BIN EXAMPLE_JSON [N]; exits 77 (CTest's skip) without a GPU.
set -u
bin="$1" example="$2" n="${3:-16}"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
export JITFUSE_CACHE_DIR="$out/cache"
for i in $(seq 1 "$n"); do
  "$bin" check "$example" --recipe fp32 --shape 100x72 >"$out/$i.log" 2>&1 &
done
wait
if grep -q "no GPU present" "$out/1.log"; then
  echo "no GPU: skipped"
  exit 77
fi
failed=0
for i in $(seq 1 "$n"); do
  if ! tail -n 1 "$out/$i.log" | grep -qx PASS; then
    failed=$((failed + 1))
    echo "--- run $i of $n did not pass:"
    tail -n 20 "$out/$i.log"
  fi
done
echo "$((n - failed)) of $n concurrent checks passed"
[ "$failed" -eq 0 ]
