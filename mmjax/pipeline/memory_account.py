"""Per-stage device memory of a pipeline step from XLA's own account, and the planner's
prediction of the same stage (planner/memory.py): tests/test_memory_model.py and
scripts/bench_runtime.py compare them.

Compiled side, per stage and device: each program's footprint is XLA's
`memory_analysis()`: argument + output - alias (donated buffers reused) + temp. A phase
adds what the runtime holds outside that program's arguments, read from its arrays: the
forward and backward run beside the master and AdamW shards (and the forward beside the
accumulators) and the residuals of the other in-flight microbatches; the optimizer step
beside the frozen parameters and the compute copy it replaces. The stage's peak is the
largest phase."""
from __future__ import annotations

from typing import Any, cast

import jax
import numpy as np

from mmjax.models.units import UnitRole, is_llm, role
from mmjax.parallel.zero import state_bytes_per_device
from mmjax.planner.memory import encoder_acts, generator_acts, llm_acts, stage_memory


def _footprint(compiled) -> int:
    m = compiled.memory_analysis()
    return (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
            + m.temp_size_in_bytes)


def _device_bytes(tree) -> int:
    per: dict[jax.Device, int] = {}
    for a in jax.tree.leaves(tree):
        for s in a.addressable_shards:
            per[s.device] = per.get(s.device, 0) + s.data.nbytes
    return max(per.values(), default=0)


def _shard_bytes(avals, shardings) -> int:
    return sum(int(np.prod(sh.shard_shape(a.shape))) * np.dtype(a.dtype).itemsize
               for a, sh in zip(jax.tree.leaves(avals), jax.tree.leaves(shardings)))


def in_flight(schedule) -> dict:
    """Per physical stage: the most microbatches whose forward ran and backward has not."""
    out = {}
    for stage, actions in schedule.items():
        live = peak = 0
        for a in actions:
            live += 1 if a.kind == "F" else -1 if a.kind == "B" else 0
            peak = max(peak, live)
        out[stage] = peak
    return out


def compiled_stage(ps, sid, flight: int) -> dict:
    """XLA's account of stage `sid` of a pipelined runner (train/pipelined.py) that has run a
    step."""
    st, opt, state = ps.runtime.stages[sid], ps.optimizers[sid], ps.state.stages[sid]
    fwd = st.fns.lowered("F").compile()
    bwd = st.fns.lowered("B").compile()
    step = opt.lower_step(state.master, state.master, state.opt).compile()
    lowered = st.fns.lowered("F")
    out_avals = lowered.out_info[1].leaves
    res = _shard_bytes(out_avals, fwd.output_shardings[1].leaves)
    master = _device_bytes(state.master)
    adam = state_bytes_per_device(state.opt)
    compute = _device_bytes(state.compute)
    frozen = _device_bytes(st.frozen)
    zeros = st.zeros.lower()  # the accumulators' shapes and shardings (ZeRO-2/3: shards)
    acc = _shard_bytes(zeros.out_info, zeros.compile().output_shardings)
    others = (flight - 1) * res
    phases = {"F": master + adam + acc + others + _footprint(fwd),
              "B": master + adam + others + _footprint(bwd),
              "S": frozen + compute + _footprint(step)}
    return {"residuals": res, "phases": phases, "peak": max(phases.values()),
            "step": _footprint(step), "backward": _footprint(bwd)}


def _count(tree) -> int:
    return sum(int(np.prod(a.shape)) for a in jax.tree.leaves(tree))


def _tp_rank_count(tree, mesh) -> float:
    """Parameters one TP rank holds of `tree` (whole over dp, whatever its ZeRO sharding)."""
    from mmjax.parallel.tensor import state_shardings

    if not jax.tree.leaves(tree):
        return 0.0
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, np.float32), tree)
    return _shard_bytes(abstract, state_shardings(abstract, mesh)) / 4


