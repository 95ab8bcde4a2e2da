#!/usr/bin/env python
"""Rerun every CPU row of the README's results table and print it beside the README's
figures: row, the README's figure, the figure measured now, the command that makes it.

  python scripts/reproduce_results.py --cpu [--quick] [--rows=reorder,balance]
                                      [--json=bench_results/reproduce_results.json]

Each row calls its benchmark's own functions (scripts/results_rows.py); the README's
figures are read from README.md itself (scripts/results_readme.py). Rows that need a GPU
are listed as "GPU row, not rerun". `--quick` keeps every row's setting but shrinks its
repeats and sample counts (1 start-up repeat, 40 fuzz mutations, one memory case, ...), so
its figures are rougher. Timing rows depend on the machine and its load: the JSON records
both.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "scripts"))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
from mmjax.cpu_threads import force_cpu_devices  # noqa: E402

force_cpu_devices(8)  # the results' CPU machine: 8 forced host devices (docs/results.md)

from results_readme import figures, results_table  # noqa: E402
from results_rows import ROWS, Row  # noqa: E402


def _fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.4f}" if abs(x) < 2 else f"{x:.4g}"
    return str(x)


def run_row(row: Row, readme: dict, quick: bool, verbose: bool) -> dict:
    """One row: the README's figure and, for a CPU row, the figures measured now."""
    figure, machine = readme[row.what]
    out = {"key": row.key, "what": row.what, "machine": machine, "readme_figure": figure,
           "readme_numbers": figures(row.pattern, figure), "labels": list(row.labels),
           "command": row.command, "note": row.note}
    if row.measure is None:
        return out | {"status": "GPU row, not rerun", "measured": None}
    log = io.StringIO()
    t0 = time.perf_counter()
    try:
        with contextlib.redirect_stdout(sys.stdout if verbose else log):
            measured, detail = row.measure(quick)
        status = "measured"
    except Exception as e:  # one failing benchmark must not hide the other rows
        measured, detail, status = None, {"error": f"{type(e).__name__}: {e}",
                                          "log_tail": log.getvalue()[-2000:]}, "failed"
    return out | {"status": status, "measured": measured, "detail": detail,
                  "seconds": time.perf_counter() - t0}


def measured_text(r: dict) -> str:
    if r["measured"] is None:
        return r["status"] if r["status"] != "failed" else f"failed: {r['detail']['error']}"
    return "; ".join(f"{lab} {_fmt(v) if v is not None else 'GPU, not rerun'}"
                     for lab, v in zip(r["labels"], r["measured"]))


def print_table(results: list[dict], quick: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="README results table, rerun" + (
        " (--quick: fewer repeats than the commands shown)" if quick else ""), show_lines=True)
    for c in ("row", "README", "measured now", "command"):
        t.add_column(c, overflow="fold")
    for r in results:
        t.add_row(r["what"], r["readme_figure"], measured_text(r) +
                  (f"\n({r['seconds']:.0f} s)" if "seconds" in r else ""), r["command"])
    Console(width=max(Console().width, 160)).print(t)
    for r in results:
        if r.get("note"):
            print(f"  {r['key']}: {r['note']}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true",
                    help="rerun the CPU rows (GPU rows are listed, not rerun)")
    ap.add_argument("--quick", action="store_true",
                    help="fewer repeats and samples, same settings (for tests)")
    ap.add_argument("--rows", default="", help="comma list of row keys: "
                    + ",".join(r.key for r in ROWS) + " (default all)")
    ap.add_argument("--verbose", action="store_true", help="show each benchmark's own output")
    ap.add_argument("--json", default=os.path.join(REPO, "bench_results",
                                                   "reproduce_results.json"))
    a = ap.parse_args(argv)
    if not a.cpu:
        print("error: nothing to rerun (pass --cpu: it reruns the CPU rows and lists the GPU "
              "rows)", file=sys.stderr)
        return 2
    keys = [k for k in a.rows.split(",") if k]
    unknown = sorted(set(keys) - {r.key for r in ROWS})
    if unknown:
        print(f"error: unknown --rows {','.join(unknown)} (choose from "
              f"{','.join(r.key for r in ROWS)})", file=sys.stderr)
        return 2
    from mmjax.cli import write_json
    from mmjax.host_info import machine

    readme = results_table()
    results = [run_row(r, readme, a.quick, a.verbose) for r in ROWS
               if not keys or r.key in keys]
    print_table(results, a.quick)
    write_json(a.json, {"machine": machine(), "quick": a.quick, "rows": results})
    return 1 if any(r["status"] == "failed" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
