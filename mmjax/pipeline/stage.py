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
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from mmjax.models.config import MLLMConfig
from mmjax.models.generator import DiffusionGenerator, diffusion_loss_sum
from mmjax.models.attention import TokenMeta, choose_implementation
from mmjax.models.llm import LLM, lm_loss_sum, merge_modalities, meta_attend
from mmjax.models.mllm import (encoder_embed, encoder_layers, generator_inputs, llm_meta,
                               make_encoder, project, unit_key)
from mmjax.models.projector import make_projector
from mmjax.parallel.context import cp_attention_sharded
from mmjax.parallel.tensor import mesh_param_specs
from mmjax.parallel.tp_ops import sequence_sharded_llm_stage
from mmjax.planner.plan import REMAT_POLICIES, UnitPlan
from mmjax.models.layers import cast_floats


class EncoderStage(nnx.Module):
    """Encoder layers [start, end) (+ projector on the last stage) of one encoder branch."""

    def __init__(self, cfg: MLLMConfig, name: str, root_key, start: int, end: int):
        spec = cfg.encoder(name)
        self.encoders = nnx.Dict({name: make_encoder(spec, unit_key(root_key, name), start, end)})
        self.is_last = end == cfg.num_layers(name)
        self.projectors = nnx.Dict({name: make_projector(
            spec.projector, spec.encoder.hidden_size, cfg.llm.hidden_size,
            unit_key(root_key, name + "/projector"))} if self.is_last else {})


def build_stage_module(cfg: MLLMConfig, unit: str, root_key, start: int, end: int):
    if unit == "llm":
        return LLM(cfg.llm, unit_key(root_key, "llm"), start, end)
    if unit == "generator":
        return DiffusionGenerator(cfg.generator, cfg.llm.hidden_size,
                                  unit_key(root_key, "generator"), start, end)
    return EncoderStage(cfg, unit, root_key, start, end)


def stage_module(cfg: MLLMConfig, unit: str, start: int, end: int, root_key):
    """`build_stage_module` with the key last: the constructor `init_split` takes."""
    return build_stage_module(cfg, unit, root_key, start, end)


