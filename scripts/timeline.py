"""Render a pipeline trace as a Chrome/Perfetto trace JSON and a PNG Gantt chart.

A trace is a JSON list of {stage, kind, microbatch, chunk, start, end} (stage like
"llm:0", times in seconds): what the runtime's tracing mode and `SimResult.trace()` emit.
The chart has one row per stage, F and B in different colours (darker for later model
chunks) and the microbatch id in each box, like the pipeline figures of the papers
(Cornstarch Fig. 6-7; Megatron-LM's 1F1B, Narayanan et al., 2021, §2.2).

    python scripts/timeline.py run/trace.json                 # -> run/trace.perfetto.json, .png
    python scripts/timeline.py --simulate --schedule=1f1b --stages=4 --microbatches=8
    python scripts/timeline.py --simulate --schedule=interleaved --stages=4 \
        --microbatches=8 --chunks=2
    python scripts/timeline.py --simulate --schedule=multimodal --encoders=vision:1,audio:2 \
        --llm=2 --generator=1 --frozen=vision,llm --microbatches=6
In --simulate mode the simulated trace is also written (PREFIX.trace.json).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import to_rgb  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from mmjax.models.units import UnitRole, role  # noqa: E402
from mmjax.schedule.stage_graph import StageGraph  # noqa: E402
from mmjax.schedule.schedule import (gpipe, interleaved_one_f_one_b,  # noqa: E402
                                     multimodal_one_f_one_b, one_f_one_b)
from mmjax.schedule.simulate import frozen_aware_costs, simulate  # noqa: E402

FIELDS = ("stage", "kind", "microbatch", "chunk", "start", "end")
COLOURS = {"F": "#4C72B0", "B": "#DD8452"}


# ---- reading ------------------------------------------------------------------------------
def check_trace(trace) -> list[dict]:
    """The trace as a list of dicts with the six fields; ValueError naming the bad entry."""
    if not isinstance(trace, list):
        raise ValueError("a trace is a JSON list of {stage, kind, microbatch, chunk, start, "
                         f"end}} objects, got {type(trace).__name__}")
    for i, d in enumerate(trace):
        if not isinstance(d, dict) or set(FIELDS) - set(d):
            raise ValueError(f"trace entry #{i} {d!r} needs the fields {FIELDS}")
        if d["kind"] not in COLOURS:
            raise ValueError(f"trace entry #{i}: kind={d['kind']!r}, must be 'F' or 'B'")
        if not d["end"] >= d["start"]:
            raise ValueError(f"trace entry #{i}: end={d['end']} < start={d['start']}")
    return trace


def load_trace(path: str) -> list[dict]:
    """A trace list, or the trainer's `traces/step_<n>.json` ({model, plan, trace})."""
    with open(path) as f:
        data = json.load(f)
    if isinstance(data, dict) and "trace" in data:
        data = data["trace"]
    return check_trace(data)


def stage_rows(trace: list[dict]) -> list[str]:
    """Stages top to bottom: encoder branches (in order of first appearance), then the
    llm, then the generator; stages of one unit by index."""
    first: dict[str, int] = {}
    for d in trace:
        first.setdefault(d["stage"].rpartition(":")[0] or d["stage"], len(first))

    def key(stage: str):
        unit, _, idx = stage.rpartition(":")
        unit = unit or stage
        group = list(UnitRole).index(role(unit))  # encoders, then the LLM, the generator
        return group, first[unit], int(idx) if idx.isdigit() else 0, stage
    return sorted({d["stage"] for d in trace}, key=key)


