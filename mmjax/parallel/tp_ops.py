"""Overlapped tensor parallelism for the models: the `ops` hook and the shard_map stage glue.

Models do every projection through `ops.column(x, *ws)` / `ops.row(x, w)` (default: plain
dots). `OverlappedTPOps` swaps in the decomposed collective matmuls of DistTrain §7
("Mitigating TP overhead with StepCCL", Fig. 13-14), so inside a `shard_map` over the TP axis
a Megatron block runs with sequence-sharded activations between projections:

    x [B, S/N, d] --norm--> column (all-gather-matmul) -> [B, S, n/N] (local heads / ffn)
      --attention or SwiGLU (local)--> row (matmul-reduce-scatter) -> [B, S/N, d] + residual

`sequence_sharded_llm_stage` wraps an LLM block stack (`module.run_layers(x, positions,
attend, ops)`) in that `shard_map` when `overlap_tp=True`, with activation spec
P(None, 'tp', None), column weights P(None, 'tp') (biases P('tp')), row weights
P('tp', None), everything else replicated; with `overlap_tp=False` it is the same stack with
plain dots (GSPMD TP).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import jax
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from mmjax.parallel.collective_matmul import allgather_matmul, matmul_reducescatter

# Parameter names of mmjax/models/llm.py's DecoderLayer, by Megatron role.
LLM_COLUMN_PARAMS = ("wq", "wk", "wv", "bq", "bk", "bv", "w_gate", "w_up")
LLM_ROW_PARAMS = ("wo", "w_down")


@dataclass(frozen=True)
class OverlappedTPOps:
    """`MatmulOps` whose column() is all-gather-matmul over the sequence-sharded x (outputs
    full sequence, feature shard) and row() is matmul-reduce-scatter (output sequence
    shard). Only valid inside `shard_map` over `axis_name`."""

    axis_name: str = "tp"
    num_chunks: int = 1
    bidirectional: bool = False

    def column(self, x, *ws) -> tuple:
        return allgather_matmul(x, ws, self.axis_name, self.num_chunks, self.bidirectional)

    def row(self, x, w):
        return matmul_reducescatter(x, w, self.axis_name, self.num_chunks, self.bidirectional)


def _leaf_name(path) -> str:
    """Innermost attribute/key name of a parameter path, skipping Variable's `.value`."""
    for key in reversed(path):
        name = getattr(key, "key", None) or getattr(key, "name", None)
        if isinstance(name, str) and name != "value":
            return name
    return ""


def megatron_sp_specs(
    state,
    axis_name: str = "tp",
    tp: int | None = None,
    column: Iterable[str] = LLM_COLUMN_PARAMS,
    row: Iterable[str] = LLM_ROW_PARAMS,
):
    """PartitionSpec tree for `state`: column weights P(None, tp) / biases P(tp), row weights
    P(tp, None), the rest replicated. With `tp` given, checks the sharded dims divide."""
    column, row = frozenset(column), frozenset(row)

    def spec(path, leaf):
        name = _leaf_name(path)
        if name in column:
            dim, s = leaf.ndim - 1, (P(None, axis_name) if leaf.ndim == 2 else P(axis_name))
        elif name in row:
            dim, s = 0, P(axis_name, None)
        else:
            return P()
        if name in row and leaf.ndim != 2 or leaf.ndim not in (1, 2):
            raise ValueError(f"parameter {jax.tree_util.keystr(path)} has shape {leaf.shape}; "
                             f"column/row parameters must be 2-D weights or 1-D column biases")
        if tp is not None and leaf.shape[dim] % tp:
            raise ValueError(
                f"parameter {jax.tree_util.keystr(path)} dim {dim} = {leaf.shape[dim]} is not "
                f"divisible by the {axis_name!r} size {tp}; choose heads/ffn sizes divisible by tp"
            )
        return s

    return jax.tree_util.tree_map_with_path(spec, state)


def sequence_sharded_llm_stage(
    module: nnx.Module,
    mesh: Mesh | None,
    make_attend: Callable,
    *,
    overlap_tp: bool = True,
    axis_name: str = "tp",
    batch_axis: str | None = None,
    num_chunks: int = 1,
    bidirectional: bool = False,
):
    """A pure stage function over an LLM block stack and its parameter state.

    Returns `(fn, state)`; `fn(state, x, positions, *attend_args) -> y`, x/y `[B, S, d]`,
    positions `[B, S]`, `attend = make_attend(*attend_args)` (e.g. `llm.mask_attend` with
    the `[B, S, S]` mask; every attend arg has the batch as its leading dim). With
    `overlap_tp=True` the stack runs inside `shard_map` over `mesh`'s `axis_name` with
    `OverlappedTPOps` (S must divide by the TP size); otherwise with the module's default
    plain dots, to be sharded by GSPMD under the caller's jit.
    `batch_axis` (e.g. 'dp') shards the batch dim of x, positions and the attend args too;
    the replicated weights' gradients are then summed over it.
    """
    graphdef, state = nnx.split(module)

    def body(state, x, positions, *attend_args, ops=None):
        stack = nnx.merge(graphdef, state)
        attend = make_attend(*attend_args)
        if ops is None:
            return stack.run_layers(x, positions, attend)
        return stack.run_layers(x, positions, attend, ops)

    if not overlap_tp:
        return body, state
    for name in (axis_name, batch_axis):
        if name is not None and (mesh is None or name not in mesh.axis_names):
            raise ValueError(f"overlap_tp=True needs a mesh with a {name!r} axis; got {mesh}")
    assert mesh is not None  # the check above raised otherwise (axis_name is a str)
    tp = mesh.shape[axis_name]
    ops = OverlappedTPOps(axis_name, num_chunks, bidirectional)
    param_specs = megatron_sp_specs(state, axis_name, tp)
    act, batch = P(batch_axis, axis_name, None), P(batch_axis)

    def fn(state, x, positions, *attend_args):
        if x.ndim != 3 or x.shape[1] % tp:
            raise ValueError(
                f"x must be [B, S, d] with S divisible by the {axis_name!r} size {tp}; got "
                f"{x.shape}: pad the sequence to a multiple of {tp}"
            )
        mapped = jax.shard_map(
            lambda st, xl, pos, *args: body(st, xl, pos, *args, ops=ops),
            mesh=mesh,
            in_specs=(param_specs, act, batch, *(batch for _ in attend_args)),
            out_specs=act,
        )
        return mapped(state, x, positions, *attend_args)

    return fn, state
