#!/usr/bin/env python3
"""Median time of each kernel and grid size in an Nsight Compute CSV of launch durations.

Reads what `ncu --metrics gpu__time_duration.sum --csv ...` prints (one row per launch) and
prints, per kernel name and grid, the launch count and the median, fewest and most us, sorted by
the launches' summed time, so a decode step's kernels come out in the order of what they cost
when each runs alone (ncu serialises launches: no overlap with the kernel before).

usage: tools/ncu_durations.py launches.csv
"""

import argparse
import collections
import statistics
import sys

from ncu_csv import launch_table

METRIC = "gpu__time_duration.sum"
TO_US = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("csv", help=f"ncu --csv output with the {METRIC} metric")
    args = parser.parse_args()
    launches = collections.defaultdict(list)
    for row in launch_table(args.csv):
        if row.get("Metric Name") != METRIC:
            continue
        unit = row.get("Metric Unit", "")
        if unit not in TO_US:
            sys.exit(f"{args.csv}: {METRIC} in unit '{unit}', expected one of {sorted(TO_US)}")
        value = float(row["Metric Value"].replace(",", "")) * TO_US[unit]
        name = row["Kernel Name"].split("(")[0]
        launches[(name, row["Grid Size"])].append(value)
    if not launches:
        sys.exit(f"{args.csv}: no {METRIC} rows (was ncu run with --metrics {METRIC}?)")
    print(f"{'kernel':44} {'grid':16} {'launches':>8} {'median us':>10} {'min':>9} {'max':>9} {'sum us':>10}")
    for (name, grid), us in sorted(launches.items(), key=lambda item: -sum(item[1])):
        print(f"{name:44} {grid:16} {len(us):8d} {statistics.median(us):10.2f} {min(us):9.2f} "
              f"{max(us):9.2f} {sum(us):10.1f}")


if __name__ == "__main__":
    main()
