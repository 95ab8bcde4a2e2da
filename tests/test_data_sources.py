"""LLaVA / WebDataset sources: sidecar index (header metadata, caching, invalidation), bad
records named with their reason, decoded samples matching the index, SourceBatches."""
import io
import json
import os
import tarfile

import numpy as np
import pytest
from PIL import Image

from mmjax.data.layout import AssemblyLayout, sample_shapes
from mmjax.data.example_data import write_llava_example, write_tokenizer
from mmjax.data.records import DecodeError
from mmjax.data.sources import default_processors
from mmjax.data.sources.common import EntryBuilder
from mmjax.data.sources.llava import LlavaSource
from mmjax.data.sources.webdataset import WebDatasetSource, expand_braces
from mmjax.data.stream import SourceBatches
from mmjax.data.tokenizer import Tokenizer, padded_vocab
from mmjax.models.config import with_overrides
from mmjax.models.tiny import tiny_valm

MODEL = with_overrides(tiny_valm(), {"encoders.vision.encoder.max_grid": 8})


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("llava"))
    info = write_llava_example(root, num_samples=16)
    info["tok"] = Tokenizer(info["tokenizer"])
    return info


def _source(info, json_path=None, **kw):
    img, aud = default_processors(MODEL, None, None)
    return LlavaSource(json_path or info["json"], info["tok"], img, aud, info["image_root"],
                       index_workers=2, **kw)


def test_index_names_bad_records_and_matches_decoding(example):
    src = _source(example)
    names = [src.name(i) for i in range(len(src))]
    assert len(src) == 19 and names[-2:] == ["corrupt-image", "missing-image"]
    assert src.problem(len(src) - 1).startswith("missing: image")
    bad = src.problem(len(src) - 2)
    if bad is None:  # the header parsed: decoding must fail instead
        with pytest.raises(DecodeError):
            src.load(len(src) - 2)
    else:
        assert bad.startswith("unreadable: image")
    for i in range(len(src) - 2):
        assert src.problem(i) is None
        s = src.load(i)
        assert sample_shapes(s) == [tuple(e) for e in src.spec(i)]  # index == decoded
    two = names.index("two-images")
    assert [e[0] for e in src.spec(two)] == ["text", "image", "text", "image", "text"]
    # Image sizes come from the file header, through the native-aspect rule.
    with Image.open(os.path.join(example["image_root"], "pair.png")) as im:
        assert (im.height, im.width) == (30, 50)
    assert src.spec(two)[1][1] == (32, 32, 3)  # 30 -> 8 patches of 4; 50 -> 13 -> max 8
    # text-only sample: a single text segment with its prompt masked
    text_only = names.index("sample-0007")
    (seg,) = src.spec(text_only)
    assert seg[0] == "text" and 0 < seg[3] < seg[1][0]


def test_index_is_cached_and_invalidated(example, tmp_path, monkeypatch):
    records = json.load(open(example["json"]))[:4]
    jp = tmp_path / "a.json"
    jp.write_text(json.dumps(records))
    first = _source(example, str(jp))
    key = json.load(open(str(jp) + ".mmjax_index.json"))["key"]

    def boom(self, rec):
        raise AssertionError("index rebuilt although nothing changed")
    monkeypatch.setattr(EntryBuilder, "__call__", boom)
    again = _source(example, str(jp))  # from the cache: no per-record work
    assert again.entries == first.entries
    monkeypatch.undo()
    jp.write_text(json.dumps(records[:3]))  # data changed
    assert len(_source(example, str(jp))) == 3
    assert json.load(open(str(jp) + ".mmjax_index.json"))["key"] != key
    # Another tokenizer: token counts change, so the index must be rebuilt.
    tok2 = Tokenizer(write_tokenizer(str(tmp_path / "tok2"), ["completely other words"] * 9, 270))
    img, aud = default_processors(MODEL, None, None)
    other = LlavaSource(str(jp), tok2, img, aud, example["image_root"], index_workers=1)
    assert other.entries != _source(example, str(jp)).entries


