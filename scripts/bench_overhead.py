#!/usr/bin/env python
"""What mmjax costs over a plain program, measured side by side in one run.

  python scripts/bench_overhead.py [--part step,loader] [--rounds 3]
                                   [--json bench_results/bench_overhead.json]

step    mmjax's single-program train step (train/step.py `make_train_step`, as the trainer
        calls it: the spike-guard limits and the learning rate as inputs, the state
        donated) of a text-only Llama-style LLM against a minimal pure-JAX + optax step of
        the same model written below (stacked layer weights scanned with `lax.scan`, dense
        causal attention, clip + AdamW, donated). Both start from the same weights: the
        first losses must agree (checked). Default 12 x 768, FFN 3072, vocabulary 48000:
        187M parameters, 2 x 512 tokens, float32. The two steps alternate, `--rounds`
        times each after one warm-up; the ratio is of medians.
loader  mmjax's LLaVA source (decode, resize, patchify, chat template, tokenise, loss
        mask) over the example set's records, against a plain loop over the same records:
        PIL decode + resize to the same grid, one chat-template render (Jinja2, as
        `apply_chat_template`) and one tokeniser call per sample. Samples/s each; ratio
        mmjax / plain (>= 0.9 is the issue-41 target).

The machine's load (1 min) is printed beside the figures: on a shared host the ratio is
the honest number, the absolute times are not.
"""
from __future__ import annotations

import argparse
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", default="step,loader")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--ffn", type=int, default=3072)
    ap.add_argument("--vocab", type=int, default=48000)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--data", default="/tmp/mmjax_bench_overhead")
    ap.add_argument("--samples", type=int, default=200)
    ap.add_argument("--passes", type=int, default=3, help="loader: passes over the records")
    ap.add_argument("--json", default=os.path.join(REPO, "bench_results",
                                                   "bench_overhead.json"))
    a = ap.parse_args(argv)
    from rich.console import Console
    from rich.table import Table

    from mmjax.cli import write_json

    parts = [p for p in a.part.split(",") if p]
    res = {"load_1min_start": os.getloadavg()[0]}
    if "step" in parts:
        from overhead_step import compare_steps
        res["step"] = compare_steps(a)
    if "loader" in parts:
        from overhead_loader import compare_loaders
        res["loader"] = compare_loaders(a)
    res["load_1min_end"] = os.getloadavg()[0]
    table = Table(title=f"mmjax against a plain program (load {res['load_1min_start']:.1f}"
                        f" -> {res['load_1min_end']:.1f})")
    for c in ("part", "mmjax", "plain", "ratio", "target"):
        table.add_column(c, justify="right" if c != "part" else "left")
    if "step" in res:
        s = res["step"]
        table.add_row(f"LLM step, {s['params'] / 1e6:.0f}M, {a.batch} x {a.seq} f32 (ms)",
                      f"{s['mmjax_ms']:.0f}", f"{s['plain_ms']:.0f}",
                      f"{s['ratio']:.3f}x time", "<= 1.05")
    if "loader" in res:
        s = res["loader"]
        table.add_row(f"LLaVA loader, {s['records']} records (samples/s)",
                      f"{s['mmjax_per_s']:.0f}", f"{s['plain_per_s']:.0f}",
                      f"{s['ratio']:.3f}x speed", ">= 0.9")
    Console().print(table)
    write_json(a.json, {"args": vars(a), **res})
    return 0


if __name__ == "__main__":
    from mmjax.cli import run_main

    sys.exit(run_main(main))
