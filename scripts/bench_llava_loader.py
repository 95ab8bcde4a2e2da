#!/usr/bin/env python
"""Does the real-data loader keep up? The tiny LLaVA run (configs/examples/llava_tiny.gin on
scripts/make_example_data.py's set) with the trainer's wait for data per step as a share of
the step (MMScale §6 / DistTrain §4.2: preprocessing must stay off the training path), plus
the loader alone (decode + chat render + assembly, samples/s) and the sidecar index build
(cold, then cached).

  python scripts/bench_llava_loader.py [--steps 60] [--data /tmp/llava_bench]
                                       [--json bench_results/bench_llava_loader.json]

Steps whose shapes grew (a jit compile) are left out of the wait share: they measure the
compiler, not the loader; the table says how many.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import gin

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def index_build(data: str) -> dict:
    from mmjax.data.sources import default_processors
    from mmjax.data.sources.llava import LlavaSource
    from mmjax.data.tokenizer import Tokenizer
    from mmjax.models.tiny import tiny

    tok = Tokenizer(os.path.join(data, "tokenizer"))
    img, aud = default_processors(tiny(), None, None)
    out = {}
    for label in ("cold", "cached"):
        if label == "cold" and os.path.exists(os.path.join(data, "train.json.mmjax_index.json")):
            os.remove(os.path.join(data, "train.json.mmjax_index.json"))
        t = time.perf_counter()
        src = LlavaSource(os.path.join(data, "train.json"), tok, img, aud,
                          os.path.join(data, "images"))
        out[f"index_{label}_s"] = time.perf_counter() - t
    out["records"] = len(src)
    return out, src


def loader_alone(src, layout, batches: int = 20, global_batch: int = 8) -> dict:
    from mmjax.data.stream import SourceBatches

    data = SourceBatches(src, layout, global_batch, prefetch=1)
    next(data)
    t = time.perf_counter()
    for _ in range(batches):
        next(data)
    dt = time.perf_counter() - t
    data.close()
    return {"loader_samples_per_s": batches * global_batch / dt,
            "loader_batch_ms": 1e3 * dt / batches}


def training(data: str, steps: int, workdir: str) -> dict:
    from mmjax.train.trainer import train

    gin.parse_config_files_and_bindings(
        [os.path.join(REPO, "configs", "examples", "llava_tiny.gin")],
        [f"tokenizer.path = '{data}/tokenizer'", f"llava_source.json_path = '{data}/train.json'",
         f"llava_source.image_root = '{data}/images'", f"train.steps = {steps}",
         f"train.checkpoint_every = {steps * 10}", "train.progress = False"],
        finalize_config=False)
    try:
        recs = train(workdir)
    finally:
        gin.clear_config()
    times = [r["step_time_s"] for r in recs]
    med = statistics.median(times)
    steady = [r for r in recs[3:] if r["step_time_s"] < 3 * med]  # no compile in the step
    wait = sum(r["data_wait_s"] for r in steady)
    total = wait + sum(r["step_time_s"] for r in steady)
    return {"steps": len(recs), "steady_steps": len(steady),
            "step_ms_median": 1e3 * med,
            "data_wait_ms_mean": 1e3 * wait / max(len(steady), 1),
            "data_wait_share_pct": 100 * wait / max(total, 1e-9),
            "data_wait_ms_max": 1e3 * max([r["data_wait_s"] for r in steady] or [0.0]),
            "final_loss": recs[-1]["loss"], "skipped_samples": recs[-1]["skipped_samples"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--data", default="/tmp/llava_bench")
    ap.add_argument("--num_samples", type=int, default=200)
    ap.add_argument("--json", default=os.path.join(REPO, "bench_results", "bench_llava_loader.json"))
    a = ap.parse_args(argv)
    from rich.console import Console
    from rich.table import Table

    from mmjax.data.example_data import write_llava_example
    from mmjax.train.config import named_model_config
    from mmjax.cli import write_json
    from mmjax.train.data_config import data_layout, fit_vocab

    write_llava_example(a.data, a.num_samples)
    res, src = index_build(a.data)
    gin.parse_config_file(os.path.join(REPO, "configs", "examples", "llava_tiny.gin"))
    tok = src.builder.tokenizer
    cfg = fit_vocab(named_model_config(), tok)
    layout = data_layout(cfg, special=tok.special_tokens())
    gin.clear_config()
    from mmjax.data.sources import default_processors
    src.image_processor = default_processors(cfg, None, None)[0]  # the run's max_grid
    res.update(loader_alone(src, layout))
    res.update(training(a.data, a.steps, os.path.join(a.data, "run")))
    table = Table(title="tiny LLaVA run: loader vs trainer (CPU)")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for k, v in res.items():
        table.add_row(k, f"{v:.3f}" if isinstance(v, float) else str(v))
    Console().print(table)
    write_json(a.json, res)
    return 0


if __name__ == "__main__":
    from mmjax.cli import run_main

    sys.exit(run_main(main))