def test_placeholder_mismatch_jsonl_and_audio(example, tmp_path):
    import soundfile as sf

    t = np.arange(16000 * 2) / 16000
    sf.write(str(tmp_path / "clip.wav"), np.sin(2 * np.pi * 300 * t).astype(np.float32), 16000)
    recs = [{"id": "no-placeholder", "image": "0000.png", "conversations": [
                {"from": "human", "value": "What is it?"}, {"from": "gpt", "value": "A cat."}]},
            {"id": "speech", "audio": str(tmp_path / "clip.wav"), "conversations": [
                {"from": "human", "value": "<audio>\nTranscribe."}, {"from": "gpt", "value": "Hum."}]},
            {"id": "bad-role", "conversations": [{"from": "robot", "value": "x"}]}]
    jp = tmp_path / "r.jsonl"
    jp.write_text("\n".join(json.dumps(r) for r in recs))
    src = _source(example, str(jp))
    assert src.problem(0).startswith("placeholders:") and src.problem(2).startswith("chat:")
    assert src.problem(1) is None
    spec, s = src.spec(1), src.load(1)
    assert spec[1] == ("audio", (200, 16), 0)  # 2 s at hop 160: 200 frames of 16 mels
    assert sample_shapes(s) == [tuple(e) for e in spec]


def _tar(path, members):
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def _png(h, w, seed):
    buf = io.BytesIO()
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def test_expand_braces():
    assert expand_braces("s-{08..11}.tar") == ["s-08.tar", "s-09.tar", "s-10.tar", "s-11.tar"]
    assert expand_braces("{a,b}/x{0..1}") == ["a/x0", "a/x1", "b/x0", "b/x1"]


def test_webdataset_shards(example, tmp_path):
    conv = {"conversations": [{"from": "human", "value": "<image>\nColour?"},
                              {"from": "gpt", "value": "Red."}]}
    _tar(tmp_path / "shard-00.tar", [("a/k1.png", _png(20, 28, 1)), ("a/k1.txt", b"a red dot"),
                                     ("a/k2.png", _png(9, 40, 2)),
                                     ("a/k2.json", json.dumps(conv).encode())])
    _tar(tmp_path / "shard-01.tar", [("k3.txt", b"only words here"),
                                     ("k4.jpg", b"\xff\xd8\xff garbage"), ("k4.txt", b"bad")])
    img, aud = default_processors(MODEL, None, None)
    src = WebDatasetSource(str(tmp_path / "shard-{00..01}.tar"), example["tok"], img, aud,
                           index_workers=2)
    names = [src.name(i) for i in range(len(src))]
    assert names == ["shard-00.tar/a/k1", "shard-00.tar/a/k2", "shard-01.tar/k3", "shard-01.tar/k4"]
    assert src.problem(3).startswith("unreadable: image")
    s = src.load(0)
    want = img(Image.open(io.BytesIO(_png(20, 28, 1)))).transpose(1, 2, 0)
    np.testing.assert_array_equal(s.segments[0].data, want)  # read by seeking into the tar
    assert [e[0] for e in src.spec(1)] == ["image", "text"]  # "plain": no role headers
    assert len(src.spec(0)[1]) == 3 and src.spec(1)[1][3] > 0  # caption all trained; question not
    assert [e[0] for e in src.spec(2)] == ["text"]
    for i in range(3):
        assert sample_shapes(src.load(i)) == [tuple(e) for e in src.spec(i)]


def test_source_batches_skip_name_and_resume(example):
    src = _source(example)
    layout = AssemblyLayout.from_config(
        MODEL.replace(llm=MODEL.llm.__class__(**{**MODEL.llm.__dict__,
                                                "vocab_size": padded_vocab(example["tok"].vocab_size)})),
        256, vision_caps=(64, 128, 256), special=example["tok"].special_tokens())
    data = SourceBatches(src, layout, global_batch=6, seed=3)
    seen = []
    for _ in range(4):  # 24 draws > 19 records: every bad record comes up
        batch, skipped = next(data)
        seen += skipped
        assert len(batch.sample_ids) == 6
    assert {n for n, _, _ in seen} >= {"corrupt-image", "missing-image"}
    state = data.state()
    after = next(data)[0]
    data.close()
    again = SourceBatches(src, layout, global_batch=6, seed=3)
    again.restore(state)
    b = next(again)[0]
    again.close()
    assert b.sample_ids == after.sample_ids
    np.testing.assert_array_equal(b.tokens, after.tokens)
    np.testing.assert_array_equal(b.loss_mask, after.loss_mask)


