#!/usr/bin/env bash
# Installs what jitfuse needs to build on Debian 12 and checks for the CUDA toolkit.
# Idempotent and quiet when everything is already there.
set -euo pipefail
PKGS=(cmake ninja-build g++ nlohmann-json3-dev libspdlog-dev libfmt-dev catch2 libcli11-dev libdlpack-dev libssl-dev python3 python3-pytest)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "jitfuse setup: installing ${missing[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
if [ ! -x "$CUDA_HOME/bin/nvcc" ] || [ ! -f "$CUDA_HOME/include/nvrtc.h" ]; then
  echo "jitfuse setup: the CUDA 13 toolkit was not found at $CUDA_HOME (need nvrtc.h, cuda.h, cublasLt.h)." >&2
  echo "  Install CUDA 13 from https://developer.nvidia.com/cuda-downloads or set CUDA_HOME." >&2
  exit 1
fi
ver=$("$CUDA_HOME/bin/nvcc" --version | sed -n 's/.*release \([0-9]*\)\..*/\1/p')
if [ "${ver:-0}" -lt 13 ]; then
  echo "jitfuse setup: CUDA $ver found at $CUDA_HOME, jitfuse needs CUDA 13 or newer." >&2
  exit 1
fi
