"""Re-plan from measured times: the traced steps of a run against the planner's predictions.

    python scripts/replan.py --workdir=runs/x [--gpus=N] [--profile=FILE | --hardware=h100]
        [--prior_actions=4] [--json=new_plan.json]

Reads `<workdir>/traces/step_*.json` (written by `train.trace_every`: the run's model
name, Plan and serial trace; steps in which programs compiled are left out), learns the measured profile (planner/measured.py: per unit,
measured / analytic time with the analytic model as prior), prints per virtual stage the
measured and predicted forward + backward time of one microbatch, the learned factors,
and the planner's plan on the measured costs (DistTrain §5) with its predicted gain over
the traced plan. `--gpus` defaults to the traced plan's device count.

The analytic prior is priced on the device the trace ran on (the trace names it): its
measured profile (`--profile FILE` from scripts/profile_hardware.py on that device; a CPU
trace read on the same CPU without one: its peak and bandwidths measured here), or a known
GPU's spec. A CPU trace is never priced by a GPU's spec. Traces that do not name their
device (older runs) are priced by `--hardware` (default h100).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from mmjax.planner.hardware import hardware, hardware_of_device  # noqa: E402
from mmjax.planner.measured_hardware import check_device, hardware_from_profile  # noqa: E402
from mmjax.planner.measured import plan_changes, replan  # noqa: E402
from mmjax.errors import UserError  # noqa: E402
from mmjax.planner.plan import Plan  # noqa: E402


def load_model(name: str):
    from mmjax.models.named import NAMED_CONFIGS, named_config
    from mmjax.models.tiny import TINY_CONFIGS

    if name in TINY_CONFIGS:
        return TINY_CONFIGS[name]()
    if name in NAMED_CONFIGS:
        return named_config(name)
    raise ValueError(f"model {name!r} of the traces is not a named config")


def load_traces(workdir: str):
    """(model name, Plan, concatenated trace, steps left out, device kind or None) of the
    traced steps in the
    workdir that ran the newest traced step's plan (a run re-planned by
    train.replan_every traced several), leaving out steps in which programs compiled
    (their action times include compilation)."""
    # only step_<n>.json: the trainer writes step_<n>.perfetto.json and .png beside them
    tdir = os.path.join(workdir, "traces")
    steps = sorted(int(m.group(1)) for m in map(re.compile(r"step_(\d+)\.json").fullmatch,
                                                 os.listdir(tdir) if os.path.isdir(tdir) else [])
                   if m)
    paths = [os.path.join(tdir, f"step_{n}.json") for n in steps]
    if not paths:
        raise ValueError(f"no traces in {workdir}/traces: train with train.trace_every=N")
    runs = []
    for n, p in zip(steps, paths):
        with open(p) as f:
            runs.append((n, json.load(f)))
    compiled = [n for n, d in runs if d.get("compiled", 0)]
    clean = [(n, d) for n, d in runs if not d.get("compiled", 0)]
    if not clean:
        raise ValueError(f"every traced step in {workdir}/traces compiled programs (steps "
                         f"{compiled}): their times include compilation; trace steps after "
                         f"warm-up (e.g. --trace_steps=3:4)")
    name, plan = clean[-1][1]["model"], clean[-1][1]["plan"]
    trace = [a for _, d in clean if d["plan"] == plan for a in d["trace"]]
    return name, Plan.from_json(plan), trace, compiled, clean[-1][1].get("device")


def traced_hardware(device: str | None, profile_path: str | None, hardware_name: str | None):
    """The `Hardware` the trace's analytic prior is priced on (see the module docstring)."""
    if profile_path:
        with open(profile_path) as f:
            profile = json.load(f)
        if device is not None:
            check_device(profile, device, f"--profile={profile_path}")
        return hardware_from_profile(profile, profile.get("dtype", "bfloat16"))
    if device is None:  # a trace from before traces named their device
        return hardware(hardware_name or "h100")
    spec = hardware_of_device(device)
    if hardware_name:
        if spec is None or hardware(hardware_name).name != spec.name:
            raise ValueError(f"--hardware={hardware_name} but the trace ran on {device!r} "
                             f"(price it with that device's profile: --profile=FILE from "
                             f"scripts/profile_hardware.py)")
        return spec
    if spec is not None:
        return spec
    import jax

    if str(jax.devices()[0].device_kind) != device:
        raise ValueError(f"the trace ran on {device!r}, which has no spec here and is not "
                         f"this machine's device: give its measured profile (--profile=FILE "
                         f"from scripts/profile_hardware.py on it)")
    from mmjax.train.device_measure import measure_device

    return hardware_from_profile(measure_device(), "float32")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--gpus", type=int, help="devices to plan for (default: the traced plan's)")
    ap.add_argument("--hardware", help="a800 | h100 | h200: the traced GPU's spec (default: "
                    "the device the trace names; h100 for traces that name none)")
    ap.add_argument("--profile", help="the traced device's measured hardware profile "
                    "(scripts/profile_hardware.py)")
    ap.add_argument("--prior_actions", type=float, default=4.0,
                    help="weight of the analytic model, in traced actions")
    ap.add_argument("--json", help="write the new plan here (loadable with Plan.load)")
    args = ap.parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 132)
    try:
        name, plan, trace, compiled, device = load_traces(args.workdir)
        model = load_model(name)
        hw = traced_hardware(device, args.profile, args.hardware)
        res = replan(model, plan, trace, hw, args.gpus or plan.num_devices,
                     prior_actions=args.prior_actions)
    except (ValueError, UserError) as e:  # a bad trace directory, profile or plan
        console.print(f"error: {e}", soft_wrap=True, markup=False)
        return 2
    console.print(f"priced on {hw.name}" + (f" (the trace ran on {device})" if device else ""))
    if compiled:
        console.print(f"left out traced steps {compiled}: programs compiled in them")
    t = Table(title=f"{name}: {len(trace)} traced actions; one microbatch, forward + backward")
    for col in ("stage", "actions", "measured s", "predicted s", "measured / predicted"):
        t.add_column(col, justify="right")
    for r in res.stages:
        ratio = r["measured_s"] / r["predicted_s"] if r["predicted_s"] > 0 else float("nan")
        t.add_row(r["stage"], str(r["actions"]), f"{r['measured_s']:.4g}",
                  f"{r['predicted_s']:.4g}", f"{ratio:.3f}")
    console.print(t)
    console.print("learned factors (measured / analytic, prior 1): " + ", ".join(
        f"{k} {v:.3f}" for k, v in res.factors.items()))
    new = Table(title="plan on the measured profile")
    for col in ("unit", "devices before", "devices after", "dp,tp,pp before", "dp,tp,pp after",
                "remat before", "remat after"):
        new.add_column(col, justify="right")
    for u in res.plan.units:
        old = plan.unit(u.name)
        new.add_row(u.name, str(old.num_devices), str(u.num_devices),
                    f"{old.dp},{old.tp},{old.pp}", f"{u.dp},{u.tp},{u.pp}", old.remat, u.remat)
    console.print(new)
    changes = plan_changes(plan, res.plan)
    if not changes:
        console.print(f"the plan on the measured costs is the traced plan ({res.current_s:.4g} "
                      f"s/iter): no change, gain 1.000x")
    else:
        console.print("changes: " + "; ".join(changes))
        console.print(f"traced plan {res.current_s:.4g} s/iter on the measured costs; new plan "
                      f"{res.predicted_s:.4g} s/iter: predicted gain {res.gain:.3f}x")
    if args.json:
        res.plan.save(args.json)
        console.print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    from mmjax.cli import run_main

    sys.exit(run_main(main))
