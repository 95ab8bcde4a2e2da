"""Pipeline stages: a slice of one unit on its own sub-mesh, with jitted forward/backward.

`forward(params, frozen, x, side)` returns `(y, Residuals)`: the `jax.vjp` residuals under
the plan's remat policy, with every parameter-only and host-input leaf dropped (recomputed in
backward), so no microbatch keeps a copy of the parameters; `backward(..., residuals, dy,
acc)` returns `(acc + dparams, dx)`. The stage runs as a `vmap` over its dp ranks
(`spmd_axis_name='dp'`), each rank on its own copy of the parameters, so `dparams` is every
rank's un-reduced partial gradient `[dp, ...]`: no dp collective in any microbatch (the
step's one reduce-scatter is parallel/zero.py's). An LLM stage with cp > 1 also vmaps over
its cp ranks (`spmd_axis_name='cp'`, each on its L tokens of the CP layout): partials
`[dp * cp, ...]`, reduced over dp x cp once per step (Megatron-LM). Loss outputs are
per-rank `[dp]` partial sums. Backward modes are frozen-aware (Cornstarch §4.2). The long
story: docs/design.md "Stage residuals" and "One gradient sync per step".

ZeRO-2 (`UnitPlan.zero_stage`): the accumulators are the ZeRO shards; each backward
reduce-scatters its per-rank partials into them (parallel/zero.py), so no rank holds a full
float32 gradient between microbatches. ZeRO-3: the stage's weights are stored dp-sharded and
shared by the ranks (not per-rank copies); each layer is all-gathered inside the layer scan
in the forward and again in the backward (models/scan.py `layer_weights`), and the
gradients come out reduce-scattered per layer, summed over the ranks.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from mmjax.models.attention import choose_implementation
from mmjax.models.config import MLLMConfig
from mmjax.models.llm import attention_options
from mmjax.models.units import UnitRole, role
from mmjax.models.layers import cast_floats
from mmjax.models.scan import layer_weights
from mmjax.parallel.tensor import mesh_param_specs
from mmjax.parallel.zero_shards import (reduce_scatter_partials, zero3_layer_gather, zero_axes,
                                        zero_mesh, zero_shard_specs)
from mmjax.pipeline.lora_dropout import stage_dropout
from mmjax.pipeline.residuals import (Residuals, ResidualLayout, input_signature,
                                      remat_wrap, residual_layout)
from mmjax.pipeline.stage_modules import (apply_encoder, apply_generator, apply_llm,
                                          apply_llm_cp_ranks, apply_vae)
from mmjax.planner.plan import UnitPlan
from mmjax.schedule.stage_graph import Backward


def _split_ranks(tree, dp: int):
    """Rank-major leading dims [dp * b, ...] -> [dp, b, ...] (scalars stay shared)."""
    return jax.tree.map(lambda a: a.reshape((dp, a.shape[0] // dp) + a.shape[1:])
                        if a.ndim else a, tree)


def _rank_axes(tree):
    return jax.tree.map(lambda a: 0 if a.ndim else None, tree)


class StageFns:
    """The jitted functions of one stage; `mode` a schedule `Backward` mode.

    `forward(params, frozen, x, side) -> (y, Residuals)`; `apply(...) -> y` (evaluation);
    `backward(params, frozen, side, residuals, dy, acc) -> (acc + dparams, dx)` (acc is
    donated; dparams is skipped for mode "input_only", dx is None for mode "params").
    `params`: the compute copy (replicated over dp, TP-sharded); `acc`/`dparams`: float32
    per-rank partial gradients `[ranks, ...]` on `partial_shardings(params, mesh)` (ranks =
    dp, or dp * cp when `cp` > 1: `run` then takes params `[cp, ...]` and vmaps over them).
    `layout(...)` computes the residual layout of an input signature, once, before the
    forward of that signature is traced; `layouts[key]` is read by the backward."""

    def __init__(self, run, mode: Backward | str, remat: str, dp: int = 1, mesh=None,
                 cp: int = 1, zero_stage: int = 1, fsdp_group: int = 0):
        self.run, self.remat, self.dp, self.mesh = run, remat, dp, mesh
        self.zero_stage = zero_stage if mesh is not None else 1
        # where the ZeRO state lives: the stage mesh, or its FSDP-group view (hybrid)
        self.zero_mesh = None if mesh is None else zero_mesh(mesh, fsdp_group)
        self.shared = self.zero_stage == 3  # one dp-sharded copy of the weights, not per rank
        self.mode = mode = Backward(mode)  # a mode's string (e.g. "full") is accepted too
        self.cp, self.ranks = cp, dp * cp  # cp > 1: `run` takes params [cp, ...] (see _block)
        self.layouts: dict[int, ResidualLayout] = {}
        self._keys: dict = {}  # input signature -> key
        self.signatures: dict[str, Any] = {}  # kind -> last abstract arguments (for HLO)
        self._forward = jax.jit(self._forward_impl, static_argnames=("key",))
        self._backward = (None if mode is Backward.NONE
                          else jax.jit(self._backward_impl, donate_argnums=(5,)))
        self.backward = None if mode is Backward.NONE else self._run_backward
        self.apply = jax.jit(self._apply_impl)  # forward only (evaluation): no residuals

    def _block(self, params):
        """Per-rank copies `[dp, ...]` of the dp-replicated params, slot r on dp rank r (a
        local broadcast: no communication). Differentiating with respect to them gives each
        rank's own partial gradient instead of GSPMD's all-reduced one. With cp > 1 the
        copies are per (dp, cp) rank, `[dp * cp, ...]` on P(('dp', 'cp'), *TP spec). ZeRO-3:
        the params themselves (their gradient comes out summed over the ranks)."""
        if self.shared:
            return params
        if self.cp > 1:
            specs = mesh_param_specs(params, self.mesh)
            return jax.tree.map(lambda a, s: jax.lax.with_sharding_constraint(
                jnp.broadcast_to(a[None], (self.ranks,) + a.shape),
                NamedSharding(self.mesh, P(("dp", "cp"), *_padded_spec(s, a.ndim)))),
                params, specs)
        if self.dp == 1 or self.mesh is None:
            return jax.tree.map(lambda a: a[None], params)
        specs = mesh_param_specs(params, self.mesh)
        return jax.tree.map(lambda a, s: jax.lax.with_sharding_constraint(
            jnp.broadcast_to(a[None], (self.dp,) + a.shape),
            NamedSharding(self.mesh, P("dp", *_padded_spec(s, a.ndim)))), params, specs)

    def _run_ranks(self, blocked, frozen, x, side):
        """The stage on every dp rank: `vmap` over the rank axis (spmd_axis_name 'dp'), rank r
        on its params slot and its rows of x and side; outputs merged back rank-major, per-rank
        scalars (losses) kept as `[dp]` vectors. With cp > 1 rank r gets its cp ranks' slots
        `[cp, ...]` (the stage function vmaps over them)."""
        if self.cp > 1:
            abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), blocked)
            specs = mesh_param_specs(abstract, self.mesh)
            blocked = jax.tree.map(lambda a, s: jax.lax.with_sharding_constraint(
                a.reshape((self.dp, self.cp) + a.shape[1:]),
                NamedSharding(self.mesh, P("dp", "cp", *_padded_spec(s, a.ndim - 1)))),
                blocked, specs)
        elif self.dp == 1:
            t = blocked if self.shared else jax.tree.map(lambda a: a[0], blocked)
            y = self.run(t, frozen, x, side, 1)
            return jax.tree.map(lambda a: a[None] if a.ndim == 0 else a, y)
        dp = self.dp
        one = lambda t, xx, ss: self.run(t, frozen, xx, ss, 1)
        y = jax.vmap(one, in_axes=(None if self.shared else 0, _rank_axes(x), _rank_axes(side)),
                     spmd_axis_name="dp")(blocked, _split_ranks(x, dp), _split_ranks(side, dp))
        return jax.tree.map(lambda a: a if a.ndim == 1 else
                            a.reshape((a.shape[0] * a.shape[1],) + a.shape[2:]), y)

    def _linearize(self, trainable, frozen, x, side):
        """-> (y, vjp leaves, vjp treedef) for the primals this mode differentiates (the
        per-rank param copies, not the shared params: see `_block`)."""
        run, policy = self._run_ranks, self.remat
        ranks = 1 if self.dp > 1 else 0  # `_run_ranks` vmaps over the dp ranks
        remat = lambda f, p: remat_wrap(f, p, ranks)
        blocked = self._block(trainable)
        if self.mode is Backward.INPUT_ONLY:
            y, vjp = jax.vjp(remat(lambda xx: run(blocked, frozen, xx, side), policy), x)
        elif self.mode is Backward.PARAMS:
            y, vjp = jax.vjp(remat(lambda t: run(t, frozen, x, side), policy), blocked)
        else:
            y, vjp = jax.vjp(remat(lambda t, xx: run(t, frozen, xx, side), policy),
                             blocked, x)
        leaves, treedef = jax.tree_util.tree_flatten(vjp)
        return y, leaves, treedef

    def layout(self, trainable, frozen, x, side) -> int:
        """The key of this input signature's residual layout (computed on first sight)."""
        if self.mode is Backward.NONE:
            return -1
        sig = input_signature((trainable, frozen, x, side))
        if sig not in self._keys:
            key = len(self.layouts)
            self.layouts[key] = residual_layout(self._linearize, (trainable, frozen, x, side))
            self._keys[sig] = key
        return self._keys[sig]

    def forward(self, trainable, frozen, x, side):
        args = (trainable, frozen, x, side)
        key = self.layout(*args)
        self.signatures["F"] = (abstract_args(args), key)
        return self._forward(*args, key=key)

    def _run_backward(self, trainable, frozen, side, residuals, dy, acc):
        args = (trainable, frozen, side, residuals, dy, acc)
        self.signatures["B"] = abstract_args(args)
        return self._backward(*args)

    def lowered(self, kind: str):
        """The lowered forward ("F") or backward ("B") of the last signature run (for HLO
        inspection: which collectives one microbatch issues)."""
        if kind == "F":
            args, key = self.signatures["F"]
            return self._forward.lower(*args, key=key)
        assert self._backward is not None  # "B" is recorded only by a stage with a backward
        return self._backward.lower(*self.signatures["B"])

    def _forward_impl(self, trainable, frozen, x, side, key):
        if self.mode is Backward.NONE:
            return (self._run_ranks(self._block(trainable), frozen, x, side),
                    Residuals([], -1))
        lay = self.layouts[key]
        y, leaves, _ = self._linearize(trainable, frozen, x, side)
        kept = [a for i, a in enumerate(leaves) if i not in lay.recompute and i not in lay.side]
        return y, Residuals(kept, key)

    def _apply_impl(self, trainable, frozen, x, side):
        """The stage's outputs alone (no vjp, nothing kept for a backward)."""
        return self._run_ranks(self._block(trainable), frozen, x, side)

    def _backward_impl(self, trainable, frozen, side, residuals, dy, acc):
        lay = self.layouts[residuals.key]
        # Re-trace the linearization on the parameters and host inputs (the stage input is
        # a placeholder: every leaf depending on it comes from `residuals`); jit's dead-code
        # elimination leaves only the parameter-only leaves' computation.
        x0 = jax.tree.map(lambda sd: jnp.zeros(sd.shape, sd.dtype), lay.x_shapes)
        _, fresh, treedef = self._linearize(trainable, frozen, x0, side)
        side_leaves = jax.tree.leaves(side)
        kept = iter(residuals.leaves)
        leaves = [fresh[i] if i in lay.recompute else
                  side_leaves[lay.side[i]] if i in lay.side else next(kept)
                  for i in range(lay.num_leaves)]
        cts = jax.tree_util.tree_unflatten(treedef, leaves)(dy)
        if self.mode is Backward.INPUT_ONLY:
            return acc, cts[0]
        g = cts[0]
        if self.zero_stage >= 2:  # into the ZeRO shards: ZeRO-2 one flat reduce-scatter
            g = self._to_shards(trainable, g)  # of the partials, ZeRO-3 the summed grads
        grads = jax.tree.map(lambda a, g: a + g.astype(a.dtype), acc, g)
        return grads, (cts[1] if self.mode is Backward.FULL else None)

    def _to_shards(self, trainable, g):
        """This microbatch's parameter gradients on the ZeRO shard specs (`zero_shard_specs`):
        ZeRO-2 per-rank partials `[ranks, ...]` reduce-scattered; ZeRO-3 gradients (summed by
        the layer scan's per-layer reduce-scatters) constrained to their shards."""
        abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), trainable)
        mesh = self.zero_mesh
        specs = zero_shard_specs(abstract, mesh)
        if self.shared:
            return jax.tree.map(lambda x, s: jax.lax.with_sharding_constraint(
                x.astype(jnp.float32), NamedSharding(mesh, s)), g, specs,
                is_leaf=_is_leaf_or_spec)
        partial = jax.tree.map(lambda sh: sh.spec, partial_shardings(abstract, mesh))
        scatter = reduce_scatter_partials(mesh, specs, partial, rank_axes(mesh),
                                          zero_axes(mesh)[1])
        return scatter(jax.tree.map(lambda x: x.astype(jnp.float32), g))


