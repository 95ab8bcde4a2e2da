"""The one-line refusals and supported lists name what mmjax reads (issue 42): whole Qwen2-VL
/ Qwen2.5-VL checkpoints among the supported model types and whole-model checkpoints, a
mixture-of-experts config refused by its own model_type (not as "Mixtral")."""
import json
import os

import pytest

from mmjax.models import hf
from mmjax.models.hf.pretrained import pretrained_config
from mmjax.models.tiny import tiny_qwen2_vl

DATA = os.path.join(os.path.dirname(__file__), "data", "qwen2_vl")
MOE = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 10,
       "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
       "intermediate_size": 8, "num_local_experts": 128}


def test_supported_lists_name_qwen2_vl(tmp_path):
    with pytest.raises(ValueError, match=r"model_type='bert'.*supported: .*llava, qwen2_vl, "
                                         r"qwen2_5_vl$"):
        hf.model_type({"model_type": "bert"})
    for family in ("qwen2_vl", "qwen2_5_vl"):
        d = os.path.join(DATA, f"{family}_tf4")
        assert hf.model_type(d) == family
        assert hf.config_for(d) == hf.load(d)[1]
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ValueError, match=r"whole-model checkpoints supported: llava, "
                                         r"qwen2_vl, qwen2_5_vl$"):
        pretrained_config(tiny_qwen2_vl(), {"model": str(tmp_path)})


@pytest.mark.parametrize("load", [hf.model_type, hf.config_from_hf])
def test_moe_refused_by_its_model_type(load):
    with pytest.raises(ValueError, match=r"num_local_experts=128.*mixture-of-experts layers "
                                         r".*are not in mmjax") as e:
        load(MOE)
    assert "Mixtral" not in str(e.value) and "qwen3_moe" in str(e.value)
    assert "\n" not in str(e.value)
