"""The rows of the README's results table, each as the benchmark that makes it: the README
row it reproduces (`what`, its first cell), a pattern that pulls the figures out of the
README's figure cell, the command a user runs, and `measure(quick)` calling that
benchmark's own functions. GPU rows have no `measure`: they are listed, not rerun.

`measure(quick) -> (figures, detail)`: one float per pattern group (None where this machine
cannot measure it, e.g. the H100 half of a row), and a dict of what else the run showed.
`quick` shrinks the repeats and sample counts, never the setting a figure is about.
"""
from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Callable

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(REPO, "scripts")

Measured = tuple[list, dict]


@dataclass(frozen=True)
class Row:
    key: str  # --rows=KEY
    what: str  # the README row's first cell, exactly
    pattern: str  # regex over the README's figure cell: one group per figure, in order
    labels: tuple[str, ...]  # what each figure is
    command: str  # what reproduces it, as a user types it
    measure: Callable[[bool], Measured] | None = None  # None: a GPU row, not rerun here
    note: str = ""


def _json_tmp(fn, *args):
    """Run `fn(json_path, *args)` with a temporary JSON path; the JSON it wrote."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "out.json")
        fn(path, *args)
        with open(path) as f:
            return json.load(f)


PLANS = (("72b", "--gin_file=configs/disttrain/mllm_72b.gin", "--gpus=1296", "--global_batch=1920"),
         ("9b", "--gin_file=configs/disttrain/mllm_9b.gin", "--gpus=98", "--global_batch=128"))


def planner(quick: bool) -> Measured:
    """`plan.py` for MLLM-72B and MLLM-9B, as a user runs it: the planning CPU time and the
    speedups over Megatron and the FLOPs-ratio plan it prints."""
    ms, speed, lines = [], {}, {}
    for name, *flags in PLANS:
        cmd = [sys.executable, os.path.join(SCRIPTS, "plan.py"), *flags]
        env = {**os.environ, "PYTHONPATH": REPO, "COLUMNS": "200"}
        out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                             check=True, timeout=600).stdout
        ms.append(float(re.search(r"planning time: \d+ ms, CPU (\d+) ms", out).group(1)))
        for m in re.finditer(r"(megatron|ratio)\s*│.*│\s*([\d.]+)x\s*│", out):
            speed[(name, m.group(1))] = float(m.group(2))
        lines[name] = [x for x in out.splitlines() if x.startswith("planning time")]
    return (ms + [speed.get((n, "megatron")) for n, *_ in PLANS]
            + [speed.get((n, "ratio")) for n, *_ in PLANS], {"planning": lines})


MEMORY_CASES = [(kind, remat) for kind in ("dp2pp2", "tp2") for remat in ("full", "dots", "none")]


def memory_model(quick: bool) -> Measured:
    """tests/test_memory_model.py's comparisons: each stage's predicted peak against XLA's
    account of its compiled programs, the tiny config's stages for both plans at every
    remat and the mid-size (MLLM-9B widths) middle LLM stage; the worst |error|, %."""
    if os.path.join(REPO, "tests") not in sys.path:
        sys.path.insert(0, os.path.join(REPO, "tests"))
    from test_memory_model import MID_CASES, stage_errors

    errors, residuals = {}, {}
    for kind, remat in MEMORY_CASES[:1] if quick else MEMORY_CASES:
        for sid, (pred, comp, _, _) in stage_errors(kind, remat).items():
            errors[f"tiny {kind} {remat} {sid}"] = 100 * (pred / comp - 1)
    for dp, tp, remat in MID_CASES[:1] if quick else MID_CASES:
        name = f"mid-size dp {dp} tp {tp} {remat}"
        errors[name], residuals[name] = mid_size_stage(dp, tp, remat)
    worst = max(errors, key=lambda k: abs(errors[k]))
    return [abs(errors[worst])], {"worst_stage": worst, "peak_error_percent": errors,
                                  "mid_size_residual_error_percent": residuals}


def mid_size_stage(dp: int, tp: int, remat: str) -> tuple[float, float]:
    """tests/test_memory_model.py's mid-size case: a middle LLM stage of MLLM-9B's widths
    compiled from shapes alone; (peak, residual) error of the prediction, %."""
    import jax
    import jax.numpy as jnp
    from helpers import global_batch

    from mmjax.data.feed import microbatch_feed
    from mmjax.models.config import with_overrides
    from mmjax.models.named import named_config
    from mmjax.parallel.mesh import stage_mesh
    from mmjax.pipeline.memory_account import abstract_peak, abstract_stage, predicted_abstract
    from mmjax.planner.plan import UnitPlan

    cfg = with_overrides(named_config("disttrain/mllm_9b_mid"), {"llm.num_layers": 3})
    lay, samples = global_batch(cfg, 2)
    feed = microbatch_feed(samples, lay, {"vision": 1, "llm": dp, "generator": 1})
    mesh = stage_mesh(jax.devices()[:dp * tp], dp, tp, 1)
    up = UnitPlan("llm", dp=dp, tp=tp, pp=3, layers=(1, 1, 1), remat=remat)
    r = abstract_stage(cfg, up, 1, 2, feed, mesh, jnp.float32)
    p = predicted_abstract(cfg, up, r, flight=2)
    return (100 * (p.peak / abstract_peak(r, 2) - 1),
            100 * (p.residuals / r["residuals"] - 1))


def reorder(quick: bool) -> Measured:
    """bench_data.py part 2 at l = 8 (every order searched): each order's simulated
    iteration time over the exhaustive optimum, averaged over the cases."""
    import bench_data

    trials = "1" if quick else "3"
    res = _json_tmp(lambda p: bench_data.main(["--parts", "2", "--long_microbatches",
                                               "--trials", trials, "--json", p]))
    rows = [r for r in res["part2"] if r["optimum"] is not None]

    def mean(k):
        return statistics.mean(r[k] / r["optimum"] for r in rows)

    def worst(k):
        return max(r[k] / r["optimum"] for r in rows)

    return ([mean("inter_reorder"), mean("alg3")],
            {"cases": len(rows), "alg3_guarded_mean": mean("guarded"),
             "inter_reorder_worst": worst("inter_reorder"), "alg3_worst": worst("alg3"),
             "random_mean_over_inter_reorder": statistics.mean(
                 r["random_mean"] / r["inter_reorder"] for r in rows)})


BALANCE_POLICIES = ("sum", "padded", "sum_square", "conv")


def balancing(quick: bool) -> Measured:
    """bench_balance.py part 1 at 2560 ranks: the loader's call (`split_unit`), median CPU ms."""
    import bench_balance

    repeats = "2" if quick else "14"
    res = _json_tmp(lambda p: bench_balance.main(["--parts", "1", "--dp", "2560",
                                                  "--repeats", repeats, "--json", p]))
    by = {r["policy"]: r for r in res["part1"]}
    return ([by[p]["loader"]["median"] for p in BALANCE_POLICIES],
            {"arrays_alone_ms": {p: by[p]["arrays"]["median"] for p in BALANCE_POLICIES},
             "identical_to_reference": all(r["identical"] for r in res["part1"]),
             "load_avg_1m": res["machine"]["load_avg_1m"]})


