"""The co-located step with the ragged exchange (`kind="ragged"`, GPU), lowered for CUDA from
this CPU host (XLA:CPU cannot run it): the tiny model's loss and gradients over 8 devices
read as 2 nodes of 4, per encoder one ragged all-to-all forward and one backward at the
tables' bucketed buffers, and no other collective in the route's scopes."""
import jax
import pytest

from helpers import global_batch, make_cfg
from mmjax.models.mllm import MultimodalModel, trainable_filter
from mmjax.parallel.fsdp import colocated_mesh
from mmjax.parallel.phase_inputs import balanced_inputs, colocated_route
from mmjax.parallel.hlo_traffic import ragged_operands
from mmjax.parallel.rearrange import BACKWARD_SCOPE, FORWARD_SCOPE, ROUTE_KEY
from mmjax.train.colocated import Colocation
from mmjax.train.step import make_loss_fn, split_model


@pytest.mark.slow  # ~15 s: the whole model traced and lowered
def test_colocated_step_lowers_with_ragged_exchanges():
    cfg = make_cfg()
    lay, samples = global_batch(cfg, 8)
    gd, tr, fr = split_model(MultimodalModel(cfg, jax.random.key(0)), trainable_filter(cfg))
    mesh = colocated_mesh(jax.devices(), Colocation(tp=1))
    inputs, _ = balanced_inputs(samples, lay, mesh, "sum", ranks_per_node=4, kind="ragged")
    loss_fn = make_loss_fn(gd, route=colocated_route(mesh))
    low = jax.jit(jax.value_and_grad(loss_fn, has_aux=True)).trace(tr, fr, inputs).lower(
        lowering_platforms=("cuda",))
    hlo = low.as_text(dialect="hlo", debug_info=True)
    tables = inputs[ROUTE_KEY]
    assert tables  # the batch really has an exchange to make
    width = cfg.llm.hidden_size
    for scope, way in ((FORWARD_SCOPE, "fwd"), (BACKWARD_SCOPE, "bwd")):
        want = sorted(({"dtype": "f32", "send": (t[way]["take"].shape[1], width),
                        "recv": (t[way]["buffer"].shape[1], width)} for t in tables.values()),
                      key=str)
        assert sorted(ragged_operands(hlo, scope), key=str) == want, scope
    assert "collective-permute" not in hlo
