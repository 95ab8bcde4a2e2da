#!/usr/bin/env python
"""What a checkpoint costs (train/checkpoint.py): the time the training loop is blocked by
`save` (checksums, the device-to-host copy, orbax's async start), the time until the save
has committed in the background, and a restore with verification, for the parameters and
AdamW moments of a model (fp32), on this machine's disk.

  python scripts/bench_checkpoint.py [--models tiny disttrain/mllm_9b_mid] [--repeats 3]
                                     [--json bench_results/bench_checkpoint.json]

`disttrain/mllm_9b_mid --llm_only` (its LLM: 0.67B parameters, 8 GB with the moments) peaks
near 3x that in host memory (the state, orbax's host copy, the restored copy): run it alone,
with `--repeats 1`, on a 24 GB machine.
"""
from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def train_state(name: str, llm_only: bool) -> dict:
    """{name: array}: fp32 parameters and both AdamW moments of `name`, jitted init."""
    import jax
    import optax
    from flax import nnx

    from mmjax.models.mllm import MultimodalModel
    from mmjax.parallel.sharded_init import init_split
    from mmjax.pipeline.stage_modules import stage_module
    from mmjax.train.config import named_model_config

    cfg = named_model_config(name)
    if llm_only:
        made = (stage_module, (cfg, "llm", 0, cfg.llm.num_layers))
    else:
        made = (MultimodalModel, (cfg,))
    _, params, _ = init_split(*made, jax.random.key(0), (nnx.Param, ...))
    opt = jax.jit(optax.adamw(1e-4).init)(params)
    flat = jax.tree_util.tree_flatten_with_path({"params": params, "opt": opt})[0]
    return {jax.tree_util.keystr(p): x for p, x in flat if getattr(x, "ndim", 0) > 0}


def measure(state: dict, repeats: int) -> dict:
    import jax

    from mmjax.train.checkpoint import Checkpointer

    rows = {"save_call_s": [], "commit_s": [], "restore_s": []}
    nbytes = sum(x.nbytes for x in state.values())
    for r in range(repeats):
        root = tempfile.mkdtemp(prefix="mmjax_ckpt_", dir=os.environ.get("TMPDIR"))
        try:
            ck = Checkpointer(os.path.join(root, "checkpoints"), log=lambda m: None)
            t0 = time.perf_counter()
            ck.save(1, state, {"next_batch": 1})
            t1 = time.perf_counter()
            ck.wait()
            t2 = time.perf_counter()
            like = {n: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                    for n, x in state.items()}
            t3 = time.perf_counter()
            got, _ = ck.restore(1, like)
            jax.block_until_ready(got)
            t4 = time.perf_counter()
            ck.close()
            rows["save_call_s"].append(t1 - t0)
            rows["commit_s"].append(t2 - t0)
            rows["restore_s"].append(t4 - t3)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    out = {k: statistics.median(v) for k, v in rows.items()}
    out["gb"] = nbytes / 1e9
    out["arrays"] = len(state)
    out["save_gb_per_s"] = out["gb"] / out["commit_s"]
    out["restore_gb_per_s"] = out["gb"] / out["restore_s"]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["tiny"],
                    help="named configs (tiny, disttrain/mllm_9b_mid, ...)")
    ap.add_argument("--llm_only", action="store_true",
                    help="only the LLM unit's parameters and moments")
    ap.add_argument("--repeats", type=int, default=3, help="median of this many saves")
    ap.add_argument("--json", default="bench_results/bench_checkpoint.json",
                    help="where the results go")
    a = ap.parse_args(argv)
    from rich.console import Console
    from rich.table import Table

    from mmjax.cli import write_json

    res = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
           "repeats": a.repeats, "models": {}}
    t = Table(title=f"checkpoint cost, median of {a.repeats}"
              + (" (LLM only)" if a.llm_only else ""))
    for c in ("model", "GB", "arrays", "save blocks s", "commit s", "restore s",
              "save GB/s", "restore GB/s"):
        t.add_column(c)
    for name in a.models:
        r = measure(train_state(name, a.llm_only), a.repeats)
        res["models"][name] = r
        t.add_row(name, f"{r['gb']:.3f}", str(r["arrays"]), f"{r['save_call_s']:.3f}",
                  f"{r['commit_s']:.2f}", f"{r['restore_s']:.2f}",
                  f"{r['save_gb_per_s']:.2f}", f"{r['restore_gb_per_s']:.2f}")
    Console(width=120).print(t)
    write_json(a.json, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
