"""Record the planner's plans on every named setting as a JSON fixture, so a faster solver
can be checked to return the same plan (tests/test_planner_fast.py).

Settings: those of scripts/bench_planner.py (DistTrain Table 2 and §8.2, OrchMLLM §8,
every Cornstarch config, the frozen settings of DistTrain §8.3.1), each at the default
fewest-GPUs tolerance and at 0 (least time alone).

    python scripts/record_plans.py [--method=cvxpy] [--out=tests/data/planner_plans.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mmjax.models.named import named_config  # noqa: E402
from mmjax.planner.build import DISTTRAIN_FROZEN, model_costs  # noqa: E402
from mmjax.planner.hardware import A800, H100  # noqa: E402
from mmjax.planner.orchestrate import GPU_TOLERANCE, orchestrate  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_planner import GROUPS  # noqa: E402

TOLERANCES = (GPU_TOLERANCE, 0.0)


def setting_key(name, gpus, batch, setting, tol) -> str:
    return f"{name}|{setting or '-'}|{gpus}|{batch}|{tol:g}"


def record(method: str | None = None) -> dict:
    out = {}
    for name, gpus, batch, _, setting in GROUPS["all"]:
        model = named_config(name, DISTTRAIN_FROZEN[setting] if setting else None)
        hw = H100 if name.startswith("orchmllm") else A800
        costs, _ = model_costs(model, hw)
        for tol in TOLERANCES:
            kw = {} if method is None else {"method": method}
            res = orchestrate(costs, hw, gpus, batch, gpu_tolerance=tol, **kw)
            out[setting_key(name, gpus, batch, setting, tol)] = {
                "plan": {k: [v.tp, v.dp, v.pp, v.vpp, v.remat] for k, v in res.choices.items()},
                "iteration_time_s": res.iteration_time_s,
                "optimal_time_s": res.optimal_time_s}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--method", help="orchestrate(method=...); default: the planner's default")
    ap.add_argument("--out", default="tests/data/planner_plans.json")
    args = ap.parse_args(argv)
    plans = record(args.method)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(plans, f, indent=1, sort_keys=True)
    print(f"wrote {len(plans)} plans to {args.out}")
    return 0


if __name__ == "__main__":
    from mmjax.cli import run_main

    sys.exit(run_main(main))
