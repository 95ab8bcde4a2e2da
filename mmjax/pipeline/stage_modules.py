"""What each pipeline stage is and computes: the stage modules (a slice of one unit's
layers, `stage_module`) and the per-unit stage functions the runtime differentiates
(`apply_encoder`, `apply_llm`, `apply_llm_cp_ranks` for a context-parallel LLM stage,
`apply_generator`, `apply_vae` for the generator's frozen VAE unit), on one dp rank's rows (pipeline/stage.py vmaps them over the ranks)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mmjax.models.config import MLLMConfig
from mmjax.models.generator import DiffusionGenerator, diffusion_loss_sum
from mmjax.models.attention import NO_OPTIONS, TokenMeta
from mmjax.models.layers import cast_floats
from mmjax.models.llm import LLM, meta_attend
from mmjax.models.mllm import (encoder_embed, encoder_layers, generator_inputs, llm_embed,
                               llm_meta, make_encoder, project, unit_key, vae_outputs)
from mmjax.models.projector import make_projector
from mmjax.models.units import UnitRole, is_llm, is_vae, role
from mmjax.models.vae import AutoencoderKL
from mmjax.parallel.context import cp_attention_sharded
from mmjax.parallel.tp_ops import sequence_sharded_llm_stage


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
    """The module of unit `unit`'s layers [start, end), keyed like the whole model's."""
    match role(unit):
        case UnitRole.LLM:
            return LLM(cfg.llm, unit_key(root_key, unit), start, end)
        case UnitRole.GENERATOR:
            assert cfg.generator is not None  # the plan has a generator unit
            return DiffusionGenerator(cfg.generator, cfg.llm.hidden_size,
                                      unit_key(root_key, unit), start, end)
        case UnitRole.VAE:  # one stage; its weights are read from `vae.path` after placement
            assert cfg.vae is not None  # the plan has a VAE unit
            return AutoencoderKL(cfg.vae, unit_key(root_key, unit))
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
    inputs = cast_floats(side["inputs"], dtype)
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
        attend = lambda q, k, v, o=NO_OPTIONS: cp_attention_sharded(q, k, v, meta, mesh,
                                                      num_head_groups=cp_head_groups,
                                                      implementation=attention_impl, options=o,
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
    lm = module.loss_sum(hf, batch["targets"], batch["loss_mask"]) / side["num_tokens"]
    if not with_generator:
        return lm
    return lm, _condition(hf, side, ranks)


def _embed_inputs(cfg: MLLMConfig, module: LLM, x, b, dtype, ranks: int):
    """The first LLM stage's input: per DP rank, `llm_embed` of its tokens with the encoder
    outputs it received (`x[name]`, that rank's parts) merged in at its placeholders."""
    batch = {k: _per_rank(b[k], ranks)
             for k in ["tokens"] + [f"gather_{e.name}" for e in cfg.encoders]}
    parts = {e.name: _per_rank(x[e.name], ranks).reshape(ranks, -1, x[e.name].shape[-1])
             for e in cfg.encoders}
    h = jax.vmap(lambda bb, pp: llm_embed(cfg, module, bb, pp, dtype))(batch, parts)
    return h.reshape(b["tokens"].shape + h.shape[-1:])


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
        attend = lambda q, k, v, o=NO_OPTIONS: cp_attention_sharded(q, k, v, meta, mesh,
                                                      num_head_groups=cp_head_groups,
                                                      implementation=attention_impl, options=o,
                                                      batch_axis=None, local_sequence=True)
        if module.is_first:
            xx = _embed_inputs(cfg, module, xx, b, dtype, 1)
        h = module.run_layers(xx.astype(dtype), b["positions"], attend)
        if not module.is_last:
            return h
        hf = module.final_hidden(h)
        return module.loss_sum(hf, b["targets"], b["loss_mask"]), hf

    out = jax.vmap(one, in_axes=(0, 0 if per_token_x else None, 0), spmd_axis_name="cp")(
        trainable, split(x) if per_token_x else x, jax.tree.map(split, tokens))
    if not isinstance(out, tuple):
        return merge(out)
    lm = jnp.sum(out[0]) / side["num_tokens"]
    return (lm, _condition(merge(out[1]), side, 1)) if with_generator else lm


def apply_vae(cfg: MLLMConfig, module: AutoencoderKL, side):
    """The frozen VAE unit (forward only): one rank's target pixels -> its patchified
    latents [rows, P, pd], in the generator's row order."""
    return vae_outputs(cfg, module, {"gen_pixels": side["pixels"]})


def apply_generator(cfg: MLLMConfig, module: DiffusionGenerator, x, side, dtype,
                    attention_impl: str = "auto"):
    """`x` on the first stage: the LLM's packed conditioning, or {unit: input} with the VAE
    unit's latents beside it (no gradient flows to the frozen VAE)."""
    g = side["gen"]
    if module.is_first:
        latents = None
        if isinstance(x, dict):
            latents = jax.lax.stop_gradient(next(v for u, v in x.items() if is_vae(u)))
            x = next(v for u, v in x.items() if is_llm(u))
        cond = x.reshape((-1,) + x.shape[2:])                          # [ranks*slots*cap, K, d]
        noisy, t = generator_inputs(cfg, g, dtype, latents)
        x = module.embed(noisy, t, cond)
    x = module.run_layers(jax.tree.map(lambda a: a.astype(dtype), x), attention_impl)
    if not module.is_last:
        return x
    eps = module.finish(x)
    return diffusion_loss_sum(eps, g["gen_noise"], g["gen_valid"]) / side["num_gen"]
