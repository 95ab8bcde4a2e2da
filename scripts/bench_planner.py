"""Planner benchmark: planning time and predicted speedup over the baselines, from the function
scripts/plan.py calls (planner/compare.py `plan_and_baselines`: the paper workload, every
unit at the least recomputation that fits, the baselines priced and memory-checked the
same way and among the planner's candidates).

Settings: DistTrain Table 2 (MLLM-72B on 1296/648/324/112 A800s, global batch
1920/960/480/240; DistTrain's solve times 922/641/441/133 ms), the §8.2 microbenchmarks
(MLLM-9B/15B/72B on 98 GPUs, batch 128/64/40), OrchMLLM MLLM-10B/18B/84B on 128 H100s,
every Cornstarch VLM/ALM/VALM config (Cornstarch §6.1; encoders and LLM frozen) on 24 GPUs
with 24 single-sample microbatches, and the four frozen settings of DistTrain §8.3.1 on
MLLM-9B and MLLM-72B (98 GPUs).
Planning time is the median CPU time (process_time: the development machine is shared, its
wall time includes waiting for a core; wall medians are in the JSON) of `--repeats` calls,
the whole call: unit costs, baselines, the closed-form search, and every plan it proposes
timed by the simulated 1F1B schedule (the compiled kernels loaded once before). Times are
the simulated schedule's; speedup = baseline time / planner time, "does not fit" for a
baseline that cannot be repaired within the GPUs and their memory; "used" is the planner's
GPU count (the tie-break may leave some idle), "LLM share" the LLM's part of them.
"vs cornstarch co-loc": Cornstarch's co-located baseline (encoders on the LLM's first
pipeline stage's devices, planner/cornstarch_colocated.py) over the planner; "vs
co-located": the co-located layout (every unit on every GPU with FSDP, planner/colocated.py)
over the planner.

    python scripts/bench_planner.py [--repeats=5] [--only=table2|cornstarch|frozen|all]
        [--json=bench_results/planner.json] [--markdown=FILE]
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

from mmjax.models.named import NAMED_CONFIGS, named_config  # noqa: E402
from mmjax.planner.compare import BASELINES, plan_and_baselines  # noqa: E402
from mmjax.planner.hardware import A800, H100  # noqa: E402
from mmjax.planner.build import DISTTRAIN_FROZEN, model_costs  # noqa: E402
from mmjax.planner.colocated import best_colocated  # noqa: E402
from mmjax.planner.cornstarch_colocated import cornstarch_colocated  # noqa: E402
from mmjax.planner.plan import PlanError  # noqa: E402
from mmjax.schedule.compiled_timing import load_kernels  # noqa: E402
from mmjax.host_info import machine  # noqa: E402

# (model, GPUs, global batch, DistTrain's solve ms, frozen setting of §8.3.1 or None)
TABLE2 = [("disttrain/mllm_72b", 1296, 1920, 922, None),
          ("disttrain/mllm_72b", 648, 960, 641, None),
          ("disttrain/mllm_72b", 324, 480, 441, None),
          ("disttrain/mllm_72b", 112, 240, 133, None)]
OTHERS = [("disttrain/mllm_9b", 98, 128, None, None), ("disttrain/mllm_15b", 98, 64, None, None),
          ("disttrain/mllm_72b", 98, 40, None, None),
          ("orchmllm/mllm_10b", 128, 512, None, None), ("orchmllm/mllm_18b", 128, 512, None, None),
          ("orchmllm/mllm_84b", 128, 256, None, None)]
CORNSTARCH = [(name, 24, 24, None, None) for name in sorted(NAMED_CONFIGS)
              if name.startswith("cornstarch/")]
FROZEN = [(name, 98, batch, None, setting) for name, batch in (("disttrain/mllm_9b", 128),
                                                               ("disttrain/mllm_72b", 40))
          for setting in DISTTRAIN_FROZEN]
GROUPS = {"table2": TABLE2, "cornstarch": CORNSTARCH, "frozen": FROZEN,
          "all": TABLE2 + OTHERS + CORNSTARCH + FROZEN}


def _planning(model, hw, gpus, batch, repeats):
    """(Comparison, CPU seconds per call, wall seconds per call)."""
    cpu, wall, res = [], [], None
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        res = plan_and_baselines(model, hw, gpus, batch)
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - t0)
    return res, cpu, wall


def bench_one(name, gpus, batch, paper_ms, setting, repeats):
    model = named_config(name, DISTTRAIN_FROZEN[setting] if setting else None)
    hw = H100 if name.startswith("orchmllm") else A800
    res, times, wall = _planning(model, hw, gpus, batch, repeats)
    if "planner" not in res.plans:
        return {"model": name, "frozen_setting": setting, "gpus": gpus, "global_batch": batch,
                "hardware": hw.name, "error": res.errors["planner"]}
    plan = res.plans["planner"]
    p = plan.predicted
    plan_t = p["iteration_time_s"]
    used = {u.name: u.num_devices for u in plan.units}
    row = {"model": name, "frozen_setting": setting, "gpus": gpus, "global_batch": batch,
           "hardware": hw.name, "gpus_used": sum(used.values()),
           "llm_share": used["llm"] / sum(used.values()),
           "optimal_time_s": p["optimal_time_s"], "closed_form_s": p["closed_form_s"],
           "solve_ms_median": 1e3 * statistics.median(times),
           "solve_ms_all": [1e3 * t for t in times],
           "solve_wall_ms_median": 1e3 * statistics.median(wall),
           "paper_ms": paper_ms, "iteration_time_s": plan_t, "mfu": p["mfu"],
           "timed_plans": p["timed_plans"], "picked_from": p["picked_from"],
           "memory_gb": p["memory_gb"],
           "plan": {u.name: {"dp": u.dp, "tp": u.tp * u.cp, "pp": u.pp, "vpp": u.num_chunks}
                    for u in plan.units}}
    for kind in BASELINES:
        if kind in res.plans:
            b = res.plans[kind].predicted
            row[kind] = {"iteration_time_s": b["iteration_time_s"], "mfu": b["mfu"],
                         "gpus": b["gpus"], "memory_gb": b["memory_gb"],
                         "speedup": b["iteration_time_s"] / plan_t}
        else:
            row[kind] = {"does_not_fit": res.errors[kind]}
    # co-located layouts: Cornstarch's baseline (encoders on the LLM's first pipeline
    # stage's devices) and OrchMLLM's (every unit on every GPU, FSDP)
    costs, _ = model_costs(model, hw)
    for kind, fn in (("cornstarch_colocated", lambda: cornstarch_colocated(costs, hw, gpus,
                                                                           batch)),
                     ("colocated", lambda: best_colocated(costs, gpus, batch, hw))):
        try:
            ev = fn()
            row[kind] = {"iteration_time_s": ev.iteration_time_s, "gpus": ev.gpus,
                         "speedup": ev.iteration_time_s / plan_t}
        except PlanError as e:  # the layout does not fit these GPUs
            row[kind] = {"error": str(e)}
    return row


COLUMNS = ("model", "GPUs", "used", "batch", "hw", "planning ms", "paper ms",
           "plan (dp,tp,pp)",
           "LLM share", "iter s", "MFU", "vs megatron", "vs ratio", "vs cornstarch co-loc",
           "vs co-located")


def cells(r) -> list[str]:
    plan = " ".join(f"{k[:3]}:{v['dp']},{v['tp']},{v['pp']}"
                    + (f"x{v['vpp']}" if v["vpp"] > 1 else "") for k, v in r["plan"].items())
    sp = lambda k: (f"{r[k]['speedup']:.2f}x" if "speedup" in r[k] else
                    "does not fit" if "does_not_fit" in r[k] else "infeasible")
    model = r["model"] + (f" ({r['frozen_setting']})" if r["frozen_setting"] else "")
    return [model, str(r["gpus"]), str(r["gpus_used"]), str(r["global_batch"]), r["hardware"],
            f"{r['solve_ms_median']:.0f}",
            str(r["paper_ms"] or "-"), plan,
            f"{r['llm_share']:.2f}", f"{r['iteration_time_s']:.2f}", f"{100 * r['mfu']:.1f}%",
            sp("megatron"), sp("ratio"), sp("cornstarch_colocated"), sp("colocated")]


def markdown(rows, repeats: int) -> str:
    out = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    out += ["| " + " | ".join(cells(r)) + " |" for r in rows]
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--only", choices=sorted(GROUPS), default="all")
    ap.add_argument("--json", default="bench_results/planner.json")
    ap.add_argument("--markdown", help="also write the table as markdown here")
    args = ap.parse_args(argv)
    info = machine()
    load_kernels()
    rows = [bench_one(*s, args.repeats) for s in GROUPS[args.only]]
    failed = [r for r in rows if "error" in r]
    rows = [r for r in rows if "error" not in r]
    t = Table(title=f"planner: planning CPU ms (median of {args.repeats}) and predicted "
                    f"speedup (simulated 1F1B schedule); "
                    f"{info['cpu']}, {info['cores']} cores, load {info['load_avg_1m']}")
    for col in COLUMNS:
        t.add_column(col, justify="left" if col in ("model", "plan (dp,tp,pp)") else "right")
    for r in rows:
        t.add_row(*cells(r))
    Console(width=None if sys.stdout.isatty() else 200).print(t)
    for r in failed:
        print(f"{r['model']} on {r['gpus']} GPUs: no plan: {r['error']}")
    if args.markdown:
        os.makedirs(os.path.dirname(os.path.abspath(args.markdown)), exist_ok=True)
        with open(args.markdown, "w") as f:
            f.write(markdown(rows, args.repeats))
        print(f"wrote {args.markdown}")
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"repeats": args.repeats, "machine": info, "rows": rows,
                   "failed": failed}, f, indent=2)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    from mmjax.cli import run_main

    sys.exit(run_main(main))
