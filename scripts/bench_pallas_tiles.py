"""Tune the block-sparse Pallas attention kernel: forward + backward time per tile shape and
Triton (num_warps, num_stages), against cuDNN on the plain causal mask.

One row of `--lengths` tokens with `--heads` query heads over `--kv_heads` GQA heads of
`--dim`, bf16, causal (one document). For each configuration "BQxBK[:warps:stages]" it
compiles `pallas_attention` forward + backward (jitted `value_and_grad`), times the median of
`--repeats` runs, and checks dq/dk/dv against cuDNN's at the first length (largest error
relative to the largest gradient; bf16 rounding is ~4e-3). Prints a table (time, ratio to
cuDNN) and writes JSON. GPU only (on CPU the kernel runs interpreted: use tiny lengths).

  python scripts/bench_pallas_tiles.py [--lengths 4096 16384 32768]
      [--configs 128x32 128x64 128x128:8:3 64x64] [--json bench_results/pallas_tiles.json]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np
from rich.console import Console
from rich.table import Table

from mmjax.cli import UserError, run_main, write_json
from mmjax.models.attention import TokenMeta, bam_attention
from mmjax.models.attention_pallas import pallas_attention


def parse_config(text: str) -> tuple[int, int, int | None, int | None]:
    """"128x64" or "128x64:8:3" -> (block_q, block_k, num_warps, num_stages)."""
    parts = text.split(":")
    try:
        bq, bk = (int(x) for x in parts[0].split("x"))
        extra = [int(x) if x else None for x in parts[1:]] + [None, None]
    except ValueError:
        raise UserError(f"--configs entry {text!r} is not BQxBK[:warps[:stages]] "
                        f"(e.g. 128x64 or 128x64:4:3)") from None
    for b in (bq, bk):
        if b < 16 or b & (b - 1):
            raise UserError(f"--configs entry {text!r}: tile sizes must be powers of two >= 16 "
                            f"(Triton's rule)")
    return bq, bk, extra[0], extra[1]


def causal_meta(n: int) -> TokenMeta:
    """One causal text document: bam bit 0 (text), doc 1, sub 1, idx 0..n-1."""
    idx = jnp.arange(n, dtype=jnp.int32)[None]
    one = jnp.ones((1, n), jnp.int32)
    return TokenMeta(one, one, one, idx)


def fwd_bwd(attend):
    def loss(q, k, v, cot):
        return jnp.sum(attend(q, k, v).astype(jnp.float32) * cot)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def timed(fn, args, repeats: int) -> tuple[float, float, object]:
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*args))  # compile + first run
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), first, out


def run(args) -> dict:
    configs = [parse_config(c) for c in args.configs]
    gpu = jax.default_backend() == "gpu"
    rows = []
    for n in args.lengths:
        ks = jax.random.split(jax.random.key(0), 4)
        shapes = [(1, n, h, args.dim) for h in (args.heads, args.kv_heads, args.kv_heads)]
        q, k, v = (jax.random.normal(kk, s, jnp.bfloat16) for kk, s in zip(ks, shapes))
        cot = jax.random.normal(ks[3], shapes[0], jnp.float32)
        meta = causal_meta(n)
        row = {"length": n}
        ref = None
        if gpu:
            f = fwd_bwd(lambda q, k, v: bam_attention(q, k, v, meta, implementation="cudnn",
                                                      mask_family="causal"))
            row["cudnn_s"], _, ref = timed(f, (q, k, v, cot), args.repeats)
        for bq, bk, warps, stages in configs:
            name = f"{bq}x{bk}" + (f":{warps}:{stages}" if (warps, stages) != (None, None) else "")
            f = fwd_bwd(lambda q, k, v, bq=bq, bk=bk, w=(warps, stages): pallas_attention(
                q, k, v, meta, meta, block_q=bq, block_k=bk, warps=w))
            try:
                t, first, out = timed(f, (q, k, v, cot), args.repeats)
            except Exception as e:  # a configuration Triton cannot compile (shared memory)
                row[name] = {"error": f"{type(e).__name__}: {str(e)[:160]}"}
                print(f"{n} {name}: {row[name]['error']}", flush=True)
                continue
            cell = {"time_s": t, "first_s": first}
            if ref is not None and n == args.lengths[0]:
                cell["grad_error"] = max(
                    float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))
                          / jnp.max(jnp.abs(b.astype(jnp.float32))))
                    for a, b in zip(out[1], ref[1]))
            row[name] = cell
            print(f"{n} {name}: {t * 1e3:.2f} ms" + (f" ({t / row['cudnn_s']:.2f}x cuDNN)"
                                                     if gpu else ""), flush=True)
        rows.append(row)
    return {"device": str(jax.devices()[0].device_kind), "backend": jax.default_backend(),
            "jax": jax.__version__, "heads": args.heads, "kv_heads": args.kv_heads,
            "dim": args.dim, "repeats": args.repeats, "rows": rows}


def show(r) -> None:
    t = Table(title=f"Pallas causal fwd+bwd on {r['device']} (bf16, {r['heads']}/"
                    f"{r['kv_heads']} heads x {r['dim']})")
    names = [k for k in r["rows"][0] if k not in ("length", "cudnn_s")]
    t.add_column("S")
    t.add_column("cuDNN")
    for n in names:
        t.add_column(n)
    for row in r["rows"]:
        c = row.get("cudnn_s")
        cells = []
        for n in names:
            x = row.get(n) or {}
            if "time_s" not in x:
                cells.append("fails")
            else:
                cells.append(f"{x['time_s'] * 1e3:.2f} ms" + (f" ({x['time_s'] / c:.2f}x)" if c else ""))
        t.add_row(str(row["length"]), f"{c * 1e3:.2f} ms" if c else "-", *cells)
    Console().print(t)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 32768])
    ap.add_argument("--configs", nargs="+",
                    default=["128x32", "64x64", "64x32", "128x64", "64x64:4:3", "64x64:8:2"])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv_heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=os.path.join("bench_results", "pallas_tiles.json"))
    args = ap.parse_args(argv)
    r = run(args)
    show(r)
    write_json(args.json, r)
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
