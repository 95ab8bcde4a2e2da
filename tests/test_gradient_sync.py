"""One gradient sync per step: each dp rank (each dp x cp rank of a CP stage) accumulates its
own partial gradients over the step's microbatches, then one reduce-scatter per stage into
the ZeRO-1 shards and one program with the AdamW update and the all-gather of the compute
params. Checked on the compiled programs (collective counts), the dispatch log, the live
arrays' shard sizes, and numerically against the replicated ZeRO-1 update and the
single-device reference."""
from __future__ import annotations

import re
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from helpers import check, global_batch, make_cfg
from mmjax.data.feed import microbatch_feed
from mmjax.models.llm import LLM
from mmjax.models.tiny import TINY_LLM
from mmjax.parallel.tensor import shard_state
from zero1_legacy import Zero1Reference
from mmjax.planner.plan import Plan
from mmjax.train.optimizer import OptimizerSettings, make_optimizer
from mmjax.train.pipelined import PipelinedRunner

pytestmark = pytest.mark.parity  # judged by the float64 rule; CI reruns it under a second XLA config

_COLLECTIVE = re.compile(r"\b(all-reduce|reduce-scatter|all-gather|all-to-all|"
                         r"collective-permute)(-start)?\(")


def _collectives(hlo: str) -> Counter:
    return Counter(m.group(1) for m in _COLLECTIVE.finditer(hlo))


def _grads(params, seed):
    leaves, tree = jax.tree.flatten(params)
    ks = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(tree, [0.1 * jax.random.normal(k, x.shape)
                                     for k, x in zip(ks, leaves)])


@pytest.mark.parametrize("shape,names,rank_axes", [((2, 2), ("dp", "tp"), ("dp",)),
                                                   ((2, 2, 2), ("dp", "cp", "tp"), ("dp",)),
                                                   ((2, 2, 2), ("dp", "cp", "tp"), ("dp", "cp")),
                                                   ((1, 2, 2), ("dp", "cp", "tp"), ("dp", "cp")),
                                                   ((4, 1), ("dp", "tp"), ("dp",))])
def test_sync_and_step_equal_the_replicated_update(shape, names, rank_axes):
    """`sync` (one flat reduce-scatter of per-rank partials blocked over 'dp', or over
    ('dp', 'cp') for a CP stage's per-(dp, cp) partials) + `step` (AdamW on the master
    shards + one flat all-gather) == `update` on the summed grads."""
    params = nnx.state(LLM(TINY_LLM, jax.random.key(5), 0, 2), nnx.Param)
    mesh = Mesh(np.array(jax.devices()[:int(np.prod(shape))]).reshape(shape), names)
    p = shard_state(params, mesh)
    tx = make_optimizer(1e-2, weight_decay=0.01, clip_norm=0)
    opt = Zero1Reference(tx, mesh, p, clip_norm=1.0, rank_axes=rank_axes)
    s = opt.init(p)
    dp = int(np.prod([mesh.shape[a] for a in rank_axes]))  # the partials' ranks
    parts = [_grads(params, 10 + r) for r in range(dp)]
    partial = jax.device_put(jax.tree.map(lambda *g: jnp.stack(g), *parts),
                             opt.rank_partial_shardings)
    shards, sq = opt.sync(partial)
    summed = jax.tree.map(lambda *g: sum(g), *parts)
    for g, want, spec in zip(jax.tree.leaves(shards), jax.tree.leaves(summed),
                             jax.tree.leaves(opt.shard_specs, is_leaf=lambda x: isinstance(x, P))):
        assert g.sharding.spec == spec
        np.testing.assert_allclose(np.asarray(g), np.asarray(want), rtol=1e-6, atol=1e-7)
    norm = np.sqrt(float(np.sum(np.asarray(sq))))
    np.testing.assert_allclose(norm, optax.tree.norm(summed), rtol=1e-6)
    master = jax.device_put(p, opt.master_shardings)
    got_m, got_s, compute = opt.step(master, shards, s, norm)
    want_p, want_s = opt.update(p, shard_state(summed, mesh), s, norm)
    for a, b in zip(jax.tree.leaves((got_m, got_s)), jax.tree.leaves((want_p, want_s))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=0)
    for c, m, sh in zip(jax.tree.leaves(compute), jax.tree.leaves(got_m),
                        jax.tree.leaves(opt.param_shardings)):
        np.testing.assert_array_equal(np.asarray(c), np.asarray(m))  # the exact gather
        assert c.sharding.is_equivalent_to(sh, c.ndim)
    # one flat reduce-scatter (+ one all-reduce for leaves with no dp-divisible dimension)
    unsplit = sum(opt._split_dim(sp, len(a.shape)) is None for sp, a in zip(
        jax.tree.leaves(opt.shard_specs, is_leaf=lambda x: isinstance(x, P)),
        jax.tree.leaves(p)))
    rs = _collectives(opt._sync.lower(partial).compile().as_text())
    assert rs == Counter({"reduce-scatter": 1, **({"all-reduce": 1} if unsplit else {})}), rs
    up = _collectives(opt.lower_step(master, shards, s).compile().as_text())
    assert up == Counter({"all-gather": 1}), up