# ---- writing ------------------------------------------------------------------------------
def to_chrome(trace: list[dict]) -> dict:
    """Chrome trace-event format (chrome://tracing, ui.perfetto.dev): one thread per stage,
    one complete ("X") event per action, times in microseconds."""
    rows = {s: i for i, s in enumerate(stage_rows(trace))}
    t0 = min((d["start"] for d in trace), default=0.0)
    events = [{"name": "process_name", "ph": "M", "pid": 0,
               "args": {"name": "mmjax pipeline"}}]
    for s, i in rows.items():
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": i,
                       "args": {"name": s}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": i,
                       "args": {"sort_index": i}})
    for d in trace:
        label = f"{d['kind']}{d['microbatch']}" + (f".{d['chunk']}" if d["chunk"] else "")
        events.append({"name": label, "cat": "forward" if d["kind"] == "F" else "backward",
                       "ph": "X", "pid": 0, "tid": rows[d["stage"]],
                       "ts": (d["start"] - t0) * 1e6, "dur": (d["end"] - d["start"]) * 1e6,
                       "args": {"microbatch": d["microbatch"], "chunk": d["chunk"]}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _shade(kind: str, chunk: int, num_chunks: int):
    """Later model chunks darker, so interleaved schedules read like Megatron's figure."""
    r, g, b = to_rgb(COLOURS[kind])
    k = 0.55 * chunk / max(num_chunks - 1, 1)
    return (r * (1 - k), g * (1 - k), b * (1 - k))


def render_png(trace: list[dict], path: str, title: str = "") -> None:
    rows = stage_rows(trace)
    index = {s: i for i, s in enumerate(rows)}
    t0 = min(d["start"] for d in trace)
    span = max(d["end"] for d in trace) - t0 or 1.0
    num_chunks = 1 + max(d["chunk"] for d in trace)
    width_in = 14.0
    fig, ax = plt.subplots(figsize=(width_in, 0.55 * len(rows) + 1.4))
    for d in trace:
        x, w = d["start"] - t0, d["end"] - d["start"]
        y = index[d["stage"]]
        ax.broken_barh([(x, w)], (y - 0.4, 0.8), facecolors=_shade(d["kind"], d["chunk"],
                                                                   num_chunks),
                       edgecolor="black", linewidth=0.5)
        label = str(d["microbatch"]) + (f".{d['chunk']}" if num_chunks > 1 else "")
        box_pt = w / span * width_in * 0.8 * 72  # box width in points (axes ~80% wide)
        size = min(9.0, box_pt / (0.65 * len(label) + 0.4))
        if size >= 3.5:
            ax.text(x + w / 2, y, label, ha="center", va="center", fontsize=size,
                    color="white" if d["chunk"] else "black")
    ax.set_yticks(range(len(rows)), rows)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlim(0, span)
    ax.set_xlabel("time (s)")
    handles = [Patch(color=_shade(k, c, num_chunks),
                     label=("forward" if k == "F" else "backward")
                     + (f" chunk {c}" if num_chunks > 1 else ""))
               for k in ("F", "B") for c in range(num_chunks)]
    height_in = fig.get_size_inches()[1]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), frameon=False)
    if title:
        ax.set_title(title)
    fig.tight_layout(rect=(0, 0.4 / height_in, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def summary(trace: list[dict]) -> str:
    t0 = min(d["start"] for d in trace)
    span = max(d["end"] for d in trace) - t0
    lines = [f"iteration time {span:.6g} s"]
    for s in stage_rows(trace):
        busy = sum(d["end"] - d["start"] for d in trace if d["stage"] == s)
        lines.append(f"  {s:<14} busy {busy:.6g} s  bubble "
                     f"{1 - busy / span if span else 0.0:.1%}")
    return "\n".join(lines)


# ---- --simulate -----------------------------------------------------------------------------
def _parse_encoders(text: str) -> dict[str, int]:
    out = {}
    for item in filter(None, text.split(",")):
        name, _, n = item.partition(":")
        if not n.isdigit():
            raise ValueError(f"--encoders item {item!r}: write NAME:STAGES, e.g. vision:2")
        out[name] = int(n)
    return out


def simulated_trace(args) -> tuple[list[dict], str]:
    """Build the requested schedule, simulate it with --forward/--backward seconds per
    action (split over chunks), and return (trace, title)."""
    f, b = args.forward, args.backward
    if args.schedule == "multimodal":
        encoders = _parse_encoders(args.encoders)
        frozen = set(filter(None, args.frozen.split(",")))
        units = [*encoders, "llm", *(["generator"] if args.generator else [])]
        unknown = sorted(frozen - set(units))
        if unknown:
            raise ValueError(f"--frozen names unknown units {unknown}; units are {units}")
        graph = StageGraph.from_units(encoders, args.llm, args.generator,
                                      {u: u not in frozen for u in units})
        sched = multimodal_one_f_one_b(graph, args.microbatches)
        # Cornstarch §4.2: B = 2F trainable, 1F input-only, 0 none (scaled by --backward)
        costs = {k: v * (b / (2 * f)) if k[1] == "B" else v
                 for k, v in frozen_aware_costs(graph, {s: f for s in graph.stages}).items()}
        result = simulate(sched, costs, graph, comm=args.comm)
        title = (f"unit-DAG 1F1B, encoders {encoders}, llm {args.llm}, generator "
                 f"{args.generator}, frozen {sorted(frozen) or 'none'}, m={args.microbatches}")
    else:
        p, m, v = args.stages, args.microbatches, args.chunks
        if args.schedule == "gpipe":
            sched, v = gpipe(p, m), 1
        elif args.schedule == "1f1b":
            sched, v = one_f_one_b(p, m), 1
        else:
            sched = interleaved_one_f_one_b(p, m, v)
        result = simulate(sched, lambda s, a: (f if a.kind == "F" else b) / v,
                          comm=args.comm)
        title = f"{args.schedule}, p={p}, m={m}" + (f", v={v}" if v > 1 else "")
    return result.trace(), f"{title}: iteration {result.iteration_time:.4g} s"


def main(argv=None) -> dict[str, str]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace", nargs="?", help="trace JSON (list of action dicts)")
    ap.add_argument("--out", help="output prefix (default: the trace path without .json, "
                    "or bench_results/timeline_<schedule> with --simulate)")
    ap.add_argument("--simulate", action="store_true", help="simulate a schedule instead")
    ap.add_argument("--schedule", default="1f1b",
                    choices=["gpipe", "1f1b", "interleaved", "multimodal"])
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--chunks", type=int, default=2, help="model chunks (interleaved)")
    ap.add_argument("--forward", type=float, default=1.0, help="seconds per forward")
    ap.add_argument("--backward", type=float, default=2.0, help="seconds per backward")
    ap.add_argument("--comm", type=float, default=0.0, help="inter-stage latency (s)")
    ap.add_argument("--encoders", default="vision:1,audio:1", help="NAME:STAGES,...")
    ap.add_argument("--llm", type=int, default=2, help="llm stages (multimodal)")
    ap.add_argument("--generator", type=int, default=0, help="generator stages (multimodal)")
    ap.add_argument("--frozen", default="", help="frozen units, comma separated")
    args = ap.parse_args(argv)

    written = {}
    if args.simulate:
        trace, title = simulated_trace(args)
        prefix = args.out or os.path.join("bench_results", f"timeline_{args.schedule}")
        os.makedirs(os.path.dirname(prefix) or ".", exist_ok=True)
        written["trace"] = prefix + ".trace.json"
        with open(written["trace"], "w") as fh:
            json.dump(trace, fh)
    else:
        if not args.trace:
            ap.error("give a trace JSON path, or --simulate")
        trace = load_trace(args.trace)
        title = os.path.basename(args.trace)
        prefix = args.out or (args.trace[:-5] if args.trace.endswith(".json") else args.trace)
        os.makedirs(os.path.dirname(prefix) or ".", exist_ok=True)
    if not trace:
        raise ValueError("the trace is empty: nothing to draw")
    written["chrome"] = prefix + ".perfetto.json"
    with open(written["chrome"], "w") as fh:
        json.dump(to_chrome(trace), fh)
    written["png"] = prefix + ".png"
    render_png(trace, written["png"], title)
    print(title)
    print(summary(trace))
    for k, v in written.items():
        print(f"wrote {k}: {v}")
    return written


if __name__ == "__main__":
    from mmjax.cli import run_main

    sys.exit(run_main(main))