def startup(quick: bool) -> Measured:
    """bench_startup.py: `python scripts/train.py` from launch to its first step line."""
    import bench_startup

    res = bench_startup.measure(1 if quick else 3)
    return ([res["cold"]["first_step_s"], res["warm"]["first_step_s"]],
            {k: res[k] for k in ("cold", "warm", "resume")} | {"load_avg_1m": os.getloadavg()[0]})


def tiny_step(quick: bool) -> Measured:
    """bench_step.py --preset tiny on this CPU (the H100 figure is a GPU run)."""
    import bench_step

    argv = ["--preset", "tiny"] + (["--steps", "3"] if quick else [])
    rec = _json_tmp(lambda p: bench_step.main(argv + ["--json", p]))
    return ([None, rec["step_time_s"] * 1e3],
            {"compile_s": rec["compile_s"], "load_avg_1m": os.getloadavg()[0]})


def preprocessing(quick: bool) -> Measured:
    """bench_preprocess.py at (10 images, 1024²): in process vs the trainer's wait with one
    producer (mean over the iterations)."""
    import bench_preprocess

    iters = "2" if quick else "5"
    res = _json_tmp(lambda p: bench_preprocess.main(["--configs", "10x1024", "--iters", iters,
                                                     "--json", p]))
    r = res["rows"][0]
    return ([r["in_process_s"], r["producer_wait_s"] * 1e3],
            {"producer_wait_median_ms": 1e3 * statistics.median(r["producer_wait_all_s"]),
             "load_avg_1m": os.getloadavg()[0]})


