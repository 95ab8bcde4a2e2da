#!/usr/bin/env python
"""Train an MLLM: `python scripts/train.py [--gin_file=configs/tiny.gin] [--gin_param=K=V ...]
[--workdir=DIR] [--plan=...]`. Writes DIR/metrics.jsonl and checkpoints; resumes from DIR's newest."""
from __future__ import annotations

import contextlib
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from mmjax.cli import (ArgumentParser, add_debug_flag, parse_gin,  # noqa: E402
                       refuse_unused_bindings, run_main)
from mmjax.cpu_threads import reserve_cpu_threads  # noqa: E402


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


def check_flags(args) -> None:
    """The flags' own values, before gin: an empty --plan / --workdir / --trace_steps is
    an error, not the default."""
    from mmjax.errors import UserError

    for flag in ("plan", "workdir", "trace_steps"):
        value = getattr(args, flag)
        if value is not None and not value.strip():
            raise UserError(f"--{flag}={value!r}: empty (give a value or leave the flag out)")
    for b in args.gin_param:
        if not b.strip() or "=" not in b or not b.split("=", 1)[1].strip():
            raise UserError(f"--gin_param={b!r}: give a binding configurable.parameter = "
                            f"value")
    if args.workdir is not None and os.path.exists(args.workdir) and \
            not os.path.isdir(args.workdir):
        raise UserError(f"--workdir={args.workdir!r}: is a file (give a directory)")


@contextlib.contextmanager
def removed_if_refused(workdir: str):
    """A run refused with a user error leaves nothing: a workdir it created is removed,
    unless a step was trained (metrics or a checkpoint written: work is never deleted)."""
    import shutil

    from mmjax.cli import user_error_types

    existed = os.path.exists(workdir)
    try:
        yield
    except user_error_types():
        ckpts = os.path.join(workdir, "checkpoints")
        metrics = os.path.join(workdir, "metrics.jsonl")
        trained = (os.path.isdir(ckpts) and os.listdir(ckpts)) or (
            os.path.exists(metrics) and os.path.getsize(metrics))
        if not existed and not trained:
            shutil.rmtree(workdir, ignore_errors=True)
        raise


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__)
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
    p.add_argument("--check", action="store_true",
                   help="check the settings, the plan and the first global batch, then exit "
                        "(0: the run would start; 2: one line saying what is wrong); writes "
                        "nothing")
    add_debug_flag(p)
    args = p.parse_args(argv)
    reserve_cpu_threads()  # before any backend starts: XLA:CPU's pool fits forced devices
    check_flags(args)
    files = args.gin_file or [os.path.join(REPO, "configs", "tiny.gin")]
    refuse_unused_bindings(args.gin_param, args.plan)
    params = list(args.gin_param) + ([f"train.plan = {args.plan!r}"] if args.plan else [])
    if args.trace_steps is not None:
        params.append(f"train.trace_steps = {args.trace_steps!r}")
    parse_gin(files, params)
    from mmjax.errors import first_line
    from mmjax.train.preemption import EXIT_INTERRUPTED, EXIT_PREEMPTED, Preempted
    from mmjax.train.run_spec import RunSpec
    from mmjax.train.trainer import TrainingStopped, train

    workdir = args.workdir or os.path.join("runs", os.path.splitext(os.path.basename(files[0]))[0])
    try:
        with removed_if_refused(workdir):
            records = train(workdir, spec=RunSpec.from_gin(dry_run=args.check))
    except TrainingStopped as e:  # not bad input: the run itself went wrong (exit 1)
        print(f"error: {first_line(e)}", file=sys.stderr)
        return 1
    except Preempted as e:  # SIGTERM / SIGINT: checkpoint written, rerun to resume
        import jax

        if jax.process_index() == 0:  # its first line: gin appends "In call to ..."
            print(f"preempted: {first_line(e)}", file=sys.stderr)
        return EXIT_PREEMPTED
    except KeyboardInterrupt:  # Ctrl-C before the loop's handler (set-up) or after it
        print("interrupted (Ctrl-C): stopped at once, outside a step; rerun the same command "
              "to resume from the last checkpoint (or start, if none was written)",
              file=sys.stderr)
        return EXIT_INTERRUPTED
    if args.check:
        print("check: the settings, the plan and the first global batch are good; "
              "nothing written")
        return 0
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
