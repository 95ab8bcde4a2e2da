"""Plan-independent training state: every trainable array and its optimizer moments named by
its place in the whole model ("params.llm.layers.3.attn.q.kernel", "opt.mu.llm.layers.3...",
"opt.count"), in its logical (unsharded, un-staged) shape.

The single-program state and a pipeline plan's per-stage state (layers numbered within the
stage, optimizer state ZeRO-1 sharded) map to the same names and shapes, so a checkpoint
written under one plan restores under any other: orbax reads each named array straight into
the sharding the new run's leaf has (resharding on read). Frozen parameters are not part of
it: they are rebuilt from the seed or the pretrained weights, exactly as at the start.
"""
from __future__ import annotations

from typing import Any

import jax
from jax.tree_util import DictKey, GetAttrKey, SequenceKey

from mmjax.models.units import is_encoder
from mmjax.train.state import WHOLE_MODEL, StageState


def path_keys(path) -> list:
    """A pytree path as plain keys, nnx's `.value` wrapper dropped."""
    out = []
    for k in path:
        if isinstance(k, DictKey):
            out.append(k.key)
        elif isinstance(k, SequenceKey):
            out.append(k.idx)
        elif isinstance(k, GetAttrKey):
            if k.name != "value":
                out.append(k.name)
        else:
            out.append(str(k))
    return out


def _join(keys) -> str:
    return ".".join(str(k) for k in keys)


def _opt_names(opt_state, param_name) -> list[str]:
    """Names of the optimizer-state leaves: "opt.<field>.<param name>" for per-parameter
    fields (Adam's mu, nu), "opt.<field>" for scalars (counts), the chain position dropped
    (the single program chains clipping in front, the pipeline clips outside). Repeated
    scalar names get "#k" in order."""
    names: list[str] = []
    seen: dict[str, int] = {}
    for path, _ in jax.tree_util.tree_flatten_with_path(opt_state)[0]:
        keys = path_keys(path)
        first = next((i for i, k in enumerate(keys) if isinstance(k, str)), len(keys))
        field, rest = keys[first:first + 1], keys[first + 1:]
        name = "opt." + _join(field) + ("." + param_name(rest) if rest else "")
        if name in seen:
            seen[name] += 1
            name = f"{name}#{seen[name]}"
        else:
            seen[name] = 0
        names.append(name)
    return names


def _named(tree, names) -> dict:
    leaves = jax.tree.leaves(tree)
    if len(leaves) != len(names) or len(set(names)) != len(names):
        raise RuntimeError("internal: state leaves and logical names do not pair up")
    return dict(zip(names, leaves))


def _rebuild(like, names, arrays: dict):
    return jax.tree.unflatten(jax.tree.structure(like), [arrays[n] for n in names])


# ---- single program: TrainState({WHOLE_MODEL: StageState(trainable, opt)}, step) -----------

def _single_names(stage):
    params = [_join(path_keys(p)) for p, _ in jax.tree_util.tree_flatten_with_path(
        stage.master)[0]]
    return ["params." + n for n in params], _opt_names(stage.opt, _join)


def single_logical(state) -> dict:
    """The single program's TrainState -> {name: array} (trainable parameters, optimizer
    state)."""
    stage = state.stages[WHOLE_MODEL]
    params, opt = _single_names(stage)
    return {**_named(stage.master, params), **_named(stage.opt, opt)}


def single_from_logical(like, arrays: dict):
    """{name: array} (as `single_logical(like)` names them) -> a TrainState like `like`;
    its step (applied steps) is the optimizer's count, which only applied steps advance."""
    stage = like.stages[WHOLE_MODEL]
    params, opt = _single_names(stage)
    step = arrays.get("opt.count", like.step)  # a copy: the step donates both buffers
    return like._replace(
        step=jax.numpy.array(step, like.step.dtype, copy=True),
        stages={WHOLE_MODEL: StageState(_rebuild(stage.master, params, arrays),
                                        _rebuild(stage.opt, opt, arrays))})


# ---- pipeline: per stage trainable + ZeRO-1 optimizer state ----------------------------------