def settings_fuzz(quick: bool) -> Measured:
    """fuzz_settings.py, seed 0: the failure rows of its table."""
    import fuzz_settings

    n = 40 if quick else 1000
    counts = fuzz_settings.table(fuzz_settings.fuzz(n, 0))
    return ([counts.get("invalid accepted", 0), counts.get("traceback", 0),
             counts.get("hang", 0)], {"mutations": n, "counts": counts})


ROWS = (
    Row("planner", "`plan.py`: MLLM-72B, 1296 GPUs, batch 1920 / MLLM-9B, 98 GPUs, batch 128 "
        "(DistTrain Table 2: 922 ms; §8.2: 1.4–2.7×)",
        r"([\d.]+) / ([\d.]+) ms planning; ([\d.]+)× / ([\d.]+)× Megatron, ([\d.]+)× / "
        r"([\d.]+)× FLOPs-ratio",
        ("72B CPU ms", "9B CPU ms", "72B × Megatron", "9B × Megatron", "72B × FLOPs-ratio",
         "9B × FLOPs-ratio"),
        "python scripts/plan.py --gin_file=configs/disttrain/mllm_72b.gin --gpus=1296 "
        "--global_batch=1920 (and mllm_9b.gin --gpus=98 --global_batch=128)", planner,
        "the CPU planning time plan.py prints (the README: median of bench_planner.py)"),
    Row("memory", "planner memory vs compiled stage programs (tiny, every remat; ZeRO-2/3 "
                  "stages of MLLM-9B widths)", r"within (\d+)%", ("worst stage |error| %",),
        "python -m pytest tests/test_memory_model.py tests/test_pipeline_zero_memory.py -m ''",
        memory_model, "rerun: the tiny stages (dp2/pp2, tp2 at every remat) and the mid-size "
                      "stage (its residuals in the JSON); ZeRO-2/3: test_pipeline_zero_memory.py"),
    Row("reorder", "inter-microbatch reorder vs exhaustive optimum",
        r"([\d.]+)× on average.*Algorithm 3 alone ([\d.]+)×",
        ("inter_reorder / optimum", "Algorithm 3 alone / optimum"),
        "python scripts/bench_data.py --parts 2 --long_microbatches --trials 3", reorder),
    Row("balance", "OrchMLLM balancing, 2560 ranks × 60 samples, as the loader calls it",
        r"sum ([\d.]+), padded ([\d.]+), sum_square ([\d.]+), conv ([\d.]+) ms",
        tuple(f"{p} ms" for p in BALANCE_POLICIES),
        "python scripts/bench_balance.py --parts 1 --dp 2560 --repeats 14", balancing),
    Row("attention", "attention fwd + bwd, 16k tokens: packing mask / causal",
        r"Pallas ([\d.]+) ms, chunked ([\d.]+) ms / Pallas ([\d.]+) ms = ([\d.]+)× cuDNN",
        ("packing Pallas ms", "packing chunked ms", "causal Pallas ms", "× cuDNN"),
        "python scripts/bench_attention.py; python scripts/bench_pallas_tiles.py"),
    Row("startup", "`python scripts/train.py` (tiny, cold / warm cache)",
        r"first step after ([\d.]+) / ([\d.]+) s", ("cold s", "warm s"),
        "python scripts/bench_startup.py --repeats 3", startup),
    Row("tiny_step", "tiny single-program step", r"~([\d.]+) ms \(H100\), ([\d.]+) ms \(CPU\)",
        ("H100 ms", "CPU ms"), "python scripts/bench_step.py --preset tiny", tiny_step),
    Row("gpu_step", "bf16 step, one GPU: llava_1b 16 × 4096 / Llama-3-8B-wide (6 layers) "
                    "12 × 2048",
        r"([\d.]+) ms, ([\d.]+)% MFU / ([\d.]+) ms, ([\d.]+)% MFU",
        ("llava_1b ms", "llava_1b MFU %", "Llama ms", "Llama MFU %"),
        "bash scripts/bench_gpu.sh"),
    Row("preprocess", "trainer-side preprocessing, 10 images of 1024² per sample",
        r"([\d.]+) s in process, ([\d.]+) ms with producers", ("in process s", "producers ms"),
        "python scripts/bench_preprocess.py --configs 10x1024", preprocessing),
    Row("fuzz", "settings fuzz, 1000 mutations of every setting and flag",
        r"(\d+) invalid accepted, (\d+) tracebacks, (\d+) hangs",
        ("invalid accepted", "tracebacks", "hangs"),
        "python scripts/fuzz_settings.py --mutations=1000", settings_fuzz),
)
