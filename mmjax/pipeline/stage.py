"""Pipeline stages: a slice of one unit on its own sub-mesh, with jitted forward/backward.

A stage module holds layers [start, end) of its unit (encoder + projector on the encoder's
last stage; LLM layers with embedding / head at the ends; generator blocks), built from the
same per-unit keys as `MultimodalModel`, so stages equal the reference model's slices.

`apply(module, x, side)` is the stage's arithmetic on global (dp-sharded) arrays; `x` is
what the previous stage sent (None for an encoder's first stage), `side` the host inputs of
this microbatch. Forward stores the stage input; backward re-runs the stage under `jax.vjp`
("full" remat: per microbatch only the input is kept, never a copy of the params).
Frozen-aware (Cornstarch §4.2): mode "full" returns parameter and input gradients, "params"
parameter gradients only (nothing upstream needs dx), "input_only" dx only (frozen stage
with trainable parameters upstream); a stage with mode "none" gets no B actions at all.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from mmjax.models.config import MLLMConfig
from mmjax.models.generator import DiffusionGenerator, diffusion_loss_sum
from mmjax.models.llm import LLM, lm_loss_sum, mask_attend, merge_modalities
from mmjax.models.mllm import (encoder_embed, encoder_layers, generator_inputs, llm_allowed,
                               make_encoder, project, unit_key)
from mmjax.models.projector import make_projector
from mmjax.parallel.context import TokenMeta, cp_attention_sharded
from mmjax.parallel.tp_ops import sequence_sharded_llm_stage
from mmjax.train.step import cast_floats


class EncoderStage(nnx.Module):
    """Encoder layers [start, end) (+ projector on the last stage) of one encoder branch."""

    def __init__(self, cfg: MLLMConfig, name: str, root_key, start: int, end: int):
        spec = cfg.encoder(name)
        self.encoders = nnx.Dict({name: make_encoder(spec, unit_key(root_key, name), start, end)})
        self.is_last = end == spec.encoder.num_layers
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


def apply_encoder(cfg: MLLMConfig, name: str, module: EncoderStage, x, side, dtype):
    spec = cfg.encoder(name)
    enc = module.encoders[name]
    inputs = {k: (v.astype(dtype) if jnp.issubdtype(v.dtype, jnp.floating) else v)
              for k, v in side["inputs"].items()}
    if enc.is_first:
        x = encoder_embed(spec, enc, inputs)
    x = encoder_layers(spec, enc, x, inputs)
    if not module.is_last:
        return x
    ranks = side["pack"].shape[0]
    y = project(spec, module.projectors[name], enc.finish(x), inputs)  # [ranks*N, D]
    return _pack(_per_rank(y, ranks), side["pack"])


def apply_llm(cfg: MLLMConfig, module: LLM, x, side, dtype, with_generator: bool, ranks: int,
              mesh=None, overlap_tp: bool = False):
    """LLM stage; on a ('dp','cp','tp') mesh attention is Cornstarch's all-gather CP
    attention over tokens already in CP layout (pipeline/feed.py `cp_layout`)."""
    b = side["llm"]
    if module.is_first:
        h = module.embed_tokens(b["tokens"], dtype)
        for e in cfg.encoders:
            parts = x[e.name]
            flat = _per_rank(parts, ranks).reshape(ranks, -1, parts.shape[-1])
            g = _per_rank(b[f"gather_{e.name}"], ranks)
            hr = jax.vmap(lambda hh, ff, gg: merge_modalities(hh, {"e": ff}, {"e": gg}))(
                _per_rank(h, ranks), flat, g)
            h = hr.reshape(h.shape)
        x = h
    batch = side["llm"]
    if mesh is not None and "cp" in mesh.axis_names:
        meta = TokenMeta(batch["bam"], batch["doc"], batch["sub"], batch["idx"])
        attend = lambda q, k, v: cp_attention_sharded(q, k, v, meta, mesh)
        x = module.run_layers(x.astype(dtype), batch["positions"], attend)
    elif overlap_tp:  # DistTrain §7 StepCCL: decomposed collective matmuls, sequence-sharded
        fn, state = sequence_sharded_llm_stage(module, mesh, mask_attend, overlap_tp=True,
                                               batch_axis="dp", num_chunks=2, bidirectional=True)
        x = fn(state, x.astype(dtype), batch["positions"], llm_allowed(batch))
    else:
        x = module.run_layers(x.astype(dtype), batch["positions"], mask_attend(llm_allowed(batch)))
    if not module.is_last:
        return x
    hf = module.final_hidden(x)
    lm = lm_loss_sum(module.logits(hf), batch["targets"], batch["loss_mask"]) / side["num_tokens"]
    if not with_generator:
        return lm
    hr = _per_rank(hf, ranks).reshape(ranks, -1, hf.shape[-1])        # [ranks, rows*S, d]
    q = _per_rank(batch["gen_query"], ranks)                           # [ranks, G, K]
    cond = jax.vmap(lambda hh, qq: hh[qq])(hr, q)                      # [ranks, G, K, d]
    return lm, _pack(cond, side["gen_pack"])


def apply_generator(cfg: MLLMConfig, module: DiffusionGenerator, x, side, dtype):
    g = side["gen"]
    if module.is_first:
        cond = x.reshape((-1,) + x.shape[2:])                          # [ranks*slots*cap, K, d]
        noisy, t = generator_inputs(cfg, g, dtype)
        x = module.embed(noisy, t, cond)
    x = module.run_layers(jax.tree.map(lambda a: a.astype(dtype), x))
    if not module.is_last:
        return x
    eps = module.finish(x)
    return diffusion_loss_sum(eps, g["gen_noise"], g["gen_valid"]) / side["num_gen"]


@dataclass
class StageFns:
    """The jitted functions of one stage; `mode` in full / params / input_only / none."""

    forward: callable
    backward: callable | None


def make_stage_fns(cfg: MLLMConfig, unit: str, graphdef, mode: str, dtype,
                   with_generator: bool, ranks: int, mesh=None,
                   overlap_tp: bool = False) -> StageFns:
    def run(trainable, frozen, x, side):
        module = nnx.merge(graphdef, cast_floats(trainable, dtype), cast_floats(frozen, dtype))
        if unit == "llm":
            return apply_llm(cfg, module, x, side, dtype, with_generator, ranks, mesh,
                             overlap_tp)
        if unit == "generator":
            return apply_generator(cfg, module, x, side, dtype)
        return apply_encoder(cfg, unit, module, x, side, dtype)

    forward = jax.jit(run)
    if mode == "none":
        return StageFns(forward, None)

    def backward(trainable, frozen, x, side, dy, acc):
        if mode == "input_only":
            _, vjp = jax.vjp(lambda xx: run(trainable, frozen, xx, side), x)
            return acc, vjp(dy)[0]
        if mode == "params":
            _, vjp = jax.vjp(lambda t: run(t, frozen, x, side), trainable)
            (dt,) = vjp(dy)
            return jax.tree.map(jnp.add, acc, dt), None
        _, vjp = jax.vjp(lambda t, xx: run(t, frozen, xx, side), trainable, x)
        dt, dx = vjp(dy)
        return jax.tree.map(jnp.add, acc, dt), dx

    return StageFns(forward, jax.jit(backward, donate_argnums=(5,)))


def dp_sharding(mesh, ndim: int) -> NamedSharding:
    return NamedSharding(mesh, P("dp", *([None] * (ndim - 1))))
