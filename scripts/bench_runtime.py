"""Pipeline runtime benchmark: host dispatch cost, measured vs simulated step time, timelines.

For the tiny MLLM (vision -> LLM -> generator, mmjax/models/tiny.py, widened by flags) on 8
forced CPU devices, under
  rigid     Megatron-style `Plan.rigid(dp=1, tp=2, pp=2)` (DistTrain §2.1 Fig. 2: encoder
            and generator are extra stages with the LLM's dp and tp),
  disagg    vision dp2 | llm tp2 pp2 | generator dp2 (DistTrain §4.1 disaggregation),
  planner   the planner's choice for 8 devices (planner/build.py `plan_model`, H100 cost
            model, vpp off: see below); opt-in with --plans,
it measures for one global batch through `PipelineRuntime.run`:
  dispatch   host time for `run(feeds)` to return (async dispatch, no tracing, losses not
             read) / number of schedule actions;
  measured   wall time of `run` + reading the losses + waiting for the gradients (median
             over --steps after --warmup; compile excluded);
  busy       per-stage busy time from the tracing mode (blocks after every action, so each
             action's time includes its broker input transfer);
  simulated  `schedule/simulate.py` on the runtime's own schedule with per-(stage, kind)
             costs = median traced action time over --trace_steps steps; its bubble fraction
             is the mean over stages of 1 - busy / iteration time.
  traffic    bytes one step moves between stages (the brokers' ledgers) and in the dp
             syncs, by link class (same device, intra-node, inter-node) on nodes of
             --devices_per_node devices, with the node map; and the programs traced or
             compiled in the timed steps (jax.monitoring; 0 after warm-up);
  memory     per stage, the planner's predicted peak bytes per device (planner/memory.py)
             against XLA's account of the compiled stage programs (memory_analysis plus
             what the runtime holds beside them: pipeline/memory_account.py);
  collectives  per stage per training step, from the compiled HLO: the forward and
             backward programs (each run once per microbatch) and the ZeRO-1 sync and update
             programs (parallel/zero.py: one reduce-scatter, one all-gather), as op counts;
  overlap    one step traced in the runtime's "overlap" mode (dispatch stays asynchronous;
             per-mesh waiter threads stamp completions): the concurrent timeline.
The serial-traced step of each plan is written to <out dir>/trace_<plan>.json and rendered
with scripts/timeline.py (PNG + Perfetto JSON); the overlap trace (trace_<plan>.overlap.*) and
the simulated trace (trace_<plan>.sim.*) likewise.

On CPU the 8 "devices" are threads of one process sharing the machine's cores (2 here), so
stages do not truly run concurrently, and measured/simulated ratios reflect that core
sharing, not the schedule. The serial sum times each action alone with a sync after it (its
dispatch and sync costs included, nothing overlapped), so it is far above the measured step,
whose actions are dispatched asynchronously and overlap. On a GPU host each stage mesh has its
own devices.

The planner plan is asked for without interleaving (vpp) to keep this CPU benchmark small;
interleaved plans run Megatron's per-mesh order (schedule/schedule.py) and simulate alike.

  python scripts/bench_runtime.py [--steps 3] [--seq 256] [--samples 8] [--plans rigid,disagg]
"""
from __future__ import annotations

import os
import sys

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from mmjax.cpu_threads import force_cpu_devices  # noqa: E402

force_cpu_devices(8)

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import contextlib  # noqa: E402
import io  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402
from collections import Counter  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from mmjax.data.layout import AssemblyLayout, check_sample  # noqa: E402
from mmjax.data.synthetic import SyntheticConfig, SyntheticDataset  # noqa: E402
from mmjax.models.config import with_overrides  # noqa: E402
from mmjax.models.tiny import tiny  # noqa: E402
from mmjax.data.feed import microbatch_feed  # noqa: E402
from mmjax.parallel.zero import Zero1Optimizer  # noqa: E402
from mmjax.pipeline.runtime import PipelineRuntime  # noqa: E402
from mmjax.pipeline.stage import rank_axes  # noqa: E402
from mmjax.schedule.stage_graph import StageId  # noqa: E402
from mmjax.schedule.simulate import simulate  # noqa: E402
from mmjax.planner.plan import Plan  # noqa: E402
from mmjax.train.beside_profile import ProbeSet  # noqa: E402
from mmjax.train.dispatch_probe import DispatchProbe  # noqa: E402

