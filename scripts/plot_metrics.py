#!/usr/bin/env python
"""Plot the loss curves of one or several runs (their metrics.jsonl) into one PNG:

  python scripts/plot_metrics.py runs/tiny                # -> runs/tiny/loss_curves.png
  python scripts/plot_metrics.py runs/a runs/b --out=compare.png

Loss, lm loss, diffusion loss and eval loss against step (above) and the learning rate
(below); a training run writes the same picture to DIR/loss.png at each checkpoint (this
script never writes over that file: the default is DIR/loss_curves.png, or
loss_curves.png here for several runs).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mmjax.errors import UserError  # noqa: E402
from mmjax.train.loss_plot import plot_runs, read_metrics  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="workdirs (or metrics.jsonl files)")
    ap.add_argument("--out", default=None,
                    help="PNG path (default: RUN/loss_curves.png for one run, "
                         "loss_curves.png for several; never a run's own loss.png)")
    a = ap.parse_args(argv)
    runs = {}
    for r in a.runs:
        path = os.path.join(r, "metrics.jsonl") if os.path.isdir(r) else r
        if not os.path.isfile(path):
            raise UserError(f"{r}: no metrics.jsonl (pass a scripts/train.py workdir)")
        rows = read_metrics(path)
        if not rows:
            raise UserError(f"{path} is empty (the run has not finished a step yet)")
        runs[r.rstrip("/")] = rows
    out = a.out or (os.path.join(a.runs[0], "loss_curves.png") if len(a.runs) == 1
                    and os.path.isdir(a.runs[0]) else "loss_curves.png")
    owned = {os.path.realpath(os.path.join(r if os.path.isdir(r) else os.path.dirname(r)
                                           or ".", "loss.png")) for r in a.runs}
    if os.path.realpath(out) in owned:
        raise UserError(f"--out={out}: the run's own loss.png (rewritten at each checkpoint)"
                        f": pass another path, e.g. --out=loss_curves.png")
    print(f"wrote {plot_runs(runs, out)}")
    return 0


if __name__ == "__main__":
    from mmjax.cli import run_main

    sys.exit(run_main(main))
