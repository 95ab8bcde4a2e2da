"""Decomposed collective matmuls: overlapped tensor parallelism (StepCCL in JAX).

DistTrain §7 (Fig. 13-14): each TP GEMM and its collective split into (communication, GEMM)
pairs around a `lax.ppermute` ring inside `shard_map`, so moving chunk k+1 overlaps the GEMM
of chunk k; a block gather remaps the layout. `allgather_matmul` and `matmul_reducescatter`
(Megatron sequence-parallel layouts), chunked and optionally bidirectional, with overlapped
custom-VJP backwards. Details: docs/design.md "Overlapped TP".
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


@dataclass(frozen=True)
class _Piece:
    """Rows [start, start + size) of every sequence shard, travelling one way round the ring
    (`forward`: to rank i-1, so rank i holds shard i+s at step s; else to rank i+1)."""

    start: int
    size: int
    forward: bool


def _pieces(rows: int, num_chunks: int, bidirectional: bool) -> tuple[_Piece, ...]:
    halves = [(0, rows, True)]
    if bidirectional:
        mid = (rows + 1) // 2
        halves = [(0, mid, True), (mid, rows - mid, False)]
    out = []
    for start, size, forward in halves:
        sizes = [len(a) for a in np.array_split(np.arange(size), num_chunks)]
        offsets = np.cumsum([0] + sizes[:-1])
        out += [_Piece(start + int(o), s, forward) for o, s in zip(offsets, sizes) if s > 0]
    return tuple(out)


def _check_static(num_chunks, axis_name):
    if not isinstance(num_chunks, int) or isinstance(num_chunks, bool) or num_chunks < 1:
        raise ValueError(f"num_chunks must be an int >= 1, got {num_chunks!r}")
    if axis_name is None:
        raise ValueError("axis_name must name the shard_map TP axis, e.g. 'tp'")


def _shift(a, axis_name, n: int, forward: bool):
    """One ring step: forward sends rank j's buffer to j-1, backward to j+1."""
    step = -1 if forward else 1
    return lax.ppermute(a, axis_name, [(j, (j + step) % n) for j in range(n)])


def _source(i, s: int, n: int, forward: bool):
    """Which rank's shard rank i holds at ring step s."""
    return (i + s) % n if forward else (i - s) % n


def _rows(a, start, size: int):
    """Rows [start, start+size) on the sequence axis (-2); start may be traced."""
    return lax.dynamic_slice_in_dim(a, start, size, axis=a.ndim - 2)


def _ring_gather(x, axis_name, n: int, pieces):
    """held[s][p]: piece p of the shard that rank i holds at step s (see `_source`).

    Step s's ppermutes depend only on step s-1's buffers, never on a dot, so XLA can overlap
    them with the dots that consume step s-1 (Fig. 13)."""
    held = [[_rows(x, p.start, p.size) for p in pieces]]
    for _ in range(1, n):
        held.append([_shift(a, axis_name, n, p.forward) for a, p in zip(held[-1], pieces)])
    return held


def _remap(outs, i, n: int, pieces, rows: int):
    """Layout remap (Fig. 14): outs[s][p] `[..., size_p, m]` computed in ring order ->
    `[..., n * rows, m]` in global sequence order, one gather per piece."""
    blocks = jnp.arange(n)
    cols = []
    for k, p in enumerate(pieces):
        stacked = jnp.stack([outs[s][k] for s in range(n)], axis=outs[0][k].ndim - 2)
        step_of_block = (blocks - i) % n if p.forward else (i - blocks) % n
        cols.append(jnp.take(stacked, step_of_block, axis=stacked.ndim - 3, mode="clip"))
    y = jnp.concatenate(cols, axis=cols[0].ndim - 2)  # [..., n, rows, m]
    return y.reshape(*y.shape[:-3], n * rows, y.shape[-1])


