"""bam_attention: every implementation equals a float64 numpy reference (Cornstarch §4.3.1).

One batch holds a row of each mask family (Cornstarch Fig. 11 plus plain causal) with padding
at the end (fully masked query rows), grouped-query heads, and a length that is not a multiple
of any block; forward and gradients are compared with the softmax-attention formula in float64.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mmjax.errors import UserError
from mmjax.models.attention import (TokenMeta, bam_attention, choose_implementation,
                                    segment_meta)
from mmjax.models.attention_chunked import chunked_attention
from mmjax.models.attention_pallas import pallas_attention, visited_tiles
from mmjax.data import token_distribution as td

S, PAD, H, KV, D = 72, 6, 4, 2, 8  # 72 is not a multiple of the 16/32 blocks below


def _meta(seq_len, pad, seed0=0):
    rows = [td.example_mask(f, seq_len - pad, seed0 + i) for i, f in enumerate(td.FAMILIES)]
    cols = [np.stack([np.pad(getattr(m, f), (0, pad)) for m in rows]) for f in ("bam", "doc", "sub")]
    idx = np.broadcast_to(np.arange(seq_len), cols[0].shape)
    return TokenMeta(*(np.asarray(a, np.int32) for a in (*cols, idx)))


def _inputs(b, sq, sk, h, kv, seed=0):
    r = np.random.default_rng(seed)
    return (r.normal(size=(b, sq, h, D)), r.normal(size=(b, sk, kv, D)),
            r.normal(size=(b, sk, kv, D)), r.normal(size=(b, sq, h, D)))


def reference(q, k, v, ct, mq, mk):
    """float64 softmax attention over allowed keys and its VJP for cotangent ct (zeros for
    queries with no allowed key): (out, dq, dk, dv)."""
    mask = td.allowed(mq.bam, mk.bam, mq.idx, mk.idx, mq.doc, mk.doc, mq.sub, mk.sub)
    g = q.shape[2] // k.shape[2]
    kk, vv = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)  # head h uses kv head h // g
    s = np.einsum("bqhd,bkhd->bhqk", q, kk) / np.sqrt(q.shape[-1])
    m = mask[:, None]
    s = np.where(m, s, -np.inf)
    mx = np.max(s, axis=-1, keepdims=True)
    p = np.where(m, np.exp(s - np.where(np.isfinite(mx), mx, 0)), 0.0)
    den = p.sum(-1, keepdims=True)
    p = np.where(den > 0, p / np.where(den > 0, den, 1), 0.0)
    out = np.einsum("bhqk,bkhd->bqhd", p, vv)
    dp = np.einsum("bqhd,bkhd->bhqk", ct, vv)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True)) / np.sqrt(q.shape[-1])
    dq = np.einsum("bhqk,bkhd->bqhd", ds, kk)
    fold = lambda x: x.reshape(x.shape[0], x.shape[1], k.shape[2], g, q.shape[-1]).sum(3)
    dk = fold(np.einsum("bhqk,bqhd->bkhd", ds, q))
    dv = fold(np.einsum("bhqk,bqhd->bkhd", p, ct))
    return out, dq, dk, dv


IMPLS = {
    "dense": lambda q, k, v, mq, mk: bam_attention(q, k, v, mq, mk, implementation="dense"),
    "chunked": lambda q, k, v, mq, mk: chunked_attention(q, k, v, mq, mk, block_q=16, block_k=32),
    "pallas": lambda q, k, v, mq, mk: pallas_attention(q, k, v, mq, mk, block_q=32, block_k=16),
}


def _run(impl, dtype, q, k, v, ct, mq, mk):
    f = IMPLS[impl]
    cast = lambda x: jnp.asarray(x, dtype)
    mq, mk = (TokenMeta(*(jnp.asarray(a) for a in m)) for m in (mq, mk))

    @jax.jit
    def fwd_bwd(q, k, v, ct):
        out, vjp = jax.vjp(lambda *a: f(*a, mq, mk), q, k, v)
        return (out, *vjp(ct))

    return [np.asarray(x, np.float64) for x in fwd_bwd(cast(q), cast(k), cast(v), cast(ct))]


def _check(got, want, rtol):
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        scale = np.abs(w).max()
        np.testing.assert_allclose(g, w, rtol=rtol, atol=rtol * scale, err_msg=name)


@pytest.fixture(scope="module")
def self_attention_case():
    meta = _meta(S, PAD)
    q, k, v, ct = _inputs(len(td.FAMILIES), S, S, H, KV)
    return (q, k, v, ct, meta, meta), reference(q, k, v, ct, meta, meta)


@pytest.mark.parametrize("impl", ["dense", "chunked", "pallas"])
def test_float32_equals_float64_reference(self_attention_case, impl):
    args, want = self_attention_case
    got = _run(impl, jnp.float32, *args)
    _check(got, want, 1e-5)
    pad_rows = args[4].doc == 0
    assert pad_rows.any()
    for x in got[:2]:  # fully masked queries: zero output and zero gradient
        assert np.all(x[pad_rows] == 0)


@pytest.mark.parametrize("impl", ["dense", "chunked", "pallas"])
def test_bfloat16_within_its_tolerance(self_attention_case, impl):
    args, want = self_attention_case
    _check(_run(impl, jnp.bfloat16, *args), want, 3e-2)


def test_cross_attention_and_uneven_lengths_chunked():
    """Projector-style cross-attention: 10 queries in 2 item slots over 37 encoder tokens."""
    slot = np.repeat([1, 2], 5)[None].repeat(2, 0).astype(np.int32)
    seg = np.array([[1] * 15 + [2] * 20 + [0] * 2, [1] * 30 + [0] * 7], np.int32)
    mq = TokenMeta(np.full_like(slot, 2), slot, slot, np.zeros_like(slot))
    mk = TokenMeta(*(np.asarray(a) for a in segment_meta(jnp.asarray(seg))))
    q, k, v, ct = _inputs(2, 10, 37, 2, 2, seed=3)
    want = reference(q, k, v, ct, mq, mk)
    _check(_run("chunked", jnp.float32, q, k, v, ct, mq, mk), want, 1e-5)
    assert np.all(want[0][1, 5:] == 0)  # slot 2 of row 2 has no item: zeros


def test_visited_tiles_equal_nonempty_tiles_and_skip_the_embedded_mask():
    """The kernel's own visit counter equals the non-empty tiles of the dense mask, and on
    Cornstarch's embedded-encoder mask it does under half the dense tile work (16 x 16 tiles:
    the causal text part alone costs about half plus the diagonal's 1/nb)."""
    s, blk = 512, 16
    m = td.example_mask("embedded", s, 5)
    meta = TokenMeta(*(np.asarray(a, np.int32)[None] for a in (m.bam, m.doc, m.sub, np.arange(s))))
    q, k, v, _ = _inputs(1, s, s, 1, 1)
    f = jax.jit(lambda q, k, v: visited_tiles(q, k, v, meta, meta, block_q=blk, block_k=blk))
    visits = np.asarray(f(*(jnp.asarray(x, jnp.float32) for x in (q, k, v))))[0, 0]
    nb = s // blk
    want = m.dense().reshape(nb, blk, nb, blk).any(axis=(1, 3)).sum(axis=1)
    np.testing.assert_array_equal(visits, want)
    assert visits.sum() < 0.5 * nb * nb, visits


