"""The table of an Nsight Compute CSV export, for the tools/ncu_*.py scripts.

ncu (and the profiled program) print lines of their own before the table, so the table starts at
the first line `is_header` accepts.
"""

import csv
import sys


def table(path, is_header, header_name):
    """The rows of the table in `path` as dicts; exits naming `header_name` when no line is one."""
    with open(path, newline="") as f:
        lines = f.read().splitlines()
    start = next((i for i, line in enumerate(lines) if is_header(line)), None)
    if start is None:
        sys.exit(f"{path}: no {header_name}; first lines: {lines[:3]}")
    return list(csv.DictReader(lines[start:]))


def launch_table(path):
    """The rows of a per-launch export (`--csv` of metrics, `--page details --csv`): its header
    starts with "ID"."""
    return table(path, lambda line: line.startswith('"ID"'), 'ncu CSV header (a line starting with "ID")')
