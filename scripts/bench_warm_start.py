#!/usr/bin/env python
"""Issue 41's "compile once across runs", measured as a user meets it: two default runs of
`scripts/train.py` (the tiny config) in fresh workdirs sharing one empty compilation cache,
the first with `train.steps=--first_steps`, the second with `--second_steps` (another
length: its programs must come from the cache). Per run: seconds from launch to the first
output line (process start, imports, gin), the compile the trainer reports ("compiled ...
in X s": tracing, lowering, then XLA or the cache), and to the first `step ` line. Also
the floor no cache can answer: a process that only imports the third-party libraries a
run imports before its first step (best of 3).

The goal: the second run's first step within 10% of the first run's compile time, and
within 10 s of launch. Prints a table and writes JSON.

  python scripts/bench_warm_start.py [--first_steps 2] [--second_steps 5]
         [--json bench_results/bench_warm_start.json]
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

_COMPILED = re.compile(r"compiled the training step .* in ([0-9.]+) s")


def timed_run(workdir: str, steps: int, cache: str) -> dict:
    """One train.py run: seconds to its first line, its reported compile, its first step."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS",
                                                             "JAX_COMPILATION_CACHE_DIR")}
    env["JAX_PLATFORMS"] = "cpu"
    cmd = [sys.executable, os.path.join(REPO, "scripts", "train.py"), f"--workdir={workdir}",
           f"--gin_param=train.steps={steps}",
           f"--gin_param=train.compilation_cache_dir='{cache}'"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=REPO)
    out = {"first_line_s": None, "compile_s": None, "first_step_s": None}
    lines = []
    for line in proc.stdout:
        lines.append(line)
        now = time.perf_counter() - t0
        if out["first_line_s"] is None:
            out["first_line_s"] = now
        m = _COMPILED.search(line)
        if m and out["compile_s"] is None:
            out["compile_s"] = float(m.group(1))
        if out["first_step_s"] is None and line.startswith("step "):
            out["first_step_s"] = now
    rc = proc.wait()
    out["total_s"] = time.perf_counter() - t0
    if rc != 0:
        raise RuntimeError(f"train.py exited {rc}:\n{''.join(lines[-20:])}")
    return out


# the third-party libraries a default run imports before its first step (grain imports
# orbax), each process's floor
FLOOR = "import jax; jax.devices(); import flax.nnx, optax, numba, grain, gin, rich"


def floor_s(repeats: int = 3) -> float:
    """Best of `repeats` seconds for a process that imports `FLOOR` and exits: the part of
    any run's start no cache can answer."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", FLOOR], check=True, env=env, cwd=REPO)
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--first_steps", type=int, default=2)
    ap.add_argument("--second_steps", type=int, default=5)
    ap.add_argument("--json", default=os.path.join(REPO, "bench_results",
                                                   "bench_warm_start.json"))
    a = ap.parse_args(argv)
    from rich.console import Console
    from rich.table import Table

    from mmjax.cli import write_json
    from mmjax.host_info import machine

    root = tempfile.mkdtemp(prefix="mmjax_warm_")
    try:
        cache = os.path.join(root, "cache")
        first = timed_run(os.path.join(root, "first"), a.first_steps, cache)
        second = timed_run(os.path.join(root, "second"), a.second_steps, cache)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    floor = floor_s()
    res = {"first": first, "second": second, "imports_floor_s": floor, "machine": machine(),
           "load_avg_1m_after": os.getloadavg()[0],
           "second_first_step_over_first_compile": second["first_step_s"] / first["compile_s"],
           "second_compile_over_first_compile": second["compile_s"] / first["compile_s"],
           "floor_over_first_compile": floor / first["compile_s"]}
    t = Table(title=f"scripts/train.py (tiny): train.steps={a.first_steps}, then "
                    f"train.steps={a.second_steps} on the first run's cache (seconds)")
    for c in ("run", "first line", "compile (reported)", "first step", "total"):
        t.add_column(c, justify="right")
    for name, r in (("first (empty cache)", first), ("second (warm)", second)):
        t.add_row(name, *(f"{r[k]:.1f}" for k in ("first_line_s", "compile_s",
                                                  "first_step_s", "total_s")))
    t.add_row("imports alone (floor)", "", "", "", f"{floor:.1f}")
    Console(width=110).print(t)
    print(f"second run's first step / first run's compile: "
          f"{res['second_first_step_over_first_compile']:.1%}; compiles: "
          f"{res['second_compile_over_first_compile']:.1%}; a process importing the "
          f"libraries alone: {res['floor_over_first_compile']:.1%}")
    write_json(a.json, res)
    return 0


if __name__ == "__main__":
    from mmjax.cli import run_main
    sys.exit(run_main(main))