PLANS = ("rigid", "disagg", "planner")
CPU_NOTE = ("On CPU the 8 'devices' share {cores} host core(s): stages do not truly run "
            "concurrently, so measured/simulated ratios reflect that core sharing, not the "
            "schedule or runtime overhead. The serial sum times each action alone with a sync "
            "after it (nothing overlapped), so it lies far above the measured step.")


def _timeline():
    """scripts/timeline.py as a module (scripts/ is not a package)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "timeline.py")
    spec = importlib.util.spec_from_file_location("mmjax_timeline_script", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def model_config(args):
    h = args.llm_hidden
    return with_overrides(tiny(), {"llm.hidden_size": h, "llm.ffn_size": 2 * h,
                                   "llm.num_layers": args.llm_layers})


def make_plan(name: str, cfg, samples: int, microbatches: int, per_node: int = 0) -> Plan:
    """The named plan, placed on nodes of `per_node` devices (planner/placement.py: no TP
    group straddles a node); 0: one node."""
    if name == "rigid":
        plan = Plan.rigid(cfg, dp=1, tp=2, pp=2, global_batch=samples,
                          num_microbatches=microbatches)
    elif name == "disagg":
        plan = Plan.uniform(cfg, samples, microbatches, kind="disaggregated",
                            dp={"vision": 2, "llm": 1, "generator": 2},
                            tp={"llm": 2}, pp={"llm": 2})
    elif name == "planner":
        from mmjax.planner.build import plan_model
        from mmjax.planner.hardware import hardware
        plan = plan_model(cfg, hardware("h100"), 8, samples, vpp=False)
    else:
        raise ValueError(f"--plans: unknown plan {name!r}; choose from {PLANS}")
    return dataclasses.replace(plan, devices_per_node=per_node) if per_node else plan


def node_of(device_index: int, per_node: int) -> int:
    return device_index // per_node if per_node else 0


def traffic(rt: PipelineRuntime, ledgers: list[dict], per_node: int) -> dict:
    """Bytes one step moves, by link class: broker exchanges between stages (counted by the
    brokers' ledgers: the parts delivered, a device's parts to itself as "same device"),
    and each stage's ZeRO-1 gradient sync (ring reduce-scatter of the float32 partials, ring
    all-gather of the compute copy: (dp-1)/dp of each per device, computed from the shapes)
    on the link class of its dp groups."""
    index = {d.id: k for k, d in enumerate(jax.devices())}
    out = {"broker_same_device": 0, "broker_intra_node": 0, "broker_inter_node": 0,
           "sync_intra_node": 0, "sync_inter_node": 0}
    for ledger in ledgers:
        for (u, v), nbytes in ledger.items():
            cls = ("same_device" if u == v else "intra_node"
                   if node_of(index[u], per_node) == node_of(index[v], per_node) else "inter_node")
            out[f"broker_{cls}"] += nbytes
    for st in rt.stages.values():
        if not (st.mode.param_grads and jax.tree.leaves(st.abstract)) or st.dp == 1:
            continue
        params = sum(x.size for x in jax.tree.leaves(st.abstract))
        per_device = params / st.mesh.devices.size * st.dp  # one dp rank's TP shard
        nbytes = st.mesh.devices.size * (st.dp - 1) / st.dp * per_device * (
            4 + np.dtype(rt.dtype).itemsize)
        nodes = {node_of(index[d.id], per_node) for d in st.mesh.devices.flat}
        out["sync_intra_node" if len(nodes) == 1 else "sync_inter_node"] += int(nbytes)
    return out


def node_map(plan: Plan) -> str:
    """Per unit, its stages' device indices (planner/placement.py), nodes marked."""
    per = plan.devices_per_node
    return "; ".join(f"{u}: " + " | ".join(",".join(f"{d}@n{node_of(d, per)}" for d in idx)
                                           for idx in stages)
                     for u, stages in plan.stage_devices().items())


