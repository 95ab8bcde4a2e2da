"""Model semantics: masks, causality, packing isolation, stage slicing, DAG, bf16 compute.

Models run as jitted programs (tests/jitted.py); one tiny LLM serves the module."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jitted import call

from mmjax.models.attention import allowed_mask, dot_product_attention
from mmjax.models.audio import AudioEncoder
from mmjax.models.generator import DiffusionGenerator
from mmjax.models.llm import LLM, mask_attend
from mmjax.models.projector import CrossAttentionProjector, MLPProjector
from mmjax.models.config import ProjectorConfig
from mmjax.models.mllm import MultimodalModel, trainable_filter
from mmjax.models.tiny import TINY_AUDIO, TINY_GENERATOR, TINY_LLM, TINY_VISION, tiny, tiny_valm
from mmjax.models.vision import VisionEncoder


def dense_reference(bam, doc, sub):
    s = len(bam)
    m = np.zeros((s, s), bool)
    for q in range(s):
        for k in range(s):
            if doc[q] == 0 or doc[q] != doc[k]:
                continue
            if bam[q] & 1:
                m[q, k] = bool(bam[q] & bam[k]) and k <= q
            else:
                m[q, k] = sub[q] != 0 and sub[q] == sub[k]
    return m


def test_bitfield_mask_matches_dense_reference():
    # doc 1: text, image A (2 tokens), text, audio B, text; doc 2: text, image; then padding.
    bam = np.array([7, 2, 2, 7, 4, 4, 5, 1, 3, 2, 2, 0, 0])  # token 6 sees text+audio only
    doc = np.array([1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 0, 0])
    sub = np.array([0, 1, 1, 0, 2, 2, 0, 0, 0, 3, 3, 0, 0])
    idx = np.arange(len(bam))
    got = np.asarray(allowed_mask(*(jnp.asarray(a) for a in (bam, bam, idx, idx, doc, doc, sub, sub))))
    want = dense_reference(bam, doc, sub)
    np.testing.assert_array_equal(got, want)
    assert got[3, 1] and not got[1, 3]            # text sees earlier image; image not text
    assert got[1, 2] and got[2, 1]                # image bidirectional inside itself
    assert not got[6, 1] and got[6, 4]            # bit selects which modality text sees
    assert not got[8, 0] and not got[9, 2]        # packed documents isolated
    assert not got[11].any()                      # padding sees nothing


def test_attention_fully_masked_rows_are_zero_and_gqa_shapes():
    q = jnp.ones((1, 3, 4, 8))
    k = v = jnp.ones((1, 3, 2, 8))
    allowed = jnp.array([[[1, 0, 0], [1, 1, 0], [0, 0, 0]]], bool)
    out = dot_product_attention(q, k, v, allowed)
    assert out.shape == (1, 3, 4, 8)
    np.testing.assert_allclose(out[0, 2], 0.0)
    np.testing.assert_allclose(out[0, 0], 1.0, rtol=1e-6)


def _causal(tokens):
    b, s = tokens.shape
    idx = jnp.broadcast_to(jnp.arange(s), (b, s))
    ones = jnp.ones((b, s), jnp.int32)
    return idx, allowed_mask(ones, ones, idx, idx, ones, ones, 0 * ones, 0 * ones)


@pytest.fixture(scope="module")
def llm():
    return LLM(TINY_LLM, jax.random.key(0))


def test_llm_causal_future_tokens_do_not_change_logits(llm):
    tok = jax.random.randint(jax.random.key(1), (2, 12), 16, 512)
    pos, allowed = _causal(tok)
    base = call(llm, tok, pos, allowed)
    tok2 = tok.at[:, 7:].set(99)
    changed = call(llm, tok2, pos, allowed)
    np.testing.assert_allclose(base[:, :7], changed[:, :7], atol=1e-5)
    assert not np.allclose(base[:, 7:], changed[:, 7:], atol=1e-3)


def test_packed_documents_are_independent(llm):
    a = jax.random.randint(jax.random.key(1), (1, 5), 16, 512)
    b = jax.random.randint(jax.random.key(2), (1, 7), 16, 512)
    packed = jnp.concatenate([a, b], axis=1)
    doc = jnp.array([[1] * 5 + [2] * 7])
    idx = jnp.arange(12)[None]
    pos = jnp.array([list(range(5)) + list(range(7))])
    ones = jnp.ones_like(doc)
    allowed = allowed_mask(ones, ones, idx, idx, doc, doc, 0 * doc, 0 * doc)
    out = call(llm, packed, pos, allowed)
    pa, ma = _causal(a)
    pb, mb = _causal(b)
    np.testing.assert_allclose(out[:, :5], call(llm, a, pa, ma), atol=1e-5)
    np.testing.assert_allclose(out[:, 5:], call(llm, b, pb, mb), atol=1e-5)


def test_vit_segment_isolation():
    vit = VisionEncoder(TINY_VISION, jax.random.key(0))
    pd = TINY_VISION.patch_dim
    patches = jax.random.normal(jax.random.key(1), (1, 10, pd))
    seg = jnp.array([[1, 1, 1, 1, 2, 2, 2, 2, 2, 0]])
    pos = jnp.stack([jnp.array([[0, 0, 1, 1, 0, 0, 0, 1, 1, 0]]),
                     jnp.array([[0, 1, 0, 1, 0, 1, 2, 0, 1, 0]])], -1)
    out = call(vit, patches, seg, pos)
    other = patches.at[:, 4:].set(jax.random.normal(jax.random.key(3), (1, 6, pd)))
    out2 = call(vit, other, seg, pos)
    np.testing.assert_allclose(out[:, :4], out2[:, :4], atol=1e-6)
    assert not np.allclose(out[:, 4:9], out2[:, 4:9], atol=1e-3)
    alone = call(vit, patches[:, :4], seg[:, :4], pos[:, :4])
    np.testing.assert_allclose(out[:, :4], alone, atol=1e-5)


def test_audio_output_independent_of_bucket_capacity():
    enc = AudioEncoder(TINY_AUDIO, jax.random.key(0))
    mels = jax.random.normal(jax.random.key(1), (1, 10, TINY_AUDIO.num_mel_bins))
    small = call(enc, mels, jnp.array([10]))  # capacity == length
    big = call(enc, jnp.pad(mels, ((0, 0), (0, 6), (0, 0)), constant_values=5.0), jnp.array([10]))
    assert small.shape[1] == 5 and big.shape[1] == 8
    np.testing.assert_allclose(small, big[:, :5], atol=1e-5)


@nnx.jit
def _two_stages(s0, s1, tok, pos, allowed):
    attend = mask_attend(allowed)
    h = s1.run_layers(s0.run_layers(s0.embed_tokens(tok), pos, attend), pos, attend)
    return s1.logits(s1.final_hidden(h))


def test_stage_slices_equal_whole_model(llm):
    s0, s1 = LLM(TINY_LLM, jax.random.key(0), 0, 1), LLM(TINY_LLM, jax.random.key(0), 1, 4)
    tok = jax.random.randint(jax.random.key(1), (2, 12), 16, 512)
    pos, allowed = _causal(tok)
    np.testing.assert_allclose(_two_stages(s0, s1, tok, pos, allowed),
                               call(llm, tok, pos, allowed), atol=1e-5)
    g0 = DiffusionGenerator(TINY_GENERATOR, 64, jax.random.key(0), 0, 1)
    gw = DiffusionGenerator(TINY_GENERATOR, 64, jax.random.key(0))
    np.testing.assert_array_equal(g0.layers[0].q.kernel[...], gw.layers[0].q.kernel[...])


def test_projectors_shapes_and_item_isolation():
    mlp = MLPProjector(ProjectorConfig(downsample=2), 32, 64, jax.random.key(0))
    assert call(mlp, jnp.ones((3, 8, 32))).shape == (3, 4, 64)
    with pytest.raises(ValueError, match="downsample"):
        call(mlp, jnp.ones((1, 7, 32)))
    xa = CrossAttentionProjector(ProjectorConfig(kind="cross_attention", num_queries=3,
                                                 num_heads=2, max_items=2), 32, 64, jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (1, 6, 32))
    seg = jnp.array([[1, 1, 1, 2, 2, 0]])
    y = call(xa, x, seg)
    assert y.shape == (1, 6, 64)
    y2 = call(xa, x.at[:, 3:].set(0.0), seg)
    np.testing.assert_allclose(y[:, :3], y2[:, :3], atol=1e-6)
    assert not np.allclose(y[:, 3:], y2[:, 3:], atol=1e-4)


def _batch(cfg, kind):
    from mmjax.data.layout import AssemblyLayout
    from mmjax.data.assemble import assemble
    from mmjax.data.synthetic import SyntheticConfig, SyntheticDataset
    from mmjax.train.inputs import model_inputs

    ds = SyntheticDataset(kind, SyntheticConfig.for_model(cfg, gen_fraction=0.5), seed=3)
    lay = AssemblyLayout.from_config(cfg, 160, "pad", vision_caps=(64, 256),
                                     audio_frame_caps=(128, 256, 512))
    return model_inputs(assemble([ds[i] for i in range(4)], lay))


def _matmul_operand_dtypes(jaxpr, out):
    """(primitive, operand dtypes) of every dot_general / conv, recursing into sub-jaxprs
    (pjit, custom_vjp, remat, ...)."""
    from jax.extend import core as jcore

    for eq in jaxpr.eqns:
        if eq.primitive.name in ("dot_general", "conv_general_dilated"):
            out.append((eq.primitive.name, tuple(str(v.aval.dtype) for v in eq.invars)))
        for p in eq.params.values():
            for sub in (p if isinstance(p, (list, tuple)) else [p]):
                if isinstance(sub, jcore.ClosedJaxpr):
                    _matmul_operand_dtypes(sub.jaxpr, out)
                elif isinstance(sub, jcore.Jaxpr):
                    _matmul_operand_dtypes(sub, out)
    return out


@pytest.mark.parametrize("make,kind", [(tiny, "laion"), (tiny_valm, "mix")],
                         ids=["tiny", "tiny_valm"])
def test_bf16_train_step_runs_every_matmul_in_bf16(make, kind):
    """compute_dtype=bf16: encoders (patches / mels cast like pipeline/stage.py does),
    projectors, LLM, generator and all their backward matmuls take bf16 operands. Traced only,
    so the model and optimizer state are shapes (`eval_shape`)."""
    from mmjax.train.optimizer import learning_rate_schedule, make_optimizer
    from mmjax.train.state import whole_model_state
    from mmjax.train.step import make_train_step, split_model

    cfg = make()
    model = nnx.eval_shape(lambda: MultimodalModel(cfg, jax.random.key(0)))
    graphdef, tr, fr = split_model(model, trainable_filter(cfg))
    tx = make_optimizer(learning_rate_schedule(10))
    state = whole_model_state(tr, jax.eval_shape(tx.init, tr),
                              jax.ShapeDtypeStruct((), jnp.int32))
    jaxpr = jax.make_jaxpr(make_train_step(graphdef, tx, jnp.bfloat16))(state, fr,
                                                                         _batch(cfg, kind))
    ops = _matmul_operand_dtypes(jaxpr.jaxpr, [])
    assert len(ops) > 100
    if kind == "mix":
        assert any(name == "conv_general_dilated" for name, _ in ops)  # the audio convs
    bad = sorted({o for o in ops if o[1] != ("bfloat16", "bfloat16")})
    assert not bad, bad


def test_bf16_loss_and_grads_close_to_float32():
    from mmjax.train.step import make_loss_fn, split_model

    from mmjax.models.config import with_overrides

    cfg = with_overrides(tiny(), {"llm.num_layers": 2})
    batch = _batch(cfg, "laion")
    graphdef, tr, fr = split_model(MultimodalModel(cfg, jax.random.key(0)), trainable_filter(cfg))
    out = {}
    for dt in (jnp.float32, jnp.bfloat16):
        fn = jax.jit(jax.value_and_grad(make_loss_fn(graphdef, dt), has_aux=True))
        (loss, aux), g = fn(tr, fr, batch)
        out[dt] = float(loss), aux, jnp.concatenate([x.ravel() for x in jax.tree.leaves(g)])
    (l32, a32, g32), (l16, a16, g16) = out[jnp.float32], out[jnp.bfloat16]
    assert g16.dtype == jnp.float32  # gradients of the float32 master parameters
    assert l16 != l32  # bf16 really ran
    # bf16 has 8 mantissa bits (eps 2**-8 = 3.9e-3): the loss agrees well inside that
    np.testing.assert_allclose(l16, l32, rtol=4e-3)
    for k in ("lm_loss", "diffusion_loss"):
        np.testing.assert_allclose(float(a16[k]), float(a32[k]), rtol=4e-3)
    assert float(jnp.linalg.norm(g16 - g32) / jnp.linalg.norm(g32)) < 0.05


def _abstract(make, cfg):
    """`make(cfg, key)` with shapes for parameters: for what reads only the structure."""
    return nnx.eval_shape(lambda: make(cfg, jax.random.key(0)))


def test_dag_edges_and_execution_order():
    m = _abstract(MultimodalModel, tiny())
    assert m.dag() == [("vision", "llm"), ("llm", "generator")]
    assert m.execution_order() == ["vision", "llm", "generator"]
    v = _abstract(MultimodalModel, tiny_valm())
    assert v.dag() == [("vision", "llm"), ("audio", "llm")]
    assert v.execution_order() == ["vision", "audio", "llm"]
    order = v.execution_order()
    assert all(order.index(a) < order.index(b) for a, b in v.dag())


class _EdgeDropped(MultimodalModel):
    def dag(self):
        return [e for e in super().dag() if e != ("audio", "llm")]


class _Cyclic(MultimodalModel):
    def dag(self):
        return super().dag() + [("llm", "vision")]


def test_call_walks_the_dag():
    cfg = tiny_valm()
    batch = _batch(cfg, "mix")
    # the call reads the DAG: a missing encoder -> llm edge is an error naming the encoder
    # (raised while tracing, so shapes suffice)
    with pytest.raises(ValueError, match=r"no edge from encoder\(s\) \['audio'\]"):
        nnx.eval_shape(lambda m: m(batch), _abstract(_EdgeDropped, cfg))
    with pytest.raises(ValueError, match="cycle"):
        nnx.eval_shape(lambda m: m(batch), _abstract(_Cyclic, cfg))
    loss, aux = call(MultimodalModel(cfg, jax.random.key(0)), batch)
    assert np.isfinite(float(loss)) and float(aux["lm_loss"]) > 0
