"""Benchmark overlapped TP (DistTrain §7, StepCCL): decomposed collective matmuls vs GSPMD.

For each (tokens, hidden, tp) shape, one Megatron sequence-parallel MLP-style layer
    y = reduce_scatter(all_gather(x) @ w1) @ w2,   x [tokens, hidden], w1 [hidden, 4 hidden]
is timed forward+backward (value_and_grad of sum(y^2)) as:
  gspmd            plain dots under sharding constraints (XLA inserts all-gather /
                   reduce-scatter),
  uni-cK / bi-cK   mmjax.parallel.collective_matmul, uni/bidirectional ring, K chunks,
  xla-windowed     (GPU, or --windowed=on) the gspmd program compiled with XLA's own windowed
                   einsum, --xla_gpu_threshold_for_windowed_einsum_mib=0, confirmed by the
                   `windowed_dot_general` markers in the dumped HLO.
Every variant's loss and gradients are checked against gspmd (max relative error).

On CPU the collective-permutes are executed synchronously by the host runtime, so CPU
timings do NOT show communication/computation overlap; they show correctness and the
compile/step cost of the decomposition only.

    python scripts/bench_collective_matmul.py [--shapes 1024,256,4;2048,512,8]
        [--chunks 1,2] [--steps 5] [--dtype float32] [--json bench_results/collective_matmul.json]
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from mmjax.cpu_threads import force_cpu_devices  # noqa: E402

force_cpu_devices(8)  # only affects the CPU platform: lets the CPU run show tp up to 8
from mmjax.errors import UserError  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from mmjax.parallel.collective_matmul import (  # noqa: E402
    allgather_matmul_on_mesh,
    matmul_reducescatter_on_mesh,
    plain_sharded_matmuls,
)

WINDOWED_FLAG = "xla_gpu_threshold_for_windowed_einsum_mib"
WINDOWED_MARKER = "windowed_dot_general"


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    shapes = []
    for item in text.split(";"):
        parts = [p for p in item.replace(" ", "").split(",") if p]
        if len(parts) != 3:
            raise UserError(f"--shapes: expected 'tokens,hidden,tp;...', got {item!r}")
        tokens, hidden, tp = map(int, parts)
        if tokens % tp or (4 * hidden) % tp:
            raise UserError(f"--shapes: tokens {tokens} and 4*hidden {4 * hidden} must "
                             f"divide by tp {tp}")
        shapes.append((tokens, hidden, tp))
    return shapes


def layer_step(column, row):
    """value_and_grad of sum(y^2), y = row(column(x, w1), w2)."""

    def loss(x, w1, w2):
        y = row(column(x, w1), w2).astype(jnp.float32)
        return jnp.sum(y * y)

    return jax.value_and_grad(loss, argnums=(0, 1, 2))


def variants(mesh, chunks: list[int]):
    column, row = plain_sharded_matmuls(mesh)
    out = {"gspmd": layer_step(column, row)}
    for bidi in (False, True):
        for c in chunks:
            kw = dict(num_chunks=c, bidirectional=bidi)
            out[f"{'bi' if bidi else 'uni'}-c{c}"] = layer_step(
                lambda x, w, kw=kw: allgather_matmul_on_mesh(x, w, mesh, **kw),
                lambda x, w, kw=kw: matmul_reducescatter_on_mesh(x, w, mesh, **kw),
            )
    return out


def count_windowed_markers(dump_dir: str, compiled_text: str) -> int:
    """`windowed_dot_general` occurrences in the dumped HLO (after optimisations), or in the
    compiled module text if the dump is empty."""
    files = glob.glob(os.path.join(dump_dir, "*after_optimizations.txt"))
    count = 0
    for f in files:
        with open(f, errors="replace") as fh:
            count += fh.read().count(WINDOWED_MARKER)
    return count or compiled_text.count(WINDOWED_MARKER)


def run_variant(step, args_, steps: int, compiler_options=None):
    t0 = time.perf_counter()
    compiled = jax.jit(step).lower(*args_).compile(compiler_options=compiler_options)
    compile_s = time.perf_counter() - t0
    out = jax.block_until_ready(compiled(*args_))  # warm-up
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = jax.block_until_ready(compiled(*args_))
        times.append(time.perf_counter() - t0)
    return compiled, out, compile_s, times


def max_rel_err(out, ref) -> float:
    errs = []
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        errs.append(float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)))
    return max(errs)


def bench_shape(tokens, hidden, tp, args, windowed: bool):
    mesh = Mesh(np.array(jax.devices()[:tp]), ("tp",))
    dtype = jnp.dtype(args.dtype)
    rng = np.random.default_rng(0)
    x = jax.device_put(rng.standard_normal((tokens, hidden)).astype(dtype),
                       NamedSharding(mesh, P("tp", None)))
    w1 = jax.device_put((rng.standard_normal((hidden, 4 * hidden)) / np.sqrt(hidden))
                        .astype(dtype), NamedSharding(mesh, P(None, "tp")))
    w2 = jax.device_put((rng.standard_normal((4 * hidden, hidden)) / np.sqrt(4 * hidden))
                        .astype(dtype), NamedSharding(mesh, P("tp", None)))
    inputs = (x, w1, w2)
    flops = 3 * 2 * (2 * tokens * hidden * 4 * hidden)  # fwd + 2x bwd, two matmuls
    rows, ref = [], None
    for name, step in variants(mesh, args.chunks).items():
        _, out, compile_s, times = run_variant(step, inputs, args.steps)
        ref = out if name == "gspmd" else ref
        rows.append(row_record(name, tokens, hidden, tp, compile_s, times, flops,
                               max_rel_err(out, ref)))
    if windowed:
        rows.append(windowed_row(tokens, hidden, tp, mesh, inputs, args, flops, ref))
    return rows


def windowed_row(tokens, hidden, tp, mesh, inputs, args, flops, ref):
    column, row = plain_sharded_matmuls(mesh)
    with tempfile.TemporaryDirectory(prefix="mmjax_windowed_") as dump_dir:
        options = {WINDOWED_FLAG: 0, "xla_dump_to": dump_dir, "xla_dump_hlo_as_text": True}
        try:
            compiled, out, compile_s, times = run_variant(
                layer_step(column, row), inputs, args.steps, options)
        except Exception as e:  # report, do not hide: the row says why it has no timing
            return {"variant": "xla-windowed", "tokens": tokens, "hidden": hidden, "tp": tp,
                    "error": f"{type(e).__name__}: {e}"}
        markers = count_windowed_markers(dump_dir, compiled.as_text())
    rec = row_record("xla-windowed", tokens, hidden, tp, compile_s, times, flops,
                     max_rel_err(out, ref))
    rec["windowed_dot_general_markers"] = markers
    return rec


def row_record(name, tokens, hidden, tp, compile_s, times, flops, err):
    step = statistics.median(times)
    return {"variant": name, "tokens": tokens, "hidden": hidden, "tp": tp,
            "compile_s": compile_s, "step_s_median": step, "step_s_min": min(times),
            "tflops_per_s": flops / step / 1e12, "max_rel_err_vs_gspmd": err}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="512,128,2;1024,256,4;1024,256,8",
                    help="'tokens,hidden,tp;...' (tp devices each)")
    ap.add_argument("--chunks", default="1,2", help="chunk counts for the decomposed variants")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--windowed", default="auto", choices=["auto", "on", "off"],
                    help="time XLA's windowed einsum (auto: on GPU only)")
    ap.add_argument("--json", default="bench_results/collective_matmul.json")
    args = ap.parse_args(argv)
    args.chunks = [int(c) for c in args.chunks.split(",") if c]
    if not args.chunks or min(args.chunks) < 1:
        raise UserError("--chunks: give positive integers, e.g. 1,2,4")

    console = Console(width=None if sys.stdout.isatty() else 140)
    platform = jax.default_backend()
    windowed = args.windowed == "on" or (args.windowed == "auto" and platform == "gpu")
    n_dev = len(jax.devices())
    notes = []
    if platform == "cpu":
        notes.append("CPU run: collective-permutes execute synchronously on the host, so these "
                     "timings do NOT show communication/computation overlap; they report "
                     "correctness and compile/step cost only.")
    records = []
    for tokens, hidden, tp in parse_shapes(args.shapes):
        if tp > n_dev:
            notes.append(f"skipped tokens={tokens} hidden={hidden} tp={tp}: only {n_dev} "
                         f"{platform} device(s)")
            continue
        records += bench_shape(tokens, hidden, tp, args, windowed)

    if windowed and any(r.get("windowed_dot_general_markers") == 0 for r in records):
        why = " (the flag is GPU-only)" if platform != "gpu" else ""
        notes.append(f"no '{WINDOWED_MARKER}' in some dumped HLO: XLA did not apply windowed "
                     f"einsum to those programs{why}; their xla-windowed rows are plain GSPMD.")
    table = Table(title=f"collective matmul, fwd+bwd, {platform} ({jax.devices()[0].device_kind})")
    for col in ("tokens", "hidden", "tp", "variant", "compile s", "step ms", "TFLOP/s",
                "rel err vs gspmd", "windowed markers"):
        table.add_column(col, justify="right")
    for r in records:
        if "error" in r:
            table.add_row(str(r["tokens"]), str(r["hidden"]), str(r["tp"]), r["variant"],
                          "-", "-", "-", "-", f"error: {r['error'][:40]}")
            continue
        table.add_row(str(r["tokens"]), str(r["hidden"]), str(r["tp"]), r["variant"],
                      f"{r['compile_s']:.2f}", f"{1e3 * r['step_s_median']:.3f}",
                      f"{r['tflops_per_s']:.3f}", f"{r['max_rel_err_vs_gspmd']:.1e}",
                      str(r.get("windowed_dot_general_markers", "")))
    console.print(table)
    for note in notes:
        console.print(f"[bold]note:[/bold] {note}")

    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"platform": platform, "device_kind": jax.devices()[0].device_kind,
                   "dtype": args.dtype, "chunks": args.chunks, "steps": args.steps,
                   "notes": notes, "results": records}, f, indent=2)
    console.print(f"wrote {args.json}")
    bad = [r for r in records if r.get("max_rel_err_vs_gspmd", 0.0) > 1e-3 and
           args.dtype == "float32"]
    return 1 if bad else 0


if __name__ == "__main__":
    from mmjax.cli import run_main

    sys.exit(run_main(main))