VISION_CAPS = (64, 256)


def batch(cfg, seq: int, n: int):
    lay = AssemblyLayout.from_config(cfg, seq, "pad", vision_caps=VISION_CAPS)
    ds = SyntheticDataset("laion", SyntheticConfig.for_model(cfg, gen_fraction=0.5), seed=3)
    samples = [s for s in (ds[i] for i in range(20 * n)) if check_sample(s, lay) is None][:n]
    if len(samples) < n:
        raise ValueError(f"--seq={seq}: only {len(samples)} of {n} synthetic samples fit; "
                         "raise --seq")
    return lay, samples


def feeds_for(plan: Plan, lay, samples):
    n, dp = plan.microbatch_size, {u.name: u.dp for u in plan.units}
    return [microbatch_feed(samples[m * n:(m + 1) * n], lay, dp)
            for m in range(plan.num_microbatches)]


def _wait(rt: PipelineRuntime, res) -> dict:
    losses = res.losses()
    jax.block_until_ready(res.grads)
    return losses


def stage_costs(traces: list[list[dict]]) -> dict[tuple[str, str], float]:
    """Median traced seconds per (stage, kind) over all actions of all traced steps."""
    acc: dict[tuple[str, str], list[float]] = {}
    for tr in traces:
        for d in tr:
            stage = d.get("virtual_stage", d["stage"])  # per model chunk
            acc.setdefault((stage, d["kind"]), []).append(d["end"] - d["start"])
    return {k: statistics.median(v) for k, v in acc.items()}


_COLLECTIVE = re.compile(r"\b(all-reduce|reduce-scatter|all-gather|all-to-all|"
                         r"collective-permute)(-start)?\(")


def _ops(lowered) -> Counter:
    return Counter(m.group(1) for m in _COLLECTIVE.finditer(lowered.compile().as_text()))


def collectives_per_step(rt: PipelineRuntime) -> dict[str, dict[str, int]]:
    """Per stage: collective ops one training step issues, from the compiled programs (the
    forward/backward run once per microbatch; the ZeRO-1 sync and update once per step)."""
    m, out = rt.plan.num_microbatches, {}
    for sid, st in rt.stages.items():
        count = Counter()
        for kind in st.fns.signatures:
            for op, n in _ops(st.fns.lowered(kind)).items():
                count[op] += n * m
        if st.mode.param_grads and jax.tree.leaves(st.abstract):
            opt = Zero1Optimizer(optax.adamw(1e-3), st.mesh, st.abstract, clip_norm=1.0,
                                 rank_axes=rank_axes(st.mesh))
            put = lambda t, sh, lead=(): jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(
                lead + tuple(a.shape), a.dtype, sharding=s), t, sh)
            state = put(jax.eval_shape(opt.tx.init, st.abstract), opt.state_shardings)
            master = put(st.abstract, opt.master_shardings)
            count += _ops(opt._sync.lower(put(st.abstract, opt.rank_partial_shardings,
                                              (st.fns.ranks,))))
            count += _ops(opt.lower_step(master, master, state))
        out[str(sid)] = dict(sorted(count.items()))
    return out


def stage_memory_rows(cfg, plan: Plan, feeds) -> dict:
    """Per stage: the planner's predicted peak bytes per device (planner/memory.py) and XLA's
    account of the compiled stage programs (pipeline/memory_account.py), after one whole
    training step (forward, backward, ZeRO-1 sync and update) of `feeds`."""
    from mmjax.pipeline.memory_account import compiled_stage, in_flight, predicted_stage
    from mmjax.train.pipelined import PipelinedRunner

    ps = PipelinedRunner(cfg, plan, 1e-3)
    ps.train_on(feeds)
    flight = in_flight(ps.runtime.schedule)
    out = {}
    for sid in ps.runtime.stages:
        c = compiled_stage(ps, sid, flight[sid])["peak"]
        p = predicted_stage(cfg, plan, ps, sid, flight[sid]).peak
        out[str(sid)] = {"predicted_bytes": float(p), "compiled_bytes": float(c),
                         "error": float(p / c - 1)}
    return out


