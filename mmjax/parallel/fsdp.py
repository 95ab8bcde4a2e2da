"""FSDP shardings of the co-located layout: every unit on one mesh of all devices.

The mesh is (rep, fsdp, tp axes): the tp axes factor the largest tensor-parallel size of
any unit into a chain, innermost first: "tp" of the smallest size t1 > 1, then "tp2" of
t2 / t1, "tp3" of t3 / t2 ... (only "tp", of size 1 or the one tp, when every unit with tp
shares it). A unit at tp t_i is Megatron-sharded over the innermost axes whose sizes
multiply to t_i (parallel/tensor.py's rules: the LLM's projections, the encoder blocks'
q/k/v/fc1 and o/fc2) and data-parallel over the rest, so its tp group is contiguous
devices, inside the next larger unit's; a unit at tp 1 is data-parallel over every device.
`fsdp_group` devices (contiguous ids, so a group lies inside a node when it fits; a multiple
of the largest tp) hold one sharded copy; `rep` groups replicate (hybrid sharding, OrchMLLM
§7). `colo` (train/colocated_plan.py `Colocation`) says each unit's tp; where it is not
given, the LLM takes the "tp" axis and every other unit none (a mesh of one tp size).

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

from mmjax.models.scan import current_unit
from mmjax.models.units import is_generator, is_llm
from mmjax.parallel.tensor import megatron_role, path_names
from mmjax.parallel.tp_ops import LLM_COLUMN_PARAMS, LLM_ROW_PARAMS

UNIT_ROOTS = ("encoders", "projectors", "llm", "generator")


def tp_axes(colo) -> tuple[tuple[str, int], ...]:
    """(name, size) of the mesh's tp axes, outer to inner (module docstring)."""
    sizes = colo.tp_sizes or (1,)
    axes = [("tp", sizes[0])] + [(f"tp{i + 1}", b // a)
                                 for i, (a, b) in enumerate(zip(sizes, sizes[1:]), start=1)]
    return tuple(reversed(axes))


def colocated_mesh(devices, colo) -> Mesh:
    """(rep, fsdp, tp axes) over `devices` in their order (jax.devices(): by process, then
    id); `colo`: a train/colocated_plan.py `Colocation` (tp per unit, fsdp_group, stages)."""
    n = len(devices)
    group = colo.fsdp_group or n
    tps = tp_axes(colo)
    top = math.prod(s for _, s in tps)
    return Mesh(np.asarray(devices).reshape(n // group, group // top, *(s for _, s in tps)),
                ("rep", "fsdp") + tuple(a for a, _ in tps))


def _unit_tp(mesh: Mesh, unit: str, colo) -> int:
    if colo is not None:
        return colo.tp_of(unit)
    return mesh.shape["tp"] if is_llm(unit) else 1


def unit_tp_axes(mesh: Mesh, unit: str, colo=None) -> tuple[str, ...]:
    """The innermost tp axes of the mesh that `unit`'s tp spans (() at tp 1)."""
    t = _unit_tp(mesh, unit, colo)
    names = [a for a in mesh.axis_names if a not in ("rep", "fsdp")]
    out: list[str] = []
    size = 1
    for a in reversed(names):
        if size >= t:
            break
        out.insert(0, a)
        size *= mesh.shape[a]
    if size != max(t, 1):
        raise ValueError(f"fsdp: unit {unit!r} at tp {t} does not fit the mesh's tp axes "
                         f"{dict((a, mesh.shape[a]) for a in names)}")
    return tuple(out)


def unit_of(names: tuple[str, ...]) -> str | None:
    """The unit a parameter (or optimizer-state) path belongs to."""
    for i, n in enumerate(names):
        if n in ("encoders", "projectors"):
            return names[i + 1] if i + 1 < len(names) else None
        if is_llm(n) or is_generator(n):
            return n
    return None


def _tp_dim(names, shape, tp: int) -> int | None:
    """The leaf's Megatron dimension (parallel/tensor.py rules), when tp divides it."""
    role = megatron_role(names)
    nd = len(shape)
    dims: dict[str | None, int | None] = {
        "column": nd - 1 if nd in (1, 2) else None, "row": 0 if nd == 2 else None,
        "vocab_row": 0 if nd == 2 else None, "vocab_column": 1 if nd == 2 else None}
    dim = dims.get(role)
    return dim if tp > 1 and dim is not None and shape[dim] % tp == 0 else None


def batch_axes(mesh: Mesh, unit: str, colo=None) -> tuple[str, ...]:
    """The mesh axes a unit's batch (and data parallelism) spans: all but its tp axes."""
    tp = unit_tp_axes(mesh, unit, colo)
    return tuple(a for a in mesh.axis_names if a not in tp)


def _group_axes(mesh: Mesh, unit: str, colo) -> tuple[str, ...]:
    tp = unit_tp_axes(mesh, unit, colo)
    return tuple(a for a in mesh.axis_names if a != "rep" and a not in tp)


def _one(axes: tuple[str, ...]):
    return axes[0] if len(axes) == 1 else axes


def leaf_spec(mesh: Mesh, names, shape, sharded: bool, colo=None) -> P:
    """`names`' spec: its tp dimension (a unit with tp), and with `sharded` its FSDP
    dimension."""
    unit = unit_of(names) or ""
    spec = [None] * len(shape)
    tp_axes_ = unit_tp_axes(mesh, unit, colo) if unit else ()
    tp = math.prod(mesh.shape[a] for a in tp_axes_)
    tdim = _tp_dim(names, shape, tp) if tp_axes_ else None
    if tdim is not None:
        spec[tdim] = _one(tp_axes_)
    if sharded:
        axes = _group_axes(mesh, unit, colo)
        size = math.prod(mesh.shape[a] for a in axes)
        dims = [d for d in range(len(shape)) if d != tdim and shape[d] % size == 0]
        if size > 1 and dims:
            d = max(dims, key=lambda d: shape[d])
            spec[d] = _one(axes)
    return P(*spec)


def tree_shardings(tree, mesh: Mesh, colo, what: str):
    """NamedShardings for a params / grads / optimizer-state tree: `what` is "params"
    (sharded at stage 3), "grads" (stage >= 2) or "opt" (every stage)."""
    least = {"params": 3, "grads": 2, "opt": 1}[what]

    def one(path, leaf):
        names = path_names(path)
        unit = unit_of(names)
        sharded = unit is not None and colo.stage(unit) >= least and len(leaf.shape) > 0
        return NamedSharding(mesh, leaf_spec(mesh, names, leaf.shape, sharded, colo))

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
    """`scan.layer_weights`' function: one layer's state whole again (but for its unit's tp
    dimension); the stacked layers' states kept as stored (sharded at ZeRO-3). Layer paths
    are relative: the unit is the one `scan.unit_scope` tags (`MultimodalModel.__call__`
    tags each); untagged (a unit called alone), LLM projections are told by role
    (wq/wo/w_up...) and every other block is taken at tp 1, its stacked weights kept
    sharded when any non-LLM unit is at ZeRO-3."""
    others = max([colo.stage(u) for u, _ in colo.stages if not is_llm(u)]
                 + [colo.default_stage])

    def spec(names, shape, stacked):
        unit = current_unit()
        if unit is None:
            llm = bool(set(names) & (set(LLM_COLUMN_PARAMS) | set(LLM_ROW_PARAMS)))
            full = (("llm", "layers") if llm else ("encoders", "", "layers")) + names
            stage = colo.stage("llm") if llm else others
        else:
            full = ((unit, "layers") if is_llm(unit) or is_generator(unit)
                    else ("encoders", unit, "layers")) + names
            stage = colo.stage(unit)
        return leaf_spec(mesh, full, shape, stacked and stage >= 3, colo)
    return layer_gather(mesh, spec)


def _split_product(names: tuple[str, ...]) -> bool:
    """An adaLN modulation (DiT §3.2: the generator's `final_modulation`): the model splits
    its product along the features into shift / scale (/ gate) chunks."""
    return any(n.endswith("modulation") for n in names)


def gather_split_products(tree, mesh: Mesh, colo):
    """ZeRO-3: the weights outside the layer stacks whose product the model splits along
    its features (`_split_product`) constrained whole but for their tp dimension where the
    step starts. Stored feature-sharded, XLA computes the product on the weight's layout
    and can move the split chunks to the batch's only by replicating them (its "Involuntary
    full rematerialization"); gathered, the product is batch-sharded from the start. Only
    these: gathering every weight outside the stacks (the embeddings too) raised the
    step's temporary memory by a third of a layer (docs/colocated.md). The layer stacks
    are gathered in the layer scan (`gather_layer`); a no-op below ZeRO-3."""
    def one(path, w):
        names = path_names(path)
        if "layers" in names or not getattr(w, "shape", ()) or not _split_product(names):
            return w
        return jax.lax.with_sharding_constraint(
            w, NamedSharding(mesh, leaf_spec(mesh, names, w.shape, False, colo)))
    return jax.tree_util.tree_map_with_path(one, tree)


def batch_sharding(mesh: Mesh, unit: str, shape, colo=None) -> NamedSharding:
    """A batch leaf of `unit`: its leading dimension over the unit's data-parallel axes
    (whole when they do not divide it)."""
    axes = batch_axes(mesh, unit, colo)
    size = math.prod(mesh.shape[a] for a in axes)
    if len(shape) == 0 or shape[0] % size:
        return NamedSharding(mesh, P())
    return NamedSharding(mesh, P(axes, *([None] * (len(shape) - 1))))


def place_batch(mesh: Mesh, inputs: dict, colo=None) -> dict:
    """Host arrays (every process holds the whole global batch) -> global arrays: encoder
    E's inputs over E's data-parallel ranks, the rest over the LLM's."""
    def put(path, x):
        x = np.asarray(x)
        names = path_names(path)
        unit = names[1] if names[:1] == ("encoders",) else "llm"
        sh = batch_sharding(mesh, unit, x.shape, colo)
        return jax.make_array_from_callback(x.shape, sh, lambda idx: x[idx])
    return jax.tree_util.tree_map_with_path(put, inputs)
