"""Named paper-scale configs: sizes within 3% of the papers, registry, gin files."""
import glob
import os
import re

import pytest

from mmjax.models.config import VisionConfig
from mmjax.models.named import NAMED_CONFIGS, named_config
from mmjax.planner.costs import module_params, num_params

B = 1e9
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
# published module sizes (seed 000 §8: ViT-Huge 0.63B, SD-2.1 UNet 0.865B; seed 001 Table 1;
# seed 002 Table 1) and MLLM totals named by the papers
MODULES = {
    "disttrain/mllm_9b": {"vision": 0.632, "generator": 0.865},
    "disttrain/mllm_15b": {"vision": 0.632, "generator": 0.865},
    "disttrain/mllm_72b": {"vision": 0.632, "generator": 0.865, "llm": 70.0},
    "orchmllm/mllm_10b": {"llm": 7.6, "vision": 1.8, "audio": 0.635},
    "orchmllm/mllm_18b": {"llm": 14.8, "vision": 2.8, "audio": 0.635},
    "orchmllm/mllm_84b": {"llm": 72.7, "vision": 5.5, "audio": 5.5},
}
TOTALS = {"disttrain/mllm_9b": 9, "disttrain/mllm_72b": 72, "orchmllm/mllm_10b": 10,
          "orchmllm/mllm_18b": 18, "orchmllm/mllm_84b": 84}
CORNSTARCH_LLM_M = 8.0
CORNSTARCH_ENC = {("vision", "s"): 1.0, ("vision", "m"): 8.0, ("vision", "l"): 18.0,
                  ("audio", "s"): 1.4, ("audio", "m"): 7.0, ("audio", "l"): 15.0}


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


def test_mllm_15b_total():
    """Llama3 vocabulary on the 13B shape gives a 14.0B LLM, so the total is 15.5B: the
    paper rounds it to 15B (3.6% off); the Table-1 shape itself is exact."""
    cfg = named_config("disttrain/mllm_15b")
    assert (cfg.llm.num_layers, cfg.llm.hidden_size, cfg.llm.ffn_size, cfg.llm.num_heads,
            cfg.llm.num_kv_heads) == (40, 5120, 13824, 40, 40)
    assert close(num_params(cfg) / B, 15.0, tol=0.04)


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
    with pytest.raises(ValueError, match="disttrain/mllm_9b"):
        named_config("disttrain/mllm_7b")
    with pytest.raises(ValueError, match="no field"):
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
