"""`train.plan = "auto"`: the run's layout planned at start-up for the devices present and
the run's data (DistTrain §3: the manager samples the training data, profiles, and
orchestrates before training); `auto_plan.layout` acts here. The planner (planner/build.py, DistTrain §5) runs on the workload of samples
drawn from the trainer's own source (data/data_spec.py), for `jax.device_count()` devices
of the hardware the devices are (by device kind; the analytic H100 model for others, e.g.
CPU devices in tests)."""
from __future__ import annotations

import re

import gin
import jax

from mmjax.data.data_spec import sample_workload
from mmjax.planner.build import plan_model
from mmjax.planner.hardware import H100, hardware, hardware_of_device
from mmjax.planner.plan import PlanError
from mmjax.models.units import is_encoder, is_llm
from mmjax.settings import bound, check_args
from mmjax.train.run_layout import RunLayout


def device_hardware(devices=None):
    """The `Hardware` spec of the devices present (by device kind), H100's otherwise."""
    return hardware_of_device(str((devices or jax.devices())[0].device_kind)) or H100


def planning_inputs(cfg, source, hardware_name: str | None = None, data_samples: int = 256):
    """(Hardware, Workload) the planner plans a run for: the named hardware (else the
    devices'), and `data_samples` samples of the run's `source`."""
    hw = hardware(hardware_name) if hardware_name else device_hardware()
    return hw, sample_workload(source, cfg, data_samples, name="train data")


def run_planning_inputs(cfg, source):
    """`planning_inputs` under the run's gin `auto_plan.*` settings, so re-planning plans
    for the hardware and data that start-up planning does."""
    get = lambda p, default: bound(f"auto_plan.{p}", default)
    return planning_inputs(cfg, source, get("hardware_name", None), get("data_samples", 256))


def cpu_devices_hint(message: str) -> str:
    """On CPU, how to get the devices a plan needs: XLA_FLAGS's forced host devices."""
    if jax.devices()[0].platform != "cpu":
        return ""
    need = re.search(r"needs (\d+) GPUs", message)
    count = max(int(need.group(1)) if need else 8, 2)
    return (f" (on CPU, force host devices: XLA_FLAGS=--xla_force_host_platform_device_count="
            f"{count} before the command)")


@gin.configurable
def auto_plan(cfg, global_batch: int, source, num_devices: int | None = None,
              hardware_name: str | None = None, data_samples: int = 256,
              layout: str = "disaggregated") -> tuple[RunLayout, str]:
    """-> (the run's layout, one line saying what was planned and why), planned for
    `num_devices` (default: the devices present) of `hardware_name` (default: the devices'
    kind) on `data_samples` samples of `source`. `layout`: "disaggregated" (default): the
    planner's validated Plan (DistTrain §5); "colocated": the co-located layout's best
    choice (planner/colocated.py, OrchMLLM §4-7, one step of the whole global batch as the
    co-located runner runs it); "auto": both priced on the same workload, the faster taken
    (planner/layout_choice.py)."""
    check_args("auto_plan", layout=layout)
    n = num_devices or jax.device_count()
    hw, wl = planning_inputs(cfg, source, hardware_name, data_samples)
    if layout != "disaggregated":
        return _priced_layout(cfg, global_batch, hw, wl, n, layout)
    try:
        if cfg.vae is not None:  # the VAE unit (vae.placement chose devices): its GPUs
            from mmjax.planner.vae_placement import plan_with_vae
            plan, _ = plan_with_vae(
                lambda m, g: plan_model(m, hw, g, global_batch, workload=wl), cfg, hw, n,
                global_batch * wl.mean_generated(), 1, placement="device")
        else:
            plan = plan_model(cfg, hw, n, global_batch, workload=wl)
    except PlanError as e:
        raise PlanError(f"train.plan='auto' on {n} device{'s' if n > 1 else ''}: {e}"
                        f"{cpu_devices_hint(str(e))}") from None
    plan = plan.validate(cfg, n)
    return RunLayout("auto", chosen=plan), "auto plan: " + "; ".join(
        f"{u.name} dp={u.dp} tp={u.tp} pp={u.pp}" for u in plan.units)


def _priced_layout(cfg, global_batch: int, hw, wl, n: int, layout: str
                   ) -> tuple[RunLayout, str]:
    """`auto_plan.layout` "colocated" or "auto": the co-located layout's best choice,
    beside the disaggregated planner's plan when "auto" (the faster taken)."""
    from mmjax.planner.build import model_costs
    from mmjax.planner.colocated import best_colocated
    from mmjax.planner.layout_choice import choose_layout, slowest_stage_busy_s
    from mmjax.train.colocated_plan import check_layout

    try:
        colo = best_colocated(model_costs(cfg, hw, wl)[0], n, global_batch, hw,
                              max_micro_steps=1)
    except PlanError as e:
        if layout == "colocated":
            raise PlanError(f"train.plan='auto' with auto_plan.layout='colocated' on {n} "
                            f"devices: {e}") from None
        colo, colo_error = None, str(e)
    plan, dis_s, warm = None, None, 0.0
    if layout == "auto":
        try:
            plan = plan_model(cfg, hw, n, global_batch, workload=wl).validate(cfg, n)
            dis_s, warm = plan.predicted["iteration_time_s"], slowest_stage_busy_s(plan)
        except PlanError:
            plan = None
    if layout == "colocated":
        assert colo is not None  # a co-located layout that does not fit raised above
        why = f"auto_plan.layout='colocated', predicted {colo.iteration_time_s:.3f} s per iteration"
    else:
        try:
            pick = choose_layout(colo, dis_s, warm)
        except PlanError:
            raise PlanError(f"train.plan='auto' on {n} devices: neither layout fits "
                            f"(co-located: {colo_error}; no disaggregated plan)") from None
        if pick.layout == "disaggregated":
            return (RunLayout("auto", chosen=plan),
                    f"auto layout: disaggregated ({pick.reason})")
        why = pick.reason
        assert colo is not None  # choose_layout picks co-located only when it fits
    tps = {u: t for u, t in colo.tp.items() if is_llm(u) or is_encoder(u)}
    chosen = check_layout(cfg.unit_names, n, "colocated", dict(colo.zero), None, tps,
                          model=cfg)
    assert chosen is not None  # check_layout's answer for layout "colocated"
    encs = "".join(f", {u} tp {t}" for u, t in chosen.unit_tp)
    return RunLayout("auto", colocation=chosen), (
        f"auto layout: co-located (llm tp {chosen.tp}{encs}, ZeRO {dict(colo.zero)}) ({why})")
