"""Encoders at their own tp in the co-located layout (`manual_plan.tp = {"vision": 2, ...}`):
each encoder Megatron-sharded over the innermost tp axes of the mesh and data-parallel over
the rest, its outputs moved to the LLM's ranks (at another tp) by one all-to-all per encoder
(the inverse in the backward), give the single-device loss and gradients (rtol 1e-5, the
parity tests' per-tensor rule, tests/helpers.py) on `tiny` and `tiny_valm`, trainable and
frozen encoders, ZeRO 1-3, every post-balancing policy. The placement checks compile
nothing (default suite); the parity checks are slow."""
import jax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from helpers import (assert_same_grads, assert_same_loss, cached_reference, global_batch,
                     make_cfg)
from mmjax.data.assemble import assemble
from mmjax.data.colocated_batch import plan_phases
from mmjax.models.mllm import MultimodalModel, trainable_filter
from mmjax.models.tiny import tiny, tiny_valm
from mmjax.parallel.fsdp import batch_axes, colocated_mesh, tree_shardings
from mmjax.parallel.phase_inputs import (balanced_inputs, colocated_route, encoder_ranks,
                                         llm_ranks)
from mmjax.parallel.tensor import path_names
from mmjax.train.colocated import colocated_loss_fn
from mmjax.train.colocated_plan import Colocation
from mmjax.train.inputs import model_inputs
from mmjax.train.step import split_model
from test_colocated_parity import colocated_grads, frozen_encoders

pytestmark = pytest.mark.parity  # judged by the float64 rule; CI reruns it under a second XLA config


def _colo(tp: dict, stage: int = 1, group=None) -> Colocation:
    enc = tuple(sorted((u, t) for u, t in tp.items() if u != "llm" and t > 1))
    return Colocation(tp.get("llm", 1), (), stage, group, enc)


def _specs(cfg, colo, what="params"):
    mesh = colocated_mesh(jax.devices(), colo)
    abstract = nnx.state(nnx.eval_shape(lambda: MultimodalModel(cfg, jax.random.key(0))))
    sh = tree_shardings(abstract, mesh, colo, what)
    return {path_names(p): s.spec for p, s in jax.tree_util.tree_flatten_with_path(sh)[0]}


def test_mesh_and_shardings_of_encoder_tp():
    """vision tp 2 inside the LLM's tp 4: the mesh nests "tp" (2) in "tp2" (2); vision's
    blocks are column / row split over "tp", the LLM's over ("tp2", "tp"); each unit's
    batch runs over the other axes; ZeRO-3 shards over the FSDP group less the unit's tp."""
    cfg = make_cfg(tiny_valm)
    colo = _colo({"vision": 2, "llm": 4}, stage=3)
    mesh = colocated_mesh(jax.devices(), colo)
    assert dict(mesh.shape) == {"rep": 1, "fsdp": 2, "tp2": 2, "tp": 2}
    assert batch_axes(mesh, "vision", colo) == ("rep", "fsdp", "tp2")
    assert batch_axes(mesh, "audio", colo) == ("rep", "fsdp", "tp2", "tp")
    assert batch_axes(mesh, "llm", colo) == ("rep", "fsdp")
    assert encoder_ranks(mesh, ["vision", "audio"], colo) == {"vision": 4, "audio": 8}
    assert llm_ranks(mesh, colo) == 2
    spec = _specs(cfg, colo)
    layer = ("encoders", "vision", "layers")
    assert spec[layer + ("q", "kernel")] == P(("fsdp", "tp2"), "tp")
    assert spec[layer + ("fc2", "kernel")] == P("tp", ("fsdp", "tp2"))
    assert spec[("encoders", "audio", "layers", "q", "kernel")] == P(("fsdp", "tp2", "tp"), None)
    wq = [k for k in spec if k[0] == "llm" and k[-1] == "wq"][0]
    assert spec[wq][-1] == ("tp2", "tp")
    whole = _specs(cfg, _colo({"vision": 2}))  # stage 1: only the tp split
    assert whole[layer + ("q", "kernel")] == P(None, "tp")
    assert whole[layer + ("q", "bias")] == P("tp")
    assert whole[layer + ("o", "bias")] == P(None)  # row bias: added after the all-reduce
    assert whole[("projectors", "vision", "fc1", "kernel")] == P(None, None)
    assert whole[wq] == P(None, None)


def test_phase_plan_with_encoder_tp():
    """plan_phases with per-encoder ranks: vision's routes start from its 4 ranks, audio's
    from 8, both end at the LLM's 2; every sample's rows arrive."""
    cfg = make_cfg(tiny_valm)
    lay, samples = global_batch(cfg, 8)
    metas = [lay.rules.meta(s) for s in samples]
    pp = plan_phases(metas, lay, {"vision": 4, "audio": 8}, 2, "sum", devices=8)
    assert pp.routes["vision"].src_ranks == 4 and pp.routes["audio"].src_ranks == 8
    assert {r.dst_ranks for r in pp.routes.values()} == {2}
    assert len(pp.enc_groups["vision"]) == 4 and len(pp.llm_groups) == 2
    for slot in lay.encoders:
        have = sorted(i for g in pp.enc_groups[slot.name] for i in g)
        assert have == [i for i, m in enumerate(metas) if m.count(slot.modality)]


