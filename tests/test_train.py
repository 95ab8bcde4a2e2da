"""Single-device training: invariances, frozen modules, overfitting, resume."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from mmjax.data.assemble import AssemblyLayout, assemble
from mmjax.data.synthetic import SyntheticConfig, SyntheticDataset
from mmjax.models.config import with_overrides
from mmjax.models.mllm import MultimodalModel, trainable_filter
from mmjax.models.tiny import tiny, tiny_valm
from mmjax.train.inputs import model_inputs
from mmjax.train.step import TrainState, make_loss_fn, make_train_step, split_model

SMALL = {"llm.num_layers": 2, "encoders.vision.encoder.num_layers": 1}


def small_tiny(**kw):
    cfg = with_overrides(tiny(), SMALL)
    return dataclasses.replace(cfg, **kw)


def laion_samples(cfg, n, start=0, kind="laion", **kw):
    ds = SyntheticDataset(kind, SyntheticConfig.for_model(cfg, gen_fraction=0.5, **kw), seed=3)
    return [ds[i] for i in range(start, start + n)]


def layout_for(cfg, packing="pad"):
    return AssemblyLayout.from_config(cfg, 160, packing, vision_caps=(64, 256),
                                      audio_frame_caps=(128, 256, 512))


def loss_and_grads(cfg, batch_inputs):
    mdl = MultimodalModel(cfg, jax.random.key(0))
    graphdef, tr, fr = split_model(mdl, trainable_filter(cfg))
    fn = jax.jit(jax.value_and_grad(make_loss_fn(graphdef), has_aux=True))
    (loss, aux), g = fn(tr, fr, batch_inputs)
    return float(loss), aux, g


@pytest.mark.parametrize("packing", ["pad", "pack"])
def test_loss_and_grads_invariant_to_sample_permutation(packing):
    cfg = small_tiny()
    samples = laion_samples(cfg, 6)
    assert any(s.segments[-1].modality == "image_out" for s in samples)
    lay = layout_for(cfg, packing)
    l0, aux0, g0 = loss_and_grads(cfg, model_inputs(assemble(samples, lay)))
    perm = [4, 2, 5, 0, 3, 1]
    l1, aux1, g1 = loss_and_grads(cfg, model_inputs(assemble([samples[i] for i in perm], lay)))
    assert float(aux0["diffusion_loss"]) > 0 and float(aux0["lm_loss"]) > 0
    np.testing.assert_allclose(l0, l1, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_split_batch_with_global_normalisers_sums_to_whole():
    """Two halves, each normalised by the global counts, add up to the whole batch."""
    cfg = small_tiny()
    samples = laion_samples(cfg, 6)
    lay = layout_for(cfg)
    whole = assemble(samples, lay)
    l, _, g = loss_and_grads(cfg, model_inputs(whole))
    parts = [assemble(samples[:3], lay), assemble(samples[3:], lay)]
    outs = [loss_and_grads(cfg, model_inputs(p, whole.num_target_tokens, whole.num_gen_elements))
            for p in parts]
    np.testing.assert_allclose(l, outs[0][0] + outs[1][0], rtol=1e-5)
    summed = jax.tree.map(lambda a, b: a + b, outs[0][2], outs[1][2])
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(summed)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def _train(cfg, batches, steps, lr=3e-3):
    mdl = MultimodalModel(cfg, jax.random.key(0))
    graphdef, tr, fr = split_model(mdl, trainable_filter(cfg))
    tx = optax.adam(lr)
    state = TrainState(jnp.zeros((), jnp.int32), tr, fr, tx.init(tr))
    step = make_train_step(graphdef, tx)
    frozen0 = jax.tree.map(np.array, fr)
    losses = []
    for i in range(steps):
        state, m = step(state, batches[i % len(batches)])
        losses.append(float(m["loss"]))
    return state, frozen0, losses


def test_frozen_modules_bit_identical_and_without_optimizer_state():
    cfg = with_overrides(tiny_valm(), {"llm.num_layers": 2, "encoders.vision.frozen": True,
                                       "llm_frozen": True, "encoders.audio.projector_frozen": True})
    samples = laion_samples(cfg, 6, kind="mix")
    inputs = model_inputs(assemble(samples, layout_for(cfg)))
    state, frozen0, losses = _train(cfg, [inputs], 3)
    for a, b in zip(jax.tree.leaves(frozen0), jax.tree.leaves(state.frozen)):
        np.testing.assert_array_equal(a, np.asarray(b))
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(state.trainable)]
    assert paths and all("llm" not in p for p in paths)
    assert not any("encoders" in p and "vision" in p for p in paths)
    assert any("projectors" in p and "vision" in p for p in paths)   # trainable projector
    assert any("encoders" in p and "audio" in p for p in paths)      # trainable audio encoder
    assert not any("projectors" in p and "audio" in p for p in paths)
    n_opt = sum(x.size for x in jax.tree.leaves(state.opt_state))
    n_tr = sum(x.size for x in jax.tree.leaves(state.trainable))
    assert n_opt <= 2 * n_tr + 8  # Adam moments for trainable params only
    assert losses[-1] < losses[0]


def test_overfit_fixed_batch_loss_drops_90_percent():
    cfg = small_tiny()
    samples = laion_samples(cfg, 4)
    inputs = model_inputs(assemble(samples, layout_for(cfg)))
    _, _, losses = _train(cfg, [inputs], 150, lr=1e-2)
    assert losses[-1] < 0.1 * losses[0], (losses[0], losses[-1])
