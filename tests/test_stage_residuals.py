"""Stage residuals (pipeline/stage.py): forward returns the `jax.vjp` residuals, backward
consumes them; the remat policy decides what is kept, and no residual is ever a copy of the
parameters (docs/design.md "Execute the schedule"). Also the Plan knobs that reach the stage
functions: remat, tp_chunks / tp_bidirectional (overlapped TP), cp_head_groups (CP).

Stage-level checks use the last LLM stage with tied embeddings: its logits use the
transposed embedding, which a plain (remat "none") vjp keeps as a residual, and in bf16
every weight's cast would be kept too. Runtime checks compare with the single-device
reference exactly as tests/test_runtime_parity.py does (same helpers and tolerances).
"""
import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mmjax.data.feed import microbatch_feed
from mmjax.pipeline.stage import make_stage_fns
from mmjax.pipeline.stage_modules import apply_llm, build_stage_module
from mmjax.planner.plan import Plan, PlanError, UnitPlan
from float64_reference import in_float64
from helpers import Exact, assert_same_grads, check, global_batch, make_cfg

pytestmark = pytest.mark.parity  # judged by the float64 rule; CI reruns it under a second XLA config

POLICIES = ("full", "dots", "none")


# ---- Plan fields (no JAX work) ----------------------------------------------------------
def test_plan_knobs_validate_and_round_trip(tmp_path):
    cfg = make_cfg()
    plan = Plan.uniform(cfg, 4, 2, cp={"llm": 2}, remat={"llm": "dots", "vision": "none"},
                        cp_head_groups={"llm": 2}, tp_chunks=3, tp_bidirectional=False)
    plan.validate(cfg, 8)
    assert [(u.name, u.remat) for u in plan.units] == [
        ("vision", "none"), ("llm", "dots"), ("generator", "full")]
    assert plan.unit("llm").cp_head_groups == 2 and plan.unit("vision").cp_head_groups == 1
    assert all(u.tp_chunks == 3 and u.tp_bidirectional is False for u in plan.units)
    plan.save(str(tmp_path / "p.json"))
    assert Plan.load(str(tmp_path / "p.json")) == plan
    # JSON written before these fields existed still loads, with the defaults
    old = plan.to_json()
    for u in old["units"]:
        for k in ("remat", "tp_chunks", "tp_bidirectional", "cp_head_groups"):
            del u[k]
    back = Plan.from_json(json.loads(json.dumps(old)))
    assert all((u.remat, u.tp_chunks, u.tp_bidirectional, u.cp_head_groups)
               == ("full", 2, True, 1) for u in back.units)


@pytest.mark.parametrize("field,value,needle", [
    ("remat", "selective", "remat='selective': must be one of ['full', 'dots', 'none']"),
    ("tp_chunks", 0, "tp_chunks=0 must be an int >= 1"),
    ("tp_bidirectional", 1, "tp_bidirectional=1 must be true/false"),
    ("cp_head_groups", 0, "cp_head_groups=0 must be an int >= 1"),
    # tiny llm: 2 kv heads, tp=2 -> 2 % (2 * 2) != 0
    ("cp_head_groups", 2, "tp * cp_head_groups = 4 must divide llm.num_kv_heads=2"),
])
def test_plan_knob_errors_name_the_field(field, value, needle):
    cfg = make_cfg()
    plan = Plan.uniform(cfg, 4, 2, cp={"llm": 2}, tp={"llm": 2})
    units = tuple(dataclasses.replace(u, **{field: value}) if u.name == "llm" else u
                  for u in plan.units)
    with pytest.raises(PlanError, match="Plan.unit\\['llm'\\]") as e:
        dataclasses.replace(plan, units=units).validate(cfg, 8)
    assert needle in str(e.value)


def test_cp_head_groups_only_for_llm():
    cfg = make_cfg()
    plan = Plan.uniform(cfg, 4, 2)
    units = tuple(dataclasses.replace(u, cp_head_groups=2) if u.name == "vision" else u
                  for u in plan.units)
    with pytest.raises(PlanError, match="vision.*cp_head_groups=2: CP head groups are for "
                                        "the llm only"):
        dataclasses.replace(plan, units=units).validate(cfg, 8)


