"""Co-located layout benchmarks (OrchMLLM §5-6): per-phase balance and encoder->LLM traffic.

Parts (``--parts``, default 1 2; 3 compiles the tiny model, minutes on CPU):
  1. Per phase (vision / audio encoder tokens of the samples with that modality, LLM
     sequence tokens) of the three-modality mix set (scripts/bench_data.py's shapes), the
     max and mean tokens per rank of the loaded mini-batches ("none": sample k on rank
     k * d // n) and under each post-balancing policy (OrchMLLM Algorithms 1, 2, 4, 5), at
     the given DP sizes, ``--samples_per_rank`` samples per rank, over ``--seeds`` batches.
  2. Bytes of the encoder->LLM all-to-all (every encoder's outputs to the LLM's balanced
     layout, rearrangement composition, §6) crossing nodes, with and without the node-wise
     rearrangement (§5.2.2, Algorithm 3), counted by `parallel.rearrange.TrafficLedger`
     from the exchange tables the all-to-all runs with (2 nodes x 4 ranks, and larger
     clusters host-side: the counting needs no devices). Rows are ``--hidden`` wide in bf16.
     OrchMLLM reports inter-node all-to-all volume ratios of 0.436-0.722. Columns: total
     inter-node bytes (ratio node-wise / plain; min-max over batches) and the largest
     per-rank inter-node volume (Eq. 5, the all-to-all's straggler, which Algorithm 3
     minimises), at ``--traffic_samples_per_rank`` samples per rank.

  3. Step time of the co-located loss and gradients (the model with the co-located
     `route` seam, inputs placed on the co-located mesh, jitted over 8 CPU devices, dp 8) on one global batch of the tiny
     model with ``--step_samples`` variable-size synthetic samples (bench_data's image
     sizes), assembled in the loaded mini-batches ("none") and in each policy's balanced
     per-phase layouts (data/colocated_batch.py, the encoder->LLM all-to-all at the seam):
     median of ``--step_repeats`` steps after compiling. In an SPMD step every rank pays
     the fullest rank's padded shapes, which balancing lowers. On CPU devices the 8 ranks
     share the host's cores, so this measures the padded work, not a GPU's wall clock.

  python scripts/bench_colocated.py [--parts 1 2 3] [--json bench_results/bench_colocated.json]
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mmjax.data.batch_plan import NodeWise
from mmjax.cpu_threads import force_cpu_devices  # noqa: E402

force_cpu_devices(8)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from bench_data import phase_lengths, run_parts  # noqa: E402
from mmjax.data.colocated_layout import (LAYOUT_POLICIES, phase_loads,  # noqa: E402
                                         plan_colocated_layout)

PHASE_NAMES = {"image": "vision", "audio": "audio", "llm": "llm"}
PAPER = {"speedup": "1.5-2.0x over unbalanced (OrchMLLM §8)",
         "inter_node_ratio": "0.436-0.722 (OrchMLLM §8, node-wise vs naive all-to-all)"}


def _batch(n: int, seed: int):
    """(lengths per phase, output rows per encoder) of n samples of the mix set."""
    raw = phase_lengths("mix", n, seed)
    lengths = {PHASE_NAMES[k]: v for k, v in raw.items()}
    out_rows = {e: lengths[e] for e in ("vision", "audio")}  # a token-preserving projector
    return lengths, out_rows


def part1_balance(args, console) -> list[dict]:
    rows = []
    for d in args.dp:
        n = d * args.samples_per_rank
        acc: dict = {}
        for seed in range(args.seeds):
            lengths, out_rows = _batch(n, args.seed + seed)
            for pol in LAYOUT_POLICIES:
                lay = plan_colocated_layout(lengths, out_rows, d, pol)
                for p, ph in lay.phases.items():
                    mx, mean = phase_loads(ph, lengths[p])
                    a = acc.setdefault((p, pol), [0.0, 0.0])
                    a[0] += mx / args.seeds
                    a[1] += mean / args.seeds
        for p in ("vision", "audio", "llm"):
            row = {"dp": d, "phase": p, "mean": acc[(p, "none")][1]}
            for pol in LAYOUT_POLICIES:
                row[f"max_{pol}"] = acc[(p, pol)][0]
            rows.append(row)
    t = Table(title="Part 1: tokens per rank, max (max/mean) per policy, mean over "
                    f"{args.seeds} batches, {args.samples_per_rank} samples per rank")
    for c in ["dp", "phase", "mean"] + [f"max {p}" for p in LAYOUT_POLICIES]:
        t.add_column(c, justify="right")
    for r in rows:
        t.add_row(str(r["dp"]), r["phase"], f"{r['mean']:.0f}",
                  *[f"{r[f'max_{p}']:.0f} ({r[f'max_{p}'] / r['mean']:.2f})"
                    for p in LAYOUT_POLICIES])
    console.print(t)
    return rows


def _ledger(lay, mesh, nodes: int, rpn: int, row_bytes: int):
    """Inter-node payload bytes of every encoder's exchange, and the largest per-rank
    inter-node send (Eq. 5's objective), from the tables the all-to-all runs with."""
    from mmjax.data.balance import inter_node_volumes
    from mmjax.parallel.rearrange import TrafficLedger, plan_exchange
    led = TrafficLedger(rpn)
    src, dst, w = [], [], []
    for e, routes in lay.routes.items():
        if mesh is not None:
            led.add(plan_exchange(routes, mesh, "dp", "dp").forward, row_bytes)
        for i, _, j, _ in routes.pairs:
            src.append(i)
            dst.append(j)
            w.append(row_bytes)
    send, recv = inter_node_volumes(src, dst, w, rpn)
    total = float(send.sum())
    if mesh is not None:
        assert led.payload["inter_node"] == total, (led.payload, total)
    return total, float(max(send.max(initial=0), recv.max(initial=0)))


def part2_traffic(args, console) -> list[dict]:
    import jax
    rows = []
    row_bytes = args.hidden * 2
    for (nodes, rpn), spr in itertools.product(args.clusters, args.traffic_samples_per_rank):
        d = nodes * rpn
        mesh = jax.make_mesh((d,), ("dp",)) if d <= len(jax.devices()) else None
        n = d * spr
        plain_t, nw_t, plain_m, nw_m = [], [], [], []
        for seed in range(args.seeds):
            lengths, out_rows = _batch(n, args.seed + seed)
            kw = dict(row_bytes={"vision": row_bytes, "audio": row_bytes})
            plain = plan_colocated_layout(lengths, out_rows, d, args.policy, **kw)
            nw = plan_colocated_layout(lengths, out_rows, d, args.policy, node_wise=NodeWise(rpn, "local"),
                                       **kw)
            a, am = _ledger(plain, mesh, nodes, rpn, row_bytes)
            b, bm = _ledger(nw, mesh, nodes, rpn, row_bytes)
            plain_t.append(a)
            nw_t.append(b)
            plain_m.append(am)
            nw_m.append(bm)
        rows.append({"nodes": nodes, "ranks_per_node": rpn, "samples_per_rank": spr,
                     "measured": mesh is not None,
                     "inter_node_bytes_plain": float(np.mean(plain_t)),
                     "inter_node_bytes_node_wise": float(np.mean(nw_t)),
                     "ratio_total": float(np.sum(nw_t) / np.sum(plain_t)),
                     "ratio_min": float(min(b / a for a, b in zip(plain_t, nw_t))),
                     "ratio_max": float(max(b / a for a, b in zip(plain_t, nw_t))),
                     "max_rank_ratio": float(np.sum(nw_m) / np.sum(plain_m))})
    t = Table(title=f"Part 2: encoder->LLM inter-node bytes ({args.policy} balanced, "
                    f"{args.hidden}-wide bf16 rows, mean of {args.seeds} batches)")
    for c in ("nodes x ranks", "samples/rank", "counted on", "plain MB", "node-wise MB", "ratio (min-max)",
              "max-rank ratio"):
        t.add_column(c, justify="right")
    for r in rows:
        t.add_row(f"{r['nodes']} x {r['ranks_per_node']}", str(r["samples_per_rank"]),
                  "exchange tables" if r["measured"] else "host routes",
                  f"{r['inter_node_bytes_plain'] / 1e6:.2f}",
                  f"{r['inter_node_bytes_node_wise'] / 1e6:.2f}",
                  f"{r['ratio_total']:.3f} ({r['ratio_min']:.3f}-{r['ratio_max']:.3f})",
                  f"{r['max_rank_ratio']:.3f}")
    console.print(t)
    console.print(f"OrchMLLM: {PAPER['inter_node_ratio']}")
    return rows


def _step_setup(n: int, seed: int):
    from mmjax.data.layout import AssemblyLayout, check_sample
    from mmjax.data.synthetic import SyntheticConfig, SyntheticDataset
    from mmjax.models.config import with_overrides
    from mmjax.models.tiny import tiny
    cfg = with_overrides(tiny(), {"llm.num_layers": 4, "encoders.vision.encoder.num_layers": 2})
    lay = AssemblyLayout.from_config(cfg, 256, "pad", vision_caps=(64, 128, 256))
    syn = SyntheticConfig.for_model(cfg, gen_fraction=0.0, image_side_range=(2, 16),
                                    image_side_median=6.0, text_len_median=24.0,
                                    text_len_range=(4, 128))
    ds = SyntheticDataset("laion", syn, seed=seed)
    samples = [s for s in (ds[i] for i in range(8 * n)) if check_sample(s, lay) is None][:n]
    return cfg, lay, samples


def part3_step(args, console) -> list[dict]:
    import statistics
    import time

    import jax
    from mmjax.models.mllm import MultimodalModel, trainable_filter
    from mmjax.parallel.fsdp import colocated_mesh
    from mmjax.parallel.phase_inputs import balanced_inputs, colocated_route
    from mmjax.train.colocated import Colocation
    from mmjax.train.step import make_loss_fn, split_model

    cfg, lay, samples = _step_setup(args.step_samples, args.seed)
    mesh = colocated_mesh(jax.devices()[:8], Colocation(tp=1))
    gd, tr, fr = split_model(MultimodalModel(cfg, jax.random.key(0)), trainable_filter(cfg))
    fn = jax.jit(jax.value_and_grad(make_loss_fn(gd, route=colocated_route(mesh)),
                                    has_aux=True))
    rows, losses = [], {}
    for pol in LAYOUT_POLICIES:
        inputs, pb = balanced_inputs(samples, lay, mesh, pol)
        (loss, _), g = fn(tr, fr, inputs)
        jax.block_until_ready(g)
        times = []
        for _ in range(args.step_repeats):
            t = time.perf_counter()
            jax.block_until_ready(fn(tr, fr, inputs))
            times.append(time.perf_counter() - t)
        losses[pol] = float(loss)
        enc = pb.inputs["encoders"]["vision"]["patches"].shape
        rows.append({"policy": pol, "step_s": statistics.median(times),
                     "llm_rows_per_rank": pb.inputs["tokens"].shape[0] // 8,
                     "vision_buffers_per_rank": enc[0] // 8, "vision_cap": enc[1],
                     "loss": float(loss)})
    base = rows[0]["step_s"]
    t = Table(title=f"Part 3: co-located step (loss + grads), tiny model, "
                    f"{len(samples)} samples, dp 8 on CPU devices")
    for c in ("policy", "step (s)", "speedup vs none", "LLM rows/rank",
              "vision buffers/rank x cap", "loss"):
        t.add_column(c, justify="right")
    for r in rows:
        r["speedup"] = base / r["step_s"]
        t.add_row(r["policy"], f"{r['step_s']:.3f}", f"{r['speedup']:.2f}x",
                  str(r["llm_rows_per_rank"]),
                  f"{r['vision_buffers_per_rank']} x {r['vision_cap']}", f"{r['loss']:.6f}")
    console.print(t)
    spread = max(losses.values()) - min(losses.values())
    console.print(f"losses agree across layouts to {spread:.2e}; OrchMLLM: {PAPER['speedup']}")
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--dp", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--clusters", type=lambda s: tuple(map(int, s.split("x"))), nargs="+",
                    default=[(2, 4), (4, 8), (8, 8)], help="NODESxRANKS, e.g. 2x4")
    ap.add_argument("--samples_per_rank", type=int, default=16)
    ap.add_argument("--traffic_samples_per_rank", type=int, nargs="+", default=[6, 16])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policy", default="sum", choices=[p for p in LAYOUT_POLICIES
                                                          if p != "none"])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--step_samples", type=int, default=32)
    ap.add_argument("--step_repeats", type=int, default=3)
    ap.add_argument("--json", default="bench_results/bench_colocated.json")
    args = ap.parse_args(argv)
    for p in args.parts:
        if p not in (1, 2, 3):
            ap.error(f"--parts: unknown part {p} (use 1, 2 or 3)")
    console = Console()
    results = {"paper": PAPER, "args": {k: v for k, v in vars(args).items()}}
    run_parts({1: part1_balance, 2: part2_traffic, 3: part3_step}, args, console, results)


if __name__ == "__main__":
    main()
