"""Per-phase post-balancing that moves real data in the co-located step (OrchMLLM §5-6): the
global batch assembled in each phase's balanced layout (data/colocated_batch.py) and placed
on the co-located mesh (parallel/fsdp.py), the encoder outputs moved to the LLM's layout by
one all-to-all per encoder at the model's `route` seam (parallel/rearrange.py
`phase_route`), give the single-device loss and gradients. The loss is `make_loss_fn` with
the route, which the runner's `colocated_loss_fn` wraps with its ZeRO-3 layer gathers (a
no-op for the whole parameters used here)."""
import jax
import numpy as np
import pytest
from flax import nnx

from helpers import assert_same_grads, cached_reference, make_cfg
from mmjax.models.mllm import MultimodalModel, trainable_filter
from mmjax.parallel.fsdp import colocated_mesh
from mmjax.parallel.phase_inputs import balanced_inputs, colocated_route
from mmjax.parallel.rearrange import TrafficLedger
from mmjax.train.colocated import Colocation
from mmjax.train.step import make_loss_fn, split_model


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
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
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
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert_same_grads(grads, ref_grads)
