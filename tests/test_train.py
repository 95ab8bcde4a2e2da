"""Single-device training with the project optimizer (train/optimizer.py): invariances,
frozen modules, overfitting, learning-rate schedule, clipping."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from mmjax.data.layout import AssemblyLayout
from mmjax.data.assemble import assemble
from mmjax.data.synthetic import SyntheticConfig, SyntheticDataset
from mmjax.models.config import with_overrides
from mmjax.models.mllm import MultimodalModel, trainable_filter
from mmjax.models.tiny import tiny, tiny_valm
from mmjax.train.inputs import model_inputs
from mmjax.train.optimizer import (OptimizerSettings, learning_rate_schedule, make_optimizer,
                                   optimizer_from_settings)
from mmjax.train.state import WHOLE_MODEL, whole_model_state
from mmjax.train.step import make_loss_fn, make_train_step, split_model

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


def _train(cfg, batches, steps, lr=3e-3, warmup=5):
    """`steps` steps of the trainer's optimizer: AdamW with the default OptimizerSettings
    (weight decay, global-norm clipping at 1) on warmup + cosine decay to 0.1 x lr."""
    mdl = MultimodalModel(cfg, jax.random.key(0))
    graphdef, tr, fr = split_model(mdl, trainable_filter(cfg))
    tx = optimizer_from_settings(learning_rate_schedule(steps, peak_lr=lr, warmup_steps=warmup),
                                 OptimizerSettings())
    state = whole_model_state(tr, tx.init(tr), jnp.zeros((), jnp.int32))
    step = make_train_step(graphdef, tx)
    frozen0 = jax.tree.map(np.array, fr)
    losses = []
    for i in range(steps):
        state, m = step(state, fr, batches[i % len(batches)])
        losses.append(float(m["loss"]))
    return state, fr, frozen0, losses


def test_frozen_modules_bit_identical_and_without_optimizer_state():
    cfg = with_overrides(tiny_valm(), {"llm.num_layers": 2, "encoders.vision.frozen": True,
                                       "llm_frozen": True, "encoders.audio.projector_frozen": True})
    samples = laion_samples(cfg, 6, kind="mix")
    inputs = model_inputs(assemble(samples, layout_for(cfg)))
    state, frozen, frozen0, losses = _train(cfg, [inputs], 3)
    for a, b in zip(jax.tree.leaves(frozen0), jax.tree.leaves(frozen)):
        np.testing.assert_array_equal(a, np.asarray(b))
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(
        state.stages[WHOLE_MODEL].master)]
    assert paths and all("llm" not in p for p in paths)
    assert not any("encoders" in p and "vision" in p for p in paths)
    assert any("projectors" in p and "vision" in p for p in paths)   # trainable projector
    assert any("encoders" in p and "audio" in p for p in paths)      # trainable audio encoder
    assert not any("projectors" in p and "audio" in p for p in paths)
    n_opt = sum(x.size for x in jax.tree.leaves(state.stages[WHOLE_MODEL].opt))
    n_tr = sum(x.size for x in jax.tree.leaves(state.stages[WHOLE_MODEL].master))
    assert n_opt <= 2 * n_tr + 8  # Adam moments for trainable params only
    assert losses[-1] < losses[0]


def test_overfit_fixed_batch_loss_drops_90_percent():
    cfg = small_tiny()
    samples = laion_samples(cfg, 4)
    inputs = model_inputs(assemble(samples, layout_for(cfg)))
    _, _, _, losses = _train(cfg, [inputs], 150, lr=1e-2)
    assert losses[-1] < 0.1 * losses[0], (losses[0], losses[-1])


def test_learning_rate_schedule_shape():
    peak, warm, total, ratio = 2e-3, 10, 100, 0.1
    sched = learning_rate_schedule(total, peak_lr=peak, warmup_steps=warm, min_lr_ratio=ratio)
    lrs = np.array([float(sched(i)) for i in range(total + 6)])
    assert lrs[0] == 0.0 and int(np.argmax(lrs)) == warm
    np.testing.assert_allclose(lrs[:warm + 1], peak * np.arange(warm + 1) / warm, rtol=1e-6)
    assert np.all(np.diff(lrs[:warm + 1]) > 0)                    # linear warmup up
    assert np.all(np.diff(lrs[warm:total + 1]) < 0)               # cosine down
    mid = warm + (total - warm) // 2                              # half-way: mean of ends
    np.testing.assert_allclose(lrs[mid], peak * (ratio + 1) / 2, rtol=1e-5)
    np.testing.assert_allclose(lrs[total:], peak * ratio, rtol=1e-5)  # then stays at min
    assert float(learning_rate_schedule(5, peak_lr=peak, warmup_steps=0)(0)) == pytest.approx(peak)
    short = learning_rate_schedule(3, peak_lr=peak, warmup_steps=10)  # warmup clipped
    assert float(short(0)) == 0.0 and float(short(2)) == pytest.approx(peak)
    with pytest.raises(ValueError, match="total_steps"):
        learning_rate_schedule(0)


def test_optimizer_is_clipped_adamw_on_the_schedule():
    """make_optimizer == global-norm clipping then AdamW at the scheduled rate, against a
    NumPy reimplementation over steps whose gradient norms straddle the clip threshold."""
    b1, b2, eps, wd, clip = 0.9, 0.95, 1e-8, 0.01, 1.0
    sched = learning_rate_schedule(4, peak_lr=0.1, warmup_steps=1)
    tx = make_optimizer(sched, weight_decay=wd, clip_norm=clip, b1=b1, b2=b2, eps=eps)
    rng = np.random.default_rng(0)
    p = {"a": rng.normal(size=(3, 2)).astype(np.float32),
         "b": rng.normal(size=4).astype(np.float32)}
    grads = [jax.tree.map(lambda x: (scale * rng.normal(size=x.shape)).astype(np.float32), p)
             for scale in (30.0, 0.1, 5.0, 0.3)]
    state, params = tx.init(p), jax.tree.map(jnp.asarray, p)
    ref = {k: v.astype(np.float64) for k, v in p.items()}
    m = {k: np.zeros_like(v) for k, v in ref.items()}
    v = {k: np.zeros_like(x) for k, x in ref.items()}
    for t, g in enumerate(grads, start=1):
        upd, state = tx.update(g, state, params)
        params = optax.apply_updates(params, upd)
        norm = np.sqrt(sum(np.sum(np.square(x.astype(np.float64))) for x in g.values()))
        lr = float(sched(t - 1))
        for k in ref:
            gc = g[k] * min(1.0, clip / norm)
            m[k] = b1 * m[k] + (1 - b1) * gc
            v[k] = b2 * v[k] + (1 - b2) * gc * gc
            mh, vh = m[k] / (1 - b1 ** t), v[k] / (1 - b2 ** t)
            ref[k] = ref[k] - lr * (mh / (np.sqrt(vh) + eps) + wd * ref[k])
        for k in ref:
            np.testing.assert_allclose(np.asarray(params[k]), ref[k], rtol=1e-5, atol=1e-6)
    assert not np.allclose(ref["a"], p["a"])
