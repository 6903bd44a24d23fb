#!/usr/bin/env bash
# Sanitizer builds and runs (issue 15): ASan+UBSan of the unit and nvrtc tiers, TSan of the many-threads
# C ABI test, each in its own build directory. CPU only. Results are recorded in docs/sanitizers.md.
#
#   tools/sanitize.sh [asan|tsan|all]      (default all; JOBS=2, NICE=10, ASAN_OPT=-O1 by default)
#
# Debug builds on purpose: they also check that a Debug libjitfuse.so links without the driver stub
# (tests/unit/api/no_driver_link_test.cpp runs in the ASan unit tier).
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
JOBS=${JOBS:-2}
NICE=${NICE:-10}
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_C_COMPILER_LAUNCHER=ccache)

configure() {  # dir flags
  cmake -S . -B "$1" -G Ninja -DCMAKE_BUILD_TYPE=Debug "${launcher[@]}" \
    -DCMAKE_CXX_FLAGS="$2" -DCMAKE_C_FLAGS="$2" \
    -DCMAKE_EXE_LINKER_FLAGS="$2" -DCMAKE_SHARED_LINKER_FLAGS="$2" >/dev/null
}

status=0
if [[ $what == asan || $what == all ]]; then
  flags="${ASAN_OPT:--O1} -g -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
  configure build-asan "$flags"
  nice -n "$NICE" cmake --build build-asan --parallel "$JOBS" --target jf_unit_tests jf_nvrtc_tests jitfuse_cli
  # detect_leaks=0: the NVRTC/cuBLASLt libraries keep process-lifetime allocations LSan cannot see freed.
  export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:detect_stack_use_after_return=1
  export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
  echo "== ASan+UBSan: unit tier"
  nice -n "$NICE" build-asan/tests/jf_unit_tests || status=1
  echo "== ASan+UBSan: nvrtc tier"
  nice -n "$NICE" build-asan/tests/jf_nvrtc_tests || status=1
fi
if [[ $what == tsan || $what == all ]]; then
  configure build-tsan "-O1 -g -fsanitize=thread -fno-omit-frame-pointer"
  nice -n "$NICE" cmake --build build-tsan --parallel "$JOBS" --target jf_threads_tests jitfuse
  echo "== Debug libjitfuse.so: no NEEDED libcuda (the driver is dlopen'ed)"
  if readelf -d build-tsan/runtime/libjitfuse.so | grep NEEDED | grep -q libcuda; then
    echo "FAIL: build-tsan/runtime/libjitfuse.so needs libcuda"; status=1
  else
    echo "ok"
  fi
  echo "== TSan: many-threads C ABI test"
  TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 nice -n "$NICE" build-tsan/tests/jf_threads_tests \
    || status=1
fi
exit $status