def _ring_reduce_scatter(partial, axis_name, i, n: int, pieces):
    """sum over ranks of partial(block=i, piece), accumulated round the ring: at step s rank
    i adds its contribution to block i+s+1 (forward) / i-s-1 (backward) to the accumulator
    it received, then passes it on; after n steps it holds block i. Returns `[..., rows, m]`."""
    accs: list[Any] = [None] * len(pieces)  # every slot filled at s == 0
    for s in range(n):
        for k, p in enumerate(pieces):
            block = (i + s + 1) % n if p.forward else (i - s - 1) % n
            part = partial(block, p)
            accs[k] = part if s == 0 else part + _shift(accs[k], axis_name, n, p.forward)
    return jnp.concatenate(accs, axis=accs[0].ndim - 2)


def _weight_grad(a, b):
    """sum over all leading and row dims of a[..., r, :]^T b[..., r, :], in float32."""
    dims = tuple(range(a.ndim - 1))
    return lax.dot_general(a, b, ((dims, dims), ((), ())), preferred_element_type=jnp.float32)


def _varying_axes(a) -> frozenset:
    """Manual mesh axes `a` varies over inside shard_map (empty outside or unchecked).
    jax <= 0.9 spells it `typeof(a).vma`, jax 0.10 `typeof(a).manual_axis_type.varying`."""
    t = jax.typeof(a)
    vma: Any = getattr(t, "vma", None)
    if vma is None:
        vma = getattr(getattr(t, "manual_axis_type", None), "varying", frozenset())
    return frozenset(vma)


def _like(ct, primal):
    """Cast a cotangent to its primal's dtype and sum it over the mesh axes it varies on but
    the primal does not (a weight replicated over 'dp' inside a ('dp', 'tp') shard_map), as
    shard_map's own transpose would; custom_vjp requires matching types."""
    extra = _varying_axes(ct) - _varying_axes(primal)
    if extra:
        ct = lax.psum(ct, tuple(sorted(extra)))
    return ct.astype(primal.dtype)


def _ring_setup(axis_name, rows: int, num_chunks: int, bidirectional: bool):
    n = lax.axis_size(axis_name)
    return n, lax.axis_index(axis_name), _pieces(rows, num_chunks, bidirectional)


# ----------------------------------------------------------------------------------------
# all-gather-matmul: y_k = all_gather(x) @ w_k


