#!/usr/bin/env bash
# Installs the compilers the codegen checks need on a machine with no GPU, idempotently:
#   clang-19 + lld-19 + llvm-19 (Debian) for gfx1151 code objects and their checks (llvm-readelf,
#   llvm-objdump),
#   the HIP runtime header and library (Debian's libamdhip64-dev, HIP 5.2; skipped when ROCm is
#   installed) and libclang (libclang1-19) for `--features hip` (bindgen generates the runtime
#   bindings; with no AMD GPU the library reports no device),
#   NVRTC, the CUDA headers and ptxas 13.0.88 (PyPI wheels, in .toolchains/venv) for sm_90a / sm_121a.
# Source it to get the environment (LD_LIBRARY_PATH, PATH, FP4SPEC_CUDA_INCLUDE), or run
#   bash tools/toolchains.sh COMMAND...   to run COMMAND inside that environment.
# The CUDA version is pinned to the GPU host's driver: PTX from a newer NVRTC can be too new for it.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cuda_version=13.0.88
venv="$root/.toolchains/venv"

packages=()
if ! command -v clang-19 >/dev/null 2>&1 || ! command -v ld.lld-19 >/dev/null 2>&1 \
   || ! command -v llvm-objdump-19 >/dev/null 2>&1; then
  packages+=(clang-19 lld-19 llvm-19)
fi
hip_root=${ROCM_PATH:-${HIP_PATH:-/opt/rocm}}
if [ ! -f "$hip_root/include/hip/hip_runtime_api.h" ] && [ ! -f /usr/include/hip/hip_runtime_api.h ]; then
  packages+=(libamdhip64-dev)
fi
if ! ls /usr/lib/llvm-19/lib/libclang-19.so* >/dev/null 2>&1; then
  packages+=(libclang1-19)
fi
if [ ${#packages[@]} -gt 0 ]; then
  if command -v apt-get >/dev/null 2>&1; then
    echo "toolchains: installing ${packages[*]} (apt)" >&2
    log=$(mktemp)
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${packages[@]}"; } >"$log" 2>&1; then
      cat "$log" >&2; echo "toolchains: apt-get failed" >&2; exit 1
    fi
    rm -f "$log"
  else
    echo "toolchains: ${packages[*]} missing and apt-get is not available; gfx1151 checks and --features hip will report what is missing" >&2
  fi
fi

stamp="$venv/.fp4spec-cuda-$cuda_version"
if [ ! -f "$stamp" ]; then
  echo "toolchains: installing NVRTC, CUDA headers and ptxas $cuda_version into $venv (pip)" >&2
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check \
    "nvidia-cuda-nvrtc==$cuda_version" "nvidia-cuda-runtime==$cuda_version" "nvidia-cuda-nvcc==$cuda_version" >&2
  touch "$stamp"
fi
cu13=$(ls -d "$venv"/lib/python3*/site-packages/nvidia/cu13 | head -n 1)
export LD_LIBRARY_PATH="$cu13/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PATH="$cu13/bin:$PATH"
export FP4SPEC_CUDA_INCLUDE="$cu13/include"

if [ $# -gt 0 ] && [ "${BASH_SOURCE[0]}" = "$0" ]; then exec "$@"; fi
