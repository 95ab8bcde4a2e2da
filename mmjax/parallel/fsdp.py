"""FSDP shardings of the co-located layout: every unit on one mesh of all devices.

The mesh is (rep, fsdp, tp): `tp` is the LLM's tensor-parallel size (1 without), `fsdp` *
`tp` devices form one FSDP group (`fsdp_group`, contiguous device ids, so a group lies
inside a node when it fits), `rep` groups replicate (hybrid sharding, OrchMLLM §7). A unit
with tp 1 is data-parallel over every device; the LLM with tp T is data-parallel over
(rep, fsdp) and Megatron-sharded over tp (parallel/tensor.py's rules).

ZeRO stages (ZeRO §5, per unit), as GSPMD shardings XLA turns into collectives:
  1: optimizer state sharded over the group, parameters and gradients whole (all-reduce);
  2: also the gradients sharded (reduce-scatter);
  3: also the parameters stored sharded; each layer's weights are all-gathered inside the
     layer scan (models/scan.py `layer_weights`) in the forward and again in the backward.
A leaf is sharded along its largest dimension that the group size divides (not its tp
dimension); a leaf with none stays whole.
"""
from __future__ import annotations

import math
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mmjax.models.units import is_generator, is_llm
from mmjax.parallel.tensor import megatron_role, path_names
from mmjax.parallel.tp_ops import LLM_COLUMN_PARAMS, LLM_ROW_PARAMS

AXES = ("rep", "fsdp", "tp")
UNIT_ROOTS = ("encoders", "projectors", "llm", "generator")


def colocated_mesh(devices, colo) -> Mesh:
    """(rep, fsdp, tp) over `devices` in their order (jax.devices(): by process, then id);
    `colo`: a train/colocated_plan.py `Colocation` (tp, fsdp_group, per-unit stages)."""
    n = len(devices)
    group = colo.fsdp_group or n
    return Mesh(np.asarray(devices).reshape(n // group, group // colo.tp, colo.tp), AXES)


def unit_of(names: tuple[str, ...]) -> str | None:
    """The unit a parameter (or optimizer-state) path belongs to."""
    for i, n in enumerate(names):
        if n in ("encoders", "projectors"):
            return names[i + 1] if i + 1 < len(names) else None
        if is_llm(n) or is_generator(n):
            return n
    return None


def _tp_dim(names, shape, tp: int) -> int | None:
    """The LLM leaf's Megatron dimension (parallel/tensor.py rules), when tp divides it."""
    role = megatron_role(names)
    nd = len(shape)
    dim = {"column": nd - 1 if nd in (1, 2) else None, "row": 0 if nd == 2 else None,
           "vocab_row": 0 if nd == 2 else None, "vocab_column": 1 if nd == 2 else None}.get(role)
    return dim if tp > 1 and dim is not None and shape[dim] % tp == 0 else None


def batch_axes(mesh: Mesh, unit: str) -> tuple[str, ...]:
    """The mesh axes a unit's batch (and data parallelism) spans."""
    return ("rep", "fsdp") if is_llm(unit) and mesh.shape["tp"] > 1 else AXES


def _group_axes(mesh: Mesh, unit: str) -> tuple[str, ...]:
    return ("fsdp",) if is_llm(unit) and mesh.shape["tp"] > 1 else ("fsdp", "tp")


def leaf_spec(mesh: Mesh, names, shape, sharded: bool) -> P:
    """`names`' spec: its tp dimension (LLM), and with `sharded` its FSDP dimension."""
    unit = unit_of(names) or ""
    spec = [None] * len(shape)
    tdim = _tp_dim(names, shape, mesh.shape["tp"]) if is_llm(unit) else None
    if tdim is not None:
        spec[tdim] = "tp"
    if sharded:
        axes = _group_axes(mesh, unit)
        size = math.prod(mesh.shape[a] for a in axes)
        dims = [d for d in range(len(shape)) if d != tdim and shape[d] % size == 0]
        if size > 1 and dims:
            d = max(dims, key=lambda d: shape[d])
            spec[d] = axes if len(axes) > 1 else axes[0]
    return P(*spec)


def tree_shardings(tree, mesh: Mesh, colo, what: str):
    """NamedShardings for a params / grads / optimizer-state tree: `what` is "params"
    (sharded at stage 3), "grads" (stage >= 2) or "opt" (every stage)."""
    least = {"params": 3, "grads": 2, "opt": 1}[what]

    def one(path, leaf):
        names = path_names(path)
        unit = unit_of(names)
        sharded = unit is not None and colo.stage(unit) >= least and len(leaf.shape) > 0
        return NamedSharding(mesh, leaf_spec(mesh, names, leaf.shape, sharded))

    return jax.tree_util.tree_map_with_path(one, tree)


def layer_gather(mesh: Mesh, spec_of):
    """A `scan.layer_weights` function from `spec_of(names, shape, stacked) -> P`: a layer's
    leaves (relative paths) constrained to their whole-layer spec, the stacked layers' to
    their stored (ZeRO-3: sharded) spec with the layer dimension in front. Shared by the
    co-located layout (`gather_layer`) and the pipeline's ZeRO-3 stages (pipeline/stage.py)."""
    def gather(state, stacked=False):
        def one(path, w):
            spec = spec_of(path_names(path), w.shape[1:] if stacked else w.shape, stacked)
            return jax.lax.with_sharding_constraint(
                w, NamedSharding(mesh, P(None, *spec) if stacked else spec))
        return jax.tree_util.tree_map_with_path(one, state)
    return gather


def gather_layer(mesh: Mesh, colo):
    """`scan.layer_weights`' function: one layer's state whole again (but for the LLM's tp
    dimension); the stacked layers' states kept as stored (sharded at ZeRO-3). Layer paths
    are relative, so the unit is told by role: LLM projections are wq/wo/w_up...; every
    other block belongs to an encoder or the generator (tp 1), whose stacked weights stay
    sharded when any of them is at ZeRO-3."""
    others = max([colo.stage(u) for u, _ in colo.stages if not is_llm(u)]
                 + [colo.default_stage])

    def spec(names, shape, stacked):
        llm = bool(set(names) & (set(LLM_COLUMN_PARAMS) | set(LLM_ROW_PARAMS)))
        full = (("llm", "layers") if llm else ("encoders", "", "layers")) + names
        sharded = stacked and (colo.stage("llm") if llm else others) >= 3
        return leaf_spec(mesh, full, shape, sharded)
    return layer_gather(mesh, spec)


def batch_sharding(mesh: Mesh, unit: str, shape) -> NamedSharding:
    """A batch leaf of `unit`: its leading dimension over the unit's data-parallel axes
    (whole when they do not divide it)."""
    axes = batch_axes(mesh, unit)
    size = math.prod(mesh.shape[a] for a in axes)
    if len(shape) == 0 or shape[0] % size:
        return NamedSharding(mesh, P())
    return NamedSharding(mesh, P(axes, *([None] * (len(shape) - 1))))


def place_batch(mesh: Mesh, inputs: dict) -> dict:
    """Host arrays (every process holds the whole global batch) -> global arrays: encoder
    inputs over the encoders' data-parallel ranks, the rest over the LLM's."""
    def put(path, x):
        x = np.asarray(x)
        names = path_names(path)
        unit = names[1] if names[:1] == ("encoders",) else "llm"
        sh = batch_sharding(mesh, unit, x.shape)
        return jax.make_array_from_callback(x.shape, sh, lambda idx: x[idx])
    return jax.tree_util.tree_map_with_path(put, inputs)
