"""LoRA adapters (models/lora.py): the unmerged forward and the adapters' gradients equal
the merged-weight formulation W + A B * alpha / r (judged by the float64 tolerance rule,
docs/testing.md); only adapters train in a LoRA'd part; init as peft's; merge."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import (assert_same_grads, assert_same_loss, exact_reference, global_batch,
                     make_cfg)
from mmjax.data.assemble import assemble
from mmjax.errors import UserError
from mmjax.models.config import LLMConfig, with_overrides
from mmjax.models.llm import LLM
from mmjax.models.lora import LoRAParam
from mmjax.models.lora_config import LoRAConfig
from mmjax.models.lora_merge import adapter_sites, flat_params, merged_flat, without_lora
from mmjax.models.mllm import MultimodalModel, trainable_filter
from mmjax.train.inputs import model_inputs
from mmjax.train.step import make_loss_fn, split_model

LLM_LORA = LoRAConfig(rank=4, alpha=8.0, targets=("all",))
TOWER_LORA = LoRAConfig(rank=2, alpha=4.0, targets=("attention",), rslora=True)
PROJ_LORA = LoRAConfig(rank=3, alpha=3.0, targets=("fc1", "fc2"))

EPS32 = float(np.finfo(np.float32).eps)


def perturbed(model, seed=5):
    """`model` with every adapter's B drawn nonzero (a fresh B is zero: no effect)."""
    state = nnx.state(model, LoRAParam)
    leaves, tree = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    new = [jax.random.normal(k, x.shape, x.dtype) * 0.3 if x.shape[0] <= 4 else x
           for k, x in zip(keys, leaves)]  # b [r, out] (r <= 4 here); a [in, r] kept
    nnx.update(model, jax.tree.unflatten(tree, new))
    return model


@pytest.fixture(scope="module")
def lora_setup():
    cfg = make_cfg(**{"llm.num_layers": 2, "generator": None, "llm.lora": LLM_LORA, "encoders.vision.encoder.lora": TOWER_LORA,
                      "encoders.vision.projector.lora": PROJ_LORA})
    model = perturbed(MultimodalModel(cfg, jax.random.key(0)))
    lay, samples = global_batch(cfg, 4)
    return cfg, model, model_inputs(assemble(samples, lay))


def merged_formulation(cfg, model):
    """(loss_fn(adapters, frozen, batch), adapters, frozen): the model without LoRA whose
    targeted weights are W + A B * scale, built inside the traced function."""
    sites = adapter_sites(model)
    base = nnx.eval_shape(lambda: MultimodalModel(without_lora(cfg), jax.random.key(0)))
    gd0, abstract, rest = nnx.split(base, nnx.Param, ...)
    _, adapters, frozen = split_model(model, LoRAParam)
    flat = lambda s: {tuple(p): v for p, v in nnx.to_flat_state(s)}

    def loss_fn(adapters, frozen, batch):
        w = {p: v[...] for p, v in {**flat(frozen), **flat(adapters)}.items()}
        for site, (bpath, scale) in sites.items():
            w[bpath] = w[bpath] + (w.pop(site + ("a",)) @ w.pop(site + ("b",))) * scale
        state = nnx.from_flat_state({p: abstract_leaf.replace(w[p]) for p, abstract_leaf
                                     in nnx.to_flat_state(abstract)})
        return nnx.merge(gd0, state, rest)(batch)
    return loss_fn, adapters, frozen


def test_lora_forward_and_grads_equal_merged_weights(lora_setup):
    cfg, model, inputs = lora_setup
    gd, tr, fr = split_model(model, trainable_filter(cfg))
    paths = {tuple(p) for p, _ in nnx.to_flat_state(tr)}
    # only adapters train: every part is LoRA'd
    assert all(p[-1] in "ab" and "lora" in p for p in paths)
    assert any(p[0] == "llm" for p in paths) and any(p[0] == "projectors" for p in paths)
    (loss, _), grads = jax.jit(jax.value_and_grad(make_loss_fn(gd), has_aux=True))(
        tr, fr, inputs)
    fn, adapters, frozen = merged_formulation(cfg, model)
    ref_loss, ref_grads = exact_reference(fn, adapters, frozen, inputs)
    assert_same_loss(float(loss), ref_loss)
    assert_same_grads(nnx.to_pure_dict(grads), ref_grads)
    # the adapters matter: without them the loss differs by far more than rounding
    off = nnx.from_flat_state({p: v.replace(jnp.zeros_like(v[...]) if "lora" in p else v[...])
                               for p, v in nnx.to_flat_state(tr)})
    plain = float(jax.jit(make_loss_fn(gd))(off, fr, inputs)[0])
    assert abs(plain - float(loss)) > 1e-3 * abs(float(loss))


