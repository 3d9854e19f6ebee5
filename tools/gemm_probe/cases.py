#!/usr/bin/env python3
"""Cases for probe.cu, for blocks of WARPS warps: `cases.py WARPS > cases.txt`.

The decode step's m64 launches at B = 64 as x_shared_plan partitions them on an H100 / H200
(2 warps per 16-row tile; GDN out_proj and attention o_proj K split 6 ways), then scans on the
out_proj shape: K splits, K at one split, N at one split (how a block's time grows with its
rounds, and whether it depends on how many blocks run), one warp per tile.
"""
import sys

# (name, format, N, K, K splits, warps per tile)
MODEL = [
    ("out_proj", "bf16", 2048, 4096, 6, 2),
    ("in_proj", "bf16", 12352, 2048, 1, 2),
    ("qkv", "nvfp4", 9216, 2048, 1, 2),
    ("o_proj", "nvfp4", 2048, 4096, 6, 2),
]
SCANS = (
    [(f"k4096s{s}", "bf16", 2048, 4096, s, 2) for s in (1, 2, 4, 8, 16)]
    + [(f"k{k}s1", "bf16", 2048, k, 1, 2) for k in (2048, 1024, 512, 256, 128, 64)]
    + [(f"n{n}", "bf16", n, 2048, 1, 2) for n in (768, 4096, 8192, 16384)]
    + [
        ("out_w1s6", "bf16", 2048, 4096, 6, 1),
        ("out_w1s12", "bf16", 2048, 4096, 12, 1),
        # fewer tiles per block, fewer splits (4 tiles x 4 splits, 2 tiles x 2 splits: 128 blocks)
        ("out_w3s4", "bf16", 2048, 4096, 4, 3),
        ("out_w6s2", "bf16", 2048, 4096, 2, 6),
        ("o_w3s4", "nvfp4", 2048, 4096, 4, 3),
        ("qkv_k512", "nvfp4", 9216, 512, 1, 2),
        ("qkv_k64", "nvfp4", 9216, 64, 1, 2),
    ]
)


def main():
    if len(sys.argv) != 2 or not sys.argv[1].isdigit() or int(sys.argv[1]) < 2:
        sys.exit("usage: cases.py WARPS_PER_BLOCK (at least 2)")
    warps = int(sys.argv[1])
    for name, fmt, n, k, splits, wpt in MODEL + SCANS:
        tiles, groups = n // 16, k // 64
        groups_per_split = -(-groups // splits)
        splits = -(-groups // groups_per_split)
        blocks = -(-tiles // (warps // wpt))
        print(name, fmt, n, k, blocks, splits, groups_per_split, wpt, warps)


if __name__ == "__main__":
    main()
