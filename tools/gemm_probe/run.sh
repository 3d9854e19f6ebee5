#!/usr/bin/env bash
# On the GPU host: builds probe.cu against each variant's gemm_NAME.cu (nvcc, in parallel) and runs
# it on cases_NAME.txt: `bash run.sh NAME...` in the folder variants.py wrote (README.md). Base also
# runs with PDL launches, at M = 48, and its m32 kernels at M = 24 and 32; m48 runs at M = 48; m24
# runs the m32 kernels at M = 24. Base also runs with PROBE_CLUSTER=1 (the K splits of a tile
# group as one cluster: gemm.cu's finish_in_cluster), without and with PDL.
set -uo pipefail
cd "$(dirname "$0")"
arch=${PROBE_ARCH:-sm_90a}
for v in "$@"; do
  nvcc -O3 -gencode "arch=compute_${arch#sm_},code=$arch" -std=c++17 -DGEMM_SOURCE="\"gemm_$v.cu\"" \
    probe.cu -lcublas -o "probe_$v" > "build_$v.log" 2>&1 &
done
wait
for v in "$@"; do
  if [ ! -x "probe_$v" ]; then echo "== $v: build failed"; grep -v "^ptxas info" "build_$v.log" | head -30; continue; fi
  if [ "$v" != m24 ]; then echo "== $v"; "./probe_$v" "cases_$v.txt"; fi
  if [ "$v" = base ]; then
    echo "== $v in clusters"; PROBE_CLUSTER=1 "./probe_$v" "cases_$v.txt"
    echo "== $v in clusters, pdl"; PROBE_CLUSTER=1 "./probe_$v" "cases_$v.txt" pdl
  fi
  if [ "$v" = base ]; then echo "== $v pdl"; "./probe_$v" "cases_$v.txt" pdl; fi
  if [ "$v" = base ] || [ "$v" = m48 ]; then echo "== $v M=48"; PROBE_M=48 "./probe_$v" "cases_$v.txt"; fi
  if [ "$v" = base ] || [ "$v" = m24 ]; then
    echo "== $v m32 kernels M=24"; PROBE_KERNEL=m32 PROBE_M=24 "./probe_$v" cases_m32.txt
  fi
  if [ "$v" = base ]; then echo "== $v m32 kernels M=32"; PROBE_KERNEL=m32 PROBE_M=32 "./probe_$v" cases_m32.txt; fi
done