def _per_rank(x, ranks):
    return x.reshape((ranks, x.shape[0] // ranks) + x.shape[1:])


def _pack(flat, pack):
    """flat [ranks, N, ...], pack [ranks, slots, cap] (-1 = empty) -> [ranks*slots, cap, ...]."""
    def one(f, p):
        got = f[jnp.clip(p, 0, f.shape[0] - 1)]
        keep = (p >= 0).reshape(p.shape + (1,) * (got.ndim - p.ndim))
        return jnp.where(keep, got, 0)
    out = jax.vmap(one)(flat, pack)
    return out.reshape((-1,) + out.shape[2:])


def apply_encoder(cfg: MLLMConfig, name: str, module: EncoderStage, x, side, dtype,
                  attention_impl: str = "auto"):
    spec = cfg.encoder(name)
    enc = module.encoders[name]
    inputs = {k: (v.astype(dtype) if jnp.issubdtype(v.dtype, jnp.floating) else v)
              for k, v in side["inputs"].items()}
    if enc.is_first:
        x = encoder_embed(spec, enc, inputs)
    x = encoder_layers(spec, enc, x, inputs, attention_impl)
    if not module.is_last:
        return x
    ranks = side["pack"].shape[0]
    y = project(spec, module.projectors[name], enc.finish(x), inputs, attention_impl)
    return _pack(_per_rank(y, ranks), side["pack"])


def apply_llm(cfg: MLLMConfig, module: LLM, x, side, dtype, with_generator: bool, ranks: int,
              mesh=None, overlap_tp: bool = False, tp_chunks: int = 2,
              tp_bidirectional: bool = True, cp_head_groups: int = 1,
              attention_impl: str = "auto", batch_axis: str | None = "dp",
              mask_family: str = "bam"):
    """LLM stage (attention: `bam_attention` with `attention_impl` on the tokens' metadata);
    on a ('dp','cp','tp') mesh attention is Cornstarch's all-gather CP attention over
    tokens already in CP layout (data/feed.py `cp_layout`), K/V gathered
    in `cp_head_groups` groups of heads (Cornstarch §5.3). With `overlap_tp` the projections
    are decomposed collective matmuls, `tp_chunks` pieces per ring step, both ring
    directions when `tp_bidirectional` (DistTrain §7). `batch_axis`: the mesh axis the batch
    is split over in those shard_maps (None inside the stage's vmap over dp ranks).
    `mask_family` (`AssemblyLayout.llm_mask_family`) holds on the plain path only: CP and
    overlapped TP attend over sharded query layouts."""
    if module.is_first:
        x = _embed_inputs(cfg, module, x, side["llm"], dtype, ranks)
    batch = side["llm"]
    if mesh is not None and "cp" in mesh.axis_names:
        meta = TokenMeta(batch["bam"], batch["doc"], batch["sub"], batch["idx"])
        attend = lambda q, k, v: cp_attention_sharded(q, k, v, meta, mesh,
                                                      num_head_groups=cp_head_groups,
                                                      implementation=attention_impl,
                                                      batch_axis=batch_axis)
        x = module.run_layers(x.astype(dtype), batch["positions"], attend)
    elif overlap_tp:  # DistTrain §7 StepCCL: decomposed collective matmuls, sequence-sharded
        make_attend = lambda *meta: meta_attend(TokenMeta(*meta), attention_impl)
        fn, state = sequence_sharded_llm_stage(module, mesh, make_attend, overlap_tp=True,
                                               batch_axis=batch_axis, num_chunks=tp_chunks,
                                               bidirectional=tp_bidirectional)
        x = fn(state, x.astype(dtype), batch["positions"], *llm_meta(batch))
    else:
        x = module.run_layers(x.astype(dtype), batch["positions"],
                              meta_attend(llm_meta(batch), attention_impl, mask_family))
    if not module.is_last:
        return x
    hf = module.final_hidden(x)
    lm = lm_loss_sum(module.logits(hf), batch["targets"], batch["loss_mask"]) / side["num_tokens"]
    if not with_generator:
        return lm
    return lm, _condition(hf, side, ranks)


def _embed_inputs(cfg: MLLMConfig, module: LLM, x, b, dtype, ranks: int):
    """The first LLM stage's input: token embeddings with the encoders' outputs `x` merged
    in at their placeholder positions (`b[f"gather_{name}"]`)."""
    h = module.embed_tokens(b["tokens"], dtype)
    for e in cfg.encoders:
        parts = x[e.name]
        flat = _per_rank(parts, ranks).reshape(ranks, -1, parts.shape[-1])
        g = _per_rank(b[f"gather_{e.name}"], ranks)
        hr = jax.vmap(lambda hh, ff, gg: merge_modalities(hh, {"e": ff}, {"e": gg}))(
            _per_rank(h, ranks), flat, g)
        h = hr.reshape(h.shape)
    return h


def _condition(hf, side, ranks: int):
    """The generator's conditioning: the final hidden states at `gen_query`, packed."""
    hr = _per_rank(hf, ranks).reshape(ranks, -1, hf.shape[-1])        # [ranks, rows*S, d]
    q = _per_rank(side["llm"]["gen_query"], ranks)                     # [ranks, G, K]
    cond = jax.vmap(lambda hh, qq: hh[qq])(hr, q)                      # [ranks, G, K, d]
    return _pack(cond, side["gen_pack"])


def apply_llm_cp_ranks(cfg: MLLMConfig, graphdef, trainable, frozen, x, side, dtype,
                       with_generator: bool, mesh, cp: int, cp_head_groups: int = 1,
                       attention_impl: str = "auto"):
    """One dp rank's LLM stage as a `vmap` over its cp ranks (`spmd_axis_name='cp'`): cp
    rank r computes on its own L = N / cp tokens of the CP layout (rank-major, data/feed.py
    `cp_layout`) with its own slot of `trainable` `[cp, ...]`, so the parameter gradients
    stay per-cp-rank partials (Megatron-LM reduces them over dp x cp once per step); the
    only cp collectives are Cornstarch's K/V all-gathers (§5.3) and their reduce-scatters.
    The loss comes out summed over cp ranks; the conditioning for the generator is read
    from the merged final hidden states (activations only)."""
    tokens = {k: v for k, v in side["llm"].items() if k != "gen_query"}

    def split(a):  # [B, N, ...] -> [cp, B, N / cp, ...]
        return jnp.moveaxis(a.reshape((a.shape[0], cp, a.shape[1] // cp) + a.shape[2:]), 1, 0)

    def merge(a):  # [cp, B, L, ...] -> [B, cp * L, ...]
        a = jnp.moveaxis(a, 0, 1)
        return a.reshape((a.shape[0], a.shape[1] * a.shape[2]) + a.shape[3:])

    per_token_x = x is not None and not isinstance(x, dict)  # the first stage's is per dp rank

    def one(t, xx, b):
        module = nnx.merge(graphdef, cast_floats(t, dtype), cast_floats(frozen, dtype))
        meta = TokenMeta(b["bam"], b["doc"], b["sub"], b["idx"])
        attend = lambda q, k, v: cp_attention_sharded(q, k, v, meta, mesh,
                                                      num_head_groups=cp_head_groups,
                                                      implementation=attention_impl,
                                                      batch_axis=None, local_sequence=True)
        if module.is_first:
            xx = _embed_inputs(cfg, module, xx, b, dtype, 1)
        h = module.run_layers(xx.astype(dtype), b["positions"], attend)
        if not module.is_last:
            return h
        hf = module.final_hidden(h)
        return lm_loss_sum(module.logits(hf), b["targets"], b["loss_mask"]), hf

    out = jax.vmap(one, in_axes=(0, 0 if per_token_x else None, 0), spmd_axis_name="cp")(
        trainable, split(x) if per_token_x else x, jax.tree.map(split, tokens))
    if not isinstance(out, tuple):
        return merge(out)
    lm = jnp.sum(out[0]) / side["num_tokens"]
    return (lm, _condition(merge(out[1]), side, 1)) if with_generator else lm


def apply_generator(cfg: MLLMConfig, module: DiffusionGenerator, x, side, dtype,
                    attention_impl: str = "auto"):
    g = side["gen"]
    if module.is_first:
        cond = x.reshape((-1,) + x.shape[2:])                          # [ranks*slots*cap, K, d]
        noisy, t = generator_inputs(cfg, g, dtype)
        x = module.embed(noisy, t, cond)
    x = module.run_layers(jax.tree.map(lambda a: a.astype(dtype), x), attention_impl)
    if not module.is_last:
        return x
    eps = module.finish(x)
    return diffusion_loss_sum(eps, g["gen_noise"], g["gen_valid"]) / side["num_gen"]



# Primitives whose single sub-jaxpr maps the eqn's inputs/outputs one to one, so dependence
# can be traced through them exactly; any other higher-order primitive (scan, while, cond)
# is treated conservatively (every output depends on every input).
_CALL_LIKE = ("pjit", "jit", "closed_call", "core_call", "remat", "checkpoint", "shard_map",
              "custom_vjp_call", "custom_vjp_call_jaxpr", "custom_jvp_call")


def _weight_dots_saveable(rank_dims: int):
    """Checkpoint policy: save a dot_general with at most `rank_dims` batch dimensions. The
    stage vmaps over its dp ranks, each on its own parameter copy (`StageFns._block`), so
    inside that vmap every weight matmul carries one batch dimension (the rank) and JAX's
    `dots_with_no_batch_dims_saveable` would save nothing; the attention core (q.k, p.v:
    batch, heads and the rank) stays above the bound either way."""
    def policy(prim, *_, **params):
        if prim.name != "dot_general":
            return False
        (_, _), (lhs_batch, _) = params["dimension_numbers"]
        return len(lhs_batch) <= rank_dims
    return policy


def remat_wrap(f, remat: str, rank_dims: int = 0):
    """The stage function under the plan's remat policy (`rank_dims`: 1 when `f` runs its
    dp ranks under a vmap, see `_weight_dots_saveable`).

    "full": `nothing_saveable`, per microbatch only the stage's inputs are kept and backward
    re-runs the forward (Megatron full recomputation). "dots": `_weight_dots_saveable` keeps
    the outputs of the weight matmuls (projections, FFN, logits: dot_generals without batch
    dimensions beyond the dp rank) and recomputes the rest: the elementwise work, norms and the attention
    core (q.k and p.v are batched dot_generals, quadratic in the sequence and cheap to redo
    relative to their memory), i.e. Megatron's selective recomputation (Korthikanti et al.).
    `dots_saveable` would also keep the [B, H, S, S] attention scores, the largest activation
    of long sequences. "none": no checkpoint, every residual is kept.
    """
    if remat == "full":
        return jax.checkpoint(f, policy=jax.checkpoint_policies.nothing_saveable)
    if remat == "dots":
        return jax.checkpoint(f, policy=_weight_dots_saveable(rank_dims))
    if remat == "none":
        return f
    raise ValueError(f"remat={remat!r}: must be one of {REMAT_POLICIES}")


def _sub_jaxprs(params) -> list:
    """The (open) jaxprs among an eqn's params, looking one level into tuples/lists; built
    on the public `Jaxpr`/`ClosedJaxpr` types only, so it holds across jax versions."""
    from jax.extend.core import ClosedJaxpr, Jaxpr

    out = []
    for v in params.values():
        for item in (v if isinstance(v, (tuple, list)) else (v,)):
            if isinstance(item, ClosedJaxpr):
                out.append(item.jaxpr)
            elif isinstance(item, Jaxpr):
                out.append(item)
    return out


def _depends(jaxpr, in_dep) -> list[bool]:
    """Per outvar of `jaxpr`: does it depend on an invar flagged in `in_dep`?"""
    from jax.extend.core import Literal

    dep = {v for v, d in zip(jaxpr.invars, in_dep) if d}
    for eqn in jaxpr.eqns:
        ins = [not isinstance(v, Literal) and v in dep for v in eqn.invars]
        if not any(ins):
            continue
        subs = _sub_jaxprs(eqn.params)
        if (eqn.primitive.name in _CALL_LIKE and len(subs) == 1
                and len(subs[0].invars) == len(ins) and len(subs[0].outvars) == len(eqn.outvars)):
            outs = _depends(subs[0], ins)
        else:
            outs = [True] * len(eqn.outvars)
        dep.update(v for v, d in zip(eqn.outvars, outs) if d)
    return [not isinstance(v, Literal) and v in dep for v in jaxpr.outvars]


@jax.tree_util.register_pytree_node_class
class Residuals:
    """What one microbatch's forward keeps for its backward: the leaves of the `jax.vjp`
    function that depend on the stage input or the host inputs. `key` (static) names the
    traced signature in `StageFns.layouts`."""

    def __init__(self, leaves, key: int):
        self.leaves, self.key = list(leaves), key

    def tree_flatten(self):
        return (self.leaves,), self.key

    @classmethod
    def tree_unflatten(cls, key, children):
        return cls(children[0], key)

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in self.leaves)


@dataclass(frozen=True)
class ResidualLayout:
    """Per traced input signature: which vjp leaves backward rebuilds instead of receiving
    (`recompute`: functions of the parameters alone, the parameters themselves included;
    `side`: leaf -> index of the host input it is), and the stage input's shapes."""

    num_leaves: int
    recompute: frozenset
    side: dict
    x_shapes: object


def _signature(tree):
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return treedef, tuple((tuple(a.shape), jnp.dtype(a.dtype).name) for a in leaves)


def residual_layout(linearize, args) -> ResidualLayout:
    """Which vjp leaves of `linearize(*args)` are functions of the parameters alone
    (dependence analysis of the traced jaxpr) or are host inputs; traced on shapes only.
    `args` = (trainable, frozen, x, side)."""
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(tuple(a.shape), a.dtype), args)
    counts = {}

    def probe(*xs):
        y, leaves, _ = linearize(*xs)
        counts["res"] = len(leaves)
        return y, leaves

    closed = jax.make_jaxpr(probe)(*abstract)
    trainable, frozen, x, side = abstract
    n_params = len(jax.tree.leaves((trainable, frozen)))
    n_x, n_side = len(jax.tree.leaves(x)), len(jax.tree.leaves(side))
    outs = closed.jaxpr.outvars
    dep = _depends(closed.jaxpr, [False] * n_params + [True] * (n_x + n_side))
    n_y = len(outs) - counts["res"]
    side_vars = closed.jaxpr.invars[n_params + n_x:]
    side_pos, recompute = {}, set()
    for i, (v, d) in enumerate(zip(outs[n_y:], dep[n_y:])):
        hit = [j for j, sv in enumerate(side_vars) if v is sv]
        if hit:
            side_pos[i] = hit[0]
        elif not d:
            recompute.add(i)
    return ResidualLayout(counts["res"], frozenset(recompute), side_pos, x)


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
    forward of that signature is traced; `layouts[key]` is read by the backward.
    `launches` counts program launches per kind ("F", "B": the dispatch log)."""

    def __init__(self, run, mode: str, remat: str, dp: int = 1, mesh=None, cp: int = 1):
        self.run, self.mode, self.remat, self.dp, self.mesh = run, mode, remat, dp, mesh
        self.cp, self.ranks = cp, dp * cp  # cp > 1: `run` takes params [cp, ...] (see _block)
        self.layouts: dict[int, ResidualLayout] = {}
        self._keys: dict = {}  # input signature -> key
        self.signatures: dict[str, object] = {}  # kind -> last abstract arguments (for HLO)
        self._forward = jax.jit(self._forward_impl, static_argnames=("key",))
        self._backward = (None if mode == "none"
                          else jax.jit(self._backward_impl, donate_argnums=(5,)))
        self.backward = None if mode == "none" else self._run_backward
        self.apply = jax.jit(self._apply_impl)  # forward only (evaluation): no residuals

    def _block(self, params):
        """Per-rank copies `[dp, ...]` of the dp-replicated params, slot r on dp rank r (a
        local broadcast: no communication). Differentiating with respect to them gives each
        rank's own partial gradient instead of GSPMD's all-reduced one. With cp > 1 the
        copies are per (dp, cp) rank, `[dp * cp, ...]` on P(('dp', 'cp'), *TP spec)."""
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
            y = self.run(jax.tree.map(lambda a: a[0], blocked), frozen, x, side, 1)
            return jax.tree.map(lambda a: a[None] if a.ndim == 0 else a, y)
        dp = self.dp
        one = lambda t, xx, ss: self.run(t, frozen, xx, ss, 1)
        y = jax.vmap(one, in_axes=(0, _rank_axes(x), _rank_axes(side)),
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
        if self.mode == "input_only":
            y, vjp = jax.vjp(remat(lambda xx: run(blocked, frozen, xx, side), policy), x)
        elif self.mode == "params":
            y, vjp = jax.vjp(remat(lambda t: run(t, frozen, x, side), policy), blocked)
        else:
            y, vjp = jax.vjp(remat(lambda t, xx: run(t, frozen, xx, side), policy),
                             blocked, x)
        leaves, treedef = jax.tree_util.tree_flatten(vjp)
        return y, leaves, treedef

    def layout(self, trainable, frozen, x, side) -> int:
        """The key of this input signature's residual layout (computed on first sight)."""
        if self.mode == "none":
            return -1
        sig = _signature((trainable, frozen, x, side))
        if sig not in self._keys:
            key = len(self.layouts)
            self.layouts[key] = residual_layout(self._linearize, (trainable, frozen, x, side))
            self._keys[sig] = key
        return self._keys[sig]

    def forward(self, trainable, frozen, x, side):
        args = (trainable, frozen, x, side)
        key = self.layout(*args)
        self.signatures["F"] = (_abstract(args), key)
        return self._forward(*args, key=key)

    def _run_backward(self, trainable, frozen, side, residuals, dy, acc):
        args = (trainable, frozen, side, residuals, dy, acc)
        self.signatures["B"] = _abstract(args)
        return self._backward(*args)

    def lowered(self, kind: str):
        """The lowered forward ("F") or backward ("B") of the last signature run (for HLO
        inspection: which collectives one microbatch issues)."""
        if kind == "F":
            args, key = self.signatures["F"]
            return self._forward.lower(*args, key=key)
        return self._backward.lower(*self.signatures["B"])

    def _forward_impl(self, trainable, frozen, x, side, key):
        if self.mode == "none":
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
        if self.mode == "input_only":
            return acc, cts[0]
        grads = jax.tree.map(lambda a, g: a + g.astype(a.dtype), acc, cts[0])
        return grads, (cts[1] if self.mode == "full" else None)


def make_stage_fns(cfg: MLLMConfig, up: UnitPlan, graphdef, mode: str, dtype,
                   mesh=None, with_generator: bool | None = None,
                   llm_mask_family: str = "bam") -> StageFns:
    """The jitted functions of one stage of unit `up.name`, as its `UnitPlan` configures
    them (dp ranks, remat policy, overlapped TP, CP head groups, attention implementation).
    `with_generator`
    (default: the model has one) makes the last LLM stage also return the conditioning."""
    unit, impl = up.name, up.attention_impl
    remat_wrap(lambda: None, up.remat)  # validate the policy name up front
    family = {"llm": llm_mask_family, "generator": "full"}.get(unit, "bam")
    choose_implementation(impl, 1, 1, dtype, family)  # validate the choice up front
    if with_generator is None:
        with_generator = cfg.generator is not None
    cp = mesh.shape["cp"] if unit == "llm" and mesh is not None and "cp" in mesh.axis_names else 1

    def run(trainable, frozen, x, side, ranks):
        if cp > 1:  # trainable [cp, ...]: one slot per cp rank (StageFns._block)
            return apply_llm_cp_ranks(cfg, graphdef, trainable, frozen, x, side, dtype,
                                      with_generator, mesh, cp, up.cp_head_groups, impl)
        module = nnx.merge(graphdef, cast_floats(trainable, dtype), cast_floats(frozen, dtype))
        if unit == "llm":  # the batch is one rank's (StageFns vmaps over dp): no 'dp' axis
            return apply_llm(cfg, module, x, side, dtype, with_generator, ranks, mesh,
                             up.overlap_tp, up.tp_chunks, up.tp_bidirectional,
                             up.cp_head_groups, impl, batch_axis=None,
                             mask_family=llm_mask_family)
        if unit == "generator":
            return apply_generator(cfg, module, x, side, dtype, impl)
        return apply_encoder(cfg, unit, module, x, side, dtype, impl)

    return StageFns(run, mode, up.remat, up.dp if mesh is not None else 1, mesh, cp)


def dp_sharding(mesh, ndim: int) -> NamedSharding:
    return NamedSharding(mesh, P("dp", *([None] * (ndim - 1))))


def _padded_spec(spec, ndim: int) -> tuple:
    return tuple(spec) + (None,) * (ndim - len(spec))


def _abstract(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(
        tuple(a.shape), a.dtype, sharding=getattr(a, "sharding", None)), tree)


def rank_axes(mesh) -> tuple[str, ...]:
    """The mesh axes a stage's per-rank partial gradients are blocked over: ('dp', 'cp') on
    a mesh with cp > 1 (an LLM stage: StageFns vmaps over both), else ('dp',)."""
    cp = "cp" in mesh.axis_names and mesh.shape["cp"] > 1
    return ("dp", "cp") if cp else ("dp",)


def partial_shardings(params, mesh):
    """Shardings of a stage's per-rank partial gradients `[ranks, ...]` (ranks = dp, or
    dp * cp): P('dp', *TP spec), or P(('dp', 'cp'), *TP spec)."""
    axes = rank_axes(mesh)
    axes = axes[0] if len(axes) == 1 else axes
    return jax.tree.map(lambda a, s: NamedSharding(mesh, P(axes, *_padded_spec(s, len(a.shape)))),
                        params, mesh_param_specs(params, mesh))
