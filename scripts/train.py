#!/usr/bin/env python
"""Train an MLLM: `python scripts/train.py [--gin_file=configs/tiny.gin] [--gin_param=K=V ...]
[--workdir=DIR] [--plan=...]`. Writes DIR/metrics.jsonl and checkpoints; resumes from DIR's newest."""
from __future__ import annotations

import argparse
import contextlib
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from mmjax.cli import add_debug_flag, parse_gin, refuse_unused_bindings, run_main  # noqa: E402


def render_traces(workdir: str, trace_steps: str) -> list[str]:
    """Each traced step's timeline (scripts/timeline.py): PNG + Perfetto JSON beside it;
    -> the PNGs' paths."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "timeline", os.path.join(REPO, "scripts", "timeline.py"))
    timeline = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(timeline)
    a, b = (int(x) for x in trace_steps.split(":"))
    pngs = []
    for n in range(a, b + 1):
        path = os.path.join(workdir, "traces", f"step_{n}.json")
        if os.path.exists(path):
            with contextlib.redirect_stdout(sys.stderr):
                pngs.append(timeline.main([path])["png"])
    return pngs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--gin_file", action="append", default=None,
                   help="gin file (repeatable); default configs/tiny.gin")
    p.add_argument("--gin_param", action="append", default=[], help="gin binding K=V (repeatable)")
    p.add_argument("--workdir", default=None, help="output directory (default runs/<gin name>)")
    p.add_argument("--plan", default=None,
                   help="Plan JSON (scripts/plan.py --json), 'manual' (manual_plan.* in gin) or "
                        "'auto' (plan at start-up for the devices present and the run's data): "
                        "run on the pipeline runtime over all devices")
    p.add_argument("--trace_steps", default=None, metavar="A:B",
                   help="with --plan: run steps A..B (1-based, inclusive) traced, writing "
                        "DIR/traces/step_<n>.json (every stage action's start and end) and "
                        "its timeline, step_<n>.png (Gantt chart) and step_<n>.perfetto.json")
    add_debug_flag(p)
    args = p.parse_args(argv)
    files = args.gin_file or [os.path.join(REPO, "configs", "tiny.gin")]
    refuse_unused_bindings(args.gin_param, args.plan)
    params = list(args.gin_param) + ([f"train.plan = {args.plan!r}"] if args.plan else [])
    if args.trace_steps:
        params.append(f"train.trace_steps = {args.trace_steps!r}")
    parse_gin(files, params)
    from mmjax.train.trainer import TrainingStopped, train

    workdir = args.workdir or os.path.join("runs", os.path.splitext(os.path.basename(files[0]))[0])
    try:
        records = train(workdir=workdir)
    except TrainingStopped as e:  # not bad input: the run itself went wrong (exit 1)
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 1
    if args.trace_steps:
        render_traces(workdir, args.trace_steps)
    if records:
        print(f"done: {len(records)} steps, loss {records[0]['loss']:.4f} -> "
              f"{records[-1]['loss']:.4f}; metrics in {workdir}/metrics.jsonl")
    else:
        print(f"nothing to do: {workdir} already holds a finished run")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
