#!/usr/bin/env python3
"""Where a kernel's warps wait: the SASS lines with the most warp-stall samples.

Reads the source page of an Nsight Compute report exported as CSV
(`ncu -i report.ncu-rep --page source --csv --print-source sass > source.csv`) and prints the
`--top` lines with the most samples, each with its share of all samples, its largest stall
reasons and the instruction. Column names differ between ncu versions, so the sample columns are
found by name ("Warp Stall Sampling (All Samples)" and the per-reason "stall_*" columns) and the
header is printed when they are not there.

usage: tools/ncu_hotspots.py source.csv [--top N]
"""

import argparse
import sys

from ncu_csv import table


def number(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("csv", help="the source page as CSV")
    parser.add_argument("--top", type=int, default=25, help="lines to print (25)")
    args = parser.parse_args()
    rows = table(args.csv, lambda line: "Source" in line and "Address" in line,
                 "header with Address and Source columns")
    header = list(rows[0].keys()) if rows else []
    total_column = next((c for c in header if "Sampling (All" in c), None)
    if total_column is None:
        sys.exit(f"{args.csv}: no 'Warp Stall Sampling (All Samples)' column; columns: {header}")
    reason_columns = [c for c in header if c.startswith("stall_") or "Stall" in c and c != total_column
                      and "Sampling" not in c]
    total = sum(number(r[total_column]) for r in rows) or 1.0
    print(f"{len(rows)} SASS lines, {total:.0f} stall samples")
    for row in sorted(rows, key=lambda r: -number(r[total_column]))[: args.top]:
        samples = number(row[total_column])
        reasons = sorted(((number(row[c]), c) for c in reason_columns), reverse=True)[:3]
        why = ", ".join(f"{c.replace('stall_', '')} {v / samples:.0%}" for v, c in reasons if v > 0)
        print(f"{samples / total:6.1%}  {row.get('Address', ''):>6}  {row['Source'].strip()[:70]:<70}  {why}")


if __name__ == "__main__":
    main()
