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
        if n in ("llm", "generator"):
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
    return ("rep", "fsdp") if unit == "llm" and mesh.shape["tp"] > 1 else AXES


def _group_axes(mesh: Mesh, unit: str) -> tuple[str, ...]:
    return ("fsdp",) if unit == "llm" and mesh.shape["tp"] > 1 else ("fsdp", "tp")


def leaf_spec(mesh: Mesh, names, shape, sharded: bool) -> P:
    """`names`' spec: its tp dimension (LLM), and with `sharded` its FSDP dimension."""
    unit = unit_of(names) or ""
    spec = [None] * len(shape)
    tdim = _tp_dim(names, shape, mesh.shape["tp"]) if unit == "llm" else None
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


def gather_layer(mesh: Mesh):
    """`scan.layer_weights`' function: one layer's state, whole again (but for the LLM's tp
    dimension). Layer-relative paths name their unit by role: LLM projections are
    wq/wo/w_up..., every other block weight belongs to a tp-1 unit."""
    def spec(path, w):
        names = path_names(path)
        llm = bool(set(names) & (set(LLM_COLUMN_PARAMS) | set(LLM_ROW_PARAMS)))
        full = (("llm", "layers") if llm else ("encoders", "", "layers")) + names
        return NamedSharding(mesh, leaf_spec(mesh, full, w.shape, sharded=False))

    def gather(state):
        return jax.tree_util.tree_map_with_path(
            lambda p, w: jax.lax.with_sharding_constraint(w, spec(p, w)), state)
    return gather


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
