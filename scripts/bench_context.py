"""Table 4 analogue of Cornstarch (§6.5): balance of CP token distributions, and LPT's speed.

For each sequence length and mask family (EP: encoder outputs prepended, EE: embedded, MP:
multimodal packing; Fig. 11) it draws random BAM rows, distributes query blocks over the CP
ranks with uniform (naive ring), zigzag, random and LPT (and LPT capped at ceil(blocks / G)
blocks per rank, the static-shape variant the runtime uses), and reports the per-rank
attention work at tile granularity: max/mean (1.0 = perfectly balanced) and each method's
makespan (max work) relative to LPT's, averaged over the draws. The makespan is what
all-gather CP attention waits for (§5.3). It then times LPT (Appendix A) for a 1M-token row
at block 128 (Cornstarch reports under 1 ms) and the BAM block-work pass that feeds it, and
compares LPT's makespan with the exact ILP optimum (§4.3.2 Eq. 1) at the shortest length.

  python scripts/bench_context.py [--lengths 16384 32768 65536] [--ranks 8] [--draws 50]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import statistics
import time

import numpy as np
from rich.console import Console
from rich.table import Table

from mmjax.data import token_distribution as td

ORDER = ("lpt", "random", "uniform", "zigzag", "lpt_capped")
LABEL = {"lpt": "LPT", "random": "Random", "uniform": "Uniform", "zigzag": "Zigzag",
         "lpt_capped": "LPT capped"}
SHORT = {"prepended": "EP", "embedded": "EE", "packing": "MP", "causal": "causal"}


def balance_rows(lengths, families, ranks, block, draws):
    rows = []
    for length in lengths:
        for family in families:
            acc = {m: {"imbalance": [], "ratio_to_lpt": [], "max": []} for m in ORDER}
            for seed in range(draws):
                mask = td.example_mask(family, length, seed)
                work = td.block_work(mask, block)
                dists = {m: td.distribute(mask, ranks, m, block, seed=seed) for m in ORDER[:4]}
                # LPT capped at ceil(blocks / G) blocks per rank: the static-shape variant
                # the runtime uses (td.batch_layout).
                cap = -(-work.size // ranks)
                dists["lpt_capped"] = td.distribute(mask, ranks, "lpt", block, capacity=cap)
                stats = {m: td.work_stats(work, d, block) for m, d in dists.items()}
                for m in ORDER:
                    acc[m]["imbalance"].append(stats[m]["imbalance"])
                    acc[m]["ratio_to_lpt"].append(stats[m]["max"] / stats["lpt"]["max"])
                    acc[m]["max"].append(stats[m]["max"])
            rows.append({"length": length, "family": family,
                         **{m: {k: float(np.mean(v)) for k, v in acc[m].items()} for m in ORDER}})
    return rows


def ilp_rows(lengths, families, ranks, block, draws, time_limit):
    """LPT's makespan over the ILP optimum (Cornstarch §4.3.2 Eq. 1) on the first `draws` masks."""
    rows = []
    for length in lengths:
        for family in families:
            ratios, proven, secs = [], 0, []
            for seed in range(draws):
                work = td.block_work(td.example_mask(family, length, seed), block)
                t0 = time.perf_counter()
                assignment, optimal = td.ilp(work, ranks, time_limit)
                secs.append(time.perf_counter() - t0)
                best = np.bincount(assignment, weights=work, minlength=ranks).max()
                ratios.append(np.bincount(td.lpt(work, ranks), weights=work,
                                          minlength=ranks).max() / best)
                proven += optimal
            rows.append({"length": length, "family": family, "lpt_over_ilp": float(np.mean(ratios)),
                         "max_lpt_over_ilp": float(np.max(ratios)), "proven_optimal": proven,
                         "draws": draws, "ilp_s": float(np.mean(secs))})
    return rows


