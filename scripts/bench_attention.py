"""Attention implementations: forward+backward time and compiled memory, and CP work balance.

For each sequence length and mask family (causal, and Cornstarch Fig. 11's prepended (EP),
embedded (EE) and packing (MP) bitfield masks) it builds one row of token metadata and times
a jitted forward+backward of `bam_attention` (q [1, S, H, D], GQA k/v) per implementation,
and reads the compiled program's temporary memory from XLA's `memory_analysis()`. Cases past
`--run_max` tokens for an implementation are compiled only (memory, no time): on a CPU the
dense [S, S] path and the Pallas interpreter are too slow to run at long lengths. It also
counts the key tiles the block-sparse kernel visits (its work) against dense.

Then the CP work balance (Cornstarch §4.3.2, §5.3): per family, the sequence is distributed
over `--ranks` ranks by each method (uniform, zigzag, random, LPT) and every rank's attention
work is counted as the tiles its implementation computes: dense computes its whole L x N block
(balanced but maximal), chunked its non-empty 128 x 128 tiles, pallas its non-empty 128 x 32
tiles. Reported: max/mean over ranks and the makespan (max rank work) relative to dense.

  python scripts/bench_attention.py [--lengths 1024 4096 16384 65536] [--json ...] [--png ...]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import time

import jax
import jax.numpy as jnp
import numpy as np
from rich.console import Console
from rich.table import Table

from mmjax.models.attention import TokenMeta, bam_attention
from mmjax.data import token_distribution as td

IMPLS = ("dense", "chunked", "pallas")
GPU_IMPLS = IMPLS + ("cudnn",)  # cuDNN runs only the plain causal mask (one document per row)
SHORT = {"causal": "causal", "prepended": "EP", "embedded": "EE", "packing": "MP"}
TILES = {"chunked": (128, 128), "pallas": (128, td.DEFAULT_KEY_BLOCK)}


def row_meta(family: str, seq_len: int, seed: int = 0) -> tuple[td.BitfieldMask, TokenMeta]:
    m = td.example_mask(family, seq_len, seed)
    cols = (m.bam, m.doc, m.sub, np.arange(seq_len))
    return m, TokenMeta(*(jnp.asarray(np.asarray(a, np.int32)[None]) for a in cols))


def implementations(family: str, dtype) -> tuple[str, ...]:
    """What runs this mask here: cuDNN joins on a GPU for the plain causal mask in bf16."""
    if jax.default_backend() == "gpu" and family == "causal" and dtype == jnp.bfloat16:
        return GPU_IMPLS
    return IMPLS


def fwd_bwd(impl: str):
    """jit of (sum(out * cotangent), its grads in q, k, v). The metadata and the cotangent are
    arguments, as in training: closed over, XLA would constant-fold the mask. A random
    cotangent makes the gradient check see every output element, not only their sum."""
    mask_family = "causal" if impl == "cudnn" else "bam"

    def loss(q, k, v, meta, cotangent):
        out = bam_attention(q, k, v, meta, implementation=impl, mask_family=mask_family)
        return jnp.sum(out.astype(jnp.float32) * cotangent)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def _inputs(seq_len, heads, kv_heads, dim, dtype):
    ks = jax.random.split(jax.random.key(0), 4)
    shapes = [(1, seq_len, h, dim) for h in (heads, kv_heads, kv_heads)]
    qkv = [jax.random.normal(k, s, dtype) for k, s in zip(ks, shapes)]
    cot = jax.random.normal(ks[3], (1, seq_len, heads, dim), jnp.float32)
    return qkv, cot


def parity(compiled, impl, meta, seq_len, heads, kv_heads, dim, dtype) -> float:
    """Largest error of the grads in q, k, v against dense attention in float32 on the same
    inputs, relative to the largest reference gradient (bf16 rounding is ~4e-3)."""
    qkv, cot = _inputs(seq_len, heads, kv_heads, dim, dtype)
    _, got = compiled(*qkv, meta, cot)
    _, ref = fwd_bwd("dense")(*(a.astype(jnp.float32) for a in qkv), meta, cot)
    return max(float(jnp.max(jnp.abs(g.astype(jnp.float32) - r)) / jnp.max(jnp.abs(r)))
               for g, r in zip(got, ref))


def measure(impl, meta, seq_len, heads, kv_heads, dim, dtype, run: bool, repeats: int,
            check: bool = False) -> dict:
    shapes = [jax.ShapeDtypeStruct((1, seq_len, h, dim), dtype) for h in (heads, kv_heads, kv_heads)]
    cot_shape = jax.ShapeDtypeStruct((1, seq_len, heads, dim), jnp.float32)
    t0 = time.perf_counter()
    compiled = fwd_bwd(impl).lower(*shapes, meta, cot_shape).compile()
    out = {"compile_s": time.perf_counter() - t0,
           "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes), "time_s": None,
           "grad_error": None}
    if run:
        args, cot = _inputs(seq_len, heads, kv_heads, dim, dtype)
        jax.block_until_ready(compiled(*args, meta, cot))
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(*args, meta, cot))
            times.append(time.perf_counter() - t0)
        out["time_s"] = float(np.median(times))
    if check:
        out["grad_error"] = parity(compiled, impl, meta, seq_len, heads, kv_heads, dim, dtype)
    return out


def kernel_rows(args) -> list[dict]:
    rows = []
    dtype = jnp.dtype(args.dtype or ("bfloat16" if jax.default_backend() == "gpu" else "float32"))
    for seq_len in args.lengths:
        for family in args.families:
            mask, meta = row_meta(family, seq_len)
            bq, bk = TILES["pallas"]
            tiles = int(td.block_work(mask, bq, bk).sum() // (bq * bk))
            dense_tiles = -(-seq_len // bq) * -(-seq_len // bk)
            row = {"length": seq_len, "family": family, "pallas_tiles": tiles,
                   "dense_tiles": dense_tiles}
            for impl in implementations(family, dtype):
                run = seq_len <= args.run_max.get(impl, 0)
                compile_ok = seq_len <= args.compile_max.get(impl, 1 << 30)
                check = run and seq_len <= args.check_max
                row[impl] = (measure(impl, meta, seq_len, args.heads, args.kv_heads, args.dim,
                                     dtype, run, args.repeats, check) if compile_ok else None)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def cp_rows(args) -> list[dict]:
    """Per-rank attention work under each distribution, counted per implementation."""
    rows, n, g, blk = [], args.cp_length, args.ranks, 128
    for family in args.families:
        mask = td.example_mask(family, n, 0)
        row = {"family": family, "length": n, "ranks": g}
        for method in td.METHODS:
            dist = td.distribute(mask, g, method, blk, seed=0)
            per = {"dense": np.array([len(ids) * n for ids in dist], np.float64)}
            for impl, (bq, bk) in TILES.items():
                per[impl] = td.rank_work(td.block_work(mask, blk, bk), dist, blk).astype(float)
            row[method] = {impl: {"imbalance": float(w.max() / w.mean()),
                                  "makespan_vs_dense": float(w.max() / per["dense"].max()),
                                  "per_rank": w.tolist()} for impl, w in per.items()}
        rows.append(row)
    return rows


def _fmt_t(m):
    if m is None:
        return "-"
    t = "compile only" if m["time_s"] is None else f"{m['time_s'] * 1e3:.2f} ms"
    err = "" if m.get("grad_error") is None else f", err {m['grad_error']:.1e}"
    return f"{t}, {m['temp_bytes'] / 2 ** 20:.1f} MiB{err}"


def print_tables(console, krows, crows, args):
    impls = GPU_IMPLS if jax.default_backend() == "gpu" else IMPLS
    t = Table(title=f"bam_attention fwd+bwd on {jax.devices()[0].device_kind} "
                    f"(H={args.heads}, KV={args.kv_heads}, D={args.dim}): time, compiled temp, "
                    f"grad error vs float32 dense")
    for col in ("S", "Mask", *impls, "pallas tiles / dense"):
        t.add_column(col)
    for r in krows:
        t.add_row(str(r["length"]), SHORT[r["family"]], *(_fmt_t(r.get(i)) for i in impls),
                  f"{r['pallas_tiles'] / r['dense_tiles']:.2f}")
    console.print(t)
    t2 = Table(title=f"CP work per rank ({crows[0]['ranks']} ranks, {crows[0]['length']} tokens, "
                     f"query blocks of 128): max/mean, makespan vs dense")
    for col in ("Mask", "Method", *(f"{i}" for i in ("dense", *TILES))):
        t2.add_column(col)
    for r in crows:
        for method in td.METHODS:
            c = r[method]
            t2.add_row(SHORT[r["family"]], method, *(
                f"{c[i]['imbalance']:.3f} / {c[i]['makespan_vs_dense']:.2f}"
                for i in ("dense", *TILES)))
    console.print(t2)


def plot(krows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for impl, style in zip(GPU_IMPLS, ("o-", "s-", "^-", "d-")):
        for family, alpha in (("causal", 1.0), ("packing", 0.5)):
            pts = [(r["length"], r[impl]) for r in krows
                   if r["family"] == family and r.get(impl)]
            lab = f"{impl} ({SHORT[family]})"
            mem = [(s, m["temp_bytes"] / 2 ** 20) for s, m in pts]
            tim = [(s, m["time_s"] * 1e3) for s, m in pts if m["time_s"] is not None]
            if mem:
                axes[1].plot(*zip(*mem), style, alpha=alpha, label=lab)
            if tim:
                axes[0].plot(*zip(*tim), style, alpha=alpha, label=lab)
    for ax, ylab in zip(axes, ("fwd+bwd time (ms)", "compiled temp memory (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length")
        ax.set_ylabel(ylab)
        ax.legend(fontsize=7)
    fig.suptitle(f"bam_attention on {jax.devices()[0].device_kind}")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384, 65536])
    ap.add_argument("--families", nargs="+", default=list(td.FAMILIES), choices=td.FAMILIES)
    ap.add_argument("--dtype", default=None, choices=("float32", "bfloat16"),
                    help="q/k/v dtype (default: bfloat16 on GPU, float32 elsewhere)")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv_heads", type=int, default=2)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--run_max", type=json.loads,
                    default={"dense": 4096, "chunked": 16384, "pallas": 1024},
                    help="per implementation, the longest length that is timed (JSON)")
    ap.add_argument("--compile_max", type=json.loads, default={"dense": 16384, "pallas": 16384},
                    help="per implementation, the longest length that is compiled (JSON)")
    ap.add_argument("--check_max", type=int, default=4096,
                    help="grads checked against float32 dense up to this length (timed cases)")
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--cp_length", type=int, default=16384)
    ap.add_argument("--json", default="bench_results/attention.json")
    ap.add_argument("--png", default="bench_results/attention.png")
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    console = Console(width=160)
    krows = kernel_rows(args)
    crows = cp_rows(args)
    print_tables(console, krows, crows, args)
    record = {"device": str(jax.devices()[0].device_kind), "backend": jax.default_backend(),
              "args": vars(args), "kernels": krows, "cp": crows}
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(record, f, indent=2)
    plot(krows, args.png)
    console.print(f"wrote {args.json} and {args.png}")
    return record


if __name__ == "__main__":
    from mmjax.cli import run_main

    sys.exit(run_main(main))
