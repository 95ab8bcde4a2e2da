"""Named paper-scale configs: sizes within 3% of the papers, exact Table shapes, Flax
modules matching the planner's analytic counts, registry, gin files."""
import glob
import os
import re

import jax
import numpy as np
import pytest
from flax import nnx

from mmjax.errors import UserError
from mmjax.models.config import VisionConfig
from mmjax.models.named import (CORNSTARCH_AUDIO, CORNSTARCH_LLM, CORNSTARCH_VISION,
                                LLAMA3_VOCAB, NAMED_CONFIGS, named_config)
from mmjax.planner.module_params import llm_params, module_params, num_params

B = 1e9
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
# published module sizes (DistTrain §8: ViT-Huge 0.63B, SD-2.1 UNet 0.865B; OrchMLLM Table 1;
# Cornstarch Table 1) and MLLM totals named by the papers
MODULES = {
    "disttrain/mllm_9b": {"vision": 0.632, "generator": 0.865},
    "disttrain/mllm_15b": {"vision": 0.632, "generator": 0.865},
    "disttrain/mllm_72b": {"vision": 0.632, "generator": 0.865, "llm": 70.0},
    "orchmllm/mllm_10b": {"llm": 7.6, "vision": 1.8, "audio": 0.635},
    "orchmllm/mllm_18b": {"llm": 14.8, "vision": 2.8, "audio": 0.635},
    "orchmllm/mllm_84b": {"llm": 72.7, "vision": 5.5, "audio": 5.5},
}
VIT_HUGE_14, SD21_UNET = 0.632, 0.865
# DistTrain's LLM backbones, exactly: Table 1 shapes are Llama-2-7B/13B (6,738,415,616 and
# 13,015,864,320 parameters with Llama-2's 32000 vocabulary) and Llama-3-70B
# (70,553,706,496); the paper names Llama3, so 7B/13B carry the 128256 vocabulary
# (embedding + untied head: 2 x 96256 x width more).
DISTTRAIN_LLM = {"disttrain/mllm_9b": 6_738_415_616 + 2 * (LLAMA3_VOCAB - 32000) * 4096,
                 "disttrain/mllm_15b": 13_015_864_320 + 2 * (LLAMA3_VOCAB - 32000) * 5120,
                 "disttrain/mllm_72b": 70_553_706_496}
# Published totals. MLLM-15B: the paper's name adds nominal sizes (13 + 0.63 + 1); its
# published parts (Table-1 LLM with the Llama3 vocabulary, ViT-Huge, SD-2.1 UNet) sum to
# 15.50B, which no choice of generator or projector can bring within 3% of 15
# (test_mllm_15b_name_is_the_nominal_sum), so its total is checked against that sum.
TOTALS = {"disttrain/mllm_9b": 9, "disttrain/mllm_15b": 15.50, "disttrain/mllm_72b": 72,
          "orchmllm/mllm_10b": 10, "orchmllm/mllm_18b": 18, "orchmllm/mllm_84b": 84}
# Cornstarch Table 1 (Cornstarch §6.1): (layers, width, billions)
CORNSTARCH_TABLE = {
    ("llm", "s"): (16, 2048, 1.2), ("llm", "m"): (32, 4096, 8.0), ("llm", "l"): (64, 5120, 32.0),
    ("vision", "s"): (40, 1408, 1.0), ("vision", "m"): (32, 4096, 8.0),
    ("vision", "l"): (48, 5120, 18.0),
    ("audio", "s"): (32, 1920, 1.4), ("audio", "m"): (40, 3840, 7.0),
    ("audio", "l"): (48, 5120, 15.0)}
CORNSTARCH_LLM_M = CORNSTARCH_TABLE[("llm", "m")][2]
CORNSTARCH_ENC = {k: v[2] for k, v in CORNSTARCH_TABLE.items() if k[0] != "llm"}


def close(got, want, tol=0.03):
    return abs(got - want) / want <= tol


@pytest.mark.parametrize("name", sorted(MODULES))
def test_module_sizes(name):
    mp = module_params(named_config(name))
    for unit, want in MODULES[name].items():
        assert close(mp[unit] / B, want), (unit, mp[unit] / B, want)


@pytest.mark.parametrize("name", sorted(TOTALS))
def test_totals_match_paper_names(name):
    assert close(num_params(named_config(name)) / B, TOTALS[name])


def test_disttrain_llms_are_table_1_exactly():
    for name, count in DISTTRAIN_LLM.items():
        assert llm_params(named_config(name).llm) == count, name
    shapes = {"disttrain/mllm_9b": (32, 4096, 11008, 32, 32),
              "disttrain/mllm_15b": (40, 5120, 13824, 40, 40),
              "disttrain/mllm_72b": (80, 8192, 28672, 64, 8)}
    for name, shape in shapes.items():
        c = named_config(name).llm
        assert (c.num_layers, c.hidden_size, c.ffn_size, c.num_heads, c.num_kv_heads) == shape
        assert c.vocab_size == LLAMA3_VOCAB and not c.tie_embeddings


