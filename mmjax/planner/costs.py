"""Analytic cost model of every unit (no JAX): time, memory and traffic of one `UnitCost`
per unit, from its parameters (planner/module_params.py) and per-layer work
(planner/unit_work.py).

- Forward FLOPs per sample: 2 x tokens x matmul weights, plus the attention quadratic term
  summed over a sample's subsequences (DistTrain §2.3: sizes are skewed, so E[n^2] != E[n]^2).
  With an `attention_impl` (per unit) the LLM's and encoders' attention FLOPs and kept bytes
  come from the tiles that implementation computes (planner/attention_cost.py): the dense
  path pays every pair and keeps [S, S] float32 buffers, the tiled ones pay non-empty tiles
  and keep one float per row; without one, the exact allowed pairs and no [S, S] buffer.
  Sliding-window layers (`LLMConfig.is_sliding`: Mistral, Gemma 2/3's local layers) pay only
  the pairs / tiles inside their window, so a local/global pattern gives per-layer costs;
  Qwen2.5-VL's window blocks pay their windows' pairs (exact-pair costing only: mmjax keeps
  patches in image order, so the tiled kernels' tiles over interleaved windows stay full).
- Backward time follows Cornstarch's rule (Cornstarch §4.2): 0 x forward for a frozen module
  with nothing trainable before it, 1 x (input gradients only) for a frozen module with a
  trainable module before it, 2 x for a trainable module; activation recomputation adds one
  forward where a backward runs.
- Memory per GPU (DistTrain §5.1) as the runtime holds it (planner/memory.py): the compute
  copy, fp32 per-rank gradient accumulators and fp32 frozen weights on one TP rank (Megatron
  rules split all but `replicated_params`) / PP, fp32 master + AdamW moments also / DP
  (ZeRO-1), the residuals of the microbatches 1F1B keeps in flight under the unit's remat
  policy, one microbatch's backward working set, and the optimizer step.
- Activation recomputation (`remat`, pipeline/stage.py `remat_wrap`): "full" re-runs the
  forward in the backward; "dots" (Megatron selective recomputation, Korthikanti et al.
  §4.2) re-runs all but the weight matmuls, i.e. pays the attention core again; "none"
  recomputes nothing.
- Communication is volume / bandwidth: TP all-reduces inside C(TP), PP point-to-point of
  one boundary tensor, DP reduce-scatter + all-gather of gradients/parameters.

`unit_costs(model, workload, hw)` reduces all of it to one `UnitCost` per unit; the
orchestrator only sees `UnitCost`s (and `profile.py` can replace their times by measured
piecewise-linear tables).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from mmjax.models.config import MLLMConfig, VisionConfig
from mmjax.models.units import is_generator, is_llm, is_vae
from mmjax.planner import memory
from mmjax.planner.hardware import Hardware
from mmjax.planner.module_params import layer_params, replicated_params
from mmjax.planner.unit_work import ACT_BYTES, UnitWork, Work, impl_of, unit_work, vae_side
from mmjax.planner.workload import Workload

TP_SIZES = (1, 2, 4, 8)
WEIGHT_BYTES = 2  # bf16 compute copy


# ---- time and memory ----------------------------------------------------------------------
def remat_policy(recompute) -> str:
    """The runtime's remat policy for a `recompute` argument: a policy name, or a bool
    (True: "full", False: "none")."""
    if isinstance(recompute, str):
        if recompute not in memory.REMATS:
            raise ValueError(f"remat={recompute!r}: must be one of {list(memory.REMATS)}")
        return recompute
    return "full" if recompute else "none"


def work_time(w: Work, tp: int, hw: Hardware, recompute=False) -> tuple[float, float]:
    """(forward, backward) seconds of one piece at tensor-parallel size `tp`; `recompute`
    (a remat policy or a bool) adds what the backward re-runs: the whole forward ("full",
    Megatron full recomputation) or the attention core ("dots", Megatron selective
    recomputation: the weight matmuls' outputs are kept)."""
    eff = tp * hw.peak_flops * hw.efficiency(w.width / tp, w.tokens, w.kind)
    fwd = w.flops / eff
    comm = 0.0 if tp == 1 else 2 * (tp - 1) / tp * w.allreduce_bytes / hw.nvlink_bw
    fwd += comm
    policy = remat_policy(recompute)
    redo = fwd if policy == "full" else w.attn_flops / eff if policy == "dots" else 0.0
    bwd = w.bwd * fwd + (redo if w.bwd > 0 else 0.0)
    return fwd, bwd


def layer_times(uw: UnitWork, tp: int, hw: Hardware, recompute: bool | str = False
                ) -> list[tuple[float, float]]:
    """(forward, backward) seconds per layer; the last layer carries the projector."""
    out = [work_time(w, tp, hw, recompute) for w in uw.layers]
    for w in uw.extra:
        f, b = work_time(w, 1, hw, recompute)
        out[-1] = (out[-1][0] + f, out[-1][1] + b)
    return out


@dataclass(frozen=True)
class UnitCost:
    """What the orchestrator needs to know about one unit (all per average sample).

    time_s[tp] = C(tp): forward + backward seconds of the whole unit for one sample,
    TP communication included (DistTrain §5.1). Memory terms as planner/memory.py
    `unit_stage_bytes` combines them (`evaluate.memory_bytes`); the defaults of the later
    fields leave the plain weights / optimizer / activations sum."""

    name: str
    num_layers: int
    time_s: dict[int, float]
    weight_bytes: float  # compute copy, fp32 accumulators and frozen weights, cotangents
    optimizer_bytes: float  # ZeRO-1 state of the whole unit (sharded by TP x PP x DP)
    activation_bytes: dict[int, float]  # tp -> kept residuals, one sample, whole unit, per GPU
    boundary_bytes: float  # stage-to-stage tensor for one sample
    grad_bytes: float  # gradient bytes synchronised over DP per iteration (0 if frozen)
    flops: float  # model FLOPs per sample (forward + required backward)
    layer_pp_divides: bool = False  # PP must divide num_layers (the LLM, DistTrain §5.2)
    fwd_s: dict[int, float] = field(default_factory=dict)
    remat: str = "none"  # the runtime's remat policy these times and bytes assume
    input_bytes: float = 0.0  # stage input kept per in-flight microbatch, one sample
    work_bytes: dict[int, float] = field(default_factory=dict)  # tp -> backward rebuilds
    fixed_bytes: dict[int, float] = field(default_factory=dict)  # tp -> score buffers, I/O
    step_weight_bytes: float | None = None  # optimizer step: compute copies, frozen
    replicated: float = 0.0  # fraction of the parameters TP does not split
    dtype_bytes: int = WEIGHT_BYTES  # compute dtype
    # policy -> this unit under that remat policy (none, dots, full): the planner picks per
    # choice the least recompute that fits (evaluate.remat_variant); {}: `remat` only
    variants: dict = field(default_factory=dict, compare=False, repr=False)
    # the orchestrator's in-flight count x this = the runtime's (build.py: an encoder's
    # first stage also holds the LLM's pipeline depth)
    flight_scale: float = 1.0
    # the unit's ZeRO stage (planner/memory.py `zero_terms`; knobs.py `zero_cost` adds its
    # traffic to the times) and its ZeRO group in dp ranks (0: all of a stage's dp ranks)
    zero_stage: int = 1
    zero_group: int = 0
    layer_params: float = 0.0  # one layer's parameters (module_params.layer_params); 0: /
    #                            num_layers of the unit's
    # ZeRO-3 with dp > 1: this cost's activation terms with every layer checkpointed in the
    # gathering scan (knobs.with_zero; memory.scan_checkpoint_acts)
    scan: UnitCost | None = field(default=None, compare=False, repr=False)


def unit_params(cost: UnitCost) -> tuple[float, float]:
    """(trainable, frozen) parameters of the whole unit, from its byte terms."""
    trainable = cost.optimizer_bytes / memory.OPTIMIZER_BYTES
    frozen = ((cost.weight_bytes - (2 * cost.dtype_bytes + memory.ACC_BYTES) * trainable)
              / memory.FROZEN_BYTES)
    return trainable, max(frozen, 0.0)


def _vae_acts(model: MLLMConfig, wl: Workload) -> memory.Acts:
    """Forward-only peak of the VAE unit for one sample: the widest conv's input and output
    at full resolution (fp32), the pixels in and the latents out."""
    v, k, side = model.vae, wl.mean_generated(), vae_side(model)
    assert v is not None and model.generator is not None  # a VAE unit encodes for the generator
    peak = 4.0 * k * side * side * 2 * v.block_out_channels[0] * 2
    latent = 4.0 * k * model.generator.latent_channels * model.generator.latent_size ** 2
    return memory.Acts(0.0, 0.0, peak, latent, 4.0 * k * side * side * 3)


def unit_acts(model: MLLMConfig, wl: Workload, unit: str, tp: int, impl: str | None,
              b: int = ACT_BYTES) -> memory.Acts:
    """planner/memory.py's activation bytes of one average sample through the whole unit
    at `tp`; `impl` None (exact pairs, no [S, S] buffer) is costed as a tiled kernel."""
    if is_vae(unit):
        return _vae_acts(model, wl)
    if is_llm(unit):
        n1, n2 = wl.llm_moments()
        return memory.llm_acts(model.llm, n1, n2, tp, b, impl)
    if is_generator(unit):
        return memory.generator_acts(model.generator, wl.mean_generated(), wl.cond_tokens, tp,
                                     b, cond_dim=model.llm.hidden_size, impl=impl)
    spec = model.encoder(unit)
    c, p = spec.encoder, spec.projector
    n1, n2 = wl.encoder_moments(unit)
    in_dim = c.patch_dim if isinstance(c, VisionConfig) else 2 * c.num_mel_bins
    out = (n1 / p.downsample if p.kind in ("mlp", "patch_merger")
           else p.num_queries * wl.mean_segments(unit))
    return memory.encoder_acts(c, n1, n2, tp, b, impl, in_dim, out, model.llm.hidden_size)


def unit_cost(model: MLLMConfig, wl: Workload, unit: str, hw: Hardware,
              recompute=False, tp_sizes=TP_SIZES, attention_impl=None) -> UnitCost:
    """`recompute`: the unit's remat policy ("none" / "dots" / "full"; a bool: True is
    "full", False "none"), which sets both the backward time and the memory terms."""
    remat = remat_policy(recompute)
    impl = impl_of(attention_impl, unit)
    uw = unit_work(model, wl, unit, attention_impl)
    tps = [t for t in tp_sizes if t <= hw.gpus_per_node and all(s % t == 0 for s in uw.tp_divides)]
    if is_vae(unit):  # runs whole on each device (planner/plan.py `_validate_vae`)
        tps = [1]
    backward = any(w.bwd for w in uw.layers + uw.extra)
    times, fwds, acts, work, fixed = {}, {}, {}, {}, {}
    b = ACT_BYTES
    for t in tps:
        lt = layer_times(uw, t, hw, remat)
        times[t] = sum(f + bb for f, bb in lt)
        fwds[t] = sum(f for f, _ in lt)
        a = unit_acts(model, wl, unit, t, impl, b)
        io = a.input + 2 * a.boundary
        if not backward:  # forward only: nothing kept, one layer's scores at a time
            acts[t], work[t], fixed[t] = 0.0, 0.0, a.scores + io
            continue
        acts[t] = a.kept(remat)
        work[t] = a.recomputed(remat)
        fixed[t] = (memory.SCORE_BUFFERS * a.scores if remat == "none" else 0.0) + io
    flops = sum(w.flops * (1 + w.bwd) for w in uw.layers + uw.extra)
    trainable, frozen = uw.trainable_params, uw.params - uw.trainable_params
    a1 = unit_acts(model, wl, unit, tps[0], impl, b) if tps else None
    return UnitCost(name=unit, num_layers=len(uw.layers), time_s=times,
                    weight_bytes=((2 * b + memory.ACC_BYTES) * trainable
                                  + memory.FROZEN_BYTES * frozen),
                    optimizer_bytes=memory.OPTIMIZER_BYTES * trainable,
                    activation_bytes=acts, boundary_bytes=uw.boundary_bytes,
                    grad_bytes=2.0 * uw.trainable_params, flops=flops,
                    layer_pp_divides=is_llm(unit), fwd_s=fwds, remat=remat,
                    input_bytes=a1.input if (a1 and backward and remat != "none") else 0.0,
                    work_bytes=work, fixed_bytes=fixed,
                    step_weight_bytes=2 * b * trainable + memory.FROZEN_BYTES * frozen,
                    replicated=replicated_params(model, unit) / max(uw.params, 1),
                    dtype_bytes=b,
                    layer_params=0.0 if is_vae(unit) else layer_params(
                        model, unit, uw.params, len(uw.layers)))


def with_remat_variants(model: MLLMConfig, wl: Workload, unit: str, hw: Hardware,
                        attention_impl=None) -> UnitCost:
    """The unit's "none" cost carrying all three policies as `variants` (none, dots, full):
    its times are the fastest, and the planner picks per choice the least recompute that
    fits (DistTrain §5.2 memory constraint; Megatron selective before full recomputation)."""
    costs = {p: unit_cost(model, wl, unit, hw, p, attention_impl=attention_impl)
             for p in memory.REMATS}
    return dataclasses.replace(costs["none"], variants=costs)


def unit_costs(model: MLLMConfig, wl: Workload, hw: Hardware, recompute=False,
               attention_impl=None) -> tuple[UnitCost, ...]:
    """One `UnitCost` per unit, in `model.unit_names` order; `recompute`: one policy for
    every unit, {unit: policy}, or "auto" (each unit with its `with_remat_variants`)."""
    def one(u):
        r = recompute.get(u, False) if isinstance(recompute, dict) else recompute
        if r == "auto":
            return with_remat_variants(model, wl, u, hw, attention_impl)
        return unit_cost(model, wl, u, hw, r, attention_impl=attention_impl)
    return tuple(one(u) for u in model.unit_names)
