#!/usr/bin/env python
"""Train an MLLM: `python scripts/train.py [--gin_file=configs/tiny.gin] [--gin_param=K=V ...]
[--workdir=DIR]`. Writes DIR/metrics.jsonl and checkpoints; resumes from DIR's newest."""
from __future__ import annotations

import argparse
import os
import sys

import gin

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_gin(files: list[str], params: list[str]) -> None:
    """Parse the gin files, then each --gin_param binding, then finalize, before any work
    (what gin.parse_config_files_and_bindings does, one piece at a time), so an error exits
    with gin's message and names the culprit: the file, or the binding as given."""
    import mmjax.data.loader  # noqa: F401  (registers the configurables)
    import mmjax.train.pipeline_step  # noqa: F401
    import mmjax.train.trainer  # noqa: F401

    for f in files:
        if not os.path.exists(f):
            sys.exit(f"error: gin file {f!r} not found (run from the repo root or pass a path)")
    # gin raises several exception types; every one means "this piece of config is bad"
    for f in files:
        try:
            gin.parse_config_file(f)
        except Exception as e:
            sys.exit(f"error: bad gin file {f}: {type(e).__name__}: {e}")
    for b in params:
        try:
            gin.parse_config(b)
        except Exception as e:
            sys.exit(f"error: bad gin binding --gin_param={b!r}: {type(e).__name__}: {e}")
    try:
        gin.finalize()
    except Exception as e:
        sys.exit(f"error: bad gin config ({', '.join(files)} + --gin_param bindings) at "
                 f"finalize: {type(e).__name__}: {e}")


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
    args = p.parse_args(argv)
    files = args.gin_file or [os.path.join(REPO, "configs", "tiny.gin")]
    params = list(args.gin_param) + ([f"train.plan = {args.plan!r}"] if args.plan else [])
    parse_gin(files, params)
    from mmjax.errors import UserError
    from mmjax.train.checkpoint import CheckpointMismatch
    from mmjax.train.trainer import TrainingStopped, train

    workdir = args.workdir or os.path.join("runs", os.path.splitext(os.path.basename(files[0]))[0])
    from mmjax.models.hf import PretrainedError
    try:
        records = train(workdir=workdir)
    except PretrainedError as e:
        sys.exit(f"error: {e}")
    except (UserError, TrainingStopped, CheckpointMismatch) as e:
        # gin appends "In call to configurable ..." on a second line: the first says it all
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2 if isinstance(e, UserError) else 1
    if records:
        print(f"done: {len(records)} steps, loss {records[0]['loss']:.4f} -> "
              f"{records[-1]['loss']:.4f}; metrics in {workdir}/metrics.jsonl")
    else:
        print(f"nothing to do: {workdir} already holds a finished run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