def _median_ms(fn, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def lpt_timing(tokens, ranks, block, repeats):
    out = []
    for family in ("causal", "prepended", "embedded", "packing"):
        mask = td.example_mask(family, tokens, 0)
        work = td.block_work(mask, block)
        out.append({
            "family": family, "tokens": tokens, "block": block, "blocks": int(work.size),
            "lpt_ms": _median_ms(lambda: td.lpt(work, ranks), repeats),
            "block_work_ms": _median_ms(lambda: td.block_work(mask, block), max(1, repeats // 5)),
            "distribute_lpt_ms": _median_ms(lambda: td.distribute(mask, ranks, "lpt", block),
                                            max(1, repeats // 5)),
        })
    return out


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[16384, 32768, 65536])
    ap.add_argument("--families", nargs="+", default=["prepended", "embedded", "packing"],
                    choices=list(td.FAMILIES))
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--draws", type=int, default=50,
                    help="random masks per (length, family); Cornstarch §6.5 uses 50")
    ap.add_argument("--lpt_tokens", type=int, default=1 << 20)
    ap.add_argument("--repeats", type=int, default=20, help="timing repeats for LPT")
    ap.add_argument("--ilp_lengths", type=int, nargs="*", default=[16384],
                    help="lengths at which to compare LPT with the exact ILP (slow)")
    ap.add_argument("--ilp_draws", type=int, default=2)
    ap.add_argument("--ilp_time_limit", type=float, default=10.0)
    ap.add_argument("--json", default="bench_results/context.json")
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    """Run the benchmark, print the tables, write and return the JSON record."""
    args = parse_args(argv)

    rows = balance_rows(args.lengths, args.families, args.ranks, args.block, args.draws)
    timing = lpt_timing(args.lpt_tokens, args.ranks, args.block, args.repeats)
    exact = ilp_rows(args.ilp_lengths, args.families, args.ranks, args.block, args.ilp_draws,
                     args.ilp_time_limit)

    console = Console(width=max(Console().width, 110))
    table = Table(title=f"CP token distribution, {args.ranks} ranks, block {args.block}: per-rank "
                        f"work max/mean and makespan vs LPT (mean of {args.draws} masks)")
    table.add_column("Length", justify="right")
    table.add_column("Mask")
    for m in ORDER[:4]:
        table.add_column(f"{LABEL[m]}\nmax/mean", justify="right")
    for m in ORDER[1:]:
        table.add_column(f"{LABEL[m]}\n/ LPT", justify="right")
    for r in rows:
        table.add_row(str(r["length"]), SHORT[r["family"]],
                      *(f"{r[m]['imbalance']:.3f}" for m in ORDER[:4]),
                      *(f"{r[m]['ratio_to_lpt']:.3f}x" for m in ORDER[1:]))
    console.print(table)

    t2 = Table(title=f"LPT distribution time, {args.lpt_tokens} tokens, block {args.block}, "
                     f"{args.ranks} ranks (median)")
    for col in ("Mask", "Blocks", "LPT (ms)", "BAM block work (ms)", "distribute total (ms)"):
        t2.add_column(col, justify="right")
    for t in timing:
        t2.add_row(SHORT[t["family"]], str(t["blocks"]), f"{t['lpt_ms']:.2f}",
                   f"{t['block_work_ms']:.1f}", f"{t['distribute_lpt_ms']:.1f}")
    console.print(t2)

    if exact:
        t3 = Table(title=f"LPT vs the exact ILP (Cornstarch Eq. 1, HiGHS, {args.ilp_time_limit:g} s "
                         f"limit), first {args.ilp_draws} masks")
        for col in ("Length", "Mask", "LPT / ILP (mean)", "LPT / ILP (max)", "proven optimal",
                    "ILP time (s)"):
            t3.add_column(col, justify="right")
        for r in exact:
            t3.add_row(str(r["length"]), SHORT[r["family"]], f"{r['lpt_over_ilp']:.4f}",
                       f"{r['max_lpt_over_ilp']:.4f}", f"{r['proven_optimal']}/{r['draws']}",
                       f"{r['ilp_s']:.2f}")
        console.print(t3)

    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    record = {"config": vars(args), "balance": rows, "lpt_timing": timing, "lpt_vs_ilp": exact}
    with open(args.json, "w") as f:
        json.dump(record, f, indent=2)
    console.print(f"wrote {args.json}")
    return record


if __name__ == "__main__":
    from mmjax.cli import run_main

    sys.exit(run_main(main))
