"""All-gather context-parallel attention with bitfield masks (Cornstarch §4.3, §5.3).

Llama 3-style CP (Cornstarch §5.3): each rank of the 'cp' mesh axis holds the queries of the
tokens `token_distribution.distribute` gave it (and the keys/values of the same tokens). It
all-gathers keys and values, one head group at a time, so the gather of group g+1 is
independent of and can overlap the attention of group g (XLA schedules the async
collectives); it then attends its local queries against all keys, building the BAM mask
(§4.3.1) from *global* token indices. Autodiff of the tiled all-gather is a reduce-scatter
(psum_scatter), so the backward pass returns each rank exactly the dK/dV of its own tokens.

RoPE is not applied here: the model rotates q/k with global positions before calling this.
Labels are shifted on the global sequence before `to_cp_layout`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from mmjax.models.attention import NO_OPTIONS, AttnOptions, TokenMeta, bam_attention

__all__ = ["TokenMeta", "to_cp_layout", "from_cp_layout", "layout_meta", "cp_attention",
           "cp_attend", "cp_attention_sharded"]


def to_cp_layout(x: jax.Array, gather_idx) -> jax.Array:
    """Sequence-major x [B, S, ...] -> CP layout [B, N, ...] (N = cp * static length).

    gather_idx: int [N] (same for all rows) or [B, N], from `layout_indices`; the sentinel S
    marks a padding slot and yields zeros.
    """
    gather_idx = jnp.asarray(gather_idx)
    padded = jnp.concatenate([x, jnp.zeros_like(x[:, :1])], axis=1)
    if gather_idx.ndim == 1:
        return jnp.take(padded, gather_idx, axis=1)
    _check_rows(x, gather_idx)
    return jax.vmap(lambda row, ids: row[ids])(padded, gather_idx)


def from_cp_layout(y: jax.Array, gather_idx, seq_len: int) -> jax.Array:
    """CP layout y [B, N, ...] -> sequence-major [B, seq_len, ...]; padding slots are dropped.

    gather_idx is the host layout (numpy); its inverse permutation is computed on the host so
    the way back is a gather too. On meshes with Explicit axes, reshard y to an unsharded
    sequence axis first (a permutation across ranks is communication either way).
    """
    gather_idx = np.asarray(gather_idx)
    rows = gather_idx if gather_idx.ndim == 2 else gather_idx[None]
    inverse = np.empty((rows.shape[0], seq_len), np.int32)
    for r, ids in enumerate(rows):
        valid = np.flatnonzero(ids < seq_len)
        if valid.size != seq_len or np.unique(ids[valid]).size != seq_len:
            raise ValueError(f"gather_idx row {r} must hold every token 0..{seq_len - 1} "
                             "exactly once (plus padding sentinels)")
        inverse[r, ids[valid]] = valid
    if gather_idx.ndim == 1:
        return jnp.take(y, inverse[0], axis=1)
    _check_rows(y, inverse)
    return jax.vmap(lambda row, ids: row[ids])(y, inverse)


def _check_rows(x, gather_idx):
    if gather_idx.shape[0] != x.shape[0]:
        raise ValueError(f"gather_idx has {gather_idx.shape[0]} rows but the array has batch "
                         f"{x.shape[0]}; pass one layout row per batch row or a 1-D layout")


def layout_meta(bam, doc, sub, gather_idx) -> TokenMeta:
    """TokenMeta in CP layout from sequence-major host metadata [B, S] (bam may be int64).

    Padding slots get doc 0 (so they attend nothing and nobody attends them) and the global
    index S. bam must fit int32 on device (jax x64 is off): bits 0..30.
    """
    bam = np.asarray(bam)
    if bam.size and (bam.min() < 0 or bam.max() >= 2 ** 31):
        raise ValueError("bam must lie in [0, 2**31) to run on device with int32 "
                         "(at most 30 modalities); got values outside that range")
    seq_len = bam.shape[-1]
    gather_idx = np.asarray(gather_idx, np.int32)
    if gather_idx.ndim == 1:
        gather_idx = np.broadcast_to(gather_idx, (bam.shape[0],) + gather_idx.shape)
    if gather_idx.size and (gather_idx.min() < 0 or gather_idx.max() > seq_len):
        raise ValueError(f"gather_idx values must lie in [0, seq_len={seq_len}] "
                         "(seq_len is the padding sentinel)")
    cols = [to_cp_layout(jnp.asarray(np.asarray(a, np.int32)), gather_idx)
            for a in (bam, doc, sub)]
    return TokenMeta(cols[0], cols[1], cols[2], idx=jnp.asarray(gather_idx))


def cp_attention(q, k, v, meta: TokenMeta, *, mesh_axis: str = "cp", num_head_groups: int = 1,
                 implementation: str = "auto", options: AttnOptions = NO_OPTIONS):
    """CP attention for use INSIDE a shard_map body over `mesh_axis` (Cornstarch §5.3).

    q: [B, L, H, D] local queries; k, v: [B, L, KV, D] the same local tokens; meta: local
    TokenMeta [B, L]. K/V are all-gathered along the sequence in `num_head_groups` groups of
    KV heads (one collective per group for K and V together) so communication of the next
    group overlaps compute of the current one. Each group runs `bam_attention` with
    `implementation` on the local queries against the gathered keys, so with a block-sparse
    implementation a rank's work is its share of non-empty tiles. Returns [B, L, H, D].
    """
    h, kv = q.shape[2], k.shape[2]
    if h % kv:
        raise ValueError(f"query heads ({h}) must be a multiple of kv heads ({kv})")
    if num_head_groups < 1 or kv % num_head_groups:
        raise ValueError(f"num_head_groups={num_head_groups} must divide the kv heads ({kv})")
    gather = lambda a, axis: jax.lax.all_gather(a, mesh_axis, axis=axis, tiled=True)
    keys = TokenMeta(*(gather(a, 1) for a in meta))
    kv_per, h_per = kv // num_head_groups, h // num_head_groups
    outs = []
    for g in range(num_head_groups):
        kv_g = jnp.stack([k[:, :, g * kv_per:(g + 1) * kv_per],
                          v[:, :, g * kv_per:(g + 1) * kv_per]])
        k_all, v_all = gather(kv_g, 2)
        outs.append(bam_attention(q[:, :, g * h_per:(g + 1) * h_per], k_all, v_all, meta, keys,
                                  implementation=implementation, options=options))
    return jnp.concatenate(outs, axis=2)


def cp_attend(meta: TokenMeta, *, mesh_axis: str = "cp", num_head_groups: int = 1,
              implementation: str = "auto"):
    """The LLM's `attend(q, k, v, options)` hook for CP, inside a shard_map body (cf.
    meta_attend); windows use the tokens' global indices, so they hold across ranks."""
    return lambda q, k, v, o=NO_OPTIONS: cp_attention(q, k, v, meta, mesh_axis=mesh_axis,
                                                      num_head_groups=num_head_groups,
                                                      implementation=implementation, options=o)