def test_fresh_adapters_change_nothing_and_init_as_peft():
    cfg = LLMConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                    ffn_size=48)
    lora_cfg = with_overrides(cfg, {"lora": LoRAConfig(rank=8, targets=("q", "v", "down"))})
    base, lora = LLM(cfg, jax.random.key(1)), LLM(lora_cfg, jax.random.key(1))
    tokens = jnp.arange(12, dtype=jnp.int32).reshape(2, 6) % 64
    pos = jnp.broadcast_to(jnp.arange(6), (2, 6))
    allowed = jnp.tril(jnp.ones((6, 6), bool))[None]
    np.testing.assert_array_equal(np.asarray(base(tokens, pos, allowed)),
                                  np.asarray(lora(tokens, pos, allowed)))
    ad = lora.layers[0].lora
    assert set(ad) == {"q", "v", "down"}
    assert not np.any(np.asarray(ad["q"].b[...]))
    a = np.asarray(ad["down"].a[...])  # kaiming-uniform(a=sqrt 5): U(-1/sqrt(in), 1/sqrt(in))
    assert a.shape == (48, 8) and np.abs(a).max() <= 1 / math.sqrt(48)
    assert np.abs(a).max() > 0.8 / math.sqrt(48)
    assert ad["q"].scale == 2.0


def test_merged_weights_are_w_plus_ba_scale(lora_setup):
    cfg, model, _ = lora_setup
    flat, merged = flat_params(model), merged_flat(model)
    assert not any("lora" in p for p in merged)
    for site, (bpath, scale) in adapter_sites(model).items():
        a = np.asarray(flat[site + ("a",)], np.float64)
        b = np.asarray(flat[site + ("b",)], np.float64)
        w = np.asarray(flat[bpath], np.float64)
        want = w + a @ b * scale
        # float32 rounding of a rank-r product, its scaling and the sum (first-order bound)
        bound = EPS32 * (a.shape[1] + 2) * (np.abs(w) + np.abs(a) @ np.abs(b) * abs(scale))
        assert np.all(np.abs(np.asarray(merged[bpath], np.float64) - want) <= bound)
    untouched = [p for p in merged if p not in {s[0] for s in adapter_sites(model).values()}]
    assert all(np.array_equal(merged[p], flat[p]) for p in untouched)
    assert TOWER_LORA.scale == 4.0 / math.sqrt(2)  # rsLoRA


@pytest.mark.parametrize("bad, words", [
    (dict(rank=0), "lora.rank"), (dict(alpha=-1.0), "lora.alpha"),
    (dict(dropout=1.0), "lora.dropout"), (dict(targets=("q_proj",)), "lora.targets")])
def test_bad_lora_settings_are_one_line_errors(bad, words):
    with pytest.raises(UserError, match=words) as e:
        LoRAConfig(**bad)
    assert "\n" not in str(e.value)


def test_lora_on_a_frozen_part_is_refused():
    with pytest.raises(UserError, match="lora.units"):
        make_cfg(**{"llm.lora": LLM_LORA, "llm_frozen": True})


def test_lora_on_a_patch_merger_projector_is_refused_in_one_line():
    """Qwen2-VL's patch-merger projector takes no adapters (its tower does:
    tests/test_lora_qwen2_vl.py)."""
    from mmjax.models.tiny import tiny_qwen2_vl
    from mmjax.train.lora_setup import with_lora

    with pytest.raises(UserError, match="'patch_merger' projector: LoRA adapts kind='mlp'") as e:
        with_lora(tiny_qwen2_vl(), ("vision.projector",), LoRAConfig())
    assert "\n" not in str(e.value) and "use some of ['llm', 'vision']" in str(e.value)