def _step(m: int):
    cfg = make_cfg()
    lay, samples = global_batch(cfg, 8)
    plan = Plan.uniform(cfg, 8, m, dp={"vision": 2, "llm": 2, "generator": 2})
    ps = PipelinedRunner(cfg, plan, 1e-2, settings=OptimizerSettings(clip_norm=1.0))
    n, dp = plan.microbatch_size, {u.name: u.dp for u in plan.units}
    feeds = [microbatch_feed(samples[k * n:(k + 1) * n], lay, dp) for k in range(m)]
    calls = dict(ps.runtime.backward_calls)
    out = ps.train_on(feeds)
    assert np.isfinite(out.loss) and out.nonfinite == 0.0
    return ps, calls


@pytest.fixture(scope="module")
def steps():
    return {m: _step(m) for m in (2, 4)}


@pytest.mark.slow
def test_one_reduce_scatter_and_one_all_gather_per_stage_per_step(steps):
    """m=2 vs m=4 microbatches: the forward/backward programs (run m times) hold no
    collective at all; per stage per step the dispatch log has exactly one sync program
    (one reduce-scatter) and one update program (one all-gather), whatever m."""
    per_m = {}
    for m, (ps, calls0) in steps.items():
        log = Counter(ps.dispatch_log)
        assert set(ps.optimizers) and all(ps.runtime.stages[s].dp == 2 for s in ps.optimizers)
        for sid, st in ps.runtime.stages.items():
            if sid in ps.optimizers:
                assert log[(sid, "reduce_scatter")] == 1 and log[(sid, "update_all_gather")] == 1
                assert ps.runtime.backward_calls[sid] - calls0[sid] == m  # m microbatch backwards ...
            for kind in ("F", "B") if st.mode.param_grads or st.mode.input_grads else ("F",):
                hlo = st.fns.lowered(kind).compile().as_text()
                assert _collectives(hlo) == Counter(), (sid, kind, _collectives(hlo))
        assert len(ps.dispatch_log) == 2 * len(ps.optimizers)
        per_m[m] = {}
        for sid, opt in ps.optimizers.items():  # ... and one sync + one update program
            partial = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct((2,) + a.shape,
                                                                      jnp.float32, sharding=sh),
                                   ps.state.stages[sid].master, opt.rank_partial_shardings)
            rs = _collectives(opt._sync.lower(partial).compile().as_text())
            master = ps.state.stages[sid].master
            up = _collectives(opt.lower_step(master, master, ps.state.stages[sid].opt)
                              .compile().as_text())
            assert rs["reduce-scatter"] == 1 and set(rs) <= {"reduce-scatter", "all-reduce"}
            assert up == Counter({"all-gather": 1}), up
            per_m[m][str(sid)] = (rs, up)
    assert per_m[2] == per_m[4]


@pytest.mark.slow
def test_master_weights_and_moments_live_as_one_dp_shard(steps):
    """dp=2: each device holds ~1/2 of the stage's fp32 master weights and Adam moments
    (live arrays' addressable shards); the compute copy stays whole (replicated over dp)."""
    ps, _ = steps[2]
    for sid, opt in ps.optimizers.items():
        st = ps.state.stages[sid]
        full = sum(a.nbytes for a in jax.tree.leaves(st.master))
        unsplit = sum(a.nbytes for a, spec in zip(
            jax.tree.leaves(st.master),
            jax.tree.leaves(opt.shard_specs, is_leaf=lambda x: isinstance(x, P)))
            if opt._split_dim(spec, a.ndim) is None)

        def per_device(tree):
            out = Counter()
            for a in jax.tree.leaves(tree):
                if isinstance(a, jax.Array):
                    for sh in a.addressable_shards:
                        out[sh.device] += sh.data.nbytes
            return out

        master = per_device(st.master)
        moments = per_device(ps.state.stages[sid].opt)
        compute = per_device(st.compute)
        assert len(master) == 2 and len(compute) == 2
        for dev in master:
            assert master[dev] == (full - unsplit) // 2 + unsplit, (sid, master[dev], full)
            assert master[dev] <= 0.55 * full
            assert moments[dev] <= 2 * (0.55 * full) + 64  # mu and nu (+ counters)
            assert compute[dev] == full


