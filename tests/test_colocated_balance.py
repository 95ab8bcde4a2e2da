"""Per-phase post-balancing that moves real data in the co-located step (OrchMLLM §5-6): the
global batch assembled in each phase's balanced layout (data/colocated_batch.py) and placed
on the co-located mesh (parallel/fsdp.py), the encoder outputs moved to the LLM's layout by
one all-to-all per encoder at the model's `route` seam (parallel/rearrange.py
`phase_route`), give the single-device loss and gradients. The loss is `make_loss_fn` with
the route, which the runner's `colocated_loss_fn` wraps with its ZeRO-3 layer gathers (a
no-op for the whole parameters used here)."""
import jax
import pytest
from flax import nnx

from helpers import assert_same_grads, assert_same_loss, cached_reference, make_cfg
from mmjax.models.mllm import MultimodalModel, trainable_filter
from mmjax.models.tiny import tiny_valm
from mmjax.parallel.fsdp import colocated_mesh, tree_shardings
from mmjax.parallel.phase_inputs import balanced_inputs, colocated_route
from mmjax.parallel.rearrange import TrafficLedger
from mmjax.train.colocated import Colocation, colocated_loss_fn
from mmjax.train.step import make_loss_fn, split_model

pytestmark = pytest.mark.parity  # judged by the float64 rule; CI reruns it under a second XLA config


@pytest.fixture(scope="module")
def setup():
    cfg = make_cfg()
    lay, samples, loss, grads = cached_reference(None, cfg, 8)
    gd, tr, fr = split_model(MultimodalModel(cfg, jax.random.key(0)), trainable_filter(cfg))
    return cfg, lay, samples, loss, grads, gd, tr, fr


def _run(setup, tp: int, policy: str, ranks_per_node: int = 0, ledger=None):
    cfg, lay, samples, _, _, gd, tr, fr = setup
    mesh = colocated_mesh(jax.devices(), Colocation(tp=tp))
    inputs, pb = balanced_inputs(samples, lay, mesh, policy, ranks_per_node=ranks_per_node,
                                 ledger=ledger, row_bytes=4 * cfg.llm.hidden_size)
    loss_fn = make_loss_fn(gd, route=colocated_route(mesh))
    (loss, _), g = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(tr, fr, inputs)
    return pb, float(loss), nnx.to_pure_dict(g)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["none", "sum", "padded", "sum_square", "conv"])
def test_colocated_dp8_each_policy_matches_single_device(setup, policy):
    pb, loss, grads = _run(setup, 1, policy)
    _, _, samples, ref_loss, ref_grads, *_ = setup
    if policy != "none":  # the balanced layouts really move samples between ranks
        assert [list(b) for b in pb.plan.phases["llm"].batches] != [[i] for i in range(8)]
    assert_same_loss(loss, ref_loss)
    assert_same_grads(grads, ref_grads)


@pytest.mark.slow
def test_colocated_llm_dp4_tp2_with_node_wise(setup):
    """Encoders at dp 8, the LLM at dp 4 x tp 2 (every tp replica receives its rows), its
    mini-batches placed node-wise (2 nodes x 4 devices); the ledger counts the exchange's
    bytes."""
    ledger = TrafficLedger(4)
    pb, loss, grads = _run(setup, 2, "sum", ranks_per_node=4, ledger=ledger)
    _, _, _, ref_loss, ref_grads, *_ = setup
    assert pb.plan.phases["llm"].num_ranks == 4 and "perm" in pb.plan.node_wise
    assert sum(ledger.payload.values()) > 0
    assert_same_loss(loss, ref_loss)
    assert_same_grads(grads, ref_grads)


@pytest.fixture(scope="module")
def valm_frozen(reference_cache):
    """tiny_valm with its encoders frozen, its 8-sample reference and split model."""
    base = tiny_valm()
    cfg = make_cfg(tiny_valm, **{f"encoders.{e.name}.frozen": True for e in base.encoders})
    lay, samples, loss, grads = cached_reference(reference_cache, cfg, 8)
    gd, tr, fr = split_model(MultimodalModel(cfg, jax.random.key(0)), trainable_filter(cfg))
    return cfg, lay, samples, loss, grads, gd, tr, fr


@pytest.mark.slow
@pytest.mark.parametrize("tp,policy,rpn", [(1, {"vision": "sum_square", "audio": "conv",
                                                  "llm": "sum"}, 0),
                                           (2, "padded", 4)])
def test_zero3_with_per_phase_balancing_matches_single_device(valm_frozen, tp, policy, rpn):
    """ZeRO-3 (parameters stored sharded, each layer gathered in the layer scan, gradients
    reduce-scattered) with the balanced per-phase layouts and the all-to-all at the route
    seam: the single-device loss and gradients, no gradient for the frozen encoders."""
    cfg, lay, samples, ref_loss, ref_grads, gd, tr, fr = valm_frozen
    colo = Colocation(tp=tp, default_stage=3)
    mesh = colocated_mesh(jax.devices(), colo)
    inputs, pb = balanced_inputs(samples, lay, mesh, policy, ranks_per_node=rpn)
    loaded = [list(range(r * tp, r * tp + tp)) for r in range(8 // tp)]  # "none"'s
    assert [list(b) for b in pb.plan.phases["llm"].batches] != loaded
    tr = jax.device_put(tr, tree_shardings(tr, mesh, colo, "params"))
    fr = jax.device_put(fr, tree_shardings(fr, mesh, colo, "params"))
    grads = tree_shardings(tr, mesh, colo, "grads")
    loss_fn = colocated_loss_fn(gd, mesh, colo, route=colocated_route(mesh))

    def f(tr, fr, b):
        (loss, _), g = jax.value_and_grad(loss_fn, has_aux=True)(tr, fr, b)
        return loss, jax.lax.with_sharding_constraint(g, grads)
    loss, g = jax.jit(f)(tr, fr, inputs)
    assert_same_loss(float(loss), ref_loss)
    g = nnx.to_pure_dict(g)
    assert "encoders" not in g
    assert_same_grads(g, ref_grads)
    dev = jax.devices()[0]  # stage 3: this device holds ~1/8 of the trainable parameters
    held = sum(s.data.nbytes for x in jax.tree.leaves(tr) for s in x.addressable_shards
               if s.device == dev)
    assert held <= sum(x.nbytes for x in jax.tree.leaves(tr)) / 8 * 1.10 + 4096