def test_load_parts_reads_only_the_modalities_asked(example, tmp_path):
    """A host holding only the LLM (or another encoder) of a sample decodes its text and
    none of its image files: zeros of the indexed shapes instead (data/global_batch.py)."""
    import shutil

    root = tmp_path / "images"
    shutil.copytree(example["image_root"], root)
    img, aud = default_processors(MODEL, None, None)
    src = LlavaSource(example["json"], example["tok"], img, aud, str(root), index_workers=2)
    two = [src.name(i) for i in range(len(src))].index("two-images")
    whole = src.load(two)
    parts = src.load_parts(two, frozenset({"image"}))
    for a, b in zip(whole.segments, parts.segments):
        np.testing.assert_array_equal(a.data, b.data)
    for f in os.listdir(root):  # no file is read for a text-only load
        os.remove(root / f)
    with pytest.raises(DecodeError):
        src.load(two)
    text = src.load_parts(two, frozenset({"text"}))
    assert sample_shapes(text) == [tuple(e) for e in src.spec(two)]
    for a, b in zip(whole.segments, text.segments):
        if a.modality == "text":
            np.testing.assert_array_equal(a.data, b.data)
            np.testing.assert_array_equal(a.loss_mask, b.loss_mask)
        else:
            assert not b.data.any()


def test_webdataset_skips_name_their_shard_and_member(example, tmp_path):
    """Issue 28: a bad WebDataset sample (an undecodable image, a caption that is neither
    text nor a conversation) is skipped and named by its tar file and member, in the skip
    rows the trainer writes to skipped.jsonl."""
    from mmjax.data.records import sample_where
    good = [(f"g{i}.png", _png(12, 16, i)) for i in range(5)]
    good += [(f"g{i}.txt", b"a caption") for i in range(5)]
    _tar(tmp_path / "ok-00.tar", good)
    _tar(tmp_path / "ok-01.tar", [("d/bad.jpg", b"\xff\xd8\xff garbage"), ("d/bad.txt", b"x"),
                                  ("nocap.json", b"[1, 2]"), ("ok.png", _png(8, 8, 9)),
                                  ("ok.txt", b"fine")])
    img, aud = default_processors(MODEL, None, None)
    src = WebDatasetSource(str(tmp_path / "ok-{00..01}.tar"), example["tok"], img, aud,
                           index_workers=1)
    shard1 = str(tmp_path / "ok-01.tar")
    names = [src.name(i) for i in range(len(src))]
    bad, nocap = names.index("ok-01.tar/d/bad"), names.index("ok-01.tar/nocap")
    assert sample_where(src, bad) == (shard1, "member", "d/bad.jpg")
    assert sample_where(src, nocap) == (shard1, "member", "nocap.json")
    assert sample_where(src, 0) == (str(tmp_path / "ok-00.tar"), "member", "g0.png")
    layout = AssemblyLayout.from_config(
        MODEL.replace(llm=MODEL.llm.__class__(**{**MODEL.llm.__dict__,
                                                "vocab_size": padded_vocab(example["tok"].vocab_size)})),
        256, vision_caps=(64, 128, 256), special=example["tok"].special_tokens())
    data = SourceBatches(src, layout, global_batch=4, seed=0, shuffle=False)
    rows = {}
    for _ in range(2):  # 8 draws cover the 8 samples
        rows.update({n: (why, where) for n, why, where in next(data)[1]})
    data.close()
    assert set(rows) == {"ok-01.tar/d/bad", "ok-01.tar/nocap"}
    assert rows["ok-01.tar/d/bad"][1] == (shard1, "member", "d/bad.jpg")
    assert rows["ok-01.tar/d/bad"][0].split(":")[0] in ("unreadable", "decode")
    assert rows["ok-01.tar/nocap"][1] == (shard1, "member", "nocap.json")


