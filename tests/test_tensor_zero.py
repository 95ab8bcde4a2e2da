"""Megatron TP sharding rules (parallel/tensor.py) and ZeRO-1 (parallel/zero.py).

TP: stages of the tiny LLM (two 2-layer slices), a ViT and a DiT jitted with sharded params on
(dp=2, tp=2) and (dp=1, tp=4) meshes equal the single-device outputs and gradients; the tp=2
layer stack's HLO has all-reduces (and a dp-only mesh's has none).
ZeRO-1: two stages updated with the shared global norm equal one optax update over the union
of their params, for dp in {1, 2, 4}; optimizer state per device shrinks by dp.
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from mmjax.models.generator import DiffusionGenerator, diffusion_loss_sum
from mmjax.models.llm import LLM, lm_loss_sum, mask_attend
from mmjax.models.tiny import TINY_GENERATOR, TINY_LLM, TINY_VISION, tiny, tiny_valm
from mmjax.models.vision import VisionEncoder
from mmjax.parallel.tensor import (activation_sharding, mesh_param_specs, param_specs,
                                   path_names, shard_state)
from mmjax.parallel.zero import Zero1Optimizer, state_bytes_per_device
from mmjax.pipeline.stage_modules import build_stage_module
from mmjax.train.optimizer import learning_rate_schedule, make_optimizer
from zero1_legacy import global_grad_norm, zero1_adamw

B = 4  # batch, divisible by every dp used here


def _mesh(dp, tp, offset=0):
    devs = np.array(jax.devices()[offset:offset + dp * tp]).reshape(dp, tp)
    return Mesh(devs, ("dp", "tp"))


def _is_spec(x):
    return isinstance(x, P)


def _layer0_sharded(state, tp=2):
    """{names under layer 0 (after 'layers'): spec} for the non-replicated leaves."""
    out = {}
    specs = param_specs(state, tp)
    for (path, _), spec in zip(jax.tree_util.tree_leaves_with_path(state),
                               jax.tree.leaves(specs, is_leaf=_is_spec)):
        names = path_names(path)
        keys = [getattr(k, "key", None) for k in path]
        if spec != P():
            if "layers" in names and 0 not in keys:
                continue
            out["/".join(names[names.index("layers") + 1:] if "layers" in names
                         else names)] = spec
    return out


# ---------------------------------------------------------------- rules tables
def test_llm_rules_table():
    first = nnx.state(LLM(TINY_LLM, jax.random.key(0), 0, 2))
    last = nnx.state(LLM(TINY_LLM, jax.random.key(0), 2, 4))
    col, row = P(None, "tp"), P("tp", None)
    layer = {"wq": col, "wk": col, "wv": col, "bq": P("tp"), "bk": P("tp"), "bv": P("tp"),
             "w_gate": col, "w_up": col, "wo": row, "w_down": row}
    assert _layer0_sharded(first) == {**layer, "embed": P("tp", None)}
    assert _layer0_sharded(last) == {**layer, "lm_head": P(None, "tp")}
    no_vocab = param_specs(first, 2, shard_vocab=False)
    assert no_vocab["embed"] == P() and no_vocab["layers"][0]["attn_norm"]["scale"] == P()


def test_encoder_generator_rules_table():
    col, row, b = P(None, "tp"), P("tp", None), P("tp")
    block = {"q/kernel": col, "q/bias": b, "k/kernel": col, "k/bias": b, "v/kernel": col,
             "v/bias": b, "o/kernel": row, "fc1/kernel": col, "fc1/bias": b, "fc2/kernel": row}
    root = jax.random.key(1)
    vision = nnx.state(build_stage_module(tiny(), "vision", root, 0, 2))  # + MLP projector
    assert _layer0_sharded(vision) == block
    audio = nnx.state(build_stage_module(tiny_valm(), "audio", root, 0, 2))
    # Whisper's attention has no key bias (HF WhisperAttention: k_proj bias=False)
    assert _layer0_sharded(audio) == {k: v for k, v in block.items() if k != "k/bias"}
    gen = nnx.state(build_stage_module(tiny(), "generator", root, 0, 2))
    cross = {"cq/kernel": col, "cq/bias": b, "ck/kernel": col, "ck/bias": b,
             "cv/kernel": col, "cv/bias": b, "co/kernel": row}
    assert _layer0_sharded(gen) == {**block, **cross}
    # The projector (fc1/fc2 outside a `layers` list) and modulation stay replicated.
    assert all(s == P() for s in jax.tree.leaves(param_specs(vision["projectors"], 2),
                                                 is_leaf=_is_spec))
    assert param_specs(gen, 2)["layers"][0]["modulation"]["kernel"] == P()


def test_indivisible_raises_naming_param_and_size():
    state = nnx.state(LLM(TINY_LLM, jax.random.key(0), 0, 1))
    with pytest.raises(ValueError, match=r"\['embed'\].*512.*'tp' size 3"):
        param_specs(state, 3)
    with pytest.raises(ValueError, match=r"\['layers'\]\[0\]\['bk'\].*32.*'tp' size 3"):
        param_specs(state, 3, shard_vocab=False)
    vision = nnx.state(VisionEncoder(TINY_VISION, jax.random.key(0), 0, 1))
    with pytest.raises(ValueError, match=r"\['fc1'\]\['bias'\].*64.*'tp' size 5"):
        param_specs(vision, 5)


# ---------------------------------------------------------------- TP parity
def _llm_first(key):
    m = LLM(TINY_LLM, key, 0, 2)
    k1, k2 = jax.random.split(jax.random.fold_in(key, 9))
    tokens = jax.random.randint(k1, (B, 8), 0, TINY_LLM.vocab_size)
    pos = jnp.broadcast_to(jnp.arange(8), (B, 8))
    r = jax.random.normal(k2, (B, 8, TINY_LLM.hidden_size))
    allowed = jnp.broadcast_to(jnp.tril(jnp.ones((8, 8), bool)), (B, 8, 8))

    def loss(mod, tokens, pos, allowed, r):
        return jnp.sum(mod.run_layers(mod.embed_tokens(tokens), pos, mask_attend(allowed)) * r)
    return m, loss, (tokens, pos, allowed, r), None


def _llm_last(key):
    m = LLM(TINY_LLM, key, 2, 4)
    k1, k2 = jax.random.split(jax.random.fold_in(key, 9))
    x = jax.random.normal(k1, (B, 8, TINY_LLM.hidden_size))
    pos = jnp.broadcast_to(jnp.arange(8), (B, 8))
    allowed = jnp.broadcast_to(jnp.tril(jnp.ones((8, 8), bool)), (B, 8, 8))
    targets = jax.random.randint(k2, (B, 8), 0, TINY_LLM.vocab_size)

    def loss(mod, x, pos, allowed, targets):
        h = mod.final_hidden(mod.run_layers(x, pos, mask_attend(allowed)))
        return lm_loss_sum(mod.logits(h), targets, jnp.ones_like(targets)) / targets.size
    return m, loss, (x, pos, allowed, targets), 0


def _vit(key):
    cfg = TINY_VISION
    m = VisionEncoder(cfg, key, 0, 2)
    ks = jax.random.split(jax.random.fold_in(key, 9), 3)
    patches = jax.random.normal(ks[0], (B, 16, cfg.patch_dim))
    seg = jnp.broadcast_to(jnp.array([1] * 6 + [2] * 8 + [0] * 2), (B, 16))
    ppos = jax.random.randint(ks[1], (B, 16, 2), 0, cfg.max_grid)
    r = jax.random.normal(ks[2], (B, 16, cfg.hidden_size))

    def loss(mod, patches, seg, ppos, r):
        return jnp.sum(mod(patches, seg, ppos) * r)
    return m, loss, (patches, seg, ppos, r), 0


def _dit(key):
    cfg = TINY_GENERATOR
    m = DiffusionGenerator(cfg, TINY_LLM.hidden_size, key, 0, 2)
    ks = jax.random.split(jax.random.fold_in(key, 9), 4)
    noisy = jax.random.normal(ks[0], (B, cfg.num_patches, cfg.patch_dim))
    t = jax.random.randint(ks[1], (B,), 0, cfg.num_train_timesteps)
    cond = jax.random.normal(ks[2], (B, 3, TINY_LLM.hidden_size))
    noise = jax.random.normal(ks[3], noisy.shape)

    def loss(mod, noisy, t, cond, noise):
        return diffusion_loss_sum(mod(noisy, t, cond), noise, jnp.ones((noisy.shape[0],)))
    return m, loss, (noisy, t, cond, noise), 2


def _at(tree, path):
    leaves = dict(jax.tree_util.tree_leaves_with_path(tree))
    return leaves[path]


def _value_and_grads(graphdef, loss, argnum):
    def f(state, *args):
        return loss(nnx.merge(graphdef, state), *args)
    nums = (0,) if argnum is None else (0, 1 + argnum)
    return jax.jit(jax.value_and_grad(f, argnums=nums))


@pytest.mark.parametrize("make", [
    pytest.param(_llm_first, id="llm_first"), pytest.param(_llm_last, id="llm_last"),
    pytest.param(_vit, id="vit", marks=pytest.mark.slow),
    pytest.param(_dit, id="dit", marks=pytest.mark.slow)])
def test_tp_stage_parity(make):
    module, loss, args, argnum = make(jax.random.key(3))
    graphdef, state = nnx.split(module)
    fn = _value_and_grads(graphdef, loss, argnum)
    ref_val, ref_grads = fn(state, *args)
    total = float(optax.tree.norm(ref_grads))
    for dp, tp in [(2, 2), (1, 4)]:
        mesh = _mesh(dp, tp)
        sharded = shard_state(state, mesh)
        specs = param_specs(state, tp)
        for leaf, spec in zip(jax.tree.leaves(sharded),
                              jax.tree.leaves(specs, is_leaf=_is_spec)):
            assert leaf.sharding.spec == spec and leaf.sharding.mesh == mesh
        assert any(s != P() for s in jax.tree.leaves(specs, is_leaf=_is_spec))
        sargs = [jax.device_put(a, activation_sharding(mesh, a.ndim)) for a in args]
        val, grads = fn(sharded, *sargs)
        np.testing.assert_allclose(val, ref_val, rtol=1e-5)
        # Per tensor ||g - g_ref|| <= 1e-5 ||g_ref||, plus 1e-6 of the global norm for tensors
        # whose true gradient is zero (attention key biases: softmax is shift-invariant).
        for path, g in jax.tree_util.tree_leaves_with_path(grads):
            r = np.asarray(_at(ref_grads, path))
            err = float(np.linalg.norm(np.asarray(g) - r))
            assert err <= 1e-5 * float(np.linalg.norm(r)) + 1e-6 * total, (
                (dp, tp), jax.tree_util.keystr(path), err, float(np.linalg.norm(r)))


def _layers_hlo(mesh):
    module, _, (x, pos, allowed, _), _ = _llm_last(jax.random.key(0))
    graphdef, state = nnx.split(module)
    fn = jax.jit(lambda st, x, pos, a: nnx.merge(graphdef, st).run_layers(x, pos,
                                                                          mask_attend(a)))
    args = [jax.device_put(a, activation_sharding(mesh, a.ndim)) for a in (x, pos, allowed)]
    return fn.lower(shard_state(state, mesh), *args).compile().as_text()


def test_tp_layer_hlo_has_all_reduce():
    assert "all-reduce" in _layers_hlo(_mesh(1, 2))   # row-parallel partial sums
    assert "all-reduce" not in _layers_hlo(_mesh(2, 1))  # control: dp only, nothing to sum


# ---------------------------------------------------------------- ZeRO-1
def _two_stages():
    llm = nnx.state(LLM(TINY_LLM, jax.random.key(5), 0, 2), nnx.Param)
    vit = nnx.state(VisionEncoder(TINY_VISION, jax.random.key(6), 0, 2), nnx.Param)
    return {"llm": llm, "vision": vit}


def _grads(params, seed, scale):
    leaves, tree = jax.tree.flatten(params)
    ks = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(tree, [scale * jax.random.normal(k, x.shape)
                                     for k, x in zip(ks, leaves)])


def _reference_steps(schedule, params, steps):
    """One optax optimizer (make_optimizer: global-norm clip + AdamW) over the union."""
    tx = make_optimizer(schedule, weight_decay=0.01, clip_norm=1.0)

    @jax.jit
    def step(p, s, g):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    p, s = params, tx.init(params)
    for g in steps:
        p, s = step(p, s, g)
    return p


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_zero1_two_stages_match_single_optimizer(dp):
    tp = 4 // dp
    schedule = learning_rate_schedule(10, peak_lr=1e-2, warmup_steps=1)
    params = _two_stages()
    # Step 1: global norm >> clip (clipping active); step 2: norm < clip (no clipping).
    steps = [_grads(params, 1, 0.5), _grads(params, 2, 1e-3)]
    assert [float(optax.tree.norm(g)) > 1.0 for g in steps] == [True, False]

    ref_p = _reference_steps(schedule, params, steps)

    meshes = {"llm": _mesh(dp, tp, 0), "vision": _mesh(dp, tp, dp * tp)}
    p = {n: shard_state(params[n], meshes[n]) for n in params}
    opts = {n: zero1_adamw(schedule, meshes[n], p[n], weight_decay=0.01, clip_norm=1.0)
            for n in params}
    s = {n: opts[n].init(p[n]) for n in params}
    for g_host in steps:
        g = {n: shard_state(g_host[n], meshes[n]) for n in params}
        norm = global_grad_norm([g[n] for n in params])
        np.testing.assert_allclose(norm, optax.tree.norm(g_host), rtol=1e-6)
        for n in params:
            p[n], s[n] = opts[n].update(p[n], g[n], s[n], global_grad_norm=norm)
    for n in params:
        for got, want in zip(jax.tree.leaves(p[n]), jax.tree.leaves(ref_p[n])):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=0)
        # params keep their TP sharding (replicated over dp), fp32; state leaves carry 'dp'
        # except the 1-D tp-sharded biases (no unsharded dimension left).
        specs = mesh_param_specs(params[n], meshes[n])
        for got, spec in zip(jax.tree.leaves(p[n]), jax.tree.leaves(specs, is_leaf=_is_spec)):
            assert got.sharding.spec == spec and got.dtype == jnp.float32
        for x in jax.tree.leaves(s[n][0][0].mu) + jax.tree.leaves(s[n][0][0].nu):
            spec = tuple(x.sharding.spec)
            assert ("dp" in spec) == (dp > 1 and not (x.ndim == 1 and "tp" in spec))


def test_zero1_state_bytes_shrink_by_dp_and_hlo():
    params = _two_stages()["llm"]
    schedule = learning_rate_schedule(10)
    bytes_, args = {}, {}
    for dp in (1, 4):
        mesh = _mesh(dp, 1)
        p = shard_state(params, mesh)
        opt = zero1_adamw(schedule, mesh, p)
        s = opt.init(p)
        bytes_[dp] = state_bytes_per_device(s)
        compiled = opt.lower_update(p, p, s).compile()
        args[dp] = compiled.memory_analysis().argument_size_in_bytes
        if dp == 4:
            hlo = compiled.as_text()
            assert "all-gather" in hlo  # new params gathered from the dp shards
            assert "all-reduce" not in hlo  # grads arrive reduced: no full-state reduction
    n = sum(x.size for x in jax.tree.leaves(params))
    # On a ('dp', 'cp', 'tp') mesh the state is split over dp x cp.
    cp_mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2, 1), ("dp", "cp", "tp"))
    p = shard_state(params, cp_mesh)
    s = zero1_adamw(schedule, cp_mesh, p).init(p)
    assert state_bytes_per_device(s) == bytes_[4]
    assert s[0][0].mu["layers"][0]["wq"].sharding.spec == P(("dp", "cp"), None)
    counts = 2 * 4  # int32 step counts of scale_by_adam and scale_by_schedule, replicated
    assert bytes_[1] == 2 * 4 * n + counts  # mu, nu (fp32)
    assert bytes_[4] == 2 * 4 * n // 4 + counts  # every TINY_LLM dim divides by 4
    # Per-device arguments: full params + full grads + a quarter of the state (+ norm).
    assert args[4] == 2 * 4 * n + bytes_[4] + 4
    assert args[1] == 2 * 4 * n + bytes_[1] + 4


def test_zero1_frozen_stage_has_no_state():
    mesh = _mesh(2, 2)
    frozen = nnx.state(LLM(TINY_LLM, jax.random.key(0), 0, 1), nnx.Not(nnx.Param))
    assert not jax.tree.leaves(frozen)
    opt = zero1_adamw(learning_rate_schedule(10), mesh, frozen)
    s = opt.init(frozen)
    assert s == optax.EmptyState() and state_bytes_per_device(s) == 0
    assert opt.update(frozen, frozen, s, global_grad_norm=1.0) == (frozen, s)
    grads = shard_state(_grads(_two_stages()["vision"], 0, 1.0), mesh)
    np.testing.assert_allclose(global_grad_norm([frozen, grads]), optax.tree.norm(grads),
                               rtol=1e-6)


def test_zero1_rejects_non_fp32_master_weights():
    params = {"w": jnp.ones((4, 4), jnp.bfloat16)}
    with pytest.raises(ValueError, match=r"\['w'\].*bfloat16.*float32"):
        Zero1Optimizer(optax.sgd(0.1), _mesh(2, 1), params)


def test_zero1_local_norm_when_single_stage():
    """Without a shared norm, a stage clips by its own norm: equals make_optimizer."""
    params = _two_stages()["vision"]
    mesh = _mesh(2, 2)
    g = _grads(params, 3, 0.5)
    tx = make_optimizer(1e-2, clip_norm=1.0)
    want = jax.jit(lambda p, g: optax.apply_updates(p, tx.update(g, tx.init(p), p)[0]))(
        params, g)  # one program, not one per eager op
    p = shard_state(params, mesh)
    opt = zero1_adamw(1e-2, mesh, p, clip_norm=1.0)
    got, _ = opt.update(p, shard_state(g, mesh), opt.init(p))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=0)
    assert re.search(r"dp", str(jax.tree.leaves(opt.state_specs, is_leaf=_is_spec)))


@pytest.mark.parametrize("shape,names", [((2, 2), ("dp", "tp")),
                                         ((2, 2, 2), ("dp", "cp", "tp"))])
def test_zero1_reduce_scatter_of_dp_partial_grads(shape, names):
    """dp-partial grads [dp, ...] reduce-scatter into the state shards; the update from the
    shards equals the update from the summed, replicated grads."""
    params = _two_stages()["llm"]
    mesh = Mesh(np.array(jax.devices()[:int(np.prod(shape))]).reshape(shape), names)
    p = shard_state(params, mesh)
    opt = zero1_adamw(1e-2, mesh, p, clip_norm=1.0)
    s = opt.init(p)
    dp = opt.dp
    assert dp == int(np.prod(shape[:-1]))
    parts = [_grads(params, 10 + r, 0.1) for r in range(dp)]
    partial = jax.device_put(jax.tree.map(lambda *g: jnp.stack(g), *parts),
                             opt.partial_shardings)
    shards, sq = opt.reduce_scatter(partial)
    summed = jax.tree.map(lambda *g: sum(g), *parts)
    np.testing.assert_allclose(np.sqrt(sq), optax.tree.norm(summed), rtol=1e-6)
    for g, spec in zip(jax.tree.leaves(shards), jax.tree.leaves(opt.shard_specs,
                                                                 is_leaf=_is_spec)):
        assert g.sharding.spec == spec
    got, got_s = opt.update_from_shards(p, shards, s, np.sqrt(sq))
    want, want_s = opt.update(p, shard_state(summed, mesh), s)
    for a, b in zip(jax.tree.leaves((got, got_s)), jax.tree.leaves((want, want_s))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=0)
    hlo = opt._reduce_scatter.lower(partial).compile().as_text()
    dp_entry = "dp" if len(shape) == 2 else ("dp", "cp")
    split = sum(dp_entry in tuple(spec)
                for spec in jax.tree.leaves(opt.shard_specs, is_leaf=_is_spec))
    assert split == len(jax.tree.leaves(params)) - 6  # all but the tp-sharded q/k/v biases
    assert 0 < len(re.findall(r"\breduce-scatter\(", hlo)) <= split


def test_zero1_update_reshards_grads_with_other_shardings():
    """Grads replicated over tp (or on one device) are resharded, not rejected by jit."""
    params = _two_stages()["vision"]
    mesh = _mesh(2, 2)
    p = shard_state(params, mesh)
    opt = zero1_adamw(1e-2, mesh, p)
    s = opt.init(p)
    g = _grads(params, 4, 0.1)
    want, _ = opt.update(p, shard_state(g, mesh), s)
    got, _ = opt.update(p, g, s)  # single-device grads
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        # (the local norm is reduced in another order on one device: not bit-equal): within
        # 1e-7, or one float32 rounding where that is finer than the values' spacing
        a_, b_ = np.asarray(a), np.asarray(b)
        bound = np.maximum(1e-7, np.spacing(np.abs(b_)))
        assert (np.abs(a_ - b_) <= bound).all(), np.abs(a_ - b_).max()
        assert a.sharding == b.sharding