def host_profile(path: str) -> dict:
    """This host's measured profile: `path`'s (scripts/profile_hardware.py --devices 8 on
    this machine), else the peak, bandwidths and dense-attention pair time measured now."""
    from mmjax.planner.measured_hardware import check_device, has_measurement
    from mmjax.train.device_measure import measure_device

    profile = {}
    if path:
        with open(path) as fh:
            profile = json.load(fh)
        check_device(profile, str(jax.devices()[0].device_kind), f"--profile={path}")
    if not has_measurement(profile) or "device_busy_cores" not in profile:
        profile.update(measure_device(dtypes=("float32",)))
    return profile


def predicted_step(cfg, plan: Plan, lay, samples, profile: dict) -> dict:
    """The planner's step for `plan` on this host (planner/shared_host.py): its cost model
    on the padded shapes the runtime computes, under each unit's remat policy (the backward
    re-runs the forward under "full"), with the measured profile's layers and dense
    attention, as the 1F1B schedule and as the host's cores shared by its devices."""
    from mmjax.planner.costs import unit_costs
    from mmjax.planner.evaluate import Choice
    from mmjax.planner.measured_hardware import hardware_from_profile
    from mmjax.planner.shared_host import dense_costs, padded_workload, shared_host_time
    from mmjax.planner.workload import workload_from_metas

    hw = hardware_from_profile(profile, "float32", call_tokens=0.0)
    wl = padded_workload(workload_from_metas("bench", [lay.rules.meta(s) for s in samples],
                                             cfg), lay.seq_len, VISION_CAPS)
    remat = {u.name: u.remat for u in plan.units}  # the stages' policies (Plan: "full")
    costs = dense_costs(cfg, wl, hw, unit_costs(cfg, wl, hw, recompute=remat),
                        act_bytes=4, remat=remat)  # float32 activations
    choices = {u.name: Choice(u.tp, u.dp, u.pp) for u in plan.units}
    t = shared_host_time(costs, choices, plan.global_batch, hw,
                         int(profile.get("cpu_cores") or os.cpu_count()),
                         float(profile.get("device_busy_cores") or 1.0),
                         float(profile.get("action_host_cpu_s") or 0.0), plan.num_microbatches)
    return {"predicted_step_s": t.step_s, "predicted_schedule_s": t.schedule_s,
            "predicted_cores_bound_s": t.cores_bound_s, "predicted_compute_s": t.compute_s,
            "predicted_host_s": t.host_s, "predicted_actions": t.num_actions,
            "predicted_process_cpu_s": t.cpu_s}


def timed_steps(rt: PipelineRuntime, feeds, steps: int, probes):
    """(dispatch s, step s, process CPU s per step, the dispatching thread's CPU s in
    `run` per step, the last losses) of `steps` steps, each of `probes` sampled once
    after each."""
    dispatch, step, cpu, host = [], [], [], []
    for _ in range(steps):
        c0, t0, h0 = time.process_time(), time.perf_counter(), time.thread_time()
        res = rt.run(feeds, rt.initial_compute_params())  # copies made each step
        t1 = time.perf_counter()
        host.append(time.thread_time() - h0)
        losses = _wait(rt, res)
        t2 = time.perf_counter()
        cpu.append(time.process_time() - c0)
        dispatch.append(t1 - t0)
        step.append(t2 - t0)
        for probe in probes:
            probe.sample()
    return dispatch, step, cpu, host, losses


