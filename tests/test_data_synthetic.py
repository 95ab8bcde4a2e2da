"""Synthetic datasets: determinism per (seed, index), shapes/metadata agree, skew directions."""
import numpy as np

from mmjax.data.layout import AssemblyLayout, check_sample, sample_shapes
from mmjax.data.sample import TokenRules
from mmjax.data.synthetic import SyntheticConfig, SyntheticDataset, laion_like, orchmllm_mix
from mmjax.models.config import (AudioConfig, EncoderSpec, GeneratorConfig, LLMConfig,
                                 MLLMConfig, ProjectorConfig, VisionConfig)

CFG = SyntheticConfig()


def _same(a, b):
    return a.id == b.id and len(a.segments) == len(b.segments) and all(
        x.modality == y.modality and np.array_equal(x.data, y.data)
        for x, y in zip(a.segments, b.segments))


def test_deterministic_per_seed_and_index():
    for make in (laion_like, orchmllm_mix):
        a, b = make(CFG, 5, 17), make(CFG, 5, 17)
        assert _same(a, b)
        assert not _same(a, make(CFG, 6, 17))
        # index order does not matter: any host can make any sample
        ds = SyntheticDataset("laion" if make is laion_like else "mix", CFG, seed=5)
        assert _same(ds[17], a) and _same(ds[17], (ds[3], ds[17])[1])


def test_spec_and_meta_agree_with_arrays():
    rules = TokenRules(patch_size=CFG.patch_size, image_downsample=2)
    for kind in ("laion", "mix"):
        ds = SyntheticDataset(kind, CFG, seed=1)
        for i in range(30):
            s = ds[i]
            assert [(m, tuple(sh), k) for m, sh, k in ds.spec(i)] == sample_shapes(s)
            assert ds.meta(i, rules) == rules.meta(s)
            for seg in s.segments:
                assert seg.data.dtype == (np.int32 if seg.modality == "text" else np.float32)


def _skew(x):
    x = np.asarray(x, float)
    return ((x - x.mean()) ** 3).mean() / x.std() ** 3


def test_laion_skew_directions():
    """DistTrain Fig. 5: text lengths, image sizes and image counts are right-skewed."""
    ds = SyntheticDataset("laion", CFG, seed=0)
    specs = [ds.spec(i) for i in range(1500)]
    text = [sh[0] for sp in specs for m, sh, _ in sp if m == "text"]
    patches = [sh[0] * sh[1] // CFG.patch_size ** 2 for sp in specs for m, sh, _ in sp if m == "image"]
    counts = np.bincount([sum(m == "image" for m, _, _ in sp) for sp in specs])
    assert np.mean(text) > np.median(text) and _skew(text) > 0.5
    assert np.mean(patches) > np.median(patches) and _skew(patches) > 0.5
    assert counts[1] > counts[2] > counts[3] > 0 and counts[0] == 0


def test_mix_composition_incoherence():
    """OrchMLLM §3.1: ASR text tracks audio length, spoken-QA answers do not; vision and
    audio shares of a sample vary widely (whole tasks lack a modality)."""
    ds = SyntheticDataset("mix", CFG, seed=0)
    asr, sqa, vis_share, aud_share = [], [], [], []
    for i in range(1500):
        sp = ds.spec(i)
        mods = [m for m, _, _ in sp]
        text_len = sum(sh[0] for m, sh, _ in sp if m == "text")
        frames = sum(sh[0] for m, sh, _ in sp if m == "audio")
        img = sum(sh[0] * sh[1] // CFG.patch_size ** 2 for m, sh, _ in sp if m == "image")
        if "audio" in mods:
            (asr if mods[0] == "text" else sqa).append((frames, text_len))
            assert "image" not in mods
        total = text_len + img + frames / 2
        vis_share.append(img / total)
        aud_share.append(frames / 2 / total)
    c_asr = np.corrcoef(np.array(asr).T)[0, 1]
    c_sqa = np.corrcoef(np.array(sqa).T)[0, 1]
    assert c_asr > 0.8 and abs(c_sqa) < 0.2
    assert np.std(vis_share) > 0.2 and np.std(aud_share) > 0.2
    assert min(vis_share) == 0 and max(vis_share) > 0.6 and min(aud_share) == 0


def test_bad_fraction_produces_each_rejection_kind():
    cfg = MLLMConfig("m", LLMConfig(512, 32, 1, 2, 1, 64), encoders=(
        EncoderSpec("vision", VisionConfig(16, 1, 2, 32, patch_size=14), ProjectorConfig()),
        EncoderSpec("audio", AudioConfig(16, 1, 2, 32, num_mel_bins=16), ProjectorConfig())),
        generator=GeneratorConfig(16, 1, 2, 32, latent_size=8, latent_channels=4))
    lay = AssemblyLayout.from_config(cfg, 2048, gen_num_queries=16)
    ds = SyntheticDataset("mix", SyntheticConfig.for_model(cfg, bad_fraction=0.3), seed=2)
    reasons = [check_sample(ds[i], lay) for i in range(120)]
    kinds = {r.split(":")[0] for r in reasons if r}
    assert kinds == {"empty", "decode", "too_long"}
    assert 0.15 < sum(r is not None for r in reasons) / len(reasons) < 0.45
