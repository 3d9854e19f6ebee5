#!/usr/bin/env python3
"""Writes probe variants of a rendered gemm.cu: `variants.py GEMM_CU OUT_DIR NAME...`.

GEMM_CU comes from `fp4spec kernels --target sm_90a --out DIR` (DIR/sm_90a/gemm.cu). For each
NAME, OUT_DIR gets gemm_NAME.cu (the source with that variant's edits; each edit must match the
source exactly once, so a template change that moves the text fails here rather than probing
something else) and cases_NAME.txt (cases.py for the variant's warps per block), and cases_m32.txt for the m32 kernels' blocks. Then copy
probe.cu and run.sh there and run `bash OUT_DIR/run.sh NAME...` on the GPU host.

The diagnostic variants (noepi, nobar, nox) compute wrong results on purpose: they take one part
out of the kernel to time the rest.
"""
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def m64_stages(rows, stages):
    """The m64 kernels' template arguments: rows per variant and weight stages."""
    return [
        (f"gemm_mma<{fmt}Weights, 64 / 8, 2, true,", f"gemm_mma<{fmt}Weights, {rows} / 8, {stages}, true,")
        for fmt in ("Nvfp4", "Bf16")
    ]


VARIANTS = {
    "base": ([], None),
    # the m64 kernels with 48 rows of X (MT 6): run with PROBE_M=48
    "m48": (m64_stages(48, 2), None),
    # the m32 kernels with 24 rows of X (MT 3): run with PROBE_KERNEL=m32 PROBE_M=24
    "m24": (
        [
            ("gemm_mma<Nvfp4Weights, 32 / 8, 6, false,", "gemm_mma<Nvfp4Weights, 24 / 8, 6, false,"),
            ("gemm_mma<Bf16Weights, 32 / 8, 4, false,", "gemm_mma<Bf16Weights, 24 / 8, 4, false,"),
        ],
        8,
    ),
    "st4": (m64_stages(64, 4), None),
    "slots5": ([("#define X_SLOTS 3\n", "#define X_SLOTS 5\n")], None),
    "w6b2": (
        [
            ("#define MMA_X_WARPS 12\n", "#define MMA_X_WARPS 6\n"),
            ("#define MMA_X_SHARED_BOUNDS MMA_X_WARPS * FP4_WARP_SIZE, 1\n", "#define MMA_X_SHARED_BOUNDS MMA_X_WARPS * FP4_WARP_SIZE, 2\n"),
        ],
        6,
    ),
    "w8": ([("#define MMA_X_WARPS 12\n", "#define MMA_X_WARPS 8\n")], 8),
    "w8b2": (
        [
            ("#define MMA_X_WARPS 12\n", "#define MMA_X_WARPS 8\n"),
            ("#define MMA_X_SHARED_BOUNDS MMA_X_WARPS * FP4_WARP_SIZE, 1\n", "#define MMA_X_SHARED_BOUNDS MMA_X_WARPS * FP4_WARP_SIZE, 2\n"),
        ],
        8,
    ),
    "w16": ([("#define MMA_X_WARPS 12\n", "#define MMA_X_WARPS 16\n")], 16),
    # the split-K finish's two gpu-scope fences as acquire-release (MEMBAR.ALL.GPU) in place of
    # __threadfence (sequentially consistent: MEMBAR.SC.GPU)
    "fence": (
        [
            ("(acc[mt][0], acc[mt][1], acc[mt][2], acc[mt][3]);\n    __threadfence();\n",
             "(acc[mt][0], acc[mt][1], acc[mt][2], acc[mt][3]);\n    asm volatile(\"fence.acq_rel.gpu;\\n\" ::: \"memory\");\n"),
            ("    if (arrived != splits - 1) return;\n    __threadfence();\n",
             "    if (arrived != splits - 1) return;\n    asm volatile(\"fence.acq_rel.gpu;\\n\" ::: \"memory\");\n"),
        ],
        None,
    ),
    # store_tile returns at once (the probe's alpha is 1: a test the compiler cannot fold)
    "noepi": (
        [("    const u32 g = lane / 4, t = lane % 4;\n    #pragma unroll\n    for (int mt = 0; mt < MT; ++mt) {\n        #pragma unroll\n        for (int half = 0; half < 2; ++half) {\n",
          "    if (alpha != 0.0f) { if (acc[0][0] == 1.2345f) y[0] = 1; return; }\n    const u32 g = lane / 4, t = lane % 4;\n    #pragma unroll\n    for (int mt = 0; mt < MT; ++mt) {\n        #pragma unroll\n        for (int half = 0; half < 2; ++half) {\n")],
        None,
    ),
    # no block barrier per X-ring round
    "nobar": ([("                cp_async_wait<X_SLOTS - 2>();  // round r landed (this thread's copies) ...\n                __syncthreads();",
                "                cp_async_wait<X_SLOTS - 2>();  // round r landed (this thread's copies) ...\n")], None),
    # no X copies (the ring holds whatever shared memory held)
    "nox": ([("                    cp_async16_zfill(slot + (p * ROWS + row) * X_ROW + piece * 8,",
              "                    if (k == 7u) cp_async16_zfill(slot + (p * ROWS + row) * X_ROW + piece * 8,")], None),
}


def warps_per_block(source, macro):
    """A block's warps, `MMA_X_WARPS` (the m64 kernels) or `MMA_WARPS` (m8..m32)."""
    found = re.search(rf"^#define {macro} (\d+)$", source, re.M)
    if not found:
        sys.exit(f"gemm.cu: no #define {macro} (not a rendered sm_90a / sm_121a gemm.cu?)")
    return int(found.group(1))


def write_cases(path, warps):
    cases = subprocess.run([sys.executable, os.path.join(HERE, "cases.py"), str(warps)],
                           check=True, capture_output=True, text=True).stdout
    with open(path, "w") as f:
        f.write(cases)


def main():
    if len(sys.argv) < 4:
        sys.exit(f"usage: variants.py GEMM_CU OUT_DIR NAME...  (NAME: {' '.join(VARIANTS)})")
    gemm, out, names = sys.argv[1], sys.argv[2], sys.argv[3:]
    with open(gemm) as f:
        base = f.read()
    os.makedirs(out, exist_ok=True)
    for name in names:
        if name not in VARIANTS:
            sys.exit(f"{name}: no such variant ({' '.join(VARIANTS)})")
        edits, warps = VARIANTS[name]
        source = base
        for old, new in edits:
            count = source.count(old)
            if count != 1:
                sys.exit(f"{name}: an edit matches {count} times in {gemm}, not once: {old[:70]!r}")
            source = source.replace(old, new)
        with open(os.path.join(out, f"gemm_{name}.cu"), "w") as f:
            f.write(source)
        write_cases(os.path.join(out, f"cases_{name}.txt"), warps or warps_per_block(source, "MMA_X_WARPS"))
    # the m32 kernels' blocks (run.sh: PROBE_KERNEL=m32)
    write_cases(os.path.join(out, "cases_m32.txt"), warps_per_block(base, "MMA_WARPS"))


if __name__ == "__main__":
    main()
