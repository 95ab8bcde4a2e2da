"""pipeline/flat_calls.py: a stage's programs called on flat leaf lists (the runtime's
dispatch path) give the tree calls' results bit for bit, and record the same residual-layout
keys and argument signatures."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mmjax.pipeline.flat_calls import Flat, FlatCalls
from mmjax.pipeline.stage import make_stage_fns
from mmjax.planner.plan import UnitPlan
from test_stage_residuals import llm_stage, stage_run


def _zeros(tr):
    return jax.tree.map(lambda a: jnp.zeros((1,) + a.shape, jnp.float32), tr)


def _aval(s):
    return (s.shape, s.dtype) if hasattr(s, "shape") else s  # the layout key: an int


def _same(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb) > 0
    for x, y in zip(la, lb):
        assert x.dtype == y.dtype and np.array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture(scope="module")
def both():
    """(tree results, flat results) of two microbatches' forward and backward through one
    stage, each path on its own StageFns: the tree path's programs are
    tests/test_stage_residuals.py's (compiled once per process)."""
    cfg, gd, tr, fr, x, side = llm_stage()
    xs = (x, x * 0.5)
    fns = stage_run("dots")[0]
    flat_fns = make_stage_fns(cfg, UnitPlan("llm", remat="dots"), gd, "full", jnp.float32,
                              with_generator=False)
    calls = FlatCalls(flat_fns)
    params, frozen, flat_acc, acc = Flat.of(tr), Flat.of(fr), Flat.of(_zeros(tr)), _zeros(tr)
    out: tuple = ([], [], [], []), ([], [], [], [])
    for xi in xs:
        y, res = fns.forward(tr, fr, xi, side)
        acc, dx = fns.backward(tr, fr, side, res, jnp.ones((1,)), acc)
        fy, fres = calls.forward(params, frozen, xi, side)
        leaves, fdx = calls.backward(params, frozen, side, fres, jnp.ones((1,)), flat_acc)
        flat_acc = Flat(leaves, flat_acc.treedef)
        for rows, vals in zip(out, ((y, res.leaves, dx, acc), (fy, fres.leaves, fdx,
                                                               flat_acc.tree()))):
            for r, v in zip(rows, vals):
                r.append(jax.tree.map(np.asarray, v))  # before the next call donates it
    return out, fns, flat_fns


def test_flat_calls_match_the_tree_calls_bit_for_bit(both):
    tree, flat = both[0]
    for a, b in zip(tree, flat):  # outputs, residuals, input cotangents, accumulators
        _same(a, b)
    assert jax.tree.structure(tree[3][-1]) == jax.tree.structure(flat[3][-1])
    assert not np.array_equal(*(jax.tree.leaves(a)[0] for a in tree[3]))  # it accumulates


def test_flat_calls_record_the_tree_calls_signatures(both):
    _, fns, ffns = both
    assert fns.signatures["F"][1] == ffns.signatures["F"][1] == 0  # one layout, one key
    for kind in ("F", "B"):
        a, b = fns.signatures[kind], ffns.signatures[kind]
        assert jax.tree.structure(a) == jax.tree.structure(b)
        assert [_aval(s) for s in jax.tree.leaves(a)] == [_aval(s) for s in jax.tree.leaves(b)]
    assert "dot" in ffns.lowered("B").as_text()  # HLO inspection reads the same records