@pytest.mark.slow
def test_each_stage_syncs_right_after_its_last_backward(steps):
    """The reduce-scatter of a stage is dispatched as soon as its own backwards are, while
    upstream stages still have backwards to run (DAG order: generator, LLM, vision)."""
    for m, (ps, calls0) in steps.items():
        total = sum(n - calls0[sid] for sid, n in ps.runtime.backward_calls.items())
        after = {sid.unit: n for sid, n in ps.sync_after.items()}
        assert set(after) == {"vision", "llm", "generator"}
        assert after["generator"] < after["llm"] < total, (m, after, total)
        assert after["vision"] == total  # the last unit to finish its backwards
        gen = next(s for s in ps.runtime.stages if s.unit == "generator")
        assert after["generator"] >= ps.runtime.backward_calls[gen] - calls0[gen] == m


# ---- context parallelism: the gradients reduce over dp x cp once per step -------------------
_RESULT = re.compile(r"= (\(.*?\)|\S+) (all-reduce|reduce-scatter|all-gather)(-start)?\(")


def _typed(hlo: str) -> list[tuple[str, str]]:
    """(collective, result type) of every all-reduce / reduce-scatter / all-gather."""
    return [(m.group(2), m.group(1)) for m in _RESULT.finditer(hlo)]


def _dims(t: str) -> list[list[int]]:
    """The dimensions of each array of an HLO result type (one, or several for a tuple)."""
    return [[int(d) for d in ds.split(",") if d] for ds in re.findall(r"\w+\[([\d,]*)\]", t)]


_CP_LAYOUTS = {"dp2_cp2": dict(dp={"vision": 2, "llm": 2, "generator": 2}, cp={"llm": 2}),
               "dp1_cp2_pp2": dict(cp={"llm": 2}, pp={"llm": 2})}


def _cp_plan(cfg, m: int, layout: str = "dp2_cp2") -> Plan:
    return Plan.uniform(cfg, 8, m, **_CP_LAYOUTS[layout])


def _cp_step(m: int, layout: str):
    cfg = make_cfg()
    lay, samples = global_batch(cfg, 8, packing="pack")
    plan = _cp_plan(cfg, m, layout)
    ps = PipelinedRunner(cfg, plan, 1e-2, settings=OptimizerSettings(clip_norm=1.0))
    n, dp = plan.microbatch_size, {u.name: u.dp for u in plan.units}
    feeds = [microbatch_feed(samples[k * n:(k + 1) * n], lay, dp, cp=2, cp_method="lpt",
                             cp_block=16) for k in range(m)]
    calls = dict(ps.runtime.backward_calls)
    out = ps.train_on(feeds)
    assert np.isfinite(out.loss) and out.nonfinite == 0.0
    return ps, calls, cfg


@pytest.mark.parametrize("layout", ["dp2_cp2", pytest.param("dp1_cp2_pp2",
                                                         marks=pytest.mark.slow)])
def test_cp_stage_keeps_per_cp_rank_partials_and_matches_the_reference(layout, reference_cache):
    """LLM on ('dp','cp','tp') = (2, 2, 1), or (1, 2, 1) over 2 pipeline stages: each stage
    vmaps over dp x cp ranks with per-(dp, cp) parameter copies; the summed partials give
    the reference's loss and gradients (rtol 1e-5)."""
    cfg = make_cfg()
    plan = _cp_plan(cfg, 2, layout)
    rt = check(cfg, plan, n=8, packing="pack", cache=reference_cache)
    llm = [st for sid, st in rt.stages.items() if sid.unit == "llm"]
    dp = plan.unit("llm").dp
    assert len(llm) == plan.unit("llm").pp
    assert all(st.fns.cp == 2 and st.fns.ranks == 2 * dp for st in llm)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(_CP_LAYOUTS))
