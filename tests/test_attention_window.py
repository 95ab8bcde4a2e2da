"""Sliding windows, logit soft-capping and the logit scale in every attention implementation.

Each implementation (dense, chunked, Pallas in interpret mode) is compared, forward and
gradients, with a float64 NumPy formula under the bitfield mask narrowed to the window
(idx_q - idx_k < window, HF's sliding_window). The window is also given as a traced value
(a layer scan's per-layer window). The Pallas kernel's own visit counter shows the tiles
outside the window are skipped. cuDNN (GPU only) is chosen only where it can express the
options. The GPU-only test below adds what a CPU cannot run (cuDNN, the Triton lowering of the
same Pallas kernel); the kernel's logic itself is covered here on CPU.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mmjax.models.attention import (AttnOptions, TokenMeta, bam_attention, causal_meta,
                                    choose_implementation)
from mmjax.models.attention_chunked import chunked_attention
from mmjax.models.attention_pallas import pallas_attention, visited_tiles
from mmjax.data import token_distribution as td

S, PAD, H, KV, D = 72, 6, 4, 2, 8
WINDOW, SOFTCAP, SCALE = 9, 1.5, 0.4


def _meta(seq_len, pad):
    rows = [td.example_mask(f, seq_len - pad, i) for i, f in enumerate(td.FAMILIES)]
    cols = [np.stack([np.pad(getattr(m, f), (0, pad)) for m in rows]) for f in ("bam", "doc", "sub")]
    idx = np.broadcast_to(np.arange(seq_len), cols[0].shape)
    return TokenMeta(*(np.asarray(a, np.int32) for a in (*cols, idx)))


def reference(q, k, v, ct, m, window, softcap, scale):
    """float64 attention under the window-narrowed mask with capped, scaled logits, and its
    VJP for cotangent ct: (out, dq, dk, dv)."""
    mask = td.allowed(m.bam, m.bam, m.idx, m.idx, m.doc, m.doc, m.sub, m.sub)
    if window is not None:
        mask = mask & (m.idx[:, :, None] - m.idx[:, None, :] < window)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    g = q.shape[2] // k.shape[2]
    kk, vv = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    raw = np.einsum("bqhd,bkhd->bhqk", q, kk) * scale
    s = raw if softcap is None else softcap * np.tanh(raw / softcap)
    dcap = 1.0 if softcap is None else 1 - np.tanh(raw / softcap) ** 2
    mm = mask[:, None]
    s = np.where(mm, s, -np.inf)
    mx = np.max(s, axis=-1, keepdims=True)
    p = np.where(mm, np.exp(s - np.where(np.isfinite(mx), mx, 0)), 0.0)
    den = p.sum(-1, keepdims=True)
    p = np.where(den > 0, p / np.where(den > 0, den, 1), 0.0)
    out = np.einsum("bhqk,bkhd->bqhd", p, vv)
    dp = np.einsum("bqhd,bkhd->bhqk", ct, vv)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True)) * dcap * scale
    dq = np.einsum("bhqk,bkhd->bqhd", ds, kk)
    fold = lambda x: x.reshape(x.shape[0], x.shape[1], k.shape[2], g, q.shape[-1]).sum(3)
    return (out, dq, fold(np.einsum("bhqk,bqhd->bkhd", ds, q)),
            fold(np.einsum("bhqk,bqhd->bkhd", p, ct)))


IMPLS = {
    "dense": lambda *a, **o: bam_attention(*a, implementation="dense", options=AttnOptions(**o)),
    "chunked": lambda *a, **o: chunked_attention(*a, block_q=16, block_k=32, **o),
    "pallas": lambda *a, **o: pallas_attention(*a, block_q=32, block_k=16, **o),
}


@pytest.fixture(scope="module")
def case():
    meta = _meta(S, PAD)
    r = np.random.default_rng(0)
    b = len(td.FAMILIES)
    q, ct = r.normal(size=(b, S, H, D)), r.normal(size=(b, S, H, D))
    k, v = r.normal(size=(b, S, KV, D)), r.normal(size=(b, S, KV, D))
    return (q, k, v, ct, meta), reference(q, k, v, ct, meta, WINDOW, SOFTCAP, SCALE)


# (window, softcap, scale): all three, then each path alone (Mistral's plain window, Gemma 2's
# global layers' soft-cap without a window)
OPTIONS = {"all": (WINDOW, SOFTCAP, SCALE), "window": (WINDOW, None, None),
           "softcap": (None, SOFTCAP, None)}


# The traced window (a scan's per-layer one) runs by default with all options on; alone it
# runs in the slow pass.
CASES = [pytest.param(opts, impl, traced, id=f"{opts}-{impl}-{traced}",
                      marks=[pytest.mark.slow] if traced and opts != "all" else [])
         for opts in OPTIONS for impl in ("dense", "chunked", "pallas") for traced in (False, True)
         if not (traced and OPTIONS[opts][0] is None)]


@pytest.mark.parametrize("opts,impl,traced", CASES)
def test_window_softcap_scale_equal_the_formula(case, impl, traced, opts):
    """Every CPU-runnable implementation (Pallas in interpret mode) against the float64
    formula, forward and all three gradients, for each option alone and together."""
    (q, k, v, ct, meta), want = case
    window, softcap, scale = OPTIONS[opts]
    if opts != "all":
        want = reference(q, k, v, ct, meta, window, softcap, scale)
    m = TokenMeta(*(jnp.asarray(a) for a in meta))
    f = IMPLS[impl]

    @jax.jit
    def fwd_bwd(q, k, v, ct, traced_window):
        w = traced_window if traced else window
        out, vjp = jax.vjp(lambda *a: f(*a, m, m, window=w, softcap=softcap, scale=scale),
                           q, k, v)
        return (out, *vjp(ct))

    got = fwd_bwd(*(jnp.asarray(x, jnp.float32) for x in (q, k, v, ct)),
                  jnp.int32(window or 0))
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        np.testing.assert_allclose(np.asarray(g, np.float64), w, rtol=1e-5,
                                   atol=1e-5 * np.abs(w).max(), err_msg=name)


def test_the_window_changes_the_result(case):
    (q, k, v, ct, meta), want = case
    wide = reference(q, k, v, ct, meta, 10 ** 6, SOFTCAP, SCALE)
    assert np.abs(wide[0] - want[0]).max() > 1e-2
    uncapped = reference(q, k, v, ct, meta, WINDOW, None, SCALE)
    assert np.abs(uncapped[0] - want[0]).max() > 1e-2  # and so does the soft-cap


def test_pallas_skips_tiles_outside_the_window():
    """Causal text of 512 tokens in 16 x 16 tiles: with a 40-token window each query block
    visits only the tiles that hold a pair inside the window (at most 4 of up to 32)."""
    s, blk, window = 512, 16, 40
    meta = causal_meta(jnp.ones((1, s), jnp.int32))
    x = jnp.zeros((1, s, 1, 8), jnp.float32)
    run = lambda w: np.asarray(jax.jit(lambda x: visited_tiles(
        x, x, x, meta, meta, block_q=blk, block_k=blk, window=w))(x))[0, 0]
    full, windowed = run(None), run(window)
    i = np.arange(s)
    allowed = (i[None] <= i[:, None]) & (i[:, None] - i[None] < window)
    nb = s // blk
    want = allowed.reshape(nb, blk, nb, blk).any(axis=(1, 3)).sum(axis=1)
    np.testing.assert_array_equal(windowed, want)
    np.testing.assert_array_equal(full, np.arange(1, nb + 1))
    assert windowed.max() <= 4 and windowed.sum() < 0.25 * full.sum()  # 122 of 528


def test_cudnn_only_where_it_expresses_the_options():
    bf16 = jnp.bfloat16
    pick = lambda fam, **o: choose_implementation("auto", 4096, 4096, bf16, fam, platform="gpu",
                                                  options=AttnOptions(**o))
    assert pick("causal") == "cudnn"
    assert pick("causal", window=512) == "cudnn"  # a static left window on a causal mask
    assert pick("causal", window=jnp.int32(512)) == "pallas"  # traced: a scan's per-layer one
    assert pick("causal", softcap=50.0) == "pallas"  # no soft-capping in cuDNN
    assert pick("full", window=512) == "pallas"
    for opts, match in (({"softcap": 50.0}, "soft-capping"),
                        ({"window": jnp.int32(8)}, "static sliding window")):
        with pytest.raises(ValueError, match=match) as err:
            choose_implementation("cudnn", 64, 64, bf16, "causal", platform="gpu",
                                  options=AttnOptions(**opts))
        assert "\n" not in str(err.value)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN and Triton need a GPU")
def test_gpu_cudnn_window_and_triton_kernel_equal_dense():
    """On a GPU: cuDNN's left window and the Triton-lowered Pallas kernel (window, soft-cap,
    traced window) against the dense path, bf16 forward and gradients."""
    b, s, h, kv, d = 2, 512, 4, 2, 64
    r = np.random.default_rng(1)
    q = jnp.asarray(r.normal(size=(b, s, h, d)), jnp.bfloat16)
    k, v = (jnp.asarray(r.normal(size=(b, s, kv, d)), jnp.bfloat16) for _ in range(2))
    lengths = np.array([s, s - 37])
    meta = causal_meta(jnp.asarray(np.arange(s)[None] < lengths[:, None], jnp.int32))

    def grads(impl, opts):
        f = lambda q, k, v: bam_attention(q, k, v, meta, implementation=impl,
                                          mask_family="causal", options=opts)
        loss = lambda q, k, v: (f(q, k, v).astype(jnp.float32) ** 2).sum()
        return jax.jit(lambda q, k, v: (f(q, k, v), *jax.grad(loss, (0, 1, 2))(q, k, v)))(q, k, v)

    for impl, opts in (("cudnn", AttnOptions(window=100)),
                       ("pallas", AttnOptions(window=100, softcap=20.0, scale=0.1)),
                       ("pallas", AttnOptions(window=jnp.int32(100)))):
        got, want = grads(impl, opts), grads("dense", opts)
        for g, w in zip(got, want):
            g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
            np.testing.assert_allclose(g, w, atol=3e-2 * np.abs(w).max(), rtol=3e-2)


def test_a_models_attention_options_validate_the_choice_up_front():
    """What pipeline stages check before any work: a Gemma 2 LLM (soft-caps) never runs on
    cuDNN; a scanned local/global stack passes a traced window."""
    from mmjax.models.config import LLMConfig
    from mmjax.models.llm import attention_options
    cfg = LLMConfig(vocab_size=8, hidden_size=16, num_layers=4, num_heads=2, num_kv_heads=1,
                    ffn_size=8, sliding_window=64, sliding_layers=(True, False) * 2,
                    attn_softcap=50.0)
    assert attention_options(cfg) == [AttnOptions(None, 50.0, None), AttnOptions(64, 50.0, None)]
    scanned = attention_options(LLMConfig(**{**cfg.__dict__, "scan_layers": True,
                                             "attn_softcap": None}))
    assert len(scanned) == 1 and not isinstance(scanned[0].window, int)
    with pytest.raises(ValueError, match="soft-capping"):
        for options in attention_options(cfg):
            choose_implementation("cudnn", 1, 1, jnp.bfloat16, "causal", platform="gpu",
                                  options=options)
