"""Batch assembly contract: exact tables on a hand-built sample, properties on synthetic ones."""
import numpy as np
import pytest

from mmjax.data.layout import AssemblyLayout, check_sample, shape_bucket
from mmjax.data.batch_shapes import BatchShapes, batch_shapes
from mmjax.data.assemble import assemble, patchify
from mmjax.data.sample import Sample, Segment, TokenRules
from mmjax.data.synthetic import SyntheticConfig, SyntheticDataset
from mmjax.models.config import (AudioConfig, EncoderSpec, GeneratorConfig, LLMConfig,
                                 MLLMConfig, ProjectorConfig, VisionConfig)


def model(vision_ds=2, audio_ds=1, kind="mlp", generator=True, placement="embed"):
    proj = lambda r: ProjectorConfig(kind=kind, downsample=r, num_queries=3, max_items=4)
    return MLLMConfig(
        "tiny", LLMConfig(256, 32, 1, 2, 1, 64),
        encoders=(EncoderSpec("vision", VisionConfig(16, 1, 2, 32, patch_size=2, max_grid=16),
                              proj(vision_ds)),
                  EncoderSpec("audio", AudioConfig(16, 1, 2, 32, num_mel_bins=4), proj(audio_ds))),
        generator=GeneratorConfig(16, 1, 2, 32, latent_size=4, latent_channels=2, patch_size=2)
        if generator else None,
        placement=placement)


def layout(cfg, seq_len=32, packing="pad", **kw):
    kw.setdefault("vision_caps", (8, 32, 128))
    kw.setdefault("audio_frame_caps", (8, 32, 256))
    return AssemblyLayout.from_config(cfg, seq_len, packing=packing, gen_num_queries=2, **kw)


def hand_sample(sid=7):
    rng = np.random.default_rng(0)
    return Sample(sid, (
        Segment("text", np.array([20, 21], np.int32)),
        Segment("image", rng.random((4, 6, 3), dtype=np.float32)),  # 2x3 patches -> 3 tokens
        Segment("text", np.array([22], np.int32)),
        Segment("audio", rng.standard_normal((5, 4), dtype=np.float32)),  # ceil(5/2)=3 tokens
        Segment("image_out", rng.standard_normal((2, 4, 4), dtype=np.float32), 2),
    ))


