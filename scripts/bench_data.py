"""Data-path benchmarks: reordering and post-balancing, host side only.

Parts (``--parts``, default all: 1 2 3 4; one function per part):
  1. DP imbalance, max/mean per-rank cost, for a random split (as sampled) vs DistTrain's
     intra-microbatch reordering (DistTrain Alg. 2) vs each OrchMLLM post-balance policy
     (OrchMLLM Alg. 1, 2, 4, 5), per phase (vision / audio encoder tokens of the samples that have
     that modality, LLM sequence tokens), on
     the LAION-like and three-modality (text, image, audio) mix sets of mmjax/data/synthetic.py,
     at DP 8, 64, 512. Two cost models: linear (sum of tokens: flash attention, no padding) and
     padded (count x longest: padded batches). intra_reorder and "sum" are the same LPT greedy
     (see reorder.intra_reorder), so their columns agree.
  2. Simulated 1F1B / interleaved iteration time (the DistTrain §6.2 recurrence) of random
     order (mean over all l! orders), ascending order, inter-microbatch reordering (Alg. 3
     alone, with reorder's guard, and guarded + the local-search step: inter_reorder's
     default) and the exhaustive optimum, l = 8 microbatches, p in
     {2, 4, 8}; also l = 32, 64 against sampled random orders and the lower bound.
     Microbatch cost = encoder tokens it holds.
  3. Balancing compute time at OrchMLLM Table 2 scales (DP 64 ... 2560, 60 samples per rank):
     each policy and node-wise rearrangement (8 ranks per node; the MILP up to
     --max_milp_ranks with a --milp_time_limit, reporting whether it proved optimality and
     its objective vs the greedy fast path and its gap to HiGHS' proven bound; greedy
     above). OrchMLLM's whole dispatcher
     overhead there is 16.7-53.9 ms. "sum_square" is skipped above --sum_square_max_dp.
  4. Loader throughput (mmjax/data/loader.py, DistTrain §4.2 / 003 §6): samples/s with 0, 1, 2
     grain worker processes and the trainer's wait per step while a simulated training step
     runs (--step_ms).

  python scripts/bench_data.py [--parts 1 2 3 4] [--json bench_results/bench_data.json]
                               [--markdown bench_results/bench_data.md]
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import statistics
import time

import cvxpy  # noqa: F401  (imported up front so part 3 does not time its import)
import numpy as np
from rich.console import Console
from rich.table import Table

from mmjax.data import balance, reorder
from mmjax.data.sample import TokenRules
from mmjax.data.synthetic import SyntheticConfig, SyntheticDataset
from mmjax.host_info import machine
from mmjax.models.units import is_llm

# Benchmark-sized shapes (the dataclass defaults are CPU-test sized): images ~24x24 patches
# (up to 64x64), audio ~300 frames, LAION-like text ~30 tokens.
BENCH_CFG = SyntheticConfig(image_side_median=24.0, image_side_range=(4, 64), text_len_median=30.0,
                            text_len_range=(1, 1024), frames_median=300.0,
                            frames_range=(20, 3000))
PHASES = {"laion": ("image", "llm"), "mix": ("image", "audio", "llm")}
METHODS = ("random", "intra_reorder") + balance.POLICIES


def run_parts(parts: dict, args, console, results: dict) -> None:
    """Run the chosen parts (each `fn(args, console) -> dict`) into `results`, timing each,
    then write `results` to `args.json`."""
    for part in args.parts:
        t0 = time.perf_counter()
        results[f"part{part}"] = parts[part](args, console)
        console.print(f"part {part}: {time.perf_counter() - t0:.1f} s")
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(results, f, indent=2, default=float)
    console.print(f"wrote {args.json}")


def phase_lengths(kind: str, n: int, seed: int) -> dict[str, np.ndarray]:
    """Per-sample tokens for each phase of ``n`` samples of a synthetic set."""
    ds = SyntheticDataset(kind, BENCH_CFG, seed=seed)
    rules = TokenRules(patch_size=BENCH_CFG.patch_size)
    metas = [ds.meta(i, rules) for i in range(n)]
    out = {"llm": np.array([m.llm_length for m in metas], dtype=np.int64)}
    for mod in ("image", "audio"):
        out[mod] = np.array([m.encoder_tokens(mod) for m in metas], dtype=np.int64)
    return out


def _split(x: np.ndarray, d: int, method: str, rng) -> list[list[int]]:
    if method == "random":  # as sampled: consecutive equal shares of a shuffled batch
        return [a.tolist() for a in np.array_split(rng.permutation(x.size), d)]
    if method == "intra_reorder":
        return reorder.intra_reorder(x, d)
    return balance.post_balance(x, d, method)


def _imbalance(x: np.ndarray, batches, cost: str) -> float:
    costs = [balance.batch_cost(x[b], cost) for b in batches]
    mean = float(np.mean(costs))
    return max(costs) / mean if mean > 0 else 1.0


def part1_imbalance(args, console) -> list[dict]:
    rows = []
    rng = np.random.default_rng(args.seed)
    n_max = max(args.dp) * args.samples_per_rank
    for kind in ("laion", "mix"):
        pool = phase_lengths(kind, n_max, args.seed)
        for d in args.dp:
            n = d * args.samples_per_rank
            for phase in PHASES[kind]:
                x = pool[phase][:n]
                if not is_llm(phase):  # an encoder's dispatcher only sees samples with its modality
                    x = x[x > 0]
                row = {"set": kind, "dp": d, "phase": phase}
                for m in METHODS:
                    b = _split(x, d, m, rng)
                    row[m] = {c: _imbalance(x, b, c) for c in ("sum", "padded")}
                rows.append(row)
    table = Table(title=f"(1) DP imbalance max/mean, linear / padded cost "
                        f"({args.samples_per_rank} samples per rank)")
    for col in ("set", "DP", "phase") + METHODS:
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["set"], str(r["dp"]), r["phase"],
                      *[f"{r[m]['sum']:.3f} / {r[m]['padded']:.3f}" for m in METHODS])
    _show(console, table)
    return rows


def _orders(f, p, v, sc):
    return {"ascending": sorted(range(len(f)), key=lambda j: (f[j], j)),
            "alg3": reorder.inter_reorder(f, p, num_chunks=v, guard=False, stage_costs=sc),
            "guarded": reorder.inter_reorder(f, p, num_chunks=v, stage_costs=sc,
                                             improve_rounds=0),
            "inter_reorder": reorder.inter_reorder(f, p, num_chunks=v, stage_costs=sc)}


def _stage_costs(kind, p, f):
    """"uniform": every stage ~ microbatch size (one pipelined unit). "enc+llm": DistTrain
    §6.2's pipeline, encoder stage 0 ~ size, LLM stages at a fixed time (the mean encoder
    time: the orchestrator balances the units)."""
    if kind == "uniform":
        return None
    m = float(np.mean(f))
    return [(1.0, 0.0, 0.0)] + [(0.0, m, 2 * m)] * (p - 1)


def _lower_bound(sc, p, f, b) -> float:
    """1F1B lower bound for every order: stage s does all its work, after some forward has
    crossed stages 0..s-1 and before the last backward crosses them back."""
    sc = sc or [(1.0, 0.0, 0.0)] * p
    best = 0.0
    for s in range(p):
        scale, fo, bo = sc[s]
        work = sum(scale * (fj + bj) + fo + bo for fj, bj in zip(f, b))
        head = min(sum(sc[t][0] * fj + sc[t][1] for t in range(s)) for fj in f)
        tail = min(sum(sc[t][0] * bj + sc[t][2] for t in range(s)) for bj in b)
        best = max(best, head + work + tail)
    return best


def part2_pipeline(args, console) -> list[dict]:
    rows = []
    rng = np.random.default_rng(args.seed + 1)
    sizes = phase_lengths("laion", 4096, args.seed + 1)["image"]
    shapes = [(p, 1, args.microbatches) for p in args.stages]
    shapes += [(p, 2, args.microbatches) for p in args.stages
               if args.microbatches % p == 0 and p < 8]
    shapes += [(p, 1, l) for l in args.long_microbatches for p in args.stages if p < l]  # v = 1
    for (p, v, l), kind, trial in itertools.product(shapes, ("uniform", "enc+llm"),
                                                     range(args.trials)):
        mb = rng.choice(sizes, (l, args.mb_size)).sum(axis=1).astype(float)
        f, b = mb.tolist(), (2.0 * mb).tolist()
        sc = _stage_costs(kind, p, f)
        model = reorder.PipelineModel.build(p, l, v, sc)

        def run(o):
            return model.iteration_time([f[j] for j in o], [b[j] for j in o])

        t0 = time.process_time()
        reorder.inter_reorder(f, p, num_chunks=v, stage_costs=sc)
        row = {"model": kind, "p": p, "v": v, "l": l, "trial": trial,
               "inter_reorder_ms": (time.process_time() - t0) * 1e3}
        if l <= 8:  # every order at once on the batched recurrence
            perms = np.array(list(itertools.permutations(range(l))))
            times = reorder.batch_iteration_time(model, mb[perms], 2.0 * mb[perms]).tolist()
            row.update(random_mean=float(np.mean(times)), random_worst=max(times),
                       optimum=min(times), ref="optimum")
        else:  # no exhaustive search: random = mean of sampled orders, ref = lower bound
            times = [run(rng.permutation(l)) for _ in range(args.random_orders)]
            row.update(random_mean=float(np.mean(times)), random_worst=max(times),
                       optimum=None, ref="lower bound",
                       lower_bound=_lower_bound(sc, p, f, b))
        row.update({name: run(o) for name, o in _orders(f, p, v, sc).items()})
        rows.append(row)
    table = Table(title=f"(2) simulated iteration time / reference (exhaustive optimum for "
                        f"l <= 8, else a per-stage lower bound); microbatches "
                        f"of {args.mb_size} LAION-like samples, cost = image tokens, b = 2f")
    for col in ("model", "p", "v", "l", "trial", "random (mean)", "random worst", "ascending",
                "Alg. 3", "Alg. 3 guarded", "+ local search", "ref", "reorder ms"):
        table.add_column(col, justify="right")
    for r in rows:
        ref = r["optimum"] if r["optimum"] is not None else r["lower_bound"]
        table.add_row(r["model"], str(r["p"]), str(r["v"]), str(r["l"]), str(r["trial"]),
                      *[f"{r[k] / ref:.3f}" for k in ("random_mean", "random_worst", "ascending",
                                                      "alg3", "guarded", "inter_reorder")],
                      r["ref"], f"{r['inter_reorder_ms']:.1f}")
    _show(console, table)
    return rows


def _times_ms(fn, repeats):
    """CPU time (process_time: the algorithms are single-threaded host code, and the shared
    benchmark machine's wall time includes waiting for a core) and wall time, in ms."""
    cpu, wall = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        cpu.append((time.process_time() - c0) * 1e3)
        wall.append((time.perf_counter() - t0) * 1e3)
    return {"median": statistics.median(cpu), "min": min(cpu),
            "wall_median": statistics.median(wall)}


def part3_overhead(args, console) -> list[dict]:
    rows = []
    rng = np.random.default_rng(args.seed + 2)
    pool = phase_lengths("laion", 4096, args.seed + 2)["llm"]
    paper = {64: 16.66, 128: 18.49, 256: 21.32, 512: 24.64, 1024: 31.37, 2560: 53.88}
    for d in args.overhead_dp:
        x = rng.choice(pool, d * 60)
        row = {"dp": d, "samples": int(x.size), "orchmllm_ms": paper.get(d)}
        reps = args.repeats if d <= 512 else max(1, args.repeats // 2)
        for pol in balance.POLICIES:
            if pol == "sum_square" and d > args.sum_square_max_dp:
                row[pol] = None  # pure-Python heap loop; see --sum_square_max_dp
                continue
            row[pol] = _times_ms(lambda: balance.post_balance(x, d, pol), reps)
        batches = balance.post_balance(x, d, "sum")
        src = np.arange(x.size) // 60
        t0, c0 = time.perf_counter(), time.process_time()
        info = {}
        perm = balance.node_wise_rearrange(src, batches, x, 8, time_limit=args.milp_time_limit,
                                           max_milp_ranks=args.max_milp_ranks, info=info)
        row["node_wise_ms"] = (time.process_time() - c0) * 1e3
        row["node_wise_wall_ms"] = (time.perf_counter() - t0) * 1e3
        row["node_wise_method"] = "milp" if d <= args.max_milp_ranks else "greedy"
        row["milp_status"] = info.get("milp_status")  # "optimal" or "user_limit" (time)
        row["milp_gap"] = info.get("milp_gap")  # to HiGHS' proven bound (0: optimal)
        row["node_wise_chosen"] = info["chosen"]
        row["node_wise_objective"] = info["objective"]
        dst = np.empty(x.size, dtype=np.int64)
        ident = np.empty(x.size, dtype=np.int64)
        for i, b in enumerate(batches):
            dst[b] = perm[i]
            ident[b] = i
        row["inter_node_before"] = balance.max_inter_node_volume(src, ident, x, 8)
        row["inter_node_after"] = balance.max_inter_node_volume(src, dst, x, 8)
        rows.append(row)
    table = Table(title="(3) balancing CPU time, ms, median (best) of repeats (60 samples "
                        "per rank; node-wise: 8 ranks per node, max inter-node volume before "
                        "-> after)")
    for col in ("DP", "samples", *balance.POLICIES, "node-wise ms", "MILP", "MILP / greedy",
                "inter-node vol", "OrchMLLM total"):
        table.add_column(col, justify="right")
    for r in rows:
        obj = r["node_wise_objective"]
        table.add_row(str(r["dp"]), str(r["samples"]),
                      *["-" if r[p] is None else f"{r[p]['median']:.1f} ({r[p]['min']:.1f})"
                        for p in balance.POLICIES],
                      f"{r['node_wise_ms']:.0f} ({r['node_wise_method']})",
                      "-" if r["milp_status"] is None else
                      f"{r['milp_status']} (gap {100 * r['milp_gap']:.1f}%)",
                      f"{obj['milp'] / obj['greedy']:.3f}" if "milp" in obj and obj["greedy"]
                      else "-",
                      f"{r['inter_node_before']:.0f} -> {r['inter_node_after']:.0f}",
                      "-" if r["orchmllm_ms"] is None else f"{r['orchmllm_ms']:.1f}")
    _show(console, table)
    return rows


def part4_loader(args, console) -> list[dict]:
    """Per worker count: start-up (first global batch, incl. worker spawn), steady-state
    samples/s over --loader_steps global batches taken back to back (at most workers x
    prefetch batches were buffered when timing starts), then the mean/max wait in next()
    while the trainer 'trains' for --step_ms per step (~0 once prefetch keeps up)."""
    from mmjax.data.layout import AssemblyLayout
    from mmjax.data.loader import Loader
    from mmjax.data.records import SyntheticSource
    from mmjax.models.config import (AudioConfig, EncoderSpec, LLMConfig, MLLMConfig,
                                     ProjectorConfig, VisionConfig)
    from mmjax.planner.plan import Plan

    cfg = MLLMConfig("bench", LLMConfig(512, 64, 1, 2, 1, 128), encoders=(
        EncoderSpec("vision", VisionConfig(32, 1, 2, 64, patch_size=14, max_grid=32),
                    ProjectorConfig(downsample=2)),
        EncoderSpec("audio", AudioConfig(32, 1, 2, 64, num_mel_bins=16),
                    ProjectorConfig(downsample=2))))
    layout = AssemblyLayout.from_config(cfg, 1024, packing="pack", vision_caps=(256, 1024),
                                        audio_frame_caps=(256, 1024))
    source = SyntheticSource(SyntheticDataset(
        "mix", SyntheticConfig.for_model(cfg, image_side_range=(1, 32)), seed=args.seed))
    gb = args.loader_global_batch
    plan = Plan.uniform(cfg, gb, 4, dp={"vision": 2, "audio": 2, "llm": 4})
    rows = []
    for nw in args.loader_workers:
        t = time.perf_counter()
        ld = Loader.build(source, cfg, plan, layout, balance="orchmllm", num_workers=nw, prefetch=2,
                    num_steps=2 * args.loader_steps + 1)  # the feeds' shape floor over those
        first = next(ld)
        startup = time.perf_counter() - t
        t0 = time.perf_counter()
        for _ in range(args.loader_steps):
            next(ld)
        thr = args.loader_steps * gb / (time.perf_counter() - t0)
        waits = []
        for _ in range(args.loader_steps):
            t = time.perf_counter()
            next(ld)
            waits.append((time.perf_counter() - t) * 1e3)
            time.sleep(args.step_ms / 1e3)  # the trainer's step
        ld.close()
        rows.append({"workers": nw, "global_batch": gb, "startup_s": startup,
                     "samples_per_s": thr, "plan_ms": first.plan_seconds * 1e3,
                     "wait_ms_mean": statistics.mean(waits), "wait_ms_max": max(waits),
                     "step_ms": args.step_ms})
    table = Table(title=f"(4) loader: global batch {gb} (OrchMLLM mix, post-balanced), "
                        f"trainer step {args.step_ms:.0f} ms")
    for col in ("workers", "start-up s", "samples/s", "plan ms", "wait ms mean", "wait ms max"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["workers"]), f"{r['startup_s']:.1f}", f"{r['samples_per_s']:.0f}",
                      f"{r['plan_ms']:.1f}", f"{r['wait_ms_mean']:.1f}", f"{r['wait_ms_max']:.1f}")
    _show(console, table)
    return rows


_TABLES: list[Table] = []


def _show(console, table: Table) -> None:
    console.print(table)
    _TABLES.append(table)


def markdown(table: Table) -> str:
    """A rich Table as a GitHub markdown table (title as a bold line above it)."""
    head = [str(c.header) for c in table.columns]
    cols = [[str(x) for x in c.cells] for c in table.columns]
    lines = [f"**{table.title}**", "", "| " + " | ".join(head) + " |",
             "|" + "|".join("---:" for _ in head) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in zip(*cols)]
    return "\n".join(lines) + "\n"


PARTS = {1: part1_imbalance, 2: part2_pipeline, 3: part3_overhead, 4: part4_loader}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", type=int, nargs="+", default=sorted(PARTS), choices=sorted(PARTS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dp", type=int, nargs="+", default=[8, 64, 512])
    ap.add_argument("--samples_per_rank", type=int, default=16)
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--microbatches", type=int, default=8, help="l (<= 8: exhaustive search)")
    ap.add_argument("--mb_size", type=int, default=4, help="samples per microbatch")
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--long_microbatches", type=int, nargs="*", default=[32, 64],
                    help="also l this long (no exhaustive optimum; vs sampled random orders)")
    ap.add_argument("--random_orders", type=int, default=50)
    ap.add_argument("--overhead_dp", type=int, nargs="+",
                    default=[64, 128, 256, 512, 1024, 2560])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sum_square_max_dp", type=int, default=2560)
    ap.add_argument("--max_milp_ranks", type=int, default=64,
                    help="node-wise: MILP up to this many ranks, greedy fast path above")
    ap.add_argument("--milp_time_limit", type=float, default=0.25,
                    help="node-wise MILP time limit, s (the best answer found is kept)")
    ap.add_argument("--loader_workers", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--loader_steps", type=int, default=8)
    ap.add_argument("--loader_global_batch", type=int, default=32)
    ap.add_argument("--step_ms", type=float, default=200.0, help="part 4: simulated train step")
    ap.add_argument("--json", default="bench_results/bench_data.json")
    ap.add_argument("--markdown", default=None, help="also write every table as markdown here")
    args = ap.parse_args(argv)
    if args.microbatches > 8:
        ap.error("--microbatches must be <= 8 (exhaustive search over l! orders)")
    console = Console(width=max(Console().width, 140))
    results = {"config": vars(args), "machine": machine()}
    console.print(f"machine: {results['machine']}")
    _TABLES.clear()
    run_parts(PARTS, args, console, results)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("\n".join(markdown(t) for t in _TABLES))
        console.print(f"wrote {args.markdown}")
    return results


if __name__ == "__main__":
    from mmjax.cli import run_main

    sys.exit(run_main(main))
