"""Both transformers layouts of a vision tower: transformers 4 writes `vision_model.*`
(LLaVA's tower `vision_tower.vision_model.*`), transformers 5 writes the tower unprefixed
(`embeddings.*`; LLaVA's `vision_tower.*`). Each loads to the same module, and an export over
its source keeps the source's names."""
import numpy as np
import pytest
from safetensors.numpy import load_file

import hf_reference as ref
from mmjax.models import hf
from test_pretrained_training import CLIP

SIGLIP = {"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 48,
          "num_hidden_layers": 2, "num_attention_heads": 2, "num_channels": 3,
          "image_size": 16, "patch_size": 4, "hidden_act": "gelu_pytorch_tanh",
          "layer_norm_eps": 1e-6}


@pytest.mark.parametrize("family,config", [("clip", CLIP), ("siglip", SIGLIP)])
@pytest.mark.parametrize("prefix", ["", "vision_tower.", "vision_tower.vision_model."])
def test_tower_layouts_load_alike(tmp_path, family, config, prefix):
    tensors = ref.tower_tensors(family, config, seed=3)
    v4 = ref.write_checkpoint(tmp_path / "v4", config, tensors)
    moved = {prefix + k[len("vision_model."):]: v for k, v in tensors.items()}
    other = ref.write_checkpoint(tmp_path / "other", config, moved)
    pixels = np.random.default_rng(0).normal(size=(2, 3, 16, 16)).astype(np.float32)
    want = hf.hf_forward(hf.load(v4)[0], pixel_values=pixels)["last_hidden_state"]
    module, cfg = hf.load(other)
    got = hf.hf_forward(module, pixel_values=pixels)["last_hidden_state"]
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    exp = ref.vision_tower(tensors, family, config, pixels[0].astype(np.float64))
    np.testing.assert_allclose(np.asarray(got)[0], exp, rtol=1e-4, atol=1e-4)
    hf.export_vit_safetensors(module, cfg, tmp_path / "out", source=other)
    out = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(out) == sorted(moved)
    assert all(out[k].tobytes() == moved[k].tobytes() for k in moved)
