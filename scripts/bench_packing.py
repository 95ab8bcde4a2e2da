"""LLM row fill and host time of the packing, before (rows first fit in batch order, frozen in
tests/packing_reference.py) and after issue 41's item 2 (rows first fit decreasing by length,
`batch_shapes.pack_rows`), host side only (no JAX).

Parts (``--parts``, default 1 2 3 4):
  1. Fill of one rank's rows over `--steps` global batches of `--global_batch` samples (each
     size given), LLaVA-like (data/synthetic.py `LLAVA_LIKE`, ~1.1k LLM tokens a sample) and
     LAION-like mixes, at 2048 and 4096 tokens per row: per step real tokens / (rows rounded
     to `shape_bucket` x seq_len); "run" is the fill at the run's one static shape, the
     largest step's (the loader's shape floor: what `metrics.jsonl`'s `llm_fill` and
     bench_step.py report); "bound" the fill of perfect packing (ceil(tokens / seq_len) rows,
     no bucket) at the same floor. Also the vision tower's packed patches (unchanged).
  2. The loader's own plan (`plan_global_batch`) at LLM DP `--dp` x `--microbatches`:
     `packing_fill.llm_fill` with the LLM split by "none", "disttrain" (DistTrain §6
     reordering) and "orchmllm" (OrchMLLM §5.1 post-balancing): every rank pays the
     fullest rank's rows.
  3. Host time: the assembly packers (Python, per global batch) and the plan's compiled row
     counts over 2,560 ranks x 60 samples (bench_host_plan.py's scale).
  4. `Loader.row_budget` (data/row_budget.py): the loader's own selection of each step's
     samples from its window (global_batch + reserve candidates) into a fixed number of
     rows, the largest `shape_bucket` value under the rows `--global_batch` average samples
     need; fill at the run's one static shape, samples per step.

  python scripts/bench_packing.py [--parts 1 2 3] [--json bench_results/bench_packing.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
from rich.console import Console
from rich.table import Table

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(_HERE, "..", "tests"))
sys.path.insert(0, os.path.join(_HERE, ".."))
import packing_reference as before  # noqa: E402  (rows first fit in order, frozen)

from mmjax.data.batch_plan import plan_global_batch, unit_policies  # noqa: E402
from mmjax.data.batch_shapes import image_runs, pack_images, pack_rows  # noqa: E402
from mmjax.data.layout import check_shapes, shape_bucket  # noqa: E402
from mmjax.data.packing_fill import llm_fill  # noqa: E402
from mmjax.data.packing_kernels import first_fit_decreasing_buffers  # noqa: E402
from mmjax.data.synthetic import LLAVA_LIKE  # noqa: E402
from mmjax.host_info import machine  # noqa: E402
from mmjax.planner.plan import Plan  # noqa: E402
from mmjax.train.config import named_model_config  # noqa: E402
from mmjax.train.data_config import data_layout, synthetic_dataset  # noqa: E402

# bench_step.py's llava_1b shapes that set token counts: patch 14, grids up to 32, 32^2 latents
MODEL = named_model_config("tiny", {"encoders.vision.encoder.patch_size": 14,
                                    "encoders.vision.encoder.max_grid": 32,
                                    "generator.latent_size": 32})
MIXES = {"llava": LLAVA_LIKE,  # bench_data.py's LAION-like text and image sizes, grids <= 32
         "laion": {"image_side_median": 24.0, "image_side_range": (4, 32),
                   "text_len_median": 30.0, "text_len_range": (1, 1024)}}
SEQ_LENS = (2048, 4096)


def batches(mix: str, seq_len: int, global_batch: int, steps: int, seed: int = 0):
    """(layout, [metas of each global batch]): usable samples in stream order (those longer
    than a row skipped, as the loader does), `steps` batches of `global_batch`."""
    layout = data_layout(MODEL, seq_len=seq_len, packing="pack", vision_caps=(256, 1024, 4096))
    ds = synthetic_dataset(MODEL, seed=seed, **MIXES[mix])
    metas, i = [], 0
    while len(metas) < steps * global_batch:
        spec = ds.spec(i)
        if check_shapes(spec, layout) is None:
            metas.append(layout.rules.meta_from_shapes(i, spec))
        i += 1
    return layout, [metas[k * global_batch:(k + 1) * global_batch] for k in range(steps)]


def rows_of(packer, metas, seq_len: int) -> int:
    return max(packer([m.llm_length for m in metas], seq_len, "pack")) + 1


def part1_fill(args, console) -> list[dict]:
    out = []
    for mix in MIXES:
        for seq in SEQ_LENS:
            for gb in args.global_batch:
                layout, steps = batches(mix, seq, gb, args.steps, args.seed)
                tokens = np.array([sum(m.llm_length for m in b) for b in steps], float)
                row = {"mix": mix, "seq_len": seq, "global_batch": gb, "steps": args.steps,
                       "tokens_per_sample": float(tokens.sum() / (gb * args.steps)),
                       "over_half_row": float(np.mean([m.llm_length > seq / 2
                                                       for b in steps for m in b]))}
                for name, packer in (("before", before.pack_rows), ("after", pack_rows)):
                    rows = np.array([shape_bucket(rows_of(packer, b, seq)) for b in steps])
                    row[name] = {"step": float(np.mean(tokens / (rows * seq))),
                                 "run": float(tokens.mean() / (rows.max() * seq))}
                ideal = np.ceil(tokens / seq)
                row["bound"] = {"step": float(np.mean(tokens / (ideal * seq))),
                                "run": float(tokens.mean() / (ideal.max() * seq))}
                row["vision"] = vision_fill(layout, steps)
                out.append(row)
    t = Table(title=f"(1) LLM row fill, one rank, {args.steps} global batches: per step / at the "
                    f"run's one static shape (the largest step's)")
    for c in ("mix", "seq", "batch", "tokens / sample", "> half a row", "before", "after",
              "bound (perfect packing)", "vision patches"):
        t.add_column(c, justify="right")
    for r in out:
        t.add_row(r["mix"], str(r["seq_len"]), str(r["global_batch"]),
                  f"{r['tokens_per_sample']:.0f}", f"{r['over_half_row']:.2f}",
                  *(f"{r[k]['step']:.3f} / {r[k]['run']:.3f}"
                    for k in ("before", "after", "bound")),
                  f"{r['vision']:.3f}")
    console.print(t)
    return out


def vision_fill(layout, steps) -> float:
    """Mean over steps of the vision tower's real patches / (buffers rounded to
    `shape_bucket` x the bucket capacity that fits the largest image)."""
    slot = layout.encoders[0]
    fills = []
    for metas in steps:
        runs = image_runs(metas, slot)
        cap = next(c for c in layout.vision_caps if c >= max(runs))
        placed = pack_images(runs, cap, slot.items_per_buffer)
        count = shape_bucket(max(b for b, _, _ in placed) + 1)
        fills.append(sum(runs) / (count * cap))
    return float(np.mean(fills))


def part2_plan(args, console) -> list[dict]:
    out = []
    dp, mbs = args.dp, args.microbatches
    gb = dp * mbs * args.samples_per_rank
    for mix in MIXES:
        for seq in SEQ_LENS:
            layout, (metas,) = batches(mix, seq, gb, 1, args.seed)
            plan = Plan.uniform(MODEL, gb, mbs, dp=dp)
            row = {"mix": mix, "seq_len": seq, "dp": dp, "microbatches": mbs, "samples": gb}
            for policy in ("none", "disttrain", "orchmllm", "rows"):
                pols = unit_policies({"llm": policy}, MODEL)
                plans = plan_global_batch(metas, MODEL, plan, layout, pols)
                row[policy] = llm_fill(plans, metas, layout, dp)
            out.append(row)
    t = Table(title=f"(2) LLM fill of the loader's plan: DP {dp} x {mbs} microbatches x "
                    f"{args.samples_per_rank} samples, rows first fit decreasing, LLM split by")
    for c in ("mix", "seq", "none", "disttrain (§6)", "orchmllm (§5.1)", "rows (dealt)"):
        t.add_column(c, justify="right")
    for r in out:
        t.add_row(r["mix"], str(r["seq_len"]),
                  *(f"{r[k]:.3f}" for k in ("none", "disttrain", "orchmllm", "rows")))
    console.print(t)
    return out


def _median_ms(fn, repeats: int) -> float:
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ts)


def part3_time(args, console) -> dict:
    _, steps = batches("llava", 2048, 256, 1, args.seed)
    lens = [m.llm_length for m in steps[0]]
    out = {"assembly_256": {
        "before": _median_ms(lambda: before.pack_rows(lens, 2048, "pack"), args.repeats),
        "after": _median_ms(lambda: pack_rows(lens, 2048, "pack"), args.repeats)}}
    rng = np.random.default_rng(args.seed)
    x = rng.choice(np.array(lens, np.int64), 2560 * 60)
    ends = np.arange(1, 2561, dtype=np.int64) * 60
    before.first_fit_rows(x, ends, 2048)  # compile outside the timing
    first_fit_decreasing_buffers(x, ends, 2048, -1)
    out["plan_counts_2560x60"] = {
        "before": _median_ms(lambda: before.first_fit_rows(x, ends, 2048), args.repeats),
        "after": _median_ms(lambda: first_fit_decreasing_buffers(x, ends, 2048, -1),
                            args.repeats)}
    t = Table(title=f"(3) host time, ms (median of {args.repeats})")
    for c in ("what", "before (first fit)", "after (first fit decreasing)"):
        t.add_column(c, justify="right")
    t.add_row("assembly packer, 256 LLaVA-like samples (Python)",
              *(f"{out['assembly_256'][k]:.2f}" for k in ("before", "after")))
    t.add_row("plan's row counts, 2,560 ranks x 60 samples (numba)",
              *(f"{out['plan_counts_2560x60'][k]:.2f}" for k in ("before", "after")))
    console.print(t)
    return out


def part4_budget(args, console) -> list[dict]:
    out = []
    for mix in MIXES:
        for seq in SEQ_LENS:
            for gb in args.global_batch:
                layout, (metas,) = batches(mix, seq, 4 * gb, 1, args.seed)
                need = gb * float(np.mean([m.llm_length for m in metas])) / seq
                budget = max(b for b in map(shape_bucket, range(1, int(need) + 2)) if b <= need
                             or b == 1)
                fills, counts, rows = budget_run(mix, layout, gb, budget, args)
                out.append({"mix": mix, "seq_len": seq, "global_batch": gb, "row_budget": budget,
                            "rows": rows, "fill": float(np.mean(fills)),
                            "min_fill": float(min(fills)), "samples": [min(counts), max(counts)]})
    t = Table(title=f"(4) Loader.row_budget: the loader's selection (data/row_budget.py) over "
                    f"{args.steps} steps, fill at the run's one static shape")
    for c in ("mix", "seq", "global_batch", "row_budget", "static rows", "fill (lowest step)",
              "samples per step"):
        t.add_column(c, justify="right")
    for r in out:
        t.add_row(r["mix"], str(r["seq_len"]), str(r["global_batch"]), str(r["row_budget"]),
                  str(r["rows"]), f"{r['fill']:.3f} ({r['min_fill']:.3f})",
                  f"{r['samples'][0]}-{r['samples'][1]}")
    console.print(t)
    return out


def budget_run(mix: str, layout, gb: int, budget: int, args):
    """(per step fill at the run's static rows, samples per step, static rows) of the
    loader's global batches 0 .. steps-1 under `Loader.row_budget=budget`."""
    from mmjax.data.batch_shapes import grow_shapes
    from mmjax.data.records import SyntheticSource
    from mmjax.data.sample_stream import SampleStream

    source = SyntheticSource(synthetic_dataset(MODEL, seed=args.seed, **MIXES[mix]))
    stream = SampleStream.from_gin(source, layout, gb, seed=args.seed, row_budget=budget)
    shapes, tokens, counts = None, [], []
    for _, _, metas in stream.scan(args.steps):
        shapes = grow_shapes(shapes, metas, layout)
        tokens.append(int(metas.llm_length.sum()))
        counts.append(len(metas))
    return [t / (shapes.rows * layout.seq_len) for t in tokens], counts, shapes.rows


PARTS = {1: part1_fill, 2: part2_plan, 3: part3_time, 4: part4_budget}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", type=int, nargs="+", default=[1, 2, 3, 4],
                    choices=sorted(PARTS))
    ap.add_argument("--global_batch", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--dp", type=int, default=8)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--samples_per_rank", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="bench_results/bench_packing.json")
    args = ap.parse_args(argv)
    console = Console(width=140)
    results = {"machine": machine(), "args": vars(args)}
    for p in args.parts:
        results[f"part{p}"] = PARTS[p](args, console)
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(results, f, indent=2)
    console.print(f"wrote {args.json}")
    return results


if __name__ == "__main__":
    main()
