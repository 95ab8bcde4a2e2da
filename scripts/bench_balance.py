"""Post-balancing and node-wise rearrangement compute time (OrchMLLM §5.1 / App. A
policies, §5.2.2 node-wise rearrangement).

Part 1: each policy at OrchMLLM Table 2 scales (DP 64 ... 2560, 60 LAION-like LLM sequence
lengths per rank), CPU time (process_time), median and min of interleaved repeats (every
column sees the same machine load): "loader", the loader's own call
(`batch_plan.split_unit`: the microbatch's cost array -> per-rank sample indices as a
`RankSplit`, what the feed reads); "post_balance_flat", the balancer alone on arrays;
"post_balance (lists)", the list API (a Python list of costs in, one list per rank out:
how the loader called the balancers before); "before", the frozen previous implementation
(tests/balance_reference.py) on lists. "costs from metadata" is `batch_plan.unit_costs`
(one pass over the SampleMetas, once per global batch for every unit). The outputs are
checked identical. OrchMLLM's whole dispatcher overhead there is 16.7-53.9 ms.

Part 2: node-wise rearrangement (8 ranks per node, 60 samples per rank, sources = the
original instances): greedy, greedy + pairwise swaps ("local"), and the MILP (HiGHS,
warm-started from "local") at several time limits: time, objective / greedy, status and
the gap to HiGHS' proven bound, over seeds.

  python scripts/bench_balance.py [--parts 1 2] [--json bench_results/bench_balance.json]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
from rich.console import Console
from rich.table import Table

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import balance_reference as before  # noqa: E402  (the frozen previous implementation)

from bench_data import BENCH_CFG, phase_lengths, run_parts  # noqa: E402
from mmjax.data import balance  # noqa: E402
from mmjax.data.balance import node_wise  # noqa: E402
from mmjax.data.balance.node_swaps import swap_improve  # noqa: E402
from mmjax.data.batch_plan import NodeWise, split_unit, unit_costs  # noqa: E402
from mmjax.data.node_milp import milp_nodes  # noqa: E402
from mmjax.data.sample import TokenRules  # noqa: E402
from mmjax.data.synthetic import SyntheticDataset  # noqa: E402
from mmjax.host_info import machine  # noqa: E402
from mmjax.models.config import (AudioConfig, EncoderSpec, LLMConfig, MLLMConfig,  # noqa: E402
                                 ProjectorConfig, VisionConfig)

# the units whose costs the loader computes for a LAION-like mix: LLM, vision, audio
MODEL = MLLMConfig(
    "bench", LLMConfig(256, 32, 1, 2, 1, 64),
    encoders=(EncoderSpec("vision", VisionConfig(16, 1, 2, 32, patch_size=BENCH_CFG.patch_size),
                          ProjectorConfig()),
              EncoderSpec("audio", AudioConfig(16, 1, 2, 32), ProjectorConfig())))
PAPER_MS = {64: 16.66, 128: 18.49, 256: 21.32, 512: 24.64, 1024: 31.37, 2560: 53.88}


def _cpu_ms(fn) -> float:
    t = time.process_time()
    fn()
    return (time.process_time() - t) * 1e3


def part1_policies(args, console) -> list[dict]:
    ds = SyntheticDataset("laion", BENCH_CFG, seed=args.seed)
    rules = TokenRules(patch_size=BENCH_CFG.patch_size)
    pool = [ds.meta(i, rules) for i in range(4096)]
    rng = np.random.default_rng(args.seed)
    no_node_wise = NodeWise(0)
    rows = []
    for d in args.dp:
        metas = [pool[i] for i in rng.choice(len(pool), d * args.samples_per_rank)]
        t = time.process_time()
        costs = unit_costs(metas, MODEL)["llm"]
        costs_ms = (time.process_time() - t) * 1e3
        x = costs.astype(np.int64)
        for pol in balance.POLICIES:
            loader = split_unit(costs, d, "orchmllm", pol, no_node_wise).lists()
            same = loader == before.post_balance(x, d, pol) == balance.post_balance(x, d, pol)
            fns = {"before": lambda: before.post_balance(x.tolist(), d, pol),
                   "lists": lambda: balance.post_balance(costs.tolist(), d, pol),
                   "loader": lambda: split_unit(costs, d, "orchmllm", pol, no_node_wise),
                   "arrays": lambda: balance.post_balance_flat(x, d, pol)}
            reps = args.repeats if d <= 512 else max(3, args.repeats // 2)
            times = {k: [] for k in fns}
            for _ in range(reps):  # interleaved: the same load for every column
                for k, fn in fns.items():
                    times[k].append(_cpu_ms(fn))
            row = {"dp": d, "samples": int(x.size), "policy": pol, "identical": bool(same),
                   "costs_from_metadata_ms": costs_ms, "orchmllm_total_ms": PAPER_MS.get(d)}
            for k, ts in times.items():
                row[k] = {"median": statistics.median(ts), "min": min(ts)}
            rows.append(row)
    table = Table(title=f"(1) post-balance CPU ms, median (min) of interleaved repeats, "
                        f"{args.samples_per_rank} LAION-like samples per rank; 'loader' is "
                        "the loader's call (batch_plan.split_unit: cost array -> RankSplit)")
    for col in ("DP", "policy", "before (lists)", "post_balance (lists)", "loader",
                "post_balance_flat", "costs from metadata", "same output", "OrchMLLM total"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["dp"]), r["policy"],
                      *[f"{r[k]['median']:.1f} ({r[k]['min']:.1f})"
                        for k in ("before", "lists", "loader", "arrays")],
                      f"{r['costs_from_metadata_ms']:.1f}",
                      "yes" if r["identical"] else "NO",
                      "-" if r["orchmllm_total_ms"] is None else f"{r['orchmllm_total_ms']:.1f}")
    console.print(table)
    return rows


def part2_node_wise(args, console) -> list[dict]:
    pool = phase_lengths("laion", 4096, args.seed + 1)["llm"]
    rows = []
    c = 8
    for d in args.node_dp:
        for seed in range(args.seeds):
            rng = np.random.default_rng(1000 * d + seed)
            x = rng.choice(pool, d * args.samples_per_rank)
            batches = balance.post_balance(x, d, "sum")
            src = np.arange(x.size) // args.samples_per_rank
            s, bat, w, dd = node_wise._per_sample(src, batches, x, c)
            v = node_wise._volumes(s, bat, w, dd)

            def obj(node_of):
                return node_wise._objective(s, bat, w, dd, node_of, c, True)

            times = []
            for _ in range(args.repeats):  # the median: one call is at the cache's mercy
                t = time.process_time()
                greedy = node_wise._greedy_nodes(s, bat, w, dd, c)
                times.append((time.process_time() - t) * 1e3)
            row = {"dp": d, "seed": seed, "greedy_ms": statistics.median(times),
                   "identity": obj(np.arange(d) // c), "greedy": obj(greedy)}
            if d <= args.max_local_ranks:
                t = time.process_time()
                local = swap_improve(v, greedy, c, True)
                row["local_ms"] = (time.process_time() - t) * 1e3
                row["local"] = obj(local)
                if d <= args.max_milp_ranks:
                    for limit in args.milp_time_limits:
                        info = {}
                        t = time.perf_counter()
                        sol = milp_nodes(v, c, True, limit, info, local, row["local"])
                        row[f"milp_{limit:g}"] = {
                            "wall_s": time.perf_counter() - t, "status": info["milp_status"],
                            "bound": info["milp_bound"], "gap": info["milp_gap"],
                            "objective": None if sol is None else obj(sol)}
            rows.append(row)
    table = Table(title="(2) node-wise rearrangement, 8 ranks per node: objective (max "
                        "per-rank inter-node volume) / greedy's; MILP warm-started from "
                        "local search: status, gap to its proven bound")
    cols = ["DP", "seed", "greedy ms", "identity", "local ms", "local"]
    cols += [f"MILP {t:g} s" for t in args.milp_time_limits]
    for col in cols:
        table.add_column(col, justify="right")
    for r in rows:
        g = r["greedy"]
        cells = [str(r["dp"]), str(r["seed"]), f"{r['greedy_ms']:.1f}", f"{r['identity'] / g:.3f}",
                 f"{r['local_ms']:.1f}" if "local_ms" in r else "-",
                 f"{r['local'] / g:.3f}" if "local" in r else "-"]
        for t in args.milp_time_limits:
            m = r.get(f"milp_{t:g}")
            cells.append("-" if m is None or m["objective"] is None else
                         f"{m['objective'] / g:.3f} {m['status']} gap {100 * m['gap']:.1f}%")
        table.add_row(*cells)
    console.print(table)
    return rows


PARTS = {1: part1_policies, 2: part2_node_wise}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", type=int, nargs="+", default=sorted(PARTS), choices=sorted(PARTS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dp", type=int, nargs="+", default=[64, 256, 1024, 2560])
    ap.add_argument("--samples_per_rank", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--node_dp", type=int, nargs="+", default=[16, 32, 64, 256, 2560])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--max_local_ranks", type=int, default=256)
    ap.add_argument("--max_milp_ranks", type=int, default=64)
    ap.add_argument("--milp_time_limits", type=float, nargs="+", default=[0.05, 0.25, 2.0])
    ap.add_argument("--json", default="bench_results/bench_balance.json")
    args = ap.parse_args(argv)
    console = Console(width=max(Console().width, 140))
    results = {"config": vars(args), "machine": machine()}
    console.print(f"machine: {results['machine']}")
    run_parts(PARTS, args, console, results)
    return results


if __name__ == "__main__":
    main()
