"""The loader's own call path per global batch, for scripts/bench_host_plan.py's first table
(issue 41): `GlobalBatchBuilder.select` -> `MetaColumns.from_specs` -> `plan_global_batch`,
then every unit's shapes ("whole plan": all four, the issue's <= 50 ms at 2,560 x 60),
against the same path with the frozen one-candidate-at-a-time `select`
(tests/selection_reference.py), on a source whose index is columns."""
from __future__ import annotations

import os
import statistics
import sys
import time

import numpy as np
from rich.table import Table

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import selection_reference  # noqa: E402  (the frozen one-at-a-time select)

from bench_balance import MODEL  # noqa: E402
from mmjax.data.batch_plan import plan_global_batch  # noqa: E402
from mmjax.data.global_batch import GlobalBatchBuilder  # noqa: E402
from mmjax.data.loader import Loader  # noqa: E402
from mmjax.data.layout import check_shapes  # noqa: E402
from mmjax.data.sample_stream import blank_sample  # noqa: E402
from mmjax.data.spec_columns import SpecColumns, SpecTable  # noqa: E402
from mmjax.data.spec_list import meta_columns_of  # noqa: E402
from mmjax.planner.plan import Plan  # noqa: E402


class TableSource:
    """A data set of `n` records whose index is columns (`spec_table`), record i having
    pool spec i mod len(pool)."""

    def __init__(self, pool: list, n: int):
        self.pool, self.n = pool, n
        self.table = SpecTable(SpecColumns.from_specs(pool).take(np.arange(n) % len(pool)))

    def __len__(self) -> int:
        return self.n

    def spec(self, i: int):
        return self.pool[i % len(self.pool)]

    def spec_table(self) -> SpecTable:
        return self.table

    def load(self, i: int):
        """Record i as a blank sample of its spec (the bench plans, it never decodes)."""
        return blank_sample(self.spec(i), i)


def _loader_path(b: GlobalBatchBuilder, select, step: int):
    """(CPU ms of select / columns / plan / every unit's shapes, wall ms of all, output)."""
    t, w = [time.process_time()], time.perf_counter()
    idx, specs, _ = select(step)
    t.append(time.process_time())
    mc = meta_columns_of(idx, specs, b.layout.rules)
    t.append(time.process_time())
    plans = plan_global_batch(mc, b.model, b.plan, b.layout, b.policies, b.algo,
                              node_wise=b.node_wise, hardware=b.hardware)
    t.append(time.process_time())
    shapes = [{u: mp.shapes[u] for u in mp.splits} for mp in plans]
    t.append(time.process_time())
    ms = np.diff(t) * 1e3
    return [*ms.tolist(), (time.perf_counter() - w) * 1e3], (idx, plans, shapes)


LOADER_KEYS = ("select", "columns", "plan", "shapes", "wall")


def _loader_row(d, args, src, layout, policies) -> dict:
    plan = Plan.uniform(MODEL, d * args.samples_per_rank, 1, dp=d)
    b = Loader.build(src, MODEL, plan, layout, policies, post_balance_policy="sum",
                     ranks_per_node=0).builder
    _loader_path(b, b.stream.select, 0)  # warm: the index's usable mask, numba's machine code
    old = lambda step: selection_reference.select(b.stream, step)  # noqa: E731
    times = {k: {"after": [], "before": []} for k in LOADER_KEYS}
    same = True
    for r in range(args.repeats):
        ms, got = _loader_path(b, b.stream.select, r + 1)
        for k, v in zip(LOADER_KEYS, ms):
            times[k]["after"].append(v)
        if d <= args.before_loader_max_dp and r < args.before_loader_repeats:
            ms, want = _loader_path(b, old, r + 1)
            for k, v in zip(LOADER_KEYS, ms):
                times[k]["before"].append(v)
            same = same and got[0] == want[0] and got[2] == want[2] and all(
                x.positions == y.positions and all(np.array_equal(
                    x.splits[u].items, y.splits[u].items) for u in x.splits)
                for x, y in zip(got[1], want[1]))
    row = {"dp": d, "samples": plan.global_batch, "identical": same,
           "load_avg_1m": round(os.getloadavg()[0], 2)}
    for k in LOADER_KEYS:
        for side, ts in times[k].items():
            row[f"{side}_{k}"] = ({"median": statistics.median(ts), "min": min(ts)}
                                  if ts else None)
    for side in ("after", "before"):  # select -> plan; the whole plan with every shape
        for key, parts in (("loader", LOADER_KEYS[:3]), ("total", LOADER_KEYS[:4])):
            tot = [sum(times[k][side][i] for k in parts)
                   for i in range(len(times["select"][side]))]
            row[f"{side}_{key}"] = ({"median": statistics.median(tot), "min": min(tot)}
                                    if tot else None)
    return row


def run_loader(args, console, layout, pool, policies) -> list[dict]:
    if not args.raw_pool:  # a curated data set: every record usable
        pool = [s for s in pool if check_shapes(s, layout) is None]
    src = TableSource(pool, 1 << 18)
    rows = [_loader_row(d, args, src, layout, policies) for d in args.dp]
    table = Table(title=f"the loader's call path per global batch, ms of CPU (process_time), "
                        f"median (min) of {args.repeats} repeats (steps), "
                        f"{args.samples_per_rank} LAION-like samples per rank, load average "
                        f"{os.getloadavg()[0]:.1f}")
    cols = ("DP", "samples", "before: select", "before: select -> plan", "select",
            "columns", "plan", "select -> plan", "wall", "+ every unit's shapes",
            "whole plan", "same output")
    for c in cols:
        table.add_column(c, justify="right")

    def cell(v):
        return "-" if v is None else f"{v['median']:.1f} ({v['min']:.1f})"
    for r in rows:
        table.add_row(str(r["dp"]), str(r["samples"]), cell(r["before_select"]),
                      cell(r["before_loader"]), cell(r["after_select"]),
                      cell(r["after_columns"]), cell(r["after_plan"]), cell(r["after_loader"]),
                      cell(r["after_wall"]), cell(r["after_shapes"]),
                      cell(r["after_total"]), "yes" if r["identical"] else "NO")
    console.print(table)
    return rows
