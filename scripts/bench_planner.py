"""Planner benchmark: solve time and predicted speedup over the baselines.

Settings: seed 000 Table 2 (MLLM-72B on 1296/648/324/112 A800s, global batch
1920/960/480/240; DistTrain's solve times 922/641/441/133 ms), the §8.2 microbenchmarks
(MLLM-9B/15B/72B on 98 GPUs, batch 128/64/40), OrchMLLM MLLM-10B/18B/84B on 128 H100s and
Cornstarch VLM/ALM/VALM on 24 GPUs with 24 single-sample microbatches.
Solve time is the median of `--repeats` runs of Algorithm 1 (costs prepared once, as a
training manager would). Speedup = baseline iteration time / planner iteration time.

    python scripts/bench_planner.py [--repeats=5] [--only=table2]
        [--json=bench_results/planner.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from mmjax.models.named import named_config  # noqa: E402
from mmjax.planner.baselines import megatron_choices, ratio_choices  # noqa: E402
from mmjax.planner.evaluate import evaluate  # noqa: E402
from mmjax.planner.hardware import A800, H100  # noqa: E402
from mmjax.planner.build import model_costs  # noqa: E402
from mmjax.planner.orchestrate import orchestrate  # noqa: E402
from mmjax.planner.plan import PlanError  # noqa: E402

TABLE2 = [("disttrain/mllm_72b", 1296, 1920, 922), ("disttrain/mllm_72b", 648, 960, 641),
          ("disttrain/mllm_72b", 324, 480, 441), ("disttrain/mllm_72b", 112, 240, 133)]
OTHERS = [("disttrain/mllm_9b", 98, 128, None), ("disttrain/mllm_15b", 98, 64, None),
          ("disttrain/mllm_72b", 98, 40, None),
          ("orchmllm/mllm_10b", 128, 512, None), ("orchmllm/mllm_18b", 128, 512, None),
          ("orchmllm/mllm_84b", 128, 256, None),
          ("cornstarch/vlm_m", 24, 24, None), ("cornstarch/alm_m", 24, 24, None),
          ("cornstarch/valm_ll", 24, 24, None)]


def bench_one(name, gpus, batch, paper_ms, repeats):
    model = named_config(name)
    hw = H100 if name.startswith("orchmllm") else A800
    costs, _ = model_costs(model, hw)
    times, res = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        res = orchestrate(costs, hw, gpus, batch)
        times.append(time.perf_counter() - t0)
    plan_t = res.iteration_time_s
    row = {"model": name, "gpus": gpus, "global_batch": batch, "hardware": hw.name,
           "solve_ms_median": 1e3 * statistics.median(times),
           "solve_ms_all": [1e3 * t for t in times],
           "paper_ms": paper_ms, "iteration_time_s": plan_t,
           "mfu": evaluate(costs, res.choices, batch, hw).mfu,
           "plan": {k: vars(v) for k, v in res.choices.items()},
           "candidates": res.candidates, "relaxations": res.relaxations, "repairs": res.repairs}
    for kind, fn in (("megatron", lambda: megatron_choices(costs, hw, gpus, batch,
                                                           model_name=name)),
                     ("ratio", lambda: ratio_choices(costs, hw, gpus, batch))):
        try:
            ev = evaluate(costs, fn(), batch, hw)
            row[kind] = {"iteration_time_s": ev.iteration_time_s, "mfu": ev.mfu, "gpus": ev.gpus,
                         "speedup": ev.iteration_time_s / plan_t}
        except PlanError as e:
            row[kind] = {"error": str(e)}
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--only", choices=["table2", "all"], default="all")
    ap.add_argument("--json", default="bench_results/planner.json")
    args = ap.parse_args(argv)
    settings = TABLE2 + ([] if args.only == "table2" else OTHERS)
    rows = [bench_one(*s, args.repeats) for s in settings]
    t = Table(title=f"planner: solve time (median of {args.repeats}) and predicted speedup")
    for col in ("model", "GPUs", "batch", "hw", "solve ms", "paper ms", "plan (dp,tp,pp)",
                "iter s", "MFU", "vs megatron", "vs ratio"):
        t.add_column(col, justify="left" if col in ("model", "plan (dp,tp,pp)") else "right")
    for r in rows:
        plan = " ".join(f"{k[:3]}:{v['dp']},{v['tp']},{v['pp']}"
                        + (f"x{v['vpp']}" if v["vpp"] > 1 else "") for k, v in r["plan"].items())
        sp = lambda k: (f"{r[k]['speedup']:.2f}x" if "speedup" in r[k] else "infeasible")
        t.add_row(r["model"], str(r["gpus"]), str(r["global_batch"]), r["hardware"],
                  f"{r['solve_ms_median']:.0f}", str(r["paper_ms"] or "-"), plan,
                  f"{r['iteration_time_s']:.2f}", f"{100 * r['mfu']:.1f}%", sp("megatron"),
                  sp("ratio"))
    Console(width=None if sys.stdout.isatty() else 160).print(t)
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"repeats": args.repeats, "rows": rows}, f, indent=2)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
