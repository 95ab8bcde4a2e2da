"""The columnar metadata path (`MetaColumns.from_specs`, issue 41) equals the object path
(`TokenRules.meta_from_shapes` per sample) exactly: every segment field, the per-sample
sums planning reads, and the whole plan of a global batch (`plan_global_batch` on columns
vs on a list of `SampleMeta`s), on random specs with text-only samples, images, audio,
image_out and masked text, under mlp and cross-attention projectors, with and without
modality markers."""
import numpy as np
import pytest

from mmjax.data.batch_plan import plan_global_batch, post_balance_policies, unit_policies
from mmjax.data.layout import AssemblyLayout
from mmjax.data.meta_columns import MetaColumns
from mmjax.data.sample import TokenRules
from mmjax.data.shape_columns import shape_columns
from mmjax.data.spec_list import meta_columns_of
from mmjax.models.config import (AudioConfig, EncoderSpec, GeneratorConfig, LLMConfig,
                                 MLLMConfig, ProjectorConfig, VisionConfig)
from mmjax.planner.plan import Plan

RULES = [TokenRules(), TokenRules(patch_size=4, image_downsample=4, audio_downsample=3,
                                  gen_patch_size=2, gen_downsample=8, markers=False),
         TokenRules(patch_size=7, image_queries=32, audio_queries=5, gen_patch_size=4)]


def random_specs(rng, n: int, patch: int = 14):
    """Specs as sources give them: text (some masked, 4-tuples), images, audio, image_out;
    some samples text only, some empty."""
    specs = []
    for _ in range(n):
        spec = []
        for _ in range(int(rng.integers(0, 6))):
            kind = int(rng.integers(5))
            if kind == 0:
                spec.append(("text", (int(rng.integers(1, 300)),), 0))
            elif kind == 1:  # masked text (chat prompts), the 4th field
                L = int(rng.integers(1, 300))
                spec.append(("text", (L,), 0, int(rng.integers(0, L + 1))))
            elif kind == 2:
                spec.append(("image", (patch * int(rng.integers(1, 20)),
                                       patch * int(rng.integers(1, 20)), 3), 0))
            elif kind == 3:
                spec.append(("audio", (int(rng.integers(1, 3000)), 16), 0))
            else:
                spec.append(("image_out", (4, 8 * int(rng.integers(1, 5)), 16),
                             int(rng.integers(1, 40))))
        if rng.random() < 0.2:  # text only
            spec = [("text", (int(rng.integers(1, 50)),), 0)]
        specs.append(spec)
    return specs


@pytest.mark.parametrize("rules", RULES, ids=["mlp", "downsample_nomarkers", "queries"])
def test_columns_from_specs_equal_the_objects(rules):
    rng = np.random.default_rng(hash(rules) % 1000)
    specs = random_specs(rng, 400)
    ids = rng.permutation(10_000)[:400].tolist()
    mc = meta_columns_of(ids, specs, rules)
    want = [rules.meta_from_shapes(i, s) for i, s in zip(ids, specs)]
    assert mc.metas() == want
    assert [mc[p] for p in (0, 7, 399)] == [want[p] for p in (0, 7, 399)]
    back = MetaColumns.from_metas(want)
    for f in ("ids", "counts", "modality", "llm_tokens", "encoder_tokens", "input_size",
              "masked", "delimiters"):
        assert np.array_equal(getattr(back, f), getattr(mc, f)), f
    assert mc.llm_length.tolist() == [m.llm_length for m in want]
    assert [rules.llm_length(s) for s in specs] == [m.llm_length for m in want]
    assert mc.num_targets.tolist() == [m.num_targets for m in want]
    for mod in ("text", "image", "audio", "image_out"):
        assert mc.count(mod).tolist() == [m.count(mod) for m in want]
    assert any(m.num_masked for m in want) and any(m.count("audio") for m in want)


def test_empty_batch_and_unknown_modality():
    mc = meta_columns_of([], [], TokenRules())
    assert len(mc) == 0 and mc.metas() == [] and mc.llm_length.size == 0
    with pytest.raises(ValueError, match="unknown modality 'video'"):
        meta_columns_of([0], [[("video", (3,), 0)]], TokenRules())


def _model(gen: bool) -> MLLMConfig:
    return MLLMConfig("t", LLMConfig(256, 32, 1, 2, 1, 64), encoders=(
        EncoderSpec("vision", VisionConfig(16, 1, 2, 32, patch_size=14),
                    ProjectorConfig(downsample=2)),
        EncoderSpec("audio", AudioConfig(16, 1, 2, 32), ProjectorConfig())),
        generator=GeneratorConfig(32, 1, 2, 64, latent_size=8, latent_channels=4,
                                  patch_size=2) if gen else None)


@pytest.mark.parametrize("policy", ["orchmllm", "none", "disttrain"])
@pytest.mark.parametrize("gen", [False, True])
def test_plan_from_columns_equals_plan_from_objects(policy, gen):
    model = _model(gen)
    layout = AssemblyLayout.from_config(model, 2048, "pack", vision_caps=(256, 1024, 4096))
    rng = np.random.default_rng(11)
    specs = [[e for e in s if e[0] != "image_out" or gen] for s in random_specs(rng, 480)]
    specs = [[e if e[0] != "image_out" else ("image_out", (4, 8, 8), 16) for e in s] or
             [("text", (5,), 0)] for s in specs]
    ids = list(range(480))
    plan = Plan.uniform(model, 480, 2, dp={"llm": 4, "vision": 3, "audio": 2,
                                           "generator": 2})
    mc = meta_columns_of(ids, specs, layout.rules)
    metas = [layout.rules.meta_from_shapes(i, s) for i, s in zip(ids, specs)]
    kw = dict(policies=unit_policies(policy, model),
              post_balance_policy=post_balance_policies("sum", model))
    a = plan_global_batch(mc, model, plan, layout, **kw)
    b = plan_global_batch(metas, model, plan, layout, **kw)
    assert len(a) == len(b) == 2
    for x, y in zip(a, b):
        assert x.positions == y.positions and x.shapes == y.shapes
        assert x.ranks == y.ranks
    cols = shape_columns(mc, layout, ("image", "audio"))
    assert cols.encoder_tokens["audio"].tolist() == [m.encoder_tokens("audio") for m in metas]
    assert cols.image_out.tolist() == [m.count("image_out") for m in metas]