def bench_plan(name, cfg, lay, samples, args, out_dir, timeline, compiles) -> dict:
    plan = make_plan(name, cfg, len(samples), args.microbatches, args.devices_per_node)
    rt = PipelineRuntime(cfg, plan)
    feeds = feeds_for(plan, lay, samples)
    num_actions = len(rt.order)
    for _ in range(args.warmup):  # compile every stage function and broker route
        _wait(rt, rt.run(feeds, rt.initial_compute_params()))
    for b in rt.brokers.values():  # one untimed step with the traffic counted
        b.ledger = {}
    _wait(rt, rt.run(feeds, rt.initial_compute_params()))
    moved = traffic(rt, [b.ledger for b in rt.brokers.values()], args.devices_per_node)
    for b in rt.brokers.values():
        b.ledger = None
    # without --profile, the host's profile is measured beside the timed steps (probes on
    # the first device after each step: the steps' own load, train/beside_profile.py)
    # and so is the host CPU of dispatching one action (train/dispatch_probe.py), on twice
    # the parameter leaves of the plan's median stage (a forward takes the parameters; a
    # backward also their gradient accumulators and the residuals)
    probes = None
    if args.host_profile is None:
        leaves = statistics.median_low([len(jax.tree.leaves(st.abstract))
                                        for st in rt.stages.values()])
        probes = (ProbeSet(dtype="float32"), DispatchProbe(leaves=max(2 * leaves, 1)))
    compiled_before = compiles["n"]
    dispatch, step, cpu, host, losses = timed_steps(rt, feeds, args.steps, probes or ())
    # the timed steps trace and compile nothing (tests/test_compile_once.py: nor do new
    # balanced global batches, padded to one shape floor);
    # the traced modes below compile their completion markers once (pipeline/trace.py)
    compiled_after_warmup = compiles["n"] - compiled_before
    traces = []
    for _ in range(args.trace_steps):
        res = rt.run(feeds, rt.initial_compute_params(), trace=True)
        _wait(rt, res)
        traces.append(res.trace)
    costs = stage_costs(traces)
    sim = simulate(rt.schedule, {(StageId.parse(s), k): v for (s, k), v in costs.items()},
                   rt.graph)
    trace = traces[-1]
    t0 = min(d["start"] for d in trace)
    traced_span = max(d["end"] for d in trace) - t0
    busy = {s: sum(d["end"] - d["start"] for d in trace if d["stage"] == s)
            for s in sorted({d["stage"] for d in trace})}
    # asynchronous dispatch, completions stamped
    res = rt.run(feeds, rt.initial_compute_params(), trace="overlap")
    _wait(rt, res)
    overlap = res.trace
    o0 = min(d["start"] for d in overlap)
    overlap_span = max(d["end"] for d in overlap) - o0
    files = {}
    for tag, tr in (("", [{**d, "start": d["start"] - t0, "end": d["end"] - t0}
                          for d in trace]),
                    (".overlap", [{**d, "start": d["start"] - o0, "end": d["end"] - o0}
                                  for d in overlap]), (".sim", sim.trace())):
        path = os.path.join(out_dir, f"trace_{name}{tag}.json")
        with open(path, "w") as fh:
            json.dump(tr, fh, indent=0)
        with contextlib.redirect_stdout(io.StringIO()):  # its per-file summary: noise here
            written = timeline.main([path])
        files[f"trace{tag}"] = path
        files[f"png{tag}"], files[f"perfetto{tag}"] = written["png"], written["chrome"]
    measured = statistics.median(step)
    return {
        "plan": name, "kind": plan.kind,
        "units": {u.name: {"dp": u.dp, "tp": u.tp, "pp": u.pp, "layers": list(u.layers)}
                  for u in plan.units},
        "global_batch": plan.global_batch, "num_microbatches": plan.num_microbatches,
        "num_stages": len(rt.stages), "num_actions": num_actions,
        "dispatch_s": statistics.median(dispatch),
        "dispatch_us_per_action": statistics.median(dispatch) / num_actions * 1e6,
        "measured_step_s": measured, "measured_steps_s": step,
        "traced_step_s": traced_span, "overlap_traced_step_s": overlap_span,
        "serial_sum_s": sum(busy.values()),
        "stage_busy_s": busy,
        "stage_costs_s": {f"{s}/{k}": v for (s, k), v in sorted(costs.items())},
        "simulated_step_s": sim.iteration_time,
        "measured_over_simulated": measured / sim.iteration_time,
        "bubble_fraction": sim.mean_bubble_fraction,
        "stage_bubble_fraction": {str(s): b for s, b in sim.bubble_fraction.items()},
        "loss": losses["loss"], "files": files,
        "collectives_per_step": collectives_per_step(rt),
        "bytes_per_step": moved, "devices_per_node": args.devices_per_node,
        "node_map": node_map(plan), "compiles_after_warmup": compiled_after_warmup,
        "stage_memory": stage_memory_rows(cfg, plan, feeds),
        "measured_cpu_s": statistics.median(cpu), "measured_steps_cpu_s": cpu,
        "dispatch_cpu_s": statistics.median(host),
        **predictions(cfg, plan, lay, samples, args.host_profile, probes),
    }