def test_with_lora_takes_what_it_is_not_given_from_gin():
    """Units named without settings: gin's `lora.*` settings on them; neither named: gin's
    `lora.units` too (the trainer's call)."""
    import gin

    from mmjax.models.tiny import tiny
    from mmjax.train.lora_setup import with_lora

    with gin.unlock_config():
        gin.parse_config(["lora.rank = 3", "lora.targets = ('q', 'v')", "lora.units = ('llm',)"])
    try:
        cfg = with_lora(tiny(), ("vision",))
        assert cfg.llm.lora is None
        assert (cfg.encoder("vision").encoder.lora.rank,
                cfg.encoder("vision").encoder.lora.targets) == (3, ("q", "v"))
        assert with_lora(tiny()).llm.lora == LoRAConfig(rank=3, targets=("q", "v"))
        assert with_lora(tiny(), ("llm",), LLM_LORA).llm.lora == LLM_LORA  # given: used
    finally:
        gin.clear_config()


def test_lora_on_an_audio_tower_is_refused_in_one_line():
    from mmjax.models.tiny import tiny_valm
    from mmjax.train.lora_setup import with_lora

    with pytest.raises(UserError, match="'audio' is an audio tower: LoRA adapts vision") as e:
        with_lora(tiny_valm(), ("audio",), LoRAConfig())
    assert "\n" not in str(e.value)


def test_dropout_only_inside_a_training_scope():
    """peft's lora_dropout: the adapter's input, training only; p = 0 or outside the scope
    the adapter is exact; inside, each call draws its own mask from the scope's key."""
    from mmjax.models.lora import LoRA, dropout_key

    cfg = LoRAConfig(rank=4, alpha=4.0, dropout=0.25)
    ad = LoRA(jax.random.key(0), 64, 8, cfg)
    ad.b[...] = jax.random.normal(jax.random.key(1), (4, 8))
    x = jax.random.normal(jax.random.key(2), (32, 64))
    a, b = np.asarray(ad.a[...], np.float64), np.asarray(ad.b[...], np.float64)
    xd = np.asarray(x, np.float64)
    exact = xd @ a @ b
    # float32 rounding of two chained products of reduction lengths 64 and 4 (first order)
    bound = EPS32 * (64 + 4 + 2) * (np.abs(xd) @ np.abs(a) @ np.abs(b))
    assert np.all(np.abs(np.asarray(ad(x), np.float64) - exact) <= bound)
    key = jax.random.key(7)
    with dropout_key(key):
        first, second = ad(x), ad(x)
    keep = np.asarray(jax.random.bernoulli(jax.random.fold_in(key, 1), 0.75, x.shape))
    xk = xd * keep / 0.75
    want = xk @ a @ b
    bound = EPS32 * (64 + 4 + 3) * (np.abs(xk) @ np.abs(a) @ np.abs(b))
    assert np.all(np.abs(np.asarray(first, np.float64) - want) <= bound)
    assert 0.65 < keep.mean() < 0.85 and not np.allclose(first, second)
    with dropout_key(key):  # the same key: the same masks (a resumed step)
        np.testing.assert_array_equal(ad(x), first)


def test_dropout_masks_are_per_layer_and_the_same_looped_or_scanned():
    """A layer's adapters draw masks keyed by its index (models/lora.py `layer_dropout`):
    the LLM's stack gives the same dropped output as a Python loop and as one `lax.scan`,
    and each layer draws its own masks (layers with equal weights differ under dropout)."""
    from mmjax.models.lora import dropout_key, layer_dropout

    cfg = LLMConfig(vocab_size=64, hidden_size=16, num_layers=3, num_heads=2, num_kv_heads=2,
                    ffn_size=32, lora=LoRAConfig(rank=4, targets=("all",), dropout=0.5))
    tokens = jnp.arange(12, dtype=jnp.int32).reshape(2, 6) % 64
    pos = jnp.broadcast_to(jnp.arange(6), (2, 6))
    allowed = jnp.tril(jnp.ones((6, 6), bool))[None]
    key = jax.random.key(7)

    def dropped(scan):
        model = perturbed(LLM(with_overrides(cfg, {"scan_layers": scan}), jax.random.key(1)))
        with dropout_key(key):
            return np.asarray(model(tokens, pos, allowed))
    looped, scanned = dropped(False), dropped(True)
    np.testing.assert_array_equal(looped, scanned)
    adapter = perturbed(LLM(cfg, jax.random.key(1))).layers[0].lora["q"]
    per_layer = []
    with dropout_key(key):
        for i in (0, 1):  # one adapter called as layer 0 and as layer 1: other masks
            with layer_dropout(i):
                per_layer.append(np.asarray(adapter(jnp.ones((4, 16)))))
    assert not np.array_equal(per_layer[0], per_layer[1])
