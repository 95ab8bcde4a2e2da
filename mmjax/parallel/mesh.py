"""Sub-meshes: one disjoint `Mesh` per pipeline stage of every parallelism unit.

DistTrain §4.1 ("parallelism unit") gives every module its own devices with its own DP/TP;
Cornstarch §4.1 runs the encoders on their own devices in parallel. `Plan.stage_devices`
says which indices of the global device list each stage owns (node-aware when the plan
has `devices_per_node`); here they become meshes with
axes ('dp', 'tp'), or ('dp', 'cp', 'tp') when the unit has cp > 1. TP is innermost, so a tp
group sits on contiguous devices (one NVLink island on GPUs).

Axis types are `AxisType.Auto` on purpose: the stage functions are plain `jit` with
`NamedSharding` in/out specs and let GSPMD propagate shardings (Megatron column/row rules),
with `shard_map` only inside (collective matmul, context parallelism, the broker). Explicit
axes would make every jnp op inside the models carry sharding-in-types, which the Flax
models are not written for.
"""
from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from mmjax.planner.plan import Plan


def unit_axes(cp: int) -> tuple[str, ...]:
    """Mesh axis names of a stage of a unit with context-parallel size `cp`."""
    return ("dp", "cp", "tp") if cp > 1 else ("dp", "tp")


def stage_mesh(devices, dp: int, tp: int, cp: int = 1) -> Mesh:
    """A ('dp'[, 'cp'], 'tp') mesh over exactly `dp * cp * tp` devices, TP innermost."""
    devs = list(devices)
    if len(devs) != dp * cp * tp:
        raise ValueError(f"stage_mesh: got {len(devs)} devices for dp={dp} x cp={cp} x tp={tp}"
                         f" = {dp * cp * tp}; pass exactly that many")
    names = unit_axes(cp)
    shape = (dp, cp, tp) if cp > 1 else (dp, tp)
    arr = np.empty(len(devs), dtype=object)
    arr[:] = devs
    return Mesh(arr.reshape(shape), names, axis_types=(AxisType.Auto,) * len(names))


def stage_meshes(plan: Plan, devices=None) -> dict[str, list[Mesh]]:
    """Per unit, per pipeline stage, its disjoint sub-mesh (see module docstring).

    `devices` defaults to `jax.devices()` (every process's devices in a multi-process run);
    stages take the indices of `plan.stage_devices()` into that list."""
    devs = list(jax.devices() if devices is None else devices)
    if plan.num_devices > len(devs):
        raise ValueError(f"stage_meshes: the plan needs {plan.num_devices} devices (sum of "
                         f"dp*cp*tp*pp over units) but {len(devs)} were given: lower dp/tp/pp "
                         f"or run on more devices")
    if len({d.id for d in devs}) != len(devs):
        raise ValueError("stage_meshes: `devices` lists a device twice; pass distinct devices")
    out: dict[str, list[Mesh]] = {}
    for name, stages in plan.stage_devices().items():
        u = plan.unit(name)
        out[name] = [stage_mesh([devs[k] for k in idx], u.dp, u.tp, u.cp) for idx in stages]
    return out


def put_global(x, sharding):
    """`device_put` that also serves shardings spanning processes: each process fills only
    its addressable shards from the host value (identical on every process)."""
    if sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    if isinstance(x, jax.Array) and x.sharding == sharding:
        return x
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx],
                                        dtype=host.dtype)