def test_cp_stage_reduces_its_gradients_once_per_step_over_dp_x_cp(layout):
    """No microbatch program of a cp=2 LLM stage reduces parameter gradients: the backward's
    only reductions are the reduce-scatters transposing Cornstarch's K/V all-gathers (§5.3;
    one per layer and head group, local K/V shapes [.., L, kv, head_dim]) and, on the first
    stage, the all-reduce of the encoder features' cotangent (an activation, replicated over
    cp); the forward's are the loss scalar and hidden states (the generator's conditioning).
    (A GSPMD stage instead all-reduced every parameter gradient over cp: one combined,
    tuple-typed all-reduce per microbatch.) Per step the dispatch log has one sync program,
    whose one reduce-scatter spans dp x cp devices, and one update program (one
    all-gather), the same for m = 2 and m = 4."""
    per_m = {}
    for m in (2, 4):
        ps, calls0, cfg = _cp_step(m, layout)
        log = Counter(ps.dispatch_log)
        up = ps.runtime.plan.unit("llm")
        hidden, head_dim = cfg.llm.hidden_size, cfg.llm.hidden_size // cfg.llm.num_heads
        llm = {sid: st for sid, st in ps.runtime.stages.items() if sid.unit == "llm"}
        assert len(llm) == up.pp and all(sid in ps.optimizers for sid in llm)
        for sid, st in llm.items():
            assert log[(sid, "reduce_scatter")] == 1 and log[(sid, "update_all_gather")] == 1
            assert ps.runtime.backward_calls[sid] - calls0[sid] == m
            layers = len(range(*up.stage_layers(sid.index % up.pp, sid.index // up.pp)))
            kv_gathers = layers * up.cp_head_groups
            fwd = _typed(st.fns.lowered("F").compile().as_text())
            bwd = _typed(st.fns.lowered("B").compile().as_text())
            # K/V all-gathers [.., kv heads, head_dim], one per layer and head group; the
            # other float ones gather hidden states over cp (the stage output), the int ones
            # token metadata
            for hlo in (fwd, bwd):
                floats = [_dims(t)[0][-1] for c, t in hlo
                          if c == "all-gather" and t.startswith("f32")]
                assert floats.count(head_dim) == kv_gathers, (sid, hlo)
                assert set(floats) <= {head_dim, hidden}, (sid, hlo)
            reductions = [(c, d) for c, t in fwd if c != "all-gather" for d in _dims(t)]
            assert all(c == "all-reduce" and (np.prod(d) == 1 or d[-1] == hidden)
                       for c, d in reductions), (sid, fwd)
            scatters = [t for c, t in bwd if c == "reduce-scatter"]
            assert len(scatters) == kv_gathers, (sid, bwd)
            assert all(len(_dims(t)) == 1 and _dims(t)[0][-1] == head_dim
                       for t in scatters), (sid, bwd)
            reduces = [t for c, t in bwd if c == "all-reduce"]
            if sid.index == 0:  # d(encoder features): [part of a dp rank's tokens, hidden]
                x = st.fns.layouts[st.fns.signatures["B"][3].key].x_shapes["vision"]
                assert len(reduces) == 1 and len(_dims(reduces[0])) == 1, (sid, reduces)
                d = _dims(reduces[0])[0]
                assert d[-1] == hidden and np.prod(d) <= np.prod(x.shape) // up.dp, (d, x)
            else:
                assert reduces == [], (sid, reduces)
        per_m[m] = {}
        for sid, st in llm.items():
            opt = ps.optimizers[sid]
            partial = jax.tree.map(
                lambda a, sh: jax.ShapeDtypeStruct((st.fns.ranks,) + a.shape, jnp.float32,
                                                   sharding=sh),
                ps.state.stages[sid].master, opt.rank_partial_shardings)
            sync_hlo = opt._sync.lower(partial).compile().as_text()
            rs = _collectives(sync_hlo)
            assert rs["reduce-scatter"] == 1 and set(rs) <= {"reduce-scatter", "all-reduce"}, rs
            groups = re.search(r"reduce-scatter\([^\n]*replica_groups=(\S+)", sync_hlo).group(1)
            assert _replica_group_size(groups) == up.dp * up.cp == st.fns.ranks, groups
            state = ps.state.stages[sid]
            upd = _collectives(opt.lower_step(state.master, state.master, state.opt)
                               .compile().as_text())
            assert upd == Counter({"all-gather": 1}), upd
            per_m[m][str(sid)] = (rs, upd)
    assert per_m[2] == per_m[4]


def _replica_group_size(groups: str) -> int:
    """Devices per replica group of an HLO `replica_groups=` value ({{0,1,2,3}} or the
    iota form [G,S]<=[N])."""
    if groups.startswith("{"):
        return len(re.match(r"\{\{([\d,]*)\}", groups).group(1).split(","))
    return int(re.match(r"\[\d+,(\d+)\]", groups).group(1))