def test_manual_plan_passes_the_knobs():
    from mmjax.train.manual_plan import manual_plan
    cfg = make_cfg()
    plan = manual_plan(global_batch=4, model=cfg, remat={"llm": "none"}, tp_chunks={"llm": 1},
                       tp_bidirectional=False, cp_head_groups={"llm": 2}, cp={"llm": 2}).chosen
    llm = plan.unit("llm")
    assert (llm.remat, llm.tp_chunks, llm.tp_bidirectional, llm.cp_head_groups) == (
        "none", 1, False, 2)
    assert plan.unit("vision").remat == "full"


# ---- one LLM stage ----------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def llm_stage():
    """Last LLM stage (layers 2..3 + final norm + tied head) and one microbatch for it."""
    cfg = make_cfg(**{"llm.tie_embeddings": True})
    lay, samples = global_batch(cfg, 2)
    feed = microbatch_feed(samples, lay, {"vision": 1, "llm": 1, "generator": 1})
    side = jax.tree.map(jnp.asarray, {"llm": feed.llm,
                                      "num_tokens": np.float32(feed.num_target_tokens)})
    gd, tr, fr = nnx.split(build_stage_module(cfg, "llm", jax.random.key(0), 2, 4),
                           nnx.Param, ...)
    b, s = feed.llm["tokens"].shape
    x = jax.random.normal(jax.random.key(1), (b, s, cfg.llm.hidden_size))
    return cfg, gd, tr, fr, x, side


@functools.lru_cache(maxsize=None)
def stage_run(remat, dtype=jnp.float32):
    cfg, gd, tr, fr, x, side = llm_stage()
    fns = make_stage_fns(cfg, UnitPlan("llm", remat=remat), gd, "full", dtype,
                         with_generator=False)
    y, res = fns.forward(tr, fr, x, side)
    # one dp rank: the loss is a per-rank vector [1], the gradients per-rank partials [1, ...]
    assert y.shape == (1,)
    partials, dx = fns.backward(tr, fr, side, res, jnp.ones((1,), jnp.float32),
                                jax.tree.map(lambda a: jnp.zeros((1,) + a.shape, jnp.float32),
                                             tr))
    assert all(g.shape[0] == 1 for g in jax.tree.leaves(partials))
    return fns, y[0], res, jax.tree.map(lambda g: g[0], partials), dx


def test_full_remat_keeps_only_the_stage_input():
    x = llm_stage()[4]
    fns, _, res, _, _ = stage_run("full")
    assert res.nbytes <= x.nbytes + 256, (res.nbytes, x.nbytes)
    lay = fns.layouts[res.key]
    assert lay.recompute and lay.side  # parameters and host inputs are not kept


def test_residual_bytes_order_none_dots_full():
    full, dots, none = (stage_run(p)[2].nbytes for p in POLICIES)
    assert none >= dots >= full and none > full, (none, dots, full)


@pytest.mark.parametrize("remat,dtype", [("full", jnp.float32), ("dots", jnp.float32),
                                         ("none", jnp.float32), ("none", jnp.bfloat16)])
def test_no_parameter_copy_in_residuals(remat, dtype):
    """No residual is a parameter, its transpose (tied LM head) or its compute-dtype cast."""
    _, _, tr, fr, _, _ = llm_stage()
    _, _, res, _, _ = stage_run(remat, dtype)
    params = [np.asarray(p) for p in jax.tree.leaves((tr, fr)) if np.ndim(p) >= 1]
    forms = [f for p in params for f in (p, p.T, np.asarray(jnp.asarray(p).astype(dtype)),
                                         np.asarray(jnp.asarray(p.T).astype(dtype)))]
    for leaf in res.leaves:
        a = np.asarray(leaf)
        for f in forms:
            assert not (a.shape == f.shape and a.dtype == f.dtype
                        and np.array_equal(a.view(np.uint8), f.view(np.uint8))), (
                f"{remat}: residual {a.shape} {a.dtype} is a copy of a parameter")


@functools.lru_cache(maxsize=None)
def plain_vjp():
    """The stage's output, and its parameter and input gradients (as a tests/helpers.py
    `Exact`: float32 and float64) by a plain `jax.vjp` (one jitted program: eagerly, each op
    would compile on its own)."""
    cfg, gd, tr, fr, x, side = llm_stage()

    def value_and_grads(t, f, xx, sd):
        plain = lambda t, xx: apply_llm(cfg, nnx.merge(gd, t, f), xx, sd, jnp.float32,
                                        False, 1)
        y, vjp = jax.vjp(plain, t, xx)
        g, dx = vjp(jnp.ones((), jnp.float32))
        return y, {"params": nnx.to_pure_dict(g), "dx": dx}

    y_ref, g32 = jax.jit(value_and_grads)(tr, fr, x, side)
    _, g64 = in_float64(value_and_grads)(tr, fr, x, side)
    return y_ref, Exact(g32, g64, int(np.prod(x.shape[:2])))


