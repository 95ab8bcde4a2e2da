"""Megatron tensor-parallel sharding rules for every mmjax module, by parameter path.

Megatron-LM (Shoeybi et al., 2019, §3: column-/row-parallel matmuls): a column-parallel
weight W = [c_1 .. c_M] splits its output features over the 'tp' axis, so each device computes
its slice of the activations with no communication; the following row-parallel weight splits
its input features the same way, and one all-reduce sums the partial outputs. Consecutive
column -> row pairs (QKV -> attention output, up/gate -> down, fc1 -> fc2) need one all-reduce
each in forward and backward. Here that is GSPMD sharding: `param_specs` gives each parameter
a `PartitionSpec`, `shard_state` places it with `NamedSharding`, and XLA inserts the
all-reduces.

Rules (kernels are [in, out]):
  column (P(None, 'tp'), bias P('tp')): LLM wq wk wv bq bk bv w_gate w_up; encoder / DiT block
      q k v fc1, DiT cross-attention cq ck cv;
  row (P('tp', None), bias replicated): LLM wo w_down; block o fc2 co;
  vocab (optional, default on): LLM embed [V, d] -> P('tp', None), lm_head [d, V] -> P(None, 'tp');
  everything else (norms, patch embeds, positions, projectors, modulation) replicated.
Block rules apply only under a `layers` list, so projectors' own fc1/fc2/q/k/v stay replicated.
"""
from __future__ import annotations

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mmjax.parallel.tp_ops import LLM_COLUMN_PARAMS, LLM_ROW_PARAMS

# Dense sub-module names inside transformer blocks (models/layers.py EncoderBlock for the ViT
# and Whisper encoders, models/generator.py DiTBlock), by Megatron role.
BLOCK_COLUMN_DENSE = ("q", "k", "v", "fc1", "cq", "ck", "cv")
BLOCK_ROW_DENSE = ("o", "fc2", "co")
VOCAB_ROW_PARAMS = ("embed",)     # [V, d]: vocab is dim 0
VOCAB_COLUMN_PARAMS = ("lm_head",)  # [d, V]: vocab is dim 1


def path_names(path) -> tuple[str, ...]:
    """The string names along a pytree path (attributes and dict keys), skipping list indices
    and Variable's `.value`."""
    names = []
    for key in path:
        name = getattr(key, "key", getattr(key, "name", None))
        if isinstance(name, str) and name != "value":
            names.append(name)
    return tuple(names)


def megatron_role(names: tuple[str, ...], shard_vocab: bool = True) -> str | None:
    """'column', 'row', 'vocab_row', 'vocab_column' or None (replicated) for a parameter path."""
    if not names:
        return None
    leaf = names[-1]
    if leaf in LLM_COLUMN_PARAMS:
        return "column"
    if leaf in LLM_ROW_PARAMS:
        return "row"
    if "layers" in names[:-2] and leaf in ("kernel", "bias"):
        if names[-2] in BLOCK_COLUMN_DENSE:
            return "column"
        if names[-2] in BLOCK_ROW_DENSE:
            return "row"
    if shard_vocab and leaf in VOCAB_ROW_PARAMS:
        return "vocab_row"
    if shard_vocab and leaf in VOCAB_COLUMN_PARAMS:
        return "vocab_column"
    return None


def _spec_for(role: str | None, ndim: int, axis: str) -> tuple[P, int | None]:
    """(spec, sharded dim) for a role and a leaf rank; raises on ranks the role cannot take."""
    if role is None:
        return P(), None
    if role == "column" and ndim in (1, 2):
        return (P(axis) if ndim == 1 else P(None, axis)), ndim - 1
    if role == "row" and ndim == 2:
        return P(axis, None), 0
    if role == "row" and ndim == 1:
        return P(), None  # row-parallel bias: added after the all-reduce, so replicated
    if role == "vocab_row" and ndim == 2:
        return P(axis, None), 0
    if role == "vocab_column" and ndim == 2:
        return P(None, axis), 1
    raise ValueError(f"a {role}-parallel parameter must be 2-D (or a 1-D bias); got rank {ndim}")


def tp_leaf_spec(names: tuple[str, ...], ndim: int, axis: str = "tp") -> P:
    """The Megatron spec of one leaf by its path names (the rules above)."""
    return _spec_for(megatron_role(names), ndim, axis)[0]


def param_specs(state, tp: int | None = None, axis: str = "tp", shard_vocab: bool = True):
    """PartitionSpec pytree (same structure as `state`: an nnx.State or a plain dict of arrays
    or ShapeDtypeStructs) under the Megatron rules above. With `tp` given, every sharded
    dimension must divide by it; otherwise ValueError names the parameter and the size."""

    def spec(path, leaf):
        names = path_names(path)
        try:
            s, dim = _spec_for(megatron_role(names, shard_vocab), len(leaf.shape), axis)
        except ValueError as e:
            raise ValueError(f"parameter {jax.tree_util.keystr(path)} of shape {leaf.shape}: "
                             f"{e}") from None
        if tp is not None and dim is not None and leaf.shape[dim] % tp:
            raise ValueError(
                f"parameter {jax.tree_util.keystr(path)} dim {dim} = {leaf.shape[dim]} is not "
                f"divisible by the {axis!r} size {tp}; choose a tp dividing heads*head_dim, "
                f"ffn_size{' and vocab_size' if shard_vocab else ''}"
                f"{'' if not shard_vocab else ' (or pass shard_vocab=False)'}")
        return s

    return jax.tree_util.tree_map_with_path(spec, state)


def mesh_param_specs(state, mesh: Mesh, axis: str = "tp", shard_vocab: bool = True):
    """`param_specs` for `mesh`: checked against its `axis` size; all replicated without one
    (or when it has size 1, so other axes such as ZeRO-1's 'dp' may use every dimension)."""
    if axis not in mesh.axis_names or mesh.shape[axis] == 1:
        return jax.tree.map(lambda _: P(), state)
    return param_specs(state, mesh.shape[axis], axis, shard_vocab)


def state_shardings(state, mesh: Mesh, axis: str = "tp", shard_vocab: bool = True):
    """NamedSharding pytree for `state` on `mesh` (replicated over every non-tp axis)."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s),
                        mesh_param_specs(state, mesh, axis, shard_vocab),
                        is_leaf=lambda x: isinstance(x, P))


def shard_state(state, mesh: Mesh, axis: str = "tp", shard_vocab: bool = True):
    """`device_put` every parameter of `state` with its Megatron NamedSharding on `mesh`."""
    return jax.device_put(state, state_shardings(state, mesh, axis, shard_vocab))


def activation_spec(ndim: int, batch_axis: str = "dp", seq_axis: str | None = None) -> P:
    """Activations [B, S, ...]: batch over `batch_axis` ('dp'); optionally the sequence (dim 1)
    over `seq_axis` ('cp' for context parallelism, 'tp' for sequence-parallel regions)."""
    if ndim < 1:
        return P()
    if seq_axis is not None and ndim >= 2:
        return P(batch_axis, seq_axis, *([None] * (ndim - 2)))
    return P(batch_axis, *([None] * (ndim - 1)))


def activation_sharding(mesh: Mesh, ndim: int, batch_axis: str = "dp",
                        seq_axis: str | None = None) -> NamedSharding:
    """NamedSharding of `activation_spec` on `mesh` (replicated scalars)."""
    return NamedSharding(mesh, activation_spec(ndim, batch_axis, seq_axis))
