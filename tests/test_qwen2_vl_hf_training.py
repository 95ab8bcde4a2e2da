"""A whole Qwen2-VL checkpoint trains as transformers runs it (issue 26): image tokens
under the LLM's causal mask, each image wrapped in the checkpoint's own vision_start /
vision_end tokens. The training path's forward (an assembled batch through the model's
own blocks, and its loss) gives `hf_forward`'s logits on the same tokens and pixels, and
`hf_forward` is transformers' within 1e-4 (tests/test_qwen2_vl.py). mmjax's bidirectional
image mask with its own markers stays available and differs."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mmjax.data.assemble import assemble
from mmjax.data.qwen2_vl_processor import patchify
from mmjax.data.sample import Sample, Segment, SpecialTokens
from mmjax.models import hf
from mmjax.models.llm import meta_attend
from mmjax.models.mllm import MultimodalModel, encode, llm_embed, llm_meta
from mmjax.train.data_config import data_layout
from mmjax.train.inputs import model_inputs

DATA = os.path.join(os.path.dirname(__file__), "data", "qwen2_vl")
IMAGE, VSTART, VEND = 250, 252, 253  # the fixture checkpoints' config.json ids


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def loaded(request):
    return hf.load(os.path.join(DATA, f"{request.param}_tf5"))


def _sample():
    rng = np.random.default_rng(3)
    text = lambda n: rng.integers(3, 240, n).astype(np.int32)
    images = [rng.standard_normal((56, 84, 3)).astype(np.float32),  # 4 x 6 patches of 14
              rng.standard_normal((28, 56, 3)).astype(np.float32)]  # 2 x 4
    return Sample(0, (Segment("text", text(5)), Segment("image", images[0]),
                      Segment("text", text(3)), Segment("image", images[1]),
                      Segment("text", text(4)))), images


def _training_logits_and_loss(model, cfg, inputs, family):
    """The LLM logits of the training forward (MultimodalModel.__call__'s own blocks) and the
    model's training loss, as one jitted program."""
    def logits_and_loss(model, inputs):
        enc = encode(cfg.encoder("vision"), model.encoders["vision"],
                     model.projectors["vision"], inputs["encoders"]["vision"])
        x = llm_embed(cfg, model.llm, inputs, {"vision": enc})
        h = model.llm.run_layers(x, inputs["positions"], meta_attend(llm_meta(inputs), "dense",
                                                                     family))
        loss, _ = model(inputs, attention_impl="dense", llm_mask_family=family)
        return model.llm.logits(model.llm.final_hidden(h)), loss

    logits, loss = nnx.jit(logits_and_loss)(model, inputs)
    return np.asarray(logits), float(loss)


def _log_softmax(z):
    z = z.astype(np.float64)
    m = z.max(-1, keepdims=True)
    return z - m - np.log(np.exp(z - m).sum(-1, keepdims=True))


@pytest.mark.parametrize("semantics", ["hf", "mmjax"])
def test_training_forward_is_transformers_forward(loaded, semantics):
    model, cfg = hf_model, _ = loaded
    assert cfg.image_attention == "causal" and cfg.image_markers == (VSTART, VEND)
    assert cfg.modality_markers
    if semantics == "mmjax":
        cfg = cfg.replace(image_attention="bidirectional", image_markers=None)
        model = nnx.merge(nnx.graphdef(nnx.eval_shape(lambda: MultimodalModel(
            cfg, jax.random.key(0)))), nnx.state(model))
    sample, images = _sample()
    special = SpecialTokens(bos=1, eos=2, first_text=0, image_start=120, image_end=121)
    layout = data_layout(cfg, seq_len=64, vision_caps=(64,), special=special)
    batch = assemble([sample], layout)
    inputs = model_inputs(batch)
    n = int((batch.doc[0] != 0).sum())
    tokens = batch.tokens[0, :n].copy()
    is_image = batch.gather["vision"][0, :n] >= 0
    tokens[is_image] = IMAGE  # HF's image_pad at the image positions
    starts = np.flatnonzero(np.diff(is_image.astype(int)) == 1)  # the token before each run
    ends = np.flatnonzero(np.diff(is_image.astype(int)) == -1) + 1
    assert len(starts) == len(ends) == 2 and is_image.sum() == 6 + 2
    pixels = np.concatenate([patchify(im.transpose(2, 0, 1), 14, 2, 2)[0] for im in images])
    grid = np.array([[1, 4, 6], [1, 2, 4]])
    # token ids and the grid shape the program (positions, image slots): constants of it
    want = np.asarray(nnx.jit(lambda m: hf.hf_forward(
        m, input_ids=tokens[None], pixel_values=pixels, image_grid_thw=grid)["logits"])(
            hf_model))[0]
    got, loss = _training_logits_and_loss(model, cfg, inputs, layout.llm_mask_family)
    got = got[0, :n]
    err = float(np.abs(got - want).max() / np.abs(want).max())
    lp = _log_softmax(want)
    tgt, mask = batch.targets[0, :n], batch.loss_mask[0, :n] > 0
    ref_loss = -lp[np.flatnonzero(mask), tgt[mask]].mean()
    if semantics == "hf":
        # the layout is transformers': <|vision_start|> image_pad... <|vision_end|>
        np.testing.assert_array_equal(tokens[starts], [VSTART] * 2)
        np.testing.assert_array_equal(tokens[ends], [VEND] * 2)
        assert err < 1e-5, err
        assert abs(float(loss) - ref_loss) / ref_loss < 1e-5
    else:  # mmjax's own markers and bidirectional image blocks: not transformers' model
        assert set(tokens[starts]) == {120} and err > 1e-3


def test_pretrained_model_qwen2_vl_run_uses_hf_semantics():
    """`pretrained.model = DIR` (a whole Qwen2-VL) configures the run as transformers runs
    it, whatever the gin model said; a lone tower or LLM from elsewhere does not."""
    from mmjax.models.hf.pretrained import expand_whole_model, pretrained_config
    from mmjax.models.tiny import tiny_qwen2_vl

    d = os.path.join(DATA, "qwen2_vl_tf5")
    base = tiny_qwen2_vl()
    assert base.image_attention == "bidirectional" and base.image_markers is None
    cfg = pretrained_config(base, expand_whole_model({"model": d}))
    assert cfg.image_attention == "causal" and cfg.image_markers == (VSTART, VEND)
    layout = data_layout(cfg, seq_len=64, vision_caps=(64,))
    assert (layout.special.image_start, layout.special.image_end) == (VSTART, VEND)
    only_tower = pretrained_config(base, {"vision": d})
    assert only_tower.image_attention == "bidirectional" and only_tower.image_markers is None


def test_cached_greedy_decoding_is_transformers_forward(loaded):
    """scripts/generate.py's decoding (prefill + KV-cache steps) of a prompt with two images:
    each step's logits are transformers' forward over the prompt and the tokens so far (M-RoPE
    positions of `get_rope_index` over the whole sequence: generated tokens run ahead of
    their cache slots by the images' rope delta), so 16 greedy tokens are transformers'."""
    from mmjax.models.decode import decode_step, generate, next_rope_position, prefill

    model, cfg = loaded
    sample, images = _sample()
    special = SpecialTokens(bos=1, eos=2, first_text=0, image_start=120, image_end=121)
    layout = data_layout(cfg, seq_len=64, vision_caps=(64,), special=special)
    batch = assemble([sample], layout)
    inputs = model_inputs(batch)
    p = int((batch.doc[0] != 0).sum()) - 1  # the prompt, without the document's eos
    tokens = batch.tokens[0, :p].copy()
    tokens[batch.gather["vision"][0, :p] >= 0] = IMAGE
    pixels = np.concatenate([patchify(im.transpose(2, 0, 1), 14, 2, 2)[0] for im in images])
    grid = np.array([[1, 4, 6], [1, 2, 4]])
    out = generate(model, inputs, p, 16, vocab=IMAGE)  # image / video ids never generated
    seq = np.concatenate([tokens, np.asarray(out, tokens.dtype)])[None]
    want = np.asarray(hf.hf_forward(model, input_ids=seq, pixel_values=pixels,
                                    image_grid_thw=grid)["logits"])[0, p - 1:]
    assert [int(t) for t in want[:16].argmax(-1)] == out
    graphdef, state = nnx.split(model)
    logits, cache = prefill(graphdef, state, inputs, p, p + 16)
    rope = next_rope_position(jnp.asarray(inputs["positions"]), p)
    assert int(rope[0]) < p  # two images: fewer positions than tokens
    got = [np.asarray(logits[0])]
    for t in range(15):
        logits, cache = decode_step(graphdef, state, jnp.asarray([out[t]], jnp.int32),
                                    jnp.int32(p + t), cache, rope + t)
        got.append(np.asarray(logits[0]))
    got = np.stack(got)
    assert np.abs(got - want[:16]).max() / np.abs(want[:16]).max() < 1e-5