def test_undecodable_audio_is_skipped_counted_and_named(example, tmp_path):
    """Issue 28: in a LLaVA-style JSONL with audio, an undecodable WAV (junk bytes), a FLAC
    cut in half (its header promises more than its frames hold: it fails at decode, not at
    indexing) and a missing file are each skipped, counted in the global batch and named
    with the JSONL file, line and reason, as the trainer writes them to skipped.jsonl; the
    good clips train."""
    import soundfile as sf
    from mmjax.data.loader import Loader
    from mmjax.planner.plan import Plan

    t = np.arange(16000) / 16000
    wave = np.sin(2 * np.pi * 300 * t).astype(np.float32)
    for k in range(3):
        sf.write(str(tmp_path / f"good{k}.wav"), wave * (k + 1) / 4, 16000)
    sf.write(str(tmp_path / "cut.flac"), np.random.default_rng(0).normal(size=48000)
             .astype(np.float32) * 0.1, 16000)
    raw = open(tmp_path / "cut.flac", "rb").read()
    open(tmp_path / "cut.flac", "wb").write(raw[:len(raw) // 2])
    (tmp_path / "junk.wav").write_bytes(b"RIFF\x00\x01\x00\x00WAVEjunkjunkjunk" * 8)
    turn = lambda: [{"from": "human", "value": "<audio>\nTranscribe."},
                    {"from": "gpt", "value": "A hum."}]
    names = ["good0", "junk", "good1", "cut", "missing", "good2"]
    files = {"junk": "junk.wav", "cut": "cut.flac", "missing": "gone.wav"}
    recs = [{"id": n, "audio": str(tmp_path / files.get(n, n + ".wav")),
             "conversations": turn()} for n in names]
    jp = tmp_path / "speech.jsonl"
    jp.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    src = _source(example, str(jp))
    vocab = padded_vocab(example["tok"].vocab_size)
    cfg = MODEL.replace(llm=MODEL.llm.__class__(**{**MODEL.llm.__dict__, "vocab_size": vocab}))
    layout = AssemblyLayout.from_config(cfg, 256, vision_caps=(64, 128, 256),
                                        special=example["tok"].special_tokens())
    loader = Loader.build(src, cfg, Plan.uniform(cfg, 3, 1), layout, shuffle=False, reserve=0)
    rows, trained = {}, []
    for step in range(2):  # 6 draws: every line, the bad ones replaced from the 2nd stream
        gs = loader.stream.samples(step)
        rows.update({n: (why, where) for n, why, where in gs.skipped})
        trained += [i for i in gs.sample_ids if i not in gs.failed]
        assert gs.skipped_samples == len(gs.skipped)
    assert set(rows) == {"junk", "cut", "missing"}
    for n, (why, where) in rows.items():
        assert where == (str(jp), "line", names.index(n) + 1), (n, where)
    assert rows["junk"][0].startswith(("unreadable: audio", "decode: audio"))
    assert rows["cut"][0].startswith("decode")
    assert rows["missing"][0].startswith("missing: audio")
    assert {src.name(i) for i in trained} >= {"good0", "good1", "good2"}


class _CountingTokenizer(Tokenizer):
    """The example tokenizer, recording the longest text it was asked to encode."""

    longest = 0

    def encode(self, text):
        self.longest = max(self.longest, len(text))
        return super().encode(text)


def test_a_huge_text_is_too_long_before_it_is_tokenized(example, tmp_path):
    """Issue 43: a record's text is judged against seq_len on its characters first (at
    most `max_token_chars` per token), so a 4 MB string is skipped as too_long without
    being tokenized; one under that bound but over seq_len in tokens is too_long on its
    tokens."""
    tok = _CountingTokenizer(example["tokenizer"])
    per_token = tok.max_token_chars()
    words = " ".join(["hello world"] * 40)  # about 80 tokens, far fewer characters/token
    records = [{"id": "huge", "conversations": [{"from": "human", "value": "x" * 4_000_000},
                                                {"from": "gpt", "value": "ok"}]},
               {"id": "wordy", "conversations": [{"from": "human", "value": words},
                                                 {"from": "gpt", "value": "ok"}]},
               {"id": "short", "conversations": [{"from": "human", "value": "hi"},
                                                 {"from": "gpt", "value": "ok"}]}]
    path = str(tmp_path / "long.json")
    with open(path, "w") as f:
        json.dump(records, f)
    img, aud = default_processors(MODEL, None, None)
    src = LlavaSource(path, tok, img, aud, index_workers=1, max_tokens=32)
    limit = 32 * max(per_token, 7)
    assert src.problem(0) == (f"too_long: 4000002 characters of text > {limit}, the most "
                              f"seq_len 32 tokens can hold")
    assert len(words) + 2 <= limit and tok.longest < limit  # the huge text never encoded
    assert src.problem(1).startswith("too_long: ") and src.problem(1).endswith(
        " text tokens > seq_len 32")
    assert int(src.problem(1).split()[1]) > 32
    assert src.problem(2) is None
    assert LlavaSource(path, tok, img, aud, index_workers=1).problem(0) is None  # no limit