def stage_param_name(plan, sid, keys) -> str:
    """A stage's parameter path -> its name in the whole model (what
    the parity tests' to_reference_layout does to trees): the unit prefix for the LLM and the
    generator, and layer numbers offset by the stage's first layer."""
    u = plan.unit(sid.unit)
    start, _ = u.stage_layers(sid.index % u.pp, sid.index // u.pp)
    keys = list(keys)
    if not is_encoder(sid.unit):
        keys = [sid.unit] + keys
        at: int | None = 1
    else:
        at = 2 if keys[:2] == ["encoders", sid.unit] else None
    if at is not None and len(keys) > at + 1 and keys[at] == "layers":
        keys[at + 1] = int(keys[at + 1]) + start
    return _join(keys)


def _stage_names(plan, sid, params, opt_state):
    name = lambda keys: stage_param_name(plan, sid, keys)
    pn = ["params." + name(path_keys(p))
          for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    return pn, _opt_names(opt_state, name)


def _stage_logical(plan, sid, params, opt_state, out: dict) -> None:
    """Add one stage's parameters and optimizer state to `out` by name; scalars shared by
    every stage (the optimizer counts) are taken from the first stage: every stage holds the
    same value (all stages update, or skip, together)."""
    pn, on = _stage_names(plan, sid, params, opt_state)
    out.update(_named(params, pn))
    for n, leaf in _named(opt_state, on).items():
        out.setdefault(n, leaf)


def pipeline_logical(plan, stages: dict) -> dict:
    """{StageId: StageState} (train/state.py) -> {name: array}: the trained stages' master
    parameters and ZeRO-1 optimizer state."""
    out: dict[str, Any] = {}
    for sid, st in stages.items():
        _stage_logical(plan, sid, st.master, st.opt, out)
    return out


def pipeline_from_logical(plan, stages: dict, arrays: dict) -> dict:
    """{name: array} (on the shardings of `pipeline_logical(plan, stages)`) -> {StageId:
    (master, optimizer state)} shaped like `stages`; shared scalars are copied onto each
    stage's own devices."""
    out = {}
    for sid, st in stages.items():
        pn, on = _stage_names(plan, sid, st.master, st.opt)
        opt = [jax.device_put(arrays[n], x.sharding)
               for n, x in zip(on, jax.tree.leaves(st.opt))]
        out[sid] = (_rebuild(st.master, pn, arrays),
                    jax.tree.unflatten(jax.tree.structure(st.opt), opt))
    return out


# ---- multi-process: the same names on every process ------------------------------------------

def _no_shards(shape, dtype, sharding):
    """A global array of `shape` on `sharding` whose devices are all in other processes: this
    process holds no shard of it (what it contributes to a multi-host save: nothing)."""
    return jax.make_array_from_single_device_arrays(tuple(shape), sharding, [], dtype=dtype)


def remote_stage(tx, zero_mesh, abstract):
    """A stage with no device in this process (its ZeRO mesh, its parameters' `abstract`
    shapes and shardings): its parameters and ZeRO-1 state as global arrays without local
    shards, on the shardings the owning processes use."""
    from mmjax.parallel.zero import Zero1Optimizer

    opt = Zero1Optimizer(tx, zero_mesh, abstract)  # its FSDP groups
    if not opt.has_state:
        import optax

        params = jax.tree.map(lambda a: _no_shards(a.shape, a.dtype, a.sharding),
                              abstract)
        return params, optax.EmptyState()
    # the owners keep the fp32 master weights as ZeRO-1 shards: the same sharding here
    params = jax.tree.map(lambda a, sh: _no_shards(a.shape, a.dtype, sh), abstract,
                          opt.master_shardings)
    shapes = jax.eval_shape(tx.init, jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), abstract))
    return params, jax.tree.map(lambda a, sh: _no_shards(a.shape, a.dtype, sh), shapes,
                                opt.state_shardings)


def pipeline_global_logical(plan, stages: dict, trained: list, remote) -> dict:
    """`pipeline_logical` with every stage in `trained` (the plan's trained stages, in the
    same order on every process), also those held by other processes (`remote(sid)` ->
    (params, optimizer state) as arrays without local shards): the same names, shapes and
    shardings on every process, as a multi-host orbax save and restore need."""
    if jax.process_count() == 1:
        return pipeline_logical(plan, stages)
    out: dict[str, Any] = {}
    for sid in trained:
        params, opt_state = ((stages[sid].master, stages[sid].opt) if sid in stages
                             else remote(sid))
        _stage_logical(plan, sid, params, opt_state, out)
    return out


def restore_target(named: dict) -> dict:
    """What to restore a multi-process run's state into: scalars (the optimizer counts, one
    name for every stage) as host values, copied onto each local stage's devices by
    `pipeline_from_logical`; every other array on its own sharding."""
    if jax.process_count() == 1:
        return named
    import numpy as np

    return {n: np.zeros((), x.dtype) if not x.shape else x for n, x in named.items()}