def predicted_stage(cfg, plan, ps, sid, flight: int, b: int = 4):
    """The planner's `StageMemory` of stage `sid`: parameter counts of the stage, the
    tokens its microbatch carries per device (rows x row length, as the feed pads them),
    its unit's ZeRO stage and group."""
    st, compute = ps.runtime.stages[sid], ps.state.stages[sid].compute
    up = plan.unit(sid.unit)
    start, end = up.stage_layers(sid.index % up.pp, sid.index // up.pp)
    args, _ = st.fns.signatures["F"]
    side = args[3]
    trainable = _tp_rank_count(compute, st.mesh)
    frozen = _tp_rank_count(st.frozen, st.mesh)
    dp, tp = up.dp, up.tp
    L = cfg.num_layers(sid.unit)
    first, last = start == 0, end == L
    kind = role(sid.unit)
    if kind is UnitRole.LLM:
        rows, seq = side["llm"]["tokens"].shape
        enc = sum(int(np.prod(x.shape[:-1])) for x in jax.tree.leaves(args[2])) / dp
        acts = llm_acts(cfg.llm, rows / dp * seq, rows / dp * seq * seq, tp, b, "dense",
                        end - start, first, last, enc)
    elif kind is UnitRole.GENERATOR:
        g = side["gen"]["gen_noise"].shape[0] / dp
        x = args[2]
        if isinstance(x, dict):  # with the VAE unit: {llm: conditioning, vae: latents}
            x = next(v for u, v in x.items() if is_llm(u))
        cond = x.shape[-2] if x is not None else 0
        acts = generator_acts(cfg.generator, g, cond, tp, b, end - start, first, last,
                              cfg.llm.hidden_size, "dense")
    else:
        spec = cfg.encoder(sid.unit)
        key = "patches" if "patches" in side["inputs"] else "features"
        rows, seq = side["inputs"][key].shape[:2]
        pack = side["pack"].shape
        out_tokens = pack[1] * pack[2]
        acts = encoder_acts(spec.encoder, rows / dp * seq, rows / dp * seq * seq, tp, b, "dense",
                            side["inputs"][key].shape[-1], out_tokens, cfg.llm.hidden_size,
                            end - start, first, last)
    return stage_memory(trainable, frozen, acts, up.remat, dp, 1.0, flight, b,
                        *_zero_args(up, st.fns.zero_mesh, trainable, frozen, end - start, b),
                        layers=end - start)


def _zero_args(up, zmesh, trainable: float, frozen: float, layers: int, b: int
               ) -> tuple[int, int | None, float]:
    """`stage_memory`'s (zero, zero_dp, layer) of a stage of `up` on ZeRO mesh `zmesh`:
    one layer's gathered bytes taken as the stage's parameters / its layers."""
    from mmjax.parallel.zero_shards import zero_axes

    if up.zero_stage == 1 or zmesh is None:
        return 1, None, 0.0
    return (up.zero_stage, zero_axes(zmesh)[0],
            (b * trainable + 4 * frozen) / max(layers, 1))


# ---- one stage compiled from shapes alone (the mid-size config: nothing is allocated) ----
def abstract_stage(cfg, up, start: int, end: int, feed, mesh, dtype) -> dict:
    """XLA's account of a middle LLM stage (layers [start, end), input and output the hidden
    states) built as the runtime builds it (`make_stage_fns`, `Zero1Optimizer`, and at
    `up.zero_stage` 2 / 3 the sharded accumulators and compute copy of
    pipeline/stage_setup.py), lowered and compiled on ShapeDtypeStructs carrying the
    runtime's shardings."""
    import jax.numpy as jnp
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P

    from mmjax.parallel.sharded_init import abstract_split
    from mmjax.parallel.zero import Zero1Optimizer
    from mmjax.parallel.zero_shards import zero_shardings
    from mmjax.pipeline.stage import dp_sharding, make_stage_fns, partial_shardings, rank_axes
    from mmjax.pipeline.stage_modules import stage_module
    from mmjax.parallel.tensor import state_shardings

    gd, tr, fr = abstract_split(stage_module, (cfg, "llm", start, end), jax.random.key(0),
                                (nnx.Param, ...), mesh)
    fns = make_stage_fns(cfg, up, gd, "full", dtype, mesh)
    zero, zmesh = fns.zero_stage, cast(jax.sharding.Mesh, fns.zero_mesh)  # a stage on a mesh has one
    on = lambda a, sh, dt=None: jax.ShapeDtypeStruct(a.shape, dt or a.dtype, sharding=sh)
    compute_sh = zero_shardings(tr, zmesh) if zero == 3 else state_shardings(tr, mesh)
    compute = jax.tree.map(lambda a, sh: on(a, sh, dtype), tr, compute_sh)
    if zero == 3:
        fr = jax.tree.map(on, fr, zero_shardings(fr, zmesh))
    place = lambda a: jax.ShapeDtypeStruct(
        np.shape(a), np.asarray(a).dtype,
        sharding=dp_sharding(mesh, np.ndim(a)) if np.ndim(a) else NamedSharding(mesh, P()))
    side = {"llm": feed.llm, "num_tokens": np.float32(1)}
    if cfg.generator is not None:
        side["gen_pack"] = feed.gen_pack
    side = jax.tree.map(place, side)
    rows, seq = feed.llm["tokens"].shape
    x = jax.ShapeDtypeStruct((rows, seq, cfg.llm.hidden_size), dtype,
                             sharding=dp_sharding(mesh, 3))
    key = fns.layout(compute, fr, x, side)
    fwd = fns._forward.lower(compute, fr, x, side, key=key).compile()
    lowered = fns._forward.lower(compute, fr, x, side, key=key)
    y_aval, res_aval = lowered.out_info
    y_sh, res_sh = fwd.output_shardings
    residuals = jax.tree.map(on, res_aval, res_sh)
    dy = jax.ShapeDtypeStruct(y_aval.shape, y_aval.dtype, sharding=y_sh)
    if zero >= 2:  # the accumulators are the ZeRO shards
        acc_sh = zero_shardings(tr, zmesh)
        acc = jax.tree.map(lambda a, sh: on(a, sh, jnp.float32), tr, acc_sh)
    else:
        acc_sh = partial_shardings(tr, mesh)
        acc = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(
            (fns.ranks,) + a.shape, jnp.float32, sharding=sh), tr, acc_sh)
    assert fns._backward is not None  # mode 'full': it has a backward
    bwd = fns._backward.lower(compute, fr, side, residuals, dy, acc).compile()
    opt = Zero1Optimizer(optax.adamw(1e-3), zmesh, tr, clip_norm=1.0, donate=True,
                         compute_dtype=dtype, rank_axes=rank_axes(zmesh), zero_stage=zero)
    master = jax.tree.map(on, tr, opt.master_shardings)
    state = jax.tree.map(on, jax.eval_shape(opt.tx.init, tr), opt.state_shardings)
    step = opt.lower_step(master, master, state).compile()
    per_rank = _shard_bytes(tr, state_shardings(tr, mesh)) / 4
    return {"residuals": _shard_bytes(res_aval, res_sh), "forward": _footprint(fwd),
            "backward": _footprint(bwd), "step": _footprint(step),
            # an analysis on every backend this runs on (None only where XLA has none)
            "forward_temp": cast(Any, fwd.memory_analysis()).temp_size_in_bytes,
            "backward_temp": cast(Any, bwd.memory_analysis()).temp_size_in_bytes,
            "master": _shard_bytes(master, opt.master_shardings),
            "adam": _shard_bytes(state, opt.state_shardings), "trainable": per_rank,
            "compute": _shard_bytes(compute, compute_sh),
            "frozen": _shard_bytes(fr, jax.tree.map(lambda a: a.sharding, fr)),
            "acc": _shard_bytes(acc, acc_sh), "rows": rows, "seq": seq}


def abstract_peak(r: dict, flight: int) -> float:
    """The stage's peak from `abstract_stage`'s account (phases as `compiled_stage`)."""
    others = (flight - 1) * r["residuals"]
    return max(r["master"] + r["adam"] + r["acc"] + others + r["forward"],
               r["master"] + r["adam"] + others + r["backward"],
               r["compute"] + r["frozen"] + r["step"])


def predicted_abstract(cfg, up, r: dict, flight: int, b: int = 4, layers: int = 1):
    """The planner's `StageMemory` of `abstract_stage`'s middle stage of `layers` layers."""
    rows, seq = r["rows"], r["seq"]
    acts = llm_acts(cfg.llm, rows / up.dp * seq, rows / up.dp * seq * seq, up.tp, b, "dense",
                    layers, False, False)
    zdp = up.dp if not up.fsdp_group else up.fsdp_group // (up.tp * up.cp)
    layer = b * r["trainable"] / layers if up.zero_stage == 3 else 0.0
    return stage_memory(r["trainable"], 0, acts, up.remat, up.dp, 1.0, flight, b,
                        up.zero_stage, zdp, layer, layers)