def cp_attention_sharded(q, k, v, meta: TokenMeta, mesh: Mesh, *, mesh_axis: str = "cp",
                         num_head_groups: int = 1, implementation: str = "auto",
                         batch_axis: str | None = "dp", local_sequence: bool = False,
                         options: AttnOptions = NO_OPTIONS):
    """Standalone shard_map wrapper of `cp_attention` over `mesh`.

    Inputs are global arrays in CP layout (`to_cp_layout`): sequence axis over `mesh_axis`,
    batch over `batch_axis` ('dp'; None inside a vmap over dp ranks) and heads over 'tp'
    when the mesh has those axes ('dp','cp','tp'). `local_sequence`: the inputs are one cp
    rank's tokens [B, L, ...], inside a vmap over cp ranks whose `spmd_axis_name` is
    `mesh_axis` (the vmap places the rank axis on it; the K/V gather is the same).
    """
    names = mesh.axis_names
    if mesh_axis not in names:
        raise ValueError(f"mesh has axes {names}; mesh_axis={mesh_axis!r} is not one of them")
    batch = batch_axis if batch_axis in names else None
    heads = "tp" if "tp" in names else None
    if heads and k.shape[2] % (mesh.shape["tp"] * num_head_groups):
        raise ValueError(f"kv heads ({k.shape[2]}) must be divisible by tp * num_head_groups "
                         f"({mesh.shape['tp']} * {num_head_groups})")
    seq = None if local_sequence else mesh_axis
    x_spec = P(batch, seq, heads, None)
    m_spec = TokenMeta._make((P(batch, seq),) * 4)  # a spec tree: P leaves, not arrays
    body = lambda q_, k_, v_, m_: cp_attention(q_, k_, v_, m_, mesh_axis=mesh_axis,
                                               num_head_groups=num_head_groups,
                                               implementation=implementation, options=options)
    specs = (x_spec, x_spec, x_spec, m_spec)
    # Explicit-axis meshes require inputs already laid out as in_specs (reshard is a no-op
    # when they are); on Auto meshes a sharding constraint does the same.
    explicit = all(t == AxisType.Explicit for t in mesh.axis_types)
    place = jax.sharding.reshard if explicit else jax.lax.with_sharding_constraint
    args = jax.tree.map(lambda a, s: place(a, NamedSharding(mesh, s)),
                        (q, k, v, meta), specs, is_leaf=lambda x: isinstance(x, P))
    # A pallas_call's outputs carry no varying-axes types, and under a vmap over cp ranks the
    # batched inputs already vary over `mesh_axis`: both run with shard_map's vma check off
    # (the collectives' transposes are the same either way).
    return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=x_spec,
                         check_vma=implementation != "pallas" and not local_sequence)(*args)