def _ag_forward(x, ws, axis_name, num_chunks, bidirectional):
    rows = x.shape[-2]
    n, i, pieces = _ring_setup(axis_name, rows, num_chunks, bidirectional)
    held = _ring_gather(x, axis_name, n, pieces)
    return tuple(
        _remap([[h @ w for h in step] for step in held], i, n, pieces, rows) for w in ws
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _allgather_matmul(x, ws, axis_name, num_chunks, bidirectional):
    return _ag_forward(x, ws, axis_name, num_chunks, bidirectional)


def _ag_fwd(x, ws, axis_name, num_chunks, bidirectional):
    return _ag_forward(x, ws, axis_name, num_chunks, bidirectional), (x, ws)


def _ag_bwd(axis_name, num_chunks, bidirectional, res, dys):
    """dx = reduce_scatter(sum_k dy_k @ w_k^T) on the ring; dw_k = all_gather(x)^T dy_k with
    x re-gathered on a second ring whose transfers overlap the dw dots."""
    x, ws = res
    rows = x.shape[-2]
    n, i, pieces = _ring_setup(axis_name, rows, num_chunks, bidirectional)

    def contribution(block, p):
        start = block * rows + p.start
        return sum(_rows(dy, start, p.size) @ w.T for dy, w in zip(dys, ws)).astype(x.dtype)

    dx = _ring_reduce_scatter(contribution, axis_name, i, n, pieces)
    dws = [jnp.zeros(w.shape, jnp.float32) for w in ws]
    for s, step in enumerate(_ring_gather(x, axis_name, n, pieces)):
        for h, p in zip(step, pieces):
            start = _source(i, s, n, p.forward) * rows + p.start
            dws = [dw + _weight_grad(h, _rows(dy, start, p.size)) for dw, dy in zip(dws, dys)]
    return _like(dx, x), tuple(_like(dw, w) for dw, w in zip(dws, ws))


_allgather_matmul.defvjp(_ag_fwd, _ag_bwd)


def allgather_matmul(x, w, axis_name, num_chunks: int = 1, bidirectional: bool = False):
    """`all_gather(x, sequence) @ w`, decomposed into ring steps (DistTrain §7, Fig. 13).

    Use inside `shard_map` over `axis_name`. x: `[..., S_local, d]` sequence shard; w:
    `[d, n_local]` column shard, or a tuple/list of them (one gather feeds several dots, as
    for QKV or gate/up projections; returns a tuple). Output: `[..., S_local * N, n_local]`.
    """
    _check_static(num_chunks, axis_name)
    ws = tuple(w) if isinstance(w, (tuple, list)) else (w,)
    if not ws:
        raise ValueError("allgather_matmul needs at least one weight in w")
    if x.ndim < 2:
        raise ValueError(f"x must be [..., S, d], got shape {x.shape}")
    for k, wk in enumerate(ws):
        if wk.ndim != 2 or wk.shape[0] != x.shape[-1]:
            raise ValueError(
                f"weight {k} must be [d, n] with d = x.shape[-1] = {x.shape[-1]}, got {wk.shape}"
            )
    ys = _allgather_matmul(x, ws, axis_name, num_chunks, bidirectional)
    return ys if isinstance(w, (tuple, list)) else ys[0]


# ----------------------------------------------------------------------------------------
# matmul-reduce-scatter: y = psum_scatter(x @ w, sequence)


def _rs_forward(x, w, axis_name, num_chunks, bidirectional):
    n = lax.axis_size(axis_name)
    rows = x.shape[-2] // n
    _, i, pieces = _ring_setup(axis_name, rows, num_chunks, bidirectional)
    return _ring_reduce_scatter(
        lambda block, p: _rows(x, block * rows + p.start, p.size) @ w, axis_name, i, n, pieces
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _matmul_reducescatter(x, w, axis_name, num_chunks, bidirectional):
    return _rs_forward(x, w, axis_name, num_chunks, bidirectional)


def _rs_fwd(x, w, axis_name, num_chunks, bidirectional):
    return _rs_forward(x, w, axis_name, num_chunks, bidirectional), (x, w)


def _rs_bwd(axis_name, num_chunks, bidirectional, res, dy):
    """dx = all_gather(dy) @ w^T on the ring (remapped); dw = x^T all_gather(dy), the dw dots
    fed by the same gathered pieces."""
    x, w = res
    rows = dy.shape[-2]
    n, i, pieces = _ring_setup(axis_name, rows, num_chunks, bidirectional)
    held = _ring_gather(dy, axis_name, n, pieces)
    dx = _remap([[h @ w.T for h in step] for step in held], i, n, pieces, rows)
    dw = jnp.zeros(w.shape, jnp.float32)
    for s, step in enumerate(held):
        for h, p in zip(step, pieces):
            start = _source(i, s, n, p.forward) * rows + p.start
            dw = dw + _weight_grad(_rows(x, start, p.size), h)
    return _like(dx, x), _like(dw, w)


_matmul_reducescatter.defvjp(_rs_fwd, _rs_bwd)


def matmul_reducescatter(x, w, axis_name, num_chunks: int = 1, bidirectional: bool = False):
    """`psum_scatter(x @ w, sequence)`, decomposed into ring steps (DistTrain §7).

    Use inside `shard_map` over `axis_name`. x: `[..., S, n_local]` full sequence, feature
    shard; w: `[n_local, d]` row shard. Output: `[..., S / N, d]`, this rank's sequence shard
    of the sum over ranks. S must be divisible by the TP size N.
    """
    _check_static(num_chunks, axis_name)
    if x.ndim < 2 or w.ndim != 2 or w.shape[0] != x.shape[-1]:
        raise ValueError(
            f"need x [..., S, n] and w [n, d] with matching n; got x {x.shape}, w {w.shape}"
        )
    n = lax.axis_size(axis_name)
    if x.shape[-2] % n:
        raise ValueError(
            f"sequence length {x.shape[-2]} (x.shape[-2]) must be divisible by the "
            f"{axis_name!r} axis size {n}; pad the sequence to a multiple of {n}"
        )
    return _matmul_reducescatter(x, w, axis_name, num_chunks, bidirectional)


# ----------------------------------------------------------------------------------------
# Standalone wrappers: build the shard_map over a Mesh (tests, benchmarks).


def _seq_spec(ndim: int, axis_name: str):
    return P(*([None] * (ndim - 2)), axis_name, None)


def _feature_spec(ndim: int, axis_name: str):
    return P(*([None] * (ndim - 1)), axis_name)


def _check_mesh(mesh: Mesh, axis_name: str):
    if axis_name not in mesh.axis_names:
        raise ValueError(f"mesh has axes {mesh.axis_names}; axis_name {axis_name!r} is not one")


def allgather_matmul_on_mesh(
    x, w, mesh: Mesh, *, axis_name: str = "tp", num_chunks: int = 1, bidirectional: bool = False
):
    """Global-array form of `allgather_matmul`: x `[..., S, d]` (sharded on S over
    `axis_name`), w `[d, n]` or a tuple of them (sharded on n) -> `[..., S, n]` (per w)."""
    _check_mesh(mesh, axis_name)
    many = isinstance(w, (tuple, list))
    ws = tuple(w) if many else (w,)
    out_spec = _feature_spec(x.ndim, axis_name)
    fn = jax.shard_map(
        lambda xl, wl: allgather_matmul(xl, wl, axis_name, num_chunks, bidirectional),
        mesh=mesh,
        in_specs=(_seq_spec(x.ndim, axis_name), tuple(P(None, axis_name) for _ in ws)),
        out_specs=tuple(out_spec for _ in ws),
    )
    ys = fn(x, ws)
    return ys if many else ys[0]


def matmul_reducescatter_on_mesh(
    x, w, mesh: Mesh, *, axis_name: str = "tp", num_chunks: int = 1, bidirectional: bool = False
):
    """Global-array form of `matmul_reducescatter`: x `[..., S, n]` (sharded on n), w
    `[n, d]` (sharded on n) -> `[..., S, d]` sharded on S."""
    _check_mesh(mesh, axis_name)
    fn = jax.shard_map(
        lambda xl, wl: matmul_reducescatter(xl, wl, axis_name, num_chunks, bidirectional),
        mesh=mesh,
        in_specs=(_feature_spec(x.ndim, axis_name), P(axis_name, None)),
        out_specs=_seq_spec(x.ndim, axis_name),
    )
    return fn(x, w)


def plain_sharded_matmuls(mesh: Mesh, axis_name: str = "tp") -> tuple:
    """The GSPMD baselines the decomposed versions must equal: (column, row) functions that
    do `x @ w` under Megatron-SP sharding constraints and let XLA insert the collectives."""

    def constrain(a, spec):
        return lax.with_sharding_constraint(a, NamedSharding(mesh, spec))

    def column(x, w):
        x = constrain(x, _seq_spec(x.ndim, axis_name))
        w = constrain(w, P(None, axis_name))
        return constrain(x @ w, _feature_spec(x.ndim, axis_name))

    def row(x, w):
        x = constrain(x, _feature_spec(x.ndim, axis_name))
        w = constrain(w, P(axis_name, None))
        return constrain(x @ w, _seq_spec(x.ndim, axis_name))

    return column, row


__all__: Sequence[str] = (
    "allgather_matmul",
    "matmul_reducescatter",
    "allgather_matmul_on_mesh",
    "matmul_reducescatter_on_mesh",
    "plain_sharded_matmuls",
)
