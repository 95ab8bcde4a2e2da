"""What a host-side benchmark ran on (scripts/bench_planner.py, scripts/bench_data.py):
CPU model, cores and load. On a shared machine the load inflates wall time, so those
benchmarks report CPU time and name the machine beside it."""
from __future__ import annotations

import os
import platform

import numpy as np


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
        cpu = names[0] if names else cpu
    return {"node": platform.node(), "cpu": cpu, "cores": os.cpu_count(),
            "load_avg_1m": round(os.getloadavg()[0], 2), "python": platform.python_version(),
            "numpy": np.__version__}
