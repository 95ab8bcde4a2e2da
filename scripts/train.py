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
    """Parse gin files and bindings before any work; exit 2 with gin's message and the
    file name on an error."""
    import mmjax.data.loader  # noqa: F401  (registers the configurables)
    import mmjax.train.pipeline_step  # noqa: F401
    import mmjax.train.trainer  # noqa: F401

    for f in files:
        if not os.path.exists(f):
            sys.exit(f"error: gin file {f!r} not found (run from the repo root or pass a path)")
    try:
        gin.parse_config_files_and_bindings(files, params)
    except Exception as e:  # gin raises several types; all mean "bad config"
        where = ", ".join(files) or "--gin_param"
        sys.exit(f"error: bad gin config in {where}: {type(e).__name__}: {e}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--gin_file", action="append", default=None,
                   help="gin file (repeatable); default configs/tiny.gin")
    p.add_argument("--gin_param", action="append", default=[], help="gin binding K=V (repeatable)")
    p.add_argument("--workdir", default=None, help="output directory (default runs/<gin name>)")
    p.add_argument("--plan", default=None,
                   help="Plan JSON (scripts/plan.py --json) or 'manual' (manual_plan.* in gin): "
                        "run on the pipeline runtime over all devices")
    args = p.parse_args(argv)
    files = args.gin_file or [os.path.join(REPO, "configs", "tiny.gin")]
    params = list(args.gin_param) + ([f"train.plan = {args.plan!r}"] if args.plan else [])
    parse_gin(files, params)
    from mmjax.train.trainer import train

    workdir = args.workdir or os.path.join("runs", os.path.splitext(os.path.basename(files[0]))[0])
    records = train(workdir=workdir)
    if records:
        print(f"done: {len(records)} steps, loss {records[0]['loss']:.4f} -> "
              f"{records[-1]['loss']:.4f}; metrics in {workdir}/metrics.jsonl")
    else:
        print(f"nothing to do: {workdir} already holds a finished run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
