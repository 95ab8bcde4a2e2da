"""LoRA in the co-located layout (every unit on one mesh of 8 devices, ZeRO-1/2/3): the
settings of configs/examples/llava_lora.gin (rank-8 adapters on every LLM projection, the
tower frozen, the projector trained whole), the adapters' B drawn nonzero so every adapter
gradient is live. The loss and every trained gradient (adapters and projector) equal the
single program's by the suite's float64 tolerance rule (tests/helpers.py); the bases get no
gradient; adapters are sharded like any trainable leaf, frozen bases at ZeRO-3 too."""
import os

import gin
import jax
import numpy as np
import pytest
from flax import nnx

from helpers import assert_same_grads, assert_same_loss, exact_reference, global_batch
from mmjax.data.assemble import assemble
from mmjax.models.lora import DROPOUT_SEED, LoRAParam, dropout_key
from mmjax.models.mllm import MultimodalModel, trainable_filter
from mmjax.parallel.fsdp import colocated_mesh, place_batch, tree_shardings
from mmjax.train.colocated import colocated_loss_fn
from mmjax.train.colocated_plan import Colocation
from mmjax.train.config import named_model_config
from mmjax.train.inputs import model_inputs
from mmjax.train.lora_setup import with_lora
from mmjax.train.step import make_loss_fn, split_model

pytestmark = pytest.mark.parity  # judged by the float64 rule

EXAMPLE = os.path.join(os.path.dirname(__file__), os.pardir, "configs", "examples",
                       "llava_lora.gin")


def example_config():
    """The model and LoRA settings configs/examples/llava_lora.gin gives."""
    import mmjax.train.trainer  # noqa: F401  (registers every configurable the file binds)

    gin.clear_config()
    try:
        gin.parse_config_files_and_bindings([EXAMPLE], [], finalize_config=False)
        return with_lora(named_model_config())
    finally:
        gin.clear_config()


def with_live_adapters(model, seed=5):
    """`model` with every adapter's B drawn nonzero (a fresh B is zero, so A's gradient
    would be zero too)."""
    flat = nnx.to_flat_state(nnx.state(model, LoRAParam))
    keys = jax.random.split(jax.random.key(seed), len(flat))
    nnx.update(model, nnx.from_flat_state(
        [(p, v.replace(jax.random.normal(k, v[...].shape) * 0.3) if p[-1] == "b" else v)
         for (p, v), k in zip(flat, keys)]))
    return model


@pytest.fixture(scope="module")
def setup():
    cfg = example_config()
    gd, tr, fr = split_model(with_live_adapters(MultimodalModel(cfg, jax.random.key(0))),
                             trainable_filter(cfg))
    lay, samples = global_batch(cfg, 8)
    inputs = model_inputs(assemble(samples, lay))
    return cfg, gd, tr, fr, inputs, exact_reference(make_loss_fn(gd), tr, fr, inputs)


def colocated_grads(gd, tr, fr, inputs, colo):
    mesh = colocated_mesh(jax.devices(), colo)
    tr = jax.device_put(tr, tree_shardings(tr, mesh, colo, "params"))
    fr = jax.device_put(fr, tree_shardings(fr, mesh, colo, "params"))
    grads = tree_shardings(tr, mesh, colo, "grads")
    loss_fn = colocated_loss_fn(gd, mesh, colo)

    def f(tr, fr, b):
        (loss, _), g = jax.value_and_grad(loss_fn, has_aux=True)(tr, fr, b)
        return loss, jax.lax.with_sharding_constraint(g, grads)
    return (*jax.jit(f)(tr, fr, place_batch(mesh, inputs, colo)), fr)


def per_device_bytes(tree) -> int:
    dev = jax.devices()[0]
    return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards
               if s.device == dev)


@pytest.mark.parametrize("stage", [pytest.param(1, marks=pytest.mark.slow),
                                   pytest.param(2, marks=pytest.mark.slow), 3])
def test_colocated_lora_equals_single_program(setup, stage):
    cfg, gd, tr, fr, inputs, (ref_loss, ref_grads) = setup
    assert cfg.llm.lora.rank == 8 and cfg.lora_units() == ("llm",)
    loss, grads, placed_frozen = colocated_grads(gd, tr, fr, inputs,
                                                 Colocation(default_stage=stage))
    assert_same_loss(float(loss), ref_loss)
    assert_same_grads(nnx.to_pure_dict(grads), ref_grads)
    flat = dict(nnx.to_flat_state(grads))
    llm = [p for p in flat if p[0] == "llm"]
    assert llm and all("lora" in p for p in llm)  # the LLM's base: no gradient
    assert any(p[0] == "projectors" for p in flat) and not any(p[0] == "encoders" for p in flat)
    a = [np.asarray(v[...]) for p, v in flat.items() if p[-1] == "a"]
    assert a and all(np.any(x) for x in a)  # every adapter's A gradient is live
    full = sum(x.nbytes for x in jax.tree.leaves(grads))
    if stage >= 2:  # adapter (and projector) gradients reduce-scattered over the 8 devices
        assert per_device_bytes(grads) <= full / 8 * 1.10 + 4096
    else:
        assert per_device_bytes(grads) == full
    frozen = sum(x.nbytes for x in jax.tree.leaves(placed_frozen))
    if stage == 3:  # the frozen bases (LLM and tower) stored sharded for memory
        assert per_device_bytes(placed_frozen) <= frozen / 8 * 1.10 + 4096


def with_dropout(loss_fn, key):
    """`loss_fn` traced inside a training step's dropout scope (models/lora.py)."""
    def fn(tr, fr, b):
        with dropout_key(key):
            return loss_fn(tr, fr, b)
    return fn


@pytest.mark.slow  # one more 8-device compile, and the float64 reference with dropout
def test_colocated_lora_dropout_draws_the_single_program_s_masks(setup):
    """lora.dropout = 0.1 at ZeRO-3: the co-located step's masks are the single program's
    (the same key, the same global shapes), so loss and gradients still agree by the rule,
    and differ from the undropped ones."""
    import dataclasses

    cfg, gd, tr, fr, inputs, (plain_loss, _) = setup
    drop = dataclasses.replace(cfg.llm.lora, dropout=0.1)
    cfg = cfg.replace(llm=dataclasses.replace(cfg.llm, lora=drop))
    gd, tr, fr = split_model(with_live_adapters(MultimodalModel(cfg, jax.random.key(0))),
                             trainable_filter(cfg))
    key = jax.random.fold_in(jax.random.key(DROPOUT_SEED), 3)
    ref_loss, ref_grads = exact_reference(with_dropout(make_loss_fn(gd), key), tr, fr, inputs)
    colo = Colocation(default_stage=3)
    mesh = colocated_mesh(jax.devices(), colo)
    loss_fn = with_dropout(colocated_loss_fn(gd, mesh, colo), key)
    trs = jax.device_put(tr, tree_shardings(tr, mesh, colo, "params"))
    frs = jax.device_put(fr, tree_shardings(fr, mesh, colo, "params"))
    (loss, _), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(
        trs, frs, place_batch(mesh, inputs, colo))
    assert_same_loss(float(loss), ref_loss)
    assert_same_grads(nnx.to_pure_dict(grads), ref_grads)
    assert abs(float(loss) - float(plain_loss)) > 1e-4 * abs(float(plain_loss))
