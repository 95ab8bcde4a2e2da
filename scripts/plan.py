"""Plan a model's disaggregated orchestration (DistTrain §5) and compare with the baselines.

    python scripts/plan.py --gin_file=configs/disttrain/mllm_72b.gin --gpus=1296 \
        --global_batch=1920 [--baseline=megatron|ratio] [--hardware=a800] [--json=FILE]
        [--gpu_tolerance=0.01] [--data=SPEC [--data_samples=512]]
        [--layout=disaggregated|colocated|auto]

Prints, per unit, GPUs, DP/TP/PP, stage time and memory per GPU, and the predicted
iteration time (the simulated 1F1B schedule) and MFU of the planner's plan beside the Megatron
and FLOPs-ratio baselines (planner/compare.py: priced and memory-checked the same way, a
baseline that does not fit shown as such; the baselines' plans are among the planner's
candidates, so it is never slower than one that fits), and the whole planning time.
`--nodes` adds the node map (which stage groups sit on which node).
`--baseline` makes that baseline the plan that is printed first and saved. The JSON is the
`Plan` (loadable with `Plan.load`) plus `solve_time_s` and the baselines' predictions.
`--data` plans for the user's data instead of the paper's synthetic workload: a source spec
(mmjax/data/data_spec.py: `synthetic:laion`, `synthetic:mix@3`, `arrayrecord:/path` or the
path of a scripts/make_dataset.py file) from which `--data_samples` samples' shapes (LLM
tokens, image patches, audio frames) make the workload.
`--layout`: "disaggregated" (default, the above), "colocated" (every unit on every GPU with
FSDP, OrchMLLM §4-7: planner/colocated.py, beside Cornstarch's co-located baseline) or "auto"
(both, side by side; picks the faster and says why: planner/layout_choice.py).
An infeasible request ends with exit code 2 and a message saying what is short.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from mmjax.planner.placement import node_map  # noqa: E402
from mmjax.planner.hardware import hardware  # noqa: E402
from mmjax.planner.hardware_profile import (DEFAULT_CALL_TOKENS,  # noqa: E402
                                            is_hardware_profile)
from mmjax.planner.orchestrate import GPU_TOLERANCE  # noqa: E402
from mmjax.planner.build import plan_model  # noqa: E402
from mmjax.errors import UserError  # noqa: E402
from mmjax.planner.plan import PlanError  # noqa: E402
from mmjax.planner.workload import default_workload  # noqa: E402
from mmjax.planner.layout_choice import (LAYOUTS, choose_layout,  # noqa: E402
                                        slowest_stage_busy_s)
from mmjax.planner.compare import plan_and_baselines  # noqa: E402

FAMILY_HARDWARE = {"disttrain": "a800", "orchmllm": "h100", "cornstarch": "a800"}


def load_model(gin_file: str, gin_params: list[str]):
    """The model of `gin_file` + bindings, parsed strictly (a misspelt name is an error)."""
    from mmjax.cli import parse_gin
    from mmjax.train.config import named_model_config

    from mmjax.train.lora_setup import with_lora

    parse_gin([gin_file], gin_params, finalize=False)
    return with_lora(named_model_config())  # lora.*: adapters priced (planner/lora_params.py)


def model_with_vae(model):
    """`model` with its generator's VAE as a unit config when gin binds `vae.path` (the
    planner then places it: planner/vae_placement.py), else None."""
    from mmjax.train.vae_latents import vae as vae_settings

    path = vae_settings()[0]
    if not path or model.generator is None:
        return None
    from mmjax.models.hf.vae import vae_config_from_hf

    try:
        return model.replace(vae=vae_config_from_hf(path))
    except (FileNotFoundError, UserError, ValueError) as e:
        raise UserError(f"vae.path={path!r}: {e}") from None


def data_workload(model, spec: str, samples: int):
    """The workload of `samples` samples of the source `spec` (data/data_spec.py)."""
    from mmjax.data.data_spec import open_source, sample_workload

    return sample_workload(open_source(spec, model), model, samples, name=spec)


def measured_costs(model, hw, args, wl):
    """UnitCosts whose times come from profiled tables (profile.py imports JAX)."""
    from mmjax.planner.profile import ProfileTable, profile_model, profiled_costs

    if args.write_profile:
        table = profile_model(model, wl)
        table.save(args.write_profile)
    else:
        table = ProfileTable.load(args.profile)
    return profiled_costs(model, wl, hw, table, args.recompute)


def profiled_hardware(args, hw):
    """The hardware a measured device profile describes (planner/measured_hardware.py): its
    measured peak and bandwidths, or, for a profile of layer points only, its own device's
    spec (the efficiencies are fractions of that device's peak), priced by the profile. A
    `--hardware` naming another device is an error, not a silent mix."""
    from mmjax.planner.hardware import hardware_of_device
    from mmjax.planner.measured_hardware import hardware_from_profile, has_measurement

    with open(args.profile) as f:
        profile = json.load(f)
    device = profile.get("device", "")
    own = hardware_of_device(device)
    if own is None and not has_measurement(profile):
        raise UserError(f"--profile={args.profile}: device {device!r} has no spec here and "
                        f"the profile no measured peak (re-run scripts/profile_hardware.py)")
    if args.hardware and (own is None or hardware(args.hardware).name != own.name):
        raise UserError(f"--hardware={args.hardware} but --profile={args.profile} was measured "
                        f"on {device!r} (drop --hardware or profile that device)")
    try:
        return hardware_from_profile(profile, profile.get("dtype", "bfloat16"),
                                     call_tokens=args.profile_tokens)
    except (UserError, ValueError) as e:
        raise UserError(f"--profile={args.profile}: {e}") from None


def _cell(table: dict, unit: str, fmt: str) -> str:
    """A unit's predicted value, or "-" for one the planner's orchestration does not price
    (the VAE unit, placed beside it: planner/vae_placement.py)."""
    return fmt.format(table[unit]) if unit in table else "-"


def unit_table(plan, title: str) -> Table:
    p = plan.predicted
    t = Table(title=f"{title}: {p['iteration_time_s']:.3f} s/iter, MFU {100 * p['mfu']:.1f}%, "
                    f"{p['gpus']} GPUs")
    zero = any(u.zero_stage > 1 for u in plan.units)  # the planner's ZeRO-2/3 when needed
    for col in ("unit", "GPUs", "DP", "TP", "PP", "VPP") + ("ZeRO",) * zero + (
            "layers/stage", "stage time (s)", "memory (GB/GPU)", "frozen"):
        t.add_column(col, justify="left" if col in ("unit", "layers/stage") else "right")
    for u in plan.units:
        layers = ",".join(str(x) for x in u.layers)
        t.add_row(u.name, str(u.num_devices), str(u.dp), str(u.tp), str(u.pp), str(u.num_chunks),
                  *((str(u.zero_stage),) * zero),
                  layers if len(layers) < 40 else layers[:37] + "...",
                  _cell(p['stage_time_s'], u.name, "{:.4f}"), _cell(p['memory_gb'], u.name, "{:.1f}"),
                  "yes" if u.frozen else "")
    return t


def node_map_text(plan) -> str:
    """The primary plan's placement: which stage groups sit on which node."""
    n = plan.devices_per_node
    head = (f"node map ({n} GPUs a node; every TP group inside one node):" if n
            else "placement: contiguous (devices_per_node = 0)")
    return "\n".join([head] + ["  " + ln for ln in node_map(plan.units, plan.stage_devices(), n)])


def summary_table(plans: dict, errors: dict) -> Table:
    """One row per plan; a baseline that does not fit is a row saying so, left out of the
    speedup."""
    t = Table(title="side by side (simulated 1F1B schedule)")
    for col in ("plan", "GPUs", "iteration (s)", "samples/s", "MFU", "speedup of planner"):
        t.add_column(col, justify="right")
    ref = plans.get("planner")
    for name, plan in plans.items():
        p = plan.predicted
        speed = (f"{p['iteration_time_s'] / ref.predicted['iteration_time_s']:.2f}x"
                 if ref is not None else "-")
        t.add_row(name, str(p["gpus"]), f"{p['iteration_time_s']:.3f}",
                  f"{p['samples_per_s']:.1f}", f"{100 * p['mfu']:.1f}%", speed)
    for name in errors:
        if name not in plans:
            t.add_row(name, "-", "does not fit" if name != "planner" else "no plan", "-",
                      "-", "-")
    return t


def colocated_table(ev, title: str) -> Table:
    t = Table(title=f"{title}: {ev.iteration_time_s:.3f} s/iter, MFU {100 * ev.mfu:.1f}%, "
                    f"{ev.gpus} GPUs, {ev.memory_gb:.1f} GB/GPU, remat {ev.remat}, "
                    f"{ev.micro_steps} micro-step(s), all-to-all {ev.all_to_all_s:.4f} s")
    for col in ("unit", "DP", "TP", "ZeRO", "compute (s)", "exposed comm (s)"):
        t.add_column(col, justify="left" if col == "unit" else "right")
    for u, comp in ev.compute_s.items():
        t.add_row(u, str(ev.gpus // ev.tp[u]), str(ev.tp[u]), str(ev.zero[u]), f"{comp:.4f}",
                  f"{ev.exposed_comm_s[u]:.4f}")
    return t


def colocated_main(args, console, model, hw, wl, costs) -> int:
    """`--layout=colocated|auto`: the co-located layout's best choice, Cornstarch's
    co-located baseline and (auto) the disaggregated planner's plan, side by side."""
    from mmjax.planner.build import model_costs
    from mmjax.planner.colocated import best_colocated
    from mmjax.planner.cornstarch_colocated import cornstarch_colocated

    unit_costs = costs or model_costs(model, hw, wl, args.recompute)[0]
    console.print(f"[bold]{model.name}[/bold] on {args.gpus} x {hw.name}, "
                  f"global batch {args.global_batch}, layout {args.layout}")
    rows, errors, colo, dis = {}, {}, None, None
    try:
        colo = best_colocated(unit_costs, args.gpus, args.global_batch, hw)
        console.print(colocated_table(colo, "co-located (OrchMLLM)"))
        rows["colocated"] = (colo.iteration_time_s, colo.samples_per_s, colo.mfu)
    except PlanError as e:
        errors["colocated"] = str(e)
    try:
        cs = cornstarch_colocated(unit_costs, hw, args.gpus, args.global_batch)
        rows["cornstarch-colocated"] = (cs.iteration_time_s, cs.samples_per_s, None)
        console.print(f"Cornstarch co-located baseline (encoders on the LLM's first stage): "
                      f"LLM tp {cs.llm.tp} pp {cs.llm.pp} dp {cs.llm.dp}, "
                      f"{cs.iteration_time_s:.3f} s/iter, {cs.memory_gb:.1f} GB/GPU")
    except PlanError as e:
        errors["cornstarch-colocated"] = str(e)
    if args.layout == "auto":
        try:
            dis = plan_model(model, hw, args.gpus, args.global_batch, workload=wl,
                             recompute=args.recompute, vpp=not args.no_vpp, costs=costs,
                             gpu_tolerance=args.gpu_tolerance,
                             attention_impl=args.attention_impl)
            console.print(unit_table(dis, "disaggregated (DistTrain)"))
            p = dis.predicted
            rows["disaggregated"] = (p["iteration_time_s"], p["samples_per_s"], p["mfu"])
        except PlanError as e:
            errors["disaggregated"] = str(e)
    for name, err in errors.items():
        console.print(f"[yellow]{name}: infeasible:[/yellow] {' '.join(err.split())}")
    t = Table(title="side by side")
    for col in ("layout", "iteration (s)", "samples/s", "MFU"):
        t.add_column(col, justify="right")
    for name, (it, sps, mfu) in rows.items():
        t.add_row(name, f"{it:.3f}", f"{sps:.1f}", "-" if mfu is None else f"{100 * mfu:.1f}%")
    console.print(t)
    chosen = "colocated"
    if args.layout == "auto":
        try:
            pick = choose_layout(colo, None if dis is None else
                                 dis.predicted["iteration_time_s"],
                                 0.0 if dis is None else slowest_stage_busy_s(dis))
        except PlanError as e:
            print(f"error: infeasible: {e}", file=sys.stderr)
            return 2
        chosen = pick.layout
        console.print(f"layout auto picks {pick.layout}: {pick.reason}")
    elif colo is None:
        print(f"error: infeasible (colocated): {' '.join(errors['colocated'].split())}",
              file=sys.stderr)
        return 2
    if args.json:
        out = {"model": model.name, "layout": chosen,
               "colocated": None if colo is None else colo.to_json(),
               "disaggregated": None if dis is None else dis.to_json(),
               "side_by_side": {k: {"iteration_time_s": v[0], "samples_per_s": v[1]}
                                for k, v in rows.items()}}
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
        console.print(f"wrote {args.json}")
    return 0


def main(argv=None) -> int:
    from mmjax.cli import add_debug_flag

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_debug_flag(ap)
    ap.add_argument("--gin_file", required=True)
    ap.add_argument("--gin_param", action="append", default=[])
    ap.add_argument("--gpus", type=int, required=True)
    ap.add_argument("--global_batch", type=int, required=True)
    ap.add_argument("--baseline", choices=["megatron", "ratio"])
    ap.add_argument("--hardware", help="a800 | h100 | h200 (default: the paper's)")
    ap.add_argument("--recompute", default="auto", choices=("auto", "none", "dots", "full"),
                    help="remat policy of every unit (the runtime's remat_wrap); auto: per "
                         "unit the least recomputation that fits (default)")
    ap.add_argument("--no_vpp", action="store_true", help="disable interleaved 1F1B")
    ap.add_argument("--attention_impl", choices=["dense", "chunked", "pallas"],
                    help="cost attention by this implementation's tiles and memory and put it "
                         "in every unit of the plan (default: exact pairs, attention_impl auto)")
    ap.add_argument("--gpu_tolerance", type=float, default=GPU_TOLERANCE,
                    help="relative slack on the least iteration time within which the plan "
                         "with the fewest GPUs wins (0: least time only)")
    ap.add_argument("--json", help="write the plan here")
    ap.add_argument("--profile", help="a measured profile (JSON): this device's hardware "
                                      "profile (scripts/profile_hardware.py, e.g. "
                                      "configs/hardware/h100.json) in place of the assumed "
                                      "efficiency curve, or the model's C(TP, size) tables "
                                      "(--write_profile) in place of the analytic times")
    ap.add_argument("--profile_tokens", type=float, default=DEFAULT_CALL_TOKENS,
                    help="with a hardware profile: the tokens one layer call runs together "
                         "(a microbatch's packed rows), at least the sample's own")
    ap.add_argument("--write_profile", help="profile the units on this machine's devices, "
                                            "save the tables here and use them")
    ap.add_argument("--data", help="plan for this data source (synthetic:laion, "
                                   "arrayrecord:/path, ...) instead of the paper's workload")
    ap.add_argument("--data_samples", type=int, default=512,
                    help="samples drawn from --data to build the workload")
    ap.add_argument("--producer_cores", type=int, default=32,
                    help="with vae.path: CPU cores of the producers that would encode the "
                         "generator's targets if the VAE stays on hosts (the planner compares "
                         "that with a VAE unit on GPUs)")
    ap.add_argument("--nodes", action="store_true",
                    help="also print the node map: which stage groups sit on which node")
    ap.add_argument("--layout", default="disaggregated", choices=LAYOUTS,
                    help="disaggregated (each unit on its own GPUs), colocated (every unit on "
                         "every GPU, FSDP) or auto (both; picks the faster)")
    args = ap.parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 132)
    if args.gpus < 1 or args.global_batch < 1:
        raise UserError(f"--gpus={args.gpus} --global_batch={args.global_batch}: both must "
                        f"be >= 1")
    model = load_model(args.gin_file, args.gin_param)
    hw = hardware(args.hardware or FAMILY_HARDWARE.get(model.name.split("/")[0], "h100"))
    plans, errors = {}, {}
    costs = None
    try:
        wl = (data_workload(model, args.data, args.data_samples) if args.data
              else default_workload(model))
    except (UserError, ValueError) as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    if args.data:
        (llm, _), enc = wl.llm_moments(), {e.name: wl.encoder_moments(e.name)[0]
                                           for e in model.encoders}
        console.print(f"workload: {wl.num_samples} samples of {args.data}: mean LLM tokens "
                      f"{llm:.0f}" + "".join(f", {k} tokens {v:.0f}" for k, v in enc.items()))
    if args.profile and not args.write_profile and is_hardware_profile(args.profile):
        hw = profiled_hardware(args, hw)
    elif args.profile or args.write_profile:
        costs = measured_costs(model, hw, args, wl)
    if args.layout != "disaggregated":
        return colocated_main(args, console, model, hw, wl, costs)
    vae_model = model_with_vae(model)

    def vae_planner(plan_fn):  # the VAE on producers' CPUs or as a frozen unit on GPUs
        from mmjax.planner.vae_placement import plan_with_vae
        from mmjax.train.vae_latents import vae as vae_settings

        plan, decision = plan_with_vae(
            plan_fn, vae_model, hw, args.gpus, args.global_batch * wl.mean_generated(),
            args.producer_cores, vae_settings()[1])
        console.print(f"VAE placement: {decision.placement}: {decision.reason}")
        return plan
    planner = None if vae_model is None else vae_planner
    comparison = plan_and_baselines(
        model, hw, args.gpus, args.global_batch, workload=wl, recompute=args.recompute,
        vpp=not args.no_vpp, costs=costs, gpu_tolerance=args.gpu_tolerance,
        attention_impl=args.attention_impl, planner=planner)
    plans, errors = comparison.plans, comparison.errors
    primary = args.baseline or "planner"
    console.print(f"[bold]{model.name}[/bold] on {args.gpus} x {hw.name}, "
                  f"global batch {args.global_batch}")
    if primary not in plans:
        print(f"error: infeasible ({primary}): {' '.join(errors[primary].split())}",
              file=sys.stderr)
        return 2
    for name in [primary] + [k for k in plans if k != primary]:
        console.print(unit_table(plans[name], name))
        if name == primary and args.nodes:
            console.print(node_map_text(plans[name]))
    for name, err in errors.items():
        what = "no plan" if name == "planner" else "does not fit"
        console.print(f"[yellow]{name}: {what}:[/yellow] {err}")
    console.print(summary_table(plans, errors))
    if "planner" in plans:
        p = plans["planner"].predicted
        least = p["optimal_time_s"]
        picked = (f"least time {least:.3f} s" if p["iteration_time_s"] <= least * (1 + 1e-12)
                  else f"least time {least:.3f} s; picked the fewest GPUs within "
                       f"{100 * args.gpu_tolerance:g}% of it")
        console.print(f"planning time: {comparison.planning_time_s * 1e3:.0f} ms, CPU "
                      f"{comparison.planning_cpu_s * 1e3:.0f} ms (unit costs, "
                      f"baselines, search and {p['timed_plans']} plans timed by the "
                      f"simulated 1F1B schedule; compiled kernels loaded before it in "
                      f"{comparison.kernel_load_s * 1e3:.0f} ms, once per process); {picked}: "
                      f"{p['gpus']} of {args.gpus} GPUs")
    if args.json:
        out = plans[primary].to_json()
        out["solve_time_s"] = plans[primary].predicted.get("solve_time_s", 0.0)
        out["model"] = model.name
        out["baselines"] = baselines_json(plans, errors, primary)
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
        console.print(f"wrote {args.json}")
    return 0


def baselines_json(plans: dict, errors: dict, primary: str) -> dict:
    """`baselines.<name>` of the plan JSON: each plan that was not printed first, with its
    prediction and `"fits": true`; a baseline that cannot fit the GPUs carries
    `"fits": false`, no time or memory, and the reason."""
    out = {k: {**v.predicted, "fits": True} for k, v in plans.items() if k != primary}
    for name, err in errors.items():
        if name != primary:
            out[name] = {"fits": False, "iteration_time_s": None, "memory_gb": None,
                         "reason": err}
    return out


if __name__ == "__main__":
    from mmjax.cli import run_main

    sys.exit(run_main(main))
