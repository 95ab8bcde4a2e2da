"""Host planning time of one global batch (issue 41: linear in the batch) at OrchMLLM Table 2
scales (DP ranks x 60 LAION-like samples, every unit LLM / vision / audio on its own DP
ranks, "orchmllm" post-balancing "sum", packed 4096-token rows).

First table, the loader's own call path (`GlobalBatchBuilder.__call__` up to its feeds):
`select` (the step's window of the seeded stream: indices, shapes, usable checks) ->
`MetaColumns.from_specs` -> `plan_global_batch` (costs -> balancing -> packing), then
every unit's shapes (what `--check` and the feeds compute), on a source whose index is
columns (`spec_table()`, as `ArrayRecordSource` and the LLaVA / WebDataset sources: a
data set of 2**18 records drawn from a pool of LAION-like specs; `--raw_pool` keeps the
pool's unusable specs, ~7% too long, whose reasons are per-sample work); "before" is the
same path with the frozen one-candidate-at-a-time `select` (tests/selection_reference.py)
and specs as lists. CPU time (process_time, the machine is shared; the load average is
printed), median (min) of repeats, each repeat a new step; the outputs are checked
identical (indices, plans, every unit's shapes).

Second table, the plan from a list of specs alone:

Columns: "after", the whole call from the specs (`from_specs` + `plan_global_batch` on the
columns), and its parts "columns from specs" and "plan" (each unit's shapes computed when
read: the loader's feeds compute their own; "plan + every unit's shapes" is the plan as it
was before, every shape computed); "objects", the loader's path
before the columnar metadata (a `SampleMeta` per sample, `TokenRules.meta_from_shapes`,
then `plan_global_batch` on the list); "pre-issue-41", that object path with the per-sample
costs and quadratic packers (tests/packing_reference.py: `unit_costs`, `batch_shapes` with
rows first fit decreasing by the quadratic scan) on the same splits, only up to
--before_max_dp (it grows as n x bins); the outputs are checked identical (columns vs
objects always, vs pre-issue-41 where it ran). Also the plan's stages: the metadata
columns (`shape_columns`), balancing (`split_unit` per unit), shapes (`rank_shapes` per
unit).

  python scripts/bench_host_plan.py [--dp 64 256 2560] [--json bench_results/bench_host_plan.json]
      [--loader_only] [--raw_pool] [--before_loader_max_dp 2560]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
from rich.console import Console
from rich.table import Table

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(_HERE, "..", "tests"))
sys.path.insert(0, _HERE)
import packing_reference as before  # noqa: E402  (the frozen pre-issue-41 path)
from bench_loader_path import run_loader  # noqa: E402

from bench_balance import MODEL  # noqa: E402
from bench_data import BENCH_CFG  # noqa: E402
from mmjax.data.batch_plan import (NodeWise, plan_global_batch,  # noqa: E402
                                   post_balance_policies, split_unit, unit_policies)
from mmjax.data.batch_shapes import rank_shapes  # noqa: E402
from mmjax.data.layout import AssemblyLayout  # noqa: E402
from mmjax.data.meta_columns import MetaColumns  # noqa: E402
from mmjax.data.shape_columns import shape_columns  # noqa: E402
from mmjax.data.synthetic import SyntheticDataset  # noqa: E402
from mmjax.data.spec_list import meta_columns_of  # noqa: E402
from mmjax.host_info import machine  # noqa: E402
from mmjax.planner.plan import Plan  # noqa: E402


def _ms(fn):
    t = time.perf_counter()
    out = fn()
    return (time.perf_counter() - t) * 1e3, out


def _before(metas, plan, layout, policies, algos, node_wise):
    """The pre-issue-41 plan (one microbatch): per-sample costs, the same splits, then the
    per-sample quadratic shapes of every unit's rank groups."""
    costs = before.unit_costs(metas, MODEL)
    splits = {u: split_unit(costs[u], plan.unit(u).dp, policies[u], algos[u], node_wise)
              for u in MODEL.unit_names}
    slots = {slot.name: slot.modality for slot in layout.encoders}

    def groups(u, s):  # a unit with nothing of its modality: an empty batch (unit_shapes.py)
        g = [[metas[p] for p in grp] for grp in s.lists()]
        if u in slots and not any(seg.modality == slots[u] for grp in g for m in grp
                                  for seg in m.segments):
            g = [[] for _ in g]
        return g
    return splits, {u: before.batch_shapes(groups(u, s), layout, before.pack_rows_decreasing)
                    for u, s in splits.items()}


def _stages(metas: MetaColumns, plan, layout, policies, algos, node_wise):
    t0 = time.perf_counter()
    cols = shape_columns(metas, layout, tuple(e.modality for e in MODEL.encoders))
    t1 = time.perf_counter()
    splits = {u: split_unit(cols_cost, plan.unit(u).dp, policies[u], algos[u], node_wise)
              for u, cols_cost in _costs(cols).items()}
    t2 = time.perf_counter()
    for s in splits.values():
        rank_shapes(cols, s.items, s.counts, layout)
    t3 = time.perf_counter()
    return {"columns": (t1 - t0) * 1e3, "balancing": (t2 - t1) * 1e3, "shapes": (t3 - t2) * 1e3}


def _costs(cols):
    from mmjax.data.batch_plan import unit_costs
    return unit_costs([], MODEL, cols)


def _same(a, b) -> bool:
    return all(x.positions == y.positions and x.shapes == y.shapes and all(
        np.array_equal(x.splits[u].items, y.splits[u].items)
        and np.array_equal(x.splits[u].counts, y.splits[u].counts) for u in x.splits)
        for x, y in zip(a, b)) and len(a) == len(b)


