"""The co-located layout gives the single-device loss and gradients (rtol 1e-5, the parity
tests' per-tensor rule, tests/helpers.py) at dp 8 and dp 4 x tp 2, ZeRO stages 1-3 and a
hybrid FSDP group, on `tiny` and `tiny_valm` with frozen encoders (no gradient for them)."""
import jax
import pytest
from flax import nnx

from helpers import assert_same_grads, assert_same_loss, cached_reference, make_cfg
from mmjax.data.assemble import assemble
from mmjax.models.mllm import MultimodalModel, trainable_filter
from mmjax.models.tiny import tiny, tiny_valm
from mmjax.parallel.fsdp import colocated_mesh, place_batch, tree_shardings
from mmjax.train.colocated import colocated_loss_fn
from mmjax.train.colocated_plan import Colocation
from mmjax.train.inputs import model_inputs
from mmjax.train.step import split_model

pytestmark = pytest.mark.parity  # judged by the float64 rule; CI reruns it under a second XLA config


def frozen_encoders(base):
    cfg = base()
    return make_cfg(base, **{f"encoders.{e.name}.frozen": True for e in cfg.encoders})


CONFIGS = {"tiny": lambda: frozen_encoders(tiny), "tiny_valm": lambda: frozen_encoders(tiny_valm)}


def colocated_grads(cfg, colo, batch):
    """Loss and gradients of the co-located loss, parameters placed at their ZeRO stage,
    gradients at theirs (whole: all-reduce; sharded: reduce-scatter)."""
    mesh = colocated_mesh(jax.devices(), colo)
    gd, tr, fr = split_model(MultimodalModel(cfg, jax.random.key(0)), trainable_filter(cfg))
    tr = jax.device_put(tr, tree_shardings(tr, mesh, colo, "params"))
    fr = jax.device_put(fr, tree_shardings(fr, mesh, colo, "params"))
    grads = tree_shardings(tr, mesh, colo, "grads")
    loss_fn = colocated_loss_fn(gd, mesh, colo)

    def f(tr, fr, b):
        (loss, _), g = jax.value_and_grad(loss_fn, has_aux=True)(tr, fr, b)
        return loss, jax.lax.with_sharding_constraint(g, grads)
    loss, g = jax.jit(f)(tr, fr, place_batch(mesh, batch, colo))
    return float(loss), g


@pytest.mark.slow
@pytest.mark.parametrize("name,tp,stage,group", [
    (name, tp, stage, None) for name in ("tiny", "tiny_valm") for tp in (1, 2)
    for stage in (1, 2, 3)] + [("tiny", 2, 3, 4)])  # the hybrid (HSDP) group: on tiny
def test_colocated_matches_single_device(name, tp, stage, group, reference_cache):
    cfg = CONFIGS[name]()
    lay, samples, ref_loss, ref_grads = cached_reference(reference_cache, cfg, 8)
    colo = Colocation(tp=tp, default_stage=stage, fsdp_group=group)
    loss, grads = colocated_grads(cfg, colo, model_inputs(assemble(samples, lay)))
    assert_same_loss(loss, ref_loss)
    assert_same_grads(nnx.to_pure_dict(grads), ref_grads)
    # frozen encoders: no gradient at all; stage >= 2: every sharded-able gradient sharded
    assert not any(k == "encoders" for k in nnx.to_pure_dict(grads))
    if stage >= 2:
        dev = jax.devices()[0]
        per = sum(s.data.nbytes for x in jax.tree.leaves(grads) for s in x.addressable_shards
                  if s.device == dev)
        full = sum(x.nbytes for x in jax.tree.leaves(grads))
        d = group or 8  # one FSDP group (its tp ranks included) holds one copy
        assert per <= full / d * 1.10 + 4096, (per, full)