def predictions(cfg, plan: Plan, lay, samples, profile: dict | None, probes) -> dict:
    """The planner's step for `plan` priced with `profile` (--profile's), or with the
    probes' wall-second profile and, for the step's process CPU time, their CPU-second one
    (its devices' compute, `predicted_cpu_compute_s`, plus the actions' host dispatch CPU
    from the dispatch probe: `predicted_cpu_s`)."""
    if probes is None:
        return {"hardware_profile": profile, **predicted_step(cfg, plan, lay, samples, profile)}
    device, dispatching = probes
    host = {"action_host_cpu_s": dispatching.action_host_cpu_s(),
            "action_host_cpu_samples": dispatching.samples}
    wall, per_cpu = {**device.profile(), **host}, {**device.profile("cpu"), **host}
    out = {"hardware_profile": wall, "cpu_profile": per_cpu,
           **predicted_step(cfg, plan, lay, samples, wall)}
    on_cpu = predicted_step(cfg, plan, lay, samples, per_cpu)
    out["predicted_cpu_s"] = on_cpu["predicted_process_cpu_s"]
    out["predicted_cpu_compute_s"] = on_cpu["predicted_compute_s"]
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--plans", default="rigid,disagg", help=f"comma list of {PLANS}")
    ap.add_argument("--samples", type=int, default=8, help="global batch (samples)")
    ap.add_argument("--microbatches", type=int, default=4,
                    help="microbatches for rigid/disagg (the planner picks its own)")
    ap.add_argument("--seq", type=int, default=256, help="LLM sequence length")
    ap.add_argument("--llm_hidden", type=int, default=128, help="LLM width (ffn = 2x)")
    ap.add_argument("--llm_layers", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps (compile)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps (median)")
    ap.add_argument("--trace_steps", type=int, default=2, help="traced steps for the costs")
    ap.add_argument("--devices_per_node", type=int, default=4,
                    help="devices per (virtual) node: placement and link classes")
    ap.add_argument("--profile", default="", metavar="FILE",
                    help="this host's measured profile (scripts/profile_hardware.py "
                         "--devices 8); without one, the peak and bandwidths are measured")
    ap.add_argument("--out", default=os.path.join("bench_results", "bench_runtime.json"))
    args = ap.parse_args(argv)
    for k in ("samples", "microbatches", "seq", "steps", "trace_steps"):
        if getattr(args, k) < 1:
            raise ValueError(f"--{k}={getattr(args, k)}: must be >= 1")
    names = [p for p in args.plans.split(",") if p]
    for p in names:
        if p not in PLANS:
            raise ValueError(f"--plans: unknown plan {p!r}; choose from {PLANS}")
    if len(jax.devices()) < 8:
        raise RuntimeError(f"need 8 devices, found {len(jax.devices())}; run with "
                           "XLA_FLAGS=--xla_force_host_platform_device_count=8")
    out_dir = os.path.dirname(args.out) or "."
    os.makedirs(out_dir, exist_ok=True)
    cfg = model_config(args)
    lay, samples = batch(cfg, args.seq, args.samples)
    args.host_profile = host_profile(args.profile) if args.profile else None
    timeline = _timeline()
    compiles = {"n": 0}  # programs traced or compiled (jax.monitoring), to count after warm-up

    def count(event, duration, **kw):
        if event in ("/jax/core/compile/jaxpr_trace_duration",
                     "/jax/core/compile/backend_compile_duration"):
            compiles["n"] += 1

    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        rows = [bench_plan(p, cfg, lay, samples, args, out_dir, timeline, compiles)
                for p in names]
    finally:
        jax.monitoring.unregister_event_duration_listener(count)

    console = Console(width=max(Console().width, 140))
    table = Table(title=f"pipeline runtime, tiny MLLM (llm {args.llm_layers}x{args.llm_hidden}),"
                        f" seq {args.seq}, {args.samples} samples, {jax.devices()[0].platform}")
    for col in ("plan", "units dp/tp/pp", "#mb", "#actions", "dispatch us/action",
                "measured step s", "serial sum s", "simulated step s", "ratio meas/sim",
                "bubble frac", "predicted step s", "ratio meas/pred",
                "CPU s meas/pred", "host CPU ms/action"):
        table.add_column(col, justify="left" if col.startswith(("plan", "units")) else "right",
                         no_wrap=col.startswith("units"))
    for r in rows:
        units = " ".join(f"{n[:3]}:{u['dp']}/{u['tp']}/{u['pp']}" for n, u in r["units"].items())
        table.add_row(r["plan"], units, str(r["num_microbatches"]), str(r["num_actions"]),
                      f"{r['dispatch_us_per_action']:.0f}", f"{r['measured_step_s']:.3f}",
                      f"{r['serial_sum_s']:.3f}", f"{r['simulated_step_s']:.3f}",
                      f"{r['measured_over_simulated']:.2f}", f"{r['bubble_fraction']:.2f}",
                      f"{r['predicted_step_s']:.3f}",
                      f"{r['measured_step_s'] / r['predicted_step_s']:.2f}",
                      f"{r['measured_cpu_s']:.3f}/{r['predicted_cpu_s']:.3f}"
                      if r.get("predicted_cpu_s") else "-",
                      f"{r['predicted_host_s'] / r['num_actions'] * 1e3:.2f}")
    console.print(table)
    for r in rows:
        console.print(f"{r['plan']}: collectives per stage per step "
                      + "; ".join(f"{s} " + (", ".join(f"{n} {op}" for op, n in c.items())
                                             or "none")
                                  for s, c in r["collectives_per_step"].items()))
        mb = {k: v / 2 ** 20 for k, v in r["bytes_per_step"].items()}
        console.print(f"{r['plan']}: nodes of {r['devices_per_node']} devices: {r['node_map']}")
        console.print(f"{r['plan']}: MiB per step: broker same device "
                      f"{mb['broker_same_device']:.2f}, intra-node {mb['broker_intra_node']:.2f}, "
                      f"inter-node {mb['broker_inter_node']:.2f}; gradient sync intra-node "
                      f"{mb['sync_intra_node']:.2f}, inter-node {mb['sync_inter_node']:.2f}; "
                      f"programs traced or compiled in the timed steps: {r['compiles_after_warmup']}")
        console.print(f"{r['plan']}: peak MB per device, planner / compiled: " + ", ".join(
            f"{s} {m['predicted_bytes'] / 2 ** 20:.2f} / {m['compiled_bytes'] / 2 ** 20:.2f} "
            f"({m['error']:+.1%})" for s, m in r["stage_memory"].items()))
        console.print(f"{r['plan']}: stage busy (traced step) "
                      + ", ".join(f"{s} {v * 1e3:.1f} ms" for s, v in r["stage_busy_s"].items()))
        console.print(f"  timeline {r['files']['png']} (simulated: {r['files']['png.sim']}), "
                      f"Perfetto {r['files']['perfetto']}")
    note = CPU_NOTE.format(cores=os.cpu_count())
    if jax.devices()[0].platform == "cpu":
        console.print(f"[bold]Note:[/bold] {note}")
    profile = rows[-1]["hardware_profile"]
    del args.host_profile
    result = {"settings": vars(args), "hardware_profile": profile, "platform": jax.devices()[0].platform,
              "num_devices": len(jax.devices()), "host_cores": os.cpu_count(),
              "note": note if jax.devices()[0].platform == "cpu" else "", "rows": rows}
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)
    console.print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    from mmjax.cli import run_main

    sys.exit(run_main(main))