def _row(d, args, pool, rng, layout, policies, algos, node_wise) -> dict:
    rules = layout.rules
    pick = rng.choice(args.pool, d * args.samples_per_rank)
    ids, specs = pick.tolist(), [pool[i] for i in pick]
    plan = Plan.uniform(MODEL, len(ids), 1, dp=d)

    def planned(metas):
        return plan_global_batch(metas, MODEL, plan, layout, policies, algos,
                                 node_wise=node_wise)

    def after():  # the loader's call: columns from the specs, the plan from the columns
        return planned(meta_columns_of(ids, specs, rules))

    def objects():
        return planned([rules.meta_from_shapes(i, s) for i, s in zip(ids, specs)])

    got = after()  # warm: numba's cached machine code loaded once per process
    row = {"dp": d, "samples": len(ids), "identical": _same(got, objects())}
    do_before = d <= args.before_max_dp
    if do_before:
        metas = [rules.meta_from_shapes(i, s) for i, s in zip(ids, specs)]
        splits, shapes = _before(metas, plan, layout, policies, algos, node_wise)
        row["identical"] = row["identical"] and bool(shapes == got[0].shapes and all(
            np.array_equal(splits[u].items, got[0].splits[u].items) and
            np.array_equal(splits[u].counts, got[0].splits[u].counts) for u in splits))
    def every_shape(mc):  # the plan as it was before its shapes were lazy: all units' shapes
        plans = planned(mc)
        for mp in plans:
            for u in mp.splits:
                mp.shapes[u]  # noqa: B018
        return plans

    keys = ("after", "from_specs", "plan", "plan_all_shapes", "objects", "before", "columns",
            "balancing", "shapes")
    times = {k: [] for k in keys}
    for _ in range(args.repeats):  # interleaved: every column sees the same load
        times["after"].append(_ms(after)[0])
        t, mc = _ms(lambda: meta_columns_of(ids, specs, rules))
        times["from_specs"].append(t)
        times["plan"].append(_ms(lambda: planned(mc))[0])
        times["plan_all_shapes"].append(_ms(lambda: every_shape(mc))[0])
        for k, v in _stages(mc, plan, layout, policies, algos, node_wise).items():
            times[k].append(v)
        if not args.skip_objects:
            times["objects"].append(_ms(objects)[0])
        if do_before:
            times["before"].append(_ms(lambda: _before(
                [rules.meta_from_shapes(i, s) for i, s in zip(ids, specs)], plan, layout,
                policies, algos, node_wise))[0])
    for k, ts in times.items():
        row[k] = {"median": statistics.median(ts), "min": min(ts)} if ts else None
    return row


def run(args, console) -> list[dict]:
    layout = AssemblyLayout.from_config(MODEL, args.seq_len, "pack")
    ds = SyntheticDataset("laion", BENCH_CFG, seed=args.seed)
    pool = [ds.spec(i) for i in range(args.pool)]
    rng = np.random.default_rng(args.seed)
    policies, algos = unit_policies("orchmllm", MODEL), post_balance_policies("sum", MODEL)
    loader_rows = run_loader(args, console, layout, pool, policies)
    if args.loader_only:
        return loader_rows, []
    rows = []
    for d in args.dp:
        rows.append(_row(d, args, pool, rng, layout, policies, algos, NodeWise(0)))
        console.print(rows[-1])
    table = Table(title=f"host plan of one global batch from the source's specs, ms (wall), "
                        f"median (min) of {args.repeats} interleaved repeats, "
                        f"{args.samples_per_rank} LAION-like samples per rank, LLM / vision "
                        f"/ audio each on DP ranks")
    cols = ("DP", "samples", "pre-issue-41", "objects", "after (specs -> plan)",
            "objects / after", "columns from specs", "plan", "plan + every unit's shapes",
            "metadata columns",
            "balancing", "shapes", "same output")
    for c in cols:
        table.add_column(c, justify="right")

    def cell(v):
        return "-" if v is None else f"{v['median']:.1f} ({v['min']:.1f})"
    for r in rows:
        ratio = (f"{r['objects']['median'] / r['after']['median']:.1f}x"
                 if r["objects"] else "-")
        table.add_row(str(r["dp"]), str(r["samples"]), cell(r["before"]), cell(r["objects"]),
                      cell(r["after"]), ratio, cell(r["from_specs"]), cell(r["plan"]),
                      cell(r["plan_all_shapes"]), cell(r["columns"]), cell(r["balancing"]),
                      cell(r["shapes"]),
                      "yes" if r["identical"] else "NO")
    console.print(table)
    return loader_rows, rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dp", type=int, nargs="+", default=[64, 256, 2560])
    ap.add_argument("--samples_per_rank", type=int, default=60)
    ap.add_argument("--before_max_dp", type=int, default=256)
    ap.add_argument("--seq_len", type=int, default=4096)
    ap.add_argument("--pool", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip_objects", action="store_true",
                    help="leave out the object path's timing (seconds a repeat at 2560)")
    ap.add_argument("--loader_only", action="store_true",
                    help="only the first table (the loader's call path)")
    ap.add_argument("--raw_pool", action="store_true",
                    help="keep the pool's unusable specs (their reasons are per sample)")
    ap.add_argument("--before_loader_max_dp", type=int, default=2560)
    ap.add_argument("--before_loader_repeats", type=int, default=2)
    ap.add_argument("--json", default="bench_results/bench_host_plan.json")
    args = ap.parse_args(argv)
    console = Console(width=max(Console().width, 160))
    results = {"config": vars(args), "machine": machine()}
    console.print(f"machine: {results['machine']}")
    results["loader_rows"], results["rows"] = run(args, console)
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(results, f, indent=2, default=float)
    console.print(f"wrote {args.json}")
    return results


if __name__ == "__main__":
    main()