def make_stage_fns(cfg: MLLMConfig, up: UnitPlan, graphdef, mode: Backward | str, dtype,
                   mesh=None, with_generator: bool | None = None,
                   llm_mask_family: str = "bam") -> StageFns:
    """The jitted functions of one stage of unit `up.name`, as its `UnitPlan` configures
    them (dp ranks, remat policy, overlapped TP, CP head groups, attention implementation).
    `with_generator`
    (default: the model has one) makes the last LLM stage also return the conditioning."""
    unit, impl, kind = up.name, up.attention_impl, role(up.name)
    remat_wrap(lambda: None, up.remat)  # validate the policy name up front
    family = {UnitRole.LLM: llm_mask_family, UnitRole.GENERATOR: "full"}.get(kind, "bam")
    choose_implementation(impl, 1, 1, dtype, family)  # validate the choice up front
    if kind is UnitRole.LLM:  # and against the layers' options (windows, soft-caps)
        for options in attention_options(cfg.llm):
            choose_implementation(impl, 1, 1, dtype, family, options=options)
    if with_generator is None:
        with_generator = cfg.generator is not None
    cp = (mesh.shape["cp"] if kind is UnitRole.LLM and mesh is not None
          and "cp" in mesh.axis_names else 1)

    gather = (zero3_layer_gather(zero_mesh(mesh, up.fsdp_group)) if up.zero_stage == 3
              and mesh is not None and up.dp > 1 else None)

    def run(trainable, frozen, x, side, ranks):
        # ZeRO-3: each layer gathered in the scan (else no-op); LoRA dropout in a training
        # step (the ids in `side`: pipeline/lora_dropout.py)
        with layer_weights(gather), stage_dropout(side):
            return run_unit(trainable, frozen, x, side, ranks)

    def run_unit(trainable, frozen, x, side, ranks):
        if cp > 1:  # trainable [cp, ...]: one slot per cp rank (StageFns._block)
            return apply_llm_cp_ranks(cfg, graphdef, trainable, frozen, x, side, dtype,
                                      with_generator, mesh, cp, up.cp_head_groups, impl)
        module = nnx.merge(graphdef, cast_floats(trainable, dtype), cast_floats(frozen, dtype))
        if kind is UnitRole.LLM:  # the batch is one rank's (StageFns vmaps over dp): no 'dp' axis
            return apply_llm(cfg, module, x, side, dtype, with_generator, ranks, mesh,
                             up.overlap_tp, up.tp_chunks, up.tp_bidirectional,
                             up.cp_head_groups, impl, batch_axis=None,
                             mask_family=llm_mask_family)
        if kind is UnitRole.GENERATOR:
            return apply_generator(cfg, module, x, side, dtype, impl)
        if kind is UnitRole.VAE:
            return apply_vae(cfg, module, side)
        return apply_encoder(cfg, unit, module, x, side, dtype, impl)

    return StageFns(run, mode, up.remat, up.dp if mesh is not None else 1, mesh, cp,
                    up.zero_stage, up.fsdp_group)


