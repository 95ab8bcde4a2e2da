"""The loss curve as a picture: `DIR/loss.png` from `DIR/metrics.jsonl` (loss, lm loss,
diffusion loss and eval loss against step above, the learning rate below), for one run or
several side by side (scripts/plot_metrics.py). matplotlib, Agg backend (no display)."""
from __future__ import annotations

import json
import math
import os

CURVES = ("loss", "lm_loss", "diffusion_loss", "eval_loss")


def read_metrics(path: str) -> list[dict]:
    """The rows of a metrics.jsonl (a workdir is taken as its metrics.jsonl)."""
    if os.path.isdir(path):
        path = os.path.join(path, "metrics.jsonl")
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of `key` over the rows holding a finite value of it. diffusion_loss
    is exactly 0 on a step whose global batch generated no image (no term, not a perfect
    one): those steps are left out, so a run without a generator has no curve and one that
    generates now and then no saw-tooth down to 0."""
    pts = [(r["step"], float(r[key])) for r in rows
           if key in r and r[key] is not None and math.isfinite(float(r[key]))]
    if key == "diffusion_loss":
        pts = [(s, v) for s, v in pts if v != 0.0]
    return [s for s, _ in pts], [v for _, v in pts]


def plot_runs(runs: dict[str, list[dict]], out: str) -> str:
    """Write the PNG of `runs` {label: metrics rows} to `out` (atomically); -> `out`."""
    fig = figure(runs)
    tmp = out + ".tmp.png"
    fig.savefig(tmp, dpi=100)
    os.replace(tmp, out)
    return out


def figure(runs: dict[str, list[dict]]):
    """The matplotlib Figure: losses against step above (one line per curve and run, the
    label "<run>: <curve>" with several runs, else "<curve>"), learning rate below."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 6), constrained_layout=True)
    ax, lr = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    several = len(runs) > 1
    for label, rows in runs.items():
        for key in CURVES:
            x, y = series(rows, key)
            if x:
                ax.plot(x, y, marker="o" if key == "eval_loss" else None, markersize=3,
                        label=f"{label}: {key}" if several else key)
        x, y = series(rows, "learning_rate")
        lr.plot(x, y, label=label if several else None)
    ax.set_ylabel("loss")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    lr.set_ylabel("learning rate")
    lr.set_xlabel("step")
    lr.grid(alpha=0.3)
    if several:
        lr.legend(fontsize=8)
    return fig


def plot_workdir(workdir: str) -> int | None:
    """Write `workdir`/loss.png from its metrics.jsonl; -> the last step plotted (None: no
    rows yet, nothing written)."""
    path = os.path.join(workdir, "metrics.jsonl")
    rows = read_metrics(path) if os.path.exists(path) else []
    if not rows:
        return None
    plot_runs({workdir: rows}, os.path.join(workdir, "loss.png"))
    return int(rows[-1]["step"])