def test_hand_built_exact_tables():
    lay = layout(model())
    b = assemble([hand_sample()], lay)
    n = 19
    assert b.tokens[0, :n].tolist() == [1, 20, 21, 3, 0, 0, 0, 4, 22, 5, 0, 0, 0, 6, 7, 0, 0, 8, 2]
    assert (b.tokens[0, n:] == 0).all() and (b.doc[0, n:] == 0).all() and (b.bam[0, n:] == 0).all()
    T = 7  # text bits: 1 | vision(2) | audio(4)
    assert b.bam[0, :n].tolist() == [T, T, T, T, 2, 2, 2, T, T, T, 4, 4, 4, T, T, T, T, T, T]
    assert b.sub[0, :n].tolist() == [0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 2, 2, 2, 0, 0, 3, 3, 0, 0]
    assert b.doc[0, :n].tolist() == [1] * n
    assert b.positions[0, :n].tolist() == list(range(n))
    scored = [0, 1, 2, 6, 7, 8, 12, 13, 16, 17]
    assert np.flatnonzero(b.loss_mask[0]).tolist() == scored
    assert b.targets[0, scored].tolist() == [20, 21, 3, 4, 22, 5, 6, 7, 8, 2]
    assert (b.targets[0][b.loss_mask[0] == 0] == 0).all()
    assert b.num_target_tokens == 10 == lay.rules.meta(hand_sample()).num_targets
    assert b.gather["vision"][0, 4:7].tolist() == [0, 1, 2]
    assert b.gather["audio"][0, 10:13].tolist() == [0, 1, 2]
    assert (np.delete(b.gather["vision"][0], [4, 5, 6]) == -1).all()
    assert b.gen["gen_query"][0].tolist() == [15, 16]
    assert b.gen["gen_valid"].tolist() == [1.0]
    assert b.num_gen_elements == 4 * 8  # 4 latent patches of 2*2*2
    v = b.encoders["vision"]
    assert v["patch_seg"][0, :8].tolist() == [1, 1, 1, 1, 1, 1, 0, 0]
    assert v["patch_pos"][0, :6].tolist() == [[0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [1, 2]]
    assert b.encoders["audio"]["frame_len"].tolist() == [5]


def test_patchify_row_major():
    img = np.arange(4 * 6 * 3, dtype=np.float32).reshape(4, 6, 3)
    p = patchify(img, 2)
    assert p.shape == (6, 12)
    np.testing.assert_array_equal(p[4], img[2:4, 2:4].reshape(-1))  # row 1, col 1


def test_prepend_placement_moves_modalities_after_bos():
    lay = layout(model(placement="prepend"))
    b = assemble([hand_sample()], lay)
    assert b.tokens[0, :19].tolist() == [1, 3, 0, 0, 0, 4, 5, 0, 0, 0, 6, 20, 21, 22, 7, 0, 0, 8, 2]
    assert b.bam[0, 2:5].tolist() == [2, 2, 2] and b.bam[0, 7:10].tolist() == [4, 4, 4]


def _dataset(kind="mix", **kw):
    cfg = model()
    sc = SyntheticConfig.for_model(cfg, image_side_range=(1, 6), frames_range=(4, 200),
                                   text_len_range=(1, 40), gen_queries=2, **kw)
    return cfg, SyntheticDataset(kind, sc, seed=3)


def _doc_text(sample):
    """The text/special tokens a sample's document must contain, in order."""
    from mmjax.data.sample import DELIMITERS
    out = [1]
    for s in sample.segments:
        if s.modality == "text":
            out += s.data.tolist()
        else:
            out += list(DELIMITERS[s.modality])
    return out + [2]


@pytest.mark.parametrize("packing", ["pad", "pack"])
@pytest.mark.parametrize("kind", ["mix", "laion"])
def test_every_sample_once_in_order(packing, kind):
    cfg, ds = _dataset(kind)
    lay = layout(cfg, seq_len=160, packing=packing, vision_caps=(16, 64))
    samples = [ds[i] for i in range(24)]
    b = assemble(samples, lay)
    good = [s for s in samples if check_sample(s, lay) is None]
    assert [s.id for s in good] == b.sample_ids and not b.skipped
    seen = []
    qmask = np.zeros_like(b.tokens, bool)
    if b.gen is not None:
        for g, v in zip(b.gen["gen_query"], b.gen["gen_valid"]):
            if v:
                qmask.reshape(-1)[g] = True
    for r in range(b.tokens.shape[0]):
        for d in range(1, b.doc[r].max() + 1):
            idx = np.flatnonzero(b.doc[r] == d)
            assert (np.diff(idx) == 1).all()  # contiguous
            text = (b.bam[r, idx] & 1).astype(bool) & ~qmask[r, idx]
            seen.append(b.tokens[r, idx][text].tolist())
            assert b.positions[r, idx].tolist() == list(range(len(idx)))
    assert sorted(map(tuple, seen)) == sorted(tuple(_doc_text(s)) for s in good)
    if packing == "pad":
        assert b.tokens.shape[0] == len(good) and (b.doc.max(axis=1) == 1).all()
        assert [tuple(x) for x in seen] == [tuple(_doc_text(s)) for s in good]  # same order
    else:
        assert b.tokens.shape[0] < len(good) and b.doc.max() > 1
        for r in range(b.tokens.shape[0]):  # no padding between packed documents
            used = np.flatnonzero(b.doc[r])
            assert used.size == 0 or used.tolist() == list(range(used.size))
    # targets: shifted text inside a document, never across, never a placeholder
    m = b.loss_mask.astype(bool)
    r, c = np.nonzero(m)
    assert (b.targets[r, c] == b.tokens[r, c + 1]).all()
    assert (b.doc[r, c] == b.doc[r, c + 1]).all()
    assert (b.sub[r, c + 1] == 0).all() and (b.tokens[r, c + 1] != 0).all()
    assert b.num_target_tokens == sum(lay.rules.meta(s).num_targets for s in good)


@pytest.mark.parametrize("vision_ds,audio_ds", [(1, 1), (2, 2), (4, 1)])
def test_gather_points_at_the_right_encoder_tokens(vision_ds, audio_ds):
    cfg, ds = _dataset("mix")
    cfg = model(vision_ds, audio_ds)
    lay = layout(cfg, seq_len=256, packing="pack", vision_caps=(16, 64))
    samples = [s for s in (ds[i] for i in range(40)) if check_sample(s, lay) is None]
    b = assemble(samples, lay)
    # Stand-in encoder+projector: vision token = its r concatenated patches; audio token =
    # the frame the stride-2 conv and the r-grouping start from.
    v = b.encoders["vision"]
    nb, cap, pd = v["patches"].shape
    v_out = v["patches"].reshape(nb * cap // vision_ds, vision_ds * pd)
    a = b.encoders["audio"]
    a_out = a["mels"][:, ::2 * audio_ds].reshape(-1, a["mels"].shape[-1])
    checked = 0
    for s, (r, d) in zip(samples, b.doc_index):
        in_doc = b.doc[r] == d
        subs = [x for x in dict.fromkeys(b.sub[r][in_doc].tolist()) if x]
        blocks = [seg for seg in s.segments if seg.modality != "text"]
        assert len(subs) == len(blocks)
        for sid, seg in zip(subs, blocks):
            cols = np.flatnonzero(in_doc & (b.sub[r] == sid))
            if seg.modality == "image":
                p = patchify(seg.data, 2)
                pad = (-len(p)) % vision_ds
                want = np.concatenate([p, np.zeros((pad, pd), np.float32)]).reshape(-1, vision_ds * pd)
                np.testing.assert_array_equal(v_out[b.gather["vision"][r, cols]], want)
                assert (b.gather["audio"][r, cols] == -1).all()
                checked += 1
            elif seg.modality == "audio":
                want = seg.data[::2 * audio_ds]
                np.testing.assert_array_equal(a_out[b.gather["audio"][r, cols]], want)
                checked += 1
    assert checked > 10


def test_cross_attention_gather_slots():
    cfg = model(kind="cross_attention")
    _, ds = _dataset("laion")
    lay = layout(cfg, seq_len=256, packing="pack", vision_caps=(16, 64))
    samples = [s for s in (ds[i] for i in range(12)) if check_sample(s, lay) is None]
    b = assemble(samples, lay)
    v = b.encoders["vision"]
    nb = v["patches"].shape[0]
    assert (v["patch_seg"].max(axis=1) <= 4).all()  # max_items per buffer
    # stand-in projector: slot s's 3 query tokens = first patch of item s+1 in the buffer
    out = np.zeros((nb, 4, 3, v["patches"].shape[-1]), np.float32)
    for bi in range(nb):
        for s in range(4):
            hit = np.flatnonzero(v["patch_seg"][bi] == s + 1)
            if hit.size:
                out[bi, s, :] = v["patches"][bi, hit[0]]
    out = out.reshape(-1, out.shape[-1])
    images = [seg.data for s in samples for seg in s.segments if seg.modality == "image"]
    got = out[b.gather["vision"][b.gather["vision"] >= 0]].reshape(-1, 3, out.shape[-1])
    assert len(got) == len(images)
    # order of blocks in the LLM rows = batch order for packing "pack" with first fit; compare as sets
    firsts = sorted(map(bytes, (patchify(im, 2)[0] for im in images)))
    assert sorted(bytes(g[0]) for g in got) == firsts
    assert all((g == g[0]).all() for g in got)


def test_buckets_and_common_shapes():
    cfg, ds = _dataset("mix")
    lay = layout(cfg, seq_len=160, packing="pack", vision_caps=(16, 64))
    metas = [ds.meta(i, lay.rules) for i in range(64)]
    ok = [m for m, i in zip(metas, range(64)) if check_sample(ds[i], lay) is None]
    g1, g2 = ok[:10], ok[10:40]
    s1, s2 = batch_shapes([g1], lay), batch_shapes([g2], lay)
    both = batch_shapes([g1, g2], lay)
    for name, count, cap in both.encoders:
        assert cap in (lay.vision_caps if name == "vision" else lay.audio_frame_caps)
        assert count == shape_bucket(count)  # a bucket: 1, 2, 4, 5, 6, 7, 8, 10, ...
        assert count >= max(s1.encoder(name)[0], s2.encoder(name)[0])
    assert both.rows == max(s1.rows, s2.rows) and both.rows == shape_bucket(both.rows)
    samples = [ds[m.id] for m in g1]
    b = assemble(samples, lay, shapes=both)  # forced common shapes
    assert b.tokens.shape == (both.rows, 160)
    assert b.encoders["vision"]["patches"].shape[:2] == both.encoder("vision")
    small = BatchShapes(1, both.encoders, both.gen)
    with pytest.raises(ValueError, match="rows"):
        assemble(samples, lay, shapes=small)


def test_bad_samples_rejected_with_reason_and_skipped():
    cfg = model()
    lay = layout(cfg)
    f = np.zeros
    bad = {
        "empty": Sample(1, ()),
        "decode": Sample(2, (Segment("image", f((5, 4, 3), np.float32)),)),
        "too_long": Sample(3, (Segment("text", np.full(40, 20, np.int32)),)),
    }
    for want, s in bad.items():
        assert check_sample(s, lay).startswith(want)
    assert check_sample(Sample(4, (Segment("text", np.array([3], np.int32)),)), lay).startswith("decode")
    assert check_sample(Sample(5, (Segment("audio", f((4, 7), np.float32)),)), lay).startswith("decode")
    no_gen = layout(model(generator=False))
    assert check_sample(hand_sample(), no_gen).startswith("unsupported")
    b = assemble([bad["empty"], hand_sample(), bad["decode"], bad["too_long"]], lay)
    assert b.sample_ids == [7] and [i for i, _ in b.skipped] == [1, 2, 3]


def test_generator_noise_fixed_by_sample_id():
    lay = layout(model(), seq_len=64, packing="pack")
    s1, s2 = hand_sample(7), hand_sample(9)
    a = assemble([s1, s2], lay)
    b = assemble([s2, s1], lay)
    np.testing.assert_array_equal(a.gen["gen_noise"][0], b.gen["gen_noise"][1])
    assert a.gen["gen_t"][0] == b.gen["gen_t"][1]
    assert not np.array_equal(a.gen["gen_noise"][0], a.gen["gen_noise"][1])
    lat = s1.segments[4].data.transpose(1, 2, 0)
    np.testing.assert_array_equal(a.gen["gen_latents"][0], patchify(lat, 2))
    # second document's queries, flat index row*S + col
    r, c = divmod(int(a.gen["gen_query"][1, 0]), 64)
    assert a.doc[r, c] == 2 and a.tokens[r, c - 1] == 7


def test_meta_from_shapes_matches_rules():
    rules = TokenRules(patch_size=2, image_downsample=4, audio_downsample=2)
    m = rules.meta(hand_sample())
    assert [(s.modality, s.num_llm_tokens, s.num_encoder_tokens) for s in m.segments] == [
        ("text", 2, 0), ("image", 2, 6), ("text", 1, 0), ("audio", 2, 3), ("image_out", 2, 4)]
    assert m.llm_length == 2 + 2 + 2 + 2 + 1 + 2 + 2 + 2 + 2


def test_shape_bucket_bounds_padding_and_shapes():
    """Buckets: 1, 2, 4, then m * 2^k (m in 4..7): under 25% padding, four shapes an octave."""
    got = [shape_bucket(n) for n in range(1, 33)]
    assert got[:12] == [1, 2, 4, 4, 5, 6, 7, 8, 10, 10, 12, 12]
    assert got[16:21] == [20, 20, 20, 20, 24]
    for n in range(5, 5000):
        b = shape_bucket(n)
        assert n <= b < n * 1.25 and shape_bucket(b) == b
    assert len({shape_bucket(n) for n in range(65, 129)}) == 4
