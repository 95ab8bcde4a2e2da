"""`train.plan = "auto"`: plan at start-up for the devices present and the run's data
(DistTrain §3: the manager samples the training data, profiles, and orchestrates before
training). The planner (planner/build.py, DistTrain §5) runs on the workload of samples
drawn from the trainer's own source (data/data_spec.py), for `jax.device_count()` devices
of the hardware the devices are (by device kind; the analytic H100 model for others, e.g.
CPU devices in tests)."""
from __future__ import annotations

import gin
import jax

from mmjax.data.data_spec import sample_workload
from mmjax.planner.build import plan_model
from mmjax.planner.hardware import H100, hardware, hardware_of_device
from mmjax.planner.plan import Plan, PlanError
from mmjax.train.validate import gin_bound



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
    get = lambda p, default: (gin.query_parameter(f"auto_plan.{p}")
                              if gin_bound(f"auto_plan.{p}") else default)
    return planning_inputs(cfg, source, get("hardware_name", None), get("data_samples", 256))


@gin.configurable
def auto_plan(cfg, global_batch: int, source, num_devices: int | None = None,
              hardware_name: str | None = None, data_samples: int = 256) -> Plan:
    """A validated plan for `cfg` on the devices present, planned for `data_samples`
    samples of `source` (gin: `auto_plan.hardware_name = "h100"` to override the device
    kind's spec)."""
    n = num_devices or jax.device_count()
    hw, wl = planning_inputs(cfg, source, hardware_name, data_samples)
    try:
        if cfg.vae is not None:  # the VAE unit (vae.placement chose devices): its GPUs
            from mmjax.planner.vae_placement import plan_with_vae
            plan, _ = plan_with_vae(
                lambda m, g: plan_model(m, hw, g, global_batch, workload=wl), cfg, hw, n,
                global_batch * wl.mean_generated(), 1, placement="device")
        else:
            plan = plan_model(cfg, hw, n, global_batch, workload=wl)
    except PlanError as e:
        raise PlanError(f"train.plan='auto' on {n} devices: {e}") from None
    return plan.validate(cfg, n)