@pytest.mark.parametrize("remat", POLICIES)
def test_stage_backward_matches_plain_vjp(remat):
    y_ref, g_ref = plain_vjp()
    _, y, _, grads, dx = stage_run(remat)
    np.testing.assert_allclose(y, y_ref, rtol=1e-6)
    assert_same_grads({"params": nnx.to_pure_dict(grads), "dx": dx}, g_ref)


def test_bf16_casts_are_recomputed_not_kept():
    """bf16 compute: remat "none" would keep each weight's bf16 cast; the dependence
    analysis marks them parameter-only, so backward recomputes them."""
    fns, _, res, grads, _ = stage_run("none", jnp.bfloat16)
    lay = fns.layouts[res.key]
    _, _, tr, fr, x, side = llm_stage()
    matrices = {tuple(sorted(a.shape)) for a in jax.tree.leaves(tr) if a.ndim == 2}
    n_matrices = sum(a.ndim == 2 for a in jax.tree.leaves(tr))
    leaves = jax.tree.leaves(jax.eval_shape(lambda *a: fns._linearize(*a)[1], tr, fr, x, side))
    cast = lambda a: a.dtype == jnp.bfloat16 and tuple(sorted(a.shape)) in matrices  # noqa: E731
    # every weight matrix's bf16 cast is a residual the backward recomputes ...
    assert sum(cast(leaves[i]) for i in lay.recompute) >= n_matrices
    # ... and none is kept
    assert not any(cast(a) for a in res.leaves)
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))


# ---- runtime parity ---------------------------------------------------------------------


def check_cached(cache, cfg, plan, n=4, kind="laion", packing="pad", cp_method="lpt"):
    """tests/helpers.py `check` with the session's reference cache."""
    return check(cfg, plan, n, kind, packing, cp_method=cp_method, cache=cache)


FROZEN = {"encoders.vision.frozen": True, "llm_frozen": True}


@pytest.mark.parametrize("remat", [{"vision": "dots", "llm": "none", "generator": "dots"},
                                   {"vision": "none", "llm": "dots", "generator": "none"}],
                         ids=["llm-none", "llm-dots"])
def test_remat_policies_parity_frozen_pp2(remat, reference_cache):
    """pp=2 units, a projector-only ("params") stage, frozen LLM stages ("input_only") and a
    trainable generator ("full"), every policy; remat "full" on this plan is
    tests/test_runtime_parity.py::test_frozen_encoder_and_llm_with_trainable_projector."""
    cfg = make_cfg(**FROZEN)
    plan = Plan.uniform(cfg, 4, 2, pp={"vision": 2, "llm": 2}, remat=remat)
    rt = check_cached(reference_cache, cfg, plan)
    modes = {str(s): st.mode for s, st in rt.stages.items()}
    assert modes["vision:1"] == "params" and modes["llm:0"] == "input_only"
    assert {str(s): st.fns.remat for s, st in rt.stages.items()}["llm:1"] == remat["llm"]


@pytest.mark.slow
@pytest.mark.parametrize("chunks,remat", [(1, "dots"), (3, "none")])
def test_overlapped_tp_chunks_unidirectional(chunks, remat, reference_cache):
    """Overlapped TP with 1 and 3 pieces per ring step, one ring direction, under the
    selective and no-remat policies (shard_map + custom_vjp residuals)."""
    cfg = make_cfg()
    plan = Plan.uniform(cfg, 4, 2, tp={"llm": 2}, overlap_tp={"llm": True},
                        tp_chunks={"llm": chunks}, tp_bidirectional={"llm": False},
                        remat={"llm": remat})
    check_cached(reference_cache, cfg, plan, packing="pack")


@pytest.mark.slow
def test_cp_head_groups_2(reference_cache):
    """CP attention gathering K/V in 2 head groups (tiny llm: 2 kv heads, tp=1)."""
    cfg = make_cfg()
    plan = Plan.uniform(cfg, 4, 2, cp={"llm": 2}, cp_head_groups={"llm": 2},
                        remat={"llm": "dots"})
    check_cached(reference_cache, cfg, plan, packing="pack")