def dp_sharding(mesh, ndim: int) -> NamedSharding:
    return NamedSharding(mesh, P("dp", *([None] * (ndim - 1))))


def _is_leaf_or_spec(x) -> bool:
    return isinstance(x, P)


def _padded_spec(spec, ndim: int) -> tuple:
    return tuple(spec) + (None,) * (ndim - len(spec))


def abstract_args(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(
        tuple(a.shape), a.dtype, sharding=getattr(a, "sharding", None)), tree)


def rank_axes(mesh) -> tuple[str, ...]:
    """The mesh axes a stage's per-rank partial gradients are blocked over: ('dp', 'cp') on
    a mesh with cp > 1 (an LLM stage: StageFns vmaps over both), else ('dp',); a ZeRO view
    with FSDP groups (parallel/zero.py `zero_mesh`) has 'rep' in front."""
    cp = "cp" in mesh.axis_names and mesh.shape["cp"] > 1
    return ("rep",) * ("rep" in mesh.axis_names) + (("dp", "cp") if cp else ("dp",))


def partial_shardings(params, mesh):
    """Shardings of a stage's per-rank partial gradients `[ranks, ...]` (ranks = dp, or
    dp * cp): P('dp', *TP spec), or P(('dp', 'cp'), *TP spec)."""
    axes = rank_axes(mesh)
    axes = axes[0] if len(axes) == 1 else axes
    return jax.tree.map(lambda a, s: NamedSharding(mesh, P(axes, *_padded_spec(s, len(a.shape)))),
                        params, mesh_param_specs(params, mesh))