def test_auto_choice_and_clear_errors():
    assert choose_implementation("auto", 128, 128, jnp.float32, platform="cpu") == "dense"
    assert choose_implementation("auto", 8192, 8192, jnp.float32, platform="cpu") == "chunked"
    assert choose_implementation("auto", 4096, 4096, jnp.bfloat16, "causal", "gpu") == "cudnn"
    assert choose_implementation("auto", 4096, 4096, jnp.bfloat16, "bam", "gpu") == "pallas"
    assert choose_implementation("auto", 4096, 4096, jnp.float32, "causal", "gpu") == "pallas"
    assert choose_implementation("auto", 256, 256, jnp.bfloat16, "bam", "gpu") == "dense"
    assert choose_implementation("auto", 1024, 77, jnp.bfloat16, "full", "gpu") == "cudnn"
    assert choose_implementation("auto", 1024, 77, jnp.float32, "full", "gpu") == "dense"
    with pytest.raises(UserError, match="attention implementation 'cudnn' needs a GPU"):
        choose_implementation("cudnn", 64, 64, jnp.bfloat16, "causal", platform="cpu")
    with pytest.raises(UserError, match="only plain causal"):
        choose_implementation("cudnn", 64, 64, jnp.bfloat16, "bam", platform="gpu")
    with pytest.raises(UserError, match="'flash' is unknown"):
        choose_implementation("flash", 64, 64, jnp.float32)
    meta = segment_meta(jnp.ones((1, 8), jnp.int32))
    x = jnp.zeros((1, 8, 2, 4))
    with pytest.raises(UserError, match="needs a GPU"):
        bam_attention(x, x, x, meta, implementation="cudnn", mask_family="causal")