CONFIGS = {"tiny": lambda: make_cfg(tiny), "tiny_frozen": lambda: frozen_encoders(tiny),
           "tiny_valm": lambda: make_cfg(tiny_valm),
           "tiny_valm_frozen": lambda: frozen_encoders(tiny_valm)}


def _check(cfg, loss, grads, ref_loss, ref_grads, stage, group=None):
    assert_same_loss(loss, ref_loss)
    g = nnx.to_pure_dict(grads)
    assert_same_grads(g, ref_grads)
    frozen = all(e.frozen for e in cfg.encoders)
    assert ("encoders" in g) != frozen  # frozen encoders: no gradient at all
    if stage >= 2:  # every shardable gradient sharded over an FSDP group (tp ranks included)
        dev = jax.devices()[0]
        per = sum(s.data.nbytes for x in jax.tree.leaves(grads) for s in x.addressable_shards
                  if s.device == dev)
        full = sum(x.nbytes for x in jax.tree.leaves(grads))
        assert per <= full / (group or 8) * 1.10 + 4096, (per, full)


@pytest.mark.slow
@pytest.mark.parametrize("name,tp,stage", [
    ("tiny", {"vision": 2}, 1),
    ("tiny_frozen", {"vision": 2, "llm": 2}, 2),
    ("tiny", {"vision": 2, "llm": 4}, 3),
    ("tiny_valm", {"vision": 2, "audio": 2, "llm": 4}, 2),
    ("tiny_valm_frozen", {"vision": 2, "llm": 1}, 3),
])
def test_encoder_tp_matches_single_device(name, tp, stage, reference_cache):
    """The loaded mini-batches (no balancing): every encoder's batch over its own dp axes,
    its outputs gathered to the LLM's layout by GSPMD."""
    cfg = CONFIGS[name]()
    lay, samples, ref_loss, ref_grads = cached_reference(reference_cache, cfg, 8)
    colo = _colo(tp, stage)
    loss, grads = colocated_grads(cfg, colo, model_inputs(assemble(samples, lay)))
    _check(cfg, loss, grads, ref_loss, ref_grads, stage)


@pytest.mark.slow
@pytest.mark.parametrize("name,tp,stage,policy,rpn", [
    ("tiny", {"vision": 2, "llm": 4}, 1, "none", 0),
    ("tiny", {"vision": 2}, 2, "sum", 0),
    ("tiny_frozen", {"vision": 2, "llm": 2}, 3, "padded", 0),
    ("tiny", {"vision": 2, "llm": 4}, 3, "sum_square", 0),
    ("tiny", {"vision": 2, "llm": 1}, 1, "conv", 4),
    ("tiny_valm_frozen", {"vision": 2, "audio": 2, "llm": 4}, 3,
     {"vision": "sum_square", "audio": "conv", "llm": "padded"}, 4),
    ("tiny_valm", {"vision": 2, "llm": 2}, 2, {"vision": "conv", "audio": "sum", "llm": "sum"},
     0),
])
def test_encoder_tp_with_balancing_matches_single_device(name, tp, stage, policy, rpn,
                                                         reference_cache):
    """Per-phase balanced layouts: each encoder's outputs leave its tp ranks (one replica
    sends each row) for the LLM's ranks at another tp by one all-to-all, the gradient
    back by the inverse; node-wise placement (2 nodes x 4 devices) where rpn is set."""
    cfg = CONFIGS[name]()
    lay, samples, ref_loss, ref_grads = cached_reference(reference_cache, cfg, 8)
    colo = _colo(tp, stage)
    mesh = colocated_mesh(jax.devices(), colo)
    inputs, pb = balanced_inputs(samples, lay, mesh, policy, ranks_per_node=rpn, colo=colo)
    assert pb.routes["vision"].src_ranks == 8 // tp["vision"]
    assert pb.routes["vision"].dst_ranks == 8 // tp.get("llm", 1)
    if rpn:
        assert "perm" in pb.plan.node_wise, pb.plan.node_wise
    gd, tr, fr = split_model(MultimodalModel(cfg, jax.random.key(0)), trainable_filter(cfg))
    tr = jax.device_put(tr, tree_shardings(tr, mesh, colo, "params"))
    fr = jax.device_put(fr, tree_shardings(fr, mesh, colo, "params"))
    grads = tree_shardings(tr, mesh, colo, "grads")
    loss_fn = colocated_loss_fn(gd, mesh, colo, route=colocated_route(mesh, colo))

    def f(tr, fr, b):
        (loss, _), g = jax.value_and_grad(loss_fn, has_aux=True)(tr, fr, b)
        return loss, jax.lax.with_sharding_constraint(g, grads)
    loss, g = jax.jit(f)(tr, fr, inputs)
    _check(cfg, float(loss), g, ref_loss, ref_grads, stage)
