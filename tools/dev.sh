#!/usr/bin/env bash
# The two entry points of README.md:
#   tools/dev.sh run   set up, build, then plan + compile (+ run and check, with a GPU) an example layer
#   tools/dev.sh test  set up, build, then run every test tier (gpu tests report "skipped" without a GPU)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$here"
cmd="${1:-}"
case "$cmd" in run|test) ;; *) echo "usage: tools/dev.sh run|test" >&2; exit 2 ;; esac
bash tools/setup.sh
build="${JITFUSE_BUILD_DIR:-build}"
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE="${JITFUSE_BUILD_TYPE:-Release}" >/dev/null
cmake --build "$build" --parallel "$(nproc)"
if [ "$cmd" = run ]; then
  "$build/tools/jitfuse" doctor
  echo
  exec "$build/tools/jitfuse" check tools/examples/transformer_layer.json --recipe bf16 --shape 128x1024
fi
cd "$build"
ctest --output-on-failure --timeout 1500 -j "$(nproc)"
