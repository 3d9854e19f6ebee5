#!/usr/bin/env python3
"""Where each profiled kernel's time goes: one line per launch of an Nsight Compute report.

Reads the details page of a report exported as CSV (`ncu -i report.ncu-rep --page details
--csv > details.csv`, from `ncu --set full ...`) and prints, per profiled launch, its duration,
DRAM and memory throughput, registers, grid and block, achieved and theoretical occupancy, IPC,
busy issue slots, cycles with no eligible warp, cycles per issued instruction, waves per SM,
instructions, L2 hit rate and dynamic shared memory: whether a launch is bound by bytes,
instructions or latency, at a glance (tools/ncu_hotspots.py then says where in the SASS).

usage: tools/ncu_details.py details.csv
"""

import argparse
import collections

from ncu_csv import launch_table

METRICS = [
    "Duration", "DRAM Throughput", "Memory Throughput", "Registers Per Thread", "Grid Size",
    "Block Size", "Achieved Occupancy", "Theoretical Occupancy", "Executed Ipc Active",
    "Issue Slots Busy", "No Eligible", "Warp Cycles Per Issued Instruction", "Waves Per SM",
    "Executed Instructions", "L2 Hit Rate", "Dynamic Shared Memory Per Block",
]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("csv", help="the details page as CSV")
    args = parser.parse_args()
    launches = collections.OrderedDict()
    for row in launch_table(args.csv):
        key = (row["ID"], row["Kernel Name"].split("(")[0])
        metrics = launches.setdefault(key, {})
        if row["Metric Name"] in METRICS:
            metrics[row["Metric Name"]] = f'{row["Metric Value"]} {row["Metric Unit"]}'.strip()
    for (launch, kernel), metrics in launches.items():
        print(f"[{launch}] {kernel}: " + "; ".join(f"{m} {metrics[m]}" for m in METRICS if m in metrics))


if __name__ == "__main__":
    main()
