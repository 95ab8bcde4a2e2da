#!/usr/bin/env python
"""How long a new user waits: `python scripts/train.py` (the tiny config, defaults) as a
subprocess, timed from launch to its first step line and to its exit, three ways:

  cold    a fresh workdir (its compilation cache empty): imports, init, the one compile
  warm    a fresh workdir with the compilation cache of an earlier run (JAX's persistent
          cache, `train.compilation_cache_dir`): what a second experiment pays
  resume  the same workdir after `train.stop_after`: restore + cached programs

Median of `--repeats`; prints a table and writes JSON.

  python scripts/bench_startup.py [--repeats 3] [--json bench_results/bench_startup.json]
"""
from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def timed_run(workdir: str, extra: list[str], cache: str | None = None) -> dict:
    """(seconds to the first `step ` line, seconds to exit) of one train.py run."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS",
                                                             "JAX_COMPILATION_CACHE_DIR")}
    env["JAX_PLATFORMS"] = "cpu"
    cmd = [sys.executable, os.path.join(REPO, "scripts", "train.py"), f"--workdir={workdir}",
           *extra]
    if cache is not None:
        cmd.append(f"--gin_param=train.compilation_cache_dir='{cache}'")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=REPO)
    first, lines = None, []
    for line in proc.stdout:
        lines.append(line)
        if first is None and line.startswith("step "):
            first = time.perf_counter() - t0
    rc = proc.wait()
    total = time.perf_counter() - t0
    if rc != 0:
        raise RuntimeError(f"train.py exited {rc}:\n{''.join(lines[-20:])}")
    return {"first_step_s": first, "total_s": total}


def measure(repeats: int) -> dict:
    rows = {"cold": [], "warm": [], "resume": []}
    for _ in range(repeats):
        root = tempfile.mkdtemp(prefix="mmjax_startup_")
        try:
            cache = os.path.join(root, "cache")
            rows["cold"].append(timed_run(os.path.join(root, "cold"), [], cache))
            rows["warm"].append(timed_run(os.path.join(root, "warm"), [], cache))
            part = os.path.join(root, "resumed")
            timed_run(part, ["--gin_param=train.stop_after=10"], cache)
            rows["resume"].append(timed_run(part, [], cache))
        finally:
            shutil.rmtree(root, ignore_errors=True)
    return {k: {m: statistics.median(r[m] for r in v) for m in ("first_step_s", "total_s")}
            for k, v in rows.items()} | {"runs": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=os.path.join(REPO, "bench_results", "bench_startup.json"))
    a = ap.parse_args(argv)
    from rich.console import Console
    from rich.table import Table

    from mmjax.cli import write_json

    res = measure(a.repeats)
    res["machine"] = {"cpu_count": os.cpu_count(), "python": platform.python_version(),
                      "load_avg_1m": os.getloadavg()[0]}
    t = Table(title=f"scripts/train.py (tiny, 30 steps), median of {a.repeats}")
    for c in ("run", "first step s", "total s"):
        t.add_column(c)
    for k in ("cold", "warm", "resume"):
        t.add_row(k, f"{res[k]['first_step_s']:.1f}", f"{res[k]['total_s']:.1f}")
    Console(width=100).print(t)
    write_json(a.json, res)
    return 0


if __name__ == "__main__":
    from mmjax.cli import run_main
    sys.exit(run_main(main))