def test_mllm_15b_name_is_the_nominal_sum():
    """Why MLLM-15B is checked against 15.50B: even with a zero-size projector and the
    generator at exactly the SD-2.1 UNet, the published parts are more than 3% over 15B
    (while 13 + 0.63 + 1, the nominal sizes, round to the name)."""
    parts = DISTTRAIN_LLM["disttrain/mllm_15b"] / B + VIT_HUGE_14 + SD21_UNET
    assert parts > 15.0 * 1.03 and close(parts, TOTALS["disttrain/mllm_15b"], tol=0.001)
    assert round(13 + VIT_HUGE_14 + 1.0) == 15
    for name, want in (("disttrain/mllm_9b", 9), ("disttrain/mllm_72b", 72)):
        assert close(DISTTRAIN_LLM[name] / B + VIT_HUGE_14 + SD21_UNET, want)
    mp = module_params(named_config("disttrain/mllm_15b"))
    assert close(num_params(named_config("disttrain/mllm_15b")) / B, parts)
    assert close(mp["generator"] / B, SD21_UNET) and close(mp["vision"] / B, VIT_HUGE_14)


@pytest.mark.parametrize("size", "sml")
def test_cornstarch_modules_match_table_1(size):
    for unit, table in (("llm", CORNSTARCH_LLM), ("vision", CORNSTARCH_VISION),
                        ("audio", CORNSTARCH_AUDIO)):
        layers, width, billions = CORNSTARCH_TABLE[(unit, size)]
        c = table[size]
        assert (c.num_layers, c.hidden_size) == (layers, width), (unit, size)
        assert c.hidden_size % c.num_heads == 0
        assert close(num_params(c) / B, billions), (unit, size, num_params(c) / B)
    assert CORNSTARCH_AUDIO[size].ffn_size == 4 * CORNSTARCH_AUDIO[size].hidden_size  # Whisper


@pytest.mark.parametrize("name", sorted(n for n in NAMED_CONFIGS if n.startswith("cornstarch/")))
def test_cornstarch(name):
    cfg = named_config(name)
    sizes = re.match(r"cornstarch/(v?a?lm)_([sml]+)$", name).group(2)
    mp = module_params(cfg)
    assert close(mp["llm"] / B, CORNSTARCH_LLM_M)
    assert [e.name for e in cfg.encoders] == (["vision", "audio"] if len(sizes) == 2 else
                                               [cfg.encoders[0].name])
    for e, s in zip(cfg.encoders, sizes):
        assert close(mp[e.name] / B, CORNSTARCH_ENC[(e.name, s)]), (e.name, mp[e.name] / B)
        assert e.frozen and not e.projector_frozen and e.projector.num_layers == 1
    assert cfg.llm_frozen and cfg.generator is None


def test_table_shapes():
    c = named_config("disttrain/mllm_72b")
    assert (c.llm.num_layers, c.llm.hidden_size, c.llm.ffn_size, c.llm.num_heads,
            c.llm.num_kv_heads) == (80, 8192, 28672, 64, 8)
    assert c.generator.latent_size * 8 == 1024
    assert named_config("disttrain/mllm_9b").generator.latent_size * 8 == 512
    for name, (vd, ad) in {"orchmllm/mllm_10b": (1, 2), "orchmllm/mllm_18b": (4, 2),
                           "orchmllm/mllm_84b": (4, 4)}.items():
        c = named_config(name)
        assert (c.encoder("vision").projector.downsample,
                c.encoder("audio").projector.downsample) == (vd, ad)
        assert isinstance(c.encoder("vision").encoder, VisionConfig) and c.llm.qkv_bias


def test_registry_and_overrides():
    with pytest.raises(TypeError):
        NAMED_CONFIGS["x"] = None
    assert "tiny" not in NAMED_CONFIGS
    cfg = named_config("cornstarch/vlm_m", {"llm.num_layers": 2, "encoders.vision.frozen": False})
    assert cfg.llm.num_layers == 2 and not cfg.encoder("vision").frozen
    with pytest.raises(UserError, match="disttrain/mllm_9b"):
        named_config("disttrain/mllm_7b")
    with pytest.raises(UserError, match="no field"):
        named_config("disttrain/mllm_9b", {"llm.depth": 2})


def test_gin_files_bind_every_name():
    bound = {}
    for path in glob.glob(os.path.join(ROOT, "configs", "*", "*.gin")):
        m = re.search(r'^named_model_config\.name = "([^"]+)"$', open(path).read(), re.M)
        if m and "/" in m.group(1):
            bound[m.group(1)] = path
    assert set(bound) == set(NAMED_CONFIGS)
    for name, path in bound.items():
        fam, short = name.split("/")
        assert path.endswith(f"{fam}/{short}.gin")


def _flax_module_params(cfg):
    """Parameters per module of the abstract (nnx.eval_shape) MultimodalModel."""
    from mmjax.models.mllm import MultimodalModel

    model = nnx.eval_shape(lambda: MultimodalModel(cfg, jax.random.key(0)))
    count = lambda m: sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(m, nnx.Param)))
    got = {"llm": count(model.llm)}
    for e in cfg.encoders:
        got[e.name] = count(model.encoders[e.name])
        got[f"{e.name}.projector"] = count(model.projectors[e.name])
    if cfg.generator is not None:
        got["generator"] = count(model.generator)
    assert sum(got.values()) == count(model)  # nothing outside the modules
    return got


_FAST = {"disttrain/mllm_9b", "orchmllm/mllm_10b", "cornstarch/valm_ss"}  # one per family


@pytest.mark.parametrize("name", [n if n in _FAST else pytest.param(n, marks=pytest.mark.slow)
                                  for n in sorted(NAMED_CONFIGS)])
def test_flax_params_equal_planner_counts(name):
    """The planner's analytic counts (planner/costs.py) are exactly the Flax layout."""
    cfg = named_config(name)
    assert _flax_module_params(cfg) == module_params(cfg)
