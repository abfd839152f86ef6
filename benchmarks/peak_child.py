#!/usr/bin/env python3
"""Run `python -m MODULE ARGS...` (or `python SCRIPT ARGS...`) and, as it exits, write its own
peak resident memory in KiB to the file named by $KVBENCH_PEAK_FILE.

The peak is VmHWM of /proc/self/status: the high-water mark of the memory this process mapped
since it started the program. A child's ru_maxrss (wait4, RUSAGE_CHILDREN) is not that: Linux
carries the parent's resident size at the fork into it, so a benchmark that held 800 MiB of
input when it started a child reported at least 800 MiB for a child that used 11
(benchmarks/bigfile.py's run_child and matrix_scale.py used it until 2026-12-07).

    KVBENCH_PEAK_FILE=/tmp/peak python benchmarks/peak_child.py -m kvbench.matrix report ...
"""

from __future__ import annotations

import atexit
import os
import runpy
import sys


def _write_peak() -> None:
    path = os.environ.get("KVBENCH_PEAK_FILE")
    with open("/proc/self/status") as f:
        kib = next((line.split()[1] for line in f if line.startswith("VmHWM:")), None)
    if path and kib:
        with open(path, "w") as out:
            out.write(kib)


def main() -> None:
    atexit.register(_write_peak)
    args = sys.argv[1:]
    if args[:1] == ["-m"]:
        sys.path[0] = os.getcwd()  # (as `python -m` sets it)
        sys.argv = [args[1], *args[2:]]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = args
        sys.path[0] = os.path.dirname(os.path.abspath(args[0]))
        runpy.run_path(args[0], run_name="__main__")


if __name__ == "__main__":
    main()