def test_the_generator_attends_as_the_full_mask_family():
    """The DiT's self- and cross-attention declare mask_family="full", so on a GPU "auto"
    runs them on cuDNN; here "cudnn" is refused only for the platform, not the mask."""
    from mmjax.models.generator import DiffusionGenerator
    from mmjax.models.tiny import tiny

    model = tiny()
    cfg = model.generator
    gen = DiffusionGenerator(cfg, model.llm.hidden_size, jax.random.key(0))
    patches = (cfg.latent_size // cfg.patch_size) ** 2
    args = (jnp.zeros((1, patches, cfg.patch_dim)), jnp.zeros((1,)),
            jnp.zeros((1, 3, model.llm.hidden_size)))
    run = nnx.jit(lambda g, *a, impl: g(*a, attention_impl=impl), static_argnames="impl")
    assert np.isfinite(np.asarray(run(gen, *args, impl="dense"))).all()
    with pytest.raises(UserError, match="needs a GPU"):
        run(gen, *args, impl="cudnn")


def test_token_distribution_weighs_the_kernels_key_tiles():
    from mmjax.models import attention_pallas

    assert td.DEFAULT_KEY_BLOCK == attention_pallas.BLOCK_K


def test_pallas_head_dim_that_is_not_a_power_of_two():
    """SigLIP's head dim is 72: the kernel zero-pads it to 128 for Triton and keeps the
    model's scale, so output and gradients still equal the formula."""
    d = 12
    meta = _meta(S, PAD)
    r = np.random.default_rng(3)
    q, ct = (r.normal(size=(len(td.FAMILIES), S, H, d)) for _ in range(2))
    k, v = (r.normal(size=(len(td.FAMILIES), S, KV, d)) for _ in range(2))
    want = reference(q, k, v, ct, meta, meta)
    got = _run("pallas", jnp.float32, q, k, v, ct, meta, meta)
    assert got[0].shape == q.shape and got[3].shape == v.shape
    _check(got, want, 1e-5)


def _kernel_shapes(jaxpr, out: set) -> None:
    """Every array shape an equation of `jaxpr` (and of the jaxprs inside it) produces."""
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            aval = var.aval
            if hasattr(aval, "shape") and type(aval).__name__ == "ShapedArray":
                out.add(tuple(aval.shape))
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    _kernel_shapes(inner, out)


def test_pallas_kernels_use_only_power_of_two_tiles():
    """Triton lowers a Pallas kernel only if every array it loads, stores or computes has a
    power-of-two size (jax's Triton lowering, `_check_tensor_size`). On an H100 a SigLIP
    encoder (head dim 72) failed there before the head dim was padded; this checks the
    forward and both backward kernels' jaxprs for that rule on CPU."""
    n, d = 200, 72  # a length that is no multiple of the blocks, SigLIP's head dim
    meta = TokenMeta(*(jnp.asarray(a) for a in _meta(n, 8)))
    b = meta.doc.shape[0]
    q = jnp.zeros((b, n, 4, d), jnp.bfloat16)
    kv = jnp.zeros((b, n, 2, d), jnp.bfloat16)
    loss = lambda q, k, v: pallas_attention(q, k, v, meta, meta).astype(jnp.float32).sum()
    closed = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, kv, kv)
    kernels = []

    def find(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                kernels.append(eqn.params["jaxpr"])
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        find(inner)
    find(closed.jaxpr)
    assert len(kernels) == 3  # forward, dK/dV, dQ
    for kernel in kernels:
        shapes = set()
        _kernel_shapes(kernel, shapes)
        bad = [s for s in shapes if int(np.prod(s)) & (int(np.prod(s)) - 1)]
        assert not bad, f"kernel arrays whose size is not a power of two: {bad}"
