"""The co-located encoder->LLM exchange at cluster scale, by simulation (OrchMLLM §5.2.2, §6).

For OrchMLLM-like global batches (scripts/bench_data.py's three-modality "mix" set,
``--samples_per_rank`` samples per rank, every encoder output row kept: a token-preserving
projector, ``--hidden``-wide bf16 rows), at each ``--ranks`` (``--rpn`` ranks per node, tp
1), every phase `sum`-balanced (OrchMLLM Algorithm 1), the LLM's mini-batches left on their
index ("plain") or placed node-wise (Algorithm 3, "greedy": the loader's method at this
size), this prints per device, forward, every encoder's exchange together:

- dense: what the old single all-to-all sent, n x C rows (C = the busiest device pair's
  rows rounded up to a power of two; the program the old `rearrange` compiled);
- staged: what the staged exchange sends (parallel/exchange_stages.py: every device sends
  each shift's bucketed capacity; `caps_bytes`), all links and inter-node only, plain and
  node-wise;
- payload: the rows really crossing nodes (a ragged exchange's bytes), plain and node-wise;
- ragged: the ragged exchange (parallel/ragged_tables.py, GPU `ragged_all_to_all`): its
  compiled send buffer (the busiest device's rows to other devices, bucketed: what a device
  may send at most) and the rows a device really sends, mean over devices (its links carry
  the send sizes, no padding); both follow the rows moved, not n;
- plan ms: host time to plan the staged exchange's capacities (relays, loads, buckets) from
  the per-device-pair row counts.

OrchMLLM reports node-wise inter-node volume ratios of 0.436-0.722 (§8).

  python scripts/bench_exchange.py [--ranks 8 64 512 2560] [--json bench_results/bench_exchange.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from bench_data import phase_lengths  # noqa: E402
from mmjax.data.balance import batches_by_rank, node_wise_rearrange, post_balance  # noqa: E402
from mmjax.parallel.exchange_stages import Topology, caps_bytes, needed_caps  # noqa: E402
from mmjax.parallel.ragged_tables import ragged_caps  # noqa: E402

ENCODERS = {"image": "vision", "audio": "audio"}


def _ranks_of(batches) -> dict[int, int]:
    return {s: r for r, b in enumerate(batches) for s in b}


def layouts(lengths: dict, d: int, rpn: int, node_wise: bool):
    """({encoder: {sample: src rank}}, {sample: LLM rank}, rows {encoder: array})."""
    src, rows = {}, {}
    for mod, e in ENCODERS.items():
        x = lengths[mod]
        members = np.flatnonzero(x > 0)
        src[e] = {int(members[i]): r for r, b in enumerate(post_balance(x[members], d, "sum"))
                  for i in b}
        rows[e] = x
    llm = post_balance(lengths["llm"], d, "sum")
    if node_wise and d > rpn:
        items_src, sizes, item_of = [], [], {}
        for e, where in src.items():
            for s, r in where.items():
                item_of.setdefault(s, []).append(len(items_src))
                items_src.append(r)
                sizes.append(float(rows[e][s]))
        new = [[i for s in b for i in item_of.get(s, ())] for b in llm]
        perm = node_wise_rearrange(items_src, new, sizes, rpn, method="greedy")
        llm = batches_by_rank(llm, perm)
    return src, _ranks_of(llm), rows


def counts(src: dict, dst: dict, rows: dict) -> dict[str, dict[tuple[int, int], int]]:
    """Per encoder, rows per (source device, destination device)."""
    out = {}
    for e, where in src.items():
        c: dict[tuple[int, int], int] = {}
        for s, u in where.items():
            key = (u, dst[s])
            c[key] = c.get(key, 0) + int(rows[e][s])
        out[e] = c
    return out


def measure(c: dict, d: int, rpn: int, row_bytes: int) -> dict:
    topo = Topology(d, rpn)
    node = lambda p: p // rpn
    dense = dense_inter = staged = staged_inter = payload_inter = 0
    ragged_buffer = ragged_sent = 0.0
    t0 = time.perf_counter()
    caps = {e: needed_caps(pairs, topo) for e, pairs in c.items()}
    plan_ms = (time.perf_counter() - t0) * 1e3
    for e, pairs in c.items():
        busiest = max(pairs.values(), default=0)
        cap = 1 << max(busiest - 1, 0).bit_length()
        dense += d * cap * row_bytes
        dense_inter += (d - rpn) * cap * row_bytes
        sent = caps_bytes(caps[e], topo, row_bytes)
        staged += (sent["intra_node"] + sent["inter_node"]) / d
        staged_inter += sent["inter_node"] / d
        payload_inter += sum(m for (u, v), m in pairs.items() if node(u) != node(v)) \
            * row_bytes / d
        ragged_buffer += ragged_caps(_matrix(pairs, d))[0] * row_bytes
        ragged_sent += sum(m for (u, v), m in pairs.items() if u != v) * row_bytes / d
    return dict(dense=dense, dense_inter=dense_inter, staged=staged, staged_inter=staged_inter,
                payload_inter=payload_inter, plan_ms=plan_ms, ragged_buffer=ragged_buffer,
                ragged_sent=ragged_sent)


def _matrix(pairs: dict, d: int) -> np.ndarray:
    """{(u, v): rows} as a [d, d] matrix."""
    out = np.zeros((d, d), np.int64)
    if pairs:
        uv = np.array(list(pairs), np.int64)
        out[uv[:, 0], uv[:, 1]] = np.fromiter(pairs.values(), np.int64, len(pairs))
    return out


def run(args, console) -> list[dict]:
    out = []
    row_bytes = args.hidden * 2
    for d in args.ranks:
        acc: dict = {}
        for seed in range(args.seeds):
            lengths = phase_lengths("mix", d * args.samples_per_rank, args.seed + seed)
            for name, nw in (("plain", False), ("node_wise", True)):
                t0 = time.perf_counter()
                src, dst, rows = layouts(lengths, d, args.rpn, nw)
                layout_ms = (time.perf_counter() - t0) * 1e3
                m = measure(counts(src, dst, rows), d, args.rpn, row_bytes)
                m["layout_ms"] = layout_ms
                for k, v in m.items():
                    acc.setdefault((name, k), []).append(v)
        row = {"ranks": d, "rpn": args.rpn, "samples_per_rank": args.samples_per_rank}
        for (name, k), v in acc.items():
            row[f"{name}_{k}"] = float(np.mean(v))
        row["staged_inter_ratio"] = (row["node_wise_staged_inter"] /
                                     max(row["plain_staged_inter"], 1e-9))
        row["payload_inter_ratio"] = (row["node_wise_payload_inter"] /
                                      max(row["plain_payload_inter"], 1e-9))
        out.append(row)
    mb = lambda x: f"{x / 2**20:,.1f}"
    t = Table(title=f"encoder->LLM exchange per device, forward (MiB; {args.samples_per_rank} "
                    f"samples/rank, {args.hidden}-wide bf16 rows, {args.rpn} ranks/node, mean "
                    f"of {args.seeds} batches)")
    for c in ("ranks", "dense (old)", "staged", "staged inter plain", "staged inter node-wise",
              "ratio", "payload inter plain", "payload inter node-wise", "ratio ",
              "ragged buffer", "ragged sent", "plan ms"):
        t.add_column(c, justify="right")
    for r in out:
        t.add_row(str(r["ranks"]), mb(r["plain_dense"]), mb(r["plain_staged"]),
                  mb(r["plain_staged_inter"]), mb(r["node_wise_staged_inter"]),
                  f"{r['staged_inter_ratio']:.2f}", mb(r["plain_payload_inter"]),
                  mb(r["node_wise_payload_inter"]), f"{r['payload_inter_ratio']:.2f}",
                  mb(r["node_wise_ragged_buffer"]), mb(r["node_wise_ragged_sent"]),
                  f"{r['node_wise_plan_ms']:.1f}")
    console.print(t)
    console.print("OrchMLLM §8: node-wise leaves 0.436-0.722 of plain post-balancing's "
                  "inter-node volume")
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 64, 512, 2560])
    p.add_argument("--rpn", type=int, default=8)
    p.add_argument("--samples_per_rank", type=int, default=8)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="bench_results/bench_exchange.json")
    args = p.parse_args(argv)
    console = Console()
    rows = run(args, console)
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"rows": rows, "args": vars(args)}, f, indent=2)
    console.print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
